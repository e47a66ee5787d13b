"""examples/fused_rmsnorm.py on the CPU: it authors a fused plan in the DSL, verifies it and runs
it through a Communicator on the simulator back end (exit status 0 only when all three hold)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_example_authors_verifies_and_runs_a_fused_plan() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "fused_rmsnorm.py")], env=env,
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "verify OK" in p.stdout and "Communicator ran my_fused_oneshot.r2" in p.stdout
