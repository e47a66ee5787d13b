"""One size and dtype grammar for every ``mscclang`` command (:mod:`mscclang.cli.args`), the
argument checks of verify/show/build-kernel/tune, Ctrl-C, and the progress bars
(:mod:`mscclang.cli.progress`): exit codes, and stderr without tracebacks."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness.cli import ROOT, cli, cli_inproc, user_error

from mscclang.cli.args import (DTYPE_ALIASES, GPU_DTYPES, MAX_LAUNCHES, MAX_SCHEDULES, SIM_DTYPES,
                               parse_dtype, parse_size, parse_sizes)
from mscclang.cli.progress import Progress

GOLDEN = ROOT / "tests" / "golden"
SMALL = GOLDEN / "prog_allreduce_ll_twostep_2.json"  # a correct 2-rank plan, quick to verify
ONE_BLOCK = GOLDEN / "op_signal.json"  # 2 ranks, one thread block each


def shows_sizes(report: str, short: str) -> bool:
    """Whether a verify report lists exactly these sizes (``1K, 4K``; or in bytes)."""
    in_bytes = ", ".join(str(parse_size(x)) for x in short.split(", "))
    return f"sizes {short};" in report or f"sizes {in_bytes};" in report


# ------------------------------------------------------------------------------------ grammar

@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("4K", 4096), ("4KB", 4096), ("4KiB", 4096), ("4kb", 4096), ("4kib", 4096),
    ("4k", 4096), ("4M", 4 << 20), ("4MB", 4 << 20), ("4mib", 4 << 20), ("1G", 1 << 30), (" 2K ", 2048),
    ("3000", 3000), ("1B", 1), ("4.5K", 4608), ("1.5M", 3 << 19), ("1T", 1 << 40), ("1_024", 1024),
])
def test_sizes_parse(text, value):
    assert parse_size(text) == value
    assert parse_sizes(text) == [value]


@pytest.mark.parametrize("text", ["0", "0K", "-4K", "-1", "4XB", "K", "", "4.3B", "4 K B", "1P", "4iB"])
def test_bad_sizes_are_refused_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="4KiB"):
        parse_size(text)


def test_size_lists_and_ranges():
    assert parse_sizes("1K:4M") == [1 << k for k in range(10, 23, 2)]  # x4 steps, as bench has
    assert parse_sizes("1K:8K:2") == [1024, 2048, 4096, 8192]
    assert parse_sizes("64K,1K,1K,4K:16K") == [1024, 4096, 16384, 65536]  # sorted, no duplicates
    for bad in ("4K:1K", "1K:4M:1", "1K:4M:x", "0:4K", "1K:-4K", "1K:2K:3:4", ","):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_dtype_names_and_aliases():
    for alias, canon in {"fp16": "float16", "float16": "float16", "half": "float16", "FP16": "float16",
                         "bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                         "int32": "int32", "i32": "int32", "torch.bfloat16": "bfloat16"}.items():
        assert parse_dtype(alias, GPU_DTYPES) == canon
    with pytest.raises(ValueError, match="float16 \\(fp16"):
        parse_dtype("fp64", GPU_DTYPES)
    assert parse_dtype("fp8_e4m3", GPU_DTYPES) == "float8_e4m3" == parse_dtype("e4m3", SIM_DTYPES)
    with pytest.raises(ValueError, match="unknown dtype 'u8'"):
        parse_dtype("u8", GPU_DTYPES)  # the simulator's, not the GPU's
    assert parse_dtype("u8", SIM_DTYPES) == "uint8"


def test_every_dtype_name_is_one_the_simulator_and_the_communicator_accept():
    from mscclang.plan.dtypes import gpu_dtype
    from mscclang.sim.dtypes import parse_dtype as sim_parse

    for name in set(SIM_DTYPES) | set(DTYPE_ALIASES):
        canon = parse_dtype(name, SIM_DTYPES)
        sim_parse(canon)  # raises when the simulator does not know it
        if canon in GPU_DTYPES:
            assert gpu_dtype(canon).name == canon


# ------------------------------------------------------------------------ the commands use it

def test_run_takes_every_size_form_and_dtype_alias(capsys, monkeypatch):
    """``run`` without GPUs verifies on the simulator; 4MB and fp16 were refused before."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = cli_inproc(capsys, "run", str(SMALL), "--size", "4KB", "--size", "1K:4K", "--dtype", "fp16")
    assert res.returncode == 0, res.stderr
    assert shows_sizes(res.stdout, "1K, 4K") and "float16" in res.stdout


