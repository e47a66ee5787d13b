"""Building, caching and choosing plan-specialised kernels (see :mod:`mscclang.runtime.spec_source`).

* Policy: ``$MSCCLANG_SPECIALIZE`` (or ``Executor(specialize=...)``) is ``auto`` (default),
  ``always`` (any size the generator accepts, built at its first call, on the calling thread) or
  ``never`` (the interpreter only). ``auto`` (:func:`when`; the builds run in the background while
  the interpreter serves the calls, see :mod:`mscclang.runtime.entries`): messages up to
  ``$MSCCLANG_SPEC_FIRST_BYTES`` (256 KiB) get their kernel from their second call; larger ones up
  to ``$MSCCLANG_SPEC_MAX_BYTES`` (64 MiB) at ``Executor.prepare()`` (``Communicator.prepare``,
  on the calling thread) or once the same (plan, sizes, dtype) has been called
  ``$MSCCLANG_SPEC_HOT_CALLS`` (3) times; a size called once costs no build; above that the
  interpreter runs (the kernels are bandwidth-bound there).
* Build: NVRTC to cubin for the device's arch (never PTX, ~1 s), never inside a CUDA graph
  capture. Looked up first in ``$MSCCLANG_CUBIN_DIR`` (files
  named by arch and source hash, written by :func:`prebuild` / ``mscclang build-kernel
  --plan``, so a machine without a usable NVRTC can run prebuilt kernels),
  then in the disk cache (``<cache_dir>/spec``, keyed by source hash, arch, options and NVRTC
  version), then compiled. Any failure leaves the interpreter in charge.
* Parameters: :func:`pack_args` fills the ``SpecArgs`` struct the kernel takes by value.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from mscclang.config import settings
from mscclang.errors import RuntimeUnavailable
from mscclang.runtime import build
from mscclang.runtime.device_plan import SYNC_ABORT_OFF, SYNC_FLAGS_OFF, Addresses, SyncLayout
from mscclang.runtime.spec_source import ArgsLayout, SpecSource, SpecUnsupported, generate


# Specialising up to 64 MiB halves the 1-4 MiB times on 2x H200 (notes/perf.md v5); each new
# (plan, size) costs one NVRTC build, so above 256 KiB only sizes that are prepared or called again
# get one (building every size at first use made the GPU suite outrun its time budget).
def when(mode: str, input_bytes: int, output_bytes: int) -> str:
    """When ``mode`` wants a specialised kernel at these sizes: 'first' (a small size: from its
    second call under 'auto', its first under 'always'), 'hot' (at ``prepare()`` or once called
    ``settings.spec_hot_calls`` times: calls of one (plan, sizes, dtype, packet, op)) or 'never'.
    Under 'auto', a size up to ``settings.spec_first_bytes`` (never above
    ``settings.spec_max_bytes``) is small; one up to ``settings.spec_max_bytes`` (input or output
    bytes) is hot; a larger one never."""
    if mode == "never":
        return "never"
    if mode == "always":
        return "first"
    n, top = max(input_bytes, output_bytes), settings.spec_max_bytes
    if n <= min(settings.spec_first_bytes, top):
        return "first"
    if n <= top:
        return "hot"
    return "never"


class _FilesHash:
    """Hash of the executor's CUDA sources (read once per builder)."""

    def __init__(self) -> None:
        self._h: Optional[str] = None

    def get(self) -> str:
        if self._h is None:
            self._h = build.source_hash()
        return self._h


def source_key(source: str, files_hash: str) -> str:
    """Hash of a generated source together with the headers it includes."""
    return hashlib.sha256((files_hash + "\n" + source).encode()).hexdigest()


def prebuilt_name(source: str, arch: str, files_hash: str) -> str:
    """File name of a prebuilt specialised cubin: arch and source hash (no NVRTC version, so a
    cubin built elsewhere is found)."""
    return f"mscclang_spec_{build.arch_string(arch)}_{source_key(source, files_hash)[:24]}.cubin"


@dataclass(frozen=True)
class BuiltSpec:
    """A specialised cubin and where it came from ('prebuilt', 'cache' or 'nvrtc')."""

    cubin: bytes
    origin: str
    name: str


