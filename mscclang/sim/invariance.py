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

    def ran(self, size: int, followed: bool) -> None:
        """Count a symbolic run at ``size``: proven there, or not ``followed`` symbolically."""
        (self.sizes if followed else self.skipped).append(size)

    @property
    def holds(self) -> bool:
        """No problem, and at least one size proven."""
        return not self.problems and bool(self.sizes)


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


def canonical(table: ExprTable, sources: Sequence[tuple[int, int]], residual: Optional[int] = None) -> tuple[int, str]:
    """(id, rendering) of the canonical expression of ``sources`` ((rank, input chunk) pairs in
    rank order), e.g. ``x0[2] + x1[2] + x2[2]``; with ``residual`` (a chunk) that sum then the
    residual chunk (the fused collective's residual)."""
    i = _red(table, [table.leaf("x", p, k) for p, k in sources])
    text = " + ".join(f"x{p}[{k}]" for p, k in sources)
    if residual is not None:
        i = _red(table, [i, table.leaf("res", residual)])
        text += f" + res[{residual}]"
    return i, text


def _wanted(spec: CollectiveSpec, layout: Layout, rank: int, table: ExprTable, granule: int, nbytes: int,
            texts: dict[int, str]) -> np.ndarray:
    """Per granule of ``rank``'s output (the fused collective: its residual, ``nbytes`` long) the
    canonical id of the reduced chunk it lies in (0: not a reduced chunk); ``texts`` gets each
    canonical's rendering."""
    fused = spec.row.fused
    want = np.zeros(nbytes // granule, dtype=np.int32)
    for (r, c), exp in postcondition_of(spec).items():
        if r != rank or not exp.reduced or len(exp.sources) < 2:
            continue
        off, ln = layout.span(BufferKind.residual if fused else BufferKind.output, c)
        i, text = canonical(table, exp.sources, c if fused else None)
        texts[i] = text
        want[off // granule: (off + ln) // granule] = i
    return want


def check_symbolic_invariance(spec: CollectiveSpec, layouts: Sequence[Layout], out_exprs: Sequence[np.ndarray],
                              table: ExprTable, granule: int, what: str, level: Optional[str],
                              forms: Sequence[str] = FORMS, res_exprs: Optional[Sequence[np.ndarray]] = None,
                              quant: bool = False, found: Optional[ChunkFindings] = None) -> list[Problem]:
    """The ``batch-variant`` problems of one launch of a symbolic run (``what`` names it, e.g.
    ``"size 4096, launch 1"``): every reduced output chunk of every rank (``out_exprs[r]``: rank
    ``r``'s output granule ids; for the fused collective also ``res_exprs[r]``, its residual's,
    whose output granule ``j`` must be the norm of the canonical residual granule it is computed
    from, ``j`` times the residual's bytes per output byte) whose granules are not the canonical
    expression in a form of ``forms``. One problem per cause (form and the op that computed the
    value), naming the chunk, the canonical expression, the plan's and the ops with their program
    lines; ``level`` goes to its details. ``found`` gathers the findings of several runs (sizes)
    into one problem per cause; the problems so far are returned."""
    found = ChunkFindings(what, level, KIND) if found is None else found
    texts: dict[int, str] = {}
    for r, lay in enumerate(layouts):
        if spec.row.fused:
            if res_exprs is None or res_exprs[r] is None:
                continue
            res_want = _wanted(spec, lay, r, table, granule, res_exprs[r].shape[0] * granule, texts)
            ratio = max(lay.input_bytes // max(lay.output_bytes, 1), 1)
            norms = {u: table.intern(Node("norm", (u, quant))) for u in np.unique(res_want).tolist() if u}
            texts.update({n: f"norm({texts[u]})" for u, n in norms.items()})
            out_want = np.array([norms.get(u, 0) for u in res_want[::ratio][:out_exprs[r].shape[0]].tolist()],
                                dtype=np.int32)
            parts = [("residual", BufferKind.residual, res_exprs[r], res_want),
                     ("output", BufferKind.output, out_exprs[r], out_want)]
        else:
            parts = [("output", BufferKind.output, out_exprs[r],
                      _wanted(spec, lay, r, table, granule, out_exprs[r].shape[0] * granule, texts))]
        for name, kind, got, want in parts:
            grid = lay.grid(kind)
            for c in range(grid.num_chunks if grid is not None else 0):
                off, ln = lay.span(kind, c)
                g, w = got[off // granule: (off + ln) // granule], want[off // granule: (off + ln) // granule]
                keep = w != 0
                if not keep.any():
                    continue
                pairs = np.unique(np.stack([g[keep], w[keep]], axis=1), axis=0).tolist()
                for form in forms:
                    bad = [(a, b) for a, b in pairs if (a != b if form == "strict" else table.flat(a) != table.flat(b))]
                    if bad:
                        _found(found, table, (r, c, name), what, form, bad[0][0], texts[bad[0][1]])
                        break   # the flat form failing, the strict one fails too
    return found.problems()


def _found(found: ChunkFindings, table: ExprTable, where: tuple[int, int, str], what: str, form: str, got: int,
           text: str) -> None:
    """Record that rank ``r``'s chunk ``c`` of buffer ``name`` (``where``) holds ``got`` where the
    canonical is ``text``."""
    r, c, name = where
    ops = table.ops_in(got, r)
    cause = (form, table.by_rank(table.cause_of, got, r) or ("copy",))
    msg = (f"rank {r} {name} chunk {c} is not the canonical expression in {_WHY[form]} ({what}):\n"
           f"  canonical:   {text}\n"
           f"  the plan:    {table.render(got, r)}   (xR[k]: rank R's input chunk k, added left to right; "
           f"(...): rounded by another op)\n"
           f"  computed by: {'; '.join(ops) or 'a copy'}")
    found.add(cause, f"rank {r} {name} chunk {c}", msg, {"rank": r, "chunk": c, "buffer": name, "form": form,
                                                         "canonical": text, "plan": table.render(got, r),
                                                         "ops": ops, "cause": cause})


class InvarianceCheck:
    """:func:`mscclang.sim.verify.verify`'s (and the fused verify's) batch-invariance proof: the
    findings of its symbolic runs (the one at the smallest size and one at each of the ``extra``
    sizes: for a plan that promises it, the other proof sizes) in the forms ``dtypes`` demand
    (None: every dtype), reported as the plan's promise says (:meth:`report`)."""

    def __init__(self, plan: Plan, dtypes: Optional[Sequence[np.dtype]], extra: list[int]) -> None:
        self.plan = plan
        self.level = "error" if plan.batch_invariant else None   # a promise broken: errors
        self.forms = forms_for(dtypes)
        self.extra = extra
        self.found = ChunkFindings("", self.level, KIND)
        self.proof = InvarianceProof([], [], [])

    def report(self, rep: Report, findings: Findings) -> None:
        """Errors for a promise that does not hold; otherwise a note saying whether it holds (that
        it holds only for a plan that passes otherwise: a race makes the symbolic run one
        schedule's, which proves nothing)."""
        probs = self.found.problems()
        rep.batch_invariant = None if not self.proof.sizes else not probs
        sizes = f"checked at sizes {', '.join(map(str, sorted(self.proof.sizes)))}" + (
            f"; not followed symbolically at {', '.join(map(str, self.proof.skipped))}" if self.proof.skipped else "")
        if self.level == "error" and probs:
            findings.add(probs, f"symbolic, {sizes}")
            return
        promise = {True: "promised", False: "not promised (batch_invariant: false)", None: "not promised"}[
            self.plan.batch_invariant]
        if rep.batch_invariant is None:
            rep.notes.append(f"batch invariant: not proven ({promise}): no size could be followed symbolically")
            return
        if not probs and rep.failed:
            rep.batch_invariant = None   # a plan that fails otherwise (a race, say) proves nothing
            return
        d = probs[0].details if probs else {}
        note = Problem(KIND, f"batch invariant ({promise}; {sizes}): " + (
            f"no: rank {d['rank']} {d['buffer']} chunk {d['chunk']} is {d['plan']}, not the canonical "
            f"{d['canonical']} ({d['form']} form; computed by {'; '.join(d['ops']) or 'a copy'}; "
            f"{len(probs)} cause(s))" if probs else "yes"))
        annotate_sources(note, self.plan)   # the ops' program lines
        rep.notes.append(note.message)
