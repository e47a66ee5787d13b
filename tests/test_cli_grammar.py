"""One grammar for every ``mscclang`` command (:mod:`mscclang.cli.args`): ``--sizes`` (alias
``--size``) repeatable and never swallowing the plan, dtypes from the one table (with ``fp8``
refused as ambiguous), case-insensitive choices, ``-o``/``--out``/``--output`` wherever an output
is written, usage errors prefixed with the subcommand; bad numbers refused; ``run`` without GPUs
scales sizes the same whatever the number of ``--sizes``; progress lines without a terminal."""

from __future__ import annotations

import io
import json
import time

import pytest

from tests.harness.cli import ROOT, cli_inproc, user_error
from tests.harness.plan_samples import mscclpp_packet_allreduce

from mscclang.cli.args import SIM_DTYPES, parse_dtype
from mscclang.cli.progress import Progress

SMALL = ROOT / "tests" / "golden" / "prog_allreduce_ll_twostep_2.json"
RS2 = ROOT / "plans" / "reducescatter_ll.r2.i1.json"


@pytest.fixture
def no_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _parse(*argv: str):
    from mscclang.cli.main import build_parser

    return build_parser().parse_args(list(argv))


# ------------------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("cmd", [["run", "p.json"], ["verify", "p.json"], ["bench"], ["tune"], ["demo"],
                                 ["build-kernel"]])
def test_sizes_has_one_spelling_with_the_old_alias_and_repeats(cmd):
    a = _parse(*cmd, "--sizes", "4K,1K", "--size", "64K")
    assert a.sizes == [1024, 4096, 65536]


def test_verify_sizes_do_not_swallow_the_plan(capsys):
    res = cli_inproc(capsys, "verify", "--sizes", "1K,4K", "--dtype", "bf16", "--schedules", "2", str(SMALL))
    assert res.returncode == 0, res.stderr
    assert "sizes 1K, 4K;" in res.stdout or "sizes 1024, 4096;" in res.stdout
    a = _parse("verify", "--dtype", "fp16,i32", "--reduce-op", "sum", "--packet-type", "ll8", "plan.json")
    assert a.plan == "plan.json" and a.dtype == ["float16", "int32"] and a.packet_type == ["LL8"]


# ------------------------------------------------------------------------------------ dtypes

def test_fp8_is_refused_as_ambiguous_naming_both():
    with pytest.raises(ValueError, match="ambiguous") as e:
        parse_dtype("fp8", SIM_DTYPES)
    assert "float8_e4m3" in str(e.value) and "float8_e5m2" in str(e.value)
    assert parse_dtype("fp8", ("float16", "float8_e5m2")) == "float8_e5m2"  # unambiguous there


def test_dtype_lists_come_from_the_table(capsys, no_gpus):
    assert _parse("demo", "--dtype", "int32").dtype == "int32"
    res = cli_inproc(capsys, "run", str(SMALL), "--sizes", "1K", "--dtype", "uint8")
    assert res.returncode == 0, res.stderr
    assert "uint8" in res.stdout


# ------------------------------------------------------------------------- choices and outputs

def test_choices_are_case_insensitive():
    assert _parse("compile", "x.py", "--protocol", "ll").protocol == "LL"
    assert _parse("compile", "x.py", "--protocol", "SIMPLE").protocol == "Simple"
    assert _parse("run", "p.json", "--packet-type", "ll16").packet_type == "LL16"
    assert _parse("run", "p.json", "--reduce-op", "MAX").reduce_op == "max"


@pytest.mark.parametrize("cmd,dest", [(["compile", "x.py"], "output"), (["import-mscclpp", "x.json"], "output"),
                                      (["export-mscclpp", "x.json"], "output"), (["schema"], "output"), (["tune"], "out"), (["bench"], "out"),
                                      (["build-kernel"], "out"), (["generate-plans"], "out")])
