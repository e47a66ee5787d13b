"""The kernel's arithmetic over a plan with segments, on the host (tests only): what every block
computes from the count matrix for a segment record (``executor/interpreter.cuh``: ``run_data``'s
run-time total, the thread-block-group split, each piece's offsets) and which count check fails
first (``counts_ok``), so CPU tests hold the device format to the simulator and to the CPU rule
(:func:`mscclang.plan.segments.check_counts`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from mscclang.plan.layout import Piece
from mscclang.runtime.counted import (
    CHECK_EXPECT, CHECK_INPUT, CHECK_NONNEG, CHECK_OUTPUT, CHECK_SCRATCH, SEG_SLOT, CountTables,
)
from mscclang.runtime.spec_source import Rec, op_range


def check_failure(tables: CountTables, m: Sequence[Sequence[int]], capacity: int) -> Optional[dict[str, int]]:
    """The error record fields the kernel writes for matrix ``m`` (None: the counts pass): the
    first failing check's ``kind``, ``rank``, entry ``i``, ``j`` (-1 for sums), ``seen`` (the
    count, sum or sender's count) and ``bound``."""
    n = tables.n
    for c in tables.checks:
        if c.kind == CHECK_EXPECT:
            for j in range(n):
                want = m[c.rank][n + 2 + j]
                if want >= 0 and want != m[j][c.rank]:
                    return dict(kind=c.kind, rank=c.rank, i=c.rank, j=j, seen=m[j][c.rank], bound=want)
            continue
        ents = tables.entries(c.first, c.count)
        if c.kind in (CHECK_INPUT, CHECK_OUTPUT):
            total = sum(m[i][j] for i, j in ents)
            bound = m[c.rank][n if c.kind == CHECK_INPUT else n + 1]
            if total > bound:
                return dict(kind=c.kind, rank=c.rank, i=-1, j=-1, seen=total, bound=bound)
            continue
        for i, j in ents:
            v = m[i][j]
            if (c.kind == CHECK_NONNEG and v < 0) or (c.kind == CHECK_SCRATCH and v > capacity):
                return dict(kind=c.kind, rank=c.rank, i=i, j=j, seen=v, bound=0 if c.kind == CHECK_NONNEG else capacity)
    return None


@dataclass(frozen=True)
class EvalPiece:
    """One piece of a segment record as the kernel computes it: ``length`` bytes at the plain
    byte ``offsets`` of each operand's buffer (packet operands live at twice those)."""

    length: int
    offsets: tuple[int, ...]


def evaluate_record(rec: Rec, tables: CountTables, m: Sequence[Sequence[int]], row_bytes: int,
                    capacity: int) -> list[EvalPiece]:
    """The byte pieces a block moves for segment record ``rec``
    (:class:`~mscclang.runtime.spec_source.Rec`) and matrix ``m``: the kernel's ``run_data``
    over segments (run-time total, the thread-block-group split, each piece's offsets)."""

    def offset(w: int) -> int:
        k, lo = w >> 32, w & 0xFFFFFFFF
        if lo == SEG_SLOT:
            return k * capacity * row_bytes
        return row_bytes * sum(m[i][j] for i, j in tables.entries(lo, k))

    lens = [m[e // tables.n][e % tables.n] * row_bytes for e, _, _ in rec.pieces]
    a, b = op_range(dataclasses.replace(rec, total=sum(lens)), None, 0)
    out: list[EvalPiece] = []
    pos = 0
    for ln, (_, _, words) in zip(lens, rec.pieces):
        lo, hi = max(a, pos), min(b, pos + ln)
        if lo < hi:
            out.append(EvalPiece(hi - lo, tuple(offset(w) + lo - pos for w in words)))
        pos += ln
    return out


def merged(pieces: Sequence[Union[Piece, EvalPiece]]) -> list[tuple[int, tuple[int, ...]]]:
    """``(length, offsets)`` of ``pieces`` with empty ones dropped and adjacent ones merged (to
    compare cuts of the same bytes)."""
    out: list[tuple[int, tuple[int, ...]]] = []
    for p in pieces:
        if p.length <= 0:
            continue
        if out and all(a + out[-1][0] == b for a, b in zip(out[-1][1], p.offsets)):
            out[-1] = (out[-1][0] + p.length, out[-1][1])
        else:
            out.append((p.length, tuple(p.offsets)))
    return out


