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

from dataclasses import dataclass
from typing import Any, Callable, Optional

from mscclang.errors import InvalidCall, PlanError
from mscclang.plan.dtypes import find_dtype, torch_dtype_info
from mscclang.plan.call import Call
from mscclang.plan.models import BufferKind, OpName, Plan
from mscclang.runtime.structs import CONSTANTS, EPI_ARGS

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


def _fp8_name(t: Any) -> Optional[str]:
    info = find_dtype(t) if isinstance(t, str) else torch_dtype_info(t)
    return info.name if info is not None and info.name in FP8_CODES else None


def pack_args(ep: EpiPlan, plan: Plan, call: Call, arch: str, norms: Callable[[], list]) -> bytes:
    """The ``EpiArgs`` bytes of a checked fused ``call`` (:func:`mscclang.plan.call.make_call`
    judged its tensors and parameters) of ``plan``, after matching the call with the plan
    (InvalidCall): a plan that normalises takes a weight and one that does not none, a quantising
    plan takes the FP8 scale (and the device must make FP8: sm_89 or later) and the others none;
    and (PlanError naming the op) that every rmsnorm record of ``norms()`` (the packed rank's
    at this size) covers whole rows whose output chunks are where those rows go (row k at k * H
    output elements)."""
    e, r = call.epi, call.rank
    if e is None:
        raise InvalidCall(f"rank {r}: plan {plan.name} has epilogue ops: pass residual=, weight= and "
                          "epilogue=Epilogue(hidden=..., eps=...)")
    h = e.hidden
    wdt = CONSTANTS["EPI_W_F32"]
    if ep.norm:
        if not e.weight_ptr:
            raise InvalidCall(f"rank {r}: plan {plan.name} normalises: pass weight= ({h} elements)")
        if e.weight_dtype != "float32":
            wdt = CONSTANTS["EPI_W_ACT"]
    elif e.weight_ptr:
        raise InvalidCall(f"rank {r}: plan {plan.name} has no rmsnorm: it takes no weight")
    quant, scale = CONSTANTS["EPI_Q_NONE"], 0.0
    if ep.quant:
        if not e.quant:
            raise InvalidCall(f"rank {r}: plan {plan.name} quantises its output: pass the fp8 scale and an FP8 "
                              "output")
        if int(arch.removeprefix("sm_").rstrip("a")) < FP8_MIN_ARCH:
            raise InvalidCall(f"rank {r}: FP8 output needs sm_{FP8_MIN_ARCH} or later; this device is {arch}")
        quant, scale = FP8_CODES[e.fp8], float(e.scale)   # type: ignore[index, arg-type]
    elif e.quant:
        raise InvalidCall(f"rank {r}: plan {plan.name} does not quantise (no rmsnorm says quant): it takes no "
                          "fp8 scale")
    row, orow = h * call.dtype.itemsize, h * (1 if e.quant else call.dtype.itemsize)
    for where, spans, got in norms():
        if not spans:
            continue
        a, b = spans[0][0], spans[-1][0] + spans[-1][1]
        if a % row or b % row or sum(ln for _, ln in spans) != b - a:
            raise PlanError(f"rank {r}: rmsnorm covers bytes [{a}, {b}) of the residual, not whole rows of {h} "
                            f"elements ({row} bytes) at this size", where)
        if got != (a // row * orow, b // row * orow):
            raise PlanError(f"rank {r}: rmsnorm's output chunks are bytes [{got[0]}, {got[1]}) but its rows "
                            f"belong at [{a // row * orow}, {b // row * orow}) of the output", where)
    return EPI_ARGS.pack(residual=e.residual_ptr, weight=e.weight_ptr, hidden=h, wdt=wdt, quant=quant, eps=e.eps,
                         scale=scale)
