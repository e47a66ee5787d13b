"""GPU tests of the fused epilogue (``pytest -m gpu``, e.g. two ranks on one GPU with
``MSCCLANG_RANKS_PER_GPU=2``): fused ``allreduce_add_rms_norm`` plans (a hand-written 2-rank
one-shot, and the shipped fused plans of the run's world size) through
``Executor.execute(residual=, weight=, epilogue=)`` on the interpreter's epilogue kernels, the
residual and the output equal to the simulator's definition bit for bit: bf16 and fp16
activations, fp32 and activation-dtype weights, H in {8, 4096, 8192, 16384}, tokens
{1, 2, 7, 64, 512} (those each plan takes), with and without FP8 output, eagerly and in CUDA
graphs; on the interpreter's epilogue kernels (the whole matrix) and on the plan-specialised
kernels (a smaller one: each size builds its own kernel)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mscclang.plan.io import plan_to_json

pytestmark = pytest.mark.gpu

C = "tests.harness.epilogue_checks"
R = "tests.harness.runtime_checks"
TOKENS = [1, 2, 7, 64, 512]
HIDDEN = [8, 4096, 8192, 16384]
ROOT = Path(__file__).resolve().parents[2] / "plans"


def _plans(world: int) -> list[tuple[str, str]]:
    from tests.harness.fused_plans import fused_oneshot_plan

    out = []
    if world == 2:
        for q in (False, True):
            out.append((f"hand-written{' quant' if q else ''}", plan_to_json(fused_oneshot_plan(q))))
    for f in sorted(ROOT.glob(f"allreduce_add_rms_norm*.r{world}.*json")):
        out.append((f.name, f.read_text()))
    return out


def _quant(plan_json: str) -> bool:
    return '"quant": true' in plan_json or '"quant":true' in plan_json


@pytest.fixture(params=["interpreter", "spec"])
def kernel(pool, request):
    """The kernel policy of the test: every worker's executor switched before, 'auto' after."""
    pool.run(f"{R}:set_specialize", "never" if request.param == "interpreter" else "always")
    yield request.param
    pool.run(f"{R}:set_specialize", "auto")


def _ok(results: list, name: str, kernel: str) -> None:
    for r in results:
        if r.get("refused"):
            pytest.fail(f"{name}: the runtime refuses it: {r['refused']}")
        assert not r["bad"], f"{name} rank {r['rank']}: {r['bad'][:4]}"
        assert r["ran"], f"{name}: no shape of the test fits the plan"
        assert r["kernel"] == kernel, f"{name} rank {r['rank']} ran the {r['kernel']} kernel, not {kernel}"


def _run(pool, kernel: str, act: str, wdt: str, graph: bool, tokens: list, hidden: list) -> None:
    plans = _plans(pool.world_size)
    if not plans:
        pytest.skip(f"no fused plan for {pool.world_size} ranks")
    for name, j in plans:
        for fp8 in (["float8_e4m3fn", "float8_e5m2"] if _quant(j) else [None]):
            _ok(pool.run(f"{C}:fused_check", j, tokens, hidden, act, act if wdt == "act" else wdt, fp8, graph),
                f"{name} {fp8 or ''}", kernel)


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
@pytest.mark.parametrize("wdt", ["float32", "act"])
def test_fused_plans_equal_the_simulator(pool, act, wdt):
    pool.run(f"{R}:set_specialize", "never")
    try:
        _run(pool, "interpreter", act, wdt, False, TOKENS, HIDDEN)
    finally:
        pool.run(f"{R}:set_specialize", "auto")


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_specialised_fused_kernels_equal_the_simulator(pool, act):
    pool.run(f"{R}:set_specialize", "always")
    try:
        _run(pool, "spec", act, "act" if act == "float16" else "float32", False, [2, 64], [8, 8192])
    finally:
        pool.run(f"{R}:set_specialize", "auto")


def test_fused_plans_in_cuda_graphs_equal_the_simulator(pool, kernel):
    _run(pool, kernel, "bfloat16", "float32", True, [2, 7, 64], [8, 8192])
