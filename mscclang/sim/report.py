"""Problems the simulator finds, and the report that gathers them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mscclang.errors import VerificationError

#: every kind of problem, in the order a report lists them
KINDS = ("plan", "deadlock", "race", "unsynced-signal", "unbalanced-channel",
         "unbalanced-semaphore", "postcondition", "symbolic")


class Deadlock(VerificationError):
    """Every live thread block of every rank waits; ``problem`` holds the wait-for cycle."""

    def __init__(self, problem: "Problem") -> None:
        self.problem = problem
        super().__init__(problem.message)


@dataclass
class Problem:
    """One finding. ``kind`` is one of :data:`KINDS`; ``message`` names rank, thread block, op
    index and op name; ``context`` says under which size/dtype/schedule it was seen."""

    kind: str
    message: str
    context: str = ""
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        ctx = f" [{self.context}]" if self.context else ""
        return f"{self.kind}: {self.message}{ctx}"


@dataclass
class Report:
    """Result of :func:`mscclang.sim.verify`. ``ok`` is true when no problem was found."""

    plan_name: str
    problems: list[Problem] = field(default_factory=list)
    runs: int = 0
    seconds: float = 0.0
    sizes: list[int] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    schedules: list[str] = field(default_factory=list)
    reduce_ops: list[str] = field(default_factory=list)
    packet_types: list[str] = field(default_factory=list)
    launches: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def kinds(self) -> set[str]:
        return {p.kind for p in self.problems}

    def first(self, kind: Optional[str] = None) -> Optional[Problem]:
        for p in self.problems:
            if kind is None or p.kind == kind:
                return p
        return None

    def __str__(self) -> str:
        status = "OK" if self.ok else f"FAILED ({len(self.problems)} problem{'s' * (len(self.problems) != 1)})"
        lines = [f"verify {self.plan_name}: {status}",
                 f"  {self.runs} runs in {self.seconds:.2f} s: sizes {', '.join(_fmt_size(s) for s in self.sizes)}; "
                 f"dtypes {', '.join(self.dtypes)}; reduce ops {', '.join(self.reduce_ops) or '-'}; "
                 f"packets {', '.join(self.packet_types)}; {len(self.schedules)} schedules; {self.launches} launches"]
        for n in self.notes:
            lines.append(f"  note: {n}")
        shown = 0
        for kind in KINDS:
            for p in self.problems:
                if p.kind != kind:
                    continue
                if shown >= 8:
                    break
                text = str(p)
                lines.extend("  " + ln for ln in text.splitlines()[:10])
                shown += 1
        if len(self.problems) > shown:
            lines.append(f"  ... and {len(self.problems) - shown} more")
        return "\n".join(lines)


def _fmt_size(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)
