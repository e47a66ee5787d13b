"""mscclang as a torch.distributed backend: ``import mscclang.distributed`` registers ``"mscclang"``.

After the import, existing torch code runs on mscclang by naming the backend::

    import mscclang.distributed
    torch.distributed.init_process_group("mscclang")

Each rank of a group made with this backend holds one :class:`mscclang.Communicator` over the
group's store. ``all_reduce`` (sum, min, max; avg as a sum then a division), ``all_gather`` (list
and single tensor), ``reduce_scatter`` (list and single tensor), ``all_to_all_single`` without
explicit splits, ``broadcast`` (any root) and ``barrier`` run on the Communicator (which itself
falls back to torch.distributed where the library has no plan, and always on a machine without
its GPU runtime). Everything else goes to an inner group of the ordinary backend (NCCL for CUDA
tensors, gloo for CPU tensors; gloo through host copies when ranks share a GPU), created on the
first such call over the same store and logged once per reason (logger
``mscclang.distributed``): ``send``/``recv`` and ``batch_isend_irecv`` (the library's plans are
collective; the inner group's Work is returned at once, so a send never waits for its
receiver), ``reduce``, ``gather``, ``scatter``, list ``all_to_all``, explicit all-to-all splits,
reduce ops other than sum/min/max/avg, dtypes the Communicator does not run (float64, int64,
...), non-contiguous tensors (gloo gets contiguous copies: it reads a strided tensor as if it
were dense) and tensors on another device type than the Communicator's.

List arguments are checked as gloo checks them, on every rank alike and before anything runs
(gloo checks some on some ranks only, leaving the others waiting): their lengths, and each
tensor's shape, dtype and device against the one it stands beside; ``all_to_all_single`` takes
contiguous tensors only (gloo's and NCCL's rule). The single-tensor forms (``all_gather_single``,
``reduce_scatter_single``, ``all_to_all_single``) read their tensors by element count, as NCCL
does. A bad argument raises :class:`~mscclang.errors.InvalidCall` naming it.

Every operation returns a :class:`MscclangWork`; its ``wait()`` orders the caller's current
stream after the collective and returns True, its ``get_future()`` a completed future of the
output tensors. Errors of the Communicator (``CollectiveTimeout``, ``CallMismatch``,
``InvalidCall``) propagate from the call when ``async_op`` is false and from ``wait()`` (and
``get_future()``, which never returns a failed future: one reaching DDP's reducer from a Python
process group crashes the process) when it is true. ``destroy_process_group()`` closes the Communicator and the inner groups.
"""

from __future__ import annotations

import datetime
import json
import logging
from functools import cache
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d   # AllgatherOptions is not re-exported by torch.distributed

from mscclang.comm.communicator import Communicator
from mscclang.comm.fallback import FallbackCalls, HostStaged, TorchFallback, torch_backend_for
from mscclang.config import settings
from mscclang.errors import InvalidCall
from mscclang.plan.call import overlap
from mscclang.plan.dtypes import DTYPES

__all__ = ["BACKEND_NAME", "MscclangProcessGroup", "MscclangWork", "create_process_group", "register"]

log = logging.getLogger("mscclang.distributed")

#: the name the backend is registered under
BACKEND_NAME = "mscclang"

