"""examples/graph_allreduce.py on the CPU: under torchrun (2 gloo ranks, no CUDA) it runs its
eager calls through the public Communicator and checks them against torch.distributed; started
without a launcher it says how to run it. Its measurement lives in the bench (``ordinary``
implementation: tests/test_bench_ranks.py, tests/test_bench_report.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests.harness.launch import ROOT, torchrun_cpu

SCRIPT = ROOT / "examples" / "graph_allreduce.py"


def test_runs_under_torchrun_on_the_cpu():
    p = torchrun_cpu(SCRIPT, "--numel", "1000", "--replays", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    for r in (0, 1):
        # on a CPU every call falls back: gloo is compared with gloo, and the script says so
        assert (f"graph_allreduce: rank {r}: 3 eager calls (no CUDA: gloo, no graph) of 1000 bf16 "
                "elements: match gloo (fallback: no mscclang plan ran)") in p.stdout   # the ranks' lines may interleave
    assert "Traceback" not in p.stderr


def test_without_a_launcher_it_says_how_to_run_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 2 and "run this under torchrun" in p.stderr


def test_uses_the_public_api_only():
    """The example imports ``mscclang`` itself, nothing below it, and builds the communicator
    with ``Communicator.from_torch``."""
    tree = ast.parse(SCRIPT.read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m for m in mods if m.startswith("mscclang")} == {"mscclang"}
    assert "mscclang.Communicator.from_torch()" in SCRIPT.read_text()
