"""The communicator: bootstrap through torch.distributed's store (store barriers and byte
exchanges: :mod:`mscclang.runtime.store_group`) and symmetric allocations (same order on every
rank, IPC-mapped by every peer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

from mscclang.errors import RuntimeUnavailable
from mscclang.runtime import cuda as cu
from mscclang.runtime.registration import BufferName, Registry
from mscclang.runtime.store_group import StoreGroup


@dataclass
class SymAlloc:
    """A symmetric allocation: ``index`` is its number in the communicator's allocation order
    (the same on every rank; never reused, also after a release); ``peer_bases[r]`` is rank r's
    copy mapped here (own base for self). ``internal``: the runtime's own staging (not a caller's
    symmetric buffer); ``label``: ``"staging"`` for the collective API's staging buffers (reported
    as staging, still symmetric for the executor); ``pinned``: used by a captured CUDA graph or kept
    by prepare (never released before close); ``temp``: staging above the cap, released after
    its call."""

    index: int
    base: int
    size: int
    buffer_id: int
    peer_bases: dict[int, int] = field(default_factory=dict)
    internal: bool = False
    label: str = ""
    pinned: bool = False
    temp: bool = False

    @cached_property
    def name(self) -> BufferName:
        """What this allocation is to zero-copy plans (made once: index and internal never change)."""
        return BufferName("internal" if self.internal else "sym", self.index)


class _DevMem:
    """Raw device memory exposed through ``__cuda_array_interface__`` so torch can wrap it."""

    def __init__(self, p: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (p, False), "version": 3, "strides": None,
        }


def default_store() -> Any:
    """torch.distributed's default store (torchrun, or any launcher torch supports)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeUnavailable(
            "no store: pass store=, rank=, world_size= or initialise torch.distributed first (torchrun works)")
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class Bootstrap(StoreGroup):
    """One rank's view of a group of GPUs that run plans together (its store exchanges:
    :class:`~mscclang.runtime.store_group.StoreGroup`).

    ``store`` is a ``torch.distributed.Store`` shared by all ranks (default: the default process
    group's). The current CUDA device (or ``device``) is used.
    """

    def __init__(self, store: Any = None, rank: Optional[int] = None, world_size: Optional[int] = None,
                 device: Optional[int] = None, name: str = "default", store_timeout_s: float = 300.0) -> None:
        import torch

        if store is None:
            import torch.distributed as dist

            store = default_store()
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        if rank is None or world_size is None:
            raise RuntimeUnavailable("Bootstrap needs rank and world_size with an explicit store")
        if not torch.cuda.is_available():
            raise RuntimeUnavailable("no CUDA device is visible")
        self.device = torch.cuda.current_device() if device is None else int(device)
        torch.cuda.set_device(self.device)
        torch.empty(1, device=f"cuda:{self.device}")  # primary context current on this thread
        drv = cu.driver()
        cu.check(drv.cuInit(0), "cuInit")
        ctx = cu.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:
            dev = cu.check(drv.cuDeviceGet(self.device), "cuDeviceGet")
            pctx = cu.check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            cu.check(drv.cuCtxSetCurrent(pctx), "cuCtxSetCurrent")
        super().__init__(store, int(rank), int(world_size), name, store_timeout_s)
        self._sym: list[SymAlloc] = []
        self._sym_by_id: dict[int, SymAlloc] = {}
        self._sym_count = 0   # symmetric allocations made so far (their indices are never reused)
        self._closed = False
        #: registrations of ordinary tensors for zero-copy plans (mscclang.runtime.registration)
        self.registry = Registry(self)

    # symmetric memory -----------------------------------------------------------------------------
    def _sym_alloc(self, nbytes: int, internal: bool = False, label: str = "") -> SymAlloc:
        """Collective: allocate ``nbytes`` (zeroed) on every rank and map every peer's copy."""
        nbytes = max(int(nbytes), 256)
        nbytes = (nbytes + 2**21 - 1) // 2**21 * 2**21 if nbytes > 2**21 else (nbytes + 255) // 256 * 256
        p = cu.mem_alloc(nbytes)
        cu.memset_d8(p, 0, nbytes, 0)
        drv = cu.driver()
        cu.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")  # zeroing done before the handle is published
        handle = cu.ipc_handle(p)
        try:
            allh = self.exchange(handle, f"symmetric allocation #{self._sym_count} of {nbytes} B")
        except BaseException:
            cu.mem_free(p)
            raise
        sa = SymAlloc(self._sym_count, p, nbytes, cu.buffer_id(p), internal=internal, label=label)
        self._sym_count += 1
        for r, h in enumerate(allh):
            if r == self.rank:
                sa.peer_bases[r] = p
            else:
                sa.peer_bases[r] = cu.ipc_open(h[:64])
        self._sym.append(sa)
        self._sym_by_id[sa.buffer_id] = sa
        return sa

    def _sym_release(self, allocs: list[SymAlloc]) -> None:
        """Close the peers' mappings of ``allocs`` and free them, here. Collective in effect: the
        caller (:meth:`mscclang.runtime.staging.StagingPool.release`) makes every rank
        finish its GPU work and meet before any rank calls this, so no peer still reads or writes
        them."""
        for sa in allocs:
            if sa not in self._sym:
                continue
            for r, b in sa.peer_bases.items():
                if r != self.rank:
                    cu.ipc_close(b)
            cu.mem_free(sa.base)
            self._sym.remove(sa)
            self._sym_by_id.pop(sa.buffer_id, None)

    def alloc(self, shape: Any, dtype: Any = None, label: str = "") -> Any:
        """Collective: a zeroed torch tensor in symmetric memory (every rank must call it in the same
        order with the same shape and dtype). Zero-copy plans run on such tensors directly.
        ``label="staging"`` marks the collective API's staging buffers (reported as staging)."""
        import torch

        dtype = dtype or torch.float16
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        sa = self._sym_alloc(nbytes, label=label)
        t = torch.as_tensor(_DevMem(sa.base, sa.size), device=f"cuda:{self.device}")
        return t[:nbytes].view(dtype).view(shape)

    def tensor_of(self, sa: SymAlloc) -> Any:
        """A uint8 torch tensor over the whole of symmetric allocation ``sa``."""
        import torch

        return torch.as_tensor(_DevMem(sa.base, sa.size), device=f"cuda:{self.device}")

    def memory(self) -> dict[str, int]:
        """Bytes of symmetric memory this communicator allocated: ``symmetric`` (the caller's,
        from :meth:`alloc`) and ``staging`` (the runtime's own and the collective API's, for
        ordinary tensors), with their counts; peers' mappings of them are not counted (they are the
        peers' memory). Plus the registrations of ordinary tensors
        (:meth:`mscclang.runtime.registration.Registry.memory`: counts, and the bytes of peers'
        allocations mapped here, which are the peers' memory)."""
        out = {"symmetric": 0, "staging": 0, "symmetric_buffers": 0, "staging_buffers": 0}
        for sa in self._sym:
            k = "staging" if sa.internal or sa.label == "staging" else "symmetric"
            out[k] += sa.size
            out[k + "_buffers"] += 1
        reg = getattr(self, "registry", None)
        if reg is not None:
            out.update(reg.memory())
        return out

    def symmetric_of(self, p: int) -> Optional[SymAlloc]:
        """The allocation holding ``p`` (at offset ``p - base`` in it) when device address ``p`` lies in a symmetric allocation.

        The communicator owns these allocations and frees them only in close(), so an address
        inside one's range belongs to it: a range check (no driver call) is exact here. Other
        memory (torch's, whose addresses are reused) is never matched by address alone."""
        for sa in self._sym:
            d = p - sa.base
            if 0 <= d < sa.size:
                return sa
        return None

    def close(self) -> None:
        """Close IPC mappings (registrations' too) and free symmetric allocations (after the GPU
        finished using them)."""
        if self._closed:
            return
        self._closed = True
        try:
            drv = cu.driver()
            drv.cuCtxSynchronize()
            reg = getattr(self, "registry", None)
            if reg is not None:
                reg.close()
            for sa in self._sym:
                for r, b in sa.peer_bases.items():
                    if r != self.rank:
                        cu.ipc_close(b)
                cu.mem_free(sa.base)
        finally:
            self._sym.clear()
            self._sym_by_id.clear()

