"""The executor's side of registration and of CUDA-graph capture sessions (the rule itself, and the
registry, live in :mod:`mscclang.runtime.registration`).

Registered ordinary tensors run zero-copy plans like symmetric buffers: their device plans name
the peers' corresponding tensors at the registration's mapped bases. Inside a capture session, a
zero-copy call on unregistered but exportable tensors is captured anyway: its device plan sits in
an arena slot that holds an aborting plan (its blocks find the abort word set and leave at once)
until the session's end registers the buffers and writes the real plan. Arenas are kept until
close, since captured graphs use them.
"""

from __future__ import annotations

import collections
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mscclang.config import settings
from mscclang.errors import InvalidCall, NotPrepared, RuntimeUnavailable
from mscclang.runtime import cuda as cu
from mscclang.runtime.device_plan import MAX_FLAGS, SYNC_ABORT_OFF, SYNC_FLAGS_OFF, pack_blob
from mscclang.runtime.packing import pack_blocks
from mscclang.runtime.registration import (ARENA_STRIDE, BufferName, Region, ZeroCopy, allocator_config,
                                           zero_copy_operands)
from mscclang.runtime.state import EntryKey, LaunchEntry, LoadedPlan, Operands, describe_call
from mscclang.runtime.structs import CONSTANTS, PLAN_HEADER


@dataclass
class Arena:
    """A device allocation of arena slots: ``used`` bytes handed out of ``size``."""

    base: int
    size: int
    used: int = 0


@dataclass
class CaptureState:
    """Arenas and the aborting sync area their initial slots point at."""

    arenas: list[Arena] = field(default_factory=list)
    poison: int = 0
    poison_bytes: int = 0


