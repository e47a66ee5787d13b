"""The numerics of the fused epilogue (residual add, RMSNorm, FP8 quantisation): the definition.

``docs/semantics.md`` ("Epilogue ops") states them; this module is them, vectorised over rows.
Every fp32 operation is one IEEE round-to-nearest-even operation (no fused multiply-add): numpy's
float32 arithmetic, ``sqrt`` and division are correctly rounded, and so are torch's on the CPU
and (with the default precise division and square root) on CUDA, so the same code run on torch
tensors gives the same bits (:func:`rms_norm_rows` takes either through :class:`ArrayOps`).

For one row ``v`` of H fp32 values (the residual after the add, widened from the activation
dtype A):

1. G = H/8 partials: ``p_g = ((((0 + v0*v0) + v1*v1) + ...) + v7*v7)`` over elements 8g..8g+7;
2. a tree over P = the smallest power of two >= G (zero padded): for stride P/2, P/4, .., 1,
   ``q_j = q_j + q_{j+stride}``; the total is ``q_0``;
3. ``inv = 1 / sqrt(total / H + eps)``;
4. ``y_i = round_A((v_i * inv) * w_i)``;
5. with quant: ``Q(clamp(y_i * (1 / s), -maxQ, maxQ))`` (NaN stays NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from mscclang.errors import PlanError
from mscclang.plan.dtypes import EPILOGUE_DTYPES, dtype_info

#: hidden sizes the epilogue takes: multiples of 8 in this range
MIN_HIDDEN = 8
MAX_HIDDEN = 65536
#: elements per partial sum of squares (one 16-byte vector of a 16-bit activation)
PARTIAL = 8


def fp8_max(q: np.dtype) -> float:
    """The largest finite value of the FP8 type ``q`` (448 for e4m3fn, 57344 for e5m2)."""
    import ml_dtypes

    return float(ml_dtypes.finfo(q).max)


#: the activation dtypes of the epilogue
ACT_NUMPY = tuple(dtype_info(n).numpy for n in EPILOGUE_DTYPES)


def _as_dtype(q: Any) -> Optional[np.dtype]:
    """``q`` (a dtype, or a name of the dtype table) as a numpy dtype, None when it is neither."""
    if isinstance(q, str):
        try:
            return dtype_info(q).numpy
        except ValueError:
            return None
    try:
        return np.dtype(q)
    except TypeError:
        return None


def check_hidden(h: object) -> None:
    """The hidden-size rule (PlanError otherwise): an int, a multiple of :data:`PARTIAL` from
    :data:`MIN_HIDDEN` to :data:`MAX_HIDDEN`; checked before anything of that size is built."""
    if isinstance(h, bool) or not isinstance(h, int) or h % PARTIAL or not MIN_HIDDEN <= h <= MAX_HIDDEN:
        raise PlanError(f"hidden size {h!r} must be a multiple of {PARTIAL} from {MIN_HIDDEN} to {MAX_HIDDEN}")


@dataclass(frozen=True)
class EpilogueParams:
    """The execution parameters of the epilogue ops (not in the plan, like the message size).

    ``hidden`` is the row length H (a multiple of 8, 8..65536), ``weight`` the H weights (fp32
    or the activation dtype), ``eps`` the fp32 epsilon; ``scale`` (> 0) turns on the FP8 output
    of ``rmsnorm`` ops that say ``quant``, in ``fp8`` (float8_e4m3fn by default or float8_e5m2).
    """

    hidden: int
    weight: np.ndarray
    eps: float = 1e-6
    scale: Optional[float] = None
    fp8: Any = None

    def __post_init__(self) -> None:
        h = self.hidden
        check_hidden(h)
        w = np.asarray(self.weight)
        if w.ndim != 1 or w.shape[0] != h:
            raise PlanError(f"the weight must be one row of {h} elements, got shape {tuple(w.shape)}")
        if w.dtype not in (np.dtype(np.float32), *ACT_NUMPY):
            raise PlanError(f"the weight's dtype must be float32 or the activation's, got {w.dtype}")
        e = self.eps
        if isinstance(e, bool) or not isinstance(e, (int, float, np.floating)) or not np.isfinite(e) or e < 0:
            raise PlanError(f"eps must be a finite number >= 0, got {e!r}")
        s = self.scale
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float, np.floating))
                              or not (np.isfinite(s) and s > 0)):
            raise PlanError(f"the fp8 scale must be positive and finite, got {s!r}")
        fp8s = (dtype_info("float8_e4m3").numpy, dtype_info("float8_e5m2").numpy)
        q = self.fp8
        if q is None:
            object.__setattr__(self, "fp8", fp8s[0])
        elif _as_dtype(q) not in fp8s:
            raise PlanError(f"the fp8 output type must be float8_e4m3fn or float8_e5m2, not {q!r}")
        else:
            object.__setattr__(self, "fp8", _as_dtype(q))

    def check_activation(self, act: np.dtype) -> None:
        """The activation dtype is float16, bfloat16 or float32 and the weight is float32 or of
        it (PlanError naming them; docs/semantics.md, "Epilogue ops")."""
        if np.dtype(act) not in ACT_NUMPY:
            raise PlanError(f"the activation dtype {np.dtype(act)} is not one the epilogue takes: float16, "
                            "bfloat16 or float32")
        w = np.asarray(self.weight).dtype
        if w not in (np.dtype(np.float32), np.dtype(act)):
            raise PlanError(f"the weight's dtype {w} is neither float32 nor the activation's {np.dtype(act)}")

    @property
    def quant(self) -> bool:
        """Whether a ``quant`` rmsnorm has its scale."""
        return self.scale is not None

    def out_dtype(self, act: np.dtype, quant: bool) -> np.dtype:
        """The dtype an rmsnorm writes: the FP8 type with ``quant``, else the activation's."""
        return np.dtype(self.fp8) if quant else np.dtype(act)


