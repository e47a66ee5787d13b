"""A group of ranks' store exchanges, the runtime's set-up steps and the CPU fallback's call
checks alike: keys under a prefix unique to the group, numbered in call order, and each
exchange carries the step's tag and the call being made, so that ranks making different calls
get :class:`~mscclang.errors.CallMismatch` on every rank, naming each rank's call, instead of
one rank's bytes paired with another step's. No GPU needed.

Store keys carry the group's name and a generation number (each rank counts the groups it
created with that name, in the same order), so a stale key is never read.
"""

from __future__ import annotations

from typing import Any, Optional

from mscclang.errors import CallMismatch


class StoreGroup:
    """Store exchanges of rank ``rank`` of ``world_size`` over ``store`` (a
    ``torch.distributed.Store`` every rank shares), waiting at most ``store_timeout_s`` for the
    others. Making one is collective (every rank makes its groups of one name in the same
    order)."""

    def __init__(self, store: Any, rank: int, world_size: int, name: str = "default",
                 store_timeout_s: float = 300.0) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.store_timeout_s = store_timeout_s
        gen = int(store.add(f"mscclang/{name}/gen/{self.rank}", 1))
        self.prefix = f"mscclang/{name}/{gen}"
        self._seq = 0
        #: the call being set up (e.g. "allreduce of 2048 B bfloat16, plan X"): it travels with
        #: every exchange so that ranks making different calls get a clear error
        self.call = ""

    def _next(self, what: str) -> str:
        self._seq += 1
        return f"{self.prefix}/{what}{self._seq}"

    def _wait(self, keys: list[str], tag: str = "", timeout_s: Optional[float] = None) -> None:
        import datetime

        t = self.store_timeout_s if timeout_s is None else timeout_s
        try:
            self.store.wait(keys, datetime.timedelta(seconds=t))
        except Exception as e:  # noqa: BLE001 - torch raises several kinds
            missing = []
            for r, k in enumerate(keys):
                try:
                    if not self.store.check([k]):
                        missing.append(r)
                except Exception:  # noqa: BLE001 - the store itself may be gone
                    missing.append(r)
            what = f" at {tag!r}" if tag else ""
            raise CallMismatch(
                f"rank {self.rank}: waited {t:.0f} s for the other ranks{what}; rank(s) {missing} did not "
                f"arrive: the ranks disagree on the call (a rank made a different call or none), or a peer "
                f"is hung or dead ({type(e).__name__})") from None

    def exchange(self, data: bytes, tag: str, timeout_s: Optional[float] = None) -> list[bytes]:
        """Every rank's ``data``, by rank, for a setup step named ``tag``. The step's tag and the
        call being set up (:attr:`call`) travel with the data: when the ranks' tags differ (they
        are setting up different calls), :class:`CallMismatch` is raised on every rank, naming what
        each rank called, instead of pairing one rank's bytes with another step's."""
        k = self._next("x")
        head = f"{tag}|{self.call}".encode("utf-8", "replace")
        self.store.set(f"{k}/{self.rank}", len(head).to_bytes(4, "little") + head + data)
        keys = [f"{k}/{r}" for r in range(self.world_size)]
        self._wait(keys, f"{tag} of {self.call}" if self.call else tag, timeout_s)
        heads, datas = [], []
        for r in range(self.world_size):
            raw = bytes(self.store.get(keys[r]))
            n = int.from_bytes(raw[:4], "little")
            heads.append(raw[4:4 + n].decode("utf-8", "replace"))
            datas.append(raw[4 + n:])
        if len(set(heads)) > 1:
            what = ", ".join(f"rank {r}: {_describe(h)}" for r, h in enumerate(heads))
            raise CallMismatch(f"ranks disagree on the call ({what})")
        return datas

    def barrier(self, tag: str = "barrier", timeout_s: Optional[float] = None) -> None:
        """Store barrier among all ranks (host side only); checks that the ranks agree on the step."""
        self.exchange(b"", tag, timeout_s)

    def allgather_bytes(self, data: bytes, tag: str = "exchange") -> list[bytes]:
        """Every rank's ``data``, by rank (see :meth:`exchange`)."""
        return self.exchange(data, tag)


def _describe(head: str) -> str:
    """``"tag|call"`` as a reader sees it: ``call (tag)``, or the tag alone."""
    tag, _, call = head.partition("|")
    return f"{call} ({tag})" if call else tag
