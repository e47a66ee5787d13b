"""The data movement of a simulation: plain copies and reductions, and the LL packet model
(packets consumed as their flags arrive, flag wake-ups, packet clocks), with the symbolic
shadows that follow every byte moved.

Packet ops progress packet by packet: a group consumes whatever packets are ready and waits for
the rest, so two blocks streaming packets to each other both progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from mscclang.plan.models import BufferKind, OpName
from mscclang.sim.dtypes import reduce_bytes
from mscclang.sim.program import COp, Group, Operand
from mscclang.sim.races import Actor, OpRef
from mscclang.sim.state import RankMemory
from mscclang.sim.tasks import Task, Wait

@dataclass
class Sym:
    """The symbolic shadow of a range: per granule its counts of input chunks and its expression
    id (:mod:`mscclang.sim.exprs`)."""

    counts: np.ndarray
    ids: np.ndarray


def _sym_get(m: RankMemory, key: str, lo: int, hi: int, step: int) -> Sym:
    return Sym(m.shadow[key][lo:hi:step].copy(), m.expr[key][lo:hi:step].copy())  # type: ignore[index]


def _sym_set(m: RankMemory, key: str, lo: int, hi: int, step: int, sh: Optional[Sym]) -> None:
    """Rows [lo, hi) (every ``step``-th) of the shadow of ``key`` get ``sh``, or nothing (None)."""
    m.shadow[key][lo:hi:step] = 0 if sh is None else sh.counts  # type: ignore[index]
    m.expr[key][lo:hi:step] = 0 if sh is None else sh.ids  # type: ignore[index]


PKT_WRITERS = frozenset({OpName.cpkt, OpName.ppkt, OpName.rppkt, OpName.respkt, OpName.recpkt,
                         OpName.recspkt, OpName.gstorepkt})


class PacketMixin:
    """Data movement and packets; mixed into :class:`mscclang.sim.engine.Simulation`, whose
    ``mem``, ``log``, ``ll16``, ``dtype``, ``reduce_op``, ``accum``, ``flag_pages``, ``sym_granule``,
    ``sym_ok`` and ``_record`` it uses."""

    def _exec_group(self, task: Task, actor: Actor, cop: COp, g: Group, rank: int, flag: int,
                    half: int, launch: int, opref: OpRef, single: bool,
                    raw: bool = False) -> Iterator:
        """Run one group (a copy or a reduction over pieces), consuming ready packets.

        ``raw`` (a port proxy): the block checked the source packets' flags before posting the
        request and the proxy copies the bytes as they are, never waiting. Packets that no
        longer carry the request's flag were overwritten by a later launch before the proxy got
        to them: the proxy still reads them, as a plain read ordered by nothing the flags say
        (so the overwrite, and the hand-over of that scratch, race with it)."""
        mem = self.mem
        nsrc = len(g.srcs)
        pkt_op = any(o.packet for o in g.srcs) or any(o.packet for o in g.dsts)
        unit = (8 if self.ll16 else 4) if pkt_op else 16
        pos = 0
        for piece in g.pieces:
            done = 0
            L0 = piece.length
            while done < L0:
                n = L0 - done
                stale: set[int] = set()
                for i, s in enumerate(g.srcs):
                    if s.packet:
                        r = mem[s.rank].ready_bytes(piece.offsets[i] + done, n, flag, half)
                        if r < n and raw:
                            stale.add(i)
                        elif r < n:
                            n = r
                            if n == 0:
                                addr = half + 8 * ((piece.offsets[i] + done) // 4)
                                yield Wait(("flag", s.rank, addr >> 7),
                                           f"packets of rank {s.rank} scratch at payload offset "
                                           f"{piece.offsets[i] + done} with flag {flag}",
                                           ("flag", s.rank))
                                break
                if n == 0:
                    continue
                datas = []
                shadows = []
                for i, s in enumerate(g.srcs):
                    off = piece.offsets[i] + done
                    m = mem[s.rank]
                    key, base = m.alias[s.kind]
                    if s.kind == BufferKind.scratch:
                        base += half
                    if s.packet:
                        datas.append(m.read_packets(off, n, half))
                        w0 = off // 4
                        w1 = -(-(off + n) // 4)
                        a = half + 8 * w0
                        b = half + 8 * w1
                        if self.log is not None and i not in stale:
                            for c in self.log.packet_clocks(f"rank{s.rank}.scr", a, b):
                                np.maximum(actor.rvc, c, out=actor.rvc)
                        self._record(actor, s.rank, key, a, b, False, opref, launch,
                                     delta=a - 2 * (pos + done), unit=unit,
                                     packet=i not in stale, single=single)
                        if m.shadow is not None:
                            shadows.append(self._sh_get(m, "scr", off, n, half))
                    else:
                        a = base + off
                        datas.append(m.storage[key][a: a + n].copy())
                        self._record(actor, s.rank, key, a, a + n, False, opref, launch,
                                     delta=a - (pos + done), unit=unit, single=single)
                        if m.shadow is not None:
                            shadows.append(self._sh_get(m, key, a, n))
                if g.reduce and nsrc > 1:
                    rop = "sum" if cop.op.name == OpName.radd else self.reduce_op
                    result = reduce_bytes(datas, self.dtype, rop, self.accum)
                    sh = None
                    if shadows and all(x is not None for x in shadows):
                        counts = shadows[0].counts.astype(np.int16)
                        for x in shadows[1:]:
                            counts = counts + x.counts
                        sh = Sym(counts, self.exprs.reduce([x.ids for x in shadows], self._op_label(opref, cop),
                                                          (cop.name, cop.op.src or self._op_label(opref, cop)), opref.rank))
                else:
                    result = datas[0]
                    sh = shadows[0] if shadows else None
                for j, d in enumerate(g.dsts):
                    off = piece.offsets[nsrc + j] + done
                    self._write(actor, rank, d, off, result, sh, flag, half, launch, opref,
                                delta_pos=pos + done, unit=unit, single=single)
                done += n
            pos += L0
        for (k, a, b) in g.pads:
            d = g.dsts[k]
            m = mem[d.rank]
            s0, s1 = m.pad_packets(a, b, flag, self.ll16, half)
            if s1 > s0:
                self._record(actor, d.rank, "scr", s0, s1, True, opref, launch, delta=0,
                             unit=unit, packet=True, single=single)
                if m.shadow is not None:
                    self._sh_clear(m, s0, s1)
                self._wake_flags(d.rank, s0, s1)

    def _write(self, actor: Actor, rank: int, d: Operand, off: int, data: np.ndarray,
               sh: Optional[Sym], flag: int, half: int, launch: int, opref: OpRef,
               delta_pos: int, unit: int, single: bool) -> None:
        m = self.mem[d.rank]
        key, base = m.alias[d.kind]
        n = data.shape[0]
        if d.packet:
            s0, s1 = m.write_packets(off, data, flag, self.ll16, half)
            self._record(actor, d.rank, key, s0, s1, True, opref, launch,
                         delta=s0 - 2 * delta_pos, unit=unit, packet=True, single=single)
            if m.shadow is not None:
                self._sh_put(m, "scr", off, n, sh, half)
            self._wake_flags(d.rank, s0, s1)
        else:
            if d.kind == BufferKind.scratch:
                base += half
            a = base + off
            m.storage[key][a: a + n] = data
            self._record(actor, d.rank, key, a, a + n, True, opref, launch,
                         delta=a - delta_pos, unit=unit, single=single)
            if m.shadow is not None:
                self._sh_put(m, key, a, n, sh)

    # symbolic shadows (one row of symbol counts and one expression id per granule of
    # ``sym_granule`` bytes: 4, or a larger power of two when every access of the run is aligned
    # to it)
    def _sh_rows(self, off: int, n: int, half: Optional[int] = None) -> Optional[tuple[int, int, int]]:
        """The shadow rows (first, end, step) of bytes [off, off + n): plain, or with ``half`` the
        packets of those payload offsets in the scratch half at ``half`` (every other row). None,
        voiding the run's symbolic results, when the bytes are not whole granules."""
        g = self.sym_granule
        if off % g or n % g or (half or 0) % g:
            self.sym_ok = False
            return None
        if half is None:
            return off // g, (off + n) // g, 1
        return half // g + 2 * (off // g), half // g + 2 * ((off + n) // g), 2

    def _sh_get(self, m: RankMemory, key: str, off: int, n: int, half: Optional[int] = None) -> Optional[Sym]:
        """The shadow of bytes [off, off + n) of ``key`` (with ``half``: packets in scratch)."""
        rows = self._sh_rows(off, n, half)
        return None if rows is None else _sym_get(m, key, *rows)

    def _sh_put(self, m: RankMemory, key: str, off: int, n: int, sh: Optional[Sym], half: Optional[int] = None) -> None:
        """Bytes [off, off + n) of ``key`` (with ``half``: packets in scratch) get the shadow ``sh``."""
        rows = self._sh_rows(off, n, half)
        if rows is None or sh is None:
            self.sym_ok = False
        else:
            _sym_set(m, key, *rows, sh)

    def _sh_clear(self, m: RankMemory, s0: int, s1: int) -> None:
        """Scratch bytes [s0, s1) now hold zero-payload packets."""
        rows = self._sh_rows(s0, s1 - s0)
        if rows is not None:
            _sym_set(m, "scr", *rows, None)

    def _op_label(self, opref: OpRef, cop: COp) -> str:
        """How a consistency report names the op that computed a value."""
        return f"rank {opref.rank} tb {opref.tb} op {cop.index} {cop.name}"

    def _wake_flags(self, rank: int, s0: int, s1: int) -> None:
        """Wake tasks waiting for packets whose flags lie in scratch bytes [s0, s1) of rank."""
        pages = self.flag_pages.get(rank)
        if not pages:
            return
        p0, p1 = s0 >> 7, (s1 - 1) >> 7
        if p1 - p0 + 1 > len(pages):
            hits = [pg for pg in pages if p0 <= pg <= p1]
        else:
            hits = [pg for pg in range(p0, p1 + 1) if pg in pages]
        for pg in hits:
            pages.pop(pg, None)
            self._wake(("flag", rank, pg))
