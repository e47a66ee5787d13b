"""The fused epilogue's side of the GPU runtime (``allreduce_add_rms_norm``, plan/2): which plans
need the epilogue kernels, the checks of an epilogue call, and the ``EpiArgs`` kernel parameter.

A plan holding ``radd`` or ``rmsnorm`` ops (or naming the residual ``r``) runs on the
interpreter's epilogue kernels (``executor/kernels.cu``, names ending in ``_epi``): the same
interpreter with one more parameter, :data:`~mscclang.runtime.structs.EPI_ARGS`, which carries
the call's residual and weight addresses and the execution parameters (:class:`Epilogue`), or on
a plan-specialised kernel whose parameters hold the same struct (written at every launch). Every
other plan runs on the kernels it always ran on (their code is unchanged). The residual and the weight are this rank's
own: no peer maps them (:func:`mscclang.runtime.device_plan.check_runnable` refuses plans whose
remote buffers name them), so they are never staged, registered or symmetric.

The numerics are the simulator's (:mod:`mscclang.sim.epilogue`), bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mscclang.errors import InvalidCall, PlanError
from mscclang.plan.dtypes import find_dtype, torch_dtype_info
from mscclang.plan.models import BufferKind, OpName, Plan
from mscclang.plan.shapes import check_layout, check_tensor, overlap
from mscclang.runtime.structs import CONSTANTS, EPI_ARGS

#: activation dtypes (runtime codes) the epilogue kernels are built for
ACT_CODES = ("f16", "bf16", "f32")
#: FP8 output types: canonical dtype name -> EpiArgs.quant code
FP8_CODES = {"float8_e4m3": CONSTANTS["EPI_Q_E4M3"], "float8_e5m2": CONSTANTS["EPI_Q_E5M2"]}
MAX_HIDDEN = CONSTANTS["EPI_MAX_HIDDEN"]
#: the oldest architecture whose cvt instruction makes FP8 (sm_89)
FP8_MIN_ARCH = 89


@dataclass(frozen=True)
class Epilogue:
    """The execution parameters of a plan's epilogue ops (not in the plan, like the message size).

    ``hidden``: the row length H (a multiple of 8, 8 <= H <= 65536, dividing the input's element
    count); ``eps``: added to the mean square, in fp32; ``scale``: the FP8 scale s (> 0, finite),
    required by plans whose ``rmsnorm`` ops say ``quant`` (output = FP8(y / s), saturating) and
    refused by the others; ``fp8``: the FP8 type, which must be the output tensor's dtype
    (``torch.float8_e4m3fn``, the default, or ``torch.float8_e5m2``; a dtype or its name)."""

    hidden: int
    eps: float = 1e-6
    scale: Optional[float] = None
    fp8: Any = None


@dataclass(frozen=True)
class EpiPlan:
    """What a loaded plan's epilogue needs: ``norm`` (it holds rmsnorm ops, which read the
    weight) and ``quant`` (its rmsnorms write FP8)."""

    norm: bool
    quant: bool


def epi_plan(plan: Plan) -> Optional[EpiPlan]:
    """The epilogue of ``plan`` (None: no epilogue op and no residual reference, the ordinary
    kernels run it). PlanError when its rmsnorms disagree on ``quant`` (one output dtype per
    call), naming the op."""
    found = False
    quant: set[bool] = set()
    for g in plan.gpus:
        for tb in g.threadblocks:
            for i, top in enumerate(tb.ops):
                for op in (top.ops or [top]):
                    if op.name in (OpName.radd, OpName.rmsnorm) or any(
                            r.type == BufferKind.residual for r in (*op.src_buff, *op.dst_buff)):
                        found = True
                    if op.name == OpName.rmsnorm:
                        quant.add(bool(op.quant))
                        if len(quant) > 1:
                            raise PlanError(f"rank {g.id} thread block {tb.id} op {i}: rmsnorm ops of one plan "
                                            "must all quantise or none (one output dtype per call)",
                                            f"gpus[{g.id}].threadblocks[{tb.id}].ops[{i}].quant")
    if not found:
        return None
    return EpiPlan(bool(quant), quant == {True})


def row_bytes(plan: Plan, rank: int, itemsize: int, params: Optional[Epilogue]) -> int:
    """The input row bytes of a call of a row-chunked plan (``chunk_unit`` ``"row"``: its chunks
    are whole rows, :func:`mscclang.plan.layout.make_layout`): the epilogue's hidden size times
    the activation's element size; 0 for every other plan. InvalidCall when such a plan gets no
    epilogue (its chunks cannot be cut without the row length)."""
    if plan.chunk_unit != "row":
        return 0
    h = getattr(params, "hidden", None)
    if not isinstance(params, Epilogue) or isinstance(h, bool) or not isinstance(h, int) or h <= 0:
        raise InvalidCall(f"rank {rank}: plan {plan.name} cuts its chunks at rows: pass epilogue=Epilogue(hidden=...) "
                          f"(got {params!r})")
    return h * itemsize


def _fp8_name(t: Any) -> Optional[str]:
    info = find_dtype(t) if isinstance(t, str) else torch_dtype_info(t)
    return info.name if info is not None and info.name in FP8_CODES else None


def call_sizes(ep: EpiPlan, plan: Plan, rank: int, device: Any, input: Any, output: Any) -> tuple[int, int]:
    """(input bytes, output bytes) of an epilogue call after checking the tensors (InvalidCall):
    on ``device``, contiguous, the activation dtype one of f16/bf16/f32, the output of the
    input's element count in the activation dtype (a quantising plan: an FP8 dtype, never in
    place), the plan's in-place rule on the activation's bytes."""
    check_tensor(input, "input", rank, device)
    check_tensor(output, "output", rank, device)
    info = torch_dtype_info(input.dtype)
    if info is None or info.code not in ACT_CODES:
        raise InvalidCall(f"rank {rank}: the activation dtype {input.dtype} is not supported by the epilogue; use "
                          "float16, bfloat16 or float32")
    n, esz = input.numel(), input.element_size()
    if output.numel() != n:
        raise InvalidCall(f"rank {rank}: the output has {output.numel()} elements, the input {n}; they must be equal")
    in_bytes, out_bytes = n * esz, n * output.element_size()
    if ep.quant:
        if _fp8_name(output.dtype) is None:
            raise InvalidCall(f"rank {rank}: plan {plan.name} quantises its output: the output must be "
                              f"float8_e4m3fn or float8_e5m2, got {output.dtype}")
        if plan.inplace:
            raise InvalidCall(f"rank {rank}: plan {plan.name} is in place, but a quantised output cannot be")
        if overlap(input.data_ptr(), in_bytes, output.data_ptr(), out_bytes):
            raise InvalidCall(f"rank {rank}: the FP8 output overlaps the input")
    else:
        if output.dtype != input.dtype:
            raise InvalidCall(f"rank {rank}: the output dtype {output.dtype} differs from the input's {input.dtype}")
        check_layout(plan.collective, rank, plan.inplace, plan.name, input.data_ptr(), in_bytes, output.data_ptr(),
                     out_bytes)
    if in_bytes == 0:
        raise InvalidCall(f"rank {rank}: {plan.collective} on empty tensors")
    return in_bytes, out_bytes


def pack_args(ep: EpiPlan, plan: Plan, rank: int, device: Any, arch: str, norms: list, input: Any, output: Any,
              residual: Any, weight: Any, params: Optional[Epilogue]) -> bytes:
    """The call's ``EpiArgs`` bytes, after checking (InvalidCall) the residual (the input's dtype
    and element count, on ``device``, overlapping neither the input nor the output), the weight
    (H elements of float32 or the activation dtype; a plan without rmsnorm takes none), the
    parameters (see :class:`Epilogue`), and (PlanError naming the op) that every rmsnorm record
    of ``norms`` (the packed rank's) covers whole rows and its output chunks are where those rows
    go (row k at k * H output elements; with FP8 the output's own chunk grid must agree, as the
    simulator requires). The tensors passed :func:`call_sizes`."""
    if not isinstance(params, Epilogue):
        raise InvalidCall(f"rank {rank}: plan {plan.name} has epilogue ops: pass epilogue=Epilogue(hidden=..., "
                          f"eps=...), got {type(params).__name__}")
    h = params.hidden
    if isinstance(h, bool) or not isinstance(h, int) or h % 8 or not 8 <= h <= MAX_HIDDEN:
        raise InvalidCall(f"rank {rank}: hidden size {h!r} must be a multiple of 8 from 8 to {MAX_HIDDEN}")
    n = input.numel()
    if n % h:
        raise InvalidCall(f"rank {rank}: hidden size {h} does not divide the input's {n} elements")
    eps = float(params.eps)
    if not math.isfinite(eps) or eps < 0:
        raise InvalidCall(f"rank {rank}: eps must be finite and not negative, got {params.eps!r}")
    if residual is None:
        raise InvalidCall(f"rank {rank}: plan {plan.name} has epilogue ops: pass residual=")
    check_tensor(residual, "residual", rank, device)
    if residual.dtype != input.dtype or residual.numel() != n:
        raise InvalidCall(f"rank {rank}: the residual must have the input's dtype {input.dtype} and {n} elements, "
                          f"got {residual.dtype} x {residual.numel()}")
    rb = n * input.element_size()
    for what, t in (("input", input), ("output", output)):
        if overlap(residual.data_ptr(), rb, t.data_ptr(), t.numel() * t.element_size()):
            raise InvalidCall(f"rank {rank}: the residual overlaps the {what}")
    wdt, wptr = CONSTANTS["EPI_W_F32"], 0
    if ep.norm:
        if weight is None:
            raise InvalidCall(f"rank {rank}: plan {plan.name} normalises: pass weight= ({h} elements)")
        check_tensor(weight, "weight", rank, device)
        if weight.numel() != h:
            raise InvalidCall(f"rank {rank}: the weight has {weight.numel()} elements; it must be one row of {h}")
        winfo = torch_dtype_info(weight.dtype)
        if winfo is None or winfo.code not in ("f32", torch_dtype_info(input.dtype).code):
            raise InvalidCall(f"rank {rank}: the weight dtype {weight.dtype} must be float32 or the activation's "
                              f"{input.dtype}")
        wdt = CONSTANTS["EPI_W_F32"] if winfo.code == "f32" else CONSTANTS["EPI_W_ACT"]
        wptr = weight.data_ptr()
    elif weight is not None:
        raise InvalidCall(f"rank {rank}: plan {plan.name} has no rmsnorm: it takes no weight")
    quant, scale = CONSTANTS["EPI_Q_NONE"], 0.0
    if ep.quant:
        s = params.scale
        if s is None or isinstance(s, bool) or not math.isfinite(float(s)) or float(s) <= 0:
            raise InvalidCall(f"rank {rank}: plan {plan.name} quantises its output: the fp8 scale must be positive "
                              f"and finite, got {s!r}")
        want = _fp8_name(params.fp8) if params.fp8 is not None else "float8_e4m3"
        if want is None:
            raise InvalidCall(f"rank {rank}: the fp8 type must be float8_e4m3fn or float8_e5m2, not {params.fp8!r}")
        if want != _fp8_name(output.dtype):
            raise InvalidCall(f"rank {rank}: the fp8 type {want} differs from the output's dtype {output.dtype}")
        if int(arch.removeprefix("sm_").rstrip("a")) < FP8_MIN_ARCH:
            raise InvalidCall(f"rank {rank}: FP8 output needs sm_{FP8_MIN_ARCH} or later; this device is {arch}")
        quant, scale = FP8_CODES[want], float(s)
    elif params.scale is not None:
        raise InvalidCall(f"rank {rank}: plan {plan.name} does not quantise (no rmsnorm says quant): it takes no "
                          "fp8 scale")
    row, orow = h * input.element_size(), h * output.element_size()
    for where, spans, got in norms:
        if not spans:
            continue
        a, b = spans[0][0], spans[-1][0] + spans[-1][1]
        if a % row or b % row or sum(ln for _, ln in spans) != b - a:
            raise PlanError(f"rank {rank}: rmsnorm covers bytes [{a}, {b}) of the residual, not whole rows of {h} "
                            f"elements ({row} bytes) at this size", where)
        if got != (a // row * orow, b // row * orow):
            raise PlanError(f"rank {rank}: rmsnorm's output chunks are bytes [{got[0]}, {got[1]}) but its rows "
                            f"belong at [{a // row * orow}, {b // row * orow}) of the {output.dtype} output", where)
    return EPI_ARGS.pack(residual=residual.data_ptr(), weight=wptr, hidden=h, wdt=wdt, quant=quant, eps=eps,
                         scale=scale)


def call_args(lp: Any, rank: int, device: Any, arch: str, norms: Callable[[], list], op: str, input: Any,
              output: Any, residual: Any, weight: Any, params: Optional[Epilogue]) -> bytes:
    """:func:`pack_args` for a call of the loaded plan ``lp`` (``Executor.execute``), reduced with
    ``op``; InvalidCall when the plan has no epilogue (then it takes none of these arguments) or
    the op is not sum. ``norms()``: the packed rank's rmsnorm spans at this size."""
    if lp.epi is None:
        raise InvalidCall(f"rank {rank}: plan {lp.plan.name} has no epilogue ops: it takes no residual, weight or "
                          "epilogue")
    if op != "sum":
        raise InvalidCall(f"rank {rank}: plan {lp.plan.name} has epilogue ops: it reduces with sum, not {op}")
    return pack_args(lp.epi, lp.plan, rank, device, arch, norms(), input, output, residual, weight, params)
