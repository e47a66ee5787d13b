"""examples/fused_rmsnorm.py on the CPU: started directly it runs two gloo ranks of its own, each
calling ``Communicator.all_reduce_add_rms_norm`` and checking the residual against torch's
all_reduce + add and the norm against torch's rms_norm; without GPUs the call takes the
library's CPU path (the fallback), and the script says that no fused plan ran. It uses the
public API only. (With two or more GPUs the same script runs a fused plan on them.)"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "fused_rmsnorm.py"


def test_example_checks_the_residual_and_the_norm_against_torch() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "3", "--hidden", "32"], env=env,
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    for r in (0, 1):
        assert (f"fused_rmsnorm: rank {r}: 3x32 bf16 on 2 ranks (cpu): residual equals torch's all_reduce + add, "
                "norm within one bf16 rounding of torch's rms_norm") in p.stdout, p.stdout
    assert p.stdout.count("(fallback: no fused plan ran)") == 2 and "Traceback" not in p.stderr


def test_example_uses_the_public_api_only() -> None:
    """It imports ``mscclang`` itself, nothing below it, and calls the fused call through
    ``Communicator.from_torch``."""
    tree = ast.parse(SCRIPT.read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m for m in mods if m.startswith("mscclang")} == {"mscclang"}
    text = SCRIPT.read_text()
    assert "mscclang.Communicator.from_torch()" in text and "comm.all_reduce_add_rms_norm(" in text
