"""Running the ``mscclang`` command from tests: as a subprocess (:func:`cli`, the real entry
point) or in this process (:func:`cli_inproc`, faster), and the check of a user mistake."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "allreduce_8rank.py"


def cli(*args: str, cwd: Path = ROOT, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "mscclang", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, input=stdin, timeout=120)


class Result:
    """What an in-process ``main()`` call gave: ``returncode``, ``stdout``, ``stderr``."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli_inproc(capsys, *args: str) -> Result:
    """The same command through ``mscclang.cli.main.main`` in this process (faster; used for the
    many error cases, the subprocess runs above cover the real entry point)."""
    from mscclang.cli.main import main

    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return Result(rc, out, err)


def user_error(res, *needles: str) -> None:
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


def script(tmp_path: Path, body: str, name: str = "prog.py") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p
