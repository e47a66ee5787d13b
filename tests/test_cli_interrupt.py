"""Ctrl-C: a real SIGINT sent to ``python3 -m mscclang COMMAND`` in the middle of its work ends
every command with the one line ``mscclang COMMAND: interrupted`` and exit status 130: no
traceback, no ``terminate called ...`` abort from a thread still running at interpreter exit, no
child process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.harness.cli import EXAMPLE, ROOT

GOLDEN = ROOT / "tests" / "golden"
BIG = GOLDEN / "prog_allreduce_ll_oneshot_8.json"


def interrupt(argv: list[str], marker: bytes, *, after: float = 0.0, env: dict | None = None,
              cwd: Path = ROOT) -> tuple[int, str]:
    """Start ``argv``, wait (at most 90 s) until ``marker`` shows on its stdout or stderr, then
    ``after`` seconds more, send SIGINT; its exit status and stderr (within 60 s more)."""
    full = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + full.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[bytes] = []
    err: list[bytes] = []

    def read(stream, into: list[bytes]) -> None:
        for chunk in iter(lambda: os.read(stream.fileno(), 4096), b""):
            into.append(chunk)
            seen.append(chunk)

    readers = [threading.Thread(target=read, args=(proc.stdout, []), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, err), daemon=True)]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 90
        while marker not in b"".join(seen) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker in b"".join(seen), (marker, b"".join(seen)[-2000:])
        time.sleep(after)
        assert proc.poll() is None, "the command ended before the interrupt"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        for t in readers:
            t.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # nothing it started outlives it (its session holds its children; zombies, ended, do not count)
    time.sleep(0.5)
    pids = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    leftover = [p for p in pids if _running(p)]
    if leftover:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not leftover, f"processes left behind: {leftover}"
    return proc.returncode, b"".join(err).decode(errors="replace")


def _running(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def one_line(rc: int, err: str, command: str) -> None:
    assert rc == 130, (rc, err[-3000:])
    assert "Traceback" not in err and "terminate called" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip().endswith(f"mscclang {command}: interrupted"), err


def test_threads_running_torch_at_exit_do_not_abort(tmp_path):
    """What the demo does at 512M: rank threads in torch ops when Ctrl-C comes. Left running at
    interpreter exit, they abort the process (SIGABRT, ``terminate called without an active
    exception``)."""
    script = tmp_path / "busy.py"
    script.write_text(
        "import sys, threading, time\n"
        "import mscclang.cli.verify_cmd as verify_cmd\n"
        "from mscclang.cli.main import main\n"
        "def busy():\n"
        "    import torch\n"
        "    while True:\n"
        "        x = torch.randn(1 << 25)\n"
        "        (x.to(torch.bfloat16).float() + x).sum()\n"
        "def run(args):\n"
        "    ts = [threading.Thread(target=busy, daemon=True) for _ in range(2)]\n"
        "    for t in ts:\n"
        "        t.start()\n"
        "    print('busy', flush=True)\n"
        "    for t in ts:\n"
        "        t.join()\n"
        "verify_cmd.run = run\n"
        "sys.exit(main())\n")
    for _ in range(2):
        one_line(*interrupt([str(script), "verify", "x.json"], b"busy", after=1.0), "verify")


def test_ctrl_c_in_the_demo():
    one_line(*interrupt(["-m", "mscclang", "demo", "--sizes", "64M"], b"no 2 GPUs here", after=0.5), "demo")


def test_ctrl_c_in_run():
    one_line(*interrupt(["-m", "mscclang", "run", str(BIG), "--sizes", "1M", "--progress"], b"run"), "run")


def test_ctrl_c_in_verify():
    one_line(*interrupt(["-m", "mscclang", "verify", str(BIG), "--schedules", "1000", "--progress"], b"run"), "verify")


def test_ctrl_c_in_tune():
    one_line(*interrupt(["-m", "mscclang", "tune", "--dry-run", "--progress"], b"variant"), "tune")


def test_ctrl_c_in_compile(tmp_path):
    prog = tmp_path / "slow.py"
    prog.write_text("import sys, time\nprint('compiling', file=sys.stderr, flush=True)\n"
                    "while True:\n    time.sleep(0.01)\n")
    one_line(*interrupt(["-m", "mscclang", "compile", str(prog)], b"compiling"), "compile")


def test_ctrl_c_in_bench(tmp_path):
    """Without GPUs, bench renders an earlier run (imports torch and matplotlib, draws a plot)."""
    src = ROOT / "notes" / "bench_2xh200" / "bench.json"
    one_line(*interrupt(["-X", "importtime", "-m", "mscclang", "bench", "--from-json", str(src),
                         "-o", str(tmp_path / "out")], b"mscclang.bench.host", after=0.2), "bench")


def test_ctrl_c_in_predict_calibrate(tmp_path):
    src = ROOT / "notes" / "bench_2xh200" / "bench.json"
    one_line(*interrupt(["-m", "mscclang", "predict", "--calibrate", str(src)], b"",
                        after=4.0), "predict")


def test_ctrl_c_in_generate_plans(tmp_path):
    one_line(*interrupt(["-m", "mscclang", "generate-plans", "-o", str(tmp_path)], b"", after=3.0), "generate-plans")


def test_ctrl_c_in_show(tmp_path):
    """Interrupted in matplotlib's import (a C extension's import fails with ImportError then)."""
    one_line(*interrupt(["-X", "importtime", "-m", "mscclang", "show", str(BIG), "--png", str(tmp_path / "p.png")],
                        b"matplotlib"), "show")


def test_ctrl_c_in_build_kernel():
    """Its worker processes (a pool, two jobs) end with it."""
    one_line(*interrupt(["-m", "mscclang", "build-kernel", "--arch", "sm_90", "--no-cache", "--jobs", "2",
                         "--progress"], b"build kernels", after=0.5), "build-kernel")
