"""The raw launcher: one way to launch a kernel (ctypes ``cuLaunchKernel`` when available, else
cuda.bindings; cooperative when asked), the interpreter's parameter block, and the ordering of
launches that share a scratch across the caller's streams."""

from __future__ import annotations

import ctypes
from typing import Any, Optional

from mscclang.runtime import cuda as cu
from mscclang.runtime.state import LaunchEntry
from mscclang.runtime.structs import EPI_ARGS


class Launcher:
    """Launches on ``device``. ``cooperative``: through cuLaunchCooperativeKernel (falls back to a
    plain launch, once, where the device refuses it). ``last_kernel`` says which kernel the latest
    launch ran ('spec' or 'interpreter')."""

    def __init__(self, device: int, cooperative: bool = False) -> None:
        self.device = device
        self.cooperative = cooperative
        self.last_kernel = ""
        self.last_stream: Optional[int] = None
        self._params = (ctypes.c_uint64 * 6)()
        self._param_ptrs = (ctypes.c_void_p * 6)(*[ctypes.addressof(self._params) + 8 * i for i in range(6)])
        self._param_addr = ctypes.addressof(self._param_ptrs)
        # the traced interpreter's block: the same six, then the trace buffer
        self._tparams = (ctypes.c_uint64 * 7)()
        self._tparam_ptrs = (ctypes.c_void_p * 7)(*[ctypes.addressof(self._tparams) + 8 * i for i in range(7)])
        #: nonzero while a traced launch runs: the entry's kernel is the ``_trace`` variant and
        #: this its buffer (mscclang.runtime.trace)
        self.trace_ptr = 0
        # the epilogue kernels' block: the same six, then the call's EpiArgs (by value)
        self._eargs = ctypes.create_string_buffer(EPI_ARGS.size)
        self._eparams = (ctypes.c_uint64 * 6)()
        self._eparam_ptrs = (ctypes.c_void_p * 7)(*[ctypes.addressof(self._eparams) + 8 * i for i in range(6)],
                                                  ctypes.addressof(self._eargs))
        self._raw = cu.raw_launch_kernel()              # ctypes cuLaunchKernel (None: use cuda.bindings)
        self._ptr = cu.PointerArgs()                    # its pointer arguments, made once per value
        self._raw_stream = cu.raw_current_stream()      # torch's current raw stream getter (or None)
        self.stream_capturing = cu.raw_stream_is_capturing()
        drv = cu.driver()
        self._event = cu.check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def current_stream(self) -> int:
        """The caller's current torch stream (raw handle), without building a Stream object."""
        if self._raw_stream is not None:
            return self._raw_stream(self.device)
        import torch

        return torch.cuda.current_stream().cuda_stream

    def capturing_now(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""
        return bool(self.stream_capturing(self.current_stream()))

    def order(self, s: int) -> None:
        """Order a launch on stream ``s`` after the previous one (launches sharing a scratch are
        ordered on the GPU, whatever stream the caller uses); nothing to do inside a capture."""
        if s == self.last_stream:
            return
        if self.last_stream is not None and not self.stream_capturing(s):
            drv = cu.driver()
            cu.check(drv.cuEventRecord(self._event, self.last_stream), "cuEventRecord")
            cu.check(drv.cuStreamWaitEvent(s, self._event, 0), "cuStreamWaitEvent")
        self.last_stream = s

    def launch(self, ent: LaunchEntry, in_ptr: int, out_ptr: int, in_delta: int, out_delta: int, s: int,
               timeout_ns: int, epi: Optional[bytes] = None) -> None:
        """Launch ``ent``'s kernel on stream ``s``: the specialised kernel when the entry has one
        and the buffers are 16-byte aligned (it assumes so), else the interpreter. ``epi``: the
        call's ``EpiArgs`` bytes (an epilogue entry: the interpreter's ``_epi`` variant, or a
        specialised kernel whose parameters hold them)."""
        self.order(s)
        if self.trace_ptr:
            t = self._tparams
            t[0], t[1], t[2], t[3], t[4], t[5], t[6] = (ent.blob, in_ptr, out_ptr, in_delta, out_delta, timeout_ns,
                                                        self.trace_ptr)
            self.last_kernel = "traced"
            self._run(ent.func, ent.handle, ent.n_blocks, ent.nthreads, ent.smem, s,
                      ctypes.addressof(self._tparam_ptrs))
            return
        sl = ent.spec
        res = 0 if epi is None else int.from_bytes(epi[:8], "little")   # EpiArgs.residual
        if sl is not None and not (in_ptr | out_ptr | in_delta | out_delta | res) & 15:
            a = sl.args
            a[0], a[1], a[2], a[3], a[4] = in_ptr, out_ptr, in_delta, out_delta, timeout_ns
            if epi is not None:
                ctypes.memmove(ctypes.addressof(a) + sl.spec.layout.epi_args, epi, EPI_ARGS.size)
            sp = sl.spec
            self.last_kernel = "spec"
            self._run(sp.func, sp.fh, sp.n_blocks, sp.nthreads, 0, s, sl.param_addr)
            return
        self.last_kernel = "interpreter"
        if epi is not None:
            p = self._eparams
            p[0], p[1], p[2], p[3], p[4], p[5] = ent.blob, in_ptr, out_ptr, in_delta, out_delta, timeout_ns
            ctypes.memmove(self._eargs, epi, EPI_ARGS.size)
            self._run(ent.func, ent.handle, ent.n_blocks, ent.nthreads, ent.smem, s,
                      ctypes.addressof(self._eparam_ptrs))
            return
        p = self._params
        p[0], p[1], p[2], p[3], p[4], p[5] = ent.blob, in_ptr, out_ptr, in_delta, out_delta, timeout_ns
        self._run(ent.func, ent.handle, ent.n_blocks, ent.nthreads, ent.smem, s, self._param_addr)

    def _run(self, func: Any, handle: int, grid: int, block: int, smem: int, s: int, params: int) -> None:
        """The one launch ladder."""
        if self._raw is not None and not self.cooperative:
            known = self._ptr.known
            h, st, pa = known.get(handle), known.get(s), known.get(params)
            if h is None or st is None or pa is None:
                make = self._ptr.make
                h, st, pa = make(handle), make(s), make(params)
            err = self._raw(h, grid, 1, 1, block, 1, 1, smem, st, pa, None)
            if err:
                cu.check(err, "cuLaunchKernel")
            return
        drv = cu.driver()
        if self.cooperative:
            err, = drv.cuLaunchCooperativeKernel(func, grid, 1, 1, block, 1, 1, smem, s, params)
            if int(err) == 0:
                return
            self.cooperative = False
        cu.check(drv.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, smem, s, params, 0), "cuLaunchKernel")