_REDUCE = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max"}
_REDUCE_BY_CODE = {int(k): v for k, v in _REDUCE.items()}
_NO_TIMEOUT = datetime.timedelta(0)
_P2P = "point-to-point runs on the inner group (the library's plans are collective)"


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

    def __init__(self, result: list, error: Optional[BaseException] = None, event: Any = None) -> None:
        super().__init__()
        self._result = result
        self._error = error
        self._event = event

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
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MscclangProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on a :class:`mscclang.Communicator`
    (see the module docstring for which run there and which go to the inner group). ``store`` is
    the group's store (torch hands the creator a PrefixStore of the group), ``timeout`` bounds the
    inner groups' collectives; ``device`` is the Communicator's (default: the current CUDA device,
    else the CPU). ``communicator``: an existing Communicator of this rank to run on instead of
    one made over the store (embedding, and the CPU tests on the simulator's back end); the group
    closes it at shutdown."""

    def __init__(self, store: Any, rank: int, world_size: int,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=5),  # noqa: B008
                 device: Any = None, communicator: Optional[Communicator] = None) -> None:
        super().__init__(rank, world_size)
        self._store = store
        self._timeout = timeout
        self._device = torch.device(device) if device is not None else _device_for(rank)
        self._device_type = self._device.type
        # one torch group per device type: the Communicator's fallback group is the inner group
        # of its device type (made from the store at the first call that needs it)
        self._fallback = None if communicator is not None else TorchFallback(
            store=dist.PrefixStore(f"mscclang/inner/{self._device_type}/", store), rank=rank, world_size=world_size,
            device=self._device, timeout_s=timeout.total_seconds())
        self._comm: Optional[Communicator] = communicator or Communicator(
            store=dist.PrefixStore("mscclang/comm/", store), rank=rank, world_size=world_size,
            device=self._device, runtime_options={"timeout_s": timeout.total_seconds()}, fallback=self._fallback)
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
        if pg is None:
            prefix = dist.PrefixStore(f"mscclang/inner/{device_type}/", self._store)
            if torch_backend_for(device_type) == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self._timeout
                pg = dist.ProcessGroupNCCL(prefix, self.rank(), self.size(), opts)
            else:
                pg = HostStaged(dist.ProcessGroupGloo(prefix, self.rank(), self.size(), self._timeout))
            self._inner[device_type] = pg
        return pg

    def _agree(self, key: Any, what: str, call: Callable[[], str], data: bytes = b"") -> list[bytes]:
        """The agreement of one call before it runs (the module docstring's rule): ``call()``
        checks this rank's arguments and describes the call (InvalidCall: this rank refuses it,
        and the refusal travels with ``what``); ``key`` (None: every call) is the call's
        signature, agreed once where the Communicator has its runtime. Raises on every rank
        alike; returns every rank's ``data`` when it was exchanged."""
        if key is not None and key in self._agreed:
            return []
        try:
            text, error = call(), ""
        except InvalidCall as e:
            text, error = what, str(e)
        if self._calls is None:   # an embedded Communicator without a store: this rank's check alone
            if error:
                raise InvalidCall(error)
            datas: list[bytes] = []
        else:
            every = self.communicator.backend is None   # each call goes to the gloo fallback anyway
            datas = self._calls.agree(text, error, self._fallback if every else None, data, "torch.distributed backend")
            if every:
                return datas
        if key is not None:
            if len(self._agreed) >= 1024:
                self._agreed.pop(next(iter(self._agreed)))
            self._agreed[key] = None
        return datas

    def _agree_tensors(self, coll: str, inp: Any, out: Any, op: str = "sum") -> None:
        """:meth:`_agree` of a single-tensor call on the Communicator, once per signature (the
        sizes, dtype, reduce op and, where the tensors overlap, the input's offset in the output):
        the Communicator's own check of the call (sizes, dtype, the in-place layout)."""
        n, gap = inp.numel(), inp.data_ptr() - out.data_ptr()
        key = (coll, n, out.numel(), inp.dtype, op, gap if -n * inp.element_size() < gap < out.nbytes else None)
        if key in self._agreed:   # the hot path's whole cost: one tuple, one lookup
            return

        def call() -> str:
            c = self.communicator.planner.make_call(coll, _flat(inp), _flat(out), op)
            return f"{c.describe()}{f' {c.op}' if c.collective.reduces else ''}"
        self._agree(key, coll, call)

    def _agree_splits(self, what: str, inp: Any, ins: list, outs: list, check: Callable[[], None]) -> Optional[list]:
        """:meth:`_agree` of an all-to-all with splits (``ins``/``outs``: element counts by
        rank), every call: the splits are exchanged and rank i's input split to j must equal
        rank j's output split from i (InvalidCall on every rank naming each that does not).
        Every rank's ``[ins, outs]``, or None when nothing was exchanged."""
        def call() -> str:
            check()
            return f"{what} of {getattr(inp, 'dtype', None)} with splits"
        datas = self._agree(None, what, call, json.dumps([ins, outs]).encode())
        if not datas:
            return None
        every = [json.loads(d) for d in datas]
        bad = [f"rank {i} sends {every[i][0][j]} element(s) to rank {j}, which expects {every[j][1][i]}"
               for i in range(self.size()) for j in range(self.size()) if every[i][0][j] != every[j][1][i]]
        if bad:
            raise InvalidCall(f"rank {self.rank()}: {what}: the ranks' splits disagree: {'; '.join(bad[:4])}")
        return every

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
        runnable = _runnable_dtypes()
        for t in tensors:
            if t.dtype not in runnable:
                return f"dtype {t.dtype}"
            if t.device.type != self._device_type:
                return f"{t.device.type} tensors (the communicator runs on {self._device_type})"
            if not t.is_contiguous():
                return "non-contiguous tensors"
        if op is not None and op not in _REDUCE:
            return f"reduce op {op}"
        return None

    def _to_inner(self, what: str, reason: str, tensors: list, call: Callable[[Any], Any],
                  agree: Optional[str] = None) -> Any:
        """``call`` on the inner group of the tensors' device type; with ``agree`` (the call's
        reduce op or root, "" for none) after the agreement of the call's tensors' shapes and
        dtypes, once per signature."""
        self.communicator   # noqa: B018 - CommError once destroyed (a new inner group would be made otherwise)
        if agree is not None:
            sig = _signature(tensors)
            self._agree((what, reason, sig, agree), what, lambda: f"{what} of {sig}{agree} on the inner group ({reason})")
        key = f"{what}: {reason}"
        if key not in self._logged:
            self._logged.add(key)
            log.warning("mscclang rank %d: %s goes to the inner %s group: %s", self.rank(), what,
                        torch_backend_for(tensors[0].device.type if tensors else self._device_type), reason)
        dev = tensors[0].device.type if tensors else self._device_type
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
        return (t.dtype in _runnable_dtypes() and t.is_contiguous()
                and (t.is_cuda if self._device_type == "cuda" else t.device.type == self._device_type))

    def allreduce(self, tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = _op_type(opts.reduceOp)
        if op == dist.ReduceOp.AVG:
            return self._averaged(opts, tensors, dist.AllreduceOptions(), lambda o: self.allreduce(tensors, o))
        name = _REDUCE_BY_CODE.get(int(op))
        if name is not None and len(tensors) == 1 and self._runs(tensors[0]):   # the lean path
            t = tensors[0]
            self._agree_tensors("allreduce", t, t, name)
            return self._run(opts, tensors, self.communicator.all_reduce, t if t.dim() == 1 else t.view(-1), name)
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
        def check() -> str:
            if len({(t.dtype, t.device) for t in tensors}) > 1:   # gloo's and NCCL's rule
                raise InvalidCall(f"rank {self.rank()}: all_reduce_coalesced: the tensors must have one dtype and "
                                  f"device, got {sorted({f'{t.dtype} on {t.device}' for t in tensors})}")
            return f"all_reduce_coalesced of {len(tensors)} tensor(s)"
        self._agree(("allreduce_coalesced", len(tensors)), "all_reduce_coalesced", check)
        works = [self.allreduce([t], _allreduce_opts(opts)) for t in tensors]
        return _last(works, tensors)

    # ------------------------------------------------------------------ all-gather
    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        """Gather every rank's ``input`` into ``output`` (torch >= 2.13's name)."""
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if self._runs(output) and self._runs(input):   # the lean path
            self._agree_tensors("allgather", input, output)
            return self._run(opts, [output], self.communicator.all_gather, _flat(input), out=_flat(output))
        return self._to_inner("all_gather", self._fallback_reason([output, input]) or "", [output, input],
                              lambda g: g._allgather_base(_flat(output), _flat(input), opts), "")

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        return self.all_gather_single(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        self._agree(("allgather_coalesced", len(outputs), len(inputs)), "all_gather_into_tensor_coalesced",
                    lambda: self._check_list("all_gather_into_tensor_coalesced", "outputs", outputs, len(inputs), "inputs"))
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last(works, outputs)

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else _c10d.AllgatherOptions()

        def check() -> str:
            self._check_list("all_gather", "output_lists", output_lists, len(inputs), "inputs")
            for i, (lst, inp) in enumerate(zip(output_lists, inputs)):
                self._check_list("all_gather", f"output_lists[{i}]", lst, len(inputs) * self.size(), "ranks", like=inp)
            return f"all_gather of {_signature(inputs)} into lists of {[len(lst) for lst in output_lists]}"
        self._agree(("allgather_list", _signature(inputs), tuple(len(lst) for lst in output_lists)), "all_gather", check)
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
        if name is not None and self._runs(output) and self._runs(input):   # the lean path
            self._agree_tensors("reducescatter", input, output, name)
            return self._run(opts, [output], self.communicator.reduce_scatter, _flat(input), name, out=_flat(output))
        return self._to_inner("reduce_scatter", self._fallback_reason([output, input], op) or "", [output, input],
                              lambda g: g._reduce_scatter_base(_flat(output), _flat(input), opts), f" {op}")

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        self._agree(("reduce_scatter_coalesced", len(outputs), len(inputs)), "reduce_scatter_tensor_coalesced",
                    lambda: self._check_list("reduce_scatter_tensor_coalesced", "outputs", outputs, len(inputs), "inputs"))
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last(works, outputs)

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if _op_type(opts.reduceOp) == dist.ReduceOp.AVG:
            return self._averaged(opts, list(outputs), dist.ReduceScatterOptions(),
                                  lambda o: self.reduce_scatter(outputs, input_lists, o))

        def check() -> str:
            self._check_list("reduce_scatter", "input_lists", input_lists, len(outputs), "outputs")
            for i, (out, lst) in enumerate(zip(outputs, input_lists)):
                self._check_list("reduce_scatter", f"input_lists[{i}]", lst, self.size(), "ranks", like=out)
            return (f"reduce_scatter of lists of {[len(lst) for lst in input_lists]} into {_signature(outputs)} "
                    f"{_op_type(opts.reduceOp)}")
        self._agree(("reduce_scatter_list", _signature(outputs), tuple(len(lst) for lst in input_lists),
                     int(_op_type(opts.reduceOp))), "reduce_scatter", check)
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
        """Block ``j`` of this rank's ``input`` to block ``r`` of rank ``j``'s ``output``. Explicit
        splits are agreed on every call (:meth:`_agree_splits`); they run on the Communicator
        when every rank's are equal, else on the inner group."""
        opts = opts if opts is not None else dist.AllToAllOptions()

        def check() -> None:
            if not (output.is_contiguous() and input.is_contiguous()):   # gloo's and NCCL's rule
                raise InvalidCall(f"rank {self.rank()}: all_to_all_single: the tensors must be contiguous")
            for name, t, splits in (("output", output, output_splits), ("input", input, input_splits)):
                if splits and (len(splits) != self.size() or sum(splits) != t.size(0)):
                    raise InvalidCall(f"rank {self.rank()}: all_to_all_single: {name} splits {list(splits)} are not "
                                      f"{self.size()} sizes summing to the {name}'s {t.size(0)} rows")
        if not (output_splits or input_splits):
            check()
            self._agree_tensors("alltoall", input, output)
            return self._a2a(output, input, [], [], opts, True)
        ins, outs = _elements(input, input_splits, self.size()), _elements(output, output_splits, self.size())
        every = self._agree_splits("all_to_all_single", input, ins, outs, check)
        even = every is not None and len({x for r in every for side in r for x in side}) == 1
        return self._a2a(output, input, list(output_splits), list(input_splits), opts, even)

    def _a2a(self, output: Any, input: Any, output_splits: list, input_splits: list, opts: Any,  # noqa: A002
             even: bool) -> Any:
        """An agreed all-to-all: on the Communicator when ``even`` (equal splits everywhere) and
        it runs these tensors, else on the inner group with the splits."""
        reason = self._fallback_reason([output, input]) or (None if even else "explicit splits")
        if reason:
            o, i = (output, input) if output_splits or input_splits else (_flat(output), _flat(input))
            return self._to_inner("all_to_all", reason, [output, input],
                                  lambda g: g.alltoall_base(o, i, output_splits, input_splits, opts))
        return self._run(opts, [output], self.communicator.all_to_all, input.reshape(-1), out=output.view(-1))

    def alltoall_base(self, output: Any, input: Any, output_splits: list, input_splits: list,  # noqa: A002
                      opts: Any = None) -> Any:
        return self.all_to_all_single(output, input, output_splits, input_splits, opts)

    # ------------------------------------------------------------------ broadcast, barrier, p2p
    def broadcast(self, tensors: list, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BroadcastOptions()

        def check() -> str:
            if not 0 <= opts.rootTensor < len(tensors):
                raise InvalidCall(f"rank {self.rank()}: broadcast: root tensor index {opts.rootTensor} is not an index "
                                  f"of the {len(tensors)} tensor(s)")
            return f"broadcast of {_signature(tensors)} from rank {opts.rootRank}"
        self._agree(("broadcast", _signature(tensors), opts.rootRank, opts.rootTensor), "broadcast", check)
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
        return self._to_inner("gather", "no mscclang gather", list(inputs),
                              lambda g: g.gather(output_lists, inputs, opts))

    def scatter(self, outputs: list, input_lists: list, opts: Any = None) -> Any:
        return self._to_inner("scatter", "no mscclang scatter", list(outputs),
                              lambda g: g.scatter(outputs, input_lists, opts))

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> Any:
        """List all-to-all: ``inputs[j]`` to rank ``j``'s ``outputs[r]``, as one flat
        all-to-all with the list sizes as splits (agreed; on the Communicator when every size is
        equal everywhere; gloo has no list all-to-all)."""
        opts = opts if opts is not None else dist.AllToAllOptions()

        def check() -> None:
            for name, items in (("outputs", outputs), ("inputs", inputs)):
                self._check_list("all_to_all", name, items, self.size(), "ranks")
                for i, t in enumerate(items):
                    if not isinstance(t, torch.Tensor) or (t.dtype, t.device) != (inputs[0].dtype, inputs[0].device):
                        raise InvalidCall(f"rank {self.rank()}: all_to_all: {name}[{i}] is {_shows(t)}; expected "
                                          f"a tensor of {inputs[0].dtype} on {inputs[0].device}")
        ins, outs = ([getattr(t, "numel", lambda: 0)() for t in items] for items in (inputs, outputs))
        every = self._agree_splits("all_to_all", inputs[0] if inputs else None, ins, outs, check)
        even = every is not None and len({x for r in every for side in r for x in side}) == 1
        flat = torch.cat([t.reshape(-1) for t in inputs])
        out = torch.empty(sum(outs), dtype=flat.dtype, device=flat.device)

        def body() -> None:
            self._a2a(out, flat, [] if even else outs, [] if even else ins, dist.AllToAllOptions(), even).wait()
            for t, part in zip(outputs, out.split(outs)):
                t.copy_(part.view(t.shape))
        return self._run(opts, list(outputs), body)

    def allgather_coalesced(self, output_lists: list, inputs: list, opts: Any = None) -> Any:
        return self._to_inner("all_gather_coalesced", "no mscclang coalesced all_gather", list(inputs),
                              lambda g: g.allgather_coalesced(output_lists, inputs, opts))

    def recv_anysource(self, tensors: list, tag: int = 0) -> Any:
        return self._to_inner("recv", "receive from any source", tensors,
                              lambda g: g.recv_anysource(tensors, tag))

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


def _signature(tensors: list) -> str:
    """Tensors' shapes and dtypes as the ranks compare them."""
    return ", ".join(f"{tuple(t.shape)} x {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                     for t in tensors)


def _shows(t: Any) -> str:
    """A tensor argument as an error message names it: shape, dtype, device."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}, not a tensor"
    return f"a tensor of shape {tuple(t.shape)}, {t.dtype}, on {t.device}"


def _elements(t: Any, splits: list, n: int) -> list[int]:
    """An all-to-all's splits (rows of ``t``; none: equal) as element counts by rank."""
    row = t.numel() // max(t.size(0), 1) if t.dim() else 1
    return [int(s) * row for s in splits] if splits else [t.numel() // n] * n


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


def create_process_group(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> MscclangProcessGroup:
    """The creator torch calls for ``init_process_group("mscclang")`` and ``new_group(backend=
    "mscclang")``: a :class:`MscclangProcessGroup` over ``store`` (already the group's
    PrefixStore)."""
    return MscclangProcessGroup(store, rank, world_size, timeout)


def register() -> None:
    """Register the ``"mscclang"`` backend with torch.distributed for CPU and CUDA tensors.
    Idempotent (``import mscclang.distributed`` calls it)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cuda", "cpu"])


register()
