"""``mscclang compile``: what it reports about the plan it wrote, DSL warnings and ``--strict``,
and a JSON plan given instead of a program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.harness.plan_samples import mscclpp_packet_allreduce
from mscclang import DSLError, DSLWarning
from mscclang.cli.compile_cmd import compile_file, describe_output
from mscclang.cli.main import main
from mscclang.plan import load_plan

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "allreduce_8rank.py"
UNBALANCED = Path(__file__).parent / "programs_unbalanced" / "signal_wait_fuse.py"


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``mscclang ARGS`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def test_compile_reports_what_it_wrote(tmp_path, capsys):
    out = tmp_path / "ar.json"
    rc, stdout, stderr = run(capsys, "compile", str(EXAMPLE), "-o", str(out), "--", "--num_gpus", "4")
    assert rc == 0, stderr
    assert stdout == ""
    plan = load_plan(out)
    n_ops = sum(len(tb.ops) for g in plan.gpus for tb in g.threadblocks)
    assert stderr == (f"mscclang compile: wrote allreduce plan 'allreduce_allpairs' (mscclang.plan/1): "
                      f"4 ranks, 1 thread block per rank (4 in all), {n_ops} ops, to {out}\n")
    rc, _, stderr = run(capsys, "compile", str(EXAMPLE), "-q", "-o", str(out), "--", "--num_gpus", "4")
    assert rc == 0 and stderr == ""
    rc, _, stderr = run(capsys, "compile", str(EXAMPLE), "--format", "mscclpp", "-o", str(out), "--",
                        "--num_gpus", "2")
    assert rc == 0 and "(MSCCL++ 0.9 format): 2 ranks" in stderr


def test_describe_output_counts_uneven_blocks_and_pipeline_ops():
    from mscclang.algorithms import build

    plan = build("allreduce_rsag_pipelined", 2, instances=2)
    inner = sum(len(op.ops or []) for g in plan.gpus for tb in g.threadblocks for op in tb.ops)
    outer = sum(len(tb.ops) for g in plan.gpus for tb in g.threadblocks)
    assert inner > 0
    text = describe_output(plan)
    assert text.endswith(f", {inner + outer} ops")
    n = len(plan.gpus[1].threadblocks)
    plan.gpus[1].threadblocks.pop()
    assert f"2 ranks, {n - 1}-{n} thread blocks per rank ({2 * n - 1} in all)" in describe_output(plan)


def test_stdout_stays_clean_json():
    """Real process: with no -o (and with -o -) stdout is exactly the plan, the report on stderr."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outs = []
    for extra in ([], ["-o", "-"]):
        res = subprocess.run([sys.executable, "-m", "mscclang", "compile", str(EXAMPLE), *extra, "--",
                              "--num_gpus", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["format"] == "mscclang.plan/1"
        assert res.stderr.startswith("mscclang compile: wrote allreduce plan") and "to standard output" in res.stderr
        outs.append(res.stdout)
    assert outs[0] == outs[1]
    assert not (ROOT / "-").exists()


def test_dsl_warnings_printed_and_strict_refuses(tmp_path, capsys):
    out = tmp_path / "sw.json"
    rc, _, stderr = run(capsys, "compile", str(UNBALANCED), "-o", str(out))
    assert rc == 0, stderr
    lines = stderr.splitlines()
    warned = [x for x in lines if ": warning: unbalanced signal/wait" in x]
    assert len(warned) == 8
    assert all(x.startswith("signal_wait_fuse.py:") for x in warned)
    assert "rank 0 signals 1 times on its memory channel 0 to rank 1, but rank 1 waits 0 times" in stderr
    assert lines[-1].startswith("mscclang compile: wrote test plan 'signal_wait_fuse'")
    assert load_plan(out).name == "signal_wait_fuse"

    strict_out = tmp_path / "strict.json"
    rc, _, stderr = run(capsys, "compile", "--strict", str(UNBALANCED), "-o", str(strict_out))
    assert rc == 1
    assert "Traceback" not in stderr
    assert ("mscclang compile: error: signal_wait_fuse.py:" in stderr
            and "unbalanced signal/wait: rank 0 signals 1 times on its memory channel 0" in stderr
            and "(and 7 more warnings) [strict: warnings are errors]" in stderr), stderr
    assert not strict_out.exists()


def test_compile_program_hands_warnings_on_and_strict_raises():
    with pytest.warns(DSLWarning, match="unbalanced signal/wait"):
        plan = compile_file(UNBALANCED)
    assert plan.collective == "test"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict mode raises its own error, re-emits nothing of ours
        with pytest.raises(DSLError, match=r"\[strict: warnings are errors\]"):
            compile_file(UNBALANCED, strict=True)


def test_compile_given_a_plan_says_so(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    rc, _, _ = run(capsys, "compile", str(EXAMPLE), "-q", "-o", str(plan_file), "--", "--num_gpus", "2")
    assert rc == 0
    rc, stdout, stderr = run(capsys, "compile", str(plan_file))
    assert rc == 1 and stdout == "" and "Traceback" not in stderr
    assert f"{plan_file} is an execution plan, not a DSL program" in stderr
    assert f"mscclang verify {plan_file}" in stderr and f"mscclang show {plan_file}" in stderr
    # an MSCCL++ plan, under a name that does not end in .json
    m = tmp_path / "plan.txt"
    m.write_text(json.dumps(mscclpp_packet_allreduce()))
    rc, _, stderr = run(capsys, "compile", str(m))
    assert rc == 1 and "is an MSCCL++ execution plan, not a DSL program" in stderr
    # other JSON, and a broken .json file
    other = tmp_path / "cfg.json"
    other.write_text('{"a": 1}')
    rc, _, stderr = run(capsys, "compile", str(other))
    assert rc == 1 and "is a JSON file, not a DSL program" in stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"gpus": [')
    rc, _, stderr = run(capsys, "compile", str(broken))
    assert rc == 1 and "ends in .json, so it is not a DSL program" in stderr and "Traceback" not in stderr


def test_dsl_errors_name_the_program_line(tmp_path, capsys):
    prog = tmp_path / "mistake.py"
    prog.write_text("from mscclang import *\n"
                    "with CollectiveProgram('bad', AllReduce(2, 1, False), 2):\n"
                    "    inp = Rank(0).get_input_buffer()\n"
                    "    Rank(0).copy(Rank(0).get_output_buffer()[0:1], inp[0:2], tb=0)\n"
                    "    print(JSON())\n")
    rc, _, stderr = run(capsys, "compile", str(prog))
    assert rc == 1 and "Traceback" not in stderr
    assert stderr.startswith("mscclang compile: error: mistake.py line 4: rank 0, tb 0: Rank(0).copy: size mismatch")
    # errors found when compiling name the op's source line
    prog.write_text("from mscclang import *\n"
                    "with CollectiveProgram('dl', AllReduce(2, 1, False), 2):\n"
                    "    a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)\n"
                    "    a.wait(0)\n"
                    "    a.signal(0)\n"
                    "    b.wait(0)\n"
                    "    b.signal(0)\n"
                    "    print(JSON())\n")
    rc, _, stderr = run(capsys, "compile", str(prog))
    assert rc == 1 and "mistake.py line 8: dependency cycle" in stderr and "(wait, mistake.py:4)" in stderr


EMPTY = '''
from mscclang.dsl import AllReduce, CollectiveProgram, JSON


def program(ranks, instances=1, protocol="Simple"):
    prog = CollectiveProgram("nothing", AllReduce(ranks, 1, True), ranks, instances=instances, protocol=protocol)
    with prog:
        pass
    return prog


if __name__ == "__main__":
    with program(2):
        print(JSON())
'''


@pytest.mark.parametrize("how", [["--ranks", "2"], []], ids=["function", "script"])
def test_an_empty_program_compiles_with_a_warning(how, tmp_path, capsys):
    """Issue 34 item 17: a program that builds no op wrote a plan without a word."""
    prog = tmp_path / "empty.py"
    prog.write_text(EMPTY)
    out = tmp_path / "empty.json"
    rc, _, err = run(capsys, "compile", str(prog), *how, "-o", str(out))
    assert rc == 0 and out.is_file(), err
    assert "empty.py:1: warning: the program built no ops: plan 'nothing' moves no data" in err, err
    rc, _, err = run(capsys, "compile", str(prog), *how, "-o", str(tmp_path / "strict.json"), "--strict")
    assert rc == 1 and "[strict: warnings are errors]" in err and not (tmp_path / "strict.json").exists()
    with pytest.warns(DSLWarning, match="built no ops"):
        compile_file(prog, ranks=2, function="program")
    with warnings.catch_warnings():   # a program with ops: no such warning
        warnings.simplefilter("error", DSLWarning)
        compile_file(EXAMPLE, ["--num_gpus", "2"])
