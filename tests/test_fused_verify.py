"""Fused plans are verified as thoroughly as plain ones (issue: "The verifier proves what
docs/semantics.md says"): verify's options reach them, the cases are crossed and varied, the
residual contract is the plan's, every verify is bounded, and every bad parameter is refused up
front, naming it."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from mscclang.algorithms.fused import build_fused_oneshot_ll, build_fused_twoshot_ll
from mscclang.errors import LimitError, PlanError, VerificationError
from mscclang.plan.check import validate_plan
from mscclang.plan.io import plan_from_dict, plan_to_dict
from mscclang.sim import fused as fused_mod
from mscclang.sim import verify
from mscclang.sim.budget import Limits
from mscclang.sim.epilogue import EpilogueParams
from mscclang.sim.fused import run_fused, verify_fused

BF16 = np.dtype(ml_dtypes.bfloat16)


def _byte_chunked_two_shot(alignment: int = 16) -> "object":
    """The two-shot as it was: chunks of alignment units (not rows), no residual contract."""
    d = plan_to_dict(build_fused_twoshot_ll(2, inplace=True))
    d.pop("chunk_unit")
    d.pop("replicated_residual")
    d["buffer_alignment"] = alignment
    return plan_from_dict(d)


@pytest.fixture
def runs(monkeypatch) -> list:
    """Every run_fused call a verify makes: (dtype, packet type, params, residuals all alike)."""
    seen: list = []
    real = fused_mod.run_fused

    def spy(plan, inputs, residuals, params, **kw):
        same = all(np.array_equal(r, residuals[0]) for r in residuals)
        seen.append((np.dtype(inputs[0].dtype), kw.get("packet_type"), params, same, kw.get("symbolic"),
                     len(inputs[0]) // params.hidden, kw.get("launches")))
        return real(plan, inputs, residuals, params, **kw)

    monkeypatch.setattr(fused_mod, "run_fused", spy)
    return seen


def test_verify_options_reach_fused_plans(runs) -> None:
    """The issue's command: --sizes 4K,64K --schedules 20 --dtype float32 --no-symbolic ran sizes
    64, 384, 512 in bf16 and fp16 at 4 schedules."""
    plan = build_fused_oneshot_ll(2)
    rep = verify(plan, sizes=[4096, 65536], schedules=20, dtypes=["float32"], symbolic=False)
    assert rep.ok and rep.dtypes == ["float32"] and len(rep.schedules) == 20
    assert {np.dtype(d) for d, *_ in runs} == {np.dtype(np.float32)}
    assert {rows * p.hidden * 4 for _, _, p, _, _, rows, _ in runs} == {4096, 65536}
    assert not any(sym for *_, sym, _, _ in runs)
    assert len(runs) == 4 * 20   # two cases per size (the largest and the smallest hidden), 20 runs each
    with pytest.raises(VerificationError, match="int32: the fused collective's activations"):
        verify(plan, dtypes=["int32"])
    with pytest.raises(VerificationError, match="reduce ops .* do not apply"):
        verify(plan, reduce_ops=["max"])
    with pytest.raises(VerificationError, match="not whole rows of bfloat16"):
        verify(plan, sizes=[6], dtypes=["bfloat16"])


def test_defaults_cross_dtypes_and_packets_and_vary_the_parameters(runs) -> None:
    rep = verify_fused(build_fused_oneshot_ll(2, quant=True), schedules=4)
    assert rep.ok and rep.launches == 3   # double scratch: its halves are reused from launch 3
    plain = [r for r in runs if not r[4]]
    for rows in {r[5] for r in plain}:
        pairs = {(d, p) for d, p, _, _, _, rr, _ in plain if rr == rows}
        assert pairs == {(np.dtype(d), p) for d in (BF16, np.float16, np.float32) for p in ("LL16", "LL8")}
    params = [p for _, _, p, *_ in plain]
    assert {p.eps for p in params} >= {1e-6, 1e-5, 0.25}
    assert len({p.scale for p in params}) >= 3
    assert {np.dtype(p.fp8).name for p in params} == {"float8_e4m3fn", "float8_e5m2"}
    assert {np.asarray(p.weight).dtype.name for p in params} >= {"float32", "bfloat16"}
    assert {same for _, _, _, same, *_ in plain} == {True, False}   # per-rank residuals too (own contract)
    assert all(launches == 3 for *_, sym, _, launches in plain)


def test_a_plan_taking_its_peers_residual_rows_gives_every_rank_one_residual(runs) -> None:
    assert verify_fused(build_fused_twoshot_ll(2), schedules=4).ok
    assert all(same for _, _, _, same, *_ in runs)


def test_a_plan_that_takes_a_peers_residual_rows_without_saying_so_fails() -> None:
    """With one residual for all ranks, adding a peer's residual row looks like adding one's own;
    per-rank residuals tell them apart."""
    d = plan_to_dict(build_fused_twoshot_ll(2))
    d.pop("replicated_residual")
    rep = verify_fused(plan_from_dict(d), schedules=4)
    assert rep.failed and "postcondition" in rep.kinds()
    assert "residual" in rep.first("postcondition").message


def test_a_byte_chunked_two_shot_whose_chunks_cut_rows_fails_at_default_settings() -> None:
    for align in (16, 32, 64, 256):
        rep = verify(_byte_chunked_two_shot(align))
        assert rep.failed and "plan" in rep.kinds(), align
        cut = [p for p in rep.problems if p.kind == "plan"]
        assert all("not whole rows" in p.message and 'chunk_unit "row"' in p.message for p in cut)
        assert len(cut) <= 2   # one per rmsnorm op (one per rank), however many cases cut rows


def test_the_row_chunked_shipped_two_shot_verifies_at_any_alignment() -> None:
    d = plan_to_dict(build_fused_twoshot_ll(2))
    for align in (32, 256):
        d["buffer_alignment"] = align
        assert verify_fused(plan_from_dict(d), schedules=4).ok


def test_fused_verify_is_budgeted() -> None:
    d = plan_to_dict(build_fused_oneshot_ll(2))
    for g in d["gpus"]:
        g["scratch_chunks"] = 10 ** 9
    with pytest.raises(LimitError, match="would take about .* of memory"):
        verify(plan_from_dict(d))
    with pytest.raises(LimitError):
        verify_fused(build_fused_oneshot_ll(2), cases=[(10 ** 6, 8192)])
    tight = Limits(memory_bytes=1 << 40, seconds=1e-4)
    with pytest.raises(LimitError):
        verify_fused(build_fused_oneshot_ll(8), limits=tight)


def test_a_fused_plan_without_its_epilogue_is_refused_at_load() -> None:
    d = plan_to_dict(build_fused_oneshot_ll(2))
    for g in d["gpus"]:
        for tb in g["threadblocks"]:
            tb["ops"] = [op for op in tb["ops"] if op["name"] not in ("radd", "rmsnorm")]
    with pytest.raises(PlanError) as e:
        validate_plan(plan_from_dict(d))
    assert "radd" in str(e.value) or "epilogue" in str(e.value)


def _run_args(n: int = 2, rows: int = 3, h: int = 16, dt=BF16):
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-1, 1, rows * h).astype(np.float32).astype(dt) for _ in range(n)]
    return xs, [xs[0].copy() for _ in range(n)], EpilogueParams(h, np.ones(h, np.float32))


@pytest.mark.parametrize("mutate, what", [
    (lambda a: (a[0], a[1], EpilogueParams(2 ** 31, np.ones(8, np.float32))), "hidden size"),
    (lambda a: (a[0], a[1], "params"), "EpilogueParams"),
    (lambda a: ([x[:0] for x in a[0]], [x[:0] for x in a[1]], a[2]), "not whole rows"),
    (lambda a: ([a[0][0], a[0][1][:-16]], a[1], a[2]), "rank 1's input"),
    (lambda a: ([x.astype(np.int32) for x in a[0]], [x.astype(np.int32) for x in a[1]], a[2]), "activation dtype"),
    (lambda a: ([x.view(np.uint16).astype(np.uint8).view(ml_dtypes.float8_e4m3fn) for x in a[0]], a[1], a[2]),
     "activation dtype"),
    (lambda a: (a[0], a[1], EpilogueParams(16, np.ones(16, np.float32), -1.0)), "eps"),
    (lambda a: (a[0], a[1], EpilogueParams(16, np.ones(16, np.float32), math.nan)), "eps"),
    (lambda a: (a[0], a[1], EpilogueParams(16, np.ones(16, np.int32))), "weight"),
    (lambda a: (a[0], a[1], EpilogueParams(16, np.ones(16, np.float32), scale=1.0, fp8="bogus")), "fp8 output type"),
    (lambda a: (a[0], a[1], EpilogueParams(16, np.ones(16, np.float32), scale=1.0)), "does not quantise"),
    (lambda a: (a[0][:1], a[1], a[2]), "give 2 inputs"),
])
def test_every_bad_execution_parameter_is_refused_up_front(mutate, what) -> None:
    plan = build_fused_oneshot_ll(2)
    with pytest.raises(PlanError, match=what):
        run_fused(plan, *mutate(_run_args()))


@pytest.mark.parametrize("case", [(0, 16), (-2, 16), (3, 12), (3, 2 ** 31)])
def test_bad_cases_are_refused(case) -> None:
    with pytest.raises((PlanError, VerificationError)):
        verify_fused(build_fused_oneshot_ll(2), cases=[case])


def test_a_case_outside_the_plans_size_range_is_refused() -> None:
    with pytest.raises(VerificationError, match="outside the plan's message sizes"):
        verify_fused(build_fused_oneshot_ll(2, max_message_size=1 << 20), cases=[(1024, 8192)])   # 16 MiB
