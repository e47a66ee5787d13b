"""The inter-node engine of port channels: NCCL point-to-point through NVIDIA's nccl4py bindings.

A port channel whose peer is on another node (:mod:`mscclang.runtime.topology`) moves its bytes
with ``ncclSend``/``ncclRecv`` on a two-rank NCCL communicator of its own (the sender is NCCL
rank 0, the receiver rank 1). One communicator per channel keeps every communicator's calls in
one stream and in the same order on both ends (the channel's trigger order), so the sends and
receives of different channels, directions and peers can never wait on each other; NCCL chooses
the transport (InfiniBand, RoCE, sockets) as it does for any job, and every call is a stream
operation, so CUDA graphs capture it.

Bootstrap: the senders' NCCL unique ids go through torch.distributed's store (the runtime
communicator's tagged exchange); all communicators of a plan are created together inside one
``ncclGroupStart/End``. :meth:`Engine.close` destroys them (``ncclCommAbort`` when the job
aborted, so a dead peer cannot block it).

Why nccl4py and not torch.distributed's send/recv: torch's process group runs point-to-point on
its own internal streams, so a send could not be made to wait on the kernel's trigger in the
same stream, and two directions between one pair share a stream there (a deadlock when both
sides send first). nccl4py gives the raw calls on our streams. It is optional
(``pip install nccl4py``, which finds the libnccl that torch installs); a plan that needs it
without it is refused with that message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from mscclang.errors import RuntimeUnavailable

NCCL_UINT8 = 1


def bindings() -> Any:
    """nccl4py's low-level bindings (RuntimeUnavailable when missing)."""
    try:
        from nccl.bindings import nccl as nb  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - ImportError, or libnccl not found at import
        raise RuntimeUnavailable(
            "port channels between nodes need NCCL point-to-point through nccl4py, which is not usable "
            f"here ({type(e).__name__}: {e}); install it with `pip install nccl4py` (it loads the libnccl "
            "that torch ships)") from None
    return nb


@dataclass(frozen=True, order=True, slots=True)
class Key:
    """One inter-node port channel's communicator: the plan's ``namespace`` (-1 until its first
    context assigns it), the sending rank ``src``, the receiving rank ``dst`` and the channel's
    ``ordinal`` between them. Ordered: every rank sorts the keys alike."""

    namespace: int
    src: int
    dst: int
    ordinal: int