class ArrayOps:
    """The few array operations the numerics need, for numpy arrays (this class) or torch
    tensors (:class:`TorchOps`); every one is a single correctly rounded operation."""

    def f32(self, x: Any) -> Any:
        return np.asarray(x).astype(np.float32)

    def cast(self, x: Any, dt: Any) -> Any:
        return x.astype(dt)

    def zeros(self, like: Any, shape: tuple[int, ...]) -> Any:
        return np.zeros(shape, dtype=np.float32)

    def scalar(self, like: Any, value: float) -> Any:
        return np.float32(value)

    def sqrt(self, x: Any) -> Any:
        return np.sqrt(x)

    def clamp(self, x: Any, lo: float, hi: float) -> Any:
        return np.clip(x, np.float32(lo), np.float32(hi))

    def concat(self, xs: list) -> Any:
        return np.concatenate(xs, axis=1)


class TorchOps(ArrayOps):
    """:class:`ArrayOps` for torch tensors (the Communicator's reference epilogue)."""

    def f32(self, x: Any) -> Any:
        import torch

        return x.to(torch.float32)

    def cast(self, x: Any, dt: Any) -> Any:
        return x.to(dt)

    def zeros(self, like: Any, shape: tuple[int, ...]) -> Any:
        import torch

        return torch.zeros(shape, dtype=torch.float32, device=like.device)

    def scalar(self, like: Any, value: float) -> Any:
        # a Python number: torch rounds it to the fp32 tensor's type and runs no host-to-device
        # copy (so the epilogue can be captured in a CUDA graph)
        return float(np.float32(value))

    def sqrt(self, x: Any) -> Any:
        return x.sqrt()

    def clamp(self, x: Any, lo: float, hi: float) -> Any:
        return x.clamp(float(np.float32(lo)), float(np.float32(hi)))

    def concat(self, xs: list) -> Any:
        import torch

        return torch.cat(xs, dim=1)


