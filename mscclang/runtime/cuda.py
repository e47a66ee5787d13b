"""Thin helpers over ``cuda.bindings.driver``: error checking, memory, IPC handles."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

from mscclang.errors import RuntimeUnavailable


def driver() -> Any:
    try:
        from cuda.bindings import driver as drv
    except ImportError as e:  # pragma: no cover - cuda-python is a dependency
        raise RuntimeUnavailable(f"cuda-python is not installed: {e}") from None
    return drv


def check(result: Any, what: str = "CUDA driver call") -> Any:
    """Unwrap a cuda.bindings result tuple, raising RuntimeUnavailable on error."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if int(err) != 0:
        drv = driver()
        name = ""
        try:
            e2, s = drv.cuGetErrorName(err)
            name = s.decode() if int(e2) == 0 else ""
        except Exception:  # noqa: BLE001 - best effort message
            pass
        raise RuntimeUnavailable(f"{what} failed: {name or err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def ptr(x: Any) -> int:
    """Integer address of a CUdeviceptr / CUstream / int."""
    if isinstance(x, int):
        return x
    try:
        return int(x)
    except TypeError:
        return int(x.getPtr())


def mem_alloc(nbytes: int) -> int:
    drv = driver()
    return ptr(check(drv.cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes})"))


def mem_free(p: int) -> None:
    drv = driver()
    check(drv.cuMemFree(p), "cuMemFree")


def memset_d8(p: int, value: int, nbytes: int, stream: int = 0) -> None:
    drv = driver()
    if nbytes:
        check(drv.cuMemsetD8Async(p, value, nbytes, stream), "cuMemsetD8Async")


def memset_d32(p: int, value: int, count: int, stream: int = 0) -> None:
    drv = driver()
    if count:
        check(drv.cuMemsetD32Async(p, value, count, stream), "cuMemsetD32Async")


def htod(p: int, data: bytes, stream: int = 0) -> None:
    drv = driver()
    if data:
        check(drv.cuMemcpyHtoDAsync(p, data, len(data), stream), "cuMemcpyHtoDAsync")


def dtoh(src: int, nbytes: int, stream: int = 0) -> bytes:
    """``nbytes`` of device memory at ``src``, after the work queued on ``stream`` (synchronised)."""
    drv = driver()
    buf = bytearray(nbytes)
    if nbytes:
        check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
        check(drv.cuMemcpyDtoH(buf, src, nbytes), "cuMemcpyDtoH")
    return bytes(buf)


def dtod(dst: int, src: int, nbytes: int, stream: int = 0) -> None:
    drv = driver()
    if nbytes:
        check(drv.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def address_range(p: int) -> tuple[int, int]:
    """(base, size) of the allocation holding device address ``p``."""
    drv = driver()
    base, size = check(drv.cuMemGetAddressRange(p), "cuMemGetAddressRange")
    return ptr(base), int(size)


def buffer_id(p: int) -> int:
    """The allocation's unique id (CU_POINTER_ATTRIBUTE_BUFFER_ID), stable across address reuse."""
    drv = driver()
    v = check(drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID, p),
              "cuPointerGetAttribute(BUFFER_ID)")
    return int(v)


def ipc_capable(p: int) -> bool:
    """Whether the allocation holding ``p`` can be exported through legacy CUDA IPC
    (``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``): false for cuMem (VMM) allocations such as
    torch's expandable segments. A driver that does not know the attribute answers True (the
    export itself then decides)."""
    drv = driver()
    attr = getattr(drv.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE", None)
    if attr is None:
        return True
    err, v = drv.cuPointerGetAttribute(attr, p)
    if int(err) != 0:
        return True
    return bool(int(v))


def ipc_handle(base: int) -> bytes:
    """The 64 bytes of the IPC handle of the allocation at ``base``."""
    drv = driver()
    h = check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    return ctypes.string_at(h.getPtr(), 64)


def ipc_open(handle: bytes) -> int:
    drv = driver()
    h = drv.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), handle, 64)
    flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    return ptr(check(drv.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))


def ipc_close(p: int) -> None:
    drv = driver()
    check(drv.cuIpcCloseMemHandle(p), "cuIpcCloseMemHandle")


