"""GPU tests of the fused epilogue (``pytest -m gpu``, e.g. two ranks on one GPU with
``MSCCLANG_RANKS_PER_GPU=2``): fused ``allreduce_add_rms_norm`` plans (a hand-written 2-rank
one-shot, and the shipped fused plans of the run's world size) through
``Executor.execute(residual=, weight=, epilogue=)`` on the interpreter's epilogue kernels, the
residual and the output equal to the simulator's definition bit for bit: bf16 and fp16
activations, fp32 and activation-dtype weights, H in {8, 4096, 8192, 16384}, tokens
{1, 7, 64, 512}, with and without FP8 output, eagerly and in CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from mscclang.plan.io import plan_to_json

pytestmark = pytest.mark.gpu

C = "tests.harness.epilogue_checks"
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


def _ok(results: list, name: str) -> None:
    for r in results:
        if r.get("refused"):
            pytest.fail(f"{name}: the runtime refuses it: {r['refused']}")
        assert not r["bad"], f"{name} rank {r['rank']}: {r['bad'][:4]}"
        assert r["ran"], f"{name}: no shape of the test fits the plan"
        assert r["kernel"] == "interpreter"


def _run(pool, act: str, wdt: str, graph: bool, tokens: list, hidden: list) -> None:
    plans = _plans(pool.world_size)
    if not plans:
        pytest.skip(f"no fused plan for {pool.world_size} ranks")
    for name, j in plans:
        if pool.world_size > 4 and "twoshot" in name:
            continue   # its ppkt ops name more operands than the kernel's 16 (a load-time refusal)
        for fp8 in (["float8_e4m3fn", "float8_e5m2"] if _quant(j) else [None]):
            _ok(pool.run(f"{C}:fused_check", j, tokens, hidden, act, act if wdt == "act" else wdt, fp8, graph),
                f"{name} {fp8 or ''}")


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
@pytest.mark.parametrize("wdt", ["float32", "act"])
def test_fused_plans_equal_the_simulator(pool, act, wdt):
    _run(pool, act, wdt, False, TOKENS, HIDDEN)


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_fused_plans_in_cuda_graphs_equal_the_simulator(pool, act):
    _run(pool, act, "float32", True, [2, 7, 64], [8, 8192])
