"""What the communicator needs from an execution engine, and the adapter to the GPU runtime.

:class:`Backend` is the small interface the :class:`~mscclang.comm.Communicator` codes against:
run a plan on one rank's tensors, allocate symmetric buffers, prepare (register) before CUDA
graph capture, and say which size granule a plan needs. :class:`RuntimeBackend` adapts
``mscclang.runtime`` (the GPU executor); ``mscclang.comm.sim_backend`` provides a CPU backend
(threads + the simulator) for tests and for machines without GPUs.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from mscclang.errors import RuntimeUnavailable
from mscclang.plan.models import Plan


class Backend:
    """Interface of an execution engine for one rank (subclass and override)."""

    rank: int = 0
    world_size: int = 1
    device: Any = None

    def execute(self, plan: Plan, inp: Any, out: Any, *, reduce_op: str = "sum",
                packet_type: Optional[str] = None) -> None:
        """Run ``plan`` on this rank with ``inp``/``out`` (torch tensors; the same tensor for an
        in-place plan whose input aliases the start of the output, or views into one buffer)."""
        raise NotImplementedError

    def prepare(self, plan: Plan, inp: Any, out: Any, *, packet_type: Optional[str] = None) -> None:
        """Do every setup step of ``execute`` (registration, device plan) without launching, so a
        later launch may be captured in a CUDA graph. Default: nothing to do."""

    def empty(self, numel: int, dtype: Any) -> Any:
        """A symmetric buffer: allocated on every rank in the same order (collective call)."""
        raise NotImplementedError

    def is_symmetric(self, tensor: Any) -> bool:
        """Whether ``tensor`` lies inside a buffer from :meth:`empty`."""
        return False

    def granule(self, plan: Plan) -> int:
        """Bytes every block of a call must be a multiple of (1: any size the layout accepts)."""
        return 1

    def synchronize(self) -> None:
        """Wait for this rank's launches (and raise a pending CollectiveTimeout)."""

    def reset(self) -> None:
        """Collective reset after an abort."""

    def close(self) -> None:
        """Release resources."""


def _call_flex(fn: Any, kwargs: dict[str, Any]) -> Any:
    """Call ``fn`` with the subset of ``kwargs`` its signature accepts."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn(**kwargs)
    params = sig.parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


class RuntimeBackend(Backend):
    """Adapter to ``mscclang.runtime``'s executor on one CUDA device.

    The runtime is developed alongside this module; the adapter only relies on
    ``Executor.execute(plan, input, output, packet_type=..., reduce_op=...)`` and looks up the
    optional pieces (``prepare``, symmetric allocation, symmetric check, size granule, reset)
    by name, degrading gracefully where one is missing.
    """

    _ALLOC_NAMES = ("empty", "empty_symmetric", "symmetric_empty", "alloc_symmetric", "allocate_symmetric")
    _SYMCHK_NAMES = ("is_symmetric", "is_symmetric_buffer")

    def __init__(self, *, store: Any, rank: int, world_size: int, device: Any = None,
                 executor: Any = None, **options: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        if executor is None:
            try:
                import mscclang.runtime as rt
            except Exception as e:  # pragma: no cover - import errors of the runtime
                raise RuntimeUnavailable(f"mscclang.runtime cannot be imported: {e}") from e
            cls = getattr(rt, "Executor", None)
            if cls is None:
                raise RuntimeUnavailable("mscclang.runtime has no Executor yet")
            kwargs = dict(store=store, rank=rank, world_size=world_size, device=device, **options)
            executor = _call_flex(cls, kwargs)
        self.executor = executor
        self._own_symmetric: list[Any] = []  # used only when the runtime has no allocator

    def _method(self, names: tuple[str, ...]) -> Any:
        for n in names:
            f = getattr(self.executor, n, None)
            if callable(f):
                return f
        return None

    def execute(self, plan: Plan, inp: Any, out: Any, *, reduce_op: str = "sum",
                packet_type: Optional[str] = None) -> None:
        kw: dict[str, Any] = {"reduce_op": reduce_op}
        if packet_type is not None:
            kw["packet_type"] = packet_type
        self.executor.execute(plan, inp, out, **kw)

    def prepare(self, plan: Plan, inp: Any, out: Any, *, packet_type: Optional[str] = None) -> None:
        f = getattr(self.executor, "prepare", None)
        if not callable(f):
            return
        kw: dict[str, Any] = {}
        if packet_type is not None:
            kw["packet_type"] = packet_type
        try:
            f(plan, inp, out, **kw)
        except TypeError:
            # a prepare(plan, sizes) form: pass the byte sizes
            f(plan, [(inp.numel() * inp.element_size(), out.numel() * out.element_size())])

    def empty(self, numel: int, dtype: Any) -> Any:
        f = self._method(self._ALLOC_NAMES)
        if f is not None:
            try:
                return f(numel, dtype=dtype)
            except TypeError:
                return f((numel,), dtype=dtype)
        import torch

        t = torch.empty(numel, dtype=dtype, device=self.device)
        self._own_symmetric.append(t)
        return t

    def is_symmetric(self, tensor: Any) -> bool:
        f = self._method(self._SYMCHK_NAMES)
        if f is not None:
            return bool(f(tensor))
        ptr = tensor.data_ptr()
        for t in self._own_symmetric:
            base = t.data_ptr()
            if base <= ptr < base + t.numel() * t.element_size():
                return True
        return False

    def granule(self, plan: Plan) -> int:
        for n in ("size_granule", "granule", "size_granularity"):
            f = getattr(self.executor, n, None)
            if callable(f):
                return int(f(plan))
            if isinstance(f, int):
                return f
        return 1

    def synchronize(self) -> None:
        f = self._method(("synchronize", "sync"))
        if f is not None:
            f()

    def reset(self) -> None:
        f = self._method(("reset",))
        if f is not None:
            f()

    def close(self) -> None:
        f = self._method(("close", "shutdown"))
        if f is not None:
            f()
        self._own_symmetric.clear()
