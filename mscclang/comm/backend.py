"""What the communicator needs from an execution engine, and the adapter to the GPU runtime.

:class:`Backend` is the small interface the :class:`~mscclang.comm.Communicator` codes against:
run a plan on one rank's tensors, allocate symmetric buffers (and staging, released above a cap),
register ordinary tensors for zero-copy plans (explicitly, or in a CUDA-graph capture session),
prepare before CUDA graph capture, and say which size granule a plan needs. :class:`RuntimeBackend` adapts
``mscclang.runtime`` (the GPU executor); ``mscclang.comm.sim_backend`` provides a CPU backend
(threads + the simulator) for tests and for machines without GPUs.
"""

from __future__ import annotations

from typing import Any, Optional

from mscclang.config import settings
from mscclang.errors import RuntimeUnavailable
from mscclang.plan.call import Call
from mscclang.plan.collectives import collective
from mscclang.plan.models import Plan


class Backend:
    """Interface of an execution engine for one rank (subclass and override)."""

    rank: int = 0
    world_size: int = 1
    device: Any = None
    #: a torch.distributed store shared by the ranks, when the engine has one (the
    #: communicator's torch.distributed fallback can build its group from it)
    store: Any = None

    def execute(self, plan: Plan, call: Call, inp: Any, out: Any, *, packet_type: Optional[str] = None,
                residual: Any = None, weight: Any = None) -> Any:
        """Run ``plan`` for the checked ``call`` (:func:`mscclang.plan.call.make_call`: nothing
        is checked again) on ``inp``/``out``, the torch tensors the plan runs on, which ``call``
        describes (the caller's, the output with the input copied in, or staging; the same tensor,
        or views into one buffer, for an in-place plan). A fused call (``call.epi``) also passes
        its ``residual`` (read and written) and ``weight``. Returns what :meth:`launch_bound`
        launches again for the same call (None: this engine resolves every call)."""
        raise NotImplementedError

    def prepare(self, plan: Plan, call: Call, *, packet_type: Optional[str] = None) -> None:
        """Do every setup step of :meth:`execute` for ``call`` (device plan, kernel) without
        launching, so a later launch may be captured in a CUDA graph. Default: nothing to do."""

    def launch_bound(self, bound: Any) -> bool:
        """Launch what :meth:`execute` returned, checking nothing again; False (nothing launched)
        when it is stale: :meth:`execute` then."""
        return False

    #: whether :meth:`execute_traced` runs (the GPU runtime's traced kernels)
    traces: bool = False

    def execute_traced(self, plan: Plan, call: Call, inp: Any, out: Any, *,
                       packet_type: Optional[str] = None) -> Any:
        """:meth:`execute` through a traced kernel, waited for: this rank's
        :class:`~mscclang.runtime.trace.RankTrace`. Default: RuntimeUnavailable."""
        raise RuntimeUnavailable(f"rank {self.rank}: this engine has no traced kernels")

    def empty(self, numel: int, dtype: Any) -> Any:
        """A symmetric buffer: allocated on every rank in the same order (collective call)."""
        raise NotImplementedError

    def is_symmetric(self, tensor: Any) -> bool:
        """Whether ``tensor`` lies inside a buffer from :meth:`empty`."""
        return False

    def empty_staging(self, numel: int, dtype: Any) -> Any:
        """A symmetric buffer the communicator stages ordinary tensors through (collective);
        reported as staging. Default: :meth:`empty`."""
        return self.empty(numel, dtype)

    def release(self, tensors: list) -> None:
        """Collective: free staging buffers from :meth:`empty_staging` once every rank's work on
        them is done (every rank passes the corresponding ones). Default: nothing (dropped)."""

    def staging_cap(self) -> Optional[int]:
        """Bytes of staging kept between calls (larger staging is released after its call), or
        None for no cap."""
        return None

    def stage(self, role: str, nbytes: int, keep: bool = False) -> tuple[Any, bool, bool]:
        """Collective when it allocates: a uint8 staging tensor of at least ``nbytes`` that the
        communicator's padded calls run on, kept for ``role`` between calls; whether it is
        temporary (above the cap: release it after its call), and whether it replaced the one kept
        for that role before. ``keep``: prepare (kept until close even above the cap). The policy
        is :class:`mscclang.runtime.staging.StagingPool`'s, which this default runs over
        :meth:`empty_staging` and :meth:`release`."""
        pool = self._staging_pool()
        buf, replaced = pool.buffer(role, nbytes, keep)
        return buf.tensor, buf.temp, replaced

    def pin_staging(self, tensors: list) -> None:
        """Keep the staging buffers ``tensors`` until close (a captured graph or a prepared call
        runs on them)."""
        pool = self._staging_pool()
        for b in pool.held():
            if any(b.tensor.data_ptr() == t.data_ptr() for t in tensors):
                b.pinned = True

    def _staging_pool(self) -> Any:
        pool = getattr(self, "_pool", None)
        if pool is None:
            import torch

            from mscclang.runtime.staging import StagingPool, TensorBuf

            cap = self.staging_cap()
            pool = StagingPool(lambda n, api: TensorBuf(self.empty_staging(n, torch.uint8)),
                               lambda bufs, why: self.release([b.tensor for b in bufs]),
                               lambda tag: None, cap if cap is not None else 1 << 62, _capturing, self.rank)
            self._pool = pool
        return pool

    def zero_copy_ok(self, inp: Any, out: Any) -> bool:
        """Whether a zero-copy (symmetric) plan runs directly on ``inp``/``out``: symmetric or
        registered buffers. Must answer alike on every rank for corresponding tensors."""
        return self.is_symmetric(inp) and self.is_symmetric(out)

    def buffer_class(self, tensor: Any) -> Any:
        """What ``tensor`` is to zero-copy plans, as a hashable value that enters the
        communicator's memo key (e.g. symmetric, a registration's number, or None)."""
        return self.is_symmetric(tensor)

    def registration_mode(self) -> str:
        """``auto``, ``explicit`` or ``off`` (see :mod:`mscclang.runtime.registration`); engines
        without registration answer ``off``."""
        return "off"

    def register(self, tensors: list) -> list[bool]:
        """Collective: register ordinary tensors for zero-copy plans; per tensor, whether zero-copy
        plans now run on it directly."""
        return [self.is_symmetric(t) for t in tensors]

    def deregister(self, tensors: list) -> int:
        """Collective: drop registrations of ``tensors``; returns how many were dropped."""
        return 0

    def registration_uses(self, cls: Any) -> int:
        """Launches that ran on the registration a :meth:`buffer_class` value names (0 if none)."""
        return 0

    def begin_graph_capture(self, arena_bytes: Optional[int] = None) -> bool:
        """Collective, before a CUDA graph capture: open a capture session (zero-copy calls on
        unregistered tensors are registered at its end). Returns whether that is enabled."""
        return False

    def end_graph_capture(self, failed: bool = False) -> int:
        """Collective, after the capture: register the session's captured buffers."""
        return 0

    def granule(self, plan: Plan) -> int:
        """Bytes every block of a call must be a multiple of (1: any size the layout accepts)."""
        return 1

    def fits(self, plan: Plan, in_bytes: int, out_bytes: int, packet_type: Optional[str] = None) -> bool:
        """Whether ``plan`` runs a call of these byte sizes as it is (the GPU runtime: packet
        offsets aligned for the packet type); when not, the communicator pads the call's blocks
        to the plan's alignment and stages it. Must answer alike on every rank."""
        return True

    def memory(self) -> dict[str, int]:
        """GPU memory the engine holds, by kind, in bytes (and counts); empty when unknown."""
        return {}

    def runnable(self, plan: Plan) -> Optional[str]:
        """Why this engine cannot run ``plan`` here (e.g. a channel the node layout cannot carry),
        or None when it can."""
        return None

    def synchronize(self) -> None:
        """Wait for this rank's launches (and raise a pending CollectiveTimeout)."""

    def check(self) -> None:
        """Raise a pending CollectiveTimeout without waiting (cheap: no device call)."""

    def describe_call(self, desc: str) -> None:
        """Name the call being set up (``""`` when done), so that setup steps the ranks must take
        together can say what each rank called when they disagree."""

    def reset(self) -> None:
        """Collective reset after an abort."""

    def close(self) -> None:
        """Release resources."""


