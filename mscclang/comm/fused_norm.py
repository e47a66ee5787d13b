"""``Communicator.all_reduce_add_rms_norm``: the fused allreduce + residual add + RMSNorm
(+ FP8 output) call, with vLLM's ``fused_add_rms_norm`` semantics.

``residual += allreduce(x)``, then ``x`` (or ``out``) gets ``RMSNorm(residual) * weight``, or its
FP8 quantisation with ``fp8_scale`` (``out`` then an FP8 tensor). The numerics are
:mod:`mscclang.sim.epilogue`'s. Every argument is checked (:func:`check_call`, InvalidCall naming
it) before anything runs. A catalog plan runs when one fits the shape
(:func:`mscclang.comm.selector.select_fused`); else
the call falls back to the library ``all_reduce`` plus the reference epilogue in torch (the same
numerics), logged once per reason. The simulator back end runs the plans (CPU CI); the GPU runtime
runs them through its ``execute_fused`` entry (:func:`run_on_backend`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from mscclang.comm.selector import FusedShape, select_fused
from mscclang.errors import InvalidCall
from mscclang.sim.epilogue import MAX_HIDDEN, MIN_HIDDEN, PARTIAL, TorchOps, rms_norm_rows


@dataclass(frozen=True)
class FusedCall:
    """A checked call: ``rows`` x ``hidden`` elements, ``dst`` the tensor the norm goes to,
    ``quant`` with an FP8 ``dst``."""

    x: Any
    residual: Any
    weight: Any
    eps: float
    dst: Any
    scale: Optional[float]
    rows: int
    hidden: int

    @property
    def quant(self) -> bool:
        return self.scale is not None

    @property
    def nbytes(self) -> int:
        return self.x.numel() * self.x.element_size()

    def shape(self) -> FusedShape:
        """What the selector needs (:func:`mscclang.comm.selector.select_fused`)."""
        return FusedShape(self.rows, self.hidden, self.nbytes, self.quant, self.dst is self.x)


def check_call(x: Any, residual: Any, weight: Any, eps: Any, out: Any = None,
               fp8_scale: Any = None) -> FusedCall:
    """Check every argument; InvalidCall naming the first bad one. ``x`` and ``residual`` are
    contiguous fp16/bf16/fp32 tensors of one shape, dtype and device; ``weight`` one row of H
    elements (fp32 or x's dtype; H = ``weight.numel()``, a multiple of 8 from 8 to 65536, equal to
    ``x.shape[-1]`` when x has 2 or more dimensions; a 1-D x is rows of H end to end, so H divides
    ``x.numel()``); ``eps`` a finite number >= 0; ``fp8_scale`` None or a finite number
    > 0, and then ``out`` an FP8 (float8_e4m3fn / float8_e5m2) tensor of x's shape; ``out``
    without a scale has x's dtype and shape."""
    import torch

    acts = (torch.float16, torch.bfloat16, torch.float32)
    fp8s = (torch.float8_e4m3fn, torch.float8_e5m2)
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise InvalidCall(f"all_reduce_add_rms_norm: {name} must be a torch tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise InvalidCall(f"all_reduce_add_rms_norm: {name} must be contiguous")
    if x.dtype not in acts:
        raise InvalidCall(f"all_reduce_add_rms_norm: x has dtype {x.dtype}; use float16, bfloat16 or float32")
    if residual.dtype != x.dtype:
        raise InvalidCall(f"all_reduce_add_rms_norm: residual has dtype {residual.dtype}, x {x.dtype} (they must match)")
    if residual.device != x.device:
        raise InvalidCall(f"all_reduce_add_rms_norm: residual is on {residual.device}, x on {x.device}")
    if residual.shape != x.shape:
        raise InvalidCall(f"all_reduce_add_rms_norm: residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}")
    if weight.dim() != 1:
        raise InvalidCall(f"all_reduce_add_rms_norm: weight must be one row (1-D), got shape {tuple(weight.shape)}")
    h = weight.numel()
    if x.dim() >= 2 and x.shape[-1] != h:   # what a torch or vLLM caller means by the hidden size
        raise InvalidCall(f"all_reduce_add_rms_norm: weight has {h} elements but x of shape {tuple(x.shape)} "
                          f"has a last dimension (the hidden size) of {x.shape[-1]}; they must be equal")
    if h % PARTIAL or not MIN_HIDDEN <= h <= MAX_HIDDEN:
        raise InvalidCall(f"all_reduce_add_rms_norm: the hidden size (weight length) {h} must be a multiple "
                          f"of {PARTIAL} from {MIN_HIDDEN} to {MAX_HIDDEN}")
    if x.numel() % h:
        raise InvalidCall(f"all_reduce_add_rms_norm: the hidden size {h} (weight length) does not divide x "
                          f"of shape {tuple(x.shape)}")
    if weight.dtype not in (torch.float32, x.dtype):
        raise InvalidCall(f"all_reduce_add_rms_norm: weight has dtype {weight.dtype}; use float32 or x's {x.dtype}")
    if weight.device != x.device:
        raise InvalidCall(f"all_reduce_add_rms_norm: weight is on {weight.device}, x on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise InvalidCall(f"all_reduce_add_rms_norm: eps must be a finite number >= 0, got {eps!r}")
    scale: Optional[float] = None
    if fp8_scale is not None:
        v = float(fp8_scale.item()) if isinstance(fp8_scale, torch.Tensor) else fp8_scale
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise InvalidCall(f"all_reduce_add_rms_norm: fp8_scale must be a finite number > 0, got {fp8_scale!r}")
        scale = float(v)
        if out is None:
            raise InvalidCall("all_reduce_add_rms_norm: with fp8_scale, pass out= (an FP8 tensor of x's shape)")
    if out is not None:
        if not isinstance(out, torch.Tensor) or not out.is_contiguous():
            raise InvalidCall("all_reduce_add_rms_norm: out must be a contiguous torch tensor")
        want = fp8s if scale is not None else (x.dtype,)
        if out.dtype not in want:
            raise InvalidCall(f"all_reduce_add_rms_norm: out has dtype {out.dtype}; "
                              + ("with fp8_scale it must be float8_e4m3fn or float8_e5m2" if scale is not None
                                 else f"without fp8_scale it must be x's {x.dtype}"))
        if out.shape != x.shape:
            raise InvalidCall(f"all_reduce_add_rms_norm: out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
        if out.device != x.device:
            raise InvalidCall(f"all_reduce_add_rms_norm: out is on {out.device}, x on {x.device}")
    return FusedCall(x, residual, weight, float(eps), x if out is None else out, scale, x.numel() // h, h)


def reference_epilogue(summed: Any, call: FusedCall) -> None:
    """The reference epilogue in torch (the numerics of :mod:`mscclang.sim.epilogue`):
    ``residual = round(residual + summed)``, then the norm into ``call.dst``."""
    import torch

    res = call.residual
    res.copy_((summed.to(torch.float32) + res.to(torch.float32)).to(res.dtype))
    rows = res.reshape(-1, call.hidden)
    dst = call.dst.reshape(-1, call.hidden)
    if call.quant:
        y = rms_norm_rows(rows, call.weight, call.eps, dst.dtype, act_dtype=res.dtype, scale=call.scale,
                          fp8_max_value=float(torch.finfo(dst.dtype).max), ops=TorchOps())
    else:
        y = rms_norm_rows(rows, call.weight, call.eps, dst.dtype, ops=TorchOps())
    dst.copy_(y)


def run_on_backend(backend: Any, plan: Any, call: FusedCall) -> bool:
    """Run ``plan`` for ``call`` through the back end's epilogue entry
    (:meth:`mscclang.comm.backend.Backend.execute_fused`: the simulator's, or the GPU runtime's
    ``Executor.execute(residual=, weight=, epilogue=)``); False when it has none."""
    return bool(backend.execute_fused(plan, call.x, call.dst, call.residual, call.weight, hidden=call.hidden,
                                      eps=call.eps, scale=call.scale, fp8=call.dst.dtype if call.quant else None))


def fused_call(comm: Any, x: Any, residual: Any, weight: Any, eps: Any, out: Any = None,
               fp8_scale: Any = None) -> Any:
    """The body of ``Communicator.all_reduce_add_rms_norm`` (see the module docstring);
    returns the tensor that holds the norm (``out``, or ``x``) and sets ``comm.last_fused`` to
    the plan that ran (None: the fallback ran)."""
    call = check_call(x, residual, weight, eps, out, fp8_scale)
    if x.numel() == 0:
        return call.dst
    be = comm.backend
    reason = "no back end runs plans"
    if be is not None:
        variant = select_fused(comm.catalog, comm.world_size, call.shape())
        reason = (f"no fused plan for {comm.world_size} ranks ({'FP8' if call.quant else 'no FP8'}, "
                  f"{'in place' if call.dst is call.x else 'out of place'}) in the catalog")
        if variant is not None:
            if run_on_backend(be, variant.load(), call):
                comm.last_fused = variant.load().name
                comm.plan_calls += 1
                return call.dst
            reason = "the back end has no fused entry (execute_fused)"
    comm.last_fused = None
    comm._note("all_reduce_add_rms_norm", f"mscclang rank {comm.rank}: all_reduce_add_rms_norm falls back to "
                                          f"all_reduce + the torch epilogue: {reason}")
    summed = x.clone()
    comm.all_reduce(summed)
    reference_epilogue(summed, call)
    return call.dst


def prepare_fused(comm: Any, x: Any, residual: Any, weight: Any, eps: Any, out: Any = None,
                  fp8_scale: Any = None) -> Optional[str]:
    """``Communicator.prepare_all_reduce_add_rms_norm``: check the call and do its setup (the
    fused plan's, or the fallback all_reduce's) outside a CUDA graph capture, so the same call
    can then be captured. Returns the fused plan's name, or None when the call will fall back."""
    call = check_call(x, residual, weight, eps, out, fp8_scale)
    be = comm.backend
    if be is None or x.numel() == 0:
        return None
    variant = select_fused(comm.catalog, comm.world_size, call.shape())
    if variant is not None:
        plan = variant.load()
        be.prepare(plan, call.x, call.dst, hidden=call.hidden)
        return plan.name
    comm.prepare("all_reduce", x)
    return None