def test_every_output_takes_o_out_and_output(cmd, dest):
    for flag in ("-o", "--out", "--output"):
        assert str(getattr(_parse(*cmd, flag, "somewhere"), dest)) == "somewhere", flag


@pytest.mark.parametrize("cmd", [["run", str(SMALL)], ["verify", str(SMALL)], ["show", str(SMALL)], ["tune"],
                                 ["export-mscclpp", str(SMALL)]])
def test_unknown_flags_are_reported_by_the_subcommand(capsys, cmd):
    res = cli_inproc(capsys, *cmd, "--bogus")
    user_error(res, f"mscclang {cmd[0]}: error: unrecognized arguments: --bogus")


# ------------------------------------------------------------------------------- bad values

@pytest.mark.parametrize("argv,needle", [
    (["tune", "--dry-run", "--ranks", "0"], "argument --ranks"),
    (["tune", "--dry-run", "--ranks=-5"], "argument --ranks"),
    (["run", str(SMALL), "--iters=-1"], "argument --iters"),
    (["run", str(SMALL), "--timeout=-1"], "argument --timeout"),
    (["run", str(SMALL), "--timeout", "nan"], "argument --timeout"),
    (["show", str(SMALL), "--png", "x.jpg"], "argument --png"),
])
def test_bad_values_are_refused(capsys, tmp_path, argv, needle):
    res = cli_inproc(capsys, *argv)
    user_error(res, needle)
    assert not (tmp_path / "x.jpg").exists()


def test_run_imports_an_mscclpp_plan_as_verify_does(capsys, tmp_path, no_gpus):
    p = tmp_path / "pp.json"
    p.write_text(json.dumps(mscclpp_packet_allreduce()))
    res = cli_inproc(capsys, "run", str(p), "--sizes", "1K")
    assert res.returncode == 0, res.stderr
    assert "MSCCL++ plan" in res.stderr and "OK" in res.stdout


def test_an_unwritable_output_folder_is_one_clear_line(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = cli_inproc(capsys, "bench", "--out", str(blocker / "sub"))
    user_error(res, "mscclang bench: error: --out", str(blocker / "sub"))
    assert "Errno" not in res.stderr


# ---------------------------------------------------------------------- run on the simulator

def _run_sizes(capsys, monkeypatch, *sizes: str):
    monkeypatch.setenv("MSCCLANG_SIM_MAX_MEMORY", "250M")
    argv = ["run", str(RS2)]
    for s in sizes:
        argv += ["--size", s]
    return cli_inproc(capsys, *argv)


def test_run_scales_a_size_the_same_whatever_the_other_sizes(capsys, monkeypatch, no_gpus):
    if not RS2.is_file():
        pytest.skip(f"no {RS2}")
    alone = _run_sizes(capsys, monkeypatch, "1M")
    both = _run_sizes(capsys, monkeypatch, "4K", "1M")
    assert alone.returncode == 0 and both.returncode == 0, (alone.stderr, both.stderr)
    assert "instead of" not in alone.stderr and "instead of" not in both.stderr, both.stderr


def test_run_says_in_full_why_it_scales_a_size(capsys, monkeypatch, no_gpus):
    if not RS2.is_file():
        pytest.skip(f"no {RS2}")
    # 1 MiB is estimated at about 132 MiB (the postcondition checks outputs of that size chunk by
    # chunk, with no index arrays), 4K well under 100 MiB
    monkeypatch.setenv("MSCCLANG_SIM_MAX_MEMORY", "100M")
    res = cli_inproc(capsys, "run", str(RS2), "--size", "4K", "--size", "1M")
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stderr.splitlines() if "instead of 1 MiB" in x)
    assert line.endswith("(set MSCCLANG_SIM_MAX_MEMORY to raise it)"), line


# --------------------------------------------------------------------------------- progress