class SpecBuilder:
    """Finds or compiles specialised cubins for one arch."""

    def __init__(self, arch: str = "sm_90") -> None:
        self.arch = build.arch_string(arch)
        self._files = _FilesHash()

    def name(self, spec: SpecSource) -> str:
        return prebuilt_name(spec.source, self.arch, self._files.get())

    def warm(self) -> None:
        """Hash the executor sources and load NVRTC now (RuntimeUnavailable without it)."""
        self._files.get()
        build.nvrtc_version()

    def get(self, spec: SpecSource, use_cache: bool = True) -> BuiltSpec:
        """The cubin of ``spec``: prebuilt, cached or compiled now (RuntimeUnavailable when NVRTC
        is missing or the compile fails)."""
        name = self.name(spec)
        d = settings.cubin_dir
        if d:
            p = Path(d) / name
            if p.is_file():
                return BuiltSpec(p.read_bytes(), "prebuilt", name)
        ver = build.nvrtc_version()
        cpath = build.cache_dir() / "spec" / name.replace(".cubin", f"_nvrtc{ver[0]}.{ver[1]}.cubin")
        if use_cache and cpath.is_file():
            return BuiltSpec(cpath.read_bytes(), "cache", name)
        cubin = build.compile_source(spec.source, self.arch, name=name.replace(".cubin", ".cu"))
        if use_cache:
            _write_atomic(cpath, cubin)
        return BuiltSpec(cubin, "nvrtc", name)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# kernel parameters


def pack_args(layout: ArgsLayout, addr: Addresses, sync: SyncLayout, rank: int) -> ctypes.Array:
    """The ``SpecArgs`` bytes as a ctypes u64 array; the per-launch words (input, output, deltas,
    timeout: indices 0-4) are written by the launcher."""
    words = [0] * (layout.size // 8)
    sb = addr.sync_base

    def put(name: str, v: int) -> None:
        words[layout.offset(name) // 8] = int(v)

    put("flags", sb + SYNC_FLAGS_OFF)
    put("abort_word", sb + SYNC_ABORT_OFF)
    put("err", addr.error_record)
    put("sems", sb + sync.semaphores)
    put("bars", sb + sync.barriers)
    put("scratch", addr.scratch_base)
    put("half", addr.scratch_half)
    if (len(addr.peer_abort) != layout.n_peers or len(addr.remote) != layout.n_remote
            or len(addr.channels) != layout.n_channels):
        raise RuntimeUnavailable("internal: specialised kernel parameters do not match the device plan's tables")
    put("rank_npeers", (rank & 0xFFFFFFFF) | (len(addr.peer_abort) << 32))
    for i, p in enumerate(addr.peer_abort):
        words[layout.peer_abort // 8 + i] = int(p)
    for i, (base, _kind) in enumerate(addr.remote):
        words[layout.remote // 8 + i] = int(base)
    for i, (a, b, c) in enumerate(addr.channels):
        o = layout.chan // 8 + 3 * i
        words[o:o + 3] = [int(a), int(b), int(c)]
    return (ctypes.c_uint64 * len(words))(*words)


# --------------------------------------------------------------------------------------------
# prebuilding (no GPU needed)


def prebuild(plan, sizes: Sequence[tuple[int, int]], dtypes: Sequence[str], packets: Sequence[str],
             reduce_ops: Sequence[str], out_dir: Path, arch: str = "sm_90",
             ranks: Optional[Sequence[int]] = None, nthreads: Optional[int] = None) -> list[tuple[str, str]]:
    """Compile the specialised kernels of ``plan`` for every rank (or ``ranks``), size (input,
    output bytes), dtype ('f16'...), packet type and reduce op into ``out_dir`` (the directory
    ``$MSCCLANG_CUBIN_DIR`` names on the GPU machine). Returns (label, file or reason) pairs;
    combinations the generator refuses are reported, not raised."""
    from mscclang.runtime.packing import pack_blocks

    b = SpecBuilder(arch)
    out_dir.mkdir(parents=True, exist_ok=True)
    done: list[tuple[str, str]] = []
    for r in (ranks if ranks is not None else range(plan.world_size)):
        for ib, ob in sizes:
            packed = pack_blocks(plan, r, ib, ob)
            for dt in dtypes:
                for pk in packets:
                    for op in reduce_ops:
                        label = f"{plan.name} rank {r} {ib}/{ob} B {dt} {pk} {op}"
                        try:
                            spec = generate(plan, packed, dt, pk, op, nthreads)
                        except SpecUnsupported as e:
                            done.append((label, f"not specialised: {e}"))
                            continue
                        name = b.name(spec)
                        path = out_dir / name
                        if not path.is_file():
                            _write_atomic(path, b.get(spec).cubin)
                        done.append((label, name))
    return done
