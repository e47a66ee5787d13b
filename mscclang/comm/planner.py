"""Planning a collective call: which plan variant runs it and how (directly on the caller's
tensors, copied into an in-place plan's output, staged through padded buffers, or handed to
torch.distributed), and the memo of past calls.

Selection: the first tuning choice that runs directly (or copy-in) wins; a choice that needs
staging is kept in reserve while later ones are tried. A torch.distributed ("nccl") choice is
taken only when no plan listed before it can run at all, and skipped when the fallback is
disabled; when nothing listed can run, the catalog's other variants are tried (heuristic order)
before falling back. Whether the runtime runs a size as it is (packet offsets) is asked before
the call, only about the way the call will run, so every rank plans alike whatever its memo holds.
The memo of past calls is keyed by the tensors' addresses, sizes, dtypes and what each tensor is
to zero-copy plans (symmetric, registered or neither), so every rank chooses alike.

In the batch-invariant mode (the selector's ``batch_invariant``) torch.distributed never runs a
call: one that no plan keeping the contract can run raises
:class:`~mscclang.comm.errors.BatchInvariantError`, one line naming the call and why.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from mscclang.comm.catalog import PlanVariant
from mscclang.comm.errors import BatchInvariantError, CommError
from mscclang.comm.invariant import call_words, refusal
from mscclang.comm.padding import needs_padding, padded_block_elems
from mscclang.comm.selector import Choice, FusedShape, Selector, select_fused
from mscclang.errors import InvalidCall, MscclangError
from mscclang.plan.call import Call, Copies, FusedArgs, check_tensor, make_call
from mscclang.plan.collectives import BlockShape, collective
from mscclang.plan.models import Plan

_MODE_RANK = {"direct": 0, "copy_in": 1, "staged": 2}
_MEMO_SIZE = 256


@dataclass
class CallPlan:
    """How one call runs: ``mode`` is ``direct``, ``copy_in`` (out-of-place call, in-place
    plan), ``staged`` or ``nccl``; ``inp``/``out`` are the staging buffers the plan runs on in
    ``staged`` mode (the other modes run on the caller's tensors; no reference is kept).
    ``registrable``: a zero-copy plan would have been chosen had the tensors been registered;
    ``sym_blocked``: (a staged variant) staged only because its tensors are not symmetric or
    registered; ``bufs``: the staging buffers ``inp``/``out`` are views of; ``temp``: those of them
    above the staging cap, released after the call; ``bound``: what the engine resolved for this
    call (:meth:`mscclang.comm.backend.LaunchPart.run_call`'s result), so a memo hit launches
    without checking or classifying the tensors again; ``moved``: the call on the buffers a
    ``copy_in`` or ``staged`` plan runs on, made once."""

    collective: str
    mode: str
    choice: Optional[Choice]
    plan: Optional[Plan]
    shape: BlockShape
    padded: BlockShape
    #: the checked call this plans (:func:`mscclang.plan.call.make_call`)
    call: Optional[Call] = None
    inp: Any = None
    out: Any = None
    reason: str = ""
    variant: Optional[PlanVariant] = None
    registrable: bool = False
    sym_blocked: bool = False
    bufs: tuple = ()
    temp: tuple = ()
    bound: Any = None       # the engine's resolution of this call, for launches that check nothing again
    #: the call on the buffers a copy_in or staged plan runs on (made at its first run: the same
    #: buffers at every memo hit)
    moved: Optional[Call] = None
    #: the copies between the caller's tensors and ``moved``'s buffers (made with it)
    copies: Optional[Copies] = None
    ran_on: str = "nccl"    # the torch.distributed backend that ran a fallback call

    def label(self) -> str:
        """E.g. ``allreduce_oneshot_ll.r2.i1.ip (direct)``, or for a fallback call the backend that
        ran it (``nccl``, ``gloo``)."""
        if self.mode == "nccl" or self.variant is None:
            return self.ran_on
        pt = f" {self.choice.packet_type}" if self.choice and self.choice.packet_type else ""
        return f"{self.variant.key}{pt} ({self.mode})"



@contextmanager
def comm_errors() -> Iterator[None]:
    """What the plan layer's call checks refuse, as the communicator's CommError (an InvalidCall)."""
    try:
        yield
    except CommError:
        raise
    except InvalidCall as e:
        raise CommError(str(e)) from None

class Planner:
    """Plans the calls of one rank's communicator. ``engine`` is the engine (None: no runtime,
    every call falls back), ``selector`` the tuning's choices, ``has_fallback`` whether
    torch.distributed may run calls, ``note(what, message, level)`` logs once per message,
    ``runtime_error`` says why there is no runtime."""

    def __init__(self, rank: int, world_size: int, device: Any, engine: Any, selector: Selector,
                 has_fallback: bool, note: Callable[..., None], runtime_error: Optional[str] = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.engine = engine
        self.selector = selector
        self.has_fallback = has_fallback
        self.note = note
        self.runtime_error = runtime_error
        self.memo: dict[tuple, CallPlan] = {}
        self._cannot: list[str] = []   # the plans of the call being planned that cannot run here, and why

    def note_fallback(self, what: str, reason: str, level: int = logging.WARNING) -> None:
        """Log once that ``what`` falls back to torch.distributed, and why."""
        self.note(what, f"mscclang rank {self.rank}: {what} falls back to torch.distributed: {reason}", level)

    def stage(self, role: str, nbytes: int) -> tuple[Any, Any, bool]:
        """A symmetric uint8 staging view of at least ``nbytes``, the buffer it views, and whether
        that buffer is temporary: the back end's staging pool (one policy for the runtime's
        staging and this communicator's). A buffer that replaced the one kept for ``role`` means
        the memo's entries that viewed the old one must be planned again (on every rank alike)."""
        if self.engine is None:
            raise CommError("staging needs the GPU runtime")
        whole, temp, replaced = self.engine.memory.stage(role, nbytes)
        if replaced:
            self.memo.clear()
        return whole[:nbytes], whole, temp

    def check_tensor(self, what: str, t: Any) -> None:
        """A tensor argument: a contiguous torch tensor on this communicator's device."""
        with comm_errors():
            check_tensor(t, what, self.rank, self.device, "communicator")

    def default_out(self, coll: str, tensor: Any) -> Any:
        """A new output of the collective's size for ``tensor`` (the input itself when the
        collective's output is its input's size); CommError when ``tensor`` does not divide
        into the collective's blocks."""
        import torch

        self.check_tensor(f"{coll} input", tensor)
        row = collective(coll)
        bi, bo = row.blocks(self.world_size)
        if bi == bo:
            return tensor
        if tensor.numel() % bi:
            raise CommError(f"{row.api} needs an element count divisible by the world size {self.world_size}, "
                            f"got {tensor.numel()}")
        return torch.empty(row.output_elems(self.world_size, tensor.numel()), dtype=tensor.dtype, device=tensor.device)

    def make_call(self, coll: str, inp: Any, out: Any, op: Any = "sum", accum: Any = None,
                  epi: Optional[FusedArgs] = None, root: int = 0) -> Call:
        """The checked call (:func:`mscclang.plan.call.make_call`, this communicator's rank and
        device): the one check of a call's tensors; what it refuses comes back as CommError (an
        InvalidCall), the communicator's error."""
        with comm_errors():
            return make_call(coll, self.rank, self.world_size, self.device, inp, out, op, accum, epi, root=root)

    def plan_call(self, call: Call, inp: Any, out: Any) -> CallPlan:
        """How ``call`` (on ``inp``/``out``, whose views staging and copy-in take) runs: see the
        module docstring."""
        coll = call.collective.name
        n = self.world_size
        shape = call.shape
        nbytes = call.message_bytes
        if call.collective.fused:
            return self.plan_fused(call)
        if self.engine is None:
            if self.selector.batch_invariant:
                raise self.refuse(call, self.runtime_error or "no runtime")
            return CallPlan(coll, "nccl", None, None, shape, shape, call,
                            reason=self.runtime_error or "no runtime")
        self._cannot = []
        reason = f"no plan for {coll} of {nbytes} bytes ({call.dtype.name}) on {n} ranks"
        # 1. the tuning's choices, in order: the first that runs without staging wins; a
        #    torch.distributed choice wins only over the choices after it (a plan listed before
        #    it that needs staging still runs on mscclang: the rule ranked it faster, and staging
        #    costs two device copies); with the fallback disabled torch.distributed is skipped.
        # 2. nothing listed can run: any other variant of the catalog (heuristic order).
        staged: Optional[CallPlan] = None  # the first choice that needs staging, kept in reserve
        nccl: Optional[CallPlan] = None
        want_reg = False   # a choice before the one taken needs only its tensors registered
        for phase in (1, 2):
            if phase == 2 and (staged is not None or nccl is not None):
                break
            choices = self.selector.choices(call) if phase == 1 else self.selector.extra_choices(call)
            for choice in choices:
                if choice.is_nccl:
                    if not self.has_fallback:
                        continue
                    if staged is None:
                        nccl = CallPlan(coll, "nccl", choice, None, shape, shape, call,
                                        reason="tuning selects torch.distributed")
                    break
                best = self.best_variant(call, choice, inp, out)
                if best is None:
                    continue
                if best.mode != "staged":
                    best.registrable = want_reg
                    return best
                want_reg = want_reg or best.sym_blocked
                if staged is None:
                    staged = best
        if nccl is not None:
            nccl.registrable = want_reg
            return nccl
        if staged is not None:
            # allocate the staging buffers now
            got = self.fit(call, staged.variant, staged.plan, staged.choice, inp, out)
            if got is not None:
                got.registrable = want_reg
                return got
        if self.selector.batch_invariant:
            why = (f"{self._cannot[0]}" + (f", and {len(self._cannot) - 1} more" if len(self._cannot) > 1 else "")
                   if self._cannot else self.selector.explain(call))
            raise self.refuse(call, why)
        return CallPlan(coll, "nccl", None, None, shape, shape, call, reason=reason, registrable=want_reg)

    def plan_fused(self, call: Call) -> CallPlan:
        """The fused call's plan (:func:`~mscclang.comm.selector.select_fused`; in the batch-invariant
        mode from the algorithm library where the catalog has none): ``direct``, or ``nccl`` for the
        fallback (``all_reduce`` plus the reference epilogue); the batch-invariant mode raises
        instead of falling back."""
        n, be, inv = self.world_size, self.engine, self.selector.batch_invariant
        cp = CallPlan(call.collective.name, "nccl", None, None, call.shape, call.shape, call,
                      reason="no back end runs plans")
        if be is not None:
            shape = FusedShape.of(call)
            v = select_fused(self.selector.catalog, n, shape, inv)
            if v is None and inv:
                v = select_fused(self.selector.generated(call.collective.name, n), n, shape, inv)
            # the fused memo key holds no buffer class (lookup): right only while no fused plan is zero-copy
            assert v is None or not v.symmetric, f"fused plan {v.key} is zero-copy"
            if v is not None:
                cp.mode, cp.variant, cp.plan = "direct", v, v.load()
            cp.reason = (f"no fused plan {'keeping it ' if inv else ''}for {n} ranks "
                         f"({'FP8' if call.epi.quant else 'no FP8'}, {'in place' if call.inplace else 'out of place'}) "
                         "in the catalog" + (" or the algorithm library" if inv else ""))
        if inv and cp.plan is None:
            raise self.refuse(call, cp.reason if be is not None else self.runtime_error or cp.reason)
        return cp

    def refuse(self, call: Call, why: str) -> BatchInvariantError:
        """The batch-invariant mode's one-line error for ``call`` (the caller raises it)."""
        return refusal(call_words(call.collective.api or call.collective.name, self.world_size, call.message_bytes,
                                  call.dtype.name), why, self.rank)

    def best_variant(self, call: Call, choice: Choice, inp: Any, out: Any) -> Optional[CallPlan]:
        """The best way one choice's variants can run the call (direct over copy-in over
        staged; the variant whose in-place mode matches the call first), or ``None``."""
        coll = call.collective.name
        best: Optional[CallPlan] = None
        blocked = False
        for v in sorted(choice.variants, key=lambda v: v.inplace != call.inplace):
            if call.collective.rooted and v.root is not None and v.root != call.root:
                continue
            try:
                plan = v.load()
            except MscclangError as e:
                if self.selector.batch_invariant:   # a generated plan its proof refused, say
                    self._cannot.append(f"{v.key} is refused: {e}")
                    self.note(coll, f"mscclang rank {self.rank}: {self._cannot[-1]}", level=logging.WARNING)
                else:
                    self.note_fallback(coll, f"plan {v.key} cannot be loaded: {e}", level=logging.ERROR)
                continue
            if call.collective.rooted and (plan.root or 0) != call.root:
                continue
            why = self.engine.launch.runnable(plan) if self.engine is not None else None
            if why is not None:
                self.note(coll, f"mscclang rank {self.rank}: plan {v.key} cannot run here: {why}",
                           level=logging.INFO)
                self._cannot.append(f"{v.key} cannot run here: {why}")
                continue
            cp = self.fit(call, v, plan, choice, inp, out, dry=True)
            blocked = blocked or (cp is not None and cp.sym_blocked)
            if cp is not None and (best is None or _MODE_RANK[cp.mode] < _MODE_RANK[best.mode]):
                best = cp
                if best.mode == "direct":
                    break   # nothing runs better
        if best is not None and best.mode == "staged":
            best.sym_blocked = blocked
        return best

    def fit(self, call: Call, v: Any, plan: Any, choice: Choice, inp: Any, out: Any,
            dry: bool = False) -> Optional[CallPlan]:
        """How variant ``v`` can run the call (``dry``: decide without allocating staging)."""
        if self.engine is None:
            return None
        coll, shape, esz, inplace = call.collective.name, call.shape, call.dtype.itemsize, call.inplace
        granule = max(1, int(self.engine.launch.granule(plan)))
        pad = needs_padding(shape, esz, granule)
        sym_ok = not v.symmetric or self.engine.registry.zero_copy_ok(inp, out)
        runs = call.fits_plan(plan) or (plan.inplace and call.collective.inplace_copy)
        if not pad and sym_ok and runs:
            # asked up front, alike on every rank, and only of a way the call would run (the
            # answer packs the plan at this size, which the launch then reuses)
            if self.fits(plan, choice, shape, esz):
                return CallPlan(coll, "direct" if plan.inplace == inplace else "copy_in", choice, plan, shape,
                                shape, call, variant=v)
            granule, pad = self.wider_granule(plan, shape, esz, granule)
            if not pad:
                return None
        # staged only because the tensors are neither symmetric nor registered: registering them
        # would let this variant run directly
        blocked = not pad and not sym_ok and runs
        kp = padded_block_elems(shape.block_elems, esz, granule) if pad else shape.block_elems
        ps = shape.padded(kp)
        if not dry and not self.fits(plan, choice, ps, esz):
            granule, _ = self.wider_granule(plan, shape, esz, granule)
            kp = padded_block_elems(shape.block_elems, esz, granule)
            ps = shape.padded(kp)
            if not self.fits(plan, choice, ps, esz):
                return None
        if kp != shape.block_elems and not (plan.min_message_size
                                            <= call.collective.message_bytes(ps.in_elems * esz, ps.out_elems * esz)
                                            <= plan.max_message_size):
            return None  # the padded message leaves the plan's size range
        if dry:
            return CallPlan(coll, "staged", choice, plan, shape, ps, call, variant=v, sym_blocked=blocked)
        dt = inp.dtype
        if plan.inplace:
            total = max(ps.in_elems, ps.out_elems)
            view, whole, t_io = self.stage("io", total * esz)
            bufs, temp = (whole,), ((whole,) if t_io else ())
            buf = view.view(dt)
            r, row = self.rank, call.collective
            if row.inplace == "input_in_output":
                s_in, s_out = buf[r * kp:(r + 1) * kp], buf[:ps.out_elems]
            elif row.inplace == "output_in_input":
                s_in, s_out = buf[:ps.in_elems], buf[r * kp:(r + 1) * kp]
            else:
                s_in = s_out = buf[:ps.in_elems]
        else:
            v_in, w_in, t_in = self.stage("in", ps.in_elems * esz)
            v_out, w_out, t_out = self.stage("out", ps.out_elems * esz)
            s_in, s_out = v_in.view(dt), v_out.view(dt)
            bufs = (w_in, w_out)
            temp = tuple(w for w, t in ((w_in, t_in), (w_out, t_out)) if t)
        return CallPlan(coll, "staged", choice, plan, shape, ps, call, s_in, s_out, variant=v, sym_blocked=blocked,
                        bufs=bufs, temp=temp)

    def fits(self, plan: Any, choice: Choice, shape: BlockShape, esz: int) -> bool:
        """Whether the runtime runs ``plan`` on buffers of ``shape`` as they are (packet offsets
        aligned for the packet type)."""
        return bool(self.engine.launch.fits(plan, shape.in_elems * esz, shape.out_elems * esz, choice.packet_type))

    @staticmethod
    def wider_granule(plan: Any, shape: BlockShape, esz: int, granule: int) -> tuple[int, bool]:
        """The granule that makes a plan's packet offsets aligned (its alignment, at least 16
        bytes), and whether the call's blocks need padding to it."""
        g = max(granule, 16, plan.buffer_alignment)
        return g, needs_padding(shape, esz, g)

    def operands(self, cp: CallPlan, inp: Any, out: Any) -> tuple[Any, Any]:
        """What the plan runs on: the caller's tensors (direct), the output with the input's
        place in it (copy_in), or the staging buffers (staged)."""
        if cp.mode == "staged":
            return cp.inp, cp.out
        if cp.mode == "copy_in":
            k = cp.shape.block_elems
            a = (out[self.rank * k:(self.rank + 1) * k] if cp.call.collective.inplace == "input_in_output"
                 else out[:inp.numel()])
            return a, out
        return inp, out

    def lookup(self, coll: str, inp: Any, out: Any, op: str, root: int, accum: Any = None,
               epi: Optional[FusedArgs] = None) -> tuple[Optional[tuple], CallPlan]:
        """The memo key of a call and its CallPlan (checked, planned and memoised on a miss, so a
        repeated call checks nothing again). Shared by the collectives, the fused call (``epi``:
        its arguments) and :meth:`prepare`, so a prepared call is found again when captured.

        The one key rule: the call's tensors' addresses, sizes, dtypes and devices, the op, the
        accumulation dtype, the root and what each tensor is to zero-copy plans; a fused call's
        key is the out-of-place key plus the residual's and the weight's addresses and shapes,
        x's shape, eps and the FP8 scale (a tensor scale is read at every call: no key)."""
        key = None
        be = self.engine
        if epi is not None:
            # no buffer class in a fused key: the classes are in the plain key so that the ranks
            # choose alike between a zero-copy plan and a staged one, and no fused plan is
            # zero-copy (plan_fused asserts it), so what the tensors are changes no choice
            if (not hasattr(epi.scale, "item") and getattr(inp, "is_contiguous", None) and inp.is_contiguous()
                    and out.is_contiguous()):
                res, w = epi.residual, epi.weight
                key = (coll, inp.data_ptr(), out.data_ptr(), inp.numel(), out.numel(), inp.dtype, out.dtype,
                       inp.device, out.device, op, accum, root, None, res.data_ptr(), getattr(w, "data_ptr", id)(),
                       tuple(inp.shape), tuple(getattr(w, "shape", ())), epi.eps, epi.scale, res.is_contiguous())
        elif out is inp:
            # in place (the common call): the tensor is read once
            if getattr(inp, "is_contiguous", None) and inp.is_contiguous():
                key = (coll, inp.data_ptr(), inp.numel(), inp.dtype, inp.device, op, accum, root,
                       None if be is None else be.registry.classify(inp))
        elif getattr(inp, "is_contiguous", None) and inp.is_contiguous() and out.is_contiguous():
            # what the tensors are to zero-copy plans (symmetric, registered, or neither) is part of
            # the key: an address may come back as an ordinary tensor on one rank and a symmetric
            # or registered one on another, and the ranks must choose alike
            sym = None if be is None else (be.registry.classify(inp), be.registry.classify(out))
            key = (coll, inp.data_ptr(), out.data_ptr(), inp.numel(), out.numel(), inp.dtype,
                   out.dtype, inp.device, out.device, op, accum, root, sym)
        cp = self.memo.get(key) if key is not None else None
        if cp is None:
            call = self.make_call(coll, inp, out, op, accum, epi, root=root)
            if call.empty:   # nothing to run
                return key, CallPlan(coll, "empty", None, None, call.shape, call.shape, call)
            if be is not None:
                be.describe_call(call.describe())
            try:
                cp = self.plan_call(call, inp, out)
            finally:
                if be is not None:
                    be.describe_call("")
            if key is not None:
                self.remember(key, cp)
        return key, cp

    def remember(self, key: tuple, record: Any) -> None:
        """Memoise ``record`` under ``key`` (the oldest entry goes when the memo is full)."""
        if len(self.memo) >= _MEMO_SIZE:
            self.memo.pop(next(iter(self.memo)))
        self.memo[key] = record

    def forget(self, keys: Iterable[tuple]) -> None:
        """Drop the memo's entries under ``keys`` (those not there are ignored)."""
        for key in keys:
            self.memo.pop(key, None)
