"""The collective API: :class:`Communicator`.

One communicator per rank (process), built from torch.distributed or from an explicit store, rank
and world size. Each call is planned (:mod:`mscclang.comm.planner`: which plan variant, run how)
and runs on the GPU runtime; what the library cannot run falls back to torch.distributed (NCCL),
logged once per reason. How a call reaches a plan, ordinary tensors and their registration, CUDA
graphs and the memory held: ``docs/architecture.md``, "The collective API".
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
from typing import Any, Optional, Union

from mscclang.comm.alltoallv import CountedCalls
from mscclang.comm.backend import Engine, RuntimeBackend
from mscclang.comm.catalog import Catalog
from mscclang.comm.errors import CommError
from mscclang.comm.fallback import TorchFallback
from mscclang.comm.launch import Launch, capturing
from mscclang.comm.membership import make_fallback, membership
from mscclang.comm.moe import MoECalls, MoEHandle
from mscclang.comm.planner import CallPlan, Planner, comm_errors
from mscclang.comm.selector import Choice, Selector
from mscclang.comm.tracing import Tracing, check_traceable
from mscclang.comm.tuning import TuningTable, load_tuning
from mscclang.config import Settings
from mscclang.plan.call import message_call
from mscclang.plan.collectives import plan_collective
from mscclang.plan.dtypes import gpu_dtype

log = logging.getLogger("mscclang.comm")

#: the byte-valued kinds of :meth:`Communicator.memory` this process holds (the others are counts,
#: settings, or the peers' memory mapped here)
_BYTE_KINDS = frozenset({"scratch", "sync", "retired_scratch", "retired_sync", "device_plans", "symmetric",
                         "staging", "graph_arena"})


class Communicator:
    """Collectives over ``world_size`` ranks; one instance per rank.

    Build it with :meth:`from_torch` (torch.distributed's default group or ``group``), or pass
    ``store``, ``rank`` and ``world_size`` explicitly. ``tuning`` is a tuning file (path, dict or
    table; default ``$MSCCLANG_TUNING`` or the shipped 2x H200 defaults), ``plans`` a plans folder
    (default: the shipped ``plans/``). ``backend`` injects an execution engine (tests, the CPU
    simulator); ``fallback=False`` raises instead of falling back to torch.distributed. The
    fallback runs on ``group``; else on a group of its own over the store (the explicit one, or
    the back end's ``store``: NCCL on CUDA, gloo on the CPU), made at the first fallback call;
    else on torch.distributed's default group.

    ``batch_invariant`` (None: ``MSCCLANG_BATCH_INVARIANT``, off by default) turns on the
    batch-invariant mode, read back as :attr:`batch_invariant`: every call runs a plan that keeps
    the contract of ``docs/semantics.md`` (each reduced element is the rank-order fold, whatever
    the message size, the plan or the batch), generated from the algorithm library and proven at
    first use where no shipped plan serves the call (:mod:`mscclang.comm.invariant`); a tuning
    rule's plan without the promise is refused, and a call no such plan can run raises
    :class:`~mscclang.comm.errors.BatchInvariantError` (one line naming the call and why)
    instead of falling back to torch.distributed. Point-to-point ``send``/``recv`` copy bits and
    still run on torch.distributed.
    """

    def __init__(self, group: Any = None, *, store: Any = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, device: Any = None,
                 tuning: Union[str, os.PathLike, dict, TuningTable, None] = None,
                 plans: Union[str, os.PathLike, Catalog, None] = None,
                 backend: Optional[Engine] = None, fallback: Union[bool, Any] = True,
                 runtime_options: Optional[dict] = None, batch_invariant: Optional[bool] = None) -> None:
        self._batch_invariant = bool(Settings.batch_invariant.or_env(batch_invariant))
        self._logged: set[tuple[str, str]] = set()
        self._closed = False
        self._runtime_error: Optional[str] = None
        self._traces = 0
        m = membership(group, store, rank, world_size, device, backend)
        self.rank, self.world_size, self.device = m.rank, m.world_size, m.device
        # tuning table and plan catalog
        self.tuning = load_tuning(tuning)   # None: $MSCCLANG_TUNING, else the shipped table
        self.catalog = plans if isinstance(plans, Catalog) else Catalog.from_dir(plans)
        extra = self.tuning.extra_plans_dir()
        if extra is not None:
            for v in Catalog.from_dir(extra):
                self.catalog.add(v)
        self.selector = Selector(self.tuning, self.catalog, self._batch_invariant)
        # the engine, then the fallback (mscclang.comm.membership)
        self.backend = backend if backend is not None else self._make_runtime(m.store, runtime_options or {})
        self._fallback, self._calls = make_fallback(fallback, group, m, runtime_options or {})
        self.planner = Planner(self.rank, self.world_size, self.device, self.backend, self.selector,
                               self._fallback is not None, self._note, self._runtime_error)
        self._runs = Launch(self.planner, self.backend, self._fallback, self._calls, self._note)
        self._counted = CountedCalls(self._runs, self.catalog, lambda inp, out: self.all_gather(inp, out=out),
                                    self.tuning)
        self._moe = MoECalls(self.rank, self.world_size, self.device, lambda inp, out: self.all_gather(inp, out=out),
                             lambda x, counts, out, cap: self.all_to_all_v(x, counts, out=out, capacity=cap))

    @property
    def backend(self) -> Optional[Engine]:
        """The execution engine (None: no runtime here, or closed: calls fall back)."""
        return self._backend

    @backend.setter
    def backend(self, be: Optional[Engine]) -> None:
        self._backend = be
        planner = self.__dict__.get("planner")
        if planner is not None:
            planner.engine = self._runs.engine = be
            planner.memo.clear()

    @property
    def plan_calls(self) -> int:
        """Calls that ran on a mscclang plan (collectives and fused calls); every other call went
        to torch.distributed. 0 after a run: no mscclang plan ran (e.g. no GPU runtime here)."""
        return self._runs.plan_calls

    @property
    def last(self) -> Optional[CallPlan]:
        """The CallPlan of the last collective call (None: none ran)."""
        return self._runs.last

    @property
    def last_fused(self) -> Optional[str]:
        """The plan the last all_reduce_add_rms_norm ran (None: none ran, or the fallback)."""
        return self._runs.last_fused

    @property
    def batch_invariant(self) -> bool:
        """Whether this communicator runs in the batch-invariant mode (see the class docstring)."""
        return self._batch_invariant

    @property
    def selector(self) -> Selector:
        """The tuning's choices."""
        return self._selector

    @selector.setter
    def selector(self, sel: Selector) -> None:
        self._selector = sel
        planner = self.__dict__.get("planner")
        if planner is not None:
            planner.selector = sel

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_torch(cls, group: Any = None, **kw: Any) -> "Communicator":
        """A communicator over torch.distributed's default group (or ``group``)."""
        return cls(group, **kw)

    def _make_runtime(self, store: Any, options: dict) -> Optional[Engine]:
        if getattr(self.device, "type", None) != "cuda":
            self._runtime_error = f"no GPU runtime on device {self.device}"
            return None
        try:
            return RuntimeBackend(store=store, rank=self.rank, world_size=self.world_size,
                                  device=self.device, **options)
        except Exception as e:  # RuntimeUnavailable, driver errors: everything falls back
            self._runtime_error = f"GPU runtime unavailable: {type(e).__name__}: {e}"
            return None

    # ------------------------------------------------------------------ buffers
    def empty(self, *shape: Union[int, tuple], dtype: Any = None) -> Any:
        """A symmetric tensor (zero-copy plans run on these directly). Collective: every rank
        must allocate the same shapes in the same order."""
        self._check_open("empty")
        import math

        import torch

        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        dims = tuple(int(s) for s in shape)
        dtype = dtype if dtype is not None else torch.float32  # any dtype: byte pools too
        numel = math.prod(dims)
        if self.backend is None:
            return torch.empty(dims, dtype=dtype, device=self.device)
        return self.backend.memory.empty(numel, dtype).view(dims)

    def is_symmetric(self, tensor: Any) -> bool:
        """Whether ``tensor`` lies in a buffer from :meth:`empty`."""
        self._check_open("is_symmetric")
        return self.backend is not None and self.backend.memory.is_symmetric(tensor)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, op: Any = "sum", out: Any = None, accum_dtype: Any = None) -> Any:
        """Reduce ``tensor`` over all ranks; in place unless ``out`` is given. Returns the result.

        fp8 tensors (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) reduce with ``sum`` only, in
        the accumulation dtype ``accum_dtype``: ``torch.float32`` (the default) or
        ``torch.float16`` (or their names); each reduction step of the plan rounds its result
        once to fp8, to nearest even, saturating at the largest finite value (docs/semantics.md,
        "FP8 reductions"). ``accum_dtype`` with any other dtype, an fp8 ``min``/``max``, or another
        accumulation dtype raise :class:`~mscclang.errors.InvalidCall` naming it."""
        self._check_open("allreduce")
        return self._runs.call("allreduce", tensor, tensor if out is None else out, op, accum=accum_dtype)

    def all_reduce_add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float = 1e-6,
                                out: Any = None, fp8_scale: Any = None) -> Any:
        """vLLM's ``fused_add_rms_norm`` after an allreduce: ``residual += all_reduce(x)``, then
        ``x`` (or ``out``) gets ``RMSNorm(residual) * weight`` (FP8 in ``out`` with
        ``fp8_scale``). Returns the tensor holding the norm. Bad arguments raise InvalidCall
        before anything runs; see :mod:`mscclang.comm.fused_norm` for the rules and the
        fallback. ``last_fused`` names the plan the last such call ran (None: the fallback)."""
        self._check_open("all_reduce_add_rms_norm")
        return self._runs.fused(x, residual, weight, eps, out, fp8_scale)

    def prepare_all_reduce_add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float = 1e-6,
                                        out: Any = None, fp8_scale: Any = None) -> Optional[str]:
        """:meth:`prepare` for :meth:`all_reduce_add_rms_norm` (same arguments): the fused
        plan's name, or None when the call will fall back. Collective."""
        self._check_open("prepare_all_reduce_add_rms_norm")
        return self._runs.prepare_fused(x, residual, weight, eps, out, fp8_scale)

    def all_gather(self, tensor: Any, out: Any = None) -> Any:
        """Gather every rank's ``tensor`` into ``out`` (``world_size`` times as many elements,
        rank order). In place when ``tensor`` is ``out``'s block of this rank."""
        if out is None:
            out = self.planner.default_out("allgather", tensor)
        self._check_open("allgather")
        return self._runs.call("allgather", tensor, out, "sum")

    def reduce_scatter(self, tensor: Any, op: Any = "sum", out: Any = None, accum_dtype: Any = None) -> Any:
        """Reduce ``tensor`` over all ranks and keep this rank's block (``numel / world_size``
        elements). In place when ``out`` is ``tensor``'s block of this rank. fp8 and
        ``accum_dtype``: as for :meth:`all_reduce`."""
        if out is None:
            out = self.planner.default_out("reducescatter", tensor)
        self._check_open("reducescatter")
        return self._runs.call("reducescatter", tensor, out, op, accum=accum_dtype)

    def all_to_all(self, tensor: Any, out: Any = None) -> Any:
        """Block ``j`` of rank ``i``'s input goes to block ``i`` of rank ``j``'s output; in place
        unless ``out`` is given."""
        out = tensor if out is None else out
        self._check_open("alltoall")
        return self._runs.call("alltoall", tensor, out, "sum")

    def all_to_all_v(self, x: Any, send_counts: Any, *, out: Any = None, capacity: Optional[int] = None,
                     expect_counts: Any = None) -> tuple[Any, Any]:
        """All-to-all with per-peer row counts known on the device only (expert parallelism's
        dispatch): ``x`` is ``[N, ...]`` rows, the rows for rank ``p`` after those for the ranks
        before ``p``; ``send_counts`` an integer tensor of ``world_size`` entries on this
        communicator's device (``send_counts[p]`` rows go to rank ``p``); ``out`` is
        ``[capacity, ...]`` rows of ``x``'s shape and dtype, receiving the rows from rank ``p``
        after those from the ranks before ``p``; the rows past them are left as they were.
        Returns ``(out, recv_counts)``, ``recv_counts`` a device tensor of ``send_counts``'s dtype.

        With ``out`` given the call does not synchronise with the host, so a CUDA graph captured
        once replays it with new counts. ``capacity`` bounds the rows any one rank sends any one
        rank, the same on every rank (default: ``out``'s rows, which must then be the same on
        every rank); it sizes the plans' scratch slots. ``expect_counts`` (like ``send_counts``): the rows this
        rank expects from each rank (torch.distributed's output splits); a rank whose expectation
        differs from what its sender sends raises :class:`~mscclang.errors.CountsError` on every
        rank.
        Without ``out`` the call reads the exchanged counts on the host once (a synchronisation)
        to size it. Counts that cannot run (negative, more rows than ``x`` holds or ``out`` takes)
        raise :class:`~mscclang.errors.CountsError` on every rank, naming the rank and the count.
        Rows may be any dtype mscclang moves (fp8 included) and any width that is a multiple of 4
        bytes. The plans are the ``alltoallv_*`` of the library (:mod:`mscclang.comm.alltoallv`);
        ``last_all_to_all_v`` names the one the last call ran (None: torch.distributed)."""
        self._check_open("all_to_all_v")
        return self._counted.all_to_all_v(x, send_counts, out, expect_counts, capacity)

    def moe_dispatch(self, tokens: Any, topk_idx: Any, num_experts: int, *, capacity: int,
                     check: bool = True, fp8: bool = False, layout: str = "expert") -> tuple[Any, Any, MoEHandle]:
        """Expert-parallel dispatch: each token's row ``tokens[t]`` (``[T, H]``) goes to the rank
        of each of its experts ``topk_idx[t]`` (``[T, k]`` ints; expert ``e`` on rank ``e //
        (num_experts // world_size)``; ``-1``: a dropped slot). Returns ``(expert_tokens,
        expert_counts, handle)``: ``expert_tokens`` ``[local_experts, capacity, H]``, each local
        expert's rows ordered by (source rank, token, slot); ``expert_counts`` ``[local_experts]``
        on the device; ``handle`` for :meth:`moe_combine`. Every step runs on the device (no host
        synchronisation inside a CUDA graph capture; see :mod:`mscclang.comm.moe`). Bad shapes
        raise InvalidCall at once; with ``check`` (outside a capture) expert ids out of range and
        experts over ``capacity`` raise InvalidCall on every rank (one host read). With ``fp8``
        each row travels as float8_e4m3fn with its float32 scale (``max|row| / 448``) and
        ``expert_tokens`` is ``(rows [local_experts, capacity, H] float8_e4m3fn, scales
        [local_experts, capacity] float32)``, a row being about ``rows.float() * scale``
        (:func:`mscclang.comm.moe.quantize_rows`; H a multiple of 4). With ``layout="rank"`` the
        rows stay as they arrived: ``[local_experts * capacity, H]`` by source rank, then local
        expert, then token, and ``expert_counts`` is ``[world_size, local_experts]`` (rows from
        each rank for each local expert)."""
        self._check_open("moe_dispatch")
        return self._moe.dispatch(tokens, topk_idx, num_experts, capacity, check, fp8, layout)

    def moe_combine(self, expert_out: Any, topk_weights: Any, handle: MoEHandle) -> Any:
        """Expert-parallel combine: the experts' outputs ``expert_out`` (in the dispatch's layout:
        ``[local_experts, capacity, H]``, or the rank-major rows) go back to their tokens' ranks,
        and each token's ``k`` rows are summed with ``topk_weights`` (``[T, k]``) in slot order in
        fp32, then cast: deterministic (no atomics), a token's bits independent of the rest of the
        batch. Returns ``[T, H]``."""
        self._check_open("moe_combine")
        return self._moe.combine(expert_out, topk_weights, handle)

    @property
    def last_all_to_all_v(self) -> Optional[str]:
        """The plan the last :meth:`all_to_all_v` ran (None: the torch.distributed fallback)."""
        return self._counted.last

    def broadcast(self, tensor: Any, root: int = 0) -> Any:
        """Copy ``root``'s ``tensor`` into every rank's ``tensor`` (in place)."""
        self._check_open("broadcast")
        return self._runs.call("broadcast", tensor, tensor, "sum", root=self._rank_arg(root, "broadcast root"))

    def send_recv(self, tensor: Any, out: Any = None) -> Any:
        """Ring shift: every rank sends ``tensor`` to ``rank + 1`` and receives ``rank - 1``'s
        into ``out`` (in place when ``out`` is None)."""
        out = tensor if out is None else out
        self._check_open("sendrecv")
        return self._runs.call("sendrecv", tensor, out, "sum")

    def send(self, tensor: Any, dst: int) -> None:
        """Point-to-point send (through torch.distributed: plans are collective, a lone send is
        not)."""
        self._check_open("send")
        dst = self._check_peer(dst, "send dst")
        self.planner.check_tensor("send tensor", tensor)
        gpu_dtype(tensor.dtype)
        self._runs.note_fallback("send", "point-to-point send/recv runs through torch.distributed")
        self._runs.need_fallback("send").send(tensor, dst)

    def recv(self, tensor: Any, src: int) -> Any:
        """Point-to-point receive into ``tensor`` (through torch.distributed)."""
        self._check_open("recv")
        src = self._check_peer(src, "recv src")
        self.planner.check_tensor("recv tensor", tensor)
        gpu_dtype(tensor.dtype)
        self._runs.note_fallback("recv", "point-to-point send/recv runs through torch.distributed")
        self._runs.need_fallback("recv").recv(tensor, src)
        return tensor

    def prepare(self, collective: str, tensor: Any, out: Any = None, op: Any = "sum",
                root: int = 0, accum_dtype: Any = None) -> CallPlan:
        """Do a call's setup (selection, registration of ordinary tensors a zero-copy plan would
        run on, staging buffers, device plan, kernel) without running it, so the call may then be
        captured in a CUDA graph. Same arguments as the collective (``accum_dtype``: the fp8
        reductions'; the kernel depends on it). Collective."""
        self._check_open("prepare")
        coll = plan_collective(collective)
        root = self._rank_arg(root, f"{coll} root")
        if out is None:
            out = self.planner.default_out(coll, tensor)
        return self._runs.prepare(coll, tensor, out, op, root, accum_dtype)

    def warm_up(self, collectives: Any = None, dtype: Any = None, max_bytes: Optional[int] = None,
                symmetric: bool = True) -> list:
        """Load every plan the selector can pick for ``collectives`` (default all_reduce,
        all_gather, reduce_scatter) in ``dtype`` (default bfloat16) up to ``max_bytes`` (default
        64 MiB), on ordinary and symmetric tensors, so that no later call pays a plan's first
        load: one real call at each size where the choice can change
        (:mod:`mscclang.comm.warmup`). Collective; not inside a CUDA graph capture. Returns one
        :class:`~mscclang.comm.warmup.WarmedCall` per call."""
        self._check_open("warm_up")
        if capturing():
            raise CommError(f"rank {self.rank}: warm_up cannot run inside a CUDA graph capture")
        from mscclang.comm.warmup import DEFAULT_MAX_BYTES, warm_up

        return warm_up(self._runs, collectives, dtype, DEFAULT_MAX_BYTES if max_bytes is None else max_bytes, symmetric)

    def register(self, *tensors: Any) -> list[bool]:
        """Collective: register ordinary CUDA tensors so that zero-copy plans run on them directly
        (every rank passes its corresponding tensors, in the same order; never inside a CUDA graph
        capture). Returns, per tensor, whether zero-copy plans now run on it (always for symmetric
        tensors; False where some rank's tensor cannot be exported, e.g. torch's expandable
        segments, logged once). A registration lasts while the tensor's storage lives (or until
        :meth:`deregister`); calls on the tensor, or a view starting at its first element, then
        need no staging and no store round trip."""
        self._check_open("register")
        for i, t in enumerate(tensors):
            self.planner.check_tensor(f"register tensor {i}", t)
        if self.backend is None or not tensors:
            return [False] * len(tensors)
        if capturing():
            raise CommError(f"rank {self.rank}: register() cannot run inside CUDA graph capture: register "
                            "before capturing, or capture inside graph_capture()")
        self.backend.describe_call(f"register of {len(tensors)} tensor(s)")
        try:
            return list(self.backend.registry.register(list(tensors)))
        finally:
            self.backend.describe_call("")

    def deregister(self, *tensors: Any) -> int:
        """Collective: drop the registrations of ``tensors`` (their IPC mappings and device plans
        are released unless a captured graph uses them). Returns how many were dropped."""
        self._check_open("deregister")
        for i, t in enumerate(tensors):
            self.planner.check_tensor(f"deregister tensor {i}", t)
        if self.backend is None or not tensors:
            return 0
        return int(self.backend.registry.deregister(list(tensors)))

    @contextlib.contextmanager
    def graph_capture(self, arena_bytes: Optional[int] = None) -> Any:
        """Collective context manager around CUDA graph capture of calls on ordinary tensors::

            with comm.graph_capture():
                with torch.cuda.graph(g):
                    comm.all_reduce(x)

        Enter it before the capture starts and leave it after the capture ends. Inside, a call
        that would run a zero-copy plan on registered tensors is captured on its unregistered
        tensors as they are; when the block ends, every rank's captured buffers are registered
        together (one exchange, in capture order) and the captured device plans get the peers'
        addresses (:meth:`register_graph_buffers`). Each call must have run (or been prepared)
        once before, with tensors of the same sizes. ``arena_bytes``: device-plan arena for the
        session (default ``MSCCLANG_GRAPH_ARENA_BYTES``, 4 MiB, about 256 calls)."""
        self.begin_graph_capture(arena_bytes)
        try:
            yield self
        except BaseException:
            try:
                self.register_graph_buffers(failed=True)
            except Exception as e:  # noqa: BLE001 - the capture's own error is the one to report
                log.warning("mscclang rank %d: ending the graph-capture session after a failed capture: %s",
                            self.rank, e)
            raise
        self.register_graph_buffers()

    def begin_graph_capture(self, arena_bytes: Optional[int] = None) -> bool:
        """Collective, before ``torch.cuda.graph`` starts: open a capture session (see
        :meth:`graph_capture`). Returns whether deferred registration is enabled in it (every rank
        runs the same torch allocator settings; else ordinary tensors are staged as outside)."""
        self._check_open("begin_graph_capture")
        if capturing():
            raise CommError(f"rank {self.rank}: begin_graph_capture() must run before the capture starts")
        if self.backend is None:
            return False
        return bool(self.backend.registry.begin_capture(arena_bytes))

    def register_graph_buffers(self, failed: bool = False) -> int:
        """Collective, after the capture ended: register the buffers of the zero-copy calls captured
        in the session and complete their device plans (``failed``: this rank's capture raised;
        nothing is registered then). Raises CallMismatch or RegistrationError on every rank when the
        ranks captured different calls or a buffer could not be registered: those captured calls
        then abort on replay (CollectiveTimeout) instead of touching a wrong address. Returns the
        number of calls registered."""
        self._check_open("register_graph_buffers")
        if self.backend is None:
            return 0
        return int(self.backend.registry.end_capture(failed))

    def use_tuning(self, tuning: Union[str, os.PathLike, dict, TuningTable]) -> None:
        """Replace the tuning table (e.g. the tuner forcing one candidate); the plan catalog and
        everything the runtime set up stay. Every rank must make the same change."""
        self._check_open("use_tuning")
        self.tuning = load_tuning(tuning)
        self.selector = Selector(self.tuning, self.catalog, self._batch_invariant)
        self.planner.memo.clear()

    def select(self, collective: str, nbytes: int, dtype: Any) -> list[Choice]:
        """The selector's ordered choices for a message of ``nbytes`` (introspection)."""
        self._check_open("select")
        with comm_errors():
            return self.selector.choices(message_call(plan_collective(collective), self.world_size, nbytes, dtype,
                                                      self.rank))

    def trace(self) -> Tracing:
        """A context manager recording the per-op GPU timeline of the collectives called inside
        it: ``with comm.trace() as tr: ...`` then ``tr.save("rank0.json")``, ``tr.events`` or
        ``tr.problems`` (:class:`~mscclang.comm.tracing.CallTrace`). Each call inside runs the
        interpreter's traced kernel and is waited for (eager only: never inside a CUDA-graph
        capture); calls that fall back to torch.distributed are listed in ``tr.skipped``.
        Collective: every rank enters and leaves its block (leaving puts the ranks on one time
        base). RuntimeUnavailable without the GPU runtime."""
        self._check_open("trace")
        check_traceable(self.backend, self.rank)
        self._traces += 1
        return Tracing(self._runs, self.backend.store, f"mscclang/trace/{self._traces}")

    def memory(self) -> dict[str, int]:
        """What this communicator holds on its GPU, in bytes by kind (and counts): the runtime's
        ``scratch``, ``sync`` areas and ``device_plans`` (live and retired contexts), ``staging``
        for ordinary tensors (the runtime's and this communicator's), ``symmetric`` buffers (from
        :meth:`empty`), the ``graph_arena`` of capture sessions, the registrations of ordinary
        tensors (``registrations``, ``graph_registrations``, ``pinned_registrations``,
        ``peer_mappings``; ``peer_mapped_bytes`` are the peers' allocations mapped here, the
        peers' memory) and the ``kernels`` loaded; ``staging_cap`` is the cap on staging kept
        between calls. ``total_bytes`` sums the byte kinds held here. The torch.distributed
        fallback's memory (NCCL's) is not included."""
        self._check_open("memory")
        out = dict(self.backend.memory.memory()) if self.backend is not None else {}
        cap = self.backend.memory.cap if self.backend is not None else None
        if cap is not None:
            out["staging_cap"] = int(cap)
        out["total_bytes"] = sum(v for k, v in out.items() if k in _BYTE_KINDS)
        return out

    def synchronize(self) -> None:
        """Wait for this rank's launches (raises a pending CollectiveTimeout)."""
        self._check_open("synchronize")
        if self.backend is not None:
            self.backend.synchronize()

    def reset(self) -> None:
        """Collective reset after a CollectiveTimeout (every rank must call it)."""
        self._check_open("reset")
        if self.backend is not None:
            self.backend.reset()

    def close(self) -> None:
        """Release staging buffers, registrations and the runtime. Always returns, from any
        thread: what fails to be released (after an abort, say: a dead peer's mappings) is logged,
        never raised. Idempotent; afterwards every other method raises CommError."""
        self._closed = True
        self._runs.schedule.clear()
        self.planner.memo.clear()
        be, self.backend = self.backend, None
        for what, step in (("the torch.distributed fallback",
                            self._fallback.close if isinstance(self._fallback, TorchFallback) else None),
                           ("the runtime", be.close if be is not None else None)):
            if step is None:
                continue
            try:
                step()
            except Exception as e:  # noqa: BLE001 - close must return; say what was left behind
                log.warning("mscclang rank %d: closing %s: %s: %s", self.rank, what, type(e).__name__, e)

    def __enter__(self) -> "Communicator":
        self._check_open("a with block")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check_open(self, what: str) -> None:
        """CommError once :meth:`close` has run: a closed communicator runs nothing (its call
        would otherwise make a new torch.distributed group and run there)."""
        if self._closed:
            raise CommError(f"rank {self.rank}: {what} on a closed communicator (close() has run): make a new one")

    def _rank_arg(self, value: Any, what: str) -> int:
        """``value`` as a rank of this communicator (an int, or an integer with ``__index__`` such
        as a numpy or 0-d torch integer; not a bool); CommError naming ``what`` and the value."""
        try:
            r = -1 if isinstance(value, bool) else operator.index(value)
        except TypeError:
            r = -1
        if not 0 <= r < self.world_size:
            raise CommError(f"rank {self.rank}: {what} {value!r} is not a rank: use an int in 0..{self.world_size - 1}")
        return r

    def _check_peer(self, peer: Any, what: str) -> int:
        r = self._rank_arg(peer, what)
        if r == self.rank:
            raise CommError(f"rank {self.rank}: {what} {r} is not another rank of {self.world_size} (it is this one)")
        return r

    def _note(self, what: str, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` once per (what, message) for this communicator."""
        key = (what, message)
        if key in self._logged:
            return
        self._logged.add(key)
        log.log(level, "%s", message)
