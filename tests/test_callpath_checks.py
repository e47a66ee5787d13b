"""tools/callpath_checks.py on the CPU: ``stream`` and ``memory`` spawn two gloo ranks and run
every call through the public Communicator (its torch.distributed fallback here: no GPU runtime on
the CPU), each result checked exactly; ``abort`` refuses to run without CUDA; bad arguments are
usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "callpath_checks.py"


def _run(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")   # this checkout's mscclang
    return subprocess.run([sys.executable, str(TOOL), *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _result(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1, p.stdout
    return json.loads(lines[0])


def test_stream(tmp_path):
    out = tmp_path / "stream.json"
    res = _result(_run("--ranks", "2", "--out", str(out), "stream", "--calls", "50", "--seed", "5",
                       "--specialize", "never"))
    assert res["subcommand"] == "stream" and res["calls"] == 50 and res["mismatches"] == 0
    assert sum(res["calls_by_collective"].values()) == 50 and all(res["calls_by_collective"].values())
    assert res["world_size"] == 2 and "fallback" in res["engine"] and res["specialize"] == "never"
    assert res["total_s"] > 0 and res["fallback_calls"] == 50
    assert json.loads(out.read_text()) == res


def test_memory():
    res = _result(_run("memory", "--sizes", "50"))
    assert res["subcommand"] == "memory" and res["sizes"] == 50 and res["mismatches"] == 0
    assert res["total_bytes"] == res["memory"]["total_bytes"] == 0   # nothing on a GPU here


def test_abort_needs_cuda():
    p = _run("abort", "--mode", "hung", "--runs", "1", timeout=120)
    assert p.returncode == 2 and "abort needs 2 CUDA GPUs" in p.stderr


@pytest.mark.parametrize("argv", [["stream", "--calls", "0"], ["--ranks", "1", "stream"],
                                  ["memory", "--sizes", "0"], ["abort", "--mode", "kill"], []])
def test_bad_arguments(argv):
    p = _run(*argv, timeout=60)
    assert p.returncode == 2 and "error:" in p.stderr


def test_first_sizes_are_the_bench_sizes():
    import importlib.util

    from mscclang.bench.sizes import FIRST_CALL_SIZES

    spec = importlib.util.spec_from_file_location("callpath_checks", ROOT / "tools" / "callpath_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert tuple(mod.FIRST_SIZES) == tuple(FIRST_CALL_SIZES)


def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("callpath_checks", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv", [["--ranks", "3", "--out", "f.json", "--timeout", "9", "memory"],
                                  ["memory", "--ranks", "3", "--out", "f.json", "--timeout", "9"],
                                  ["--ranks", "3", "memory", "--out", "f.json", "--timeout", "9"]])
def test_common_options_go_before_or_after_the_subcommand(argv):
    args = _tool().parse_args(argv)
    assert (args.cmd, args.ranks, args.out, args.timeout) == ("memory", 3, "f.json", 9.0)
    args = _tool().parse_args(["stream", "--calls", "3"])
    assert (args.ranks, args.out, args.timeout) == (2, None, 1800.0)


def test_memory_on_the_cpu_is_bounded_and_shows_progress(monkeypatch):
    """Without CUDA the default is CPU_MEMORY_SIZES sizes (10,000 gloo calls ran for many minutes
    with no output); rank 0 prints progress lines on stderr."""
    tool = _tool()
    assert tool.CPU_MEMORY_SIZES <= 200 and tool.parse_args(["memory"]).sizes is None
    p = _run("memory", "--ranks", "2", "--sizes", "20", timeout=200)
    assert _result(p)["sizes"] == 20
    monkeypatch.setattr(tool, "PROGRESS_S", 0.0)
    lines: list[str] = []

    class FakeRank:
        rank, cuda = 0, False

        def checked_call(self, *a):
            return 0.0, True, "nccl"

        def memory(self):
            return {"total_bytes": 0}

        def base(self, what):
            return {"subcommand": what}

    r = FakeRank()
    r.comm = r
    monkeypatch.setattr(tool.sys, "stderr", type("E", (), {"write": lambda s, t: lines.append(t), "flush": lambda s: None})())
    res = tool.memory(r, None, 1)
    assert res["sizes"] == tool.CPU_MEMORY_SIZES
    assert sum("sizes" in x and "s left" in x for x in lines) == tool.CPU_MEMORY_SIZES - 1, lines[:3]
