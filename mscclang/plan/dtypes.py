"""The element types mscclang knows, one table: canonical name, short code, element size,
numpy/ml_dtypes type, torch dtype, aliases, and whether the GPU kernels run it.

Every other dtype list (the command line's, the communicator's, the simulator's, the GPU
runtime's) is derived from :data:`DTYPES`. torch and numpy are imported lazily, inside the
functions that need them, so this module imports with neither.

The short ``code`` (``f16``, ``bf16``, ``f32``, ``i32``, ``f8e4m3``, ``f8e5m2``) names the type in
the GPU runtime; the simulator also runs ``u32`` and ``u8``. The fp8 types reduce in an
*accumulation dtype* chosen per call (:data:`ACCUM_DTYPES`, float32 by default; the rule is in
``docs/semantics.md``): their kernel modules are one per (fp8 type, accumulation dtype), named by
:func:`kernel_code` (``f8e4m3_a32``, ``f8e4m3_a16``, ...), and they run the sum only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

from mscclang.errors import CommError, InvalidCall


@dataclass(frozen=True)
class DtypeInfo:
    """One element type. ``name`` is the canonical spelling (``float16``), ``code`` the short
    one the runtime uses (``f16``), ``itemsize`` the element size in bytes, ``numpy_name`` the
    numpy or ml_dtypes type (``"numpy.float16"``, ``"ml_dtypes.bfloat16"``; see :attr:`numpy`),
    ``torch_name`` the attribute of ``torch`` (``"float16"``), ``aliases`` the other accepted
    spellings (lower case), ``gpu`` whether the GPU kernels and the communicator run it,
    ``unit_roundoff`` half an ulp at 1.0 (0 for integers), ``narrow_float`` whether
    reductions compute each step in fp32 and round back (fp16, bf16), ``accumulates`` whether
    reductions accumulate in an accumulation dtype and round once per op, saturating (fp8), and
    ``max_finite`` the largest finite value (fp8: where a sum saturates)."""

    name: str
    code: str
    itemsize: int
    numpy_name: str
    torch_name: str
    aliases: tuple[str, ...]
    gpu: bool
    unit_roundoff: float = 0.0
    narrow_float: bool = False
    accumulates: bool = False
    max_finite: float = 0.0

    @cached_property
    def numpy(self) -> Any:
        """The numpy dtype (``numpy.dtype``) of this type."""
        import numpy as np

        module, attr = self.numpy_name.split(".")
        if module == "numpy":
            return np.dtype(getattr(np, attr))
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, attr))

    @cached_property
    def torch(self) -> Any:
        """The torch dtype of this type (imports torch)."""
        import torch

        return getattr(torch, self.torch_name)


#: every dtype (GPU ones before u32/u8, in this order the error messages list them) (in this order the error messages list them)
DTYPES: tuple[DtypeInfo, ...] = (
    DtypeInfo("float16", "f16", 2, "numpy.float16", "float16", ("fp16", "half", "f16"), True, 2.0 ** -11, True),
    DtypeInfo("bfloat16", "bf16", 2, "ml_dtypes.bfloat16", "bfloat16", ("bf16",), True, 2.0 ** -8, True),
    DtypeInfo("float32", "f32", 4, "numpy.float32", "float32", ("fp32", "float", "f32"), True, 2.0 ** -24),
    DtypeInfo("int32", "i32", 4, "numpy.int32", "int32", ("i32", "int"), True),
    DtypeInfo("uint32", "u32", 4, "numpy.uint32", "uint32", ("u32",), False),
    DtypeInfo("uint8", "u8", 1, "numpy.uint8", "uint8", ("u8",), False),
    DtypeInfo("float8_e4m3", "f8e4m3", 1, "ml_dtypes.float8_e4m3fn", "float8_e4m3fn",
              ("fp8_e4m3", "float8_e4m3fn", "e4m3"), True, 2.0 ** -4, False, True, 448.0),
    DtypeInfo("float8_e5m2", "f8e5m2", 1, "ml_dtypes.float8_e5m2", "float8_e5m2",
              ("fp8_e5m2", "e5m2"), True, 2.0 ** -3, False, True, 57344.0),
)

#: canonical names of the dtypes the GPU kernels, the communicator and the benchmark run
GPU_DTYPES: tuple[str, ...] = tuple(d.name for d in DTYPES if d.gpu)
#: canonical names of the dtypes the CPU simulator runs (all of them)
SIM_DTYPES: tuple[str, ...] = tuple(d.name for d in DTYPES)
#: the activation dtypes of the epilogue ops (the fused collective's x, residual and output)
EPILOGUE_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")
#: the accumulation dtypes of fp8 reductions, the default first
ACCUM_DTYPES: tuple[str, ...] = ("float32", "float16")
#: the reduce ops of dtypes that accumulate (fp8)
ACCUM_REDUCE_OPS: tuple[str, ...] = ("sum",)
#: alias -> canonical name
DTYPE_ALIASES: dict[str, str] = {a: d.name for d in DTYPES for a in d.aliases}

_BY_KEY: dict[str, DtypeInfo] = {}
for _d in DTYPES:
    for _k in (_d.name, _d.code, *_d.aliases):
        _BY_KEY.setdefault(_k, _d)
del _d, _k


def _or_list(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def find_dtype(spelling: object) -> Optional[DtypeInfo]:
    """The dtype a name, alias or code spells (case-insensitive; a ``torch.``, ``numpy.`` or
    ``np.`` prefix is ignored, so ``str(torch.float16)`` works), or ``None`` when it spells
    none."""
    key = str(spelling).strip().lower()
    for prefix in ("torch.", "numpy.", "np."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return _BY_KEY.get(key)


def dtype_by_code(code: str) -> DtypeInfo:
    """The dtype of a short code (``f16`` ...); ``ValueError`` naming the known codes for any
    other string."""
    for d in DTYPES:
        if d.code == code:
            return d
    raise ValueError(f"unknown dtype code {code!r}; known: {', '.join(d.code for d in DTYPES)}")


def numpy_dtype_info(dtype: Any) -> Optional[DtypeInfo]:
    """The entry of a numpy dtype (or anything ``numpy.dtype`` accepts), or ``None``."""
    import numpy as np

    d = np.dtype(dtype)
    for info in DTYPES:
        if info.numpy == d:
            return info
    return None


def torch_dtype_info(dtype: Any) -> Optional[DtypeInfo]:
    """The entry of a torch dtype, or ``None`` (also for objects that are not torch dtypes)."""
    import torch

    for info in DTYPES:
        if getattr(torch, info.torch_name, None) == dtype:
            return info
    return None


def torch_dtype_code(dtype: Any) -> str:
    """The runtime code (``f16``, ``bf16``, ``f32``, ``i32``, ``f8e4m3``, ``f8e5m2``) of a torch
    dtype the GPU kernels run; :class:`~mscclang.errors.InvalidCall` naming the supported dtypes
    for any other."""
    info = torch_dtype_info(dtype)
    if info is None or not info.gpu:
        raise InvalidCall(f"dtype {dtype} is not supported; use {_or_list(GPU_DTYPES)}")
    return info.code


def kernel_code(code: str, accum: Optional[str] = None) -> str:
    """The GPU kernel module's code of a dtype code and its (canonical) accumulation dtype:
    the dtype code itself, or ``<code>_a32`` / ``<code>_a16`` for fp8 (``f8e4m3_a32``). Every
    fp8 module moves bytes alike, so an fp8 call that does not reduce (``accum`` None: an
    all_gather, all_to_all, broadcast) runs on the default accumulation's module: no build holds
    a module of the bare fp8 code."""
    if accum is None:
        info = dtype_by_code(code)
        if not info.accumulates:
            return code
        accum = ACCUM_DTYPES[0]
    return f"{code}_a{8 * find_dtype(accum).itemsize}"  # type: ignore[union-attr]


def kernel_codes(info: DtypeInfo) -> tuple[str, ...]:
    """The kernel module codes of a GPU dtype: its code, or one per accumulation dtype (fp8)."""
    return tuple(kernel_code(info.code, a) for a in (ACCUM_DTYPES if info.accumulates else (None,)))


#: every GPU kernel module's code (fp8: one per accumulation dtype)
KERNEL_CODES: tuple[str, ...] = tuple(c for d in DTYPES if d.gpu for c in kernel_codes(d))


def kernel_dtype(kcode: str) -> DtypeInfo:
    """The element type of a kernel module's code (``f8e4m3_a16`` -> float8_e4m3)."""
    return dtype_by_code(kcode.split("_", 1)[0])