@pytest.mark.parametrize("cmd", [
    ["run", str(SMALL), "--size"],
    ["verify", str(SMALL), "--sizes"],
    ["bench", "--sizes"],
    ["tune", "--sizes"],
    ["demo", "--sizes"],
])
@pytest.mark.parametrize("value,needle", [
    ("4XB", "bad size '4XB'"), ("0", "must be positive"), ("-4K", "bad size '-4K'"), ("4K:1K", "bad size range"),
])
def test_bad_sizes_name_the_option_in_every_command(capsys, cmd, value, needle):
    res = cli_inproc(capsys, *cmd, value)
    user_error(res, "argument --sizes/--size: ", needle)  # one option, two spellings
    assert "invalid" not in res.stderr  # not argparse's "invalid _size value"


@pytest.mark.parametrize("cmd", [
    ["run", str(SMALL)], ["verify", str(SMALL)], ["bench"], ["tune"], ["demo"], ["build-kernel"],
])
def test_bad_dtypes_name_the_option_and_the_names(capsys, cmd):
    user_error(cli_inproc(capsys, *cmd, "--dtype", "fp64"), "argument --dtype: unknown dtype 'fp64'",
               "float16 (fp16, half, f16)", "bfloat16 (bf16)")


def test_verify_takes_ranges_and_aliases(capsys):
    res = cli_inproc(capsys, "verify", str(SMALL), "--sizes", "1K:4K", "--sizes", "64kb", "--dtype", "bf16,i32",
                     "--schedules", "2")
    assert res.returncode == 0, res.stderr
    assert shows_sizes(res.stdout, "1K, 4K, 64K")
    assert "dtypes bfloat16, int32" in res.stdout


def test_verify_caps_schedules_and_launches(capsys):
    user_error(cli_inproc(capsys, "verify", str(SMALL), "--schedules", str(MAX_SCHEDULES + 1)),
               "argument --schedules", f"use 1..{MAX_SCHEDULES}")
    user_error(cli_inproc(capsys, "verify", str(SMALL), "--schedules", "0"), f"use 1..{MAX_SCHEDULES}")
    user_error(cli_inproc(capsys, "verify", str(SMALL), "--launches", str(MAX_LAUNCHES + 1)),
               "argument --launches", f"use 1..{MAX_LAUNCHES}")
    user_error(cli_inproc(capsys, "verify", str(SMALL), "--launches", "two"), "not an integer")
    help_text = cli_inproc(capsys, "verify", "--help").stdout
    assert f"1..{MAX_SCHEDULES}" in help_text and f"1..{MAX_LAUNCHES}" in help_text


# ------------------------------------------------------------------------------ misc checks

def test_verify_reads_the_plan_from_stdin():
    text = SMALL.read_text()
    res = cli("verify", "-", "--schedules", "2", stdin=text)
    assert res.returncode == 0, res.stderr
    assert "OK" in res.stdout
    user_error(cli("verify", "-", stdin=""), "no plan on standard input")
    user_error(cli("verify", "-", stdin="{oops"), "standard input is not valid JSON")


def test_show_refuses_thread_blocks_and_ranks_out_of_range(capsys):
    user_error(cli_inproc(capsys, "show", str(ONE_BLOCK), "--tb", "3"), "--tb 3", "thread block 0 only")
    user_error(cli_inproc(capsys, "show", str(ONE_BLOCK), "--tb", "-1"), "--tb -1")
    user_error(cli_inproc(capsys, "show", str(ONE_BLOCK), "--rank", "2"), "--rank 2", "ranks 0..1")
    user_error(cli_inproc(capsys, "show", str(ONE_BLOCK), "--png", "x.png", "--tb", "1"), "--tb 1")
    eight = GOLDEN / "prog_allreduce_ll_oneshot_8.json"
    user_error(cli_inproc(capsys, "show", str(eight), "--rank", "1", "--tb", "8"),
               "rank 1 has thread blocks 0..7")
    res = cli_inproc(capsys, "show", str(eight), "--rank", "1", "--tb", "7")
    assert res.returncode == 0 and "tb 7:" in res.stdout