NUMPY = ArrayOps()


def sum_of_squares(v: Any, ops: ArrayOps = NUMPY) -> Any:
    """The fp32 sum of squares of every row of ``v`` (fp32, shape ``(rows, H)``) in the defined
    order: partials of 8 in order, then the power-of-two tree. Returns shape ``(rows,)``."""
    rows, h = v.shape
    g = h // PARTIAL
    sq = (v * v).reshape(rows, g, PARTIAL)
    p = ops.zeros(v, (rows, g))
    for k in range(PARTIAL):
        p = p + sq[:, :, k]
    width = 1 << (g - 1).bit_length()
    if width > g:
        p = ops.concat([p, ops.zeros(v, (rows, width - g))])
    while width > 1:
        width //= 2
        p = p[:, :width] + p[:, width: 2 * width]
    return p[:, 0]


def inv_rms(total: Any, hidden: int, eps: float, ops: ArrayOps = NUMPY) -> Any:
    """``1 / sqrt(total / H + eps)`` with each step correctly rounded in fp32."""
    mean = total / ops.scalar(total, float(hidden))
    return ops.scalar(total, 1.0) / ops.sqrt(mean + ops.scalar(total, float(np.float32(eps))))


def rms_norm_rows(rows: Any, weight: Any, eps: float, out_dtype: Any, *, act_dtype: Any = None,
                  scale: Optional[float] = None, fp8_max_value: float = 0.0,
                  ops: ArrayOps = NUMPY) -> Any:
    """The rmsnorm of ``rows`` (shape ``(rows, H)``, the activation dtype): ``out_dtype``
    elements of the same shape. Without ``scale`` ``out_dtype`` is the activation dtype; with it
    the FP8 type whose largest finite value is ``fp8_max_value``."""
    v = ops.f32(rows)
    inv = inv_rms(sum_of_squares(v, ops), v.shape[1], eps, ops)
    act = rows.dtype if act_dtype is None else act_dtype
    y = ops.cast((v * inv[:, None]) * ops.f32(weight)[None, :], act)
    if scale is None:
        return y
    sinv = float(np.float32(1.0) / np.float32(scale))  # once, in fp32
    return ops.cast(ops.clamp(ops.f32(y) * ops.scalar(v, sinv), -fp8_max_value, fp8_max_value), out_dtype)


def residual_add(src: np.ndarray, res: np.ndarray) -> np.ndarray:
    """``round_A(f32(src) + f32(res))`` elementwise (A the dtype of ``res``)."""
    return (src.astype(np.float32) + res.astype(np.float32)).astype(res.dtype)


def norm(rows: np.ndarray, params: EpilogueParams, quant: bool = False) -> np.ndarray:
    """:func:`rms_norm_rows` of numpy ``rows`` with ``params`` (quantised when ``quant``, which
    needs ``params.scale``)."""
    if quant and params.scale is None:
        raise PlanError("an rmsnorm with quant needs the fp8 scale (an execution parameter)")
    q = np.dtype(params.fp8)
    return rms_norm_rows(rows, params.weight, params.eps, params.out_dtype(rows.dtype, quant),
                         scale=params.scale if quant else None,
                         fp8_max_value=fp8_max(q) if quant else 0.0)


def fused_reference(inputs: list[np.ndarray], residual: np.ndarray, params: EpilogueParams,
                    quant: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(residual_out, output) of ``allreduce_add_rms_norm`` with the sum in rank order
    (``((x0 + x1) + x2) ...``, each step through fp32 and rounded to A, as the library
    allreduce's reductions are): flat arrays of the activation dtype."""
    acc = inputs[0]
    for x in inputs[1:]:
        acc = residual_add(x, acc)
    res = residual_add(acc, residual)
    out = norm(res.reshape(-1, params.hidden), params, quant).reshape(-1)
    return res, out