class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_progress_without_a_terminal_prints_plain_lines():
    buf = _Pipe()
    with Progress(3, "work", unit="run", stream=buf, interval=0.01) as bar:
        bar.update()
        deadline = time.monotonic() + 30
        while "work: 1/3 runs" not in buf.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    text = buf.getvalue()
    assert "work: 1/3 runs" in text, text
    assert "\r" not in text and "\x1b" not in text and text.endswith("\n")
    off = _Pipe()
    with Progress(3, "work", stream=off, enabled=False, interval=0.01) as bar:
        bar.update()
        time.sleep(0.05)
    assert off.getvalue() == ""


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_bar_shows_each_step_done_at_the_next_note():
    """A quick first step then a long one: the bar said 0/2 all along (seen on build-kernel)."""
    pytest.importorskip("tqdm")
    tty = _Tty()
    with Progress(2, "build", unit="module", stream=tty) as bar:
        bar.set_note("layout checks")
        bar.update()
        bar.set_note("bf16")  # the long step starts: the bar must show 1/2 now
        assert "1/2" in tty.getvalue(), tty.getvalue()
        bar.update()


# ------------------------------------------------------------------ help texts and errors

def _subcommands() -> list[str]:
    from mscclang.cli.main import COMMANDS

    return list(COMMANDS)


@pytest.mark.parametrize("cmd", _subcommands())
def test_every_help_is_plain_text_with_a_description(capsys, cmd):
    """Seen: predict, demo, generate-plans and schema showed raw reST (``x``, :mod:`y`); run and
    build-kernel had no description at all."""
    import re

    with pytest.raises(SystemExit) as e:
        _parse(cmd, "--help")
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert not re.search(r"``|:[a-z]+:`|\*\*", text), text
    description = text.split("\n\n", 2)[1]
    assert not description.startswith(("positional arguments:", "options:")) and len(description) > 40, text


def test_a_description_keeps_its_list_items_apart(capsys):
    with pytest.raises(SystemExit):
        _parse("predict", "--help")
    text = capsys.readouterr().out
    items = [ln for ln in text.splitlines() if ln.startswith("* mscclang predict")]
    assert len(items) == 3, text


PLAN2 = ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json"


@pytest.mark.parametrize("argv,needle", [
    (["predict"], "give a plan"),
    (["predict", str(PLAN2), "--topology", "0x2"], "topology '0x2': 0 nodes of 2 GPUs"),
    (["predict", str(PLAN2), "--topology", "2x1"], "the GPU runtime refuses this plan on 2 x 1 GPUs"),
    (["predict", "/nonexistent/plan.json"], "/nonexistent/plan.json"),
    (["schema", "--check", "-o", "/nonexistent/schema.json"], "cannot read the schema"),
    (["compile", "/nonexistent/prog.py"], "does not exist"),
    (["show", "/nonexistent/plan.json"], "/nonexistent/plan.json"),
    (["verify", "/nonexistent/plan.json"], "/nonexistent/plan.json"),
    (["import-mscclpp", "/nonexistent/plan.json"], "/nonexistent/plan.json"),
    (["export-mscclpp", "/nonexistent/plan.json"], "/nonexistent/plan.json"),
    (["export-mscclpp", str(SMALL), "-o", "/proc/mscclang-nope/x.json"], "/proc/mscclang-nope"),
    (["generate-plans", "--only", "no_such_algorithm"], "no_such_algorithm"),
    (["demo", "--sizes", "3"], "--sizes 3"),
    (["bench", "--out", "/proc/mscclang-nope"], "--out /proc/mscclang-nope"),
])
def test_every_error_is_one_prefixed_line_with_status_1(capsys, argv, needle):
    res = cli_inproc(capsys, *argv)
    user_error(res, f"mscclang {argv[0]}: error: ", needle)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_predict_topology_names_are_case_insensitive(capsys):
    res = cli_inproc(capsys, "predict", str(PLAN2), "--topology", "NVLINK")
    assert res.returncode == 0 and "on 1 x 2 GPUs: predicted" in res.stdout, res.stderr