def test_build_kernel_lists_the_valid_architectures(capsys):
    from mscclang.cli.build_kernel_cmd import check_arch

    assert check_arch("sm_90", [80, 90]) == "sm_90"
    assert check_arch("90a", [80, 90]) == "sm_90a"
    with pytest.raises(Exception, match="valid: sm_80, sm_90"):
        check_arch("sm_12", [80, 90])
    with pytest.raises(Exception, match="valid: sm_80, sm_90"):
        check_arch("ampere", [80, 90])
    res = cli_inproc(capsys, "build-kernel", "--arch", "sm_12")
    user_error(res, "--arch sm_12")
    assert "valid: sm_" in res.stderr or "NVRTC is not available" in res.stderr


def test_tune_checks_gpus_before_compiling_and_leaves_no_files(tmp_path):
    out = tmp_path / "t.json"
    t0 = time.monotonic()
    res = cli("tune", "--out", str(out), "--progress")
    user_error(res, "needs at least 2 CUDA GPUs")
    assert "compile + verify" not in res.stderr  # nothing was compiled
    assert time.monotonic() - t0 < 60
    assert list(tmp_path.iterdir()) == []


def test_a_failed_tune_removes_what_it_made(tmp_path, capsys, monkeypatch):
    """GPUs present but the measurement fails (or is interrupted) after the extra plans were
    compiled: the plans folder, the work folder and the tuning file are removed."""
    import mscclang.bench.runner as runner
    import mscclang.comm.tune as tune

    monkeypatch.setattr(runner, "gpu_count", lambda: 2)

    def fake_compile(catalog, colls, n, instances, threads, out_dir, progress=None, **kw):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "extra.json").write_text("{}")
        return tune.ExtraResult(added=["extra"])

    monkeypatch.setattr(tune, "compile_extra", fake_compile)

    def measure_nothing(cfg, limit, nprocs):
        Path(cfg.out_dir).mkdir(parents=True)
        (Path(cfg.out_dir) / "tune.jsonl").write_text("")
        return [], {}, ["worker failed: boom"]

    monkeypatch.setattr(runner, "run_tune_measure", measure_nothing)
    out = tmp_path / "t.json"
    user_error(cli_inproc(capsys, "tune", "--out", str(out)), "nothing was measured")
    assert list(tmp_path.iterdir()) == []

    def interrupted(cfg, limit, nprocs):
        Path(cfg.out_dir).mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_tune_measure", interrupted)
    res = cli_inproc(capsys, "tune", "--out", str(out))
    assert res.returncode == 130 and "mscclang tune: interrupted" in res.stderr
    assert list(tmp_path.iterdir()) == []
    # what existed before is kept
    keep = tmp_path / "t.plans"
    keep.mkdir()
    monkeypatch.setattr(runner, "run_tune_measure", measure_nothing)
    user_error(cli_inproc(capsys, "tune", "--out", str(out)), "nothing was measured")
    assert [p.name for p in tmp_path.iterdir()] == ["t.plans"]


# ---------------------------------------------------------------------------------- Ctrl-C

def test_ctrl_c_in_process_exits_130_with_one_line(capsys, monkeypatch):
    import mscclang.cli.verify_cmd as verify_cmd

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_cmd, "run", interrupted)
    res = cli_inproc(capsys, "verify", str(SMALL))
    assert res.returncode == 130
    assert res.stderr.strip() == "mscclang verify: interrupted"