class CaptureGlue:
    """Registration and capture sessions for one executor. ``comm`` is the runtime communicator
    (its ``registry``, when it has one); ``forget(indices)`` drops what the runtime built on
    released registrations; ``capturing`` / ``capturing_now`` say whether the caller captures;
    ``error_record`` is the device address of the error record; ``check_tensor(t, what)`` checks
    a tensor argument.

    It is the collective API's registry part (:class:`mscclang.comm.backend.RegistryPart`)."""

    def __init__(self, comm: Any, forget: Callable[[set], None], capturing: Callable[[], bool],
                 capturing_now: Callable[[], bool], error_record: int,
                 check_tensor: Callable[[Any, str], None]) -> None:
        self.comm = comm
        #: the communicator's registry (made with it), or None: an attribute, read at every memo hit
        self.registry: Any = getattr(comm, "registry", None)
        self.state = CaptureState()
        self._forget = forget
        self._capturing = capturing
        self._capturing_now = capturing_now
        self._err_dev = error_record
        self._check_tensor = check_tensor
        self._hooked = False
        self.hook()

    @property
    def mode(self) -> str:
        """The registry's mode (``auto``, ``explicit`` or ``off``); ``off`` without a registry."""
        reg = self.registry
        return reg.mode if reg is not None else "off"

    def uses(self, cls: Any) -> int:
        """Launches that ran on the registration a :meth:`classify` value names (0 for anything else)."""
        reg = self.registry
        if reg is None or not (isinstance(cls, BufferName) and cls.kind == "reg"):
            return 0
        return reg.uses(cls.index)

    def hook(self) -> None:
        """Have the registry tell us about released registrations (once)."""
        reg = self.registry
        if reg is not None and not self._hooked:
            reg.on_release.append(lambda regions: self._forget({r.index for r in regions}))
            self._hooked = True

    def _need_registry(self) -> Any:
        reg = self.registry
        if reg is None:
            raise RuntimeUnavailable(f"rank {self.comm.rank}: this communicator cannot register tensors")
        return reg

    # calls --------------------------------------------------------------------------------------
    def registered(self, si: Any, so: Any, in_ptr: int, out_ptr: int, in_bytes: int,
                   out_bytes: int) -> Optional[ZeroCopy]:
        """How the call reaches its buffers (:class:`ZeroCopy`) when the call's tensors are
        registered (or one symmetric and one registered), else None. A registration used inside a
        capture is pinned (kept until close)."""
        reg = self.registry
        if reg is None or not reg.by_base:
            return None
        got = zero_copy_operands({in_ptr: si, out_ptr: so}.get, reg, in_ptr, out_ptr, in_bytes, out_bytes)
        if got is None:
            return None
        rin, rout = got.in_buf, got.out_buf
        if isinstance(rin, Region):
            rin.uses += 1
        if isinstance(rout, Region) and rout is not rin:
            rout.uses += 1
        if (((isinstance(rin, Region) and not rin.pinned) or (isinstance(rout, Region) and not rout.pinned))
                and self._capturing_now()):
            reg.pin(rin, rout)
        self.hook()
        return got

    def deferred(self, lp: LoadedPlan, dt: str, in_ptr: int, out_ptr: int, in_bytes: int, out_bytes: int,
                 pkt: str, op: str, kernels: Any, contexts: Any) -> Optional[tuple[LaunchEntry, Operands]]:
        """Inside a capture session, while capturing: the launch entry of a zero-copy call on
        unregistered, exportable tensors, with its device plan in an arena slot (see the module
        docstring). None outside a session (or when the buffers cannot be exported: the call is
        staged). Needs the kernel loaded and a context large enough: the same sizes run or
        prepared before (on any tensors). Only host queries here: no allocation, no IPC call."""
        s = None if self.registry is None else self.registry.sessions.session
        if s is None or not s.enabled or not self._capturing():
            return None
        reg = self.registry
        if lp.has_port:   # the proxy's copies need the peers' addresses at capture: staged instead
            return None
        if not reg.can_defer(in_ptr, in_bytes, out_ptr, out_bytes):
            return None
        plan = lp.plan
        r = self.comm.rank
        desc = describe_call(plan, in_bytes, out_bytes, dt, pkt, op)
        ctx = lp.ctx
        epi = lp.epi is not None
        if (not kernels.has_interpreter(dt, pkt, op, lp.nthreads, epi) or ctx is None
                or ctx.scratch_bytes < contexts.group_scratch(lp, in_bytes, out_bytes)):
            raise NotPrepared(f"rank {r}: {desc} was not prepared: run it once or prepare it (any "
                              "tensors of these sizes) before capturing it")
        packed = pack_blocks(plan, r, in_bytes, out_bytes)
        f = kernels.interpreter(dt, pkt, op, lp.nthreads, epi=epi)
        nb = len(packed.blocks)
        smem = packed.smem
        kernels.fit(f, lp.nthreads, smem, nb, f"rank {r}", packed.uses_packets, packed.packet_align, pkt)
        anyb = types.SimpleNamespace(peer_bases=collections.defaultdict(int))
        nbytes = len(pack_blob(plan, packed, contexts.addresses(lp, ctx, anyb, anyb), ctx.sync))
        slot = self._arena_slot(nbytes, desc)

        def finish(rin: Any, rout: Any) -> None:
            cu.htod(slot, pack_blob(plan, packed, contexts.addresses(lp, ctx, rin, rout), ctx.sync), 0)

        deltas = reg.defer(in_ptr, in_bytes, out_ptr, out_bytes, desc, finish)
        if deltas is None:
            return None
        ent = LaunchEntry(f, slot, nb, lp.nthreads, smem, cu.ptr(f), ctx=ctx)
        return ent, Operands("sym", deltas[0], deltas[1])

    def _arena_slot(self, nbytes: int, desc: str) -> int:
        need = -(-int(nbytes) // ARENA_STRIDE) * ARENA_STRIDE
        for a in self.state.arenas:
            if a.used + need <= a.size:
                p = a.base + a.used
                a.used += need
                return p
        free = sum(a.size - a.used for a in self.state.arenas)
        raise NotPrepared(f"rank {self.comm.rank}: the graph-capture arena ({free} B free) has no room for the "
                          f"device plan of {desc} ({need} B): pass a larger arena_bytes to graph_capture() "
                          "(or MSCCLANG_GRAPH_ARENA_BYTES)")

    def poison_image(self) -> bytes:
        """One arena slot's initial content: a device plan whose blocks find the abort word set and
        leave at once (recording an error), so a slot replayed before its buffers were registered,
        or whose registration failed, never touches a peer."""
        st = self.state
        if not st.poison:
            n = SYNC_FLAGS_OFF + 4 * MAX_FLAGS
            p = cu.mem_alloc(n)
            cu.memset_d32(p, 1, n // 4, 0)   # abort word 1, every flag 1
            st.poison, st.poison_bytes = p, n
        sb = st.poison
        h = PLAN_HEADER.size
        head = PLAN_HEADER.pack(
            magic=CONSTANTS["MSCCLANG_PLAN_MAGIC"], version=CONSTANTS["MSCCLANG_PLAN_VERSION"], n_blocks=0,
            rank=self.comm.rank, sync_base=sb, flags=sb + SYNC_FLAGS_OFF, abort_word=sb + SYNC_ABORT_OFF,
            error_record=self._err_dev, semaphores=sb, barriers=sb, peer_abort_table=h, remote_table=h,
            channel_table=h, block_table=h)
        return head + b"\0" * (ARENA_STRIDE - len(head))

    def note(self, lp: LoadedPlan, key: EntryKey, dt: str) -> None:
        """Inside a capture session: record the captured call (the ranks compare their lists at
        the session's end). With ``MSCCLANG_CHECK_REGISTRATION``: compare every zero-copy call's
        buffers across ranks (outside captures)."""
        reg = self.registry
        if reg is None or (reg.sessions.session is None and not reg.verify):
            return
        capturing = self._capturing()
        if reg.sessions.session is not None and capturing:
            reg.note_call(f"{describe_call(lp.plan, key.in_bytes, key.out_bytes, dt, key.packet, key.op)} "
                          f"{key.how()}")
        if reg.verify and lp.zero_copy and not capturing:
            reg.check_call(f"{lp.plan.name} {key.in_bytes} {key.out_bytes} {key.how()}")

    # collective steps ----------------------------------------------------------------------------
    def register(self, tensors: list) -> list[bool]:
        """Collective: register ordinary CUDA tensors for zero-copy plans (every rank passes its
        corresponding tensors, in the same order). Returns, per tensor, whether zero-copy plans now
        run on it directly (symmetric tensors: always). See :mod:`mscclang.runtime.registration`
        for the rule. Not inside a CUDA graph capture (use :meth:`begin_capture`)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        reg = self._need_registry()
        self.hook()
        if self._capturing():
            raise NotPrepared(f"rank {self.comm.rank}: registration cannot happen inside CUDA graph capture: "
                              "register before capturing, or capture inside a graph-capture session")
        items: list = []
        sym: list[bool] = []
        for i, t in enumerate(tensors):
            self._check_tensor(t, f"tensor {i}")
            n = t.numel() * t.element_size()
            got = self.comm.symmetric_of(t.data_ptr())
            if got is not None or n == 0:
                items.append((None, n, None))
                sym.append(got is not None and not got.internal)
            else:
                items.append((t.data_ptr(), n, StorageWeakRef(t.untyped_storage())))
                sym.append(False)
        res = reg.register(items)
        return [s or g is not None for s, g in zip(sym, res)]

    def deregister(self, tensors: list) -> int:
        """Collective: drop the registrations of ``tensors`` (releasing their mappings and device
        plans unless a captured graph uses them). Returns how many were dropped."""
        reg = self._need_registry()
        items = []
        for i, t in enumerate(tensors):
            self._check_tensor(t, f"tensor {i}")
            items.append((t.data_ptr(), t.numel() * t.element_size()))
        return reg.deregister(items)

    def zero_copy_ok(self, input: Any, output: Any) -> bool:
        """Whether a zero-copy plan runs on these tensors without staging: both symmetric,
        registered (or one of each, or one inside the other's registration), or, while capturing in
        a capture session, exportable (registered at the session's end)."""
        esz = input.element_size()
        p, q = input.data_ptr(), output.data_ptr()
        a, b = input.numel() * esz, output.numel() * esz
        comm = self.comm
        si, so = comm.symmetric_of(p), comm.symmetric_of(q)
        if si is not None and so is not None and not si.internal and not so.internal:
            return True
        reg = self.registry
        if reg is None:
            return False
        if reg.by_base and zero_copy_operands({p: si, q: so}.get, reg, p, q, a, b) is not None:
            return True
        s = reg.sessions.session
        return bool(s is not None and s.enabled and self._capturing() and reg.can_defer(p, a, q, b))

    def classify(self, t: Any) -> Any:
        """What a tensor is to zero-copy plans (part of the collective API's memo key): a
        :class:`BufferName` (a symmetric allocation's, or a registration's), ``"defer"``
        (capturing in a session, exportable), or None."""
        p = t.data_ptr()
        got = self.comm.symmetric_of(p)
        if got is not None:
            return got.name
        reg = self.registry
        if reg is None:
            return None
        n = t.numel() * t.element_size()
        if reg.by_base:
            g = reg.lookup(p, n)
            if g is not None:
                return g.index
        s = reg.sessions.session
        if s is not None and s.enabled and self._capturing():
            return "defer" if reg.exportable(p, n) else None
        return None

    def begin_capture(self, arena_bytes: Optional[int] = None) -> bool:
        """Collective, before ``torch.cuda.graph`` starts: open a capture session (arena space
        left by earlier sessions, plus a new arena when that is less than ``arena_bytes``).
        Returns whether deferring is enabled (every rank runs the same allocator settings)."""
        reg = self._need_registry()
        self.hook()
        if self._capturing():
            raise InvalidCall(f"rank {self.comm.rank}: open the graph-capture session before torch.cuda.graph "
                              "starts capturing")
        size = max(settings.graph_arena_bytes if arena_bytes is None else int(arena_bytes), ARENA_STRIDE)
        size = -(-size // ARENA_STRIDE) * ARENA_STRIDE
        config = allocator_config()
        free = sum(a.size - a.used for a in self.state.arenas)
        if free < size:
            more = max(size - free, min(size, 64 * ARENA_STRIDE))
            try:
                image = self.poison_image()
                p = cu.mem_alloc(more)
                cu.htod(p, image * (more // ARENA_STRIDE), 0)
                cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
                self.state.arenas.append(Arena(p, more))
            except RuntimeUnavailable as e:
                # every rank then disables deferring (the settings compared differ): staging instead
                config += f"|arena failed on rank {self.comm.rank}: {e}"
        return reg.begin_capture(config).enabled

    def end_capture(self, failed: bool = False) -> int:
        """Collective, after the capture ended: register the buffers of the calls captured in the
        session and write their device plans. Returns the number of calls registered."""
        reg = self._need_registry()
        if self._capturing():
            raise InvalidCall(f"rank {self.comm.rank}: end the graph-capture session after the capture ended "
                              "(leave torch.cuda.graph first)")
        try:
            return reg.finish_capture(failed)
        finally:
            cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")   # the device plans are written

    def arena_bytes(self) -> int:
        """Arena and aborting-sync bytes held."""
        return sum(a.size for a in self.state.arenas) + self.state.poison_bytes

    def close(self) -> None:
        """Free the arenas and the aborting sync area (the device is idle)."""
        for a in self.state.arenas:
            cu.mem_free(a.base)
        self.state.arenas.clear()
        if self.state.poison:
            cu.mem_free(self.state.poison)
            self.state.poison = self.state.poison_bytes = 0
