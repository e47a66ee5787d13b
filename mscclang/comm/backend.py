"""What the communicator needs from an execution engine, in three parts, and their assembly over
the GPU runtime.

An :class:`Engine` is one rank's engine: ``launch`` (:class:`LaunchPart`: run a plan on a checked
call, launch again what a call resolved, prepare before CUDA graph capture, which sizes a plan runs
as they are and its granule, whether it runs here, traced launches), ``memory``
(:class:`MemoryPart`: symmetric buffers, the padded staging kept between calls and released above
a cap, the memory report) and ``registry`` (:class:`RegistryPart`: what a tensor is to zero-copy
plans, registration of ordinary tensors, CUDA-graph capture sessions), with a lifecycle of its own
(check, synchronize, describe_call, reset, close). :class:`RuntimeBackend` assembles the GPU
runtime's objects, which implement the parts themselves (the executor, its symmetric memory and
its capture glue); ``mscclang.comm.sim_backend`` assembles the simulator's (threads on the CPU),
for tests and for machines without GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from mscclang.errors import RuntimeUnavailable
from mscclang.plan.call import Call, Copies
from mscclang.plan.models import Plan


class LaunchPart(Protocol):
    """Running plans. ``traces``: whether :meth:`trace` runs (the GPU runtime's traced kernels)."""

    traces: bool

    def run_call(self, plan: Plan, call: Call, packet_type: Optional[str] = None,
                 copies: Optional[Copies] = None) -> Any:
        """Run ``plan`` for the checked ``call`` (:func:`mscclang.plan.call.make_call`: nothing is
        checked again) on the buffers it names (the caller's, the output with the input copied in,
        or staging; a fused call's ``call.epi`` names its residual, read and written, and weight),
        with ``copies`` enqueued before and after the kernel in stream order (the input into the
        plan's buffers, the output back). Returns what :meth:`launch_bound` launches again for
        the same call, copies included (None: resolve every call)."""

    def launch_bound(self, bound: Any) -> bool:
        """Launch what :meth:`run_call` returned, checking nothing again; False (nothing launched)
        when it is stale: :meth:`run_call` then."""

    def prepare_call(self, plan: Plan, call: Call, packet_type: Optional[str] = None) -> None:
        """Do every setup step of :meth:`run_call` for ``call`` (device plan, kernel) without
        launching, so a later launch may be captured in a CUDA graph."""

    def fits(self, plan: Plan, in_bytes: int, out_bytes: int, packet_type: Optional[str] = None) -> bool:
        """Whether ``plan`` runs a call of these byte sizes as it is (the GPU runtime: packet
        offsets aligned for the packet type); when not, the communicator pads the call's blocks
        to the plan's alignment and stages it. Must answer alike on every rank."""

    def granule(self, plan: Plan) -> int:
        """Bytes every block of a call must be a multiple of (1: any size the layout accepts)."""

    def runnable(self, plan: Plan) -> Optional[str]:
        """Why ``plan`` cannot run here (e.g. a channel the node layout cannot carry), or None."""

    def trace(self, plan: Plan, call: Call, packet_type: Optional[str] = None, copies: Optional[Copies] = None) -> Any:
        """:meth:`run_call` through a traced kernel (the copies untraced), waited for: this rank's
        :class:`~mscclang.runtime.trace.RankTrace` (RuntimeUnavailable when ``traces`` is False)."""


class MemoryPart(Protocol):
    """Symmetric buffers and staging. ``cap``: bytes of staging kept between calls (larger
    staging is released after its call), or None for no cap."""

    cap: Optional[int]

    def empty(self, numel: int, dtype: Any, staging: bool = False) -> Any:
        """Collective: a zeroed symmetric buffer, allocated on every rank in the same order;
        ``staging``: one the communicator stages ordinary tensors through (reported as staging)."""

    def is_symmetric(self, tensor: Any) -> bool:
        """Whether ``tensor`` lies inside a buffer from :meth:`empty` (not staging of the engine's own)."""

    def stage(self, role: str, nbytes: int, keep: bool = False) -> tuple[Any, bool, bool]:
        """Collective when it allocates: a uint8 staging tensor of at least ``nbytes`` that the
        communicator's padded calls run on, kept for ``role`` between calls; whether it is
        temporary (above the cap: :meth:`release` it after its call), and whether it replaced the
        one kept for that role before. ``keep``: prepare (kept until close even above the cap).
        The policy is :class:`mscclang.runtime.staging.StagingPool`'s."""

    def release(self, tensors: list) -> None:
        """Collective: free staging buffers (from :meth:`stage` or ``empty(staging=True)``) once
        every rank's work on them is done (every rank passes the corresponding ones)."""

    def pin(self, tensors: list) -> None:
        """Keep the staging buffers ``tensors`` until close (a captured graph or a prepared call
        runs on them)."""

    def memory(self) -> dict[str, int]:
        """Memory the engine holds, by kind, in bytes (and counts); empty when unknown."""


class RegistryPart(Protocol):
    """Registration of ordinary tensors for zero-copy plans. ``mode``: ``auto``, ``explicit`` or
    ``off`` (see :mod:`mscclang.runtime.registration`)."""

    mode: str

    def classify(self, tensor: Any) -> Any:
        """What ``tensor`` is to zero-copy plans, as a hashable value that enters the
        communicator's memo key (a symmetric allocation's or a registration's name, or None)."""

    def zero_copy_ok(self, inp: Any, out: Any) -> bool:
        """Whether a zero-copy (symmetric) plan runs directly on ``inp``/``out``: symmetric or
        registered buffers. Must answer alike on every rank for corresponding tensors."""

    def register(self, tensors: list) -> list[bool]:
        """Collective: register ordinary tensors; per tensor, whether zero-copy plans now run on
        it directly."""

    def deregister(self, tensors: list) -> int:
        """Collective: drop registrations of ``tensors``; returns how many were dropped."""

    def uses(self, cls: Any) -> int:
        """Launches that ran on the registration a :meth:`classify` value names (0 if none)."""

    def begin_capture(self, arena_bytes: Optional[int] = None) -> bool:
        """Collective, before a CUDA graph capture: open a capture session (zero-copy calls on
        unregistered tensors are registered at its end). Returns whether that is enabled."""

    def end_capture(self, failed: bool = False) -> int:
        """Collective, after the capture: register the session's captured buffers; how many calls."""


def _nothing() -> None:
    """A lifecycle step with nothing to do."""


def _unnamed(desc: str) -> None:
    """An engine whose setup steps do not name the call."""


@dataclass(eq=False)
class Engine:
    """One rank's execution engine: its three parts, where it runs (``rank`` of ``world_size``
    on ``device``; ``store``: a torch.distributed store the ranks share, when it has one, from
    which the communicator's torch.distributed fallback can build its group) and its lifecycle:

    - ``check()``: raise a pending CollectiveTimeout without waiting (cheap: no device call);
    - ``synchronize()``: wait for this rank's launches (and raise a pending CollectiveTimeout);
    - ``describe_call(desc)``: name the call being set up (``""`` when done), so that setup steps
      the ranks take together can say what each rank called when they disagree;
    - ``reset()``: collective reset after an abort;
    - ``close()``: release everything.

    The lifecycle defaults do nothing (an engine with no device to wait for or free)."""

    launch: LaunchPart
    memory: MemoryPart
    registry: RegistryPart
    rank: int = 0
    world_size: int = 1
    device: Any = None
    store: Any = None
    check: Callable[[], None] = _nothing
    synchronize: Callable[[], None] = _nothing
    describe_call: Callable[[str], None] = _unnamed
    reset: Callable[[], None] = _nothing
    close: Callable[[], None] = _nothing


class RuntimeBackend(Engine):
    """The engine over ``mscclang.runtime`` (its ``Bootstrap`` + ``Executor``) on one CUDA device.

    Pass an existing ``executor`` (e.g. a GPU test worker's) or let it be built from
    ``store``/``rank``/``world_size``/``device``; ``options`` may hold ``specialize`` and
    ``watchdog`` (see :class:`~mscclang.runtime.executor.Executor`), ``timeout_s`` (GPU spin
    bound) and ``name`` (the runtime communicator's store namespace). The executor is the launch
    part and its capture glue the registry part; the memory part is
    :class:`~mscclang.runtime.staging.SymmetricMemory` over its communicator and staging. Closing
    closes the executor and then its communicator.
    """

    def __init__(self, *, store: Any = None, rank: int, world_size: int, device: Any = None,
                 executor: Any = None, **options: Any) -> None:
        try:
            from mscclang.runtime.bootstrap import Bootstrap
            from mscclang.runtime.executor import Executor
            from mscclang.runtime.staging import SymmetricMemory
        except ImportError as e:
            raise RuntimeUnavailable(f"mscclang.runtime cannot be imported: {e}") from e
        if executor is None:
            rc = Bootstrap(store=store, rank=rank, world_size=world_size, device=getattr(device, "index", device),
                           name=str(options.get("name", "comm")))
            executor = Executor(rc, timeout_s=options.get("timeout_s"), specialize=options.get("specialize"),
                                watchdog=options.get("watchdog"))
        if device is None:
            import torch

            device = torch.device("cuda", int(executor.comm.device))
        self.executor = executor
        super().__init__(executor, SymmetricMemory(executor.comm, executor.staging, executor.memory),
                         executor.capture, rank, world_size, device,
                         store if store is not None else getattr(executor.comm, "store", None),
                         check=executor.check, synchronize=executor.synchronize,
                         describe_call=executor.describe_call, reset=executor.reset, close=self._close)

    def _close(self) -> None:
        # close() may come from another thread (a finalizer, a watchdog's handler): make this
        # device's context current there first, or every driver call fails (invalid context)
        import torch

        if isinstance(self.device, torch.device) and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self.executor.close()
        finally:
            self.executor.comm.close()
