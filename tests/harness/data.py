"""Order-sensitive test data: the inputs of every GPU check that compares a result with the
simulator or across ranks.

Why: a floating-point sum of values whose exponents spread over many binades rounds differently
when it is added in another order (small terms are absorbed or kept depending on what they meet),
so a plan or kernel that changed the reduction order on one side cannot agree with the other side
by chance; and the values reach exponents far from 1, which standard normal data never does.
Small integers, constants or ``arange`` sum exactly in every order and would hide such a change.
(Standard normal data shows the order of fp16/bf16/fp32 sums too, in somewhat more elements; in
one fp8 reduction op accumulating in float16 it almost never does, this data in a few per mille.)
"""

from __future__ import annotations

import math
from typing import Any, Union

#: the binary exponents ``k`` of the scale factors ``2**k``: uniform in ``[SPREAD_LO, SPREAD_HI]``
SPREAD_LO, SPREAD_HI = -8, 7
#: fp8: the largest element is this fraction of the largest finite value, so that a sum over up to
#: 16 ranks stays below saturation
FP8_HEADROOM = 1.0 / 16


def spread(shape: Union[int, tuple], dtype: Any, seed: Union[int, Any], device: Any = "cpu") -> Any:
    """Random elements of torch ``dtype`` whose sums depend on the order (the module's docstring
    says why): standard normal values times ``2**k``, ``k`` uniform in ``[SPREAD_LO, SPREAD_HI]``,
    rounded once to ``dtype``. ``seed`` is an int (a generator on ``device`` is seeded with it, so
    any process regenerates any rank's data from the same seed) or a ``torch.Generator`` (used as
    it is; its device is the tensor's). ``shape`` is an element count or a shape.

    fp8 types (``float8_e4m3fn``, ``float8_e5m2``): scaled so that no element exceeds
    :data:`FP8_HEADROOM` of the largest finite value (sums over up to 16 ranks do not saturate),
    with the lowest exponents raised to the smallest normal value (e4m3 has fewer binades than the
    span above). int32: uniform over the whole int32 range; integer sums (wrapping) are the same
    in every order, so only the spread of values matters there."""
    import torch

    g = seed
    if not isinstance(seed, torch.Generator):
        g = torch.Generator(device=device)
        g.manual_seed(int(seed))
    dev = g.device
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype == torch.int32:
        return torch.randint(-2 ** 31, 2 ** 31, shape, generator=g, device=dev, dtype=torch.int64).to(torch.int32)
    if not dtype.is_floating_point:
        raise ValueError(f"spread data is floating point or int32, not {dtype}")
    lo, scale, top = SPREAD_LO, 1.0, None
    if dtype.itemsize == 1:
        info = torch.finfo(dtype)
        top = info.max * FP8_HEADROOM
        scale = top / 4.0 / 2.0 ** SPREAD_HI   # |normal| <= 4 in all but ~1e-4 of the elements
        lo = max(SPREAD_LO, math.ceil(math.log2(info.tiny / scale)))
    x = torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
    k = torch.randint(lo, SPREAD_HI + 1, shape, generator=g, device=dev, dtype=torch.int8)
    x.mul_(torch.pow(2.0, k))   # in place, k in int8: large inputs (1 GiB) stay near randn's memory
    del k
    if top is not None:
        x.mul_(scale).clamp_(-top, top)
    return x.to(dtype)


def rank_input(seed: int, rank: int, numel: int, dtype: Any, device: Any) -> Any:
    """Rank ``rank``'s input of a check seeded ``seed``: :func:`spread` data of ``numel`` elements
    on ``device`` (any process regenerates every rank's from the same ``seed``)."""
    return spread(numel, dtype, seed * 1000003 + rank, device=device)
