"""``Communicator.all_reduce_add_rms_norm``: the fused allreduce + residual add + RMSNorm
(+ FP8 output) call, with vLLM's ``fused_add_rms_norm`` semantics.

``residual += allreduce(x)``, then ``x`` (or ``out``) gets ``RMSNorm(residual) * weight``, or its
FP8 quantisation with ``fp8_scale`` (``out`` then an FP8 tensor). The numerics are
:mod:`mscclang.sim.epilogue`'s. Every argument is checked (:func:`check_call`, InvalidCall naming
it) before anything runs. A shipped plan runs when one fits the shape (:func:`select_fused`); else
the call falls back to the library ``all_reduce`` plus the reference epilogue in torch (the same
numerics), logged once per reason. The simulator back end runs the plans (CPU CI); the GPU runtime
runs them through its ``execute_fused`` entry (:func:`run_on_backend`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from mscclang.errors import InvalidCall
from mscclang.plan.collectives import FUSED_NORM
from mscclang.sim.epilogue import MAX_HIDDEN, MIN_HIDDEN, PARTIAL, TorchOps, fp8_max, rms_norm_rows

#: the one-shot plans' largest message (bytes of x): above it the two-shot runs
ONESHOT_MAX_BYTES = 256 * 1024


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


def check_call(x: Any, residual: Any, weight: Any, eps: Any, out: Any = None,
               fp8_scale: Any = None) -> FusedCall:
    """Check every argument; InvalidCall naming the first bad one. ``x`` and ``residual`` are
    contiguous fp16/bf16/fp32 tensors of one shape, dtype and device; ``weight`` one row of H
    elements (fp32 or x's dtype; H = ``weight.numel()``, a multiple of 8 from 8 to 65536 that
    divides ``x.numel()``); ``eps`` a finite number >= 0; ``fp8_scale`` None or a finite number
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


def select_fused(entries: list[dict], ranks: int, call: FusedCall) -> Optional[dict]:
    """The shipped plan for ``call`` on ``ranks`` ranks (an index entry), or None: the one-shot up
    to :data:`ONESHOT_MAX_BYTES`, else the two-shot when its rows split evenly over the ranks
    (and, with FP8, each rank's FP8 rows fill 16-byte chunks), else the one-shot."""
    inplace = call.dst is call.x
    quant = call.quant

    def pick(algo: str) -> Optional[dict]:
        for e in entries:
            if (e.get("collective") == FUSED_NORM and e.get("algorithm") == algo and e.get("ranks") == ranks
                    and bool(e.get("inplace")) == inplace and ("quant" in e.get("file", "")) == quant):
                return e
        return None

    one, two = pick("allreduce_add_rms_norm_oneshot_ll"), pick("allreduce_add_rms_norm_twoshot_ll")
    even = call.rows % ranks == 0 and (not quant or (call.rows // ranks * call.hidden) % 16 == 0)
    if call.nbytes > ONESHOT_MAX_BYTES and even and two is not None:
        return two
    return one


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
    """Run ``plan`` for ``call`` through the back end's ``execute_fused`` entry (the simulator's
    :meth:`~mscclang.comm.sim_backend.SimBackend.execute_fused`; the GPU runtime provides the
    same entry, ``execute_fused(plan, x, out, residual, params)``). False when the back end has
    no such entry (the caller then falls back)."""
    from mscclang.sim.epilogue import EpilogueParams

    execute = getattr(backend, "execute_fused", None)
    if execute is None:
        return False
    import torch

    q = None
    if call.quant:
        q = np.dtype("float8_e5m2") if call.dst.dtype == torch.float8_e5m2 else None
        if q is None:
            import ml_dtypes

            q = np.dtype(ml_dtypes.float8_e4m3fn)
    from mscclang.comm.sim_backend import torch_to_numpy

    weight = torch_to_numpy(call.weight) if call.weight.device.type == "cpu" else call.weight
    params = EpilogueParams(call.hidden, weight if isinstance(weight, np.ndarray) else np.zeros(call.hidden),
                            call.eps, scale=call.scale, fp8=q)
    execute(plan, call.x, call.dst, call.residual, params)
    return True


def fused_call(comm: Any, x: Any, residual: Any, weight: Any, eps: Any, out: Any = None,
               fp8_scale: Any = None) -> Any:
    """The body of ``Communicator.all_reduce_add_rms_norm`` (see the module docstring);
    returns the tensor that holds the norm (``out``, or ``x``)."""
    call = check_call(x, residual, weight, eps, out, fp8_scale)
    if x.numel() == 0:
        return call.dst
    entry = None
    be = comm.backend
    reason = "no back end runs plans"
    if be is not None:
        from mscclang.algorithms.index import load_index

        entry = select_fused(load_index(), comm.world_size, call)
        reason = f"no shipped fused plan for {comm.world_size} ranks ({'fp8' if call.quant else 'no fp8'}, " \
                 f"{'in place' if call.dst is call.x else 'out of place'})"
    if entry is not None:
        from mscclang.algorithms.index import default_plans_dir
        from mscclang.plan.io import load_plan

        plan = load_plan(default_plans_dir() / entry["file"])
        if run_on_backend(be, plan, call):
            return call.dst
        reason = "the back end has no fused entry (execute_fused)"
    comm._note_fallback("all_reduce_add_rms_norm", reason)
    summed = x.clone()
    comm.all_reduce(summed)
    reference_epilogue(summed, call)
    return call.dst
