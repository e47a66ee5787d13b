"""The README: its DSL example is examples/oneshot_allreduce.py and compiles and verifies; its
commands run as written and write only into ignored folders; its `show` and `demo` samples are
what those commands print; its notebook command is installed by the `test` extra."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from mscclang.cli.compile_cmd import compile_file
from mscclang.sim import verify

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "README.md").read_text()


def _readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)


def test_readme_dsl_example_is_the_example_file():
    example = (ROOT / "examples" / "oneshot_allreduce.py").read_text()
    assert example in _readme_python_blocks()


def test_readme_dsl_example_compiles_and_verifies():
    plan = compile_file(str(ROOT / "examples" / "oneshot_allreduce.py"))
    assert plan.collective == "allreduce" and len(plan.gpus) == 4
    report = verify(plan, schedules=3)
    assert report.ok and not report.warnings, str(report)   # every rank holds the same bits


# ------------------------------------------------------------------ the README's commands, run



def _fenced_after(marker: str) -> str:
    """The first fenced block of the README after ``marker`` (its text, without the fences)."""
    return TEXT[TEXT.index(marker):].split("```", 2)[1].split("\n", 1)[1]


def _run_steps(line: str, cwd: Path) -> list[subprocess.CompletedProcess]:
    """Run the ``mkdir`` and ``mscclang`` steps of a README command line (``&&``-joined; the pip
    installs and ``mscclang demo`` left out) in ``cwd`` holding a copy of ``examples/``, with
    ``mscclang`` as ``python -m mscclang`` of this checkout; every step must succeed."""
    shutil.copytree(ROOT / "examples", cwd / "examples")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = []
    for step in (s.strip() for s in line.split("&&")):
        if step.startswith("mscclang ") and step != "mscclang demo":
            step = f"{sys.executable} -m {step}"
        elif not step.startswith("mkdir "):
            continue
        res = subprocess.run(["bash", "-c", step], cwd=cwd, env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, (step, res.stderr)
        results.append(res)
    return results


def _assert_writes_only_ignored_paths(cwd: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: .gitignore cannot be asked")
    for entry in cwd.iterdir():
        if entry.name == "examples":
            continue
        name = entry.name + ("/" if entry.is_dir() else "")
        ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", name],
                                 timeout=60).returncode == 0
        assert entry.is_dir() and ignored, f"a README command writes {name} into the repository root"


def _main_job() -> str:
    return _fenced_after("**Main job**").strip()


def _show_command() -> str:
    m = re.search(r"`((?:mkdir -p \S+ && )?mscclang compile examples/oneshot_allreduce\.py[^`]*)`\nprints", TEXT)
    assert m, "the README names the command its `show` sample is the output of"
    return m.group(1)


def test_readme_main_job_writes_into_an_ignored_folder(tmp_path):
    _run_steps(_main_job(), tmp_path)
    _assert_writes_only_ignored_paths(tmp_path)


def test_readme_show_sample_is_what_show_prints(tmp_path):
    results = _run_steps(_show_command(), tmp_path)
    assert results[-1].stdout == _fenced_after(_show_command())
    assert "  # oneshot_allreduce.py:" in results[-1].stdout   # the source-line suffixes
    _assert_writes_only_ignored_paths(tmp_path)


def _masked(text: str) -> list[str]:
    return [re.sub(r"\d+(\.\d+)?", "N", re.sub(r" +", " ", x.strip())) for x in text.strip().splitlines()]


def test_readme_demo_sample_matches_the_cpu_demo_and_explains_its_times():
    sample = _fenced_after("without two GPUs, `mscclang demo` prints")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "mscclang", "demo", "--cpu"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert _masked(sample) == _masked(res.stdout)
    after = TEXT[TEXT.index(sample) + len(sample):].split("\n\n", 2)[1]
    assert "ms simulated" in after and "wall" in after and "not" in after


def test_readme_notebook_commands_are_installed_by_the_test_extra():
    extra = re.search(r"^test = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), flags=re.M)
    test_dists = {re.split(r"[<>=!; \[]", d.strip().strip('"'))[0].lower()
                  for d in extra.group(1).split(",")}
    commands = re.findall(r"`(jupyter [a-z]+)[^`]*notebooks/[^`]*`", TEXT)
    assert commands, "the README says how to run the notebooks"
    for cmd in commands:
        script_name = cmd.replace(" ", "-")
        found = list(entry_points(group="console_scripts", name=script_name))
        assert found, f"`{cmd}` is not installed here"
        dist = found[0].dist.name.lower() if found[0].dist else ""
        assert dist in test_dists, f"`{cmd}` comes from {dist!r}, which '.[test]' does not install"
