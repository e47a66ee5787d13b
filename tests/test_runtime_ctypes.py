"""The libcuda calls mscclang.runtime.cuda makes through ctypes without argtypes (a copy of a
staged call, the capture query of every bound launch): their arguments reach C as the driver
declares them, 64-bit addresses and streams intact. libcuda is replaced by C callbacks of the
driver's prototypes (tests.harness.recording_driver), reached the way ``ctypes.CDLL`` reaches it."""

from __future__ import annotations

import ctypes
import types

from mscclang.plan.call import Copy
from mscclang.runtime import cuda
from tests.harness.recording_driver import MEMCPY_2D, MEMCPY_DTOD, STREAM_IS_CAPTURING, no_argtypes

BIG = 0x7F00_0000_0000   # above 2**32: an int handed to ctypes as a C int would not fit


def _libcuda(monkeypatch, **fns) -> list:
    keep = []
    lib = types.SimpleNamespace()
    for name, (fn, proto) in fns.items():
        f, cb = no_argtypes(fn, proto)
        keep.append(cb)
        setattr(lib, name, f)
    monkeypatch.setattr(cuda.ctypes, "CDLL", lambda name: lib)
    return keep


def test_a_flat_copy_passes_its_addresses_and_the_stream_whole(monkeypatch):
    done = []

    def flat(dst, src, n, s):
        done.append((dst, src, n, s))
        return 0

    keep = _libcuda(monkeypatch, cuMemcpyDtoDAsync_v2=(flat, MEMCPY_DTOD), cuMemcpy2DAsync_v2=(flat, MEMCPY_DTOD))
    run = cuda.copier(Copy(BIG + 0x100, BIG + 0x500, 1 << 20))
    for s in (BIG + 7, 0, BIG + 7):
        run(s)
    assert done == [(BIG + 0x100, BIG + 0x500, 1 << 20, BIG + 7), (BIG + 0x100, BIG + 0x500, 1 << 20, None),
                    (BIG + 0x100, BIG + 0x500, 1 << 20, BIG + 7)] and keep


def test_a_2d_copy_passes_its_struct_and_the_stream_whole(monkeypatch):
    done = []

    def two(ref, s):
        m = cuda._Memcpy2D.from_address(ref)
        done.append((m.dstDevice, m.srcDevice, m.dstPitch, m.srcPitch, m.WidthInBytes, m.Height, s))
        return 0

    keep = _libcuda(monkeypatch, cuMemcpyDtoDAsync_v2=(two, MEMCPY_2D), cuMemcpy2DAsync_v2=(two, MEMCPY_2D))
    cuda.copier(Copy(BIG, BIG + 0x10000, 14, 3, 16, 14))(BIG + 9)
    assert done == [(BIG, BIG + 0x10000, 16, 14, 14, 3, BIG + 9)] and keep


def test_the_capture_query_passes_the_stream_whole_and_reads_the_status(monkeypatch):
    capturing = {BIG + 3}
    asked = []

    def query(s, status):
        asked.append(s)
        ctypes.c_int.from_address(status).value = 1 if s in capturing else 0
        return 0

    keep = _libcuda(monkeypatch, cuStreamIsCapturing=(query, STREAM_IS_CAPTURING))
    f = cuda.raw_stream_is_capturing()
    assert [f(BIG + 3), f(BIG + 4), f(BIG + 3)] == [True, False, True]
    assert asked == [BIG + 3, BIG + 4, BIG + 3] and keep
