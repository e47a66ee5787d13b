"""A small builder for writing execution plans by hand (tests, experiments, broken plans).

It keeps the bookkeeping of the plan format (global channel lists, thread-block-local channel
and remote-buffer indexes) so that ops can name peers and buffers directly::

    b = PlanBuilder("ag", "allgather", 2, input_chunks=1, output_chunks=2)
    for r in range(2):
        p = 1 - r
        b.op(r, 0, "put", src=[L("i", 0, 1)], dst=[R(p, "o", r, 1)], channels=[p])
        ...
    plan = b.build()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from mscclang.plan.io import plan_from_dict
from mscclang.plan.models import PLAN_FORMAT, Plan


@dataclass(frozen=True)
class L:
    """A local chunk range: buffer kind ``"i"``/``"o"``/``"s"``."""
    kind: str
    index: int
    size: int = 1


@dataclass(frozen=True)
class R:
    """A chunk range of ``rank``'s buffer ``kind``, reached through the op's channel type."""
    rank: int
    kind: str
    index: int
    size: int = 1


@dataclass(frozen=True)
class S:
    """A chunk range of the multicast view of global switch channel ``switch``."""
    switch: int
    index: int
    size: int = 1


Ref = Union[L, R, S]
ChanSpec = Union[int, tuple[int, int]]


class _Rank:
    def __init__(self) -> None:
        self.peers: dict[str, list[int]] = {"memory": [], "port": []}
        self.switch: list[tuple[str, list[int]]] = []
        self.remote: list[list[Any]] = []          # [rank, kind, [access types]]
        self.tbs: dict[int, dict] = {}
        self.semaphores: list[int] = []


class PlanBuilder:
    """Builds a :class:`~mscclang.plan.models.Plan` op by op."""

    def __init__(self, name: str, collective: str, num_ranks: int, input_chunks: int,
                 output_chunks: int, scratch_chunks: int = 0, **plan_fields: Any) -> None:
        self.name = name
        self.collective = collective
        self.n = num_ranks
        self.chunks = (input_chunks, output_chunks, scratch_chunks)
        self.fields = plan_fields
        self.ranks = [_Rank() for _ in range(num_ranks)]
        self.scratch_override: dict[int, int] = {}

    # resources ---------------------------------------------------------------------------
    def channel(self, rank: int, peer: int, k: int = 0, ctype: str = "memory") -> int:
        """Global index of the ``k``-th ``ctype`` channel from ``rank`` to ``peer`` (created on
        first use, in order)."""
        lst = self.ranks[rank].peers[ctype]
        while lst.count(peer) <= k:
            lst.append(peer)
        idx = [i for i, p in enumerate(lst) if p == peer]
        return idx[k]

    def switch(self, rank: int, kind: str, ranks: Sequence[int]) -> int:
        """Global index of the switch channel of ``rank`` over ``ranks``' buffer ``kind``."""
        sw = self.ranks[rank].switch
        key = (kind, list(ranks))
        if key not in sw:
            sw.append(key)
        return sw.index(key)

    def semaphore(self, rank: int, init_value: int = 0) -> int:
        self.ranks[rank].semaphores.append(init_value)
        return len(self.ranks[rank].semaphores) - 1

    def set_scratch(self, rank: int, chunks: int) -> None:
        self.scratch_override[rank] = chunks

    def _tb(self, rank: int, tb: int) -> dict:
        tbs = self.ranks[rank].tbs
        for t in range(tb + 1):
            tbs.setdefault(t, {"channels": {"memory": [], "port": [], "switch": []},
                               "remote": {"memory": [], "port": [], "switch": []}, "ops": []})
        return tbs[tb]

    def _tb_channel(self, rank: int, tb: int, ctype: str, gidx: int) -> int:
        lst = self._tb(rank, tb)["channels"][ctype]
        if gidx not in lst:
            lst.append(gidx)
        return lst.index(gidx)

    def _remote(self, rank: int, tb: int, ctype: str, peer: int, kind: str) -> int:
        rem = self.ranks[rank].remote
        for i, (r, k, types) in enumerate(rem):
            if r == peer and k == kind:
                if ctype not in types:
                    types.append(ctype)
                break
        else:
            rem.append([peer, kind, [ctype]])
            i = len(rem) - 1
        lst = self._tb(rank, tb)["remote"][ctype]
        if i not in lst:
            lst.append(i)
        return lst.index(i)

    # ops ---------------------------------------------------------------------------------
    def mkop(self, rank: int, tb: int, name: str, src: Sequence[Ref] = (), dst: Sequence[Ref] = (),
             channels: Sequence[ChanSpec] = (), ctype: Optional[str] = None,
             **fields: Any) -> dict:
        """An op record for ``rank``'s block ``tb`` (not appended; see :meth:`op`)."""
        self._tb(rank, tb)
        refs = list(src) + list(dst)
        if ctype is None:
            if any(isinstance(r, S) for r in refs):
                ctype = "switch"
            elif channels or any(isinstance(r, R) for r in refs):
                ctype = "memory"
            else:
                ctype = "none"
        d: dict[str, Any] = {"name": name}

        def conv(r: Ref) -> dict:
            if isinstance(r, L):
                return {"type": r.kind, "index": r.index, "size": r.size}
            if isinstance(r, R):
                return {"buffer_id": self._remote(rank, tb, ctype, r.rank, r.kind),  # type: ignore[arg-type]
                        "index": r.index, "size": r.size}
            return {"switch_channel_id": self._tb_channel(rank, tb, "switch", r.switch),
                    "index": r.index, "size": r.size}

        if src:
            d["src_buff"] = [conv(r) for r in src]
        if dst:
            d["dst_buff"] = [conv(r) for r in dst]
        if ctype == "switch":
            sws = sorted({r.switch for r in refs if isinstance(r, S)})
            d["channel_ids"] = [self._tb_channel(rank, tb, "switch", s) for s in sws]
        elif channels:
            ids = []
            for c in channels:
                peer, k = (c, 0) if isinstance(c, int) else c
                g = self.channel(rank, peer, k, ctype)
                ids.append(self._tb_channel(rank, tb, ctype, g))
            d["channel_ids"] = ids
        d["channel_type"] = ctype
        d.update(fields)
        return d

    def op(self, rank: int, tb: int, name: str, src: Sequence[Ref] = (), dst: Sequence[Ref] = (),
           channels: Sequence[ChanSpec] = (), ctype: Optional[str] = None, **fields: Any) -> dict:
        """Append an op to ``rank``'s block ``tb``; returns the record (mutable until build)."""
        d = self.mkop(rank, tb, name, src, dst, channels, ctype, **fields)
        self._tb(rank, tb)["ops"].append(d)
        return d

    def nop(self, rank: int, tb: int) -> dict:
        return self.op(rank, tb, "nop")

    def pipeline(self, rank: int, tb: int, unit_size: int, num_chunks: int,
                 ops: Sequence[dict]) -> dict:
        d = {"name": "pipeline", "channel_type": "none",
             "iter_context": {"unit_size": unit_size, "num_chunks": num_chunks}, "ops": list(ops)}
        self._tb(rank, tb)["ops"].append(d)
        return d

    # output ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        gpus = []
        cin, cout, cs = self.chunks
        for r, st in enumerate(self.ranks):
            chans = [{"channel_type": ctype, "connected_to": list(st.peers[ctype])}
                     for ctype in ("memory", "port") if st.peers[ctype]]
            chans += [{"channel_type": "switch", "buffer_type": kind,
                       "rank_groups": [{"size": len(ranks), "ranks": list(ranks)}]} for kind, ranks in st.switch]
            tbs = []
            for t in sorted(st.tbs):
                tb = st.tbs[t]
                tbs.append({
                    "id": t,
                    "ops": tb["ops"],
                    "channels": [{"channel_type": k, "channel_ids": v} for k, v in tb["channels"].items() if v],
                    "remote_buffer_refs": [{"access_channel_type": k, "remote_buffer_ids": v}
                                           for k, v in tb["remote"].items() if v],
                })
            gpus.append({
                "id": r, "input_chunks": cin, "output_chunks": cout,
                "scratch_chunks": self.scratch_override.get(r, cs),
                "threadblocks": tbs, "channels": chans,
                "remote_buffers": [{"rank": a, "type": k, "access_channel_types": list(t)} for a, k, t in st.remote],
                "semaphores": [{"init_value": v} for v in st.semaphores],
            })
        d = {"format": PLAN_FORMAT, "name": self.name, "collective": self.collective,
             "num_ranks": self.n, "gpus": gpus}
        d.update(self.fields)
        return d

    def build(self) -> Plan:
        return plan_from_dict(self.to_dict())
