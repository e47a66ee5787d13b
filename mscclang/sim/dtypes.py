"""Data types the simulator supports and the reductions it performs on them.

Reductions follow ``docs/semantics.md``: ``dst = (((src0 OP src1) OP src2) ...)`` in the order
given; fp16 and bf16 compute every binary step in fp32 and round to the narrow type (round to
nearest even); fp32 in fp32; integer types wrap; min and max are exact. fp8 (sum only) converts
every source to the accumulation dtype (float32 or float16), adds in order in that dtype, and
rounds the op's result once to fp8 (round to nearest even, saturating at the largest finite
value; NaN stays NaN).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from mscclang.errors import VerificationError
from mscclang.plan.dtypes import ACCUM_DTYPES, DTYPES, find_dtype, numpy_dtype_info
from mscclang.plan.reference import fp8_sum_arrays

#: every accepted spelling, for error messages
_SPELLINGS = sorted({k for d in DTYPES for k in (d.name, d.numpy.name, *d.aliases)})
#: dtypes rounded through fp32 at every reduction step
_NARROW_FLOATS = {d.numpy for d in DTYPES if d.narrow_float}
#: dtypes accumulated in an accumulation dtype and rounded once per op (fp8) -> largest finite
_ACCUMULATING = {d.numpy: d.max_finite for d in DTYPES if d.accumulates}

DtypeLike = Union[str, np.dtype, type]


def parse_dtype(dt: DtypeLike) -> np.dtype:
    """Turn a name (``"fp16"``, ``"bfloat16"``, ...; :mod:`mscclang.plan.dtypes`) or numpy dtype
    into a supported numpy dtype; :class:`~mscclang.errors.VerificationError` naming the
    supported ones for anything else."""
    if isinstance(dt, str):
        info = find_dtype(dt)
        if info is not None:
            return info.numpy
        raise VerificationError(f"unsupported dtype {dt!r}; supported: {', '.join(_SPELLINGS)}")
    d = np.dtype(dt)
    if numpy_dtype_info(d) is not None:
        return d
    raise VerificationError(f"unsupported dtype {d}; supported: {', '.join(_SPELLINGS)}")


def dtype_name(dt: np.dtype) -> str:
    """Canonical name (:mod:`mscclang.plan.dtypes`) of a numpy dtype; numpy's own name for one
    the table lacks."""
    info = numpy_dtype_info(dt)
    return info.name if info is not None else str(np.dtype(dt))


def is_float(dt: np.dtype) -> bool:
    return np.dtype(dt).kind == "f" or np.dtype(dt) in _NARROW_FLOATS or np.dtype(dt) in _ACCUMULATING


def accumulates(dt: np.dtype) -> bool:
    """Whether reductions of ``dt`` accumulate in an accumulation dtype (fp8; sum only)."""
    return np.dtype(dt) in _ACCUMULATING


def unit_roundoff(dt: np.dtype) -> float:
    """Unit roundoff (half an ulp at 1.0) of a floating dtype; 0 for integers."""
    info = numpy_dtype_info(dt)
    return info.unit_roundoff if info is not None else 0.0


def _binary(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if op == "sum":
        return a + b
    if op == "min":
        return np.minimum(a, b)
    if op == "max":
        return np.maximum(a, b)
    raise VerificationError(f"unknown reduce op {op!r} (sum, min, max)")


def reduce_bytes(sources: Sequence[np.ndarray], dt: np.dtype, op: str, accum: Optional[str] = None) -> np.ndarray:
    """Reduce byte arrays (each holding elements of ``dt``) in order; returns a new byte array.
    ``accum``: the accumulation dtype of an fp8 reduction (default float32; fp8 runs the sum
    only); ignored for other dtypes. One source is copied as it is (no conversion).

    A trailing partial element (only possible for packet payload padding) is copied from the
    first source."""
    first = sources[0]
    n = first.shape[0]
    isz = dt.itemsize
    ne = n // isz
    out = first.copy()
    if ne == 0 or len(sources) == 1:
        return out
    views = [np.ascontiguousarray(s[: ne * isz]).view(dt) for s in sources]
    if dt in _ACCUMULATING:
        if op != "sum":
            raise VerificationError(f"reduce op {op} is not defined on {dtype_name(dt)}; fp8 reduces with sum only")
        out[: ne * isz] = fp8_sum_arrays(views, dt, accum or ACCUM_DTYPES[0]).view(np.uint8)
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        if dt in _NARROW_FLOATS:
            acc = views[0]
            for v in views[1:]:
                acc = _binary(op, acc.astype(np.float32), v.astype(np.float32)).astype(dt)
        else:
            acc = views[0].copy()
            for v in views[1:]:
                acc = _binary(op, acc, v)
            acc = acc.astype(dt, copy=False)
    out[: ne * isz] = acc.view(np.uint8)
    return out