def reduction_code(dtype: Any, op: str = "sum", accum: object = None) -> str:
    """The kernel code of a call on ``dtype`` (a torch dtype) with reduce op ``op`` and
    accumulation dtype ``accum`` (:func:`check_reduction`); :class:`~mscclang.errors.InvalidCall`
    naming what the GPU does not run (the dtype, an fp8 min/max, a misplaced ``accum``)."""
    code = torch_dtype_code(dtype)
    return kernel_code(code, check_reduction(dtype_by_code(code), op, accum))


def check_reduction(info: DtypeInfo, op: str, accum: object = None) -> Optional[str]:
    """The canonical accumulation dtype of an ``op`` reduction of ``info`` elements: ``accum``
    (any spelling of float32 or float16, a torch dtype too) or, when None, float32 for the fp8
    types; None for types that do not accumulate. :class:`~mscclang.errors.InvalidCall` naming it
    for an ``accum`` given with a non-fp8 dtype, one that is not an accumulation dtype, or an op
    the type does not run (fp8: the sum only)."""
    if info.accumulates and op not in ACCUM_REDUCE_OPS:
        raise InvalidCall(f"reduce op {op} is not supported on {info.name} tensors; use {_or_list(ACCUM_REDUCE_OPS)}")
    if accum is None or not info.accumulates:
        if accum is not None:
            raise InvalidCall(f"accum_dtype={accum} applies to fp8 tensors only, not to {info.name}")
        return ACCUM_DTYPES[0] if info.accumulates else None
    a = find_dtype(accum)
    if a is None or a.name not in ACCUM_DTYPES:
        raise InvalidCall(f"accum_dtype={accum} is not an accumulation dtype; use {_or_list(ACCUM_DTYPES)}")
    return a.name


def dtype_info(spelling: object) -> DtypeInfo:
    """:func:`find_dtype`, raising ``ValueError`` naming the known dtypes when ``spelling``
    spells none."""
    info = find_dtype(spelling)
    if info is None:
        raise ValueError(f"unknown dtype {spelling!r}; known: {', '.join(SIM_DTYPES)}")
    return info


def gpu_dtype(spelling: object) -> DtypeInfo:
    """:func:`find_dtype` of a dtype the GPU runs (a torch or numpy dtype, a name, alias or
    code); :class:`~mscclang.errors.CommError` naming the supported ones for any other."""
    info = find_dtype(spelling)
    if info is None or not info.gpu:
        raise CommError(f"unsupported dtype {spelling}; supported: {', '.join(GPU_DTYPES)}")
    return info


def torch_dtype(spelling: str) -> Any:
    """The torch dtype of a name, alias or code (``"bf16"`` -> ``torch.bfloat16``); ``ValueError``
    naming the known dtypes for any other string."""
    return dtype_info(spelling).torch
