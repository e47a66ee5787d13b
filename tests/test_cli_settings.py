"""What a new user meets first: ``mscclang --version``, the error classes the docs name, a typo'd
flag, files of the wrong kind, and the settings every command honours or refuses
(``MSCCLANG_PLANS_DIR``, ``MSCCLANG_TUNING``): one line on stderr, exit status 1."""

from __future__ import annotations

import argparse
import inspect
import json
import re

import pytest

from tests.harness.cli import ROOT, cli, cli_inproc, user_error

import mscclang
import mscclang.errors

GOLDEN = ROOT / "tests" / "golden"
SMALL = GOLDEN / "prog_allreduce_ll_twostep_2.json"


# ------------------------------------------------------------------------ version, exports

def test_version_flag():
    res = cli("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"mscclang {mscclang.__version__}"


def test_every_error_class_is_exported_from_mscclang():
    """Every exception and warning of :mod:`mscclang.errors` (the README and docs name them as
    ``mscclang.X``), and every such name the docs use, is importable from ``mscclang``."""
    classes = {n for n, c in vars(mscclang.errors).items()
               if inspect.isclass(c) and issubclass(c, (Exception, Warning)) and c.__module__ == "mscclang.errors"}
    docs = "".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    named = set(re.findall(r"\b([A-Z]\w*(?:Error|Call|Mismatch|Timeout|Unavailable|Unsupported|Warning))\b", docs))
    assert {"CommError", "InvalidCall", "CallMismatch"} <= named
    for name in classes | (named & set(dir(mscclang.errors))) | ({"TuningError"} & named):
        assert name in mscclang.__all__, name
        assert getattr(mscclang, name).__name__ == name
    from mscclang import CallMismatch, CommError, InvalidCall  # noqa: F401


# ------------------------------------------------------------------------------- typo'd flag

@pytest.mark.parametrize("argv,wrong,right", [
    (["verify", str(SMALL), "--shedules", "3"], "--shedules", "--schedules"),
    (["verify", str(SMALL), "--shedules=3"], "--shedules", "--schedules"),
    (["demo", "--cpus"], "--cpus", "--cpu"),
    (["predict", str(SMALL), "--topolgy", "nvlink"], "--topolgy", "--topology"),
])
def test_a_typod_flag_gets_did_you_mean(capsys, argv, wrong, right):
    res = cli_inproc(capsys, *argv)
    user_error(res, f"unrecognized arguments: {wrong}", f"did you mean {right}?")
    assert "a list is one comma list" not in res.stderr, res.stderr


def test_every_command_suggests_its_options(capsys):
    """For every command, each long option with a letter left out gets "did you mean" that option."""
    from mscclang.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for opt in (o for a in p._actions for o in a.option_strings if o.startswith("--") and len(o) > 6):
            typo = opt[:4] + opt[5:]
            if any(o.startswith(typo) for a in p._actions for o in a.option_strings):
                continue   # an abbreviation argparse accepts
            plans = ["x.json"] * sum(not a.option_strings and a.required for a in p._actions)
            res = cli_inproc(capsys, name, typo, *plans)
            user_error(res, f"{typo}: did you mean ")


@pytest.mark.parametrize("argv,wrong,right", [
    (["verfy", str(SMALL)], "verfy", "verify"),
    (["exprt-mscclpp", str(SMALL)], "exprt-mscclpp", "export-mscclpp"),
    (["bnch", "--sizes", "1K"], "bnch", "bench"),
])
def test_a_typod_command_gets_did_you_mean(capsys, argv, wrong, right):
    res = cli_inproc(capsys, *argv)
    user_error(res, f"mscclang: error: argument COMMAND: invalid choice: '{wrong}'", f"did you mean {right}?")
    assert len(res.stderr.strip().splitlines()) == 2, res.stderr   # the usage line, the error


def test_a_command_like_none_lists_them_all(capsys):
    res = cli_inproc(capsys, "zzzz")
    user_error(res, "invalid choice: 'zzzz'", "'verify'")
    assert "did you mean" not in res.stderr, res.stderr


# ------------------------------------------------------------------- files of the wrong kind

@pytest.mark.parametrize("content", ["plan", "{}", '{"results": []}', "[1, 2]", "not json"])
@pytest.mark.parametrize("flag", ["--calibrate", "--error"])
def test_predict_refuses_files_that_are_not_bench_results(capsys, tmp_path, flag, content):
    f = tmp_path / "f.json"
    f.write_text(SMALL.read_text() if content == "plan" else content)
    out = tmp_path / "cal.json"
    res = cli_inproc(capsys, "predict", flag, str(f), "-o", str(out))
    user_error(res, str(f))
    assert "0 figures" not in res.stdout and not out.exists()
    assert res.stderr.count("\n") == 1, res.stderr


# ------------------------------------------------------------------------------- settings

@pytest.fixture
def cpu_demo(monkeypatch):
    """``mscclang demo`` on the simulator, whatever this machine has."""
    import mscclang.cli.demo_cmd as demo_cmd

    def small(sizes, dtype, world=2):
        return real(sizes, dtype, world)

    real = demo_cmd.run_simulator
    monkeypatch.setattr(demo_cmd, "run_gpus", lambda sizes, dtype, world: small(sizes, dtype))
    return monkeypatch


@pytest.mark.parametrize("kind", ["missing", "empty", "file", "no plan"])
def test_a_plans_dir_without_plans_is_refused(capsys, cpu_demo, tmp_path, kind):
    folder = tmp_path / "plans"
    if kind in ("empty", "no plan"):
        folder.mkdir()
    if kind == "no plan":
        (folder / "tuning.json").write_text((ROOT / "mscclang" / "comm" / "tuning_2xh200.json").read_text())
    elif kind == "file":
        folder.write_text("")
    cpu_demo.setenv("MSCCLANG_PLANS_DIR", str(folder))
    res = cli_inproc(capsys, "demo", "--sizes", "1K")
    user_error(res, "MSCCLANG_PLANS_DIR", str(folder))
    assert res.stderr.count("\n") == 1, res.stderr
    from mscclang.comm.catalog import Catalog
    from mscclang.errors import SettingError

    from mscclang.comm import Communicator
    from mscclang.comm.sim_backend import SimWorld

    with pytest.raises(SettingError, match="MSCCLANG_PLANS_DIR"):
        Catalog.from_dir()
    with pytest.raises(SettingError, match=f"MSCCLANG_PLANS_DIR='{folder}'"):
        Communicator(backend=SimWorld(1).backend(0), fallback=False)


def test_the_demo_honours_and_checks_mscclang_tuning(capsys, cpu_demo, tmp_path):
    cpu_demo.setenv("MSCCLANG_TUNING", "{not json")
    user_error(cli_inproc(capsys, "demo", "--sizes", "1K"), "not valid JSON")
    # a valid table that sends every call to NCCL: the demo's calls go there
    cpu_demo.setenv("MSCCLANG_TUNING", json.dumps({"format": "mscclang.tuning/1", "rules": [{"collective": c, "candidates": [{"plan": "nccl"}]}
                                                             for c in ("allreduce", "allgather")]}))
    res = cli_inproc(capsys, "demo", "--sizes", "1K")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("nccl") == 2, res.stdout


@pytest.mark.parametrize("command", ["show", "verify", "run", "predict", "import-mscclpp"])
@pytest.mark.parametrize("other", ["notes/bench_2xh200/bench.json", "mscclang/comm/tuning_2xh200.json"])
def test_plan_commands_name_a_file_of_another_kind(capsys, command, other):
    res = cli_inproc(capsys, command, str(ROOT / other))
    user_error(res, str(ROOT / other), "file, not a plan")
    assert res.stderr.count("\n") == 1 and "already an mscclang plan" not in res.stderr, res.stderr


BENCH, TUNING, PLAN = "notes/bench_2xh200/bench.json", "mscclang/comm/tuning_2xh200.json", str(SMALL)


@pytest.mark.parametrize("argv,other,what", [
    (["show", PLAN, "--png", "{tmp}/p.png", "--trace"], BENCH, "not a Chrome trace"),
    (["show", PLAN, "--png", "{tmp}/p.png", "--trace"], PLAN, "not a Chrome trace"),
    (["show", PLAN, "--png", "{tmp}/p.png", "--trace"], "{tmp}/empty.json", "not a Chrome trace"),
    (["predict", PLAN, "--topology"], BENCH, "not a topology"),
    (["predict", PLAN, "--topology"], PLAN, "not a topology"),
    (["bench", "-o", "{tmp}/out", "--from-json"], PLAN, "not a `mscclang bench` result"),
    (["bench", "-o", "{tmp}/out", "--from-json"], TUNING, "not a `mscclang bench` result"),
    (["bench", "-o", "{tmp}/out", "--from-json"], "{tmp}/empty.json", "not a `mscclang bench` result"),
    (["bench", "-o", "{tmp}/out", "--from-json"], "{tmp}/list.json", "not a `mscclang bench` result"),
])
def test_files_of_another_kind_are_named(capsys, tmp_path, argv, other, what):
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "list.json").write_text("[1, 2]")
    other = other.format(tmp=tmp_path)
    other = other if other.startswith("/") else str(ROOT / other)
    res = cli_inproc(capsys, *[a.format(tmp=tmp_path) for a in argv], other)
    user_error(res, other, what)
    assert res.stderr.count("\n") == 1, res.stderr


