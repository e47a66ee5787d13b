"""Rank consistency: after a reduction every rank that holds an output element holds the same
bits (docs/semantics.md, "Rank consistency").

Two checks, both reporting problems of kind ``inconsistent``:

* symbolic (:func:`check_symbolic_consistency`): in a symbolic run every granule of every
  output carries the interned tree of how its value was computed (:mod:`mscclang.sim.exprs`);
  output chunks that the collective defines as the same reduction (every rank's chunk ``c`` of
  an allreduce) must carry equal trees: the same sources, in the same order and grouping,
  rounded at the same points. A race-free plan's data flow does not depend on the schedule, so
  one run proves it for every schedule, size of the same chunk grid, and launch;
* numeric (:func:`check_numeric_consistency`): in every run, those chunks' bytes are compared.

A problem names the output chunk, the two ranks, the two reduction orders and the ops that
computed them (with their DSL lines), and how many chunks the same pair of ops differs in. Its
severity follows the plan's promise (:func:`consistency_level`).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np

from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.layout import Layout
from mscclang.plan.models import BufferKind, Plan
from mscclang.sim.exprs import ExprTable
from mscclang.sim.report import Problem

KIND = "inconsistent"


def consistency_level(plan: Plan) -> Optional[str]:
    """How an ``inconsistent`` finding counts for ``plan``: ``"error"`` when the plan promises
    rank consistency (``consistent: true``, every library plan), ``"warning"`` when it says
    nothing (user and imported plans: ``--strict`` fails it), None when it disclaims it
    (``consistent: false``: a note)."""
    if plan.consistent is None:
        return "warning"
    return "error" if plan.consistent else None


def _groups(spec: CollectiveSpec) -> list[list[tuple[int, int]]]:
    """The (rank, output chunk) sets that the postcondition defines as one reduction of two or
    more input chunks, each set in rank order, only those held by two or more ranks."""
    from mscclang.sim.postcondition import postcondition_of

    by: dict[tuple, list[tuple[int, int]]] = {}
    for (r, c), exp in sorted(postcondition_of(spec).items()):
        if exp.reduced and len(exp.sources) > 1:
            by.setdefault(tuple(exp.sources), []).append((r, c))
    return [m for m in by.values() if len({r for r, _ in m}) > 1]


def _same_pairs(spec: CollectiveSpec, layouts: Sequence[Layout]) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(first rank of a :func:`_groups` set, its chunk's output offset, another rank of the set, its
    output chunk, that chunk's offset, the length both have): every output chunk that must hold
    the bits of the first chunk of its set (another rank's, of the same length)."""
    for members in _groups(spec):
        r0, c0 = members[0]
        off0, ln0 = layouts[r0].span(BufferKind.output, c0)
        for r, c in members[1:]:
            off, ln = layouts[r].span(BufferKind.output, c)
            if ln == ln0 and r != r0:
                yield r0, off0, r, c, off, ln


class ChunkFindings:
    """Findings of chunks gathered per cause (for ``inconsistent``: the other rank and the pair
    of top ops), one problem of ``kind`` each, listing its chunks; ``level`` goes to its details."""

    def __init__(self, launch: object, level: Optional[str], kind: str = KIND) -> None:
        self.launch = launch
        self.level = level
        self.kind = kind
        self.found: dict[tuple, dict] = {}

    def add(self, key: tuple, chunk: str, message: str, details: dict) -> None:
        got = self.found.get(key)
        if got is None:
            self.found[key] = {"message": message, "chunks": [chunk], "details": details}
        elif chunk not in got["chunks"]:
            got["chunks"].append(chunk)

    def problems(self) -> list[Problem]:
        out = []
        for f in self.found.values():
            chunks = f["chunks"]
            sep = "\n  " if "\n" in f["message"] else " "   # a message of several lines: one more
            more = (f"{sep}(and {len(chunks) - 1} more chunk{'s' * (len(chunks) != 2)}: {', '.join(chunks[1:6])}"
                    f"{'...' if len(chunks) > 6 else ''})" if len(chunks) > 1 else "")
            out.append(Problem(self.kind, f["message"] + more, details={**f["details"], "chunks": chunks,
                                                                   "level": self.level}))
        return out


