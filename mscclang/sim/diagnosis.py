"""Turning the simulator's raw findings into diagnoses a person can act on.

* :func:`group_key`: what makes two findings the same bug (so a bug seen at many sizes, dtypes,
  schedules and launches is reported once, with its count and cases);
* :func:`classify`: a race that only a relaxed signal/wait publishing multimem stores leaves
  unordered becomes a ``multimem-relaxed`` warning;
* :func:`rotate_cycle`: a wait-for cycle is printed from the op the author wrote first;
* :func:`annotate_sources`: every ``rank R tb T op I`` gets the op's DSL source line
  (``program.py:42``) when the plan records it (the optional ``src`` field of an op).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from mscclang.plan.models import ChannelType, Op, Plan
from mscclang.sim.report import Problem

_LAUNCH = re.compile(r"launch \d+")
_RANGE = re.compile(r"\[\d+, \d+\)")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(\.\d+)?(e[+-]?\d+)?")
#: ``rank 2 tb 0 op 16`` (plain text) and ``(rank 2, tb 0, op 16)`` (cycle summaries)
_OP_TEXT = re.compile(r"rank (\d+) tb (\d+) op (\d+(?:\.\d+)*)")
_OP_TUPLE = re.compile(r"\(rank (\d+), tb (\d+), op (\d+(?:\.\d+)*)\)")


def op_at(plan: Plan, rank: int, tb: int, index: Any) -> Optional[Op]:
    """The op ``index`` (``"3"``, or ``"3.1"``: inner op 1 of pipeline op 3) of ``rank``'s
    thread block ``tb``; ``None`` when there is no such op."""
    if index is None or not 0 <= rank < len(plan.gpus):
        return None
    tbs = plan.gpus[rank].threadblocks
    if not 0 <= tb < len(tbs):
        return None
    ops: Optional[list] = tbs[tb].ops
    op: Optional[Op] = None
    try:
        parts = [int(x) for x in str(index).split(".")]
    except ValueError:
        return None
    for k in parts:
        if not ops or not 0 <= k < len(ops):
            return None
        op = ops[k]
        ops = op.ops
    return op


def src_of(plan: Plan, rank: int, tb: int, index: Any) -> Optional[str]:
    """The DSL source line (``"program.py:42"``) that made the op, when the plan records it;
    an inner op of a pipeline without one inherits the pipeline's."""
    op = op_at(plan, rank, tb, index)
    src = getattr(op, "src", None) if op is not None else None
    if not src and index is not None and "." in str(index):
        return src_of(plan, rank, tb, str(index).rsplit(".", 1)[0])
    return src if isinstance(src, str) and src else None


def _src_order(src: str) -> tuple:
    path, _, line = src.rpartition(":")
    return (path, int(line)) if line.isdigit() else (src, 0)


def _index_order(index: Any) -> tuple:
    try:
        return tuple(int(x) for x in str(index).split("."))
    except ValueError:
        return (1 << 62,)


def author_order(plan: Plan, rank: int, tb: int, index: Any) -> tuple:
    """Sort key: ops with a source line first, by file and line; then by rank, thread block
    and op index."""
    src = src_of(plan, rank, tb, index)
    if src is not None:
        return (0, _src_order(src), (rank, tb), _index_order(index))
    return (1, (), (rank, tb), _index_order(index))


def annotate_sources(problem: Problem, plan: Plan) -> None:
    """Append ``(program.py:42)`` after every op a message names whose op records ``src``."""
    found: dict[tuple[int, int, str], str] = {}

    def text_sub(m: re.Match) -> str:
        r, tb, idx = int(m.group(1)), int(m.group(2)), m.group(3)
        src = src_of(plan, r, tb, idx)
        if src is None:
            return m.group(0)
        found[(r, tb, idx)] = src
        tail = problem.message[m.end(): m.end() + len(src) + 3]
        if src in tail:
            return m.group(0)
        return f"{m.group(0)} ({src})"

    def tuple_sub(m: re.Match) -> str:
        r, tb, idx = int(m.group(1)), int(m.group(2)), m.group(3)
        src = src_of(plan, r, tb, idx)
        if src is None:
            return m.group(0)
        found[(r, tb, idx)] = src
        return f"(rank {r}, tb {tb}, op {idx}, {src})"

    msg = _OP_TUPLE.sub(tuple_sub, problem.message)
    problem.message = msg
    problem.message = _OP_TEXT.sub(text_sub, msg)
    if found:
        problem.details.setdefault("src", {}).update(found)


