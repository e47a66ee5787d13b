"""The ``mscclang`` command (compile, import-mscclpp, show), run as ``python -m mscclang`` in a
subprocess: exit codes, files written, and errors on stderr without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.harness.cli import EXAMPLE, ROOT, cli, cli_inproc, script, user_error
from tests.harness.plan_samples import allpairs_allreduce, kitchen_sink, mscclpp_packet_allreduce
from mscclang.plan import from_mscclpp, load_plan, plan_to_dict

# ------------------------------------------------------------------------------------ compile

def test_compile_example_to_file_and_show(tmp_path):
    out = tmp_path / "ar8.json"
    res = cli("compile", str(EXAMPLE), "-o", str(out), "--", "--num_gpus", "8")
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    plan = load_plan(out)
    assert plan.collective == "allreduce" and len(plan.gpus) == 8
    assert all(g.input_chunks == 8 for g in plan.gpus)
    # stdout output is the same bytes (deterministic compile)
    res2 = cli("compile", str(EXAMPLE), "--", "--num_gpus", "8")
    assert res2.returncode == 0 and res2.stdout == out.read_text()
    shown = cli("show", str(out), "--rank", "2")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "rank 2:" in text and "rank 1:" not in text and "rank 3:" not in text
    assert "tb 0:" in text
    assert "i[0:1] -> s[2:3]@r0" in text  # rank 2 puts its chunk 0 into slot 2 of rank 0's scratch
    assert "ch0->r0" in text


def test_compile_function_program(tmp_path):
    res = cli("compile", str(EXAMPLE), "--ranks", "4", "--instances", "2")
    assert res.returncode == 0, res.stderr
    plan = load_plan(json.loads(res.stdout))
    assert len(plan.gpus) == 4 and plan.gpus[0].input_chunks == 8  # 4 ranks x 2 instances
    user_error(cli("compile", str(EXAMPLE), "--ranks", "4", "--protocol", "LL"),
               "program() of", "line ", "ValueError", "Simple protocol only")
    user_error(cli("compile", str(EXAMPLE), "--function", "nothere", "--ranks", "2"),
               "defines no function 'nothere'")
    user_error(cli("compile", str(EXAMPLE), "--function", "program"), "needs --ranks")


def test_function_convention_variants(tmp_path):
    sample = tmp_path / "sample.json"
    sample.write_text(json.dumps(allpairs_allreduce(2)))
    p = script(tmp_path, f"""
        import json
        print("not a plan, just chatter")

        def build(num_gpus):                     # only the ranks, under another accepted name
            d = json.load(open({str(sample)!r}))
            d["name"] = "n%d" % num_gpus
            return json.dumps(d)

        def bad(instances):
            return None
        """)
    res = cli("compile", str(p), "--function", "build", "--ranks", "2")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["name"] == "n2"
    assert "chatter" in res.stderr  # the program's own output is passed on to stderr
    user_error(cli("compile", str(p), "--function", "bad", "--ranks", "2"), "number of ranks")


def test_script_gets_arguments_after_dashdash_unchanged(tmp_path):
    sample = tmp_path / "sample.json"
    sample.write_text(json.dumps(allpairs_allreduce(2)))
    p = script(tmp_path, f"""
        import json, sys
        d = json.load(open({str(sample)!r}))
        d["name"] = "|".join(sys.argv[1:])
        print("hello before the plan")
        print(json.dumps(d, indent=1))
        print("and after")
        """)
    res = cli("compile", str(p), "--", "--num_gpus", "2", "-x", "--weird=1", "--")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["name"] == "--num_gpus|2|-x|--weird=1|--"
    assert "hello before the plan" in res.stderr and "and after" in res.stderr


def test_script_printing_mscclpp_plan_is_converted(tmp_path):
    src = tmp_path / "m.json"
    src.write_text(json.dumps(mscclpp_packet_allreduce()))
    p = script(tmp_path, f"print(open({str(src)!r}).read())\n")
    res = cli("compile", str(p))
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["format"] == "mscclang.plan/1"
    assert plan_to_dict(load_plan(doc)) == plan_to_dict(from_mscclpp(mscclpp_packet_allreduce()))


def test_compile_can_write_mscclpp_format(tmp_path):
    out = tmp_path / "m.json"
    res = cli("compile", str(EXAMPLE), "--format", "mscclpp", "-o", str(out), "--", "--num_gpus", "4")
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    assert "format" not in doc and doc["collective"] == "allreduce"
    assert len(from_mscclpp(doc).gpus) == 4


def test_compile_user_mistakes(tmp_path, capsys):
    boom = script(tmp_path, "x = 1\ny = x / 0\n", "boom.py")
    user_error(cli("compile", str(boom)), "boom.py failed at line 2", "ZeroDivisionError")  # real process

    def run(*args):
        return cli_inproc(capsys, *args)

    user_error(run("compile", str(tmp_path / "missing.py")), "does not exist")
    user_error(run("compile", str(boom)), "boom.py failed at line 2", "ZeroDivisionError")
    syntax = script(tmp_path, "def f(:\n", "syn.py")
    user_error(run("compile", str(syntax)), "SyntaxError", "line 1")
    quiet = script(tmp_path, "x = 1\n", "quiet.py")
    user_error(run("compile", str(quiet)), "printed no plan")
    parses = script(tmp_path, """
        import argparse
        argparse.ArgumentParser().parse_args()
        """, "parses.py")
    user_error(run("compile", str(parses), "--", "--bogus"), "exited with status 2", "unrecognized arguments")
    dsl = script(tmp_path, """
        from mscclang.dsl import AllReduce, CollectiveProgram, JSON, Rank
        with CollectiveProgram("bad", AllReduce(2, 1, False), 2):
            inp = Rank(0).get_input_buffer()
            Rank(0).copy(Rank(0).get_output_buffer()[0:1], inp[0:3], tb=0)
            print(JSON())
        """, "dsl.py")
    res = run("compile", str(dsl))
    user_error(res, "mscclang compile: error:")
    # an invalid plan is reported with the JSON path of the bad field
    doc = allpairs_allreduce(2)
    doc["gpus"][1]["threadblocks"][0]["ops"][4]["src_buff"][0]["index"] = 7
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    badplan = script(tmp_path, f"print(open({str(bad)!r}).read())\n", "badplan.py")
    user_error(run("compile", str(badplan)), "gpus[1].threadblocks[0].ops[4].src_buff[0].index", "invalid plan")
    assert run("compile", str(badplan), "--no-check").returncode == 0
    user_error(run("compile", str(EXAMPLE), "--ranks", "0"), "at least 1")
    user_error(run("compile", str(EXAMPLE), "--protocol", "LL128"), "invalid choice")


# ------------------------------------------------------------------------------ import-mscclpp

def test_import_mscclpp(tmp_path):
    src = tmp_path / "in.json"
    src.write_text(json.dumps(mscclpp_packet_allreduce()))
    out = tmp_path / "out.json"
    res = cli("import-mscclpp", str(src), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert plan_to_dict(load_plan(out)) == plan_to_dict(from_mscclpp(mscclpp_packet_allreduce()))
    res = cli("import-mscclpp", str(src))
    assert res.returncode == 0 and json.loads(res.stdout) == json.loads(out.read_text())
    res = cli("import-mscclpp", "-", stdin=src.read_text())
    assert res.returncode == 0 and json.loads(res.stdout) == json.loads(out.read_text())


def test_import_mscclpp_errors(tmp_path, capsys):
    def run(*args):
        return cli_inproc(capsys, *args)

    user_error(run("import-mscclpp", str(tmp_path / "nope.json")), "cannot read")
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    user_error(run("import-mscclpp", str(junk)), "not valid JSON")
    d = mscclpp_packet_allreduce()
    d["gpus"][1]["threadblocks"][0]["ops"][1]["channel_type"] = "carrier-pigeon"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    user_error(run("import-mscclpp", str(bad)), "gpus[1].threadblocks[0].ops[1].channel_type")
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps(allpairs_allreduce(2)))
    user_error(run("import-mscclpp", str(ours)), "already an mscclang plan")


# ------------------------------------------------------------------------------------ show

def test_show_kitchen_sink(tmp_path):
    f = tmp_path / "ks.json"
    f.write_text(json.dumps(kitchen_sink()))
    res = cli("show", str(f))
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert text.startswith("plan kitchen_sink: allreduce over 2 ranks, protocol LL")
    for needle in ("rank 0:", "rank 1:", "tb 3:", "i[0:2]@r1 -> o[0:2]",
                   "o[0:2]@sw0", "s[0:1]@sw1", "pipeline   unit 4 KiB", "4.1  copy", "tbg 1/2",
                   "sem #0", "id 0, 2 thread blocks tbs [0, 1]", "ch0->r1 ch1->r1", "max",
                   "switch sw0:o{0,1} sw1:s{0,1}", "#0=o@r1(memory,port)", "semaphores: #0=0 #1=1"):
        assert needle in text, (needle, text)
    one = cli("show", str(f), "--rank", "1", "--tb", "1").stdout
    assert "rank 1:" in one and "rank 0:" not in one and "tb 1:" in one and "tb 0:" not in one


def test_show_mscclpp_and_errors(tmp_path, capsys):
    m = tmp_path / "m.json"
    m.write_text(json.dumps(mscclpp_packet_allreduce()))
    res = cli("show", str(m))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("(converted from an MSCCL++ plan)")
    assert "respkt" in res.stdout and "tbg 0/2" in res.stdout

    def run(*args):
        return cli_inproc(capsys, *args)

    assert run("show", str(m)).stdout == res.stdout  # in-process and real runs agree
    user_error(run("show", str(m), "--rank", "2"), "ranks 0..1")
    user_error(run("show", str(tmp_path / "none.json")), "cannot read")
    doc = kitchen_sink()
    doc["gpus"][0]["threadblocks"][0]["ops"][3]["dst_buff"][0]["buffer_id"] = 9
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    user_error(run("show", str(bad)), "gpus[0].threadblocks[0].ops[3].dst_buff[0].buffer_id")
    res = run("show", str(bad), "--no-check")
    assert res.returncode == 0 and "?[0:2]@remote#9" in res.stdout


def test_usage_errors_exit_1(capsys):
    user_error(cli("show"), "PLAN.json")
    user_error(cli_inproc(capsys, "frobnicate"), "invalid choice")
    res = cli()
    assert res.returncode == 1 and "usage" in res.stderr


# ------------------------------------------------------------------------------ README / CI

def _readme_block(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(title)
    block = text[start:].split("```", 2)[1]
    lines = [x for x in block.splitlines()[1:] if x.strip()]
    assert len(lines) == 1, lines
    return lines[0].strip()


def test_ci_runs_exactly_the_readme_test_command():
    cmd = _readme_block("**Tests**")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert cmd in [x.strip() for x in ci], (cmd, ci)
    torch_line = next(i for i, x in enumerate(ci) if "torch==2.13.0" in x and "install" in x)
    assert torch_line < [x.strip() for x in ci].index(cmd)


def test_readme_main_job_compiles_and_shows_an_8_rank_allreduce():
    cmd = _readme_block("**Main job**")
    assert "mscclang compile examples/allreduce_8rank.py" in cmd and "mscclang show" in cmd
    assert "torch==2.13.0" in cmd


def test_example_plan_verifies_in_simulator():
    """The README's example program is a correct allreduce (checked by the CPU simulator)."""
    from mscclang.cli.compile_cmd import compile_file
    from mscclang.sim import verify

    plan = compile_file(EXAMPLE, ["--num_gpus", "4"])
    report = verify(plan, schedules=3, dtypes=("float32", "int32"))
    assert report.ok, str(report)
