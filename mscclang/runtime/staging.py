"""Staging: the symmetric buffers that zero-copy plans run on when the caller's tensors are neither
symmetric nor registered.

One policy: up to the cap (``MSCCLANG_STAGING_CAP_BYTES``, read once) a plan's staging is kept
between calls and grown by size only, in powers of two (at most to the cap), so a stream of new
sizes allocates (a collective step) only logarithmically often; the collective API's staging
starts at a floor (``MSCCLANG_STAGING_MIN_BYTES`` on the GPU, default 32 MiB), so new sizes up to
it never allocate after the first staged call; an outgrown buffer is released
unless a captured graph or a prepared call uses it (then it stays until close). A call above the
cap gets staging of its own, released once its work is done, or kept when prepared. In-place
plans stage input and output in one buffer. Every decision depends only on the call's sizes,
which all ranks share, so every rank allocates and releases at the same calls.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from mscclang.errors import NotPrepared


def pow2_size(n: int, cap: int) -> int:
    """The staging size kept for a need of ``n`` bytes: the next power of two (at least 256 B),
    at most the cap, never less than ``n``."""
    return max(min(1 << max(n - 1, 0).bit_length(), cap), n, 256)


class StagingPool:
    """The staging of one engine (the GPU runtime, or a CPU back end of the collective API).
    ``alloc(nbytes, api)`` makes a buffer collectively (an object with ``size``, ``pinned``,
    ``temp`` and ``index``; ``api``: for the collective API's padded staging, which the engine's
    zero-copy plans run on directly, rather than for a plan's own staging); ``free(buffers,
    why)`` releases buffers collectively once every rank's work on them is done (and drops what
    the engine built on them); ``barrier(tag)`` meets the other ranks; ``cap``: bytes kept between
    calls; ``capturing``: whether the caller captures a CUDA graph (no allocation then); ``rank``
    names this rank in messages; ``floor``: the least size of a buffer of the collective API (at
    most the cap; 0: none).

    Buffers are kept by key: a loaded plan's input and output (:meth:`get`), or a role of the
    collective API's padded staging (:meth:`buffer`)."""

    def __init__(self, alloc: Callable[[int, bool], Any], free: Callable[[list, str], None], barrier: Callable[[str], None],
                 cap: int, capturing: Callable[[], bool], rank: int, floor: int = 0) -> None:
        self._alloc = alloc
        self.floor = max(0, min(int(floor), cap))
        self._free = free
        self._barrier = barrier
        self.cap = cap
        self._capturing = capturing
        self.rank = rank
        self._kept: dict[Any, tuple[Any, Any]] = {}   # key -> (input, output) up to the cap
        self._big: dict[tuple, tuple[Any, Any]] = {}  # (key, in, out) -> kept above the cap (prepare)

    def get(self, lp: Any, in_bytes: int, out_bytes: int, keep: bool = False) -> tuple[Any, Any]:
        """A loaded plan's staging (input, output) for a call of these sizes (collective when it
        allocates); in-place plans stage both in one buffer. ``keep``: prepare, whose captured call
        will use it."""
        return self._pair(("plan", id(lp)), lp.plan.name, lp.plan.inplace, in_bytes, out_bytes, keep, False)

    def buffer(self, role: str, nbytes: int, keep: bool = False) -> tuple[Any, bool]:
        """One buffer of at least ``nbytes`` for the collective API's padded staging under
        ``role``, and whether it replaced (and released) the buffer kept for that role before:
        what was built on the old one must be planned again. A pinned old buffer is kept, and so
        may be what was built on it."""
        old = self._kept.get(("api", role), (None, None))[1]
        _, buf = self._pair(("api", role), f"the {role} staging", True, nbytes, nbytes, keep, True)
        return buf, old is not None and buf is not old and not buf.temp and not old.pinned

    def _pair(self, key: Any, what: str, inplace: bool, in_bytes: int, out_bytes: int,
              keep: bool, api: bool) -> tuple[Any, Any]:
        need_in = 0 if inplace else in_bytes
        if max(need_in, out_bytes) > self.cap:
            return self._above_cap(key, what, inplace, in_bytes, out_bytes, keep, api)
        si, so = self._kept.get(key, (None, None))
        if so is None or so.size < out_bytes or (si is not None and si.size < need_in) or (si is None and need_in):
            if self._capturing():
                raise NotPrepared(f"rank {self.rank}: staging for {in_bytes} B on {what} cannot "
                                  "be allocated inside CUDA graph capture: prepare the call (or run it once) first")
            old = [x for x in (si, so) if x is not None]
            so = self._grow(so, out_bytes, api)
            si = so if inplace else self._grow(si, in_bytes, api)
            self._kept[key] = (si, so)
            if not api:
                # a plan's own staging: the ranks meet before its first use (the collective API's
                # buffers are symmetric allocations, whose exchange is the meeting already)
                self._barrier("staging")
            stale: list = []
            for x in old:
                if x is not si and x is not so and not x.pinned and all(x is not y for y in stale):
                    stale.append(x)
            self.release(stale, "outgrown staging")
        return si, so

    def _grow(self, cur: Any, n: int, api: bool) -> Any:
        if cur is not None and cur.size >= n:
            return cur
        return self._alloc(pow2_size(max(n, self.floor) if api else n, self.cap), api)

    def _above_cap(self, key: Any, what: str, inplace: bool, in_bytes: int, out_bytes: int,
                   keep: bool, api: bool) -> tuple[Any, Any]:
        k = (key, in_bytes, out_bytes)
        got = self._big.get(k)
        if got is not None:
            return got
        if self._capturing():
            raise NotPrepared(f"rank {self.rank}: {what} needs {max(in_bytes, out_bytes)} B of staging, "
                              f"above the staging cap ({self.cap} B, MSCCLANG_STAGING_CAP_BYTES), which cannot be "
                              "allocated inside CUDA graph capture: prepare the call before capturing (prepare "
                              "keeps its staging), or register the tensors")
        so = self._alloc(out_bytes, api)
        si = so if inplace else self._alloc(in_bytes, api)
        for x in (si, so):
            if keep:
                x.pinned = True
            else:
                x.temp = True
        if keep:
            self._big[k] = (si, so)
        self._barrier("staging")
        return si, so

    def release(self, bufs: list, why: str = "staging") -> None:
        """Collective: release buffers (pinned ones are skipped; every rank passes the
        corresponding buffers)."""
        todo: list = []
        for a in bufs:
            if not a.pinned and all(a is not b for b in todo):
                todo.append(a)
        if not todo:
            return
        if self._capturing():
            raise NotPrepared(f"rank {self.rank}: {why} cannot be released inside CUDA graph capture")
        self._free(todo, why)

    def plan_staging(self, lp: Any) -> tuple[Any, Any]:
        """The staging kept for ``lp`` up to the cap ((None, None) before its first staged call)."""
        return self._kept.get(("plan", id(lp)), (None, None))

    def clear(self) -> None:
        """Forget every kept buffer (close: the engine frees the allocations)."""
        self._kept.clear()
        self._big.clear()


