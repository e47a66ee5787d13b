"""NVRTC build of the interpreter kernel into cubin (machine code for one arch, never PTX JIT),
with a disk cache keyed by source hash, arch, options and NVRTC version.

The kernel sources live in ``executor/`` (a checkout) or ``mscclang/_executor`` (an installed
wheel). One module is built per kernel dtype code (:data:`DTYPES`: the GPU dtypes, fp8 once per
accumulation dtype); it holds the (packet type x reduce op x block-size bound) kernels (fp8: the
sum only).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from mscclang.config import settings
from mscclang.errors import RuntimeUnavailable
from mscclang.plan.dtypes import EPILOGUE_DTYPES, KERNEL_CODES, dtype_info, kernel_dtype
from mscclang.plan.models import REDUCE_OP_NAMES, PacketType

_log = logging.getLogger("mscclang.runtime")

#: kernel dtype codes the kernels are built for (:data:`mscclang.plan.dtypes.KERNEL_CODES`)
DTYPES = KERNEL_CODES
#: dtypes whose modules also hold the epilogue kernels (activation dtypes of fused plans)
EPI_DTYPES = tuple(dtype_info(d).code for d in EPILOGUE_DTYPES)
_DT_MACRO = {c: f"DT_{c.upper()}" for c in DTYPES}
BASE_OPTIONS = ("-std=c++17", "--fmad=false")


#: the oldest arch with the hardware fp8 conversions the fp8 modules use
FP8_MIN_ARCH = 89


def module_kernels(dtype: str) -> int:
    """How many kernels (per block-size bound) the module of kernel code ``dtype`` holds: every
    packet type x reduce op, fp8 the sum only."""
    return len(PacketType) * (1 if kernel_dtype(dtype).accumulates else len(REDUCE_OP_NAMES))


BLOCK_VARIANTS = (1024, 512)  # __launch_bounds__ of the kernel variants (kernels.cu)


def block_variant(nthreads: int) -> int:
    """The smallest kernel variant bound that fits ``nthreads`` threads per block (fewer threads
    allowed per block leave more registers per thread)."""
    if not 1 <= nthreads <= BLOCK_VARIANTS[0]:
        raise RuntimeUnavailable(f"{nthreads} threads per block: the kernel supports 1..{BLOCK_VARIANTS[0]}")
    return min(v for v in BLOCK_VARIANTS if v >= nthreads)


def kernel_name(dtype: str, packet: str, op: str, nthreads: int = 1024, traced: bool = False,
                epi: bool = False) -> str:
    """Name of one specialised kernel, e.g. ``mscclang_f16_ll16_sum`` (1024-thread bound) or
    ``mscclang_f16_ll16_sum_t512`` (plans of at most 512 threads per block); ``traced``: its
    variant with per-op timestamps (``..._trace``, one more parameter: the trace buffer); ``epi``:
    its epilogue variant (``..._epi``, sum only, one more parameter: the call's ``EpiArgs``)."""
    v = block_variant(nthreads)
    return (f"mscclang_{dtype}_{packet}_{op}" + ("" if v == BLOCK_VARIANTS[0] else f"_t{v}")
            + ("_trace" if traced else "") + ("_epi" if epi else ""))


def executor_dir() -> Path:
    """Directory of the CUDA sources: ``<repo>/executor`` in a checkout; in an installed wheel
    ``<prefix>/share/mscclang/executor`` (or ``mscclang/_executor``); ``MSCCLANG_EXECUTOR_DIR``
    overrides."""
    env = settings.executor_dir
    cands = [Path(env)] if env else []
    here = Path(__file__).resolve().parent.parent  # mscclang/
    cands += [here / "_executor", here.parent / "executor",
              Path(sys.prefix) / "share" / "mscclang" / "executor"]  # wheel data files
    for c in cands:
        if (c / "kernels.cu").is_file():
            return c
    raise RuntimeUnavailable(
        "cannot find the executor's CUDA sources (kernels.cu) in " + ", ".join(str(c) for c in cands))


def source_files() -> list[Path]:
    d = executor_dir()
    return sorted(list(d.glob("*.cu")) + list(d.glob("*.cuh")))


def source_hash(extra: str = "") -> str:
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(extra.encode())
    return h.hexdigest()


def cache_dir() -> Path:
    d = settings.cache_dir
    if d:
        return Path(d)
    xdg = settings.xdg_cache_home
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mscclang"


_NVRTC_READY = False


def _nvrtc_loads() -> bool:
    """Whether ``cuda.bindings.nvrtc`` finds a working libnvrtc."""
    try:
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()
        return int(err) == 0
    except (ImportError, RuntimeError, OSError):
        return False


def _ensure_nvrtc() -> None:
    """Make sure ``cuda.bindings.nvrtc`` can load libnvrtc: if the default lookup fails, preload
    a libnvrtc.so* found in site-packages/nvidia/** or /usr/local/cuda*/lib64."""
    global _NVRTC_READY
    if _NVRTC_READY or _nvrtc_loads():
        _NVRTC_READY = True
        return
    pats = [os.path.join(p, "nvidia", "**", "libnvrtc.so*") for p in sys.path]
    pats += ["/usr/local/cuda*/lib64/libnvrtc.so*", "/usr/lib/x86_64-linux-gnu/libnvrtc.so*"]
    for pat in pats:
        for lib in sorted(glob.glob(pat, recursive=True), reverse=True):
            if "builtins" in os.path.basename(lib) or "alt" in os.path.basename(lib):
                continue
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            if _nvrtc_loads():
                _NVRTC_READY = True
                return
    raise RuntimeUnavailable("NVRTC is not available: install cuda-python and nvidia-cuda-nvrtc "
                             "(pip) or a CUDA toolkit")


def nvrtc_version() -> tuple[int, int]:
    _ensure_nvrtc()
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


def _check(err, prog=None, what: str = "nvrtc") -> None:
    from cuda.bindings import nvrtc

    if int(err) == 0:
        return
    log = ""
    if prog is not None:
        e2, n = nvrtc.nvrtcGetProgramLogSize(prog)
        if int(e2) == 0 and n > 1:
            buf = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, buf)
            log = buf.decode(errors="replace")
    raise RuntimeUnavailable(f"{what} failed ({err}):\n{log}")


