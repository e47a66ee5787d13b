"""The fused allreduce + residual + RMSNorm: the epilogue's numerics against float64, the
simulator against the exact-order numerics bit for bit, the verifier on the library plans and on
planted early-read bugs, and Communicator.all_reduce_add_rms_norm on the simulator back end."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch

from mscclang.algorithms.fused import build_fused_oneshot_ll, build_fused_twoshot_ll
from mscclang.comm.catalog import Catalog
from mscclang.comm.fused_norm import check_call, reference_epilogue
from mscclang.comm.sim_ranks import run_ranks
from mscclang.errors import InvalidCall, PlanError
from mscclang.plan import load_plan, plan_to_dict, to_mscclpp
from mscclang.plan.models import OpName
from mscclang.sim.epilogue import EpilogueParams, fused_reference, norm
from mscclang.sim.fused import run_fused, verify_fused

BF16 = np.dtype(ml_dtypes.bfloat16)


def _case(n: int, rows: int, h: int, dt: np.dtype, seed: int):
    rng = np.random.default_rng(seed)
    xs = [rng.uniform(-1, 1, rows * h).astype(np.float32).astype(dt) for _ in range(n)]
    res = rng.uniform(-1, 1, rows * h).astype(np.float32).astype(dt)
    w = rng.uniform(0.5, 1.5, h).astype(np.float32)
    return xs, res, w


@pytest.mark.parametrize("h,rows", [(8, 1), (24, 7), (128, 33), (1000, 2), (4096, 3), (16384, 1), (64, 512)])
def test_norm_within_bound_of_float64(h: int, rows: int) -> None:
    """|y - y64| <= |y64| * (2^-8 + (H/8 + log2 H + 8) * 2^-24) + tiny for bf16 (the output's
    rounding plus the fp32 sum's error); the documented bound (docs/semantics.md)."""
    rng = np.random.default_rng(h * 7 + rows)
    x = rng.uniform(-4, 4, (rows, h)).astype(np.float32).astype(BF16)
    w = rng.uniform(0.5, 1.5, h).astype(np.float32)
    y = norm(x, EpilogueParams(h, w, 1e-6)).astype(np.float64)
    x64 = x.astype(np.float64)
    y64 = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    bound = np.abs(y64) * (2.0 ** -8 + (h / 8 + np.log2(h) + 8) * 2.0 ** -24) + 1e-30
    assert (np.abs(y - y64) <= bound).all()


def test_fp8_saturates_and_keeps_nan() -> None:
    h = 8
    x = np.array([[1, -1, 2, 0, 0, 0, 0, 0]], dtype=np.float32).astype(BF16)
    q = norm(x, EpilogueParams(h, np.ones(h, np.float32), 0.0, scale=1e-6), quant=True)
    assert float(q[0, 0]) == 448.0 and float(q[0, 1]) == -448.0
    x[0, 3] = np.nan
    assert np.isnan(norm(x, EpilogueParams(h, np.ones(h, np.float32), 0.0, scale=1.0), quant=True).astype(np.float32)).all()


@pytest.mark.parametrize("build,n,rows,h", [(build_fused_oneshot_ll, 2, 5, 24), (build_fused_oneshot_ll, 4, 3, 64),
                                            (build_fused_twoshot_ll, 2, 4, 16), (build_fused_twoshot_ll, 4, 8, 128)])
def test_sim_equals_exact_order_numerics(build, n: int, rows: int, h: int) -> None:
    """Every library fused plan sums the ranks' inputs in rank order on every rank: the
    simulator's outputs and residuals equal the spec's numerics over the inputs in rank order,
    bit for bit, on every rank (so every rank holds the same bits)."""
    plan = build(n)
    xs, res, w = _case(n, rows, h, BF16, n + rows)
    p = EpilogueParams(h, w, 1e-5)
    run = run_fused(plan, xs, [res] * n, p, check_races=True)
    assert not run.problems
    want_res, want_out = fused_reference(xs, res, p)
    for r in range(n):
        assert np.array_equal(run.residuals[r].view(np.uint16), want_res.view(np.uint16)), r
        assert np.array_equal(run.outputs[r].view(np.uint16), want_out.view(np.uint16)), r
        # the output is always exactly the norm of the rank's residual
        assert np.array_equal(run.outputs[r].view(np.uint16),
                              norm(run.residuals[r].reshape(-1, h), p).reshape(-1).view(np.uint16))


@pytest.mark.parametrize("build,kw", [(build_fused_oneshot_ll, {}), (build_fused_oneshot_ll, {"inplace": True}),
                                      (build_fused_oneshot_ll, {"quant": True}), (build_fused_twoshot_ll, {}),
                                      (build_fused_twoshot_ll, {"quant": True})])
def test_library_plans_verify(build, kw) -> None:
    rep = verify_fused(build(2, **kw), schedules=4)
    assert rep.runs and not rep.problems, [p.message for p in rep.problems]


def _mutated(plan, fn):
    d = copy.deepcopy(plan_to_dict(plan))
    fn(d)
    return load_plan(d)


def test_verifier_finds_a_norm_without_the_nop() -> None:
    """Planted bug: the nop between radd and rmsnorm of the two-shot removed; the norm reads the
    rows with another thread mapping while threads may still add them."""
    def drop(d):
        for g in d["gpus"]:
            ops = g["threadblocks"][0]["ops"]
            k = [o["name"] for o in ops].index("rmsnorm")
            assert ops[k - 1]["name"] == "nop"
            del ops[k - 1]
    rep = verify_fused(_mutated(build_fused_twoshot_ll(2), drop), schedules=2, symbolic=False)
    assert any(p.kind == "race" and "rmsnorm" in p.message for p in rep.problems)


def test_verifier_finds_an_early_norm_read() -> None:
    """Planted bug: the one-shot's norm moved before the radd of block 0, so it reads rows no
    residual add reached yet (and that other blocks may be adding): races, wrong outputs, and
    the symbolic run sees rows missing their contributions."""
    def early(d):
        for g in d["gpus"]:
            ops = g["threadblocks"][0]["ops"]
            names = [o["name"] for o in ops]
            b, k = names.index("radd"), names.index("rmsnorm")
            ops.insert(b, ops.pop(k))
    rep = verify_fused(_mutated(build_fused_oneshot_ll(2), early), schedules=2)
    kinds = {p.kind for p in rep.problems}
    assert {"race", "early-norm-read", "postcondition"} <= kinds, kinds


def test_plan_format_rules() -> None:
    plan = build_fused_oneshot_ll(2)
    assert plan.format == "mscclang.plan/2"
    d = plan_to_dict(plan)
    d["format"] = "mscclang.plan/1"
    with pytest.raises(PlanError, match="radd is an epilogue op"):
        load_plan(d)
    with pytest.raises(PlanError, match="MSCCL.. has no epilogue ops"):
        to_mscclpp(plan)
    d = plan_to_dict(plan)
    norm_op = d["gpus"][0]["threadblocks"][0]["ops"][-1]
    assert norm_op["name"] == OpName.rmsnorm.value
    norm_op["dst_buff"][0]["type"] = "s"
    with pytest.raises(PlanError, match="rmsnorm needs output"):
        load_plan(d)
    d = plan_to_dict(plan)
    d["gpus"][0]["threadblocks"][0]["ops"][-1]["src_buff"][0]["type"] = "w"
    with pytest.raises(PlanError, match="weight buffer"):
        load_plan(d)
    d = plan_to_dict(plan)
    d["gpus"][0]["threadblocks"][0]["ops"][-1]["dst_buff"][0].update(index=1, size=1)
    d["gpus"][0]["threadblocks"][0]["ops"][-1]["src_buff"][0].update(index=0, size=1)
    with pytest.raises(PlanError, match="row k of the residual to row k"):
        load_plan(d)
    d = plan_to_dict(plan)
    d["gpus"][0]["threadblocks"][0]["ops"][-1]["src_buff"][0].update(index=1, size=2)
    with pytest.raises(PlanError, match="outside rank 0's residual buffer"):
        load_plan(d)
    d = plan_to_dict(plan)
    d["gpus"][0]["threadblocks"][0]["ops"][-1]["tbg_info"] = {"tb_id": 0, "tbg_size": 1}
    with pytest.raises(PlanError, match="rmsnorm cannot be split over a thread-block group"):
        load_plan(d)
    d = plan_to_dict(plan)
    ops = d["gpus"][0]["threadblocks"][0]["ops"]
    k = [o["name"] for o in ops].index("radd")
    ops[k] = {"name": "pipeline", "iter_context": {"unit_size": 64, "num_chunks": 1}, "ops": [ops[k]]}
    with pytest.raises(PlanError, match="radd cannot stand inside a pipeline"):
        load_plan(d)


# -- the Communicator call ------------------------------------------------------------------

N, T, H = 2, 6, 32


def _tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(N)]
    return xs, torch.randn(T, H, generator=g).to(torch.bfloat16), torch.rand(H, generator=g) + 0.5


