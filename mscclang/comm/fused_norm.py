"""``Communicator.all_reduce_add_rms_norm``: the fused allreduce + residual add + RMSNorm
(+ FP8 output) call, with vLLM's ``fused_add_rms_norm`` semantics.

``residual += allreduce(x)``, then ``x`` (or ``out``) gets ``RMSNorm(residual) * weight``, or its
FP8 quantisation with ``fp8_scale`` (``out`` then an FP8 tensor). The numerics are
:mod:`mscclang.sim.epilogue`'s. Every argument is checked once, by
:func:`mscclang.plan.call.make_call` (InvalidCall naming it), before anything runs. The call goes
through the planner's memo like every other call: a repeated call (the same tensors and
parameters) launches what the engine resolved the first time. A catalog plan runs when one fits
the shape (:func:`mscclang.comm.selector.select_fused`); else the call falls back to the
library ``all_reduce`` plus the reference epilogue in torch (the same numerics), logged once per
reason; in the batch-invariant mode only plans that keep the contract run (generated from the
library where the catalog has none) and a call none serves raises
:class:`~mscclang.comm.errors.BatchInvariantError` instead of falling back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mscclang.comm.invariant import call_words, refusal
from mscclang.comm.selector import FusedShape, select_fused
from mscclang.plan.call import Call, FusedArgs, make_call
from mscclang.plan.collectives import FUSED_NORM
from mscclang.sim.epilogue import TorchOps, rms_norm_rows


@dataclass
class FusedCall:
    """A checked fused call (:attr:`call`) with its tensors, ``dst`` the tensor the norm goes to;
    the plan it runs (None: the fallback, for ``reason``) and what the engine resolved for it
    (``bound``: a repeated call launches it)."""

    call: Call
    x: Any
    residual: Any
    weight: Any
    dst: Any
    plan: Any = None
    reason: str = ""
    bound: Any = None

    @property
    def hidden(self) -> int:
        return self.call.epi.hidden  # type: ignore[union-attr]

    @property
    def eps(self) -> float:
        return self.call.epi.eps  # type: ignore[union-attr]

    @property
    def scale(self) -> Optional[float]:
        return self.call.epi.scale  # type: ignore[union-attr]

    @property
    def quant(self) -> bool:
        return self.scale is not None

    def shape(self) -> FusedShape:
        """What the selector needs (:func:`mscclang.comm.selector.select_fused`)."""
        c = self.call
        return FusedShape(c.in_bytes // c.dtype.itemsize // self.hidden, self.hidden, c.in_bytes, self.quant,
                          self.dst is self.x)


def check_call(x: Any, residual: Any, weight: Any, eps: Any, out: Any = None, fp8_scale: Any = None,
               rank: int = 0, world: int = 1, device: Any = None) -> FusedCall:
    """The checked call (:func:`mscclang.plan.call.make_call` with the fused arguments; InvalidCall
    naming the first bad one): ``x`` and ``residual`` contiguous fp16/bf16/fp32 tensors of one
    shape, dtype and device; ``weight`` one row of H elements (fp32 or x's dtype; H =
    ``weight.numel()``, a multiple of 8 from 8 to 65536, x's last dimension when x has two or more);
    ``eps`` a finite number >= 0; ``fp8_scale`` None or a finite number > 0, and then ``out`` an FP8
    (float8_e4m3fn / float8_e5m2) tensor of x's shape; ``out`` without a scale has x's dtype and
    shape."""
    dst = x if out is None else out
    dev = device if device is not None else getattr(x, "device", None)
    call = make_call(FUSED_NORM, rank, world, dev, x, dst, "sum", None, FusedArgs(residual, weight, eps, fp8_scale))
    return FusedCall(call, x, residual, weight, dst)


def reference_epilogue(summed: Any, fc: FusedCall) -> None:
    """The reference epilogue in torch (the numerics of :mod:`mscclang.sim.epilogue`):
    ``residual = round(residual + summed)``, then the norm into ``fc.dst``."""
    import torch

    res = fc.residual
    res.copy_((summed.to(torch.float32) + res.to(torch.float32)).to(res.dtype))
    rows = res.reshape(-1, fc.hidden)
    dst = fc.dst.reshape(-1, fc.hidden)
    if fc.quant:
        y = rms_norm_rows(rows, fc.weight, fc.eps, dst.dtype, act_dtype=res.dtype, scale=fc.scale,
                          fp8_max_value=float(torch.finfo(dst.dtype).max), ops=TorchOps())
    else:
        y = rms_norm_rows(rows, fc.weight, fc.eps, dst.dtype, ops=TorchOps())
    dst.copy_(y)


def planned(planner: Any, x: Any, residual: Any, weight: Any, eps: Any, out: Any, fp8_scale: Any) -> FusedCall:
    """The call's FusedCall from the memo of ``planner`` (a :class:`~mscclang.comm.planner.Planner`;
    checked and planned on a miss): keyed by the tensors' addresses, shapes and dtypes and the
    parameters (a tensor scale is read at every call: not memoised)."""
    dst = x if out is None else out
    key = None
    if not hasattr(fp8_scale, "item") and getattr(x, "is_contiguous", None) and x.is_contiguous():
        key = (FUSED_NORM, x.data_ptr(), dst.data_ptr(), residual.data_ptr(), getattr(weight, "data_ptr", id)(),
               tuple(x.shape), x.dtype, dst.dtype, tuple(getattr(weight, "shape", ())), eps, fp8_scale,
               dst.is_contiguous(), residual.is_contiguous())
        got = planner.memo.get(key)
        if got is not None:
            return got
    fc = check_call(x, residual, weight, eps, out, fp8_scale, planner.rank, planner.world_size, planner.device)
    be = planner.backend
    fc.reason = "no back end runs plans"
    inv, n = planner.selector.batch_invariant, planner.world_size
    if be is not None and not fc.call.empty:
        variant = select_fused(planner.selector.catalog, n, fc.shape(), inv)
        if variant is None and inv:
            variant = select_fused(planner.selector.generated(FUSED_NORM, n), n, fc.shape(), inv)
        fc.plan = variant.load() if variant is not None else None
        fc.reason = (f"no fused plan {'keeping it ' if inv else ''}for {n} ranks ({'FP8' if fc.quant else 'no FP8'}, "
                     f"{'in place' if fc.dst is fc.x else 'out of place'}) in the catalog"
                     + (" or the algorithm library" if inv else ""))
    if inv and fc.plan is None and not fc.call.empty:
        c = fc.call
        raise refusal(call_words("all_reduce_add_rms_norm", n, c.message_bytes, c.dtype.name),
                      fc.reason if be is not None else planner.runtime_error or fc.reason, planner.rank)
    if key is not None:
        planner.remember(key, fc)
    return fc