def host_alloc_mapped(nbytes: int) -> tuple[int, int]:
    """Pinned host memory mapped into the device: (host address, device address)."""
    drv = driver()
    flags = drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE
    h = check(drv.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc")
    hp = int(h)
    ctypes.memset(hp, 0, nbytes)
    d = check(drv.cuMemHostGetDevicePointer(hp, 0), "cuMemHostGetDevicePointer")
    return hp, ptr(d)


def host_free(hp: int) -> None:
    drv = driver()
    check(drv.cuMemFreeHost(hp), "cuMemFreeHost")


def stream_is_capturing(stream: int) -> bool:
    drv = driver()
    st = check(drv.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
    return int(st) != int(drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


def device_attribute(dev: int, attr_name: str) -> int:
    drv = driver()
    attr = getattr(drv.CUdevice_attribute, attr_name)
    return int(check(drv.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({attr_name})"))


def raw_launch_kernel() -> Any:
    """``cuLaunchKernel`` of the process's libcuda through ctypes (about a microsecond per call
    less than the cuda.bindings wrapper), or None when libcuda cannot be opened that way. It has
    no ``argtypes`` (converting eleven arguments through them cost 0.7 us a call on a 2-core CPU):
    call it as ``f(function, gx, gy, gz, bx, by, bz, smem, stream, params, None)`` with the
    function handle, the stream and the parameter block's address as ``ctypes.c_void_p`` (a
    plain int would pass as a 32-bit C int) and the counts as ints below 2**31; it returns the
    CUresult as an int."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernel
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


class PointerArgs:
    """Pointer arguments (``ctypes.c_void_p``) of raw addresses and handles for ctypes calls
    without argtypes, made once per address: the hot path reads ``known.get(address)`` (no Python
    frame) and calls :meth:`make` on a miss. At most ``limit`` are kept (then all are forgotten
    together: they are values, never stale)."""

    def __init__(self, limit: int = 4096) -> None:
        self.known: dict[int, ctypes.c_void_p] = {}
        self.limit = limit

    def make(self, address: int) -> ctypes.c_void_p:
        """The argument of ``address``, kept for the next call."""
        if len(self.known) >= self.limit:
            self.known.clear()
        p = self.known[address] = ctypes.c_void_p(address)
        return p


def raw_current_stream() -> Any:
    """torch's getter of the current raw CUDA stream for a device index (no Stream object built),
    or None when this torch does not have it."""
    try:
        import torch

        fn = torch._C._cuda_getCurrentRawStream
    except (ImportError, AttributeError):
        return None
    return fn


_CAPTURE_IMPLICIT = 906  # CUDA_ERROR_STREAM_CAPTURE_IMPLICIT


def raw_stream_is_capturing() -> Any:
    """``f(stream) -> bool``: whether ``stream`` is capturing a CUDA graph, through libcuda's
    ``cuStreamIsCapturing`` over ctypes (a fraction of a microsecond), falling back to the
    cuda.bindings wrapper when libcuda cannot be opened that way."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuStreamIsCapturing
    except (OSError, AttributeError):
        return stream_is_capturing
    fn.restype = ctypes.c_int   # no argtypes: the stream goes as a c_void_p (raw_launch_kernel)
    status = ctypes.c_int(0)
    ref = ctypes.byref(status)
    args = PointerArgs()
    known = args.known

    def capturing(stream: int) -> bool:
        st = known.get(stream)
        err = fn(args.make(stream) if st is None else st, ref)
        if err == _CAPTURE_IMPLICIT:   # the legacy stream while another stream captures globally
            return True
        if err:
            check(err, "cuStreamIsCapturing")
        return status.value != 0

    return capturing


class _Memcpy2D(ctypes.Structure):
    """The driver's ``CUDA_MEMCPY2D``."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


_MEMORYTYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE


def copier(c: Any) -> Callable[[int], None]:
    """``f(stream)``: enqueue the device copy ``c`` (a :class:`mscclang.plan.call.Copy`) on
    ``stream``, its arguments built once here: libcuda's ``cuMemcpyDtoDAsync`` or (several rows)
    ``cuMemcpy2DAsync`` through ctypes (a fraction of a microsecond per call), or one :func:`dtod`
    per row when libcuda cannot be opened that way. Capturable in a CUDA graph."""
    rows = [(c.dst + r * c.dst_pitch, c.src + r * c.src_pitch) for r in range(c.rows if c.width else 0)]
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        flat, two = lib.cuMemcpyDtoDAsync_v2, lib.cuMemcpy2DAsync_v2
    except (OSError, AttributeError):
        def each_row(s: int) -> None:
            for dst, src in rows:
                dtod(dst, src, c.width, s)

        return each_row
    # no argtypes (raw_launch_kernel): every argument but the stream is converted here, once
    flat.restype = two.restype = ctypes.c_int
    streams = PointerArgs(64)
    known = streams.known
    if len(rows) <= 1:
        args = [(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(c.width)) for dst, src in rows]

        def run_flat(s: int) -> None:
            st = known.get(s)
            st = streams.make(s) if st is None else st
            for dst, src, n in args:
                err = flat(dst, src, n, st)
                if err:
                    check(err, "cuMemcpyDtoDAsync")

        return run_flat
    m = _Memcpy2D(srcMemoryType=_MEMORYTYPE_DEVICE, srcDevice=c.src, srcPitch=c.src_pitch,
                  dstMemoryType=_MEMORYTYPE_DEVICE, dstDevice=c.dst, dstPitch=c.dst_pitch, WidthInBytes=c.width,
                  Height=c.rows)
    ref = ctypes.byref(m)

    def run_2d(s: int) -> None:
        st = known.get(s)
        err = two(ref, streams.make(s) if st is None else st)
        if err:
            check(err, "cuMemcpy2DAsync")

    return run_2d   # ``ref`` keeps the struct alive


@dataclass(frozen=True)
class AllocInfo:
    """The allocation holding a device address: base, size, unique id, and whether legacy CUDA
    IPC can export it (``why`` says why not)."""

    base: int
    size: int
    buffer_id: int
    ipc_capable: bool
    why: str = ""


class CudaIpc:
    """The driver calls a :class:`Registry` makes (CPU tests substitute fakes with the same
    methods)."""

    def describe(self, ptr: int) -> AllocInfo:
        """The allocation holding device address ``ptr`` (RuntimeUnavailable for other memory)."""
        base, size = address_range(ptr)
        capable = ipc_capable(ptr)
        why = "" if capable else ("a cuMem (virtual memory) allocation, e.g. torch's expandable segments, which "
                                  "legacy CUDA IPC cannot export")
        return AllocInfo(base, size, buffer_id(ptr), capable, why)

    def export(self, base: int) -> bytes:
        """The 64-byte IPC handle of the allocation at ``base``."""
        return ipc_handle(base)

    def open(self, handle: bytes) -> int:
        """Map a peer's allocation here; returns its address in this process."""
        return ipc_open(handle)

    def close(self, addr: int) -> None:
        """Unmap a peer's allocation mapped by :meth:`open`."""
        ipc_close(addr)

    def synchronize(self) -> None:
        """Wait until this device's work is done (before releasing what it may use)."""
        check(driver().cuCtxSynchronize(), "cuCtxSynchronize")
