"""Launch entries: the one place that decides how a call runs, and keeps what it decided.

:meth:`Entries.resolve` maps a call (plan, sizes, dtype, packet type, reduce op, buffer
addresses) to a :class:`~mscclang.runtime.state.LaunchEntry` and its
:class:`~mscclang.runtime.state.Operands`: directly on the caller's tensors (plans that run on
any buffers), on symmetric buffers, on registered tensors, deferred into a capture session's
arena, or staged. A new entry is host work only once its plan's context and staging are large
enough (see :mod:`mscclang.runtime.contexts` and :mod:`mscclang.runtime.staging`): it packs a
device plan and uploads it on the launching stream; it never builds a kernel on the calling
thread. Specialised kernels are built in the background (:mod:`mscclang.runtime.kernels`) for
the sizes the policy wants (:func:`mscclang.runtime.spec_build.when`): at the second call up to
``MSCCLANG_SPEC_FIRST_BYTES``, once called ``MSCCLANG_SPEC_HOT_CALLS`` times above it, so a size
called once builds nothing; the interpreter serves a size until its kernel is ready. ``prepare`` does everything at once, so a
call captured after it runs the specialised kernel; so does the 'always' policy (tests, tuning).

Entries are bounded: beyond ``MSCCLANG_MAX_LAUNCH_ENTRIES`` (default 512) the least recently
used entries that no prepare and no captured graph holds are evicted, with their device plans
and specialised modules, a quarter of the cap at a time (after the device finished its work).
The order of calls is the same on every rank, so every rank evicts alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional

from mscclang.config import settings
from mscclang.errors import InvalidCall, NotPrepared, PlanError
from mscclang.plan.call import Call
from mscclang.plan.collectives import collective
from mscclang.plan.dtypes import kernel_dtype
from mscclang.plan.models import ChannelType
from mscclang.runtime import cuda as cu
from mscclang.runtime.contexts import ContextPool, drop_device_plans
from mscclang.runtime.device_plan import SYNC_ABORT_OFF
from mscclang.runtime.packing import pack_blocks
from mscclang.runtime.engine import Key as EngineKey
from mscclang.runtime.kernels import SPEC_ERRORS, KernelCache, unsupported
from mscclang.runtime.ports import PortScript
from mscclang.runtime.proxy import Incoming, PortLaunch
from mscclang.runtime.spec_build import pack_args, when
from mscclang.runtime.spec_source import generate
from mscclang.runtime.state import (
    DevPlan, EntryKey, LaunchEntry, LoadedPlan, Operands, Pending, SpecKey, SpecLaunch, describe_call,
)

log = logging.getLogger("mscclang.runtime.entries")


class Entries:
    """The launch entries of one executor, built from its collaborators: ``comm`` (rank,
    ``call`` naming the call being set up), ``kernels``, ``contexts``, ``staging``, ``capture``,
    ``topology``, ``engine`` and ``proxy`` (port channels), ``specialize()`` (the policy now),
    ``capturing()`` and ``capturing_now()``."""

    def __init__(self, comm: Any, kernels: KernelCache, contexts: ContextPool, staging: Any, capture: Any,
                 topology: Any, engine: Any, proxy: Any, specialize: Callable[[], str],
                 capturing: Callable[[], bool], capturing_now: Callable[[], bool]) -> None:
        self.comm = comm
        self.kernels = kernels
        self.contexts = contexts
        self.staging = staging
        self.capture = capture
        self.topology = topology
        self.engine = engine
        self.proxy = proxy
        self._specialize = specialize
        self._capturing = capturing
        self._capturing_now = capturing_now
        self.cap = settings.max_launch_entries
        self._lru: "OrderedDict[tuple[int, EntryKey], LoadedPlan]" = OrderedDict()
        self._latest: Optional[tuple] = None   # the key :meth:`touch` made most recent, while it is
        self._pinned: set[tuple[int, EntryKey]] = set()
        self.evicted = 0
        #: bumped whenever an entry is dropped or replaced (what holds an entry checks it)
        self.epoch = 0
        #: the key of the latest resolve (``bind`` reads it)
        self.last_key: Optional[EntryKey] = None

    # resolving -------------------------------------------------------------------------------
    def resolve(self, lp: LoadedPlan, call: Call, pkt: str, stream: int, prepare: bool = False,
                count: bool = True) -> tuple[LaunchEntry, Operands]:
        """The launch entry of a checked ``call`` (:class:`~mscclang.plan.call.Call`) with packet
        type ``pkt`` and how its buffers map (see the module docstring). ``prepare``: do every
        first-time step now, specialised kernel included, and keep the entry (never evicted).
        ``count``: this is a call (it counts toward the specialisation policy); False only looks
        the entry up (a traced launch)."""
        dt = call.kernel_code
        in_ptr, out_ptr, in_bytes, out_bytes, op = call.in_ptr, call.out_ptr, call.in_bytes, call.out_bytes, call.op
        row = call.row_bytes if lp.plan.chunk_unit == "row" else 0   # the layout of row chunks needs it
        opr = Operands()
        sym_in = sym_out = None
        if lp.zero_copy:
            comm = self.comm
            si = comm.symmetric_of(in_ptr)
            so = comm.symmetric_of(out_ptr)
            if si is not None and so is not None and not si.internal and not so.internal:
                sym_in, sym_out = si, so
                key = EntryKey(in_bytes, out_bytes, dt, pkt, op, "sym", si.index, so.index)
                opr = Operands("sym", in_ptr - si.base, out_ptr - so.base)
            elif (zc := self.capture.registered(si, so, in_ptr, out_ptr, in_bytes, out_bytes)) is not None:
                # registered ordinary tensors: like symmetric buffers, the peers' corresponding
                # tensors at the registration's mapped bases
                sym_in, sym_out = zc.in_buf, zc.out_buf
                key = EntryKey(in_bytes, out_bytes, dt, pkt, op, "sym", sym_in.index, sym_out.index)
                opr = Operands("sym", zc.in_delta, zc.out_delta)
            else:
                dfr = self.capture.deferred(lp, dt, in_ptr, out_ptr, in_bytes, out_bytes, pkt, op,
                                            self.kernels, self.contexts)
                if dfr is not None:
                    return dfr
                # the plan's staging: the key names it, so an entry never runs on staging other
                # than its device plan's
                st_in, st_out = self.staging.get(lp, in_bytes, out_bytes, keep=prepare)
                key = EntryKey(in_bytes, out_bytes, dt, pkt, op, "staged", st_in.index, st_out.index)
                opr = Operands("staged", stage_in=st_in, stage_out=st_out)
                sym_in, sym_out = (st_out if lp.plan.inplace else st_in), st_out
                if not (st_in.pinned and st_out.pinned) and (prepare or self._capturing()):
                    # a prepared call or a captured graph uses them: never released before close
                    st_in.pinned = st_out.pinned = True
        else:
            key = EntryKey(in_bytes, out_bytes, dt, pkt, op, row=row)
        self.capture.note(lp, key, dt)
        self.last_key = key
        lk = (id(lp), key)
        ent = lp.fast.get(key)
        if ent is None:
            ent = self._build(lp, dt, in_bytes, out_bytes, pkt, op, sym_in, sym_out, prepare, stream, row)
            lp.fast[key] = ent
            self._lru[lk] = lp
            if len(self._lru) > self.cap:
                self._evict(keep=lk)
        else:
            self._lru.move_to_end(lk)
            if ent.pending is not None and count:
                ent = self.advance(lp, key, ent, prepare)
        self._latest = None   # the order changed: the next touch moves its key
        if (prepare or self._capturing()) and lk not in self._pinned:
            self._pinned.add(lk)
        return ent, opr

    def _build(self, lp: LoadedPlan, dt: str, in_bytes: int, out_bytes: int, pkt: str, op: str,
               sym_in: Any, sym_out: Any, force: bool, stream: int, row: int = 0) -> LaunchEntry:
        """A new entry (first-time set-up: refused inside a CUDA graph capture)."""
        plan = lp.plan
        r = self.comm.rank
        ref = collective(plan.collective).message_bytes(in_bytes, out_bytes)
        if not plan.min_message_size <= ref <= plan.max_message_size:
            raise PlanError(f"message size {ref} bytes is outside the plan's range "
                            f"[{plan.min_message_size}, {plan.max_message_size}]")
        desc = describe_call(plan, in_bytes, out_bytes, dt, pkt, op)
        if kernel_dtype(dt).accumulates and any(c.channel_type == ChannelType.switch for g in plan.gpus
                                                for c in g.channels):
            raise InvalidCall(f"{desc}: switch-channel (NVLink multicast) reductions have no fp8 form")
        if self._capturing():
            raise NotPrepared(f"rank {r}: {desc} was not prepared: its first-time set-up "
                              "(device plan, scratch, kernel) cannot happen inside CUDA graph capture; call "
                              "prepare with the same tensors (or run the call once) before capturing")
        with self._calling(desc):
            f = self.kernels.interpreter(dt, pkt, op, lp.nthreads, epi=lp.epi is not None)
            dp = self.contexts.device_plan(lp, in_bytes, out_bytes, sym_in, sym_out, stream, row)
            self.kernels.fit(f, lp.nthreads, dp.smem, dp.n_blocks, f"rank {r}", dp.uses_packets,
                             dp.packet_align, pkt)
            port = self.port_launch(lp, dp, in_bytes, out_bytes) if lp.has_port else None
            spec, pending = None, None
            # port plans run on the interpreter (the specialised kernel has no port ops)
            if not lp.has_port:
                spec, pending = self._specialisation(lp, SpecKey(in_bytes, out_bytes, dt, pkt, op, row), dp, force,
                                                     sym_in, sym_out)
        return LaunchEntry(f, dp.blob, dp.n_blocks, lp.nthreads, dp.smem, cu.ptr(f), spec, pending, lp.ctx, port)

    def _specialisation(self, lp: LoadedPlan, skey: SpecKey, dp: DevPlan, force: bool, sym_in: Any,
                        sym_out: Any) -> tuple[Optional[SpecLaunch], Optional[Pending]]:
        """The specialised launch now (``force``: built on this thread), or what is pending."""
        w = when(self._specialize(), skey.in_bytes, skey.out_bytes)
        if w == "never":
            return None, None
        got = lp.spec.get(skey)
        if isinstance(got, str):   # refused earlier
            return None, None
        if got is not None:
            return self._spec_launch(got, dp, lp.ctx), None
        if force or self._specialize() == "always":
            # prepare (a capture follows), or the 'always' policy: built on this thread
            try:
                sp = self.kernels.specialised_now(generate(lp.plan, dp.packed, skey.dtype, skey.packet, skey.op))
            except SPEC_ERRORS as e:
                lp.spec[skey] = unsupported(e)
                return None, None
            lp.spec[skey] = sp
            return self._spec_launch(sp, dp, lp.ctx), None
        # 'first' sizes are built at their second call, 'hot' ones at the policy's count: a size
        # called once (a stream of new sizes) builds nothing
        pend = Pending(1 if w == "first" else settings.spec_hot_calls - 1, skey, sym_in, sym_out)
        if pend.calls <= 0:
            pend.build = self._start(lp, skey, dp)
            if pend.build is None:
                return None, None
        return None, pend

    def _start(self, lp: LoadedPlan, skey: SpecKey, dp: DevPlan) -> Any:
        plan, packed, dt, pkt, op = lp.plan, dp.packed, skey.dtype, skey.packet, skey.op
        return self.kernels.specialise_later(lambda: generate(plan, packed, dt, pkt, op))

    def _spec_launch(self, sp: Any, dp: DevPlan, ctx: Any) -> SpecLaunch:
        args = pack_args(sp.layout, dp.addr, ctx.sync, self.comm.rank)
        ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        return SpecLaunch(sp, args, ctypes.addressof(ptrs), ptrs)

    def advance(self, lp: LoadedPlan, key: EntryKey, ent: LaunchEntry, now: bool = False,
                capturing: Optional[bool] = None) -> LaunchEntry:
        """One more call of an entry whose specialised kernel is wanted (a resolved call, or a
        bound one: :meth:`Executor.launch_bound`): count it, start its background build at the
        policy's count, and switch to the kernel once built (``now``: prepare, build on this
        thread). Returns the entry to launch: another than ``ent`` once switched. Never inside a
        capture: ``capturing`` is whether the call's stream is capturing when the caller has just
        asked (a bound call asks the driver), else None and it is asked here."""
        pend = ent.pending
        if self._capturing() if capturing is None else capturing:
            return ent
        sk = pend.key
        if now:
            if pend.build is not None and pend.build.done():
                return self._switch(lp, key, ent, pend)
            new = self._build(lp, sk.dtype, sk.in_bytes, sk.out_bytes, sk.packet, sk.op, pend.sym_in, pend.sym_out,
                              True, 0, sk.row)
            new = _replace(new, pending=None)
            lp.fast[key] = new
            self.epoch += 1
            return new
        if pend.build is None:
            pend.calls -= 1
            if pend.calls > 0:
                return ent
            dp = device_plan_of(lp, ent)
            if dp is None:
                lp.fast[key] = new = _replace(ent, pending=None)
                return new
            pend.build = self._start(lp, sk, dp)
            if pend.build is None:
                pend.calls = 1   # the build queue is full: ask again at the next call
            return ent
        if not pend.build.done():
            return ent
        return self._switch(lp, key, ent, pend)

    def _switch(self, lp: LoadedPlan, key: EntryKey, ent: LaunchEntry, pend: Pending) -> LaunchEntry:
        skey = pend.key
        try:
            sp = self.kernels.finish(pend.build)
        except Exception as e:  # noqa: BLE001 - a failed background build never fails a call
            if not isinstance(e, SPEC_ERRORS):
                log.warning("rank %d: building the specialised kernel of %s failed (%s: %s); the interpreter "
                            "runs it", self.comm.rank, describe_call(lp.plan, skey.in_bytes, skey.out_bytes, skey.dtype, skey.packet, skey.op), type(e).__name__, e)
            lp.spec[skey] = unsupported(e)
            lp.fast[key] = new = _replace(ent, pending=None)
            self.epoch += 1
            return new
        lp.spec[skey] = sp
        dp = device_plan_of(lp, ent)
        spec = self._spec_launch(sp, dp, ent.ctx) if dp is not None and ent.ctx is not None else None
        lp.fast[key] = new = _replace(ent, spec=spec, pending=None)
        self.epoch += 1
        return new

    # port channels ------------------------------------------------------------------------------
    def port_launch(self, lp: LoadedPlan, dp: DevPlan, in_bytes: int, out_bytes: int,
                    peer_script: Optional[Callable[[int], Optional[PortScript]]] = None) -> Optional[PortLaunch]:
        """What the proxy needs for every launch of device plan ``dp`` (None: no port work on this
        rank). ``peer_script(q)``: rank ``q``'s port script at these sizes, for the copies a peer
        on another node sends here (default: ``q``'s plan packed at these sizes; a counted
        launch passes its own packing)."""
        plan = lp.plan
        r = self.comm.rank
        ctx = lp.ctx
        script = dp.packed.port
        incoming: list[Incoming] = []
        pin = lp.table(r).port_slots
        for g in plan.gpus:
            if g.id == r or self.topology.same_node(g.id, r):
                continue
            theirs = None
            for kq, c in enumerate(lp.table(g.id).port):
                if c.peer != r:
                    continue
                o = c.ordinal
                if theirs is None:
                    theirs = (peer_script(g.id) if peer_script is not None
                              else pack_blocks(plan, g.id, in_bytes, out_bytes).port)
                incoming.append(Incoming(theirs.channels[kq], ctx.sync_base + ctx.sync.port_inbound + 8 * pin[(g.id, o)],
                                         [rb.type for rb in g.remote_buffers],
                                         self.engine.comm(EngineKey(lp.serial, g.id, r, o))))
        if script is None and not incoming:
            return None
        if script is None:
            script = PortScript([])
        g = plan.gpus[r]
        remote_base: list[Optional[int]] = []
        for j, rb in enumerate(g.remote_buffers):
            remote_base.append(dp.addr.remote[j][0] if self.topology.same_node(r, rb.rank) else None)
        peer_inbound: list[Optional[int]] = []
        comms: list = []
        for k, c in enumerate(lp.table(r).port):
            q, o = c.peer, c.ordinal
            if self.topology.same_node(r, q):
                tq = lp.table(q)
                peer_inbound.append(ctx.peer_sync[q] + tq.sync.port_inbound + 8 * tq.port_slots[(r, o)])
                comms.append(None)
            else:
                peer_inbound.append(None)
                comms.append(self.engine.comm(EngineKey(lp.serial, r, q, o)))
        pl = PortLaunch(script, dp.port_area, remote_base,
                        [rb.type for rb in g.remote_buffers], ctx.scratch_base, peer_inbound, comms, incoming,
                        bounds=(in_bytes, out_bytes, ctx.scratch_bytes), abort_word=ctx.sync_base + SYNC_ABORT_OFF)
        self.proxy.prepare(len(script.channels) + len(incoming))
        return pl

    # bookkeeping --------------------------------------------------------------------------------
    def touch(self, lk: tuple) -> None:
        """A bound call ran (its entry is recently used): ``lk`` is its :class:`Bound`'s ``recent``
        key. The latest one touched is known by identity, so repeated launches of one bound call
        hash no key (an ``EntryKey`` hash is a Python call over nine fields)."""
        if lk is self._latest:
            return
        if lk in self._lru:
            self._lru.move_to_end(lk)
            self._latest = lk

    def forget(self, loaded: list[LoadedPlan], idx: set) -> None:
        """Drop the entries and device plans built on the buffers named by ``idx`` (symmetric
        allocation indices, registrations' ``Region.index``); the device is idle."""
        self.epoch += 1
        for lp in loaded:
            for k in [k for k in lp.fast if any(x in idx for x in k.buffers())]:
                del lp.fast[k]
                self._lru.pop((id(lp), k), None)
                self._pinned.discard((id(lp), k))
            drop_device_plans(lp, lambda dk: dk.in_buf in idx or dk.out_buf in idx)

    def clear(self, lp: LoadedPlan) -> None:
        """Forget every entry of ``lp`` (their device plans stay on the contexts)."""
        self.epoch += 1
        for k in list(lp.fast):
            self._lru.pop((id(lp), k), None)
            self._pinned.discard((id(lp), k))
        lp.fast.clear()

    def _evict(self, keep: tuple) -> None:
        """Evict a quarter of the cap of least recently used, unpinned entries, their device plans
        (when no entry kept uses them) and specialised modules (device synchronised first)."""
        victims = []
        want = max(1, self.cap // 4)
        for lk, lp in self._lru.items():
            if lk == keep or lk in self._pinned:
                continue
            victims.append((lk, lp))
            if len(victims) >= want:
                break
        if not victims:
            return
        cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        self.epoch += 1
        touched: dict[int, LoadedPlan] = {}
        for lk, lp in victims:
            self._lru.pop(lk, None)
            lp.fast.pop(lk[1], None)
            touched[id(lp)] = lp
        self.evicted += len(victims)
        for lp in touched.values():
            live = {e.blob for e in lp.fast.values()}
            drop_device_plans(lp, lambda dk, lp=lp, live=live: _blob_of(lp, dk) not in live)
        in_use = {e.spec.spec.name for lp in touched.values() for e in lp.fast.values() if e.spec is not None}
        for lp in touched.values():
            for sk in [sk for sk, v in lp.spec.items() if not isinstance(v, str) and v.name not in in_use]:
                del lp.spec[sk]
        self.kernels.trim(in_use | {v.name for lp in touched.values() for v in lp.spec.values()
                                    if not isinstance(v, str)})

    def count(self) -> int:
        """Live entries."""
        return len(self._lru)

    @contextlib.contextmanager
    def _calling(self, desc: str) -> Iterator[None]:
        """Name the call being set up in every store exchange it makes (CallMismatch otherwise)."""
        prev = getattr(self.comm, "call", "")
        try:
            self.comm.call = desc
        except AttributeError:  # a communicator without the attribute (tests' fakes)
            yield
            return
        try:
            yield
        finally:
            self.comm.call = prev


def _replace(ent: LaunchEntry, **kw: Any) -> LaunchEntry:
    import dataclasses

    return dataclasses.replace(ent, **kw)


def device_plan_of(lp: LoadedPlan, ent: LaunchEntry) -> Optional[DevPlan]:
    """The device plan an entry launches (on the plan's live or retired contexts), or None."""
    for ctx in [lp.ctx, *lp.retired]:
        if ctx is None:
            continue
        for dp in ctx.plans.values():
            if dp.blob == ent.blob:
                return dp
    return None


def _blob_of(lp: LoadedPlan, dk: Any) -> int:
    for ctx in [lp.ctx, *lp.retired]:
        if ctx is not None and dk in ctx.plans:
            return ctx.plans[dk].blob
    return -1
