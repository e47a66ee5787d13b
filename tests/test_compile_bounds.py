"""``mscclang compile`` and ``mscclang demo`` stay bounded: programs over too many ranks, instances
or ops, and programs whose plan would be more than plans are read with, are refused before the
work (with the estimate and the setting that raises the limit); a plan over the size limit is
never written; a script given ``--ranks`` is refused before its plan is dumped; DSL warnings
name the DSL call that caused them. The plan estimate is checked against the plans compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mscclang import CollectiveProgram, DSLError, LimitError
from mscclang.algorithms.generate import build_variant, shipped, variant_stem
from mscclang.compiler.budget import ERROR, estimate_plan, reporting
from mscclang.dsl import AllReduce
from mscclang.plan.io import plan_to_json
from tests.harness.compiles import capture_compiles, example_program, run_script

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
    assert "compile allreduce_8rank.py: " in p.stderr and "step" in p.stderr
    for step in ("validate", "fuse", "emit", "checking the plan", "writing the plan"):  # the passes, the tail
        assert step in p.stderr, step


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


# --- the plan estimate and the plan limits

#: shipped variants at both ends of the estimate's error (pipelines, barriers and thread-block
#: groups; 16 instances; port channels)
VARIANTS = ("allreduce_port_pipelined.r2.i1.steps16", "allreduce_rsag_zero_copy.r8.i16",
            "allreduce_hierarchical.r8.i4.gpus_per_node2", "allreduce_oneshot_ll.r2.i32.inplace",
            "allgather_port.r2.i1", "reducescatter_zero_copy.r8.i16")
PROGRAMS = ROOT / "tests" / "programs"


def _build(case: str) -> None:
    kind, _, arg = case.partition(":")
    if kind == "allpairs":
        ranks, instances = map(int, arg.split("x"))
        example_program("allreduce_8rank")(ranks, instances).to_plan()
    elif kind == "script":
        name, ranks = arg.split("@")
        run_script(ROOT / name, *(["--num_gpus", ranks] if ranks else []))
    else:
        build_variant(*next((i, v) for i, v in shipped() if variant_stem(i, v) == arg))


@pytest.mark.parametrize("case", [f"allpairs:{r}x{i}" for r in (2, 8, 16) for i in (1, 2)]
                         + [f"script:tests/programs/{p.name}@{n}" for p in sorted(PROGRAMS.glob("*.py")) for n in (2, 8)]
                         + ["script:examples/oneshot_allreduce.py@", "script:examples/fused_oneshot.py@4"]
                         + [f"variant:{v}" for v in VARIANTS])
def test_plan_estimate_is_within_its_error_of_the_plan(case):
    with capture_compiles() as seen:
        _build(case)
    assert seen
    for c in seen:
        est = estimate_plan(c.ir)
        real = len(plan_to_json(c.plan).encode())
        assert 1 / ERROR <= est.plan_bytes / real <= ERROR, (est.plan_bytes, real)
        ops = sum(1 + len(op.ops or []) for g in c.plan.gpus for tb in g.threadblocks for op in tb.ops)
        assert est.plan_ops <= ops  # fusion taken by op kind: rather too many merges than too few
        assert est.ops == c.ir.instances * sum(1 + len(op.body or ()) for r in c.ir.ranks for tb in r.tbs for op in tb)


def test_compile_refuses_before_the_work_a_plan_far_over_the_limits(tmp_path):
    out = tmp_path / "plan.json"
    # 16 ranks: a plan of 320 KiB and 240 ops
    for env, setting in (({"MSCCLANG_MAX_PLAN_BYTES": "100K"}, "MSCCLANG_MAX_PLAN_BYTES"),
                         ({"MSCCLANG_MAX_PLAN_OPS": "100"}, "MSCCLANG_MAX_PLAN_OPS")):
        msg = one_line_error(cli("compile", str(EXAMPLE), "--ranks", "16", "-o", str(out), env=env))
        assert "would compile to a plan of about 3" in msg and "KiB (240 ops)" in msg, msg
        assert "to compile" in msg and f"set {setting} to raise it" in msg, msg
        assert not out.exists()


def test_library_compile_is_refused_before_the_first_pass(monkeypatch):
    monkeypatch.setenv("MSCCLANG_MAX_PLAN_BYTES", "100K")
    notes: list[str] = []
    prog = example_program("allreduce_8rank")(16)
    with reporting(lambda done, total, note: notes.append(note)), \
            pytest.raises(LimitError, match="MSCCLANG_MAX_PLAN_BYTES"):
        prog.to_plan()
    assert set(notes) <= {"recording"}  # no pass started


@pytest.mark.parametrize("fmt", ["mscclang", "mscclpp"])
def test_compile_never_writes_a_plan_over_the_size_limit(tmp_path, fmt):
    # over the limit by less than the estimate's error: compiled, then refused by its real size
    out = tmp_path / "plan.json"
    limit = {"mscclang": "300K", "mscclpp": "270K"}[fmt]  # plans of 320 and 280 KiB
    for where in (str(out), "-"):
        p = cli("compile", str(EXAMPLE), "--ranks", "16", "--format", fmt, "-o", where,
                env={"MSCCLANG_MAX_PLAN_BYTES": limit})
        msg = one_line_error(p)
        assert msg.startswith("mscclang compile: error: the plan is ") and f"over the {limit[:3]} KiB limit on plans" in msg
        assert "set MSCCLANG_MAX_PLAN_BYTES to raise it" in msg and "nothing was written" in msg
        assert p.stdout == "" and not out.exists()
