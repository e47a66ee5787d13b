"""``mscclang compile`` and ``mscclang demo`` stay bounded: programs over too many ranks, instances
or ops are refused before the work (with the estimate and the setting that raises the limit), and
a script given ``--ranks`` is refused before its plan is dumped; DSL warnings name the DSL call
that caused them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mscclang import CollectiveProgram, DSLError, LimitError
from mscclang.dsl import AllReduce

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "allreduce_8rank.py"
ONESHOT = ROOT / "examples" / "oneshot_allreduce.py"
UNBALANCED = Path(__file__).parent / "programs_unbalanced" / "signal_wait_fuse.py"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python3 -m mscclang ARGS`` in a subprocess of this worktree."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "mscclang", *args], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=ROOT)


def one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.mark.parametrize("how", [["--ranks", "100000"], ["--", "--num_gpus", "100000"]])
def test_compile_refuses_too_many_ranks(how):
    msg = one_line_error(cli("compile", str(EXAMPLE), "-q", *how, timeout=60))
    assert "100000 ranks" in msg and "MSCCLANG_COMPILE_MAX_RANKS" in msg


def test_compile_refuses_too_many_instances():
    msg = one_line_error(cli("compile", str(EXAMPLE), "--ranks", "2", "--instances", "100000", timeout=60))
    assert "100000 instances" in msg and "1024" in msg


def test_compile_refuses_too_many_ops():
    p = cli("compile", str(EXAMPLE), "--ranks", "16", "-q", env={"MSCCLANG_COMPILE_MAX_OPS": "1000"})
    msg = one_line_error(p)
    assert "MSCCLANG_COMPILE_MAX_OPS" in msg and "1,000 ops" in msg
    p = cli("compile", str(EXAMPLE), "--ranks", "4", "--instances", "8", "-q",
            env={"MSCCLANG_COMPILE_MAX_OPS": "300"})
    msg = one_line_error(p)
    assert "x 8 instances" in msg and "MSCCLANG_COMPILE_MAX_OPS" in msg


def test_library_program_is_bounded(monkeypatch):
    with pytest.raises(LimitError, match="MSCCLANG_COMPILE_MAX_RANKS"):
        CollectiveProgram("big", AllReduce(100000, 1, False), 100000)
    with pytest.raises(DSLError, match="instances"):
        CollectiveProgram("many", AllReduce(2, 1, False), 2, instances=5000)
    monkeypatch.setenv("MSCCLANG_COMPILE_MAX_OPS", "10")
    from mscclang.dsl import MemoryChannel

    with pytest.raises(LimitError, match="MSCCLANG_COMPILE_MAX_OPS"):
        with CollectiveProgram("ops", AllReduce(2, 1, False), 2):
            for _ in range(11):
                MemoryChannel(1, 0).signal(tb=0)


def test_compile_progress_is_shown_when_asked():
    p = cli("compile", str(EXAMPLE), "--ranks", "8", "-o", os.devnull, "-q", "--progress")
    assert p.returncode == 0, p.stderr
    assert "compile allreduce_8rank.py: " in p.stderr and "op" in p.stderr


def test_demo_refuses_sizes_over_the_cap():
    msg = one_line_error(cli("demo", "--sizes", "100G", timeout=120))
    assert "100 GiB" in msg or "100G" in msg


def test_script_given_ranks_is_refused_before_its_plan_is_dumped():
    p = cli("compile", str(ONESHOT), "--ranks", "4")
    msg = one_line_error(p)
    assert "defines no function 'program'" in msg and "--" in msg
    assert '"gpus"' not in p.stderr


def test_unbalanced_warning_names_the_dsl_call():
    p = cli("compile", str(UNBALANCED), "-o", os.devnull, "-q")
    assert p.returncode == 0, p.stderr
    text = UNBALANCED.read_text().splitlines()
    signal_line = next(i for i, x in enumerate(text, 1) if ".signal(tb=0)" in x)
    wait_line = next(i for i, x in enumerate(text, 1) if ".wait(tb=0)" in x)
    warned = [x for x in p.stderr.splitlines() if "warning: unbalanced signal/wait" in x]
    assert warned
    for w in warned:
        expect = signal_line if "waits 0 times" in w else wait_line
        assert w.startswith(f"{UNBALANCED.name}:{expect}: "), w