def runtime_granule(plan: Plan) -> int:
    """The GPU runtime's granule for ``plan``: collectives whose buffers hold several blocks
    (allgather, reduce-scatter, all-to-all) have block starts inside the buffer, which the
    runtime needs aligned (packet offsets), so their blocks are padded to the plan's
    ``buffer_alignment`` (at least 16 bytes); single-block calls take any element count. The CPU
    backend can apply the same rule (``SimWorld(granule=runtime_granule)``)."""
    if collective(plan.collective).multi_block:
        return max(16, plan.buffer_alignment)
    return 1


class RuntimeBackend(Backend):
    """Adapter to ``mscclang.runtime`` (its ``Communicator`` + ``Executor``) on one CUDA device.

    Pass an existing ``executor`` (e.g. a GPU test worker's) or let the adapter build one from
    ``store``/``rank``/``world_size``/``device``; ``options`` may hold ``specialize`` and
    ``watchdog`` (see :class:`~mscclang.runtime.executor.Executor`), ``timeout_s`` (GPU spin
    bound) and ``name`` (the runtime communicator's store namespace).

    Granule: collectives whose buffers hold several blocks (allgather, reduce-scatter,
    all-to-all) have block starts inside the buffer; the runtime needs those aligned (packet
    offsets), so their blocks are padded to the plan's ``buffer_alignment``. Single-block calls
    take any element count. ``$MSCCLANG_COMM_GRANULE`` forces a granule for every call.
    """

    def __init__(self, *, store: Any = None, rank: int, world_size: int, device: Any = None,
                 executor: Any = None, **options: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        if executor is None:
            try:
                from mscclang.runtime.bootstrap import Bootstrap as RuntimeComm
                from mscclang.runtime.executor import Executor
            except ImportError as e:
                raise RuntimeUnavailable(f"mscclang.runtime cannot be imported: {e}") from e
            index = getattr(device, "index", device)
            rc = RuntimeComm(store=store, rank=rank, world_size=world_size, device=index,
                             name=str(options.get("name", "comm")))
            executor = Executor(rc, timeout_s=options.get("timeout_s"), specialize=options.get("specialize"),
                                watchdog=options.get("watchdog"))
        self.executor = executor
        self.store = store if store is not None else getattr(getattr(executor, "comm", None), "store", None)
        if self.device is None:
            import torch

            self.device = torch.device("cuda", int(getattr(executor.comm, "device", 0)))
        self._forced_granule = settings.comm_granule
        self._runnable: dict[int, tuple] = {}   # id(plan) -> (plan, reason or None)

    def execute(self, plan: Plan, call: Call, inp: Any, out: Any, *, packet_type: Optional[str] = None,
                residual: Any = None, weight: Any = None) -> Any:
        return self.executor.run_call(plan, call, packet_type)

    def prepare(self, plan: Plan, call: Call, *, packet_type: Optional[str] = None) -> None:
        self.executor.prepare_call(plan, call, packet_type)

    def launch_bound(self, bound: Any) -> bool:
        return self.executor.launch_bound(bound)

    traces = True

    def execute_traced(self, plan: Plan, call: Call, inp: Any, out: Any, *,
                       packet_type: Optional[str] = None) -> Any:
        return self.executor.execute_traced(plan, inp, out, packet_type=packet_type, reduce_op=call.op,
                                            accum_dtype=call.accum)

    def empty(self, numel: int, dtype: Any) -> Any:
        return self.executor.comm.alloc(numel, dtype)

    def is_symmetric(self, tensor: Any) -> bool:
        got = self.executor.comm.symmetric_of(tensor.data_ptr())
        return got is not None and not getattr(got, "internal", False)

    def empty_staging(self, numel: int, dtype: Any) -> Any:
        return self.executor.comm.alloc(numel, dtype, label="staging")

    def release(self, tensors: list) -> None:
        self.executor.release_tensors(list(tensors))

    def staging_cap(self) -> Optional[int]:
        return self.executor.staging.cap

    def stage(self, role: str, nbytes: int, keep: bool = False) -> tuple[Any, bool, bool]:
        sa, replaced = self.executor.staging.buffer(role, nbytes, keep)
        return self.executor.comm.tensor_of(sa), sa.temp, replaced

    def pin_staging(self, tensors: list) -> None:
        for t in tensors:
            got = self.executor.comm.symmetric_of(t.data_ptr())
            if got is not None:
                got.pinned = True

    def zero_copy_ok(self, inp: Any, out: Any) -> bool:
        return self.executor.zero_copy_ok(inp, out)

    def buffer_class(self, tensor: Any) -> Any:
        return self.executor.buffer_class(tensor)

    def registration_mode(self) -> str:
        reg = getattr(getattr(self.executor, "comm", None), "registry", None)
        return reg.mode if reg is not None else "off"

    def register(self, tensors: list) -> list[bool]:
        return self.executor.register(list(tensors))

    def deregister(self, tensors: list) -> int:
        return self.executor.deregister(list(tensors))

    def registration_uses(self, cls: Any) -> int:
        reg = getattr(getattr(self.executor, "comm", None), "registry", None)
        from mscclang.runtime.registration import BufferName

        if reg is None or not (isinstance(cls, BufferName) and cls.kind == "reg"):
            return 0
        return reg.uses(cls.index)

    def begin_graph_capture(self, arena_bytes: Optional[int] = None) -> bool:
        return self.executor.begin_graph_capture(arena_bytes)

    def end_graph_capture(self, failed: bool = False) -> int:
        return self.executor.end_graph_capture(failed)

    def memory(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in (getattr(self.executor, "memory", None), getattr(getattr(self.executor, "comm", None), "memory", None)):
            if part is not None:
                out.update(part())
        return out

    def runnable(self, plan: Plan) -> Optional[str]:
        got = self._runnable.get(id(plan))
        if got is None or got[0] is not plan:
            check = getattr(self.executor, "runnable", None)
            got = (plan, check(plan) if check is not None else None)
            self._runnable[id(plan)] = got
        return got[1]

    def fits(self, plan: Plan, in_bytes: int, out_bytes: int, packet_type: Optional[str] = None) -> bool:
        return self.executor.fits(plan, in_bytes, out_bytes, packet_type)

    def granule(self, plan: Plan) -> int:
        if self._forced_granule:
            return self._forced_granule
        return runtime_granule(plan)

    def synchronize(self) -> None:
        self.executor.synchronize()
        # the device is idle: release the mappings of registered tensors that died here (their
        # peers' memory is freed once every rank has done so), without waiting for the next
        # registration step
        reg = getattr(getattr(self.executor, "comm", None), "registry", None)
        if reg is not None:
            reg.prune()

    def describe_call(self, desc: str) -> None:
        comm = getattr(self.executor, "comm", None)
        if comm is not None and hasattr(comm, "call"):
            comm.call = desc

    def check(self) -> None:
        check = getattr(self.executor, "check", None)
        if check is not None:
            check()

    def reset(self) -> None:
        self.executor.reset()

    def close(self) -> None:
        # close() may come from another thread (a finalizer, a watchdog's handler): make this
        # device's context current there first, or every driver call fails (invalid context)
        import torch

        if isinstance(self.device, torch.device) and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self.executor.close()
        finally:
            comm = getattr(self.executor, "comm", None)
            if comm is not None and hasattr(comm, "close"):
                comm.close()


def _capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # pragma: no cover
        return False
