"""examples/moe_ep.py on the CPU: under torchrun (2 gloo ranks, no CUDA) its expert-parallel layer
(Communicator.moe_dispatch / moe_combine, the exchanges through the torch.distributed fallback)
matches the one-process reference at every step; started without a launcher it says how to run
it."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.harness.launch import ROOT, torchrun_cpu

SCRIPT = ROOT / "examples" / "moe_ep.py"


def test_runs_under_torchrun_on_the_cpu():
    p = torchrun_cpu(SCRIPT, "--steps", "2", "--experts", "8", "--hidden", "64", "--tokens", "5")
    assert p.returncode == 0, p.stdout + p.stderr
    # the ranks' lines may interleave: count what each says
    assert p.stdout.count("ok (fallback: the exchanges ran on torch.distributed)") == 2, p.stdout
    assert all(f"rank {r}: 3 steps of an EP layer (8 experts, top-4, 5 tokens x 64) eager" in p.stdout for r in (0, 1))
    assert "WRONG" not in p.stdout


def test_without_a_launcher_it_says_how_to_run():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and "torchrun --nproc-per-node N examples/moe_ep.py" in p.stderr