def _expected(xs, res, w, **kw):
    s = (xs[0].float() + xs[1].float()).to(torch.bfloat16)
    x, r = xs[0].clone(), res.clone()
    call = check_call(x, r, w, 1e-6, **kw)
    dst = kw.get("out", x)
    reference_epilogue(s, r, w, dst, call.epi)
    return SimpleNamespace(residual=r, dst=dst)


@pytest.mark.parametrize("fp8", [False, True])
def test_communicator_call_on_the_simulator(fp8: bool) -> None:
    xs, res, w = _tensors()

    def fn(comm):
        x, r = xs[comm.rank].clone(), res.clone()
        out = torch.empty(T, H, dtype=torch.float8_e4m3fn) if fp8 else None
        y = comm.all_reduce_add_rms_norm(x, r, w, 1e-6, out=out, fp8_scale=0.05 if fp8 else None)
        return y, r
    got, world, _ = run_ranks(N, fn, engine="sim", catalog=Catalog.from_dir())   # the shipped plans
    assert world.launches and all("rms_norm" in name for name in world.launches)
    kw = {"out": torch.empty(T, H, dtype=torch.float8_e4m3fn), "fp8_scale": 0.05} if fp8 else {}
    want = _expected(xs, res, w, **kw)
    for y, r in got:
        assert torch.equal(r, want.residual)
        assert torch.equal(y.view(torch.uint8) if fp8 else y, want.dst.view(torch.uint8) if fp8 else want.dst)


