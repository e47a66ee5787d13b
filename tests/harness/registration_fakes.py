"""Fakes for testing :mod:`mscclang.runtime.registration` on the CPU: per-rank address spaces
with allocations (base, size, buffer id, exportable or not), an IPC driver over them whose
mappings can be resolved back to the peer's real address, storage references that can be made to
expire, and a thread-per-rank group with a store-like exchange.

A test builds a :class:`FakeCluster`, allocates and frees on each rank's :class:`FakeDevice`, and
runs ``fn(rank)`` on every rank at once with :meth:`FakeCluster.run` (each rank's
:class:`~mscclang.runtime.registration.Registry` is ``cluster.registry(rank)``).
"""

from __future__ import annotations

import itertools
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mscclang.errors import CallMismatch, RuntimeUnavailable
from mscclang.runtime.registration import AllocInfo, Registry

_ids = itertools.count(1)


@dataclass
class FakeAlloc:
    base: int
    size: int
    buffer_id: int
    capable: bool = True


@dataclass
class FakeRef:
    """A storage weak reference whose storage dies when the test says so."""

    dead: bool = False

    def expired(self) -> bool:
        return self.dead


class FakeDevice:
    """One rank's allocations (every rank's addresses are disjoint, like separate processes)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.allocs: dict[int, FakeAlloc] = {}

    def alloc(self, size: int, base: Optional[int] = None, capable: bool = True) -> FakeAlloc:
        """A new allocation (a new buffer id, also at a reused ``base``)."""
        if base is None:
            base = (self.rank + 1) * (1 << 40) + len(self.allocs) * (1 << 32)
        a = FakeAlloc(base, size, next(_ids), capable)
        self.allocs[base] = a
        return a

    def free(self, base: int) -> None:
        del self.allocs[base]

    def find(self, ptr: int) -> Optional[FakeAlloc]:
        for a in self.allocs.values():
            if a.base <= ptr < a.base + a.size:
                return a
        return None


class FakeIpc:
    """The driver calls of a Registry over a :class:`FakeDevice`; every mapping gets a fresh
    address, and :meth:`resolve` turns an address inside a mapping back into the owner's."""

    _addr = itertools.count(1)

    def __init__(self, cluster: "FakeCluster", rank: int) -> None:
        self.cluster = cluster
        self.rank = rank
        self.maps: dict[int, tuple[int, int, int, int]] = {}   # addr -> (owner, buffer id, base, size)
        self.opened: list[tuple[int, int]] = []                # (owner, buffer id) per open
        self.closed: list[tuple[int, int]] = []
        self.syncs = 0
        self.fail_open = False

    def describe(self, ptr: int) -> AllocInfo:
        a = self.cluster.devices[self.rank].find(ptr)
        if a is None:
            raise RuntimeUnavailable(f"{ptr:#x} is not device memory")
        return AllocInfo(a.base, a.size, a.buffer_id, a.capable, "" if a.capable else "a fake cuMem allocation")

    def export(self, base: int) -> bytes:
        a = self.cluster.devices[self.rank].allocs[base]
        return struct.pack("<QQQQ", self.rank, a.buffer_id, a.base, a.size).ljust(64, b"\0")

    def open(self, handle: bytes) -> int:
        if self.fail_open:
            raise RuntimeUnavailable("cuIpcOpenMemHandle failed: CUDA_ERROR_TOO_MANY_PEERS (fake)")
        owner, bid, base, size = struct.unpack_from("<QQQQ", handle)
        addr = (0x7000 << 32) + next(self._addr) * (1 << 36)
        self.maps[addr] = (owner, bid, base, size)
        self.opened.append((owner, bid))
        return addr

    def close(self, addr: int) -> None:
        if addr not in self.maps:
            raise RuntimeUnavailable(f"closing {addr:#x}, which is not mapped (closed twice?)")
        owner, bid, _, _ = self.maps.pop(addr)
        self.closed.append((owner, bid))

    def synchronize(self) -> None:
        self.syncs += 1

    def resolve(self, addr: int) -> tuple[int, int, int]:
        """(owner rank, owner's buffer id, owner's address) of an address inside a mapping."""
        for m, (owner, bid, base, size) in self.maps.items():
            if m <= addr < m + size:
                return owner, bid, base + (addr - m)
        raise KeyError(f"{addr:#x} is not inside an open mapping")


@dataclass
class FakeComm:
    """A registry's communicator over the cluster's threads (``exchange`` compares tags like the
    store-based one, raising CallMismatch on every rank)."""

    cluster: "FakeCluster"
    rank: int
    call: str = ""
    world_size: int = field(init=False)
    exchanges: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.world_size = self.cluster.n

    def exchange(self, data: bytes, tag: str) -> list[bytes]:
        self.exchanges.append(tag)
        return self.cluster._exchange(self.rank, bytes(data), tag)


class FakeCluster:
    """``n`` ranks, each with a device, an IPC fake, a comm and a Registry (kwargs to Registry)."""

    def __init__(self, n: int, timeout: float = 10.0, **registry_kw: Any) -> None:
        self.n = n
        self.devices = [FakeDevice(r) for r in range(n)]
        self.ipcs = [FakeIpc(self, r) for r in range(n)]
        self.comms = [FakeComm(self, r) for r in range(n)]
        self.registries = [Registry(self.comms[r], self.ipcs[r], **registry_kw) for r in range(n)]
        self._barrier = threading.Barrier(n, timeout=timeout)
        self._slots: list[Any] = [None] * n

    def registry(self, rank: int) -> Registry:
        return self.registries[rank]

    def _exchange(self, rank: int, data: bytes, tag: str) -> list[bytes]:
        self._slots[rank] = (tag, data)
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()
        tags = [t for t, _ in got]
        if len(set(tags)) > 1:
            raise CallMismatch("ranks disagree on the call (" + ", ".join(f"rank {q}: {t}" for q, t in enumerate(tags))
                               + ")")
        return [d for _, d in got]

    def run(self, fn: Callable[[int], Any], timeout: float = 30.0) -> list[Any]:
        """``fn(rank)`` on every rank at once; results by rank, or every rank's exception as a
        list when any raised (:class:`RankErrors`)."""
        res: list[Any] = [None] * self.n
        errs: list[Optional[BaseException]] = [None] * self.n

        def body(r: int) -> None:
            try:
                res[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                errs[r] = e

        ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout)
        if any(t.is_alive() for t in ts):
            raise RuntimeError("a rank is still running (deadlock?)")
        if any(e is not None for e in errs):
            raise RankErrors(errs)
        return res


class RankErrors(Exception):
    """Some ranks raised: ``errors[r]`` is rank r's exception (or None)."""

    def __init__(self, errors: list[Optional[BaseException]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in enumerate(errors) if e))
