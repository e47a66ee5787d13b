"""Placing the plan picture on a time axis from a Chrome trace (``mscclang predict --trace`` now,
a traced GPU run later: both write one ``"X"`` event per op, ``pid`` the rank, ``tid`` the thread
block, ``args.index`` the op index), and its critical path.

:func:`apply_trace` moves every op's box to its measured (or predicted) start and gives it its
length, in steps of ``scale`` microseconds, so waits are drawn as bars as long as they waited.
:func:`critical_path` walks back from the op that ends last: at each op, to the predecessor that
ended latest among its block's previous op and the ops it depends on (signals, data, packets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mscclang.errors import PlanError
from mscclang.plan.models import Plan
from mscclang.viz.graph import NodeKey, PlanGraph


@dataclass(frozen=True)
class Timed:
    """What a trace did to a graph: microseconds per step, the total, and the critical path."""

    us_per_step: float
    total_us: float
    critical: frozenset


def _events(trace: Any) -> dict[tuple[int, int, int], tuple[float, float]]:
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise PlanError("the trace has no traceEvents list (Chrome trace-event JSON)")
    out: dict[tuple[int, int, int], tuple[float, float]] = {}
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        try:
            key = (int(e["pid"]), int(e["tid"]), int(e["args"]["index"]))
            out[key] = (float(e["ts"]), float(e.get("dur", 0.0)))
        except (KeyError, TypeError, ValueError):
            raise PlanError(f"trace event {i} lacks pid, tid, ts or args.index", f"traceEvents[{i}]") from None
    return out


def check_trace(plan: Plan, trace: Any, ev: dict[tuple[int, int, int], tuple[float, float]]) -> None:
    """PlanError unless ``trace`` (with its op events ``ev``) is a trace of ``plan``: the plan
    name it records (``otherData.plan``, when it records one), its ranks (processes) and, per
    thread block, its ops (one event per op index) must be the plan's."""
    other = trace.get("otherData") if isinstance(trace, dict) else None
    other = other if isinstance(other, dict) else {}
    if other.get("plan") is not None and other["plan"] != plan.name:
        raise PlanError(f"the trace is of plan {other['plan']!r}, not of {plan.name!r}: draw it with its own "
                        "plan, or trace this one (mscclang predict PLAN --trace FILE)")
    n, ranks = len(plan.gpus), sorted({r for r, _, _ in ev})
    if ranks != list(range(n)):   # (`mscclang run --trace` at several sizes: a process per rank and size)
        raise PlanError(f"the trace has {len(ranks)} ranks (processes {ranks[:8]}{'...' * (len(ranks) > 8)}), "
                        f"the plan {plan.name!r} has {n}: is it a trace of another plan, or of several sizes?")
    got: dict[tuple[int, int], set[int]] = {}
    for r, t, i in ev:
        got.setdefault((r, t), set()).add(i)
    want = {(r, t): set(range(len(tb.ops))) for r, g in enumerate(plan.gpus) for t, tb in enumerate(g.threadblocks)}
    bad = sorted(k for k in want.keys() | got.keys() if want.get(k, set()) != got.get(k, set()))
    if bad:
        (r, t) = bad[0]
        raise PlanError(f"rank {r} thread block {t} has {len(want.get((r, t), ()))} ops in the plan {plan.name!r}, "
                        f"{len(got.get((r, t), ()))} in the trace: is it a trace of another plan?")


def apply_trace(graph: PlanGraph, trace: Any) -> Timed:
    """Place ``graph``'s nodes at the trace's times (see the module docstring). The scale keeps
    about as many steps as the untimed picture has. PlanError when the trace is not one of the
    graph's plan (:func:`check_trace`)."""
    ev = _events(trace)
    check_trace(graph.plan, trace, ev)
    steps = max(graph.span, 1.0)
    t0 = min((s for s, _ in ev.values()), default=0.0)
    t1 = max((s + d for s, d in ev.values()), default=1.0)
    total = max(t1 - t0, 1e-9)
    per = total / steps
    pipes: dict[tuple[int, int, int], list] = {}
    for k, node in graph.nodes.items():
        top = node.pipeline if node.pipeline is not None else int(node.label.split(".")[0])
        got = ev.get((node.rank, node.tb, top))
        if got is None:
            raise PlanError(f"the trace has no event for rank {node.rank} thread block {node.tb} op {top}: "
                            "is it a trace of this plan?")
        if node.pipeline is not None:
            pipes.setdefault((node.rank, node.tb, top), []).append(node)
        node.x, node.width = (got[0] - t0) / per, max(got[1] / per, 0.04)
    for members in pipes.values():   # a pipeline's inner ops share its interval
        x0, w = members[0].x, members[0].width / len(members)
        for j, m in enumerate(members):
            m.x, m.width = x0 + j * w, max(w, 0.04)
    return Timed(per, total, frozenset(critical_path(graph)))


def critical_path(graph: PlanGraph) -> list[NodeKey]:
    """The chain of ops that set the end time, last op first (see the module docstring)."""
    if not graph.nodes:
        return []
    preds: dict[NodeKey, list[NodeKey]] = {k: [] for k in graph.nodes}
    for keys in graph.blocks.values():
        for a, b in zip(keys, keys[1:]):
            preds[b].append(a)
    for e in graph.edges:
        if e.dst in preds and e.src in graph.nodes:
            preds[e.dst].append(e.src)

    def end(k: NodeKey) -> float:
        n = graph.nodes[k]
        return n.x + n.width

    cur = max(graph.nodes, key=end)
    path = [cur]
    seen = {cur}
    while True:
        start = graph.nodes[cur].x
        cands = [p for p in preds[cur] if p not in seen and end(p) <= start + 1e-6 + graph.nodes[cur].width]
        if not cands:
            return path
        cur = max(cands, key=end)
        path.append(cur)
        seen.add(cur)
