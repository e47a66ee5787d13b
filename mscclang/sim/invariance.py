"""Batch invariance: every reduced output element is exactly the canonical expression, so its bits
depend on the ranks' inputs alone, never on the message size, the plan or the batch
(docs/semantics.md, "Batch invariance"; docs/verify.md, ``batch-variant``).

The canonical expression of a reduced output element is one reduction of the postcondition's
sources in rank order 0..n-1, left to right; of the fused collective's residual chunk ``c`` that
sum then the residual (``x0[c] + ... + x{n-1}[c] + res[c]``), of its output the norm of that
residual. It is built in the symbolic run's own :class:`~mscclang.sim.exprs.ExprTable` and each
output granule's tree is compared with it in the form its dtype demands:

* ``flat`` (fp16, bf16, fp32, integers: every binary step rounds to the dtype): nested left-first
  reductions splice, so ``(x0 + x1) + x2`` is ``x0 + x1 + x2``;
* ``strict`` (fp8: rounded once per op): the canonical is one op over every source in rank order.

In both the first two operands commute (``x1 + x0`` is ``x0 + x1``); nothing else. A race-free
plan's data flow does not depend on the schedule, so one symbolic run per size proves a size;
:func:`proof_sizes` are the sizes whose chunk grids cover every size the plan serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.layout import Layout
from mscclang.plan.models import BufferKind, Plan
from mscclang.sim.consistency import ChunkFindings
from mscclang.sim.diagnosis import Findings, annotate_sources
from mscclang.sim.dtypes import accumulates
from mscclang.sim.exprs import ExprTable, Node
from mscclang.sim.postcondition import postcondition_of
from mscclang.sim.report import Problem, Report

KIND = "batch-variant"
#: the comparison forms: ``flat`` for dtypes rounded at every binary step, ``strict`` for fp8
FORMS = ("flat", "strict")
_WHY = {"flat": "fp16, bf16, fp32 and integer sums",
        "strict": "fp8 sums (rounded once per op: the canonical is one op over every source in rank order)"}


@dataclass
class InvarianceProof:
    """What :func:`prove_batch_invariant` found: the ``batch-variant`` problems (their ops'
    program lines added), the sizes (bytes) proven and those whose data moves could not be
    followed symbolically."""

    problems: list[Problem]
    sizes: list[int]
    skipped: list[int]

    @property
    def holds(self) -> bool:
        """No problem, and at least one size proven."""
        return not self.problems and bool(self.sizes)


def invariance_level(plan: Plan) -> Optional[str]:
    """How a ``batch-variant`` finding counts for ``plan``: ``"error"`` when it promises batch
    invariance (``batch_invariant: true``), else None (the report says whether it holds)."""
    return "error" if plan.batch_invariant else None


def forms_for(dtypes: Optional[Sequence[np.dtype]]) -> tuple[str, ...]:
    """The forms the given dtypes demand (``None``: every dtype, both forms)."""
    if dtypes is None:
        return FORMS
    return tuple(f for f, want in (("flat", any(not accumulates(d) for d in dtypes)),
                                   ("strict", any(accumulates(d) for d in dtypes))) if want)


def _red(table: ExprTable, ids: Sequence[int]) -> int:
    """The id of one reduction op over ``ids`` in this order (the first two commute)."""
    row = list(ids)
    if len(row) >= 2 and row[1] < row[0]:
        row[0], row[1] = row[1], row[0]
    return table.intern(Node("red", tuple(row)))


def canonical(table: ExprTable, sources: Sequence[tuple[int, int]], residual: Optional[int] = None,
              quant: Optional[bool] = None) -> tuple[int, str]:
    """(id, rendering) of the canonical expression of ``sources`` ((rank, input chunk) pairs in
    rank order); with ``residual`` (a chunk) that sum then the residual chunk, with ``quant``
    (not None) also the norm of it (the fused output)."""
    i = _red(table, [table.leaf("x", p, k) for p, k in sources])
    text = " + ".join(f"x{p}[{k}]" for p, k in sources)
    if residual is not None:
        i = _red(table, [i, table.leaf("res", residual)])
        text += f" + res[{residual}]"
    if quant is not None:
        i = table.intern(Node("norm", (i, quant)))
        text = f"norm({text})"
    return i, text


def _same(table: ExprTable, got: int, want: int, form: str) -> bool:
    return got == want if form == "strict" else table.flat(got) == table.flat(want)


def check_symbolic_invariance(spec: CollectiveSpec, layouts: Sequence[Layout], out_exprs: Sequence[np.ndarray],
                              table: ExprTable, granule: int, what: str, level: Optional[str],
                              forms: Sequence[str] = FORMS, res_exprs: Optional[Sequence[np.ndarray]] = None,
                              quant: bool = False, found: Optional[ChunkFindings] = None) -> list[Problem]:
    """The ``batch-variant`` problems of one launch of a symbolic run (``what`` names it, e.g.
    ``"size 4096, launch 1"``): every reduced output chunk of every rank (``out_exprs[r]``: rank
    ``r``'s output granule ids; for the fused collective also ``res_exprs[r]``, its residual's)
    whose granules are not the canonical expression in a form of ``forms``. One problem per cause
    (form and the op that computed the value), naming the chunk, the canonical expression, the
    plan's and the ops with their program lines; ``level`` goes to its details. ``found`` gathers
    the findings of several runs (sizes) into one problem per cause; the problems so far are
    returned."""
    found = ChunkFindings(what, level, KIND) if found is None else found
    fused = spec.row.fused
    for (r, c), exp in sorted(postcondition_of(spec).items()):
        if not exp.reduced or len(exp.sources) < 2:
            continue
        parts = [("residual", BufferKind.residual, res_exprs, c, None),
                 ("output", BufferKind.output, out_exprs, c, quant)] if fused else \
                [("output", BufferKind.output, out_exprs, None, None)]
        for name, kind, exprs, res, q in parts:
            if exprs is None or exprs[r] is None:
                continue
            off, ln = layouts[r].span(kind, c)
            ids = np.unique(exprs[r][off // granule: (off + ln) // granule])
            if ids.size == 0:
                continue
            want, text = canonical(table, exp.sources, res, q)
            for form in forms:
                bad = [int(i) for i in ids.tolist() if not _same(table, int(i), want, form)]
                if not bad:
                    continue
                got = bad[0]
                chunk = f"rank {r} {name} chunk {c}"
                ops = table.ops_in(got, r)
                cause = (form, table.by_rank(table.cause_of, got, r) or ("copy",))
                msg = (f"{chunk} ({what}) is not the canonical expression in {_WHY[form]}: canonical "
                       f"{text}, the plan computes {table.render(got, r)} [{'; '.join(ops) or 'a copy'}] "
                       f"(xR[k]: rank R's input chunk k; a + b + c adds left to right; (...) is rounded "
                       f"by another op)")
                found.add(cause, chunk, msg, {"rank": r, "chunk": c, "buffer": name, "form": form,
                                              "canonical": text, "plan": table.render(got, r), "ops": ops,
                                              "cause": cause})
                break   # the flat form failing, the strict one fails too
    return found.problems()


class InvarianceCheck:
    """:func:`mscclang.sim.verify.verify`'s (and the fused verify's) batch-invariance proof: the findings of its symbolic runs (the one at the
    smallest size and one at each of the ``extra`` sizes) in the forms ``dtypes`` demand (None:
    every dtype), reported as the plan's promise says (:meth:`report`)."""

    def __init__(self, plan: Plan, dtypes: Optional[Sequence[np.dtype]], extra: list[int]) -> None:
        self.plan = plan
        self.level = invariance_level(plan)
        self.forms = forms_for(dtypes)
        self.extra = extra if plan.batch_invariant is not False else []
        self.found = ChunkFindings("", self.level, KIND)
        self.proof = InvarianceProof([], [], [])

    def report(self, rep: Report, findings: Findings) -> None:
        """Errors for a promise that does not hold; otherwise a note saying whether it holds."""
        probs = self.found.problems()
        rep.batch_invariant = None if not self.proof.sizes else not probs
        sizes = f"sizes {', '.join(map(str, sorted(self.proof.sizes)))}" + (
            f"; not followed symbolically at {', '.join(map(str, self.proof.skipped))}" if self.proof.skipped else "")
        if self.level == "error" and probs:
            findings.add(probs, f"symbolic, {sizes}")
            return
        promise = {True: "promised", False: "not promised (batch_invariant: false)", None: "not promised"}[
            self.plan.batch_invariant]
        if rep.batch_invariant is None:
            rep.notes.append(f"batch invariant: not proven ({promise}): no size could be followed symbolically")
            return
        if probs:
            annotate_sources(probs[0], self.plan)
        rep.notes.append(f"batch invariant ({promise}; proven at {sizes}): "
                         + (f"no: {probs[0].message}" if probs else "yes"))
