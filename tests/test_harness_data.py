"""tests.harness.data.spread: the GPU checks' order-sensitive inputs. Sums of 4 and 8 ranks'
inputs, reduced by the simulator's own rule (:func:`mscclang.sim.dtypes.reduce_bytes`: every
step rounded to the element type; fp8 in its accumulation dtype, rounded once per op), differ
between left to right and another order in a clear fraction of the elements, so a plan that
changed the order on one side of a comparison cannot agree with the other side by chance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mscclang.comm.sim_backend import torch_to_numpy
from mscclang.sim.dtypes import reduce_bytes
from tests.harness.data import FP8_HEADROOM, spread

NUMEL = 1 << 15
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
FP8S = (torch.float8_e4m3fn, torch.float8_e5m2)


def _op(arrs: list, accum: str | None) -> np.ndarray:
    """One reduction op over ``arrs`` in the listed order (the simulator's rule)."""
    dt = arrs[0].dtype
    return reduce_bytes([a.view(np.uint8) for a in arrs], dt, "sum", accum).view(dt)


def _pairwise(arrs: list, accum: str | None) -> np.ndarray:
    """``(x0 + x1) + (x2 + x3) ...``: one op per pair, level by level (partial sums rounded)."""
    while len(arrs) > 1:
        arrs = [_op(arrs[i:i + 2], accum) for i in range(0, len(arrs), 2)]
    return arrs[0]


def _differ(a: np.ndarray, b: np.ndarray) -> float:
    """The fraction of elements whose bits differ."""
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return float(np.mean(a.view(u) != b.view(u)))


def _inputs(n: int, dt: torch.dtype) -> list:
    return [torch_to_numpy(spread(NUMEL, dt, 1000 + q)) for q in range(n)]


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_another_order_changes_a_clear_fraction_of_the_sums(dt, n):
    xs = _inputs(n, dt)
    ltr = _op(xs, None)
    assert _differ(ltr, _op(xs[::-1], None)) > 0.2
    assert _differ(ltr, _pairwise(xs, None)) > 0.15


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("accum", ["float32", "float16"])
@pytest.mark.parametrize("dt", FP8S, ids=str)
def test_fp8_sums_change_with_the_order_too(dt, accum, n):
    """fp8: partial sums rounded to fp8 (a plan reducing in hops) differ from one op in a clear
    fraction. Within one op, reversed: with float16 accumulation spread data makes some sums
    inexact, so the order shows; with float32 accumulation every e4m3 sum of up to 8 terms is
    exact (its values span 18 binades of 4 bits, fp32 holds 24), so no data can show it there."""
    xs = _inputs(n, dt)
    ltr = _op(xs, accum)
    assert _differ(ltr, _pairwise(xs, accum)) > 0.1
    rev = _differ(ltr, _op(xs[::-1], accum))
    if accum == "float16":
        assert rev > 1e-4   # 15 to 150 of the 32768 sums: fp8 sums are mostly exact in fp16
    elif dt == torch.float8_e4m3fn:
        assert rev == 0.0


@pytest.mark.parametrize("dt", FLOATS + FP8S, ids=str)
def test_spread_spans_many_binades_and_stays_finite(dt):
    x = spread(NUMEL, dt, 7).float()
    assert bool(torch.isfinite(x).all())
    lg = torch.log2(x.abs()[x != 0])
    q10, q90 = torch.quantile(lg, torch.tensor([0.1, 0.9])).tolist()
    assert q90 - q10 >= (7 if dt == torch.float8_e4m3fn else 12)   # plain normal values: 3.7
    if dt.itemsize == 1:
        assert float(x.abs().max()) <= torch.finfo(dt).max * FP8_HEADROOM
        assert float((x == 0).float().mean()) < 0.01   # the lowest exponents stay above underflow


def test_spread_is_regenerated_from_its_seed_on_any_process():
    a = spread(1000, torch.float16, 3)
    assert torch.equal(a.view(torch.int16), spread(1000, torch.float16, 3).view(torch.int16))
    assert not torch.equal(a, spread(1000, torch.float16, 4))
    g = torch.Generator().manual_seed(3)
    assert torch.equal(a.view(torch.int16), spread(1000, torch.float16, g).view(torch.int16))
    assert spread((7, 5), torch.bfloat16, 1).shape == (7, 5)


def test_int32_spread_covers_the_whole_range():
    x = spread(NUMEL, torch.int32, 5)
    assert x.dtype == torch.int32
    assert int(x.min()) < -(1 << 30) and int(x.max()) > (1 << 30)


def test_spread_refuses_other_dtypes():
    with pytest.raises(ValueError, match="int64"):
        spread(4, torch.int64, 0)
