"""Every plan the compiler produces from the example programs, and every stored plan
(tests/golden, plans/), verifies in the simulator; run() agrees with a direct computation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mscclang.plan import load_plan
from mscclang.sim import default_sizes, run, verify
from tests.harness.shipped import shipped_plan_files

ROOT = Path(__file__).resolve().parent.parent
# examples/ also holds scripts that are not DSL programs (graph_allreduce.py: a torchrun script)
PROGRAMS = sorted((ROOT / "tests" / "programs").glob("*.py")) + sorted(
    p for p in (ROOT / "examples").glob("*.py") if "CollectiveProgram(" in p.read_text())
GOLDEN = sorted((ROOT / "tests" / "golden").glob("**/*.json"))
SHIPPED = shipped_plan_files()


def _compile(path: Path, ranks: int, instances: int):
    from mscclang.cli.compile_cmd import compile_file
    return compile_file(path, ["--num_gpus", str(ranks), "--instances", str(instances)])


@pytest.mark.parametrize("ranks,instances", [(2, 1), (4, 2)])
@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.stem)
def test_compiled_program_verifies(program: Path, ranks: int, instances: int) -> None:
    plan = _compile(program, ranks, instances)
    rep = verify(plan, schedules=3)
    assert rep.ok, str(rep)


@pytest.mark.skipif(not GOLDEN, reason="no goldens yet")
@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name)
def test_golden_plan_verifies(path: Path) -> None:
    """Every golden verifies, the compiler's one-op goldens (``op_*.json``) included: each is a
    correct program of its collective (ready handshakes before touching peers, writes published,
    port sources flushed), with no excuse for races."""
    plan = load_plan(path)
    rep = verify(plan, schedules=3)
    assert rep.passed(), str(rep)
    if plan.collective in ("test", "custom"):
        assert rep.status == "NO POSTCONDITION" and not rep.ok, str(rep)
    else:
        assert rep.ok, str(rep)


def _small(p: Path) -> bool:
    return ".r8." not in p.name


@pytest.mark.parametrize("path", [p for p in SHIPPED if _small(p)], ids=lambda p: p.name)
def test_shipped_plan_verifies_small(path: Path) -> None:
    plan = load_plan(path)
    # a plan with segments runs over its count matrices (mscclang.plan.segments.count_cases)
    rep = verify(plan, sizes=None if plan.has_segments() else default_sizes(plan)[:1], schedules=2)
    assert rep.ok, str(rep)


@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_plan_verifies_full(path: Path) -> None:
    rep = verify(load_plan(path), schedules=10)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("program", [p for p in PROGRAMS if "allreduce" in p.stem], ids=lambda p: p.stem)
def test_run_matches_reference_bit_for_bit(program: Path) -> None:
    """fp16 sums in the plan's reduction order, each step rounded through fp32, equal a direct
    computation when the order is the same for every element (2 ranks: a + b)."""
    plan = _compile(program, 2, 1)
    if len(plan.gpus) != 2:
        pytest.skip(f"{program.name} builds a fixed {len(plan.gpus)}-rank plan (it takes no --num_gpus)")
    rng = np.random.default_rng(1)
    n = 8 * plan.gpus[0].input_chunks * 4 + 6   # odd size: short last chunk
    xs = [rng.standard_normal(n).astype(np.float16) for _ in range(2)]
    outs = run(plan, xs, launches=2, schedule="random", seed=5)
    ref = (xs[0].astype(np.float32) + xs[1].astype(np.float32)).astype(np.float16)
    for o in outs:
        assert o.dtype == np.float16
        assert np.array_equal(o.view(np.uint16), ref.view(np.uint16))