def _compare(table: ExprTable, ra: int, ia: np.ndarray, rb: int, ib: np.ndarray, what: str,
             found: ChunkFindings) -> None:
    """Record where granule ids ``ia`` (rank ``ra``) and ``ib`` (rank ``rb``) of ``what`` differ."""
    bad = np.nonzero(ia != ib)[0]
    if bad.size == 0:
        return
    for j in bad.tolist():
        a, b = int(ia[j]), int(ib[j])
        fp8_only = table.flat(a) == table.flat(b)
        opa, opb = table.ops_in(a, ra), table.ops_in(b, rb)
        key = (rb, table.by_rank(table.cause_of, a, ra) or ("copy",), table.by_rank(table.cause_of, b, rb) or ("copy",),
               fp8_only)
        if key in found.found:
            found.add(key, what, "", {})
            continue
        dtypes = ("fp8 (which rounds once per op, so the ops' boundaries differ)" if fp8_only
                  else "floating-point sums (fp16, bf16, fp32, fp8)")
        msg = (f"rank {ra} and rank {rb} compute {what} (launch {found.launch}) differently, so their "
               f"{dtypes} differ in bits: rank {ra} computes {table.render(a, ra)}"
               f" [{'; '.join(opa) or 'a copy'}], rank {rb} computes {table.render(b, rb)} "
               f"[{'; '.join(opb) or 'a copy'}] (xR[k]: rank R's input chunk k; a + b + c adds left to right)")
        found.add(key, what, msg, {"ranks": (ra, rb), "orders": (table.render(a, ra), table.render(b, rb)),
                                   "ops": (opa, opb), "fp8_only": fp8_only, "how": "symbolic",
                                   "cause": key[1:]})
        return


def check_symbolic_consistency(spec: CollectiveSpec, layouts: Sequence[Layout], out_exprs: Sequence[np.ndarray],
                               table: ExprTable, granule: int, launch: int, level: Optional[str],
                               res_exprs: Optional[Sequence[np.ndarray]] = None) -> list[Problem]:
    """The ``inconsistent`` problems of one launch of a symbolic run (see the module docstring):
    ``out_exprs[r]`` holds rank ``r``'s output granule ids; for the fused collective
    ``res_exprs[r]`` its residual's, and every rank's whole residual and output are compared."""
    found = ChunkFindings(launch, level)
    if spec.row.fused:
        for name, exprs, kind in (("residual", res_exprs, BufferKind.residual),
                                  ("output", out_exprs, BufferKind.output)):
            if exprs is None:
                continue
            lay0 = layouts[0]
            grid = lay0.grid(kind)
            for r in range(1, len(exprs)):
                if name == "output" and any(k[0] == r for k in found.found):
                    continue   # its residual differs already: the norm of it follows
                for c in range(grid.num_chunks if grid is not None else 0):
                    off, ln = lay0.span(kind, c)
                    lo, hi = off // granule, (off + ln) // granule
                    _compare(table, 0, exprs[0][lo:hi], r, exprs[r][lo:hi], f"{name} chunk {c}", found)
        return found.problems()
    for r0, off0, r, c, off, ln in _same_pairs(spec, layouts):
        _compare(table, r0, out_exprs[r0][off0 // granule: (off0 + ln) // granule], r,
                 out_exprs[r][off // granule: (off + ln) // granule], f"output chunk {c}", found)
    return found.problems()


def check_numeric_consistency(spec: CollectiveSpec, layouts: Sequence[Layout], outputs: Sequence[np.ndarray],
                              launch: int, level: Optional[str],
                              residuals: Optional[Sequence[np.ndarray]] = None) -> list[Problem]:
    """The ``inconsistent`` problems of one launch's outputs (byte arrays per rank): chunks
    defined as the same reduction must hold the same bytes on every rank; for the fused
    collective (``residuals``: the ranks' residuals after the launch) the whole residual and
    output."""
    found = ChunkFindings(launch, level)

    def cmp(ra: int, a: np.ndarray, rb: int, b: np.ndarray, what: str) -> None:
        if a.shape == b.shape and np.array_equal(a, b):
            return
        i = int(np.argmax(a != b)) if a.shape == b.shape else 0
        found.add((rb,), what, f"rank {ra} and rank {rb} hold different bytes in {what} (launch {launch}; first at "
                  f"byte {i}): their results are not the same bits", {"ranks": (ra, rb), "how": "numeric"})

    if spec.row.fused:
        for name, bufs in (("residual", residuals), ("output", outputs)):
            for r in range(1, len(bufs or ())):
                cmp(0, np.asarray(bufs[0]).view(np.uint8), r, np.asarray(bufs[r]).view(np.uint8), f"the {name}")
        return found.problems()
    for r0, off0, r, c, off, ln in _same_pairs(spec, layouts):
        cmp(r0, outputs[r0][off0: off0 + ln], r, outputs[r][off: off + ln], f"output chunk {c}")
    return found.problems()


def drop_numeric_duplicates(problems: list[Problem]) -> list[Problem]:
    """``problems`` without the numeric ``inconsistent`` findings of rank pairs a symbolic one
    names (it says more: the orders and the ops)."""
    sym = {p.details["ranks"] for p in problems if p.kind == KIND and p.details.get("how") == "symbolic"}
    return [p for p in problems if not (p.kind == KIND and p.details.get("how") == "numeric"
                                        and p.details["ranks"] in sym)]
