"""Kernels: the interpreter's module cache, the plan-specialised kernels (built off the calling
thread), and the one check that a launch shape fits the device.

The interpreter is one module per dtype (prebuilt cubin, disk cache, or NVRTC), loaded once per
process. A specialised kernel belongs to one (plan, sizes, dtype, packet type, reduce op); it is
built by NVRTC on a background thread (NVRTC releases the GIL), so a call never waits for a
build: the interpreter serves it until the kernel is ready, and the next call of that size
switches (:mod:`mscclang.runtime.entries`). ``prepare`` builds at once, so a call captured in a
CUDA graph after it runs the specialised kernel. Loaded modules are bounded: beyond
``MAX_SPEC_MODULES`` the least recently used one no launch entry holds is unloaded.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mscclang.errors import PlanError, RuntimeUnavailable
from mscclang.plan.models import PacketType
from mscclang.runtime import cuda as cu
from mscclang.runtime.build import EPI_DTYPES, block_variant, build_module, find_prebuilt, kernel_name
from mscclang.runtime.spec_build import SpecBuilder
from mscclang.runtime.spec_source import SpecSource, SpecUnsupported
from mscclang.runtime.state import Spec

log = logging.getLogger("mscclang.runtime.kernels")

#: specialised modules kept loaded (each is one small cubin)
MAX_SPEC_MODULES = 512
#: specialised builds waiting at once; further requests are dropped (the interpreter runs them)
MAX_PENDING_BUILDS = 64


@dataclass(frozen=True, slots=True)
class Module:
    """A loaded specialised module and its kernel function."""

    module: Any
    func: Any


@dataclass(frozen=True, slots=True)
class Built:
    """A background build's result: the source, its ``cubin`` (None: the module was loaded
    already), where it came from, and the module the build thread ``loaded`` (None: the launching
    thread loads it)."""

    src: SpecSource
    cubin: Optional[bytes]
    origin: str
    loaded: Optional[Module] = None


class KernelCache:
    """The kernels of one executor on a device of ``arch`` with ``sm_count`` multiprocessors."""

    def __init__(self, arch: str, sm_count: int) -> None:
        self.arch = arch
        self.sm_count = sm_count
        self._modules: dict[str, Any] = {}
        self._funcs: dict[tuple, Any] = {}   # (dtype, packet, op, bound, traced) [+ (True,): epilogue]
        self._builder = SpecBuilder(arch)
        self._spec_mods: "OrderedDict[str, Module]" = OrderedDict()   # cubin name -> its loaded module
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending = 0
        self._futures: list = []
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Find and load NVRTC and the build modules on the calling thread (set-up time), so that
        background builds never import or search for libraries while a call runs. Without NVRTC,
        nothing: the builds fail later and the interpreter serves every call."""
        try:
            self._builder.warm()
        except SPEC_ERRORS as e:
            log.info("specialised kernels unavailable (%s); the interpreter serves every call", unsupported(e))

    # interpreter ------------------------------------------------------------------------------
    def has_interpreter(self, dtype: str, packet: str, op: str, nthreads: int, epi: bool = False) -> bool:
        """Whether that interpreter function is loaded already (no build, no load needed)."""
        return (dtype, packet, op, block_variant(nthreads), False) + ((True,) if epi else ()) in self._funcs

    def interpreter(self, dtype: str, packet: str, op: str, nthreads: int = 1024, traced: bool = False,
                    epi: bool = False) -> Any:
        """The interpreter function for one dtype, packet type, reduce op and block size
        (``traced``: its variant with per-op timestamps, from a module of its own, built by NVRTC
        at its first use; ``epi``: its epilogue variant, in the dtype's module, sum only)."""
        if epi and (traced or op != "sum" or dtype not in EPI_DTYPES):
            raise RuntimeUnavailable(f"the epilogue kernels run sum on {', '.join(EPI_DTYPES)} untraced; "
                                     f"not {op} on {dtype}" + (" traced" if traced else ""))
        key = (dtype, packet, op, block_variant(nthreads), traced) + ((True,) if epi else ())
        f = self._funcs.get(key)
        if f is not None:
            return f
        drv = cu.driver()
        mkey = dtype + ("_trace" if traced else "")
        mod = self._modules.get(mkey)
        if mod is None:
            pre = find_prebuilt(dtype, self.arch, traced)
            if pre is not None:
                err, m = drv.cuModuleLoadData(pre.read_bytes())
                mod = m if int(err) == 0 else None
            if mod is None:
                built = build_module(dtype, self.arch, traced=traced)
                mod = cu.check(drv.cuModuleLoadData(built.cubin), f"cuModuleLoadData({built.path.name})")
            self._modules[mkey] = mod
        f = cu.check(drv.cuModuleGetFunction(mod, kernel_name(dtype, packet, op, nthreads, traced, epi).encode()),
                     "cuModuleGetFunction")
        self._funcs[key] = f
        return f

    # the one fit check -----------------------------------------------------------------------
    def fit(self, func: Any, nthreads: int, smem: int, n_blocks: int, where: str,
            uses_packets: bool = False, packet_align: int = 16, packet: str = "ll16") -> None:
        """Raise PlanError unless a launch of ``n_blocks`` blocks of ``nthreads`` threads with
        ``smem`` bytes of dynamic shared memory can run: packet offsets aligned for the packet
        type, the shared-memory attribute set above 48 KiB, every block co-resident (cross-block
        waits need it). ``where`` names the rank (and call) in the message."""
        need = PacketType.of(packet).align
        if uses_packets and packet_align < need:
            raise PlanError(f"{where}: packet offsets at this size are only {packet_align}-byte aligned; "
                            f"{packet.upper()} needs {need} (raise buffer_alignment or use LL8)")
        drv = cu.driver()
        if smem > 48 * 1024:
            cu.check(drv.cuFuncSetAttribute(
                func, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                "cuFuncSetAttribute")
        per_sm = cu.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, nthreads, smem),
                          "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        if int(per_sm) * self.sm_count < n_blocks:
            raise PlanError(f"{where}: {n_blocks} thread blocks of {nthreads} threads cannot all be co-resident "
                            f"(at most {int(per_sm) * self.sm_count})")

    # specialised kernels -----------------------------------------------------------------------
    def specialised_now(self, src: SpecSource) -> Spec:
        """Build (or find) and load ``src`` on the calling thread (prepare). Raises
        SpecUnsupported, RuntimeUnavailable, PlanError or OSError when it cannot."""
        name = self._builder.name(src)
        loaded = self._spec_mods.get(name)
        origin = "loaded"
        if loaded is None:
            built = self._builder.get(src)
            origin = built.origin
            loaded = self._load(name, built.cubin, src)
        else:
            self._spec_mods.move_to_end(name)
        return self._spec(src, loaded.func, origin, name)

    def specialise_later(self, make_src: Callable[[], SpecSource]) -> Optional["concurrent.futures.Future[Any]"]:
        """Generate (``make_src()``) and build a specialised kernel on the background thread; the
        future's result is a :class:`Built`, taken by
        :meth:`finish` on the launching thread. None when too many builds wait already (the
        interpreter keeps running the call).
        The background thread also loads the module, in the calling thread's CUDA context."""
        with self._lock:
            if self._pending >= MAX_PENDING_BUILDS:
                return None
            self._pending += 1
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mscclang-spec-build")
        builder = self._builder
        loaded = self._spec_mods
        drv = cu.driver()
        ctx = cu.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")

        def job() -> Any:
            try:
                src = make_src()
                name = builder.name(src)
                if name in loaded:
                    return Built(src, None, "loaded")
                built = builder.get(src)
                # loaded here too, in the calling thread's context: loading a module on the
                # launching thread cost that thread milliseconds per build
                mod = None
                try:
                    cu.check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
                    mod = cu.check(drv.cuModuleLoadData(built.cubin), f"cuModuleLoadData({name})")
                    func = cu.check(drv.cuModuleGetFunction(mod, src.kernel.encode()), "cuModuleGetFunction")
                except Exception:  # noqa: BLE001 - the launching thread loads it instead
                    if mod is not None:
                        drv.cuModuleUnload(mod)
                    return Built(src, built.cubin, built.origin)
                return Built(src, built.cubin, built.origin, Module(mod, func))
            finally:
                with self._lock:
                    self._pending -= 1

        fut = self._pool.submit(job)
        self._futures = [f for f in self._futures if not f.done()] + [fut]
        return fut

    def wait_builds(self, timeout_s: float) -> bool:
        """Wait until every background build started so far has finished (or ``timeout_s``
        passed); whether they all did. For tests and measurements that must see the switch."""
        done, pending = concurrent.futures.wait(list(self._futures), timeout=timeout_s)
        return not pending

    def finish(self, fut: "concurrent.futures.Future[Any]") -> Spec:
        """Load a finished background build (on the launching thread). Raises what the build
        raised."""
        b = fut.result()
        src, mine = b.src, b.loaded
        name = self._builder.name(src)
        loaded = self._spec_mods.get(name)
        if loaded is not None:
            self._spec_mods.move_to_end(name)
            if mine is not None and mine.module is not loaded.module:
                cu.driver().cuModuleUnload(mine.module)   # two builds of one kernel: keep the first
            return self._spec(src, loaded.func, "loaded", name)
        if mine is not None:
            self._spec_mods[name] = mine
            return self._spec(src, mine.func, b.origin, name)
        cubin = b.cubin if b.cubin is not None else self._builder.get(src).cubin
        loaded = self._load(name, cubin, src)
        return self._spec(src, loaded.func, b.origin, name)

    def _load(self, name: str, cubin: bytes, src: SpecSource) -> Module:
        drv = cu.driver()
        mod = cu.check(drv.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        func = cu.check(drv.cuModuleGetFunction(mod, src.kernel.encode()), "cuModuleGetFunction")
        got = self._spec_mods[name] = Module(mod, func)
        return got

    def _spec(self, src: SpecSource, func: Any, origin: str, name: str) -> Spec:
        drv = cu.driver()
        per_sm = cu.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, src.nthreads, 0),
                          "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        if int(per_sm) * self.sm_count < src.n_blocks:
            raise SpecUnsupported(f"{src.n_blocks} blocks of the specialised kernel cannot be co-resident")
        return Spec(func, cu.ptr(func), src.n_blocks, src.nthreads, src.steps, origin, name, src.args)

    def trim(self, in_use: set[str]) -> int:
        """Unload the least recently used specialised modules beyond :data:`MAX_SPEC_MODULES`
        that no launch entry (``in_use``: their names) holds. The caller guarantees the device
        finished with them. Returns how many were unloaded."""
        drv = cu.driver()
        n = 0
        for name in list(self._spec_mods):
            if len(self._spec_mods) <= MAX_SPEC_MODULES:
                break
            if name in in_use:
                continue
            drv.cuModuleUnload(self._spec_mods.pop(name).module)
            n += 1
        return n

    def count(self) -> int:
        """Modules loaded (interpreter and specialised)."""
        return len(self._modules) + len(self._spec_mods)

    def close(self) -> None:
        """Unload every module (the device is idle) and stop the build thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        drv = cu.driver()
        for m in self._modules.values():
            drv.cuModuleUnload(m)
        self._modules.clear()
        for m in self._spec_mods.values():
            drv.cuModuleUnload(m.module)
        self._spec_mods.clear()
        self._funcs.clear()


def unsupported(e: BaseException) -> str:
    """The reason kept when a specialised kernel is not used."""
    return f"{type(e).__name__}: {e}"


SPEC_ERRORS = (SpecUnsupported, RuntimeUnavailable, PlanError, OSError)
