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
                                      (["schema"], "output"), (["tune"], "out"), (["bench"], "out"),
                                      (["build-kernel"], "out"), (["generate-plans"], "out")])
def test_every_output_takes_o_out_and_output(cmd, dest):
    for flag in ("-o", "--out", "--output"):
        assert str(getattr(_parse(*cmd, flag, "somewhere"), dest)) == "somewhere", flag


@pytest.mark.parametrize("cmd", [["run", str(SMALL)], ["verify", str(SMALL)], ["show", str(SMALL)], ["tune"]])
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
    monkeypatch.setenv("MSCCLANG_SIM_MAX_MEMORY", "150M")
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
    """build-kernel: a quick first step (layout checks) then a long one; the bar said 0/2 all along."""
    pytest.importorskip("tqdm")
    tty = _Tty()
    with Progress(2, "build", unit="module", stream=tty) as bar:
        bar.set_note("layout checks")
        bar.update()
        bar.set_note("bf16")  # the long step starts: the bar must show 1/2 now
        assert "1/2" in tty.getvalue(), tty.getvalue()
        bar.update()