def test_predict_topology_file_without_gpus_per_node(capsys, tmp_path):
    f = tmp_path / "topo.json"
    f.write_text('{"nodes": 1}')
    res = cli_inproc(capsys, "predict", str(PLAN2), "--topology", str(f))
    user_error(res, "mscclang predict: error: ", f"topology {f}: gpus_per_node: Field required")
    assert "KeyError" not in res.stderr


def test_an_output_where_the_file_system_takes_nothing_is_named_as_such(capsys):
    """Seen: `bench --out /proc/nope` said "(/proc: No such file or directory)", as if /proc were
    missing; it exists, and its file system refuses new entries."""
    import os

    if not os.path.isdir("/proc/self"):
        pytest.skip("no procfs here")
    res = cli_inproc(capsys, "bench", "--out", "/proc/nope")
    user_error(res, "mscclang bench: error: --out /proc/nope",
               "/proc exists, but its file system does not take new files or folders")


class _Clock:
    """time.monotonic of the progress module, advanced by the fake compiler."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fake_build(monkeypatch, seconds_per_kernel: float):
    """build-kernel with a compiler that takes ``seconds_per_kernel`` per kernel on a fake clock
    (and no time at all for the layout checks)."""
    from types import SimpleNamespace

    from mscclang.cli import build_kernel_cmd, progress
    from mscclang.runtime import build

    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)   # the text line
    monkeypatch.setattr(build_kernel_cmd, "supported_archs", lambda: [90])
    monkeypatch.setattr(build, "compile_source", lambda *a, **k: b"")
    monkeypatch.setattr(build, "nvrtc_version", lambda: (13, 0))

    def build_module(dtype, arch, use_cache=True, traced=False):
        clock.now += seconds_per_kernel * build.module_kernels(dtype)
        return SimpleNamespace(dtype=dtype, cubin=b"x", cached=False, path="/nowhere", traced=traced)

    monkeypatch.setattr(build, "build_module", build_module)


def _etas(stderr: str) -> list[str]:
    return [ln for ln in stderr.replace("\x1b[K", "").split("\r") if "build kernels" in ln]


def test_build_kernel_eta_is_not_the_elapsed_time(capsys, monkeypatch):
    """Seen: all 93 progress lines of a 472 s one-module build said "ETA = elapsed": the layout
    checks (a fraction of a second) counted as one of two steps. They are no step now: no ETA
    before a module is done, and after one the others' time scaled by their kernels."""
    _fake_build(monkeypatch, 10.0)
    res = cli_inproc(capsys, "build-kernel", "--dtype", "bf16", "--progress")
    assert res.returncode == 0, res.stderr
    lines = _etas(res.stderr)
    assert lines and not any("ETA" in ln for ln in lines), lines
    # bf16 (6 kernels) in 60 s, then fp8_e4m3 (2 modules of 2 kernels: 40 s left)
    res = cli_inproc(capsys, "build-kernel", "--dtype", "bf16", "--dtype", "fp8_e4m3", "--progress")
    assert res.returncode == 0, res.stderr
    lines = _etas(res.stderr)
    at = next(ln for ln in lines if "1/3 modules" in ln)
    assert "1m00s elapsed, ETA 40s" in at, lines
    at = next(ln for ln in lines if "2/3 modules" in ln)
    assert "1m20s elapsed, ETA 20s" in at, lines
    # --traced: each module twice (bf16, then its traced variant: 60 s each)
    res = cli_inproc(capsys, "build-kernel", "--dtype", "bf16", "--traced", "--progress")
    assert res.returncode == 0 and "bf16 traced: 1 bytes" in res.stdout, (res.stdout, res.stderr)
    at = next(ln for ln in _etas(res.stderr) if "1/2 modules" in ln)
    assert "1m00s elapsed, ETA 1m00s" in at, at
