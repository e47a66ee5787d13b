"""Running a planned call: :class:`Launch` executes a :class:`~mscclang.comm.planner.CallPlan` on
an engine (:class:`~mscclang.comm.backend.Engine`).

It is the one place a plan runs, for the collectives, the fused call, ``prepare`` and the
warm-up alike:

- the copy-in of an out-of-place call on an in-place plan, and the padded staging copies;
- the relaunch of what the engine resolved at a call's first run (``cp.bound``), refreshed when
  the engine no longer launches it;
- the release of staging above the cap once the call's work is done;
- the automatic registration schedule (:mod:`mscclang.comm.autoregister`) and the re-plan after
  registering;
- the torch.distributed fallback, and the fused call's fallback (``all_reduce`` plus the reference
  epilogue in torch).

It never sees the :class:`~mscclang.comm.communicator.Communicator`: the planner plans, the engine
runs, and the communicator holds one :class:`Launch`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from mscclang.comm.autoregister import AutoRegister
from mscclang.comm.errors import CommError
from mscclang.comm.fallback import FallbackCalls, TorchFallback, run_fallback
from mscclang.comm.planner import CallPlan, Planner
from mscclang.comm.tracing import CallTrace, TracedCall
from mscclang.plan.call import Call, Copies, FusedArgs
from mscclang.plan.collectives import FUSED_NORM
from mscclang.plan.dtypes import gpu_dtype


class Launch:
    """Runs the calls of one rank: ``planner`` plans them (and holds the memo), ``engine`` runs
    them (None: no runtime; every call falls back), ``fallback`` is the torch.distributed fallback
    (None: disabled) with its call check ``calls`` (gloo only), ``note`` logs once per reason.

    Its counters are read back by the communicator: ``plan_calls`` (calls that ran on a mscclang
    plan), ``last`` (the last collective's CallPlan) and ``last_fused`` (the plan the last fused
    call ran; None: the fallback). ``tracer`` is the open ``comm.trace()`` block's record."""

    def __init__(self, planner: Planner, engine: Any, fallback: Any, calls: Optional[FallbackCalls],
                 note: Callable[..., None]) -> None:
        self.planner = planner
        self.rank = planner.rank
        self.engine = engine
        self.fallback = fallback
        self.calls = calls
        self.note = note
        self.schedule = AutoRegister()
        self.tracer: Optional[CallTrace] = None
        self.last: Optional[CallPlan] = None
        self.last_fused: Optional[str] = None
        self.plan_calls = 0

    # ------------------------------------------------------------------ collectives
    def call(self, coll: str, inp: Any, out: Any, op: Any, root: int = 0, accum: Any = None) -> Any:
        """Plan (or find in the memo) and run one collective call; returns ``out``."""
        key, cp = self.planner.lookup(coll, inp, out, op, root, accum)
        if (cp.bound is not None and self.tracer is None
                and (not cp.registrable or self.engine.registry.mode != "auto")):
            # a memo hit: launch what the engine resolved at the call's first run, its staging
            # or copy-in copies included (nothing is checked or resolved again); a call the
            # automatic registration schedule may register goes the long way
            if self.engine.launch.launch_bound(cp.bound):
                self.last = cp
                self.plan_calls += 1
                return out
            cp.bound = None   # stale: resolved again below
        if cp.call.empty:
            return out
        if cp.registrable and self._auto_register(cp, inp, out):
            if cp.temp:
                # the staged plan's buffer above the cap is moot now (every rank registered alike)
                self.release_temp(cp, key)
            key, cp = self.planner.lookup(coll, inp, out, op, root, accum)
        self.last = cp
        if cp.shape.block_elems == 0:
            return out
        self.run(cp, inp, out)
        if cp.temp:
            # staging above the cap: released (collectively) now that the call's work is done
            self.release_temp(cp, key)
        return out

    def run(self, cp: CallPlan, inp: Any, out: Any) -> None:
        """Run a planned call on the caller's ``inp``/``out``: the fallback, or the plan with its
        copies in and out."""
        be = self.engine
        if cp.mode == "nccl":
            if self.tracer is not None:
                self.tracer.skipped.append(f"{cp.collective} (torch.distributed fallback)")
            if be is not None:
                be.check()   # a pending abort of the runtime surfaces at any call
            self._run_fallback(cp, inp, out)
            return
        assert be is not None and cp.plan is not None and cp.choice is not None
        self.plan_calls += 1
        pt = cp.choice.packet_type
        call, copies = cp.call, None
        if cp.mode != "direct":
            if cp.mode == "staged" and cp.bufs and capturing():
                # a captured graph uses these buffers: never released before close()
                be.memory.pin(list(cp.bufs))
            call, copies = self._moved(cp, inp, out)
        if self.tracer is not None:
            rt = be.launch.trace(cp.plan, call, pt, copies=copies)
            self.tracer.calls.append(TracedCall(cp.plan.collective, cp.plan.name, inp.numel() * inp.element_size(), rt))
        elif cp.bound is None or not be.launch.launch_bound(cp.bound):
            got = be.launch.run_call(cp.plan, call, pt, copies=copies)
            if not cp.temp:   # a memo hit launches what the engine resolved now
                cp.bound = got

    def _moved(self, cp: CallPlan, inp: Any, out: Any) -> tuple[Call, Copies]:
        """The call on the buffers a copy_in or staged plan runs on (the input's place in the
        output, or the staging buffers: the same at every memo hit, so made once) and the copies
        between them and the caller's tensors."""
        a, b = self.planner.operands(cp, inp, out)
        if cp.moved is None or cp.moved.in_ptr != a.data_ptr() or cp.moved.out_ptr != b.data_ptr():
            cp.moved = cp.call.on(a, b, cp.plan.inplace)
            cp.copies = cp.call.copies(cp.moved, cp.mode == "staged")
        return cp.moved, cp.copies

    def prepare(self, coll: str, inp: Any, out: Any, op: Any, root: int, accum: Any) -> CallPlan:
        """A call's setup without running it (selection, registration where a zero-copy plan would
        run, staging kept until close, device plan, kernel); the CallPlan. Collective."""
        key, cp = self.planner.lookup(coll, inp, out, op, root, accum)
        if cp.call.empty:
            return cp
        be = self.engine
        if cp.registrable and be is not None and be.registry.mode != "off" and not capturing():
            # a zero-copy plan runs on these tensors once registered: prepare is collective
            if self.register_call(cp, inp, out):
                if cp.temp:
                    self.release_temp(cp, key)   # the staged plan's buffer above the cap is moot now
                _, cp = self.planner.lookup(coll, inp, out, op, root, accum)
        if cp.temp:
            # staging above the cap that a capture of this call will use: kept until close()
            be.memory.pin(list(cp.temp))
            cp.temp = ()
        if cp.bufs:
            # a prepared call keeps its staging (and its memo entry) when a larger one replaces it
            be.memory.pin(list(cp.bufs))
        if cp.mode != "nccl" and be is not None and cp.plan is not None:
            pt = cp.choice.packet_type if cp.choice else None
            be.launch.prepare_call(cp.plan, cp.call if cp.mode == "direct" else self._moved(cp, inp, out)[0], pt)
        return cp

    def release_temp(self, cp: CallPlan, key: Optional[tuple]) -> None:
        """Release ``cp``'s staging above the cap (collectively) and forget its memo entry."""
        temp, cp.temp, cp.bufs = cp.temp, (), ()
        cp.inp = cp.out = None
        if key is not None:
            self.planner.forget([key])
        if self.engine is not None and temp:
            self.engine.memory.release(list(temp))

    # ------------------------------------------------------------------ registration
    def _auto_register(self, cp: CallPlan, inp: Any, out: Any) -> bool:
        """The automatic registration schedule (:mod:`mscclang.comm.autoregister`)."""
        be = self.engine
        if be is None or be.registry.mode != "auto" or capturing():
            return False
        call = cp.call
        signature = (call.collective.name, inp.numel(), out.numel(), inp.dtype, call.op, call.root)
        return self.schedule.call(be.registry, signature,
                                  lambda: self.register_call(cp, inp, out), (inp, out))

    def register_call(self, cp: CallPlan, inp: Any, out: Any) -> bool:
        """Register a call's tensors (the containing one when its input lies in its output or the
        reverse); whether all were registered."""
        be = self.engine
        if be is None:
            return False
        a0, a1 = inp.data_ptr(), inp.data_ptr() + inp.numel() * inp.element_size()
        b0, b1 = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        if b0 <= a0 and a1 <= b1:
            tensors = [out]
        elif a0 <= b0 and b1 <= a1:
            tensors = [inp]
        else:
            tensors = [inp, out]
        be.describe_call(f"registration of the tensors of {cp.call.collective.name} of {inp.numel()} x "
                         f"{gpu_dtype(inp.dtype).name}")
        try:
            return all(be.registry.register(tensors))
        finally:
            be.describe_call("")

    # ------------------------------------------------------------------ the fused call
    def fused(self, x: Any, residual: Any, weight: Any, eps: Any, out: Any, scale: Any) -> Any:
        """Plan (or find in the memo) and run a fused call: its plan, or the library ``all_reduce``
        plus the reference epilogue in torch. Returns the tensor that holds the norm."""
        dst = x if out is None else out
        _, cp = self.planner.lookup(FUSED_NORM, x, dst, "sum", 0, None, FusedArgs(residual, weight, eps, scale))
        if cp.call.empty:
            return dst
        be = self.engine
        if cp.plan is not None and be is not None:
            if cp.bound is None or not be.launch.launch_bound(cp.bound):
                cp.bound = be.launch.run_call(cp.plan, cp.call)
            self.last_fused = cp.plan.name
            self.plan_calls += 1
            return dst
        from mscclang.comm.fused_norm import reference_epilogue

        self.last_fused = None
        self.note("all_reduce_add_rms_norm", f"mscclang rank {self.rank}: all_reduce_add_rms_norm falls back to "
                                             f"all_reduce + the torch epilogue: {cp.reason}")
        summed = x.clone()
        self.call("allreduce", summed, summed, "sum")
        reference_epilogue(summed, residual, weight, dst, cp.call.epi)
        return dst

    def prepare_fused(self, x: Any, residual: Any, weight: Any, eps: Any, out: Any, scale: Any) -> Optional[str]:
        """The fused call's setup (its plan's, or the fallback all_reduce's): the plan's name, or
        None when the call will fall back."""
        dst = x if out is None else out
        _, cp = self.planner.lookup(FUSED_NORM, x, dst, "sum", 0, None, FusedArgs(residual, weight, eps, scale))
        if self.engine is None or cp.call.empty:
            return None
        if cp.plan is not None:
            self.engine.launch.prepare_call(cp.plan, cp.call)
            return cp.plan.name
        self.prepare("allreduce", x, x, "sum", 0, None)
        return None

    # ------------------------------------------------------------------ the fallback
    def need_fallback(self, what: str) -> Any:
        """The torch.distributed fallback; CommError when it is disabled."""
        if self.fallback is None:
            raise CommError(f"rank {self.rank}: {what} cannot run on mscclang and the "
                            "torch.distributed fallback is disabled")
        return self.fallback

    def note_fallback(self, what: str, reason: str, level: int = logging.WARNING) -> None:
        """Log once that ``what`` falls back to torch.distributed for ``reason``."""
        self.note(what, f"mscclang rank {self.rank}: {what} falls back to torch.distributed: {reason}", level)

    def _run_fallback(self, cp: CallPlan, inp: Any, out: Any) -> None:
        coll = cp.collective
        if cp.choice is not None and cp.choice.is_nccl:
            # the tuning chose NCCL on purpose: note it quietly
            self.note_fallback(coll, cp.reason, level=logging.INFO)
        else:
            self.note_fallback(coll, _reason_kind(cp.reason))
        fb = self.need_fallback(coll)
        if isinstance(fb, TorchFallback):
            cp.ran_on = fb.backend_name
        if self.calls is not None:
            self.calls.check(fb, cp.call, inp, out)   # CallMismatch before gloo sees the call
        run_fallback(fb, cp.call, inp, out)


def _reason_kind(reason: str) -> str:
    """A log key that does not vary with the message size (so it is logged once)."""
    if reason.startswith("no plan for "):
        parts = reason.split(" ")
        # "no plan for COLL of N bytes (DTYPE) on N ranks" -> drop the byte count
        if len(parts) > 6:
            parts[5] = "N"
        return " ".join(parts)
    return reason


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA). No stream
    captures before torch initialised CUDA, and ``is_initialized`` is a flag, where
    ``is_available`` asks the driver for the device count at every call."""
    try:
        import torch

        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:  # pragma: no cover
        return False
