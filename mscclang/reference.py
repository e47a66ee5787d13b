"""The canonical result of the reducing collectives, as torch functions on the CPU.

A batch-invariant plan computes, for every element, exactly the bits these functions return: the
ranks' contributions folded in rank order, left to right (``((x0 + x1) + x2) + ...``), rounded at
the points docs/semantics.md ("Batch invariance") states, whatever the message size, the plan or
the batch. Use them to check a kernel, a model or a test bit for bit against the contract::

    from mscclang import reference
    want = reference.all_reduce([x0, x1, x2, x3])      # every rank's input, rank order
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))   # bits, NaN too

Every function takes one tensor per rank, in rank order (a list or tuple, at least one), on any
device (they are read to the CPU and computed there, with numpy), and returns new CPU tensors. The
arguments are checked as the Communicator checks a call (:func:`mscclang.plan.call.make_call`):
one shape and one dtype mscclang runs for every rank's tensor, the reduce op the dtype reduces
with, fp8's accumulation dtype; the fused call's residual, weight, eps and FP8 scale. A bad
argument raises :class:`~mscclang.errors.InvalidCall` naming it (and the rank, for a per-rank
tensor). The arithmetic is :mod:`mscclang.plan.reference` (and :mod:`mscclang.sim.epilogue` for
the fused call's norm), the definitions the simulator and the GPU kernels are held to.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from mscclang.comm.sim_backend import numpy_to_torch, torch_to_numpy
from mscclang.errors import InvalidCall
from mscclang.plan import reference as _numeric
from mscclang.plan.call import FusedArgs, make_call, reduce_op_name
from mscclang.plan.collectives import FUSED_NORM
from mscclang.plan.dtypes import torch_dtype_info
from mscclang.sim.epilogue import EpilogueParams, fused_reference

__all__ = ["all_reduce", "reduce_scatter", "all_reduce_add_rms_norm"]

#: the reduce op torch.distributed's backend adds to the Communicator's (sum, then a division)
_AVG = "avg"


def _cpu(tensors: Any, what: str) -> list:
    """The ranks' tensors as contiguous CPU tensors, after checking there is a list of them."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise InvalidCall(f"{what}: pass one tensor per rank (a non-empty list), got {type(tensors).__name__}"
                          + (" of length 0" if isinstance(tensors, (list, tuple)) else ""))
    out = []
    for r, t in enumerate(tensors):
        if not hasattr(t, "detach") or not hasattr(t, "dtype"):
            raise InvalidCall(f"rank {r}: {what}: expected a torch tensor, got {type(t).__name__}")
        out.append(t.detach().to("cpu").contiguous())
    s, d = tuple(out[0].shape), out[0].dtype
    for r, t in enumerate(out[1:], 1):
        if tuple(t.shape) != s or t.dtype != d:
            raise InvalidCall(f"rank {r}: {what}: tensor of shape {tuple(t.shape)} and dtype {t.dtype}, but rank 0's "
                              f"has shape {s} and dtype {d}; every rank's must be alike")
    return out


def _op(op: Any) -> tuple[str, bool]:
    """(the reduce op the plans run, whether to average after it): ``avg`` sums, then divides."""
    name = op if isinstance(op, str) else getattr(op, "name", None) or str(op)
    if isinstance(name, str) and name.rsplit(".", 1)[-1].lower() == _AVG:
        return "sum", True
    try:
        return reduce_op_name(op), False
    except InvalidCall:
        raise InvalidCall(f"unsupported reduce op {op!r}; supported: sum, min, max, avg") from None


