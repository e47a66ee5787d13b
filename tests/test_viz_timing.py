"""The plan picture on a time axis (``mscclang show --png --trace``): ops placed at a Chrome
trace's times (the cost model's here; a traced GPU run writes the same format), waits as long as
they waited, and the critical path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mscclang.errors import PlanError
from mscclang.plan.io import load_plan
from mscclang.sim import cost
from mscclang.viz.graph import build_graph
from mscclang.viz.timing import apply_trace, critical_path

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
