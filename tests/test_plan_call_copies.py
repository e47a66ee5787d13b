"""``Call.copies``: the copies between a caller's tensors and the buffers a staged or copy-in plan
runs on, checked by their geometry and by running them on CPU memory."""

import ctypes

import numpy as np
import pytest

from mscclang.plan.call import Copies, Copy, sized_call
from mscclang.plan.dtypes import find_dtype


class Buf:
    """A numpy buffer with the tensor methods Call.on reads."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    def numel(self) -> int:
        return self.a.size


def run(copies: tuple) -> None:
    for c in copies:
        for r in range(c.rows):
            ctypes.memmove(c.dst + r * c.dst_pitch, c.src + r * c.src_pitch, c.width)


@pytest.mark.parametrize("coll,bi,bo", [("reducescatter", 4, 1), ("allgather", 1, 4), ("alltoall", 4, 4)])
def test_staged_copies_pad_every_block_and_read_back_its_first_elements(coll, bi, bo):
    f16 = find_dtype("float16")
    k, kp, n = 7, 8, 4
    inp = np.arange(bi * k, dtype=np.float16) + 1
    out = np.zeros(bo * k, dtype=np.float16)
    call = sized_call(coll, 0, n, f16, inp.nbytes, out.nbytes, in_ptr=inp.ctypes.data, out_ptr=out.ctypes.data)
    a, b = np.full(bi * kp, -1, np.float16), np.full(bo * kp, -2, np.float16)
    moved = call.on(Buf(a), Buf(b), False)
    got = call.copies(moved, staged=True)
    assert got.before[0] == (Copy(a.ctypes.data, inp.ctypes.data, bi * 14) if bi == 1
                             else Copy(a.ctypes.data, inp.ctypes.data, 14, bi, 16, 14))
    run(got.before)
    assert np.array_equal(a.reshape(bi, kp)[:, :k], inp.reshape(bi, k)) and (a.reshape(bi, kp)[:, k:] == -1).all()
    b[:] = np.arange(bo * kp)
    run(got.after)
    assert np.array_equal(out.reshape(bo, k), b.reshape(bo, kp)[:, :k])


def test_unpadded_staging_and_copy_in_are_one_flat_copy():
    f16 = find_dtype("float16")
    inp, out = np.ones(32, np.float16), np.zeros(128, np.float16)
    call = sized_call("allgather", 1, 4, f16, inp.nbytes, out.nbytes, in_ptr=inp.ctypes.data, out_ptr=out.ctypes.data)
    a, b = np.zeros(32, np.float16), np.zeros(128, np.float16)
    moved = call.on(Buf(a), Buf(b), False)
    assert call.copies(moved, staged=True) == Copies((Copy(a.ctypes.data, inp.ctypes.data, 64),),
                                                     (Copy(out.ctypes.data, b.ctypes.data, 256),))
    place = out[32:64]   # copy-in: rank 1's block of the output
    moved = call.on(Buf(place), Buf(out), True)
    assert call.copies(moved, staged=False) == Copies((Copy(place.ctypes.data, inp.ctypes.data, 64),))


def test_the_2d_copy_struct_has_the_drivers_layout():
    """runtime.cuda's ctypes CUDA_MEMCPY2D: 128 bytes, the fields at the driver header's offsets."""
    from mscclang.runtime.cuda import _Memcpy2D

    offsets = {name: getattr(_Memcpy2D, name).offset for name, _ in _Memcpy2D._fields_}
    assert ctypes.sizeof(_Memcpy2D) == 128
    assert (offsets["srcMemoryType"], offsets["srcDevice"], offsets["srcPitch"]) == (16, 32, 48)
    assert (offsets["dstMemoryType"], offsets["dstDevice"], offsets["dstPitch"]) == (72, 88, 104)
    assert (offsets["WidthInBytes"], offsets["Height"]) == (112, 120)


def test_without_libcuda_through_ctypes_a_copy_is_one_flat_copy_per_row(monkeypatch):
    """runtime.cuda.copier's fallback: the project's dtod, once per row, on the given stream;
    nothing for an empty copy."""
    from mscclang.runtime import cuda

    monkeypatch.setattr(cuda.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    done = []
    monkeypatch.setattr(cuda, "dtod", lambda dst, src, n, s: done.append((dst, src, n, s)))
    cuda.copier(Copy(100, 500, 14, 3, 16, 14))(7)
    cuda.copier(Copy(100, 500, 0, 3, 16, 14))(7)
    assert done == [(100, 500, 14, 7), (116, 514, 14, 7), (132, 528, 14, 7)]
