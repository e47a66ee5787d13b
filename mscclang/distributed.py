"""mscclang as a torch.distributed backend: ``import mscclang.distributed`` registers ``"mscclang"``.

After the import, existing torch code runs on mscclang by naming the backend::

    import mscclang.distributed
    torch.distributed.init_process_group("mscclang")

Each rank of a group made with this backend holds one :class:`mscclang.Communicator` over the
group's store. ``all_reduce`` (sum, min, max; avg as NCCL defines it: the sum, then a division
by the rank count, truncated for integer tensors), ``all_gather`` (list and single tensor),
``reduce_scatter`` (list and single tensor), ``all_to_all_single`` and list ``all_to_all`` whose
sizes are equal on every rank, ``broadcast`` (any root) and ``barrier`` run on the Communicator
(which itself falls back to torch.distributed where the library has no plan, and always on a
machine without its GPU runtime). Everything else goes to an inner group of the ordinary backend
(NCCL for CUDA tensors, gloo for CPU tensors; gloo through host copies when ranks share a GPU),
created on the first such call over the same store and logged once per reason (logger
``mscclang.distributed``): ``send``/``recv`` and ``batch_isend_irecv`` (the library's plans are
collective; the inner group's Work is returned at once, so a send never waits for its receiver),
``reduce``, ``gather``, ``scatter``, all-to-alls of unequal sizes (list ``all_to_all`` as one
``all_to_all_single`` with splits, which gloo has), reduce ops other than sum/min/max/avg,
dtypes the Communicator does not run (float64, int64, ...), non-contiguous tensors (gloo gets
contiguous copies: it reads a strided tensor as if it were dense) and tensors on another device
type than the Communicator's.

Agreement before anything runs: every collective's arguments are checked on each rank (list
arguments as gloo checks them: their lengths, and each tensor's shape, dtype and device against
the one it stands beside; ``all_to_all_single`` takes contiguous tensors only; the single-tensor
forms by the Communicator's own check: sizes, dtype, the in-place layout), and the ranks then
compare their calls through the group's store (:class:`~mscclang.comm.fallback.FallbackCalls`),
each rank's refusal travelling with its call, within ``MSCCLANG_TIMEOUT_S``: ranks making
different calls, or a call one rank refused, raise on every rank alike
(:class:`~mscclang.errors.CallMismatch` naming each rank's call, or
:class:`~mscclang.errors.InvalidCall`), and the group stays usable. A call signature (sizes,
dtypes, reduce op, root, list lengths, where an input lies in its output) is agreed once, at its
first call: a repeated call costs one lookup, no store round trip (a rank repeating an agreed
call while another makes a new one is caught by the timeouts instead: CallMismatch on the new
call's rank, the collective's own timeout on the other). All-to-alls with splits
(``all_to_all_single`` with explicit splits, list ``all_to_all``) exchange their splits on every
call: rank i's input split to j must equal rank j's output split from i. Without the GPU runtime
(every call goes to the gloo fallback anyway) every call is agreed, by an all-gather of a digest
on the fallback group and the store only when the digests differ. Point-to-point calls,
``reduce``, ``gather`` and ``scatter`` are not agreed. The single-tensor forms
(``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``) read their tensors by
element count, as NCCL does.

Every operation returns a :class:`MscclangWork`; its ``wait()`` orders the caller's current
stream after the collective and returns True, its ``get_future()`` a completed future of the
output tensors. Errors of the Communicator (``CollectiveTimeout``, ``CallMismatch``,
``InvalidCall``) propagate from the call when ``async_op`` is false and from ``wait()`` (and
``get_future()``, which never returns a failed future: one reaching DDP's reducer from a Python
process group crashes the process) when it is true. ``destroy_process_group()`` closes the Communicator and the inner groups.

The batch-invariant mode (``docs/semantics.md``): ``MSCCLANG_BATCH_INVARIANT=1``, or for one group
``pg_options=BackendOptions(batch_invariant=True)`` (``init_process_group("mscclang", pg_options=...)``
or ``new_group(backend="mscclang", pg_options=...)``; torch hands a registered backend's
``pg_options`` to its creator). The group's Communicator then runs every reduction on a plan that
keeps the contract or raises; a reduction the Communicator cannot take (``reduce``, another reduce
op or dtype, non-contiguous tensors) raises :class:`~mscclang.comm.errors.BatchInvariantError`
instead of going to the inner group. Calls that reduce nothing still go there as above.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
from dataclasses import dataclass
from functools import cache
from fractions import Fraction
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d   # AllgatherOptions is not re-exported by torch.distributed

from mscclang.comm.communicator import Communicator
from mscclang.comm.fallback import FallbackCalls, TorchFallback, call_text, torch_backend_for
from mscclang.config import settings
from mscclang.errors import InvalidCall
from mscclang.plan.dtypes import DTYPES

__all__ = ["BACKEND_NAME", "BackendOptions", "MscclangProcessGroup", "MscclangWork", "create_process_group",
           "register"]

log = logging.getLogger("mscclang.distributed")

#: the name the backend is registered under
BACKEND_NAME = "mscclang"

_REDUCE = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max"}
_REDUCE_BY_CODE = {int(k): v for k, v in _REDUCE.items()}
_NO_TIMEOUT = datetime.timedelta(0)
_P2P = "point-to-point runs on the inner group (the library's plans are collective)"


@dataclass(frozen=True)
class BackendOptions:
    """The options of one ``"mscclang"`` group, passed as ``pg_options`` to
    ``init_process_group("mscclang", ...)`` or ``new_group(backend="mscclang", ...)``:
    ``batch_invariant`` runs the group's Communicator in the batch-invariant mode (None:
    ``MSCCLANG_BATCH_INVARIANT``; see the module docstring)."""

    batch_invariant: Optional[bool] = None


#: the calls of the inner group that reduce (refused in the batch-invariant mode)
_REDUCING = frozenset({"all_reduce", "reduce_scatter", "reduce"})


def _op_type(op: Any) -> Any:
    """The ``RedOpType`` of torch's ``ReduceOp`` object (options hold the object, whose hash is
    not the type's)."""
    return getattr(op, "op", op)


