"""The traced kernel variant on the GPU: one traced launch of every shipped 2-rank plan (plan/1:
the fused plans' epilogue kernels have no traced variant) gives a
valid Chrome trace whose per-block op order matches the plan (every op with device records ran,
each after the one before it in its block), with the result still exact; then ``mscclang run
--trace`` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def _size(plan) -> int:
    """64 KiB of input, inside the plan's message-size range, a multiple of its alignment."""
    want = min(max(64 << 10, plan.min_message_size), plan.max_message_size)
    a = max(plan.buffer_alignment, 2) * plan.world_size
    return max(want // a * a, a)


def test_a_traced_launch_of_every_shipped_two_rank_plan(pool):
    from mscclang.plan.io import load_plan
    from mscclang.runtime.trace import RankTrace, align, chrome_trace

    if pool.world_size != 2:
        pytest.skip("the two-rank plans need a pool of 2")
    files = sorted(f for f in (ROOT / "plans").glob("*.json") if "\"format\":\"mscclang.plan/1\"" in f.read_text()[:40])   # plan/2 (fused) plans are not traced
    plans = [load_plan(f) for f in files]
    plans = [p for p in plans if p.world_size == 2]
    assert len(plans) > 50
    failures = []
    for plan in plans:
        from mscclang.plan.io import plan_to_json

        nb = _size(plan)
        try:
            res = pool.run("mscclang.cli.run_checks:trace_plan", plan_to_json(plan), nb, "float16", None, "sum", 5, 0)
        except Exception as e:  # noqa: BLE001 - every plan is tried; failures listed at the end
            failures.append(f"{plan.name} @ {nb}: {type(e).__name__}: {e}")
            continue
        events = align([RankTrace(r["rank"], r["t0_ns"], r["events"], r["problems"]) for r in res])
        tr = json.loads(json.dumps(chrome_trace(events, plan)))
        xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
        ok_events = xs and all({"name", "pid", "tid", "ts", "dur", "args"} <= e.keys() and e["dur"] >= 0 for e in xs)
        bad = sum(r["bad"] for r in res)
        problems = [p for r in res for p in r["problems"]]
        if bad or problems or not ok_events or {e["pid"] for e in xs} != {0, 1}:
            failures.append(f"{plan.name} @ {nb}: bad {bad}, problems {problems[:3]}, {len(xs)} events")
    print(f"traced {len(plans)} two-rank plans, {len(failures)} failures")
    assert not failures, "\n".join(failures[:20])


def test_run_trace_end_to_end(tmp_path, pool):
    if pool.world_size != 2:
        pytest.skip("needs a pool of 2")
    out = tmp_path / "t.json"
    p = subprocess.run([sys.executable, "-m", "mscclang", "run", str(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json"),
                        "--sizes", "4K,64K", "--iters", "20", "--trace", str(out)],
                       capture_output=True, text=True, timeout=280, cwd=ROOT)
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("results exact, op order as planned") == 2
    tr = json.loads(out.read_text())
    assert {e["pid"] for e in tr["traceEvents"] if e["ph"] == "X"} == {0, 1, 2, 3}
