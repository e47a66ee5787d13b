"""A fused plan for every token count: the two-shot's chunks are whole rows (``chunk_unit``
``"row"``), so every row count T and every hidden size the call accepts runs a fused plan on 2, 4
and 8 ranks, in place and out of place, with FP8 output; every rank gets the same bits."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mscclang.comm.selector import FusedShape, select_fused
from mscclang.comm.sim_ranks import run_ranks
from mscclang.errors import PlanError
from mscclang.plan.layout import make_layout
from mscclang.plan.models import BufferKind
from mscclang.runtime.packing import pack_blocks
from mscclang.sim.epilogue import EpilogueParams, fused_reference
from mscclang.sim.fused import run_fused
from tests.harness.sim_plans import library_plans

BF16 = np.dtype(ml_dtypes.bfloat16)
HIDDENS = [8, 16, 24, 40, 1024, 4096, 5120, 8192, 65536]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_every_row_count_and_hidden_size_has_a_fused_plan(catalog, ranks: int) -> None:
    """The selector finds a plan for T = 1..600 at several hidden sizes and for every hidden
    size (multiples of 8 up to 65536) at several T, in place, out of place and with FP8; the
    chosen plan's layout cuts no row (packed for a sample)."""
    cases = [(t, h) for h in (8, 24, 4096, 8192) for t in range(1, 601)]
    cases += [(t, h) for t in (1, 7, 129, 512) for h in range(8, 65537, 8)]
    packed: set = set()
    for t, h in cases:
        for quant, inplace in ((False, True), (False, False), (True, False)):
            nbytes = t * h * 2
            v = select_fused(catalog, ranks, FusedShape(t, h, nbytes, quant, inplace))
            assert v is not None, (ranks, t, h, quant, inplace)
            key = (v.key, t % (2 * ranks), quant)
            if key in packed or h not in (8, 24, 4096):
                continue
            packed.add(key)
            plan = v.load()
            for r in range(ranks):
                pk = pack_blocks(plan, r, nbytes, t * h * (1 if quant else 2), row_bytes=h * 2)
                for _, spans, _ in pk.norms:
                    if spans:
                        assert spans[0][0] % (h * 2) == 0 and (spans[-1][0] + spans[-1][1]) % (h * 2) == 0


def test_row_chunks_split_rows_unevenly_and_need_the_row_size(catalog) -> None:
    plan = next(v for v in catalog if "twoshot" in v.algorithm and v.ranks == 4).load()
    assert plan.chunk_unit == "row"
    lay = make_layout(plan, 0, 7 * 48, 7 * 48, row_bytes=48)
    assert [lay.span(BufferKind.input, c) for c in range(4)] == [(0, 96), (96, 96), (192, 96), (288, 48)]
    lay = make_layout(plan, 0, 2 * 48, 2 * 48, row_bytes=48)   # fewer rows than ranks: empty chunks
    assert [lay.span(BufferKind.input, c)[1] for c in range(4)] == [48, 48, 0, 0]
    with pytest.raises(PlanError, match="row size is needed"):
        make_layout(plan, 0, 96, 96)
    with pytest.raises(PlanError, match="not whole rows"):
        make_layout(plan, 0, 100, 100, row_bytes=48)


@pytest.mark.parametrize("n, rows, h, quant, inplace", [
    (2, 129, 64, False, True), (4, 3, 32, False, False), (8, 1, 16, False, True),
    (4, 7, 24, True, False), (8, 13, 40, True, False), (2, 5, 8, False, False)])
def test_the_row_chunked_two_shot_is_exact_on_every_rank(n, rows, h, quant, inplace) -> None:
    from mscclang.algorithms.fused import build_fused_twoshot_ll
    from mscclang.sim.postcondition import check_fused

    plan = build_fused_twoshot_ll(n, quant=quant, inplace=inplace)
    rng = np.random.default_rng(rows * h)
    xs = [rng.uniform(-1, 1, rows * h).astype(np.float32).astype(BF16) for _ in range(n)]
    res = rng.uniform(-1, 1, rows * h).astype(np.float32).astype(BF16)
    p = EpilogueParams(h, rng.uniform(0.5, 1.5, h).astype(np.float32), 1e-6, scale=0.05 if quant else None)
    run = run_fused(plan, xs, [res] * n, p, check_races=True, launches=3)
    assert not run.problems
    assert not check_fused(xs, [res] * n, run.residuals, run.outputs, p, quant, 3)
    want_res, want_out = fused_reference(xs, res, p, quant=quant) if quant else fused_reference(xs, res, p)
    for r in range(n):
        assert run.residuals[r].tobytes() == want_res.tobytes(), r
        assert run.outputs[r].tobytes() == want_out.tobytes(), r
    assert not run_fused(plan, xs, [res] * n, p, symbolic=True).problems


@pytest.mark.parametrize("n, t, h", [(2, 129, 4096), (4, 7, 64), (8, 3, 32)])
def test_the_communicator_runs_odd_row_counts_fused_with_the_same_bits_on_every_rank(n, t, h) -> None:
    """The issue's case: two ranks, T = 129 at H = 4096 fell back ("no fused plan"); it runs the
    two-shot now, within the reference's bound, with every rank's bytes equal."""
    g = torch.Generator().manual_seed(t)
    xs = [torch.randn(t, h, generator=g).to(torch.bfloat16) for _ in range(n)]
    res0 = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w = torch.rand(h, generator=g) + 0.5

    def fn(comm):
        x, res = xs[comm.rank].clone(), res0.clone()
        y = comm.all_reduce_add_rms_norm(x, res, w, 1e-6)
        return comm.last_fused, y.view(torch.int16).clone(), res.view(torch.int16).clone()

    plans = library_plans(["allreduce_add_rms_norm_oneshot_ll", "allreduce_add_rms_norm_twoshot_ll"], n)
    got, _, _ = run_ranks(n, fn, engine="sim", plans=plans)
    assert all(name is not None for name, _, _ in got)
    assert "twoshot" in got[0][0] or t * h * 2 <= 256 * 1024
    for name, y, res in got[1:]:
        assert torch.equal(y, got[0][1]) and torch.equal(res, got[0][2])
    s64 = sum(x.double() for x in xs) + res0.double()
    r = got[0][2].view(torch.bfloat16).double()
    bound = (n + 1) * 2.0 ** -8 * (sum(x.double().abs() for x in xs) + res0.double().abs())
    assert bool(((r - s64).abs() <= bound).all())