class MscclangWork(dist.Work):
    """The handle of one operation of :class:`MscclangProcessGroup`. The operation has already
    been issued on the caller's stream (CPU: it has completed): ``wait()`` makes the current
    stream wait for it (through ``event``, recorded after an asynchronous CUDA collective) and
    returns True, or raises the operation's error; ``get_future()`` returns a completed future
    holding the output tensors, or raises the error."""

    _error: Optional[BaseException] = None
    _event: Any = None

    def __init__(self, result: list, error: Optional[BaseException] = None, event: Any = None) -> None:
        dist.Work.__init__(self)
        self._result = result
        if error is not None or event is not None:   # a synchronous call's Work sets neither
            self._error, self._event = error, event

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        if self._error is not None:
            raise self._error
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return True

    def get_future(self) -> torch.futures.Future:
        """A completed future of the output tensors; for a failed operation the error is raised
        here instead: a failed future from a Python process group crashes the process (SIGSEGV)
        when it reaches DDP's reducer, which takes every bucket's result through this call."""
        if self._error is not None:
            raise self._error
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error


def _device_for(rank: int) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class MscclangProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on a :class:`mscclang.Communicator`
    (see the module docstring for which run there and which go to the inner group). ``store`` is
    the group's store (torch hands the creator a PrefixStore of the group), ``timeout`` bounds the
    inner groups' collectives; ``device`` is the Communicator's (default: the current CUDA device,
    else the CPU). ``communicator``: an existing Communicator of this rank to run on instead of
    one made over the store (embedding, and the CPU tests on the simulator's back end); the group
    closes it at shutdown. ``batch_invariant``: the Communicator's mode (:class:`BackendOptions`)."""

    def __init__(self, store: Any, rank: int, world_size: int,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=5),  # noqa: B008
                 device: Any = None, communicator: Optional[Communicator] = None,
                 batch_invariant: Optional[bool] = None) -> None:
        super().__init__(rank, world_size)
        self._store, self._timeout = store, timeout
        self._device = torch.device(device) if device is not None else _device_for(rank)
        self._device_type = self._device.type
        self._dtypes = _runnable_dtypes()
        # one torch group per device type: the Communicator's fallback group is the inner group
        # of its device type (made from the store at the first call that needs it)
        self._fallback = None if communicator is not None else TorchFallback(
            store=dist.PrefixStore(f"mscclang/inner/{self._device_type}/", store), rank=rank, world_size=world_size,
            device=self._device, timeout_s=timeout.total_seconds())
        self._comm: Optional[Communicator] = communicator or Communicator(
            store=dist.PrefixStore("mscclang/comm/", store), rank=rank, world_size=world_size,
            device=self._device, runtime_options={"timeout_s": timeout.total_seconds()}, fallback=self._fallback,
            batch_invariant=batch_invariant)
        self._inner: dict[str, Any] = {}
        # the agreement before a call runs (see the module docstring), over the group's store
        self._calls = None if store is None else FallbackCalls(
            dist.PrefixStore("mscclang/agree/", store), rank, world_size, settings.timeout_s, "agreement")
        self._agreed: dict[Any, None] = {}
        self._token: Any = None
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ plumbing
    @property
    def communicator(self) -> Communicator:
        """This rank's Communicator (:class:`~mscclang.errors.CommError` once shut down)."""
        if self._comm is None:
            from mscclang.errors import CommError

            raise CommError(f"rank {self.rank()}: the mscclang process group was destroyed")
        return self._comm

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    # torch's ProcessGroup reads its name from its first registered C++ backend, and this group
    # registers none (it is the backend): the name torch gives it is kept here, so that
    # functional collectives (DTensor, FSDP2, torch.compile) resolve the group by name
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_desc", "undefined")

    def inner_group(self, device_type: str) -> Any:
        """The inner group for tensors of ``device_type`` (NCCL for ``cuda``, gloo otherwise),
        made on first use over the same store; for the Communicator's device type it is the
        Communicator's fallback group. Collective: every rank reaches the same first fallback
        call. When ranks share a GPU (``MSCCLANG_RANKS_PER_GPU`` above 1, functional
        testing on one GPU) NCCL refuses them, so CUDA tensors go to gloo too."""
        pg = self._inner.get(device_type)
        if pg is None and device_type == self._device_type and self._fallback is not None:
            pg = self._inner[device_type] = self._fallback.own_backend   # the Communicator's own
        if pg is None:   # made as the Communicator's own is: one home for torch groups over a store
            pg = self._inner[device_type] = TorchFallback(
                store=dist.PrefixStore(f"mscclang/inner/{device_type}/", self._store), rank=self.rank(),
                world_size=self.size(), device=torch.device(device_type),
                timeout_s=self._timeout.total_seconds()).own_backend
        return pg

    def _agree(self, text: Any, check: Callable[[], Any] = lambda: None, error: str = "", key: Any = None,
               data: bytes = b"") -> list[bytes]:
        """The agreement of one call before it runs (the module docstring's rule): ``text`` (or
        ``text()``) describes the call, ``check()`` checks this rank's arguments, ``error`` is
        this rank's refusal (a check's InvalidCall too), which travels with the text. The call's
        signature, ``key`` (default: ``text``), is agreed once where the Communicator has its
        runtime; a call with ``data`` on every call. Raises on every rank alike; returns every
        rank's ``data`` when it was exchanged through the store."""
        key = text if key is None else key
        if not data and key in self._agreed:
            return []
        try:
            check()
        except InvalidCall as e:
            error = str(e)
        if self._calls is None and error:   # an embedded Communicator without a store: this rank's check alone
            raise InvalidCall(error)
        # without the runtime every call goes to the gloo fallback anyway: agreed each time, on its group
        every = self.communicator.backend is None and getattr(self._fallback, "backend_name", "") == "gloo"
        datas = [] if self._calls is None else self._calls.agree(text() if callable(text) else text, error,
                                                                 self._fallback if every else None, data)
        if not (data or every):
            if len(self._agreed) >= 1024:
                self._agreed.clear()
            self._agreed[key] = None
        return datas

    def _lean(self, coll: str, inp: Any, out: Any, op: str = "") -> bool:
        """Whether a single-tensor call runs on the Communicator as it is (:meth:`_runs`), after
        its :meth:`_agree`, once per signature (sizes, dtype, reduce op and, where the tensors
        overlap, the input's offset in the output), checked by the Communicator's own check of a
        call (sizes, dtype, the in-place layout)."""
        if out is inp:   # in place (all_reduce, broadcast): the short key
            if not self._runs(inp):
                return False
            key: tuple = (coll, inp.numel(), inp.dtype, op)
        else:
            if not (self._runs(inp) and self._runs(out)):
                return False
            n, gap = inp.numel(), inp.data_ptr() - out.data_ptr()
            key = (coll, n, out.numel(), inp.dtype, op, gap and (gap if -n * inp.element_size() < gap < out.nbytes else None))
        if key not in self._agreed:   # the hot path's whole cost: one tuple, one lookup
            self._agree(lambda: f"{call_text(coll, inp, out)} {op}".rstrip(),   # op: a reduction's only
                        lambda: self.communicator.planner.make_call(coll, _flat(inp), _flat(out), op or "sum"), key=key)
        return True

    def _check_list(self, what: str, name: str, items: list, count: int, per: str, like: Any = None) -> None:
        """A list argument holds ``count`` items (one per ``per``) and, with ``like``, each is a
        tensor of ``like``'s shape, dtype and device (gloo's rule for list arguments, which it
        checks on some ranks only: a rank that passed would wait in the collective the others
        refused); InvalidCall naming the argument and what is wrong, alike on every rank."""
        if len(items) != count:
            raise InvalidCall(f"rank {self.rank()}: {what}: {name} has {len(items)} item(s); expected {count} "
                              f"(one per {per[:-1]})")
        for i, t in enumerate(items if like is not None else ()):
            if not isinstance(t, torch.Tensor) or (t.shape, t.dtype, t.device) != (like.shape, like.dtype, like.device):
                raise InvalidCall(f"rank {self.rank()}: {what}: {name}[{i}] is {_shows(t)}; expected {_shows(like)}")

    def _fallback_reason(self, tensors: list, op: Any = None) -> Optional[str]:
        """Why these tensors (and reduce op) cannot run on the Communicator, or None."""
        for t in tensors:
            if t.dtype not in _runnable_dtypes():
                return f"dtype {t.dtype}"
            if t.device.type != self._device_type:
                return f"{t.device.type} tensors (the communicator runs on {self._device_type})"
            if not t.is_contiguous():
                return "non-contiguous tensors"
        if op is not None and op not in _REDUCE:
            return f"reduce op {op}"
        return None

    def _to_inner(self, what: str, reason: str, tensors: list, call: Callable[[Any], Any], agree: Any = None) -> Any:
        """``call`` on the inner group of the tensors' device type; with ``agree`` (the call's
        reduce op or root, "" for none) after the agreement of the call's tensors' shapes and
        dtypes, once per signature."""
        comm = self.communicator   # CommError once destroyed (a new inner group would be made otherwise)
        if comm.batch_invariant and what in _REDUCING:
            from mscclang.comm.invariant import call_words, refusal

            t = tensors[0]
            dtype = str(t.dtype).replace("torch.", "")
            raise refusal(call_words(what, self.size(), t.numel() * t.element_size(), dtype),
                          f"it would go to the inner {torch_backend_for(t.device.type)} group ({reason})", self.rank())
        if agree is not None:
            self._agree(f"{what} of {', '.join(map(_shows, tensors))}{agree} on the inner group ({reason})")
        key, dev = f"{what}: {reason}", tensors[0].device.type if tensors else self._device_type
        if key not in self._logged:
            self._logged.add(key)
            log.warning("mscclang rank %d: %s goes to the inner %s group: %s", self.rank(), what, torch_backend_for(dev),
                        reason)
        return call(self.inner_group(dev))

    def _run(self, opts: Any, result: list, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MscclangWork:
        """Run ``fn(*args, **kwargs)`` now (no closure per call); a failure raises here for a
        synchronous call, else from wait(). An asynchronous CUDA call records an event after the
        collective (its ``wait()`` may come on another stream); a synchronous one records
        nothing: torch waits for it at once on the stream the collective was issued on, so the
        order already holds (and a captured graph gets no event node)."""
        if not getattr(opts, "asyncOp", True):
            fn(*args, **kwargs)
            return MscclangWork(result)
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - handed to the caller through the Work
            return MscclangWork(result, e)
        event = None
        if self._device_type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        return MscclangWork(result, None, event)

    # ------------------------------------------------------------------ all-reduce
    def _runs(self, t: Any) -> bool:
        """Whether ``t`` runs on the Communicator as it is (the fast path's whole check)."""
        return (t.dtype in self._dtypes and t.is_contiguous()
                and (t.is_cuda if self._device_type == "cuda" else t.device.type == self._device_type))

    def allreduce(self, tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        rop = opts.reduceOp
        # the common case first: ReduceOp's own comparison with SUM, without unwrapping its type
        name = "sum" if rop == dist.ReduceOp.SUM else _REDUCE_BY_CODE.get(int(_op_type(rop)))
        if name is not None and len(tensors) == 1 and self._lean("allreduce", tensors[0], tensors[0], name):
            return self._run(opts, tensors, self.communicator.all_reduce, _flat(tensors[0]), name)
        op = _op_type(rop)
        if op == dist.ReduceOp.AVG:
            return self._averaged(opts, tensors, dist.AllreduceOptions(), lambda o: self.allreduce(tensors, o))
        reason = self._fallback_reason(tensors, op) or "several tensors"
        return self._to_inner("all_reduce", reason, tensors, lambda g: g.allreduce(tensors, opts), f" {op}")

    def _averaged(self, opts: Any, result: list, sum_opts: Any, run: Callable[[Any], Any]) -> MscclangWork:
        """AVG as NCCL defines it: the sum (``run(sum_opts)``, synchronous), then the division of
        ``result`` by the rank count (of integer tensors: truncated, as NCCL's integer division)."""
        sum_opts.reduceOp = dist.ReduceOp.SUM

        def body() -> None:
            run(sum_opts).wait()
            for t in result:
                t.div_(self.size(), rounding_mode=None if t.is_floating_point() else "trunc")
        return self._run(opts, result, body)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> Any:
        kinds = sorted({f"{t.dtype} on {t.device}" for t in tensors})
        self._agree(f"all_reduce_coalesced of {len(tensors)} tensor(s)", error="" if len(kinds) < 2 else   # gloo's rule
                    f"rank {self.rank()}: all_reduce_coalesced: the tensors must have one dtype and device, got {kinds}")
        works = [self.allreduce([t], _allreduce_opts(opts)) for t in tensors]
        return _last(works, tensors)

    # ------------------------------------------------------------------ all-gather
    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        """Gather every rank's ``input`` into ``output`` (torch >= 2.13's name)."""
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if self._lean("allgather", input, output):
            return self._run(opts, [output], self.communicator.all_gather, _flat(input), out=_flat(output))
        return self._to_inner("all_gather", self._fallback_reason([output, input]) or "", [output, input],
                              lambda g: g._allgather_base(_flat(output), _flat(input), opts), "")

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        return self.all_gather_single(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        self._agree(f"all_gather_into_tensor_coalesced of {len(inputs)} into {len(outputs)}",
                    lambda: self._check_list("all_gather_into_tensor_coalesced", "outputs", outputs, len(inputs), "inputs"))
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last(works, outputs)

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else _c10d.AllgatherOptions()

        def check() -> None:
            self._check_list("all_gather", "output_lists", output_lists, len(inputs), "inputs")
            for i, (lst, inp) in enumerate(zip(output_lists, inputs)):
                self._check_list("all_gather", f"output_lists[{i}]", lst, len(inputs) * self.size(), "ranks", like=inp)
        self._agree(f"all_gather of {', '.join(map(_shows, inputs))} into lists of {list(map(len, output_lists))}", check)
        outs = [t for lst in output_lists for t in lst]
        reason = self._fallback_reason(outs + list(inputs)) or (None if len(inputs) == 1 else "several tensors")
        if reason:
            return self._to_inner("all_gather", reason, outs + list(inputs),
                                  lambda g: g.allgather(output_lists, inputs, opts))
        inp = inputs[0]

        def body() -> None:
            flat = self.communicator.all_gather(inp.reshape(-1))
            for r, o in enumerate(output_lists[0]):
                o.view(-1).copy_(flat[r * inp.numel():(r + 1) * inp.numel()])
        return self._run(opts, output_lists[0], body)

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        """Reduce ``input`` over the ranks and keep this rank's block in ``output`` (torch >=
        2.13's name)."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = _op_type(opts.reduceOp)
        if op == dist.ReduceOp.AVG:
            return self._averaged(opts, [output], dist.ReduceScatterOptions(),
                                  lambda o: self.reduce_scatter_single(output, input, o))
        name = _REDUCE_BY_CODE.get(int(op))
        if name is not None and self._lean("reducescatter", input, output, name):
            return self._run(opts, [output], self.communicator.reduce_scatter, _flat(input), name, out=_flat(output))
        return self._to_inner("reduce_scatter", self._fallback_reason([output, input], op) or "", [output, input],
                              lambda g: g._reduce_scatter_base(_flat(output), _flat(input), opts), f" {op}")

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        self._agree(f"reduce_scatter_tensor_coalesced of {len(inputs)} into {len(outputs)}",
                    lambda: self._check_list("reduce_scatter_tensor_coalesced", "outputs", outputs, len(inputs), "inputs"))
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last(works, outputs)

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if _op_type(opts.reduceOp) == dist.ReduceOp.AVG:
            return self._averaged(opts, list(outputs), dist.ReduceScatterOptions(),
                                  lambda o: self.reduce_scatter(outputs, input_lists, o))

        def check() -> None:
            self._check_list("reduce_scatter", "input_lists", input_lists, len(outputs), "outputs")
            for i, (out, lst) in enumerate(zip(outputs, input_lists)):
                self._check_list("reduce_scatter", f"input_lists[{i}]", lst, self.size(), "ranks", like=out)
        self._agree(f"reduce_scatter of lists of {list(map(len, input_lists))} into {', '.join(map(_shows, outputs))} "
                    f"{_op_type(opts.reduceOp)}", check)
        ins = [t for lst in input_lists for t in lst]
        reason = (self._fallback_reason(list(outputs) + ins, _op_type(opts.reduceOp))
                  or (None if len(outputs) == 1 else "several tensors"))
        if reason:
            return self._to_inner("reduce_scatter", reason, list(outputs) + ins,
                                  lambda g: g.reduce_scatter(outputs, input_lists, opts))
        flat = torch.cat([t.reshape(-1) for t in input_lists[0]])
        return self.reduce_scatter_single(outputs[0], flat, opts)

    # ------------------------------------------------------------------ all-to-all
    def all_to_all_single(self, output: Any, input: Any, output_splits: list, input_splits: list,  # noqa: A002
                          opts: Any = None) -> Any:
        """Block ``j`` of this rank's ``input`` to block ``r`` of rank ``j``'s ``output``. Equal
        blocks (no splits) are agreed once per signature; splits (rows of the tensors) on every
        call, and run on the Communicator when every rank's are equal,
        else on the inner group."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        if not (output_splits or input_splits) and self._lean("alltoall", input, output):
            return self._run(opts, [output], self.communicator.all_to_all, _flat(input), out=_flat(output))
        n = self.size()
        ins, outs = (list(splits) or [t.size(0) // n] * n for t, splits in ((input, input_splits), (output, output_splits)))

        def check() -> None:
            if not (output.is_contiguous() and input.is_contiguous()):   # gloo's and NCCL's rule
                raise InvalidCall(f"rank {self.rank()}: all_to_all_single: the tensors must be contiguous")
            for name, t, splits in (("output", output, outs), ("input", input, ins)):
                if len(splits) != n or sum(splits) != t.size(0):
                    raise InvalidCall(f"rank {self.rank()}: all_to_all_single: {name} splits {splits} are not {n} "
                                      f"sizes summing to the {name}'s {t.size(0)} rows")
        # the splits are exchanged on every call: rank i's input split to j must equal rank j's output split from i
        every = [json.loads(d) for d in self._agree(f"all_to_all_single of {input.dtype} rows of {tuple(input.shape[1:])}",
                                                    check, data=json.dumps([ins, outs]).encode())]
        bad = [f"rank {i} sends {a[j]} row(s) to rank {j}, which expects {every[j][1][i]}"
               for i, (a, _) in enumerate(every) for j in range(n) if a[j] != every[j][1][i]]
        if bad:
            raise InvalidCall(f"rank {self.rank()}: all_to_all_single: the ranks' splits disagree: {'; '.join(bad[:4])}")
        reason = self._fallback_reason([output, input])
        if every and len({x for r in every for side in r for x in side}) == 1 and not reason:   # equal everywhere
            return self._run(opts, [output], self.communicator.all_to_all, input.reshape(-1), out=output.view(-1))
        words = None if reason else _as_words(input, output, [x for r in every for side in r for x in side])
        if words is not None:   # uneven splits: the all-to-all-v plans, the splits copied to the device
            x, out, scale = words
            counts, expect = (torch.tensor([int(k * scale) for k in ks], dtype=torch.int32, device=self._device)
                              for ks in (ins, outs))
            if every:   # the splits agreed through the store: the largest output of any rank sizes the scratch
                cap = int(max(sum(r[1]) for r in every) * scale)
                return self._run(opts, [output], self.communicator.all_to_all_v, x, counts, out=out, capacity=cap)
            # no store: the counts agreed on the device; the exchanged counts read once size the call
            return self._run(opts, [output], lambda: out.copy_(self.communicator.all_to_all_v(
                x, counts, expect_counts=expect)[0]))
        o, i = (output, input) if output_splits or input_splits else (_flat(output), _flat(input))
        return self._to_inner("all_to_all", reason or "splits that are not whole 4-byte words", [output, input],
                              lambda g: g.alltoall_base(o, i, output_splits, input_splits, opts))

    def alltoall_base(self, output: Any, input: Any, output_splits: list, input_splits: list,  # noqa: A002
                      opts: Any = None) -> Any:
        return self.all_to_all_single(output, input, output_splits, input_splits, opts)

    # ------------------------------------------------------------------ broadcast, barrier, p2p
    def broadcast(self, tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BroadcastOptions()
        self._agree(f"broadcast of {', '.join(map(_shows, tensors))} from rank {opts.rootRank}",
                    error="" if 0 <= opts.rootTensor < len(tensors) else f"rank {self.rank()}: broadcast: root tensor "
                    f"index {opts.rootTensor} is not an index of the {len(tensors)} tensor(s)")
        reason = self._fallback_reason(tensors) or (None if len(tensors) == 1 else "several tensors")
        if reason:
            return self._to_inner("broadcast", reason, tensors, lambda g: g.broadcast(tensors, opts))
        return self._run(opts, tensors, self.communicator.broadcast, tensors[0].view(-1), root=opts.rootRank)

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BarrierOptions()
        if self._token is None:   # one token for every barrier: a barrier allocates nothing
            self._token = torch.zeros(1, dtype=torch.float32, device=self._device)
        return self._run(opts, [], self.communicator.all_reduce, self._token, "sum")

    # point-to-point: the library's plans are collective, so a lone send or receive runs on the
    # inner group, returning its Work at once: a send never waits for its receiver (every rank
    # of a batch_isend_irecv ring posts its send first)
    def send(self, tensors: list, dst: int, tag: int = 0) -> Any:
        self._check_peer(dst)
        return self._to_inner("send", _P2P, tensors, lambda g: g.send(tensors, dst, tag))

    def recv(self, tensors: list, src: int, tag: int = 0) -> Any:
        self._check_peer(src)
        return self._to_inner("recv", _P2P, tensors, lambda g: g.recv(tensors, src, tag))

    def _check_peer(self, peer: int) -> None:
        if not 0 <= int(peer) < self.size() or int(peer) == self.rank():
            raise InvalidCall(f"rank {self.rank()}: peer {peer} is not another rank of this group of {self.size()}")

    # ------------------------------------------------------------------ the inner group's
    def reduce(self, tensors: list, opts: Any = None) -> Any:
        return self._to_inner("reduce", "no mscclang reduce", tensors, lambda g: g.reduce(tensors, opts))

    def gather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        return self._to_inner("gather", "no mscclang gather", list(inputs), lambda g: g.gather(output_lists, inputs, opts))

    def scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        return self._to_inner("scatter", "no mscclang scatter", list(outputs), lambda g: g.scatter(outputs, input_lists, opts))

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        """List all-to-all: ``inputs[j]`` to rank ``j``'s ``outputs[r]``, as one
        :meth:`all_to_all_single` of the lists' tensors with their sizes as splits (gloo has no
        list all-to-all; equal sizes everywhere run on the Communicator)."""
        sizes = [t.numel() for t in outputs]
        out = torch.empty(sum(sizes), dtype=inputs[0].dtype, device=inputs[0].device)

        def body() -> None:
            flat = torch.cat([t.reshape(-1) for t in inputs])
            self.all_to_all_single(out, flat, sizes, [t.numel() for t in inputs], dist.AllToAllOptions()).wait()
            for t, part in zip(outputs, out.split(sizes)):
                t.copy_(part.view(t.shape))
        return self._run(opts if opts is not None else dist.AllToAllOptions(), list(outputs), body)

    def allgather_coalesced(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        return self._to_inner("all_gather_coalesced", "no mscclang coalesced all_gather", list(inputs),
                              lambda g: g.allgather_coalesced(output_lists, inputs, opts))

    def recv_anysource(self, tensors: list, tag: int = 0) -> Any:
        return self._to_inner("recv", "receive from any source", tensors, lambda g: g.recv_anysource(tensors, tag))

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Release the Communicator and the inner groups (``destroy_process_group`` calls it).
        Idempotent."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()
        inner, self._inner = self._inner, {}
        for pg in inner.values():
            try:
                pg.shutdown()
            except Exception as e:  # noqa: BLE001 - shutdown must return; say what was left behind
                log.warning("mscclang rank %d: shutting down an inner group: %s: %s", self.rank(),
                            type(e).__name__, e)

    def abort(self) -> None:
        """Like :meth:`shutdown` (the Communicator's close never blocks on a peer)."""
        self.shutdown()


def _shows(t: Any) -> str:
    """A tensor argument as an error message names it: shape, dtype, device."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}, not a tensor"
    return f"a tensor of shape {tuple(t.shape)}, {t.dtype}, on {t.device}"


def _as_words(x: Any, out: Any, splits: list) -> Optional[tuple[Any, Any, Fraction]]:
    """``x`` and ``out`` as the rows :meth:`Communicator.all_to_all_v` moves, with its rows per
    split row: their own rows when a row is whole 4-byte words, else (rows of 1 or 2 bytes) 4-byte
    words when every split is whole words; None when neither is."""
    row = math.prod(x.shape[1:]) * x.element_size()
    if row % 4 == 0:
        return x, out, Fraction(1)
    if any(k * row % 4 for k in splits):
        return None
    return (x.reshape(-1).view(torch.uint8).view(torch.int32), out.reshape(-1).view(torch.uint8).view(torch.int32),
            Fraction(row, 4))


def _flat(t: Any) -> Any:
    """``t`` as one dimension (itself when it already is: no view made per call; and when it is
    not contiguous, which a flat copy would not write back to). The single-tensor forms read
    their tensors by element count, as NCCL does (gloo refuses an all-gather output stacked by
    rank unless it is flat)."""
    return t if t.dim() == 1 or not t.is_contiguous() else t.view(-1)


@cache
def _runnable_dtypes() -> frozenset:
    """The torch dtypes the Communicator runs (the dtype table's GPU ones), computed once."""
    return frozenset(d.torch for d in DTYPES if d.gpu)


def _allreduce_opts(opts: Any) -> Any:
    one = dist.AllreduceOptions()
    if opts is not None:
        one.reduceOp = opts.reduceOp
        if hasattr(opts, "asyncOp"):
            one.asyncOp = opts.asyncOp
    return one


def _last(works: list, result: list) -> Any:
    """One Work for several: wait for all, the future of ``result``."""
    if len(works) == 1:
        return works[0]
    try:
        for w in works:
            w.wait()
    except Exception as e:  # noqa: BLE001 - handed to the caller through the Work
        return MscclangWork(list(result), e)
    return MscclangWork(list(result))


def create_process_group(opts: Any, pg_options: Optional[BackendOptions] = None) -> MscclangProcessGroup:
    """The creator torch calls for ``init_process_group("mscclang")`` and ``new_group(backend=
    "mscclang")`` (registered with torch's extended API): a :class:`MscclangProcessGroup` over
    ``opts.store`` (already the group's PrefixStore), ``opts.group_rank``, ``opts.group_size`` and
    ``opts.timeout``, with the caller's ``pg_options`` (a :class:`BackendOptions`, or None);
    InvalidCall for options of another kind."""
    if pg_options is not None and not isinstance(pg_options, BackendOptions):
        raise InvalidCall(f"pg_options of the mscclang backend must be mscclang.distributed.BackendOptions, "
                          f"got {type(pg_options).__name__}")
    return MscclangProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                                batch_invariant=pg_options.batch_invariant if pg_options is not None else None)


def register() -> None:
    """Register the ``"mscclang"`` backend with torch.distributed for CPU and CUDA tensors.
    Idempotent (``import mscclang.distributed`` calls it)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cuda", "cpu"])


register()
