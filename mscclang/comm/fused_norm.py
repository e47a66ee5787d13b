"""``Communicator.all_reduce_add_rms_norm``: the fused allreduce + residual add + RMSNorm
(+ FP8 output) call, with vLLM's ``fused_add_rms_norm`` semantics.

``residual += allreduce(x)``, then ``x`` (or ``out``) gets ``RMSNorm(residual) * weight``, or its
FP8 quantisation with ``fp8_scale`` (``out`` then an FP8 tensor). The numerics are
:mod:`mscclang.sim.epilogue`'s. Every argument is checked once, by
:func:`mscclang.plan.call.make_call` (InvalidCall naming it), before anything runs. The call goes
through the planner's memo like every other call (:meth:`mscclang.comm.planner.Planner.lookup`),
and :class:`mscclang.comm.launch.Launch` runs it: a repeated call (the same tensors and
parameters) launches what the engine resolved the first time. A catalog plan runs when one fits
the shape (:func:`mscclang.comm.selector.select_fused`); else the call falls back to the
library ``all_reduce`` plus the reference epilogue in torch (the same numerics), logged once per
reason; in the batch-invariant mode only plans that keep the contract run (generated from the
library where the catalog has none) and a call none serves raises
:class:`~mscclang.comm.errors.BatchInvariantError` instead of falling back.
"""

from __future__ import annotations

from typing import Any

from mscclang.plan.call import Call, EpiCall, FusedArgs, make_call
from mscclang.plan.collectives import FUSED_NORM
from mscclang.sim.epilogue import TorchOps, rms_norm_rows


def check_call(x: Any, residual: Any, weight: Any, eps: Any, out: Any = None, fp8_scale: Any = None,
               rank: int = 0, world: int = 1, device: Any = None) -> Call:
    """The checked call (:func:`mscclang.plan.call.make_call` with the fused arguments; InvalidCall
    naming the first bad one): ``x`` and ``residual`` contiguous fp16/bf16/fp32 tensors of one
    shape, dtype and device; ``weight`` one row of H elements (fp32 or x's dtype; H =
    ``weight.numel()``, a multiple of 8 from 8 to 65536, x's last dimension when x has two or more);
    ``eps`` a finite number >= 0; ``fp8_scale`` None or a finite number > 0, and then ``out`` an FP8
    (float8_e4m3fn / float8_e5m2) tensor of x's shape; ``out`` without a scale has x's dtype and
    shape."""
    dst = x if out is None else out
    dev = device if device is not None else getattr(x, "device", None)
    return make_call(FUSED_NORM, rank, world, dev, x, dst, "sum", None, FusedArgs(residual, weight, eps, fp8_scale))


def reference_epilogue(summed: Any, residual: Any, weight: Any, dst: Any, epi: EpiCall) -> None:
    """The reference epilogue in torch (the numerics of :mod:`mscclang.sim.epilogue`):
    ``residual = round(residual + summed)``, then the norm into ``dst``; ``epi`` is the checked
    call's fused part (row length, eps, FP8 scale)."""
    import torch

    residual.copy_((summed.to(torch.float32) + residual.to(torch.float32)).to(residual.dtype))
    rows = residual.reshape(-1, epi.hidden)
    out = dst.reshape(-1, epi.hidden)
    if epi.quant:
        y = rms_norm_rows(rows, weight, epi.eps, out.dtype, act_dtype=residual.dtype, scale=epi.scale,
                          fp8_max_value=float(torch.finfo(out.dtype).max), ops=TorchOps())
    else:
        y = rms_norm_rows(rows, weight, epi.eps, out.dtype, ops=TorchOps())
    out.copy_(y)