def test_fallback_without_a_plan_matches(caplog) -> None:
    """No fused plan in the catalog (three ranks), so the library all_reduce plus the reference
    epilogue runs (logged), with the same numerics."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 16, generator=g).to(torch.float16) for _ in range(3)]
    res = torch.randn(4, 16, generator=g).to(torch.float16)
    w = torch.rand(16, generator=g).to(torch.float16)

    def fn(comm):
        x, r = xs[comm.rank].clone(), res.clone()
        comm.all_reduce_add_rms_norm(x, r, w, 1e-5)
        return x, r
    with caplog.at_level("WARNING"):
        got, world, _ = run_ranks(3, fn, catalog=Catalog.from_dir())
    assert not any("rms_norm" in name for name in world.launches)
    assert any("all_reduce_add_rms_norm falls back" in m for m in caplog.messages)
    total = (xs[0].double() + xs[1].double() + xs[2].double() + res.double())
    for x, r in got:
        assert torch.allclose(r.double(), total, atol=4e-3 * (total.abs() + 1).max().item())
        call = check_call(x.clone(), res.clone(), w, 1e-5)
        want = norm(r.numpy().reshape(-1, 16), EpilogueParams(16, w.numpy(), 1e-5))
        assert np.array_equal(x.numpy().reshape(-1, 16), want) and call.epi.hidden == 16


@pytest.mark.parametrize("what,kw,match", [
    ("hidden", {"x": torch.zeros(T, 7, dtype=torch.bfloat16), "residual": torch.zeros(T, 7, dtype=torch.bfloat16),
                "weight": torch.ones(7)}, "multiple of 8"),
    ("divide", {"x": torch.zeros(T * H, dtype=torch.bfloat16), "residual": torch.zeros(T * H, dtype=torch.bfloat16),
                "weight": torch.ones(40)}, "does not divide x"),
    # seen: x and residual (4, 64) with a weight of 32 normalised 8 rows of 32, without an error
    ("weight is not the last dim", {"x": torch.zeros(4, 64, dtype=torch.bfloat16),
                                    "residual": torch.zeros(4, 64, dtype=torch.bfloat16), "weight": torch.ones(32)},
     r"weight has 32 elements but x of shape \(4, 64\) has a last dimension \(the hidden size\) of 64"),
    ("3-D x", {"x": torch.zeros(2, 3, 64, dtype=torch.bfloat16),
               "residual": torch.zeros(2, 3, 64, dtype=torch.bfloat16), "weight": torch.ones(96)}, "last dimension"),
    ("weight len", {"weight": torch.ones(2, 32)}, "weight must be one row"),
    ("dtypes", {"residual": torch.zeros(T, H, dtype=torch.float16)}, "residual has dtype"),
    ("weight dtype", {"weight": torch.ones(H, dtype=torch.float16)}, "weight has dtype"),
    ("scale zero", {"fp8_scale": 0.0, "out": torch.empty(T, H, dtype=torch.float8_e4m3fn)}, "fp8_scale"),
    ("scale negative", {"fp8_scale": -1.0, "out": torch.empty(T, H, dtype=torch.float8_e4m3fn)}, "fp8_scale"),
    ("scale no out", {"fp8_scale": 1.0}, "pass out="),
    ("out dtype", {"fp8_scale": 1.0, "out": torch.empty(T, H, dtype=torch.bfloat16)}, "out has dtype"),
    ("out shape", {"out": torch.empty(T, H + 8, dtype=torch.bfloat16)}, "out has shape"),
    ("eps", {"eps": float("nan")}, "eps"),
    ("residual device", {"residual": torch.zeros(T, H, dtype=torch.bfloat16, device="meta")}, "residual is on"),
])
def test_bad_input_raises_before_anything_runs(what: str, kw: dict, match: str) -> None:
    xs, res, w = _tensors()
    args = {"x": xs[0].clone(), "residual": res.clone(), "weight": w, "eps": 1e-6, **kw}

    def fn(comm):
        with pytest.raises(InvalidCall, match=match):
            comm.all_reduce_add_rms_norm(**args)
        return True
    got, world, _ = run_ranks(N, fn, engine="sim")
    assert all(got) and not world.launches


def test_one_dimensional_x_is_rows_of_the_hidden_size() -> None:
    """A 1-D x (as documented: rows of H = weight.numel() end to end) runs, and gives what the
    same call on x as (rows, H) gives; prepare takes it too."""
    xs, res, w = _tensors()

    def fn(comm):
        flat, r_flat = xs[comm.rank].clone().reshape(-1), res.clone().reshape(-1)
        comm.prepare_all_reduce_add_rms_norm(flat, r_flat, w, 1e-6)
        comm.all_reduce_add_rms_norm(flat, r_flat, w, 1e-6)
        x, r = xs[comm.rank].clone(), res.clone()
        comm.all_reduce_add_rms_norm(x, r, w, 1e-6)
        return flat, r_flat, x, r, comm.plan_calls
    got, world, _ = run_ranks(N, fn, engine="sim", catalog=Catalog.from_dir())
    assert len(world.launches) == 2 and all("rms_norm" in name for name in world.launches)
    for flat, r_flat, x, r, plan_calls in got:
        assert flat.shape == (T * H,) and torch.equal(flat, x.reshape(-1)) and torch.equal(r_flat, r.reshape(-1))
        assert plan_calls == 2   # the fused plans count as calls on mscclang plans


def test_selector_picks_by_size_rows_and_ranks() -> None:
    from mscclang.comm.selector import FUSED_ONESHOT_MAX_BYTES, FusedShape, select_fused

    cat = Catalog.from_dir()
    big = FUSED_ONESHOT_MAX_BYTES + 1
    pick = lambda **kw: select_fused(cat, kw.pop("ranks", 2), FusedShape(**kw))  # noqa: E731
    assert "oneshot" in pick(rows=4, hidden=8192, nbytes=4 * 8192 * 2, quant=False, inplace=True).algorithm
    assert "twoshot" in pick(rows=64, hidden=8192, nbytes=big, quant=False, inplace=True).algorithm
    # the two-shot's chunks are whole rows: odd row counts run it too
    assert "twoshot" in pick(rows=63, hidden=8192, nbytes=big, quant=False, inplace=True).algorithm
    v = pick(rows=64, hidden=8192, nbytes=big, quant=True, inplace=False)
    assert "twoshot" in v.algorithm and v.load().epilogue_ops()[-1][1].quant
    assert pick(rows=64, hidden=8192, nbytes=big, quant=True, inplace=True) is None   # FP8 is never in place
    assert pick(ranks=3, rows=3, hidden=8, nbytes=48, quant=False, inplace=False) is None
    for rows in (65, 129, 511):   # past the one-shot's 1 MiB: the two-shot, at any row count
        assert "twoshot" in pick(rows=rows, hidden=8192, nbytes=rows * 8192 * 2, quant=False, inplace=True).algorithm


def test_prepare_names_the_plan_then_the_call_runs_it() -> None:
    xs, res, w = _tensors()

    def fn(comm):
        x, r = xs[comm.rank].clone(), res.clone()
        name = comm.prepare_all_reduce_add_rms_norm(x, r, w, 1e-6)
        comm.all_reduce_add_rms_norm(x, r, w, 1e-6)
        return name
    got, world, _ = run_ranks(N, fn, engine="sim", catalog=Catalog.from_dir())
    assert got[0] == got[1] == world.launches[0]
    assert run_ranks(N, lambda comm: comm.prepare_all_reduce_add_rms_norm(xs[0].clone(), res.clone(), w),
                     engine="sim")[0] == [None, None]   # an empty catalog: the fallback's all_reduce



@pytest.mark.parametrize("rows,h", [(1, 8), (2, 16384), (512, 8), (64, 1024), (7, 4096), (33, 136)])
def test_sim_against_float64_reference(rows: int, h: int) -> None:
    """The simulator running the library's one-shot over hidden sizes 8..16384 and 1..512 rows
    (a sample): every residual within (n + 1) u (sum |x| + |r|) of float64's, every output within
    the norm's bound of float64's norm of that residual (docs/semantics.md)."""
    plan = build_fused_oneshot_ll(2)
    xs, res, w = _case(2, rows, h, BF16, rows + h)
    run = run_fused(plan, xs, [res, res], EpilogueParams(h, w, 1e-6))
    x64 = [x.astype(np.float64) for x in xs]
    exact = x64[0] + x64[1] + res.astype(np.float64)
    bound = 3 * 2.0 ** -8 * (np.abs(x64[0]) + np.abs(x64[1]) + np.abs(res.astype(np.float64))) + 1e-30
    for r in range(2):
        got = run.residuals[r].astype(np.float64)
        assert (np.abs(got - exact) <= bound).all()
        rows64 = got.reshape(rows, h)
        y64 = rows64 / np.sqrt((rows64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
        y = run.outputs[r].astype(np.float64).reshape(rows, h)
        assert (np.abs(y - y64) <= np.abs(y64) * (2.0 ** -8 + (h / 8 + np.log2(h) + 8) * 2.0 ** -24) + 1e-30).all()


def test_the_gpu_checks_pass_on_the_simulator() -> None:
    """tests/harness/fused_checks.py (the GPU suite's checks) on the simulator back end: every
    shipped two-rank fused plan runs, equals run_fused and torch's reference bounds."""
    from tests.harness.fused_checks import check_with

    got, _, _ = run_ranks(2, lambda comm: check_with(comm, torch.device("cpu"), shapes=((1, 64), (7, 72), (256, 1024))),
                          engine="sim", catalog=Catalog.from_dir())
    for r in got:
        assert r["checked"] == 18 and not r["failures"], r["failures"]
    assert len(got[0]["plans"]) == 6
