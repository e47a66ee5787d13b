"""The plan picture on a time axis (``mscclang show --png --trace``): ops placed at a Chrome
trace's times (the cost model's here; a traced GPU run writes the same format), waits as long as
they waited, and the critical path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mscclang.errors import PlanError
from mscclang.plan.io import load_plan
from mscclang.sim import cost
from mscclang.sim.runner import message_to_bytes, message_unit
from mscclang.viz.graph import build_graph
from mscclang.viz.timing import apply_trace, critical_path

from tests.harness.cli import cli_inproc
from tests.harness.shipped import one_per_algorithm

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "allreduce_rsag_zero_copy.r2.i32.inplace.json"


@pytest.fixture
def plan():
    if not PLAN.is_file():
        pytest.skip("the shipped plans are not here")
    return load_plan(PLAN)


def test_boxes_take_the_traces_times_and_the_critical_path_ends_last(plan):
    pred = cost.predict(plan, 1 << 20, 1 << 20)
    g = build_graph(plan)
    timed = apply_trace(g, pred.chrome_trace())
    assert timed.total_us == pytest.approx(pred.total_us - min(o.start_us for o in pred.ops))
    by = {(o.rank, o.tb, o.index): o for o in pred.ops}
    for node in g.nodes.values():
        o = by[(node.rank, node.tb, int(node.label))]
        assert node.x * timed.us_per_step == pytest.approx(o.start_us - cost.calibrated().launch_us, abs=1e-6)
        # a wait is as long as it waited (and the op cost)
        assert node.width * timed.us_per_step == pytest.approx(max(o.end_us - o.start_us, 0.04 * timed.us_per_step))
    path = critical_path(g)
    last = max(g.nodes.values(), key=lambda n: n.x + n.width)
    assert path[0] == last.key and set(path) == timed.critical
    # each step back ends no later than the op after it starts (plus its length)
    for a, b in zip(path, path[1:]):
        assert g.nodes[b].x + g.nodes[b].width <= g.nodes[a].x + g.nodes[a].width + 1e-9


def test_a_trace_of_another_plan_is_refused(plan):
    other = load_plan(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json")
    tr = cost.predict(other, 1024, 1024).chrome_trace()
    with pytest.raises(PlanError, match="the trace is of plan 'allreduce_oneshot_ll.r2.i1.inplace', not of"):
        apply_trace(build_graph(plan), tr)
    with pytest.raises(PlanError, match="traceEvents"):
        apply_trace(build_graph(plan), {"nothing": 1})


def test_show_draws_a_timed_picture(plan, tmp_path):
    pytest.importorskip("matplotlib")
    trace, png = tmp_path / "t.json", tmp_path / "p.png"
    p = subprocess.run([sys.executable, "-m", "mscclang", "predict", str(PLAN), "--size", "1M", "--trace", str(trace)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "mscclang", "show", str(PLAN), "--png", str(png), "--trace", str(trace)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = subprocess.run([sys.executable, "-m", "mscclang", "show", str(PLAN), "--trace", str(trace)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and "--png" in p.stderr and "Traceback" not in p.stderr


# ------------------------------------------------- issue 34 item 3: a trace of another plan
RS2 = ROOT / "plans" / "reducescatter_simple.r2.i16.json"
RING4 = ROOT / "plans" / "allgather_ll.r4.i1.json"


def _trace_of(path: Path, **edit) -> dict:
    """The cost model's trace of the plan at ``path``, with ``otherData`` entries replaced
    (``None`` removes one)."""
    p = load_plan(path)
    ib, ob = message_to_bytes(p, 1 << 16, "float16")
    tr = cost.predict(p, ib, ob).chrome_trace()
    for k, v in edit.items():
        tr["otherData"].pop(k, None) if v is None else tr["otherData"].update({k: v})
    return tr


def _without_op(tr: dict, rank: int, tb: int, index: int) -> dict:
    tr["traceEvents"] = [e for e in tr["traceEvents"]
                         if not (e.get("ph") == "X" and (e["pid"], e["tid"], e["args"]["index"]) == (rank, tb, index))]
    return tr


def _renamed(tr: dict, name: str) -> dict:
    tr["otherData"]["plan"] = name
    return tr


def _extra_block(tr: dict) -> dict:
    """Rank 1's last block's events copied to a block the plan lacks."""
    last = max(e["tid"] for e in tr["traceEvents"] if e.get("ph") == "X" and e["pid"] == 1)
    tr["traceEvents"] += [dict(e, tid=last + 7) for e in tr["traceEvents"]
                          if e.get("ph") == "X" and e["pid"] == 1 and e["tid"] == last]
    return tr


def _two_sizes(tr: dict) -> dict:
    """What `mscclang run --sizes 1K,1M --trace` writes: a process per rank and size."""
    tr["traceEvents"] += [dict(e, pid=e["pid"] + 2) for e in tr["traceEvents"] if e.get("ph") == "X"]
    return tr


@pytest.mark.parametrize("make,words", [
    # the case: a 4-rank ring allgather's trace on a 2-rank reduce-scatter's picture
    (lambda: _trace_of(RING4), "the trace is of plan 'allgather_ll.r4.i1', not of 'reducescatter_simple.r2.i16'"),
    (lambda: _trace_of(RING4, plan=None), "the trace has 4 ranks (processes [0, 1, 2, 3]), the plan "
                                          "'reducescatter_simple.r2.i16' has 2"),
    (lambda: _renamed(_trace_of(RING4), "reducescatter_simple.r2.i16"), "the trace has 4 ranks"),
    (lambda: _trace_of(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json", plan=None),
     "rank 0 thread block 0 has "),
    (lambda: _without_op(_trace_of(RS2), 1, 0, 3), "rank 1 thread block 0 has 10 ops in the plan "
                                                   "'reducescatter_simple.r2.i16', 9 in the trace"),
    (lambda: _extra_block(_trace_of(RS2)), "rank 1 thread block 22 has 0 ops in the plan 'reducescatter_simple.r2.i16', 10 in the trace"),
    (lambda: _two_sizes(_trace_of(RS2)), "the trace has 4 ranks (processes [0, 1, 2, 3]), the plan "
                                         "'reducescatter_simple.r2.i16' has 2: is it a trace of another plan, "
                                         "or of several sizes?"),
])
def test_show_refuses_a_trace_that_is_not_of_the_plan(make, words, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace, png = tmp_path / "t.json", tmp_path / "p.png"
    trace.write_text(json.dumps(make()))
    res = cli_inproc(capsys, "show", str(RS2), "--png", str(png), "--trace", str(trace))
    assert res.returncode == 1 and res.stdout == "", res.stdout
    assert res.stderr.startswith("mscclang show: error: ") and words in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and not png.exists()


@pytest.mark.parametrize("path", one_per_algorithm(), ids=lambda p: p.name.split(".")[0])
def test_every_algorithms_own_trace_is_accepted(path):
    plan = load_plan(path)
    unit = message_unit(plan, "float16")
    ib, ob = message_to_bytes(plan, -(-max(plan.min_message_size, 1 << 16) // unit) * unit, "float16")
    apply_trace(build_graph(plan), cost.predict(plan, ib, ob).chrome_trace())