def test_ctrl_c_in_process_reports_nothing_from_a_thread_in_a_gc_callback(capsys, monkeypatch):
    """The interrupt raised in a thread the command started may land while that thread runs a gc
    callback (hypothesis registers one), where Python can only report it as unraisable: the
    command still prints its one line, and nothing reaches ``sys.unraisablehook``."""
    import gc

    import mscclang.cli.verify_cmd as verify_cmd

    reported: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    inside = threading.Event()

    def slow_callback(phase: str, info: dict) -> None:
        if phase == "start" and threading.current_thread() is worker:
            inside.set()
            end = time.monotonic() + 2.0
            while time.monotonic() < end:   # the interrupt arrives here, between two bytecodes
                pass

    worker = threading.Thread(target=gc.collect, daemon=True)

    def interrupted(args):
        worker.start()
        assert inside.wait(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_cmd, "run", interrupted)
    gc.callbacks.append(slow_callback)
    try:
        res = cli_inproc(capsys, "verify", str(SMALL))
    finally:
        gc.callbacks.remove(slow_callback)
    worker.join(5)
    assert res.returncode == 130 and res.stderr.strip() == "mscclang verify: interrupted"
    assert reported == []
    assert sys.unraisablehook == reported.append   # put back once the thread ended


def test_ctrl_c_ends_a_long_verify_without_traceback():
    """A real SIGINT to ``mscclang verify`` in the middle of a long run (the progress bar shows it
    has started)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mscclang", "verify", str(GOLDEN / "prog_allreduce_ll_oneshot_8.json"),
         "--schedules", str(MAX_SCHEDULES), "--progress"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(proc.stderr.fileno(), 4096), b"")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while b"run" not in b"".join(chunks) and time.monotonic() < deadline:  # the bar: "1/3001 [..run/s]"
            time.sleep(0.2)
        assert b"run" in b"".join(chunks), chunks
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = b"".join(chunks).decode()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip().endswith("mscclang verify: interrupted"), err
    assert proc.stdout.read() == b""  # no report


# -------------------------------------------------------------------------------- progress

def test_progress_is_quiet_unless_asked_when_stderr_is_not_a_terminal():
    quiet = cli("verify", str(SMALL), "--schedules", "2")
    assert quiet.returncode == 0 and quiet.stderr.startswith("mscclang verify: ") and quiet.stderr.count("\n") == 1
    loud = cli("verify", str(SMALL), "--schedules", "2", "--progress")
    assert loud.returncode == 0, loud.stderr
    assert "verify " in loud.stderr and "run" in loud.stderr and "Traceback" not in loud.stderr
    assert loud.stdout == quiet.stdout.replace(quiet.stdout.split("\n")[1], loud.stdout.split("\n")[1])


def test_run_on_the_simulator_shows_progress_when_asked(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = cli_inproc(capsys, "run", str(SMALL), "--size", "1K", "--progress")
    assert res.returncode == 0 and "simulate " in res.stderr


def test_text_progress_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now fails
    buf = io.StringIO()
    with Progress(4, "work", unit="run", enabled=True, stream=buf) as bar:
        for _ in range(2):
            bar.update()
            bar._last_draw = 0.0  # redraw at once
        bar.update()
        assert bar._bar is None
    text = buf.getvalue()
    assert "work: 1/4 runs" in text and "ETA" in text and "work: 2/4 runs" in text
    assert text.endswith("\r\x1b[K")  # the line is cleared at the end
    off = io.StringIO()
    with Progress(4, "work", enabled=None, stream=off) as bar:  # StringIO is not a terminal
        bar.update(4)
    assert off.getvalue() == ""


def test_verify_reports_progress_through_its_callback():
    from mscclang.sim import verify

    calls = []
    rep = verify(str(SMALL), sizes=[1024, 4096], schedules=3, progress=lambda d, t: calls.append((d, t)))
    assert rep.ok
    assert calls == [(i, 7) for i in range(1, 8)]  # 2 sizes x 3 schedules + the symbolic run


def test_dtype_lists_for_the_kernel_prebuilder():
    from mscclang.cli.args import dtype_list_arg

    assert dtype_list_arg(GPU_DTYPES)("fp16, bf16,fp16") == ["float16", "bfloat16"]
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="unknown dtype 'fp64'"):
        dtype_list_arg(GPU_DTYPES)("fp16,fp64")
    with pytest.raises(argparse.ArgumentTypeError, match="no dtype"):
        dtype_list_arg(GPU_DTYPES)(" , ")
