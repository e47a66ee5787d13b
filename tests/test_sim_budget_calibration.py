"""The budget's estimates against measured runs (slow: each case is a fresh process). The memory
estimate must bound the measured peak; the time estimate must not exceed what the run takes by
more than a small factor (it is optimistic on purpose: it refuses only what clearly cannot finish,
and the deadline stops the rest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the peak is VmHWM (this process image's own high-water mark): ru_maxrss survives exec, so a
# probe started by a pytest process that had grown (a large test before it) reported the parent's
_PROBE = r"""
import json, sys, time
from mscclang.plan import load_plan
from mscclang.sim.dtypes import parse_dtype
from mscclang.sim.verify import estimate_verify, verify
plan = load_plan(sys.argv[1]); size = int(sys.argv[2])
est = estimate_verify(plan, [size], [parse_dtype("float32")], 2, 2, symbolic=False)
t = time.perf_counter()
rep = verify(plan, sizes=[size], dtypes=["float32"], schedules=2, symbolic=False)
print(json.dumps({"ok": rep.ok, "seconds": time.perf_counter() - t, "est_seconds": est.seconds,
                  "peak": int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM"))) * 1024,
                  "est_memory": est.memory_bytes}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name,size", [
    ("allreduce_oneshot_ll.r2.i1.json", 8 << 20),
    ("allreduce_rsag_simple.r8.i16.json", 1 << 20),
    ("allreduce_rsag_zero_copy.r8.i16.json", 4 << 20),
    ("allgather_ll.r8.i2.json", 1 << 20),
    ("allreduce_rsag_pipelined.r8.i8.json", 1 << 20),
    ("alltoall_simple.r8.i16.json", 1 << 20),
])
def test_estimates_against_measurements(name, size):
    r = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT / "plans" / name), str(size)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["ok"]
    assert m["peak"] <= m["est_memory"], m
    assert m["est_seconds"] <= 4 * m["seconds"], m