class SymmetricMemory:
    """The collective API's memory part (:class:`mscclang.comm.backend.MemoryPart`) over
    ``comm``'s symmetric allocations (the GPU runtime's
    :class:`~mscclang.runtime.bootstrap.Bootstrap`, or the simulator's allocations: ``alloc``,
    ``symmetric_of``, ``tensor_of``, ``memory``), the padded staging of ``pool`` (the executor's
    :class:`StagingPool`), and ``held()``, the rest of the engine's memory report."""

    def __init__(self, comm: Any, pool: StagingPool, held: Callable[[], dict]) -> None:
        self.comm = comm
        self.pool = pool
        self.held = held

    @property
    def cap(self) -> Optional[int]:
        """Bytes of staging kept between calls."""
        return self.pool.cap

    def empty(self, numel: int, dtype: Any, staging: bool = False) -> Any:
        """Collective: a zeroed symmetric tensor (``staging``: reported as staging)."""
        return self.comm.alloc(numel, dtype, label="staging" if staging else "")

    def is_symmetric(self, tensor: Any) -> bool:
        """Whether ``tensor`` lies in a symmetric allocation of the caller's (not the runtime's own staging)."""
        got = self.comm.symmetric_of(tensor.data_ptr())
        return got is not None and not got.internal

    def stage(self, role: str, nbytes: int, keep: bool = False) -> tuple[Any, bool, bool]:
        """The pool's buffer for ``role`` (:meth:`StagingPool.buffer`) as a uint8 tensor, whether
        it is temporary and whether it replaced the one kept before."""
        sa, replaced = self.pool.buffer(role, nbytes, keep)
        return self.comm.tensor_of(sa), sa.temp, replaced

    def release(self, tensors: list) -> None:
        """Collective: release the symmetric allocations holding ``tensors`` (staging above the
        cap, or outgrown)."""
        allocs = []
        for t in tensors:
            got = self.comm.symmetric_of(t.data_ptr())
            if got is not None:
                allocs.append(got)
        self.pool.release(allocs, "staging")

    def pin(self, tensors: list) -> None:
        """Keep the allocations holding ``tensors`` until close."""
        for t in tensors:
            got = self.comm.symmetric_of(t.data_ptr())
            if got is not None:
                got.pinned = True

    def memory(self) -> dict[str, int]:
        """``held()`` and ``comm``'s report (symmetric memory, staging, registrations)."""
        out = dict(self.held())
        out.update(self.comm.memory())
        return out
