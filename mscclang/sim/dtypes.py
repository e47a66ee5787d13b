"""Data types the simulator supports and the reductions it performs on them.

Reductions follow ``docs/semantics.md``: ``dst = (((src0 OP src1) OP src2) ...)`` in the order
given; fp16, bf16 and fp8 compute every binary step in fp32 and round to the narrow type (round
to nearest even); fp32 in fp32; integer types wrap; min and max are exact.
"""

from __future__ import annotations

from typing import Sequence, Union

import ml_dtypes
import numpy as np

from mscclang.errors import VerificationError

_NAMES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "fp16": np.dtype(np.float16),
    "half": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "fp32": np.dtype(np.float32),
    "float": np.dtype(np.float32),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
    "uint8": np.dtype(np.uint8),
    "float8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}

#: dtypes rounded through fp32 at every reduction step
_NARROW_FLOATS = {np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
                  np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)}

DtypeLike = Union[str, np.dtype, type]


def parse_dtype(dt: DtypeLike) -> np.dtype:
    """Turn a name (``"fp16"``, ``"bfloat16"``, ...) or numpy dtype into a supported dtype."""
    if isinstance(dt, str):
        key = dt.lower()
        if key in _NAMES:
            return _NAMES[key]
        raise VerificationError(f"unsupported dtype {dt!r}; supported: {', '.join(sorted(_NAMES))}")
    d = np.dtype(dt)
    if d in _NAMES.values():
        return d
    raise VerificationError(f"unsupported dtype {d}; supported: {', '.join(sorted(_NAMES))}")


def dtype_name(dt: np.dtype) -> str:
    d = np.dtype(dt)
    if d == np.dtype(ml_dtypes.bfloat16):
        return "bfloat16"
    return str(d)


def is_float(dt: np.dtype) -> bool:
    return np.dtype(dt).kind == "f" or np.dtype(dt) in _NARROW_FLOATS


def unit_roundoff(dt: np.dtype) -> float:
    """Unit roundoff (half an ulp at 1.0) of a floating dtype; 0 for integers."""
    d = np.dtype(dt)
    if d == np.dtype(np.float32):
        return 2.0 ** -24
    if d == np.dtype(np.float16):
        return 2.0 ** -11
    if d == np.dtype(ml_dtypes.bfloat16):
        return 2.0 ** -8
    if d == np.dtype(ml_dtypes.float8_e4m3fn):
        return 2.0 ** -4
    if d == np.dtype(ml_dtypes.float8_e5m2):
        return 2.0 ** -3
    return 0.0


def _binary(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if op == "sum":
        return a + b
    if op == "min":
        return np.minimum(a, b)
    if op == "max":
        return np.maximum(a, b)
    raise VerificationError(f"unknown reduce op {op!r} (sum, min, max)")


def reduce_bytes(sources: Sequence[np.ndarray], dt: np.dtype, op: str) -> np.ndarray:
    """Reduce byte arrays (each holding elements of ``dt``) in order; returns a new byte array.

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
