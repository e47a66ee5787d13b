"""Staging: the symmetric buffers that zero-copy plans run on when the caller's tensors are neither
symmetric nor registered.

One policy: up to the cap (``MSCCLANG_STAGING_CAP_BYTES``, read once) a plan's staging is kept
between calls and grown by size only, in powers of two (at most to the cap), so a stream of new
sizes allocates (a collective step) only logarithmically often; an outgrown buffer is released
unless a captured graph or a prepared call uses it (then it stays until close). A call above the
cap gets staging of its own, released once its work is done, or kept when prepared. In-place
plans stage input and output in one buffer. Every decision depends only on the call's sizes,
which all ranks share, so every rank allocates and releases at the same calls.
"""

from __future__ import annotations

from typing import Any, Callable

from mscclang.errors import NotPrepared
from mscclang.runtime import cuda as cu
from mscclang.runtime.state import LoadedPlan


def pow2_size(n: int, cap: int) -> int:
    """The staging size kept for a need of ``n`` bytes: the next power of two (at least 256 B),
    at most the cap, never less than ``n``."""
    return max(min(1 << max(n - 1, 0).bit_length(), cap), n, 256)


class StagingPool:
    """Staging of one executor. ``comm``: the runtime communicator (symmetric allocations,
    barriers); ``cap``: bytes kept between calls; ``forget(indices)``: drop what the runtime built
    on the allocations with these indices (called when they are released, device idle);
    ``capturing``: whether the caller captures a CUDA graph (no allocation then)."""

    def __init__(self, comm: Any, cap: int, forget: Callable[[set], None], capturing: Callable[[], bool]) -> None:
        self.comm = comm
        self.cap = cap
        self._forget = forget
        self._capturing = capturing
        self._kept: dict[int, tuple[Any, Any]] = {}   # id(LoadedPlan) -> (input, output) up to the cap
        self._big: dict[tuple, tuple[Any, Any]] = {}  # (id(LoadedPlan), in, out) -> kept above the cap

    def get(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, keep: bool = False) -> tuple[Any, Any]:
        """The plan's staging (input, output) for a call of these sizes (collective when it
        allocates). ``keep``: prepare, whose captured call will use it."""
        inplace = lp.plan.inplace
        need_in = 0 if inplace else in_bytes
        if max(need_in, out_bytes) > self.cap:
            return self._above_cap(lp, in_bytes, out_bytes, keep)
        si, so = self._kept.get(id(lp), (None, None))
        if so is None or so.size < out_bytes or (si is not None and si.size < need_in) or (si is None and need_in):
            if self._capturing():
                raise NotPrepared(f"rank {self.comm.rank}: staging for {in_bytes} B on plan {lp.plan.name} cannot "
                                  "be allocated inside CUDA graph capture: prepare the call (or run it once) first")
            old = [x for x in (si, so) if x is not None]
            so = self._grow(so, out_bytes)
            si = so if inplace else self._grow(si, in_bytes)
            self._kept[id(lp)] = (si, so)
            self.comm.barrier("staging")
            stale: list = []
            for x in old:
                if x is not si and x is not so and not x.pinned and all(x is not y for y in stale):
                    stale.append(x)
            self.release(stale, "outgrown staging")
        return si, so

    def _grow(self, cur: Any, n: int) -> Any:
        if cur is not None and cur.size >= n:
            return cur
        return self.comm._sym_alloc(pow2_size(n, self.cap), internal=True)

    def _above_cap(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, keep: bool) -> tuple[Any, Any]:
        k = (id(lp), in_bytes, out_bytes)
        got = self._big.get(k)
        if got is not None:
            return got
        if self._capturing():
            raise NotPrepared(f"rank {self.comm.rank}: {lp.plan.name} needs {max(in_bytes, out_bytes)} B of staging, "
                              f"above the staging cap ({self.cap} B, MSCCLANG_STAGING_CAP_BYTES), which cannot be "
                              "allocated inside CUDA graph capture: prepare the call before capturing (prepare "
                              "keeps its staging), or register the tensors")
        so = self.comm._sym_alloc(out_bytes, internal=True)
        si = so if lp.plan.inplace else self.comm._sym_alloc(in_bytes, internal=True)
        for x in (si, so):
            if keep:
                x.pinned = True
            else:
                x.temp = True
        if keep:
            self._big[k] = (si, so)
        self.comm.barrier("staging")
        return si, so

    def release(self, allocs: list, why: str = "staging") -> None:
        """Collective: free symmetric allocations and everything built on them, after every
        rank's GPU finished its work and the ranks met (so no peer still reads or writes them).
        Pinned ones are skipped; every rank passes the corresponding allocations."""
        todo: list = []
        for a in allocs:
            if not a.pinned and all(a is not b for b in todo):
                todo.append(a)
        if not todo:
            return
        if self._capturing():
            raise NotPrepared(f"rank {self.comm.rank}: {why} cannot be released inside CUDA graph capture")
        cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        self.comm.barrier(f"release {why}")
        self._forget({a.index for a in todo})
        self.comm._sym_release(todo)

    def plan_staging(self, lp: LoadedPlan) -> tuple[Any, Any]:
        """The staging kept for ``lp`` up to the cap ((None, None) before its first staged call)."""
        return self._kept.get(id(lp), (None, None))

    def clear(self) -> None:
        """Forget every kept buffer (close: the communicator frees the allocations)."""
        self._kept.clear()
        self._big.clear()
