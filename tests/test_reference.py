"""mscclang.reference, the canonical results (docs/semantics.md, "Batch invariance"): bit for bit
what the CPU simulator computes with the shipped plans that fold the ranks in rank order (the
one-shot allreduce, the LL reduce-scatter, the fused plans), on order-sensitive data in every
dtype the kernels reduce; the fused norm's row 0 independent of the row count; avg; and a clear
InvalidCall for every bad argument."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mscclang import reference
from mscclang.comm.sim_backend import torch_to_numpy
from mscclang.errors import InvalidCall
from mscclang.plan import load_plan
from mscclang.sim.epilogue import EpilogueParams
from mscclang.sim.fused import run_fused
from mscclang.sim.runner import run
from tests.harness.data import spread

PLANS = Path(__file__).resolve().parent.parent / "plans"
#: (dtype, accumulation dtype) of every reducing call the kernels run
DTYPES = [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None), (torch.int32, None),
          (torch.float8_e4m3fn, None), (torch.float8_e4m3fn, torch.float16), (torch.float8_e5m2, torch.float16)]


def _ids(cases: list) -> list[str]:
    return [f"{str(d).split('.')[-1]}{'-accum_' + str(a).split('.')[-1] if a is not None else ''}" for d, a in cases]


def _bits(t: torch.Tensor) -> np.ndarray:
    """One row of bytes per element (compares NaN and -0 by their bits)."""
    a = torch_to_numpy(t)
    return a.view(np.uint8).reshape(a.size, a.itemsize)


def _differing(got: np.ndarray, want: torch.Tensor) -> int:
    """How many elements of ``got`` (numpy, the simulator's) differ from ``want`` in their bits."""
    w = _bits(want)
    return int((got.view(np.uint8).reshape(w.shape) != w).any(axis=1).sum())


def _inputs(n: int, count, dt: torch.dtype, seed: int) -> list[torch.Tensor]:
    return [spread(count, dt, seed * 1009 + r) for r in range(n)]


@pytest.mark.parametrize("plan", ["allreduce_oneshot_ll.r2.i1", "allreduce_oneshot_ll.r4.i1",
                                  "allreduce_oneshot_ll.r8.i1", "allreduce_oneshot_ll.r4.i4.inplace"])
@pytest.mark.parametrize("dt,accum", DTYPES, ids=_ids(DTYPES))
def test_all_reduce_is_what_a_rank_order_plan_computes(plan: str, dt: torch.dtype, accum) -> None:
    p = load_plan(PLANS / f"{plan}.json")
    n = len(p.gpus)
    for count in (1, 1001, 4096):
        xs = _inputs(n, count, dt, count)
        want = reference.all_reduce(xs, accum_dtype=accum)
        assert want.shape == (count,) and want.dtype == dt
        outs = run(p, [torch_to_numpy(x) for x in xs], accum=None if accum is None else str(accum).split(".")[-1])
        assert [_differing(o, want) for o in outs] == [0] * n, f"{plan} {dt} {count}"


@pytest.mark.parametrize("plan", ["reducescatter_ll.r2.i1", "reducescatter_ll.r4.i1", "reducescatter_ll.r8.i1"])
@pytest.mark.parametrize("dt,accum", DTYPES, ids=_ids(DTYPES))
def test_reduce_scatter_is_what_a_rank_order_plan_computes(plan: str, dt: torch.dtype, accum) -> None:
    p = load_plan(PLANS / f"{plan}.json")
    n = len(p.gpus)
    for per_rank in (1, 517):
        xs = _inputs(n, per_rank * n, dt, per_rank)
        want = reference.reduce_scatter(xs, accum_dtype=accum)
        assert [tuple(w.shape) for w in want] == [(per_rank,)] * n
        outs = run(p, [torch_to_numpy(x) for x in xs], accum=None if accum is None else str(accum).split(".")[-1])
        assert [_differing(o, w) for o, w in zip(outs, want)] == [0] * n, f"{plan} {dt} {per_rank}"
        full = reference.all_reduce(xs, accum_dtype=accum)   # block r of the all_reduce, the same bits
        assert all(torch.equal(_t(w), _t(full[r * per_rank:(r + 1) * per_rank])) for r, w in enumerate(want))


def _t(x: torch.Tensor) -> torch.Tensor:
    """The bits as integers (torch.equal compares NaN unequal and fp8 not at all)."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.parametrize("plan", ["allreduce_add_rms_norm_oneshot_ll.r2.i1", "allreduce_add_rms_norm_oneshot_ll.r4.i1",
                                  "allreduce_add_rms_norm_twoshot_ll.r4.i1", "allreduce_add_rms_norm_twoshot_ll.r8.i1",
                                  "allreduce_add_rms_norm_oneshot_ll.r4.i1.quantTrue",
                                  "allreduce_add_rms_norm_twoshot_ll.r2.i1.quantTrue"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_call_is_what_the_fused_plans_compute(plan: str, dt: torch.dtype) -> None:
    p = load_plan(PLANS / f"{plan}.json")
    n, quant = len(p.gpus), "quant" in plan
    for t, h, wdt, fp8 in ((3, 1024, torch.float32, torch.float8_e4m3fn), (2, 520, dt, torch.float8_e5m2)):
        xs = _inputs(n, (t, h), dt, t * h)
        res = spread((t, h), dt, 77)
        w = (torch.rand(h, generator=torch.Generator().manual_seed(h)) + 0.5).to(wdt)
        scale = 0.05 if quant else None
        out, new_res = reference.all_reduce_add_rms_norm(xs, res, w, 1e-5, fp8_scale=scale,
                                                         out_dtype=fp8 if quant else None)
        assert out.shape == new_res.shape == (t, h) and new_res.dtype == dt and out.dtype == (fp8 if quant else dt)
        params = EpilogueParams(h, torch_to_numpy(w), 1e-5, scale, torch_to_numpy(torch.empty(0, dtype=fp8)).dtype)
        got = run_fused(p, [torch_to_numpy(x) for x in xs], [torch_to_numpy(res)] * n, params)
        assert not got.problems
        assert [_differing(o, out) for o in got.outputs] == [0] * n, f"{plan} {dt} {t}x{h} output"
        assert [_differing(r, new_res) for r in got.residuals] == [0] * n, f"{plan} {dt} {t}x{h} residual"


def test_the_data_shows_the_order() -> None:
    """The comparisons above cannot pass by chance: on spread data another order (the reversed
    ranks) gives other bits in many elements, in every floating dtype."""
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        xs = _inputs(4, 4096, dt, 5)
        a, b = _bits(reference.all_reduce(xs)), _bits(reference.all_reduce(xs[::-1]))
        assert (a != b).any(axis=1).sum() > 100, dt
    xs = _inputs(8, 4096, torch.float8_e4m3fn, 6)
    a32 = _bits(reference.all_reduce(xs))
    a16 = _bits(reference.all_reduce(xs, accum_dtype=torch.float16))
    assert (a32 != a16).any(axis=1).sum() > 0   # the accumulation dtype matters


def test_sums_fold_in_rank_order_rounding_every_step() -> None:
    one, tiny = torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0 ** -8], dtype=torch.bfloat16)
    assert reference.all_reduce([one, tiny, tiny]).item() == 1.0                 # each 1 + tiny rounds to 1
    assert reference.all_reduce([tiny, tiny, one]).item() == 1.0 + 2.0 ** -7     # tiny + tiny is kept
    big = torch.tensor([2 ** 31 - 1], dtype=torch.int32)
    assert reference.all_reduce([big, torch.tensor([1], dtype=torch.int32)]).item() == -2 ** 31   # wraps
    e4m3 = [torch.tensor([448.0]).to(torch.float8_e4m3fn)] * 2
    assert reference.all_reduce(e4m3).float().item() == 448.0                    # saturates


@pytest.mark.parametrize("t", [1, 7, 64, 129])
def test_fused_row_0_has_the_same_bits_at_every_row_count(t: int) -> None:
    h, n, dt = 1024, 4, torch.bfloat16
    row0 = _inputs(n, (1, h), dt, 1)
    res0 = spread((1, h), dt, 2)
    w = torch.rand(h, generator=torch.Generator().manual_seed(3)) + 0.5
    want_out, want_res = reference.all_reduce_add_rms_norm(row0, res0, w, 1e-6)
    others = _inputs(n, (t - 1, h), dt, 100 + t)
    xs = [torch.cat([r0, o]) for r0, o in zip(row0, others)]
    res = torch.cat([res0, spread((t - 1, h), dt, 200 + t)])
    out, new_res = reference.all_reduce_add_rms_norm(xs, res, w, 1e-6)
    assert torch.equal(_t(out[:1]), _t(want_out)) and torch.equal(_t(new_res[:1]), _t(want_res))
    for scale in (0.05,):
        q, _ = reference.all_reduce_add_rms_norm(xs, res, w, 1e-6, fp8_scale=scale)
        q0, _ = reference.all_reduce_add_rms_norm(row0, res0, w, 1e-6, fp8_scale=scale)
        assert torch.equal(_t(q[:1]), _t(q0))


def test_avg_is_the_sum_times_the_float32_reciprocal() -> None:
    xs = _inputs(4, 4096, torch.bfloat16, 8)
    s = reference.all_reduce(xs)
    assert torch.equal(_t(reference.all_reduce(xs, op="avg")), _t(s / 4))        # 1/4 is exact: the quotient
    xs3 = _inputs(3, 4096, torch.float32, 9)
    s3 = reference.all_reduce(xs3)
    inv = torch.tensor(1.0, dtype=torch.float32) / 3
    assert torch.equal(reference.all_reduce(xs3, op="avg"), s3 * inv)
    assert not torch.equal(s3 * inv, s3 / 3)   # on this data the product and the quotient differ somewhere
    ints = [torch.tensor([-7, 7, 2 ** 31 - 1], dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
            torch.tensor([0, 0, 1], dtype=torch.int32)]
    assert reference.all_reduce(ints, op="AVG").tolist() == [-2, 2, -(2 ** 31) // 3 + 1]   # wraps, then truncates
    assert reference.all_reduce(xs, op=torch.distributed.ReduceOp.SUM).equal(s)
    rs = reference.reduce_scatter(xs, op="avg")
    assert torch.equal(_t(torch.cat(rs)), _t(s / 4))


def test_any_layout_and_one_rank() -> None:
    x = spread((8, 6), torch.float16, 4)
    xs = [x.t(), (x * 2).t()]                      # not contiguous
    want = reference.all_reduce([t.contiguous() for t in xs])
    got = reference.all_reduce(tuple(xs))
    assert got.shape == (6, 8) and torch.equal(got, want)
    one = reference.all_reduce([x])
    assert torch.equal(one, x) and one.data_ptr() != x.data_ptr()
    res = spread((8, 8), torch.bfloat16, 5)
    before = res.clone()
    reference.all_reduce_add_rms_norm([spread((8, 8), torch.bfloat16, 6)], res, torch.ones(8), 1e-6)
    assert torch.equal(res, before)                # the reference changes none of its arguments


_X = [torch.zeros(4, 16, dtype=torch.bfloat16)] * 2
_W = torch.ones(16)


@pytest.mark.parametrize("call,message", [
    (lambda: reference.all_reduce([]), "non-empty list"),
    (lambda: reference.all_reduce(torch.zeros(4)), "non-empty list"),
    (lambda: reference.all_reduce([torch.zeros(4), "x"]), "rank 1: all_reduce: expected a torch tensor"),
    (lambda: reference.all_reduce([torch.zeros(4), torch.zeros(5)]), "rank 1: all_reduce: tensor of shape (5,)"),
    (lambda: reference.all_reduce([torch.zeros(4), torch.zeros(4, dtype=torch.float16)]), "rank 0's has shape (4,)"),
    (lambda: reference.all_reduce([torch.zeros(4, dtype=torch.float64)]), "float64, which mscclang does not run"),
    (lambda: reference.all_reduce([torch.zeros(4)], op="prod"), "supported: sum, min, max, avg"),
    (lambda: reference.all_reduce([torch.zeros(4, dtype=torch.float8_e4m3fn)], op="max"), "use sum"),
    (lambda: reference.all_reduce([torch.zeros(4, dtype=torch.float8_e4m3fn)], op="avg"), "avg is not defined"),
    (lambda: reference.all_reduce([torch.zeros(4)], accum_dtype=torch.float16), "applies to fp8 tensors only"),
    (lambda: reference.all_reduce([torch.zeros(4, dtype=torch.float8_e5m2)], accum_dtype=torch.bfloat16),
     "not an accumulation dtype"),
    (lambda: reference.reduce_scatter([torch.zeros(5)] * 2), "5 elements per rank, not divisible by the 2 ranks"),
    (lambda: reference.all_reduce_add_rms_norm(_X, _X[0].clone(), torch.ones(8), 1e-6), "last dimension"),
    (lambda: reference.all_reduce_add_rms_norm(_X, _X[0].clone(), torch.ones(2, 8), 1e-6), "one row (1-D)"),
    (lambda: reference.all_reduce_add_rms_norm(_X, _X[0].float(), _W, 1e-6), "residual has dtype"),
    (lambda: reference.all_reduce_add_rms_norm(_X, torch.zeros(2, 16, dtype=torch.bfloat16), _W, 1e-6),
     "residual has shape"),
    (lambda: reference.all_reduce_add_rms_norm(_X, _X[0].clone(), _W.half(), 1e-6), "weight has dtype"),
    (lambda: reference.all_reduce_add_rms_norm(_X, _X[0].clone(), _W, float("nan")), "eps must be"),
    (lambda: reference.all_reduce_add_rms_norm(_X, _X[0].clone(), _W, 1e-6, fp8_scale=0.0), "fp8_scale must be"),
    (lambda: reference.all_reduce_add_rms_norm(_X, _X[0].clone(), _W, 1e-6, out_dtype=torch.float8_e5m2),
     "applies with fp8_scale only"),
    (lambda: reference.all_reduce_add_rms_norm(_X, _X[0].clone(), _W, 1e-6, fp8_scale=1.0, out_dtype=torch.float16),
     "not an FP8 type"),
    (lambda: reference.all_reduce_add_rms_norm([torch.zeros(4, 12)], torch.zeros(4, 12), torch.ones(12), 1e-6),
     "multiple of 8"),
    (lambda: reference.all_reduce_add_rms_norm([torch.zeros(4, 16, dtype=torch.int32)],
                                               torch.zeros(4, 16, dtype=torch.int32), _W, 1e-6), "float16, bfloat16"),
    (lambda: reference.all_reduce_add_rms_norm(_X, None, _W, 1e-6), "must be torch tensors"),
])
def test_bad_arguments_raise_invalid_call_naming_them(call, message: str) -> None:
    with pytest.raises(InvalidCall) as e:
        call()
    assert message in str(e.value)


def test_mscclang_exposes_the_module_lazily() -> None:
    import mscclang

    assert mscclang.reference is reference


def test_the_gpu_invariance_checks_run_on_the_simulator() -> None:
    """tests/harness/invariance_checks.py (the GPU test's commands) on 2 CPU ranks of the
    simulator, whose plans at these sizes fold in rank order: every count checked, 0 differing
    elements, every call on a plan; the fused rows likewise."""
    from types import SimpleNamespace

    from mscclang.comm.catalog import Catalog
    from mscclang.comm.sim_ranks import run_ranks
    from tests.harness import invariance_checks as checks

    def ranks(comm):
        w = SimpleNamespace(state={"mscclang.comm/batch_invariant": comm}, rank=comm.rank, world_size=comm.world_size)
        return [checks.check_collectives(w, "float8_e4m3fn/float16", counts=(1, 1001), modes=("ordinary",)),
                checks.check_fused_rows(w, "bfloat16", True, tokens=(1, 7), hiddens=(1024,))]

    results, _, fb = run_ranks(2, ranks, catalog=Catalog.from_dir(PLANS), engine="sim", fallback=False)
    for coll, fused in results:
        assert coll["failures"] == fused["failures"] == []
        assert len(coll["differing"]) == 3 and set(coll["differing"].values()) == {0}   # no reduce_scatter of 1
        assert len(fused["differing"]) == 10 and set(fused["differing"].values()) == {0}
        assert None not in fused["plans"].values()