def test_predict_error_names_a_bench_file_whose_plans_are_not_here(capsys, tmp_path):
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"format": "mscclang.bench/1", "meta": {"world_size": 2}, "results": [
        {"coll": "all_reduce", "impl": "mscclang", "mode": "graph", "bytes": 1024, "us": 2.0, "ok": True,
         "plan": "nosuch.r2.i1"}]}))
    user_error(cli_inproc(capsys, "predict", "--error", str(f)), str(f), "none of its plans is in the plans folder")


@pytest.mark.parametrize("var,value,needle", [("MSCCLANG_TUNING", "{not json", "not valid JSON"),
                                              ("MSCCLANG_PLANS_DIR", "/nonexistent/plans", "no such folder")])
def test_the_gpu_demo_refuses_bad_settings_before_starting_workers(capsys, monkeypatch, var, value, needle):
    """With GPUs each worker process would meet the bad setting on its own, and the demo wait for
    their results."""
    import torch

    import mscclang.cli.demo_cmd as demo_cmd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(demo_cmd, "run_gpus", lambda *a: pytest.fail("workers started"))
    monkeypatch.setenv(var, value)
    user_error(cli_inproc(capsys, "demo"), var, needle)


def test_bench_refuses_a_broken_tuning_before_its_workers(capsys, monkeypatch, tmp_path):
    user_error(cli_inproc(capsys, "bench", "-o", str(tmp_path), "--tuning", "{not json"), "not valid JSON")
    monkeypatch.setenv("MSCCLANG_TUNING", str(tmp_path / "missing.json"))
    user_error(cli_inproc(capsys, "bench", "-o", str(tmp_path)), "missing.json")