class Engine:
    """Two-rank NCCL communicators for the inter-node port channels of one executor."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.comms: dict[Key, Any] = {}
        self._nb: Any = None
        self.aborted = False

    def _b(self) -> Any:
        if self._nb is None:
            self._nb = bindings()
        return self._nb

    def connect(self, keys: Sequence[Key], exchange: Callable[[bytes, str], list[bytes]]) -> None:
        """Create the communicators of ``keys`` that involve this rank and do not exist yet.
        Collective over every rank (``exchange`` is the store allgather): every rank passes the
        same keys in the same order."""
        want = sorted({k for k in keys if k not in self.comms})
        mine = [k for k in want if self.rank in (k.src, k.dst)]
        nb = self._b() if mine else None
        ids: dict[Key, bytes] = {}
        blob = b""
        for k in mine:
            if k.src == self.rank:
                uid = bytes(nb.get_unique_id())
                ids[k] = uid
                blob += (len(uid).to_bytes(4, "little") + k.namespace.to_bytes(4, "little")
                         + k.dst.to_bytes(4, "little") + k.ordinal.to_bytes(4, "little") + uid)
        got = exchange(blob, f"engine communicators {want}") if want else []
        for src, data in enumerate(got):
            pos = 0
            while pos < len(data):
                n, ns, dst, o = (int.from_bytes(data[pos + 4 * i:pos + 4 * i + 4], "little") for i in range(4))
                ids[Key(ns, src, dst, o)] = data[pos + 16:pos + 16 + n]
                pos += 16 + n
        if not mine:
            return
        missing = [k for k in mine if k not in ids]
        if missing:
            raise RuntimeUnavailable(f"rank {self.rank}: no NCCL unique id arrived for engine channels {missing}")
        nb.group_start()
        try:
            for k in mine:
                me = 0 if k.src == self.rank else 1
                self.comms[k] = nb.comm_init_rank_scalable(2, me, 1, bytearray(ids[k]), 0)
        finally:
            nb.group_end()
        self._warm_up(mine)

    def resync(self, keys: Sequence[Key], exchange: Callable[[bytes, str], list[bytes]]) -> bool:
        """Collective, after a CollectiveTimeout (``Executor.reset``): when any rank lost
        communicators of ``keys`` (it aborted them: a peer was dead or late), every rank aborts
        its own communicators of ``keys`` and all connect anew. Whether to reconnect must be
        agreed: a rank that never aborted (say the peer that did not call) still holds its end of
        the broken pair, and a reconnect on one side only would wait for the other forever.
        Returns whether it reconnected. Every rank passes the same keys."""
        keys = sorted(set(keys))
        lost = any(k not in self.comms for k in keys if self.rank in (k.src, k.dst))
        flags = exchange(b"\x01" if lost else b"\x00", f"engine reconnect after abort {keys}")
        if not any(f == b"\x01" for f in flags):
            return False
        stale = [self.comms.pop(k) for k in keys if k in self.comms]
        if stale:
            nb = self._b()
            for c in stale:
                try:
                    nb.comm_abort(c)
                except Exception:  # noqa: BLE001 - an already broken communicator is dropped all the same
                    pass
        self.connect(keys, exchange)
        return True

    def _warm_up(self, keys: Sequence[Key]) -> None:
        """Connect every new channel now, all in one NCCL group: NCCL connects point-to-point
        peers lazily, in a blocking handshake inside the first send or receive, so two ranks whose
        first engine call is a send to each other (on different channels) would wait for each
        other forever inside ``ncclSend``."""
        from mscclang.runtime import cuda as cu

        nb = self._b()
        drv = cu.driver()
        buf = cu.mem_alloc(16)
        s = cu.check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        try:
            nb.group_start()
            try:
                for k in keys:
                    if k.src == self.rank:
                        nb.send(buf, 1, NCCL_UINT8, 1, self.comms[k], cu.ptr(s))
                    else:
                        nb.recv(buf, 1, NCCL_UINT8, 0, self.comms[k], cu.ptr(s))
            finally:
                nb.group_end()
            cu.check(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
        finally:
            drv.cuStreamDestroy(s)
            cu.mem_free(buf)

    def comm(self, key: Key) -> Any:
        c = self.comms.get(key)
        if c is None:
            raise RuntimeUnavailable(f"internal: engine channel {key} was not connected")
        return c

    def send(self, ptr: int, nbytes: int, comm: Any, stream: int) -> None:
        if nbytes:
            self._b().send(ptr, nbytes, NCCL_UINT8, 1, comm, stream)

    def recv(self, ptr: int, nbytes: int, comm: Any, stream: int) -> None:
        if nbytes:
            self._b().recv(ptr, nbytes, NCCL_UINT8, 0, comm, stream)

    def check(self) -> Optional[str]:
        """The first communicator's asynchronous error, or None."""
        if not self.comms:
            return None
        nb = self._b()
        for k, c in self.comms.items():
            err = int(nb.comm_get_async_error(c))
            if err not in (0, 7):   # 7: ncclInProgress
                return f"NCCL error {err} on engine channel {k}"
        return None

    def close(self, abort: bool = False) -> None:
        """Destroy the communicators (abort them when ``abort``: a peer may be gone)."""
        if not self.comms:
            return
        nb = self._b()
        for c in self.comms.values():
            try:
                if abort or self.aborted:
                    nb.comm_abort(c)
                else:
                    nb.comm_destroy(c)
            except Exception:  # noqa: BLE001 - closing must not raise past close()
                pass
        self.comms.clear()
