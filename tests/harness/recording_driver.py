"""A stand-in for ``cuda.bindings.driver`` that records the calls made through it, for CPU tests
of host code that enqueues GPU work (the port proxy, the executor's launch paths)."""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

_u = ctypes.c_uint
#: C prototypes of the libcuda functions mscclang.runtime.cuda calls through ctypes without argtypes
LAUNCH_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _u, _u, _u, _u, _u, _u, _u, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p)
MEMCPY_DTOD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
MEMCPY_2D = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
STREAM_IS_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def no_argtypes(fn: Callable[..., int], proto: Any) -> tuple[Any, Any]:
    """``fn`` reached as ``ctypes.CDLL`` reaches a libcuda function: a foreign function at a C
    address, with no argtypes, so the caller's own conversion of each argument is what arrives
    (as ``proto`` declares it, in C). Returns the function and the callback behind it (keep both
    alive)."""
    cb = proto(fn)
    return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(cb, ctypes.c_void_p).value), cb


class RecordingDriver:
    """Records every call as ``(name, *args)`` in :attr:`calls`. Streams and events are numbered
    from 1; every other call returns success, except the one named ``fail``, which returns
    error code 1 (reported by ``cuGetErrorName`` as CUDA_ERROR_INVALID_VALUE)."""

    class Flags:
        CU_EVENT_DISABLE_TIMING = 2
        CU_STREAM_NON_BLOCKING = 1
        CU_STREAM_WAIT_VALUE_GEQ = 0
        CU_STREAM_WRITE_VALUE_DEFAULT = 0

    CUevent_flags = CUstream_flags = CUstreamWaitValue_flags = CUstreamWriteValue_flags = Flags

    def __init__(self, fail: Optional[str] = None) -> None:
        self.calls: list[tuple] = []
        self.fail = fail
        self.n = 0

    def _new(self, what: str) -> tuple[int, int]:
        self.n += 1
        self.calls.append((what, self.n))
        return 0, self.n

    def cuEventCreate(self, flags: Any) -> tuple[int, int]:
        return self._new("event")

    def cuStreamCreate(self, flags: Any) -> tuple[int, int]:
        return self._new("stream")

    def cuGetErrorName(self, err: Any) -> tuple[int, bytes]:
        return 0, b"CUDA_ERROR_INVALID_VALUE"

    def names(self) -> list[str]:
        """The names of the calls so far, in order."""
        return [c[0] for c in self.calls]

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> tuple[int]:
            self.calls.append((name,) + args)
            return (1,) if name == self.fail else (0,)
        return call