def _reduced(collective: str, api: str, tensors: Any, op: Any, accum_dtype: Any) -> tuple[Any, list]:
    """(rank 0's tensor on the CPU, every rank's canonical output as numpy) of a reducing
    collective (all_reduce: one output, the same for every rank)."""
    import torch

    xs = _cpu(tensors, api)
    n = len(xs)
    name, avg = _op(op)
    acc = None
    cpu = torch.device("cpu")
    if collective == "reducescatter" and xs[0].numel() % n:
        raise InvalidCall(f"{api}: {xs[0].numel()} elements per rank, not divisible by the {n} ranks")
    for r, x in enumerate(xs):
        out = x if collective == "allreduce" else torch.empty(x.numel() // n, dtype=x.dtype)
        acc = make_call(collective, r, n, cpu, x, out, name, accum_dtype, owner="reference").accum
    if avg and torch_dtype_info(xs[0].dtype).accumulates:
        raise InvalidCall(f"{api}: op avg is not defined on {xs[0].dtype} (fp8 reduces with sum only)")
    arrays = [torch_to_numpy(x) for x in xs]
    like = xs[0]
    del xs   # the numpy copies only, from here (large calls)
    outs = ([_numeric.reference_output(collective, arrays, 0, name, None, acc)] if collective == "allreduce"
            else _numeric.reference_outputs(collective, arrays, name, None, acc))
    return like, [_numeric.average(o, n) if avg else o for o in outs]


def all_reduce(tensors: Sequence[Any], op: Any = "sum", accum_dtype: Any = None) -> Any:
    """The canonical ``all_reduce`` of ``tensors`` (rank ``r``'s input at index ``r``): a CPU
    tensor of their shape and dtype, the output every rank gets.

    ``op`` is ``sum``, ``min``, ``max`` (any spelling the Communicator takes, torch's ``ReduceOp``
    included) or ``avg`` (torch.distributed's: the sum, then ``round(f32(sum) * f32(1/n))`` for
    floating point, as torch divides a CUDA tensor, truncated division for int32). Sums fold the
    ranks in rank order, left to right: float16 and bfloat16 compute each addition in float32 and
    round it to the dtype; float32 adds in float32; int32 wraps; min and max are exact. fp8
    (``float8_e4m3fn``, ``float8_e5m2``; sum only) converts every input to ``accum_dtype``
    (``torch.float32``, the default, or ``torch.float16``), adds in rank order in it and rounds
    once to fp8, saturating at the largest finite value. One rank: its input, unchanged."""
    like, outs = _reduced("allreduce", "all_reduce", tensors, op, accum_dtype)
    return numpy_to_torch(outs[0], like).reshape(like.shape)


def reduce_scatter(tensors: Sequence[Any], op: Any = "sum", accum_dtype: Any = None) -> list:
    """The canonical ``reduce_scatter`` of ``tensors`` (rank ``r``'s input at index ``r``, each
    of ``k * n`` elements for ``n`` ranks): a list of ``n`` 1-D CPU tensors, rank ``r``'s output
    at index ``r``: block ``r`` (elements ``r k .. r k + k - 1``) of every input reduced as
    :func:`all_reduce` reduces (the same ops, order and rounding). An element count that ``n``
    does not divide raises InvalidCall."""
    like, outs = _reduced("reducescatter", "reduce_scatter", tensors, op, accum_dtype)
    return [numpy_to_torch(o, like) for o in outs]


def all_reduce_add_rms_norm(tensors: Sequence[Any], residual: Any, weight: Any, eps: float = 1e-6,
                            fp8_scale: Optional[float] = None, out_dtype: Any = None) -> tuple[Any, Any]:
    """The canonical result of ``Communicator.all_reduce_add_rms_norm`` with ``tensors`` as the
    ranks' ``x`` (rank order) and one ``residual`` (the same on every rank, as tensor parallelism
    keeps it): ``(out, new_residual)``, CPU tensors of x's shape; every rank gets these bits.

    ``new_residual = round_A(f32(S) + f32(residual))`` with ``S`` the canonical sum of the ranks'
    x (:func:`all_reduce`, rank order, A the activation dtype: float16, bfloat16 or float32).
    ``out`` is the RMSNorm of each row of ``new_residual`` (rows of H = ``weight.numel()``
    elements, H a multiple of 8 from 8 to 65536 and x's last dimension when x has two or more)
    times ``weight`` (float32 or A), computed in float32 with every operation rounded once and
    the sum of squares in its fixed order (docs/semantics.md, "Epilogue ops"), rounded to A. With
    ``fp8_scale`` (> 0) ``out`` is that value times ``1/fp8_scale`` rounded to ``out_dtype``
    (``torch.float8_e4m3fn``, the default, or ``torch.float8_e5m2``), saturating. Row ``t``'s
    bits depend on row ``t`` of the inputs and the residual alone (not on the row count)."""
    import torch

    what = "all_reduce_add_rms_norm"
    xs = _cpu(tensors, what)
    if out_dtype is not None and fp8_scale is None:
        raise InvalidCall(f"{what}: out_dtype {out_dtype} applies with fp8_scale only (the output is x's dtype)")
    odt = xs[0].dtype if fp8_scale is None else (torch.float8_e4m3fn if out_dtype is None else out_dtype)
    oi = torch_dtype_info(odt)
    if oi is None or (fp8_scale is not None and not oi.accumulates):
        raise InvalidCall(f"{what}: out_dtype {out_dtype} is not an FP8 type; use torch.float8_e4m3fn or "
                          "torch.float8_e5m2")
    if not hasattr(residual, "detach") or not hasattr(weight, "detach"):
        raise InvalidCall(f"{what}: residual and weight must be torch tensors, got {type(residual).__name__} and "
                          f"{type(weight).__name__}")
    res, w = residual.detach().to("cpu").clone(), weight.detach().to("cpu").contiguous()
    cpu = torch.device("cpu")
    call = None
    for r, x in enumerate(xs):
        out = x if fp8_scale is None else torch.empty(x.shape, dtype=odt)
        call = make_call(FUSED_NORM, r, len(xs), cpu, x, out, "sum", None, FusedArgs(res, w, eps, fp8_scale),
                         owner="reference")
    epi = call.epi
    params = EpilogueParams(epi.hidden, torch_to_numpy(w), epi.eps, epi.scale,
                            torch_dtype_info(odt).numpy if epi.quant else None)
    new_res, out = fused_reference([torch_to_numpy(x) for x in xs], torch_to_numpy(res), params, epi.quant)
    like = torch.empty(0, dtype=odt)
    return numpy_to_torch(out, like).reshape(xs[0].shape), numpy_to_torch(new_res, xs[0]).reshape(xs[0].shape)