def rotate_cycle(problem: Problem, plan: Plan) -> None:
    """Start a deadlock's wait-for cycle at the op the author wrote first (:func:`author_order`):
    the ``cycle`` detail, the ``wait-for cycle:`` line, the per-block lines after it and the
    ``first ...`` of the headline. Messages of another shape are left as they are."""
    cyc = problem.details.get("cycle") if problem.kind == "deadlock" else None
    if not cyc or len(cyc) < 2:
        return
    keys = [author_order(plan, e[0], e[1], e[2]) for e in cyc]
    s = min(range(len(cyc)), key=lambda i: keys[i])
    if s == 0:
        return
    k = len(cyc)
    lines = problem.message.split("\n")
    at = next((i for i, ln in enumerate(lines) if ln.startswith("wait-for cycle: ")), None)
    if at is None or at + k >= len(lines):
        return
    parts = lines[at][len("wait-for cycle: "):].split(" -> ")
    if len(parts) != k + 1 or parts[0] != parts[-1]:
        return
    body = lines[at + 1: at + 1 + k]
    for e, ln in zip(cyc, body):
        if not ln.lstrip().startswith(f"rank {e[0]} tb {e[1]}"):
            return
    parts = parts[s:k] + parts[:s]
    lines[at] = "wait-for cycle: " + " -> ".join(parts + parts[:1])
    body = body[s:] + body[:s]
    lines[at + 1: at + 1 + k] = body
    head = re.match(r"^(all \d+ live blocks wait; first ).*$", lines[0])
    if head:
        first = body[0].strip()
        cut = first.find(" (launch ")
        lines[0] = head.group(1) + (first[:cut] if cut > 0 else first)
    problem.message = "\n".join(lines)
    problem.details["cycle"] = list(cyc[s:]) + list(cyc[:s])


def _opkey(ref: Any) -> tuple:
    """An op reference without its launch: (rank, tb, index, name)."""
    if all(hasattr(ref, a) for a in ("rank", "tb", "index", "name")):
        return (ref.rank, ref.tb, ref.index, _LAUNCH.sub("launch N", str(ref.name)))
    return (str(ref),)


def group_key(problem: Problem) -> tuple:
    """What identifies a finding across sizes, dtypes, reduce ops, packet types, schedules and
    launches: the ops, ranks, chunks or channels it names, not the byte ranges or values."""
    d = problem.details
    k = problem.kind
    if k in ("race", "multimem-relaxed") and "first" in d and "second" in d:
        a, b = sorted((_opkey(d["first"]), _opkey(d["second"])), key=str)
        return (k, a, b, d.get("storage"))
    if k in ("postcondition", "symbolic") and "rank" in d and "chunk" in d:
        return (k, d["rank"], d["chunk"], d.get("what", ""))
    if k == "deadlock":
        if d.get("cycle"):
            return (k, "cycle", frozenset((e[0], e[1], e[2]) for e in d["cycle"]))
        if d.get("blocked"):
            return (k, "blocked", frozenset((e[0], e[1], e[2]) for e in d["blocked"]))
    if k == "unsynced-signal" and "op" in d:
        return (k, _opkey(d["op"]))
    if k == "unbalanced-semaphore" and "rank" in d:
        return (k, d["rank"], d.get("semaphore"))
    if k == "unbalanced-channel" and "end" in d:
        return (k, tuple(d["end"]))
    first = problem.message.splitlines()[0] if problem.message else ""
    first = _RANGE.sub("[a, b)", _LAUNCH.sub("launch N", first))
    if k in ("postcondition", "symbolic"):
        first = _NUMBER.sub("#", first)
    return (k, first)


def _multimem_store(op: Optional[Op]) -> bool:
    """Whether ``op`` writes through a switch channel (a multimem store)."""
    return op is not None and op.channel_type == ChannelType.switch and op.name.value in (
        "gstore", "glres", "gstorepkt")


def classify(problem: Problem, plan: Plan) -> None:
    """Reclassify a race that exists only because a relaxed signal/wait is the edge that
    publishes a multimem (switch-channel) store: the later access is ordered after the store in
    execution order (``exec_ordered``), not by a data-synchronising edge. It becomes a
    ``multimem-relaxed`` warning; every other race stays a ``race``."""
    if problem.kind != "race" or not problem.details.get("exec_ordered"):
        return
    first = problem.details.get("first")
    if first is None or getattr(first, "tb", -1) < 0:
        return
    if not _multimem_store(op_at(plan, first.rank, first.tb, first.index)):
        return
    problem.kind = "multimem-relaxed"
    problem.message += (" (only a relaxed signal/wait orders the multimem store before it: a "
                        "weaker hazard than a missing synchronisation; use signal/wait to publish "
                        "the store, or accept it: a warning unless --strict)")