@dataclass(frozen=True)
class BuiltModule:
    """A cubin with the kernels of one dtype."""

    dtype: str
    arch: str
    cubin: bytes
    path: Path
    cached: bool
    traced: bool = False


def arch_string(arch: str | int | tuple[int, int]) -> str:
    """Normalise ``'sm_90'``, ``'90'``, ``90`` or ``(9, 0)`` to ``'sm_90'``."""
    if isinstance(arch, tuple):
        return f"sm_{arch[0]}{arch[1]}"
    s = str(arch)
    return s if s.startswith("sm_") else f"sm_{s}"


def compile_source(source: str, arch: str, options: Sequence[str] = (), name: str = "mscclang.cu",
                   include_dir: Optional[Path] = None) -> bytes:
    """Compile CUDA C++ ``source`` with NVRTC to a cubin for ``arch``; raise RuntimeUnavailable
    with the compiler log on failure."""
    _ensure_nvrtc()
    from cuda.bindings import nvrtc

    inc = include_dir or executor_dir()
    opts = [f"-arch={arch_string(arch)}", f"-I{inc}", *BASE_OPTIONS, *options]
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(err)
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _check(err, prog, f"NVRTC compile of {name} for {arch_string(arch)}")
        err, n = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, prog)
        buf = b" " * n
        err, = nvrtc.nvrtcGetCUBIN(prog, buf)
        _check(err, prog)
        return bytes(buf)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def module_source(dtype: str, traced: bool = False) -> str:
    """Source of the module holding the kernels of ``dtype`` (``traced``: their traced variants,
    a module of their own, so the untraced one is the same with or without tracing)."""
    if dtype not in DTYPES:
        raise RuntimeUnavailable(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    which = "MSCCLANG_KERNELS_SUM_DT" if kernel_dtype(dtype).accumulates else "MSCCLANG_KERNELS_DT"
    epi = "" if traced or dtype not in EPI_DTYPES else f"MSCCLANG_EPI_KERNELS_DT({dtype}, {_DT_MACRO[dtype]})\n"
    return (("#define MSCCLANG_TRACED\n" if traced else "") + "#define MSCCLANG_ONLY_DTYPE\n#include \"kernels.cu\"\n"
            f"{which}({dtype}, {_DT_MACRO[dtype]})\n" + epi)


def build_module(dtype: str, arch: str | int | tuple[int, int] = "sm_90", options: Sequence[str] = (),
                 use_cache: bool = True, traced: bool = False) -> BuiltModule:
    """Build (or load from the disk cache) the cubin of ``dtype``'s kernels for ``arch``
    (``traced``: their traced variants)."""
    arch = arch_string(arch)
    src = module_source(dtype, traced)
    ver = nvrtc_version()
    key = hashlib.sha256(
        "|".join([source_hash(src), arch, " ".join(BASE_OPTIONS + tuple(options)), f"{ver[0]}.{ver[1]}"]).encode()
    ).hexdigest()[:32]
    path = cache_dir() / f"mscclang_{dtype}{'_trace' if traced else ''}_{arch}_{key}.cubin"
    if use_cache and path.is_file():
        return BuiltModule(dtype, arch, path.read_bytes(), path, True, traced)
    cubin = compile_source(src, arch, options, name=f"mscclang_{dtype}.cu")
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    return BuiltModule(dtype, arch, cubin, path, False, traced)


def prebuilt_name(dtype: str, arch: str, traced: bool = False) -> str:
    """File name of a prebuilt cubin (``mscclang build-kernel --out DIR``, ``--traced`` for the
    traced variants): keyed by dtype, arch and the sources' hash, so a stale file is never picked
    up."""
    kind = f"{dtype}_trace" if traced else dtype
    return f"mscclang_{kind}_{arch_string(arch)}_{source_hash(module_source(dtype, traced))[:16]}.cubin"


def find_prebuilt(dtype: str, arch: str, traced: bool = False) -> Optional[Path]:
    """A prebuilt cubin from ``MSCCLANG_CUBIN_DIR`` matching the current sources, if any. When the
    directory is set but holds none for these sources (e.g. built from other sources), a warning
    names the file expected and those present: the caller then builds with NVRTC, which takes
    tens of seconds per dtype. Traced modules are optional there: none is no warning."""
    d = settings.cubin_dir
    if not d:
        return None
    name = prebuilt_name(dtype, arch, traced)
    p = Path(d) / name
    if p.is_file():
        return p
    kind = f"{dtype}_trace" if traced else dtype
    others = sorted(q.name for q in Path(d).glob(f"mscclang_{kind}_{arch_string(arch)}_*.cubin"))
    if traced and not others:
        return None
    _log.warning("MSCCLANG_CUBIN_DIR=%s has no %s for the current executor sources (%s); building %s with "
                 "NVRTC instead (run `python3 -m mscclang build-kernel --out %s` to refresh)",
                 d, name, "stale: " + ", ".join(others) if others else "none for this dtype and arch", dtype, d)
    return None


def build_all(arch: str | int | tuple[int, int] = "sm_90", dtypes: Sequence[str] = DTYPES,
              use_cache: bool = True, jobs: int = 1) -> list[BuiltModule]:
    """Build every variant (all dtypes) for ``arch``; ``jobs`` > 1 compiles dtypes in parallel
    processes."""
    if jobs <= 1 or len(dtypes) <= 1:
        return [build_module(d, arch, use_cache=use_cache) for d in dtypes]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as ex:
        futs = [ex.submit(build_module, d, arch, (), use_cache) for d in dtypes]
        return [f.result() for f in futs]
