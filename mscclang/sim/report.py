"""Problems the simulator finds, and the report that gathers them.

Severity: every kind is an *error* except those in :data:`WARNING_KINDS`. A report's status is

* ``FAILED``: at least one error (exit 1);
* ``NO POSTCONDITION``: no error, but the collective (``test``, ``custom``) says nothing about
  its outputs, so only deadlocks, races and synchronisation were checked (exit 0, 1 under
  ``--strict``);
* ``OK``: no error and the postcondition held. ``OK`` can be *vacuous* (no op moved a byte at any
  size checked) and can carry warnings; both exit 0, 1 under ``--strict``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from mscclang.errors import VerificationError

#: every kind of problem, in the order a report lists them: root causes (a plan that cannot run,
#: deadlocks, unbalanced signal/wait and semaphores, unsynchronised signals) before the races
#: they imply, and races before the wrong outputs they cause
KINDS = ("plan", "deadlock", "unbalanced-channel", "unbalanced-semaphore", "unsynced-signal",
         "race", "multimem-relaxed", "postcondition", "symbolic", "inconsistent", "batch-variant", "protocol")

#: kinds that are warnings: reported, but they fail a run only under ``strict``.
#: ``multimem-relaxed``: a hazard that exists only because a relaxed signal/wait is the one edge
#: publishing multimem (switch-channel) stores; a plain missing synchronisation is a ``race``.
#: ``protocol``: a plan that declares the LL protocol but has no packet op.
WARNING_KINDS = frozenset({"multimem-relaxed", "protocol"})

#: how many problems ``str(report)`` prints, and how many cases of each
SHOW_PROBLEMS = 8
SHOW_CASES = 3
#: cases (contexts) remembered per problem; the count goes on past it
KEEP_CASES = 64


class Deadlock(VerificationError):
    """Every live thread block of every rank waits; ``problem`` holds the wait-for cycle."""

    def __init__(self, problem: "Problem") -> None:
        self.problem = problem
        super().__init__(problem.message)


@dataclass
class Problem:
    """One finding. ``kind`` is one of :data:`KINDS`; ``message`` names rank, thread block, op
    index and op name (and the op's DSL source line when the plan records it); ``context`` says
    under which size/dtype/schedule it was first seen.

    In a :class:`Report` one problem stands for every time the same bug was seen: ``count`` is
    how many times (over runs and launches), ``cases`` the distinct contexts (the first
    :data:`KEEP_CASES` of them; ``ncases`` counts them all)."""

    kind: str
    message: str
    context: str = ""
    details: dict = field(default_factory=dict)
    count: int = 1
    cases: list[str] = field(default_factory=list)
    ncases: int = 0

    @property
    def severity(self) -> str:
        """``"warning"`` for :data:`WARNING_KINDS`, else ``"error"``; a problem whose severity
        depends on the plan (``inconsistent``: on its promise) says so in ``details["level"]``."""
        level = self.details.get("level")
        if level in ("error", "warning"):
            return level
        return "warning" if self.kind in WARNING_KINDS else "error"

    def seen(self, context: str) -> None:
        """Count one more occurrence, under ``context``."""
        self.count += 1
        self.add_case(context)

    def add_case(self, context: str) -> None:
        """Remember ``context`` as one of the cases (once; the first :data:`KEEP_CASES`)."""
        if not context or context in self.cases:
            return
        self.ncases += 1
        if len(self.cases) < KEEP_CASES:
            self.cases.append(context)

    def where_seen(self, show: int = SHOW_CASES) -> str:
        """``[case]`` or ``[seen N times in K cases: a; b; c; and K-3 more]``."""
        cases = self.cases or ([self.context] if self.context else [])
        ncases = max(self.ncases, len(cases))
        if self.count <= 1 and ncases <= 1:
            return f" [{cases[0]}]" if cases else ""
        times = f"seen {self.count} time{'s' * (self.count != 1)}"
        if ncases == 0:
            return f" [{times}]"
        listed = "; ".join(cases[:show])
        more = f"; and {ncases - show} more" if ncases > show else ""
        return f" [{times} in {ncases} case{'s' * (ncases != 1)}: {listed}{more}]"

    def __str__(self) -> str:
        tag = "warning: " if self.severity == "warning" else ""
        return f"{tag}{self.kind}: {self.message}{self.where_seen()}"


@dataclass
class Report:
    """Result of :func:`mscclang.sim.verify`.

    ``status`` is ``"OK"``, ``"NO POSTCONDITION"`` or ``"FAILED"``; ``ok`` is true only for
    ``"OK"`` (a plan without a postcondition is never OK), ``failed`` when an error was found.
    ``problems`` holds one entry per distinct bug (with its true count), errors and warnings;
    ``dtypes``, ``reduce_ops`` and ``packet_types`` what the runs made took (:meth:`ran`)."""

    plan_name: str
    problems: list[Problem] = field(default_factory=list)
    runs: int = 0
    seconds: float = 0.0
    sizes: list[int] = field(default_factory=list)
    #: a plan with segments: the row widths (bytes) its count matrices ran in, instead of sizes
    row_widths: list[int] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    schedules: list[str] = field(default_factory=list)
    reduce_ops: list[str] = field(default_factory=list)
    packet_types: list[str] = field(default_factory=list)
    launches: int = 1
    notes: list[str] = field(default_factory=list)
    #: whether the collective has a postcondition (``test`` and ``custom`` have none)
    postcondition: bool = True
    #: no op moved any byte at any size checked: an OK is then vacuous
    vacuous: bool = False
    #: whether every reduced output element is the canonical expression at the sizes proven
    #: (:mod:`mscclang.sim.invariance`); None: not checked (no symbolic run of a reduction)
    batch_invariant: Optional[bool] = None

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def failed(self) -> bool:
        """An error (deadlock, race, wrong output, ...) was found."""
        return bool(self.errors)

    @property
    def status(self) -> str:
        if self.failed:
            return "FAILED"
        if not self.postcondition:
            return "NO POSTCONDITION"
        return "OK"

    @property
    def ok(self) -> bool:
        """No error, and the postcondition was checked and held (warnings allowed)."""
        return self.status == "OK"

    def passed(self, strict: bool = False) -> bool:
        """Whether ``mscclang verify`` exits 0: no error; with ``strict`` also a postcondition
        that was checked, held non-vacuously, and no warning."""
        if self.failed:
            return False
        if strict:
            return self.postcondition and not self.vacuous and not self.warnings
        return True

    def exit_code(self, strict: bool = False) -> int:
        return 0 if self.passed(strict) else 1

    def ran(self, dtype: str, reduce_op: Optional[str], packet_type: Optional[str]) -> None:
        """Record a run's dtype, reduce op and packet type in :attr:`dtypes`, :attr:`reduce_ops`
        and :attr:`packet_types` (once each; ``None``: the plan has no op it applies to)."""
        for seen, value in ((self.dtypes, dtype), (self.reduce_ops, reduce_op), (self.packet_types, packet_type)):
            if value is not None and value not in seen:
                seen.append(value)

    def kinds(self) -> set[str]:
        return {p.kind for p in self.problems}

    def first(self, kind: Optional[str] = None) -> Optional[Problem]:
        for p in self.problems:
            if kind is None or p.kind == kind:
                return p
        return None

    def headline(self) -> str:
        """``OK``, ``OK (vacuous: ...)``, ``NO POSTCONDITION (...)``, ``FAILED (N problems)``,
        with the warning count."""
        nw = len(self.warnings)
        warn = f"{nw} warning{'s' * (nw != 1)}"
        if self.failed:
            ne = len(self.errors)
            extra = f", {warn}" if nw else ""
            return f"FAILED ({ne} problem{'s' * (ne != 1)}{extra})"
        vac = "; vacuous: no op moves any byte at any size checked" if self.vacuous else ""
        if not self.postcondition:
            return f"NO POSTCONDITION (deadlocks and races checked{vac})"
        inner = [s for s in (vac[2:], warn if nw else "") if s]
        return "OK" + (f" ({'; '.join(inner)})" if inner else "")

    def ranked(self) -> list[Problem]:
        """The problems in the order of :data:`KINDS` (causes first), found order within a kind."""
        order = {k: i for i, k in enumerate(KINDS)}
        return sorted(self.problems, key=lambda p: order.get(p.kind, len(KINDS)))

    def __str__(self) -> str:
        return self.render()

    def render(self, show_all: bool = False) -> str:
        """The printout: headline, what ran, notes, then the problems ranked (:meth:`ranked`):
        the first :data:`SHOW_PROBLEMS` (12 lines each) and a count of the rest, or with
        ``show_all`` every problem in full."""
        ran = [f"sizes {', '.join(_fmt_size(s) for s in self.sizes)}" if not self.row_widths else
               f"count matrices in rows of {', '.join(map(str, self.row_widths))} bytes",
               f"dtypes {', '.join(self.dtypes) or '-'}"]
        ran += [f"{what} {', '.join(vs)}" for what, vs in (("reduce ops", self.reduce_ops),
                                                          ("packets", self.packet_types)) if vs]
        lines = [f"verify {self.plan_name}: {self.headline()}",
                 f"  {self.runs} runs in {self.seconds:.2f} s: {'; '.join(ran)}; {len(self.schedules)} schedules; "
                 f"{self.launches} launches"]
        for n in self.notes:
            lines.append(f"  note: {n}")
        ordered = self.ranked()
        shown = len(ordered) if show_all else min(len(ordered), SHOW_PROBLEMS)
        for p in ordered[:shown]:
            lines.extend("  " + ln for ln in str(p).splitlines()[:None if show_all else 12])
        if len(ordered) > shown:
            rest = Counter(p.kind for p in ordered[shown:])
            lines.append(f"  ... and {len(ordered) - shown} more: "
                         + ", ".join(f"{n} {k}" for k, n in rest.items()) + " (--all prints every problem)")
        if self.warnings and not self.failed:
            lines.append("  (warnings fail only under --strict; see docs/verify.md)")
        return "\n".join(lines)


def _fmt_size(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)
