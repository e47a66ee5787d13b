"""Contexts: per loaded plan, the scratch and sync area of this rank and the peers' IPC mappings of
theirs, and the device plans built on them.

Making or growing a context is collective (an IPC handle exchange and store barriers): every
rank reaches it at the same call and decides alike, because the size is the scratch of the rank
that needs the most (:func:`~mscclang.runtime.device_plan.group_scratch_bytes`) and growth is
geometric (at least twice the previous size), so a stream of growing message sizes grows a
context only logarithmically often. An outgrown context is retired, not freed: prepared calls and
captured graphs keep running on it. A device plan is host work only (packing, one allocation and
an upload ordered on the launching stream): no store exchange, no device synchronisation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable, Optional

from mscclang.errors import NotPrepared, RuntimeUnavailable
from mscclang.plan.models import BufferKind, Plan
from mscclang.runtime import cuda as cu
from mscclang.runtime.device_plan import (
    KIND_CODE, MAX_FLAGS, SYNC_ABORT_OFF, SYNC_FLAGS_OFF, Addresses, SyncLayout, mapped_peers, pack_blob,
)
from mscclang.runtime.packing import group_scratch_bytes, pack_blocks
from mscclang.runtime.state import CachedAddresses, Context, DevPlan, DevPlanKey, LoadedPlan


class ContextPool:
    """The contexts of one executor's loaded plans. ``comm``: the runtime communicator (rank,
    store exchange, barriers); ``topology``: which peers share a node; ``engine``: the engine of
    port channels between nodes (connected at a plan's first context); ``error_record``: the
    device address of the executor's error record; ``capturing``: whether the caller is capturing
    a CUDA graph (set-up is refused then)."""

    def __init__(self, comm: Any, topology: Any, engine: Any, error_record: int,
                 capturing: Callable[[], bool]) -> None:
        self.comm = comm
        self.topology = topology
        self.engine = engine
        self.error_record = error_record
        self.capturing = capturing
        self._engine_serial = 0
        self._packed: "OrderedDict[tuple, Any]" = OrderedDict()   # (id(lp), in, out) -> PackedRank

    def packed(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, row: int = 0) -> Any:
        """This rank's plan packed for these sizes (a few recent sizes are kept: the collective
        API asks whether a size fits before the device plan of that size is built); ``row``: a
        row-chunked plan's input row bytes."""
        key = (id(lp), in_bytes, out_bytes, row)
        got = self._packed.get(key)
        if got is None or got[0] is not lp:
            got = (lp, pack_blocks(lp.plan, self.comm.rank, in_bytes, out_bytes, lp.static, row))
            self._packed[key] = got
            if len(self._packed) > 32:
                self._packed.popitem(last=False)
        return got[1]

    # contexts ---------------------------------------------------------------------------------
    def group_scratch(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, row: int = 0) -> int:
        """:func:`group_scratch_bytes` of the plan at this size (cached per size)."""
        key = (in_bytes, out_bytes, row)
        v = lp.group_scratch.get(key)
        if v is None:
            if len(lp.group_scratch) >= 1024:
                lp.group_scratch.clear()
            v = lp.group_scratch[key] = group_scratch_bytes(lp.plan, in_bytes, out_bytes, row)
        return v

    def ensure(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, row: int = 0, need: Optional[int] = None) -> Context:
        """The plan's context, made or grown (collective, see the module docstring); ``need``: the
        scratch bytes when the sizes do not say (a plan with segments: its call's slots)."""
        ctx = lp.ctx
        need = self.group_scratch(lp, in_bytes, out_bytes, row) if need is None else need
        if ctx is not None and ctx.scratch_bytes >= need:
            return ctx
        if self.capturing():
            raise NotPrepared(f"rank {self.comm.rank}: plan {lp.plan.name} needs {need} B of "
                              "scratch; first-time set-up cannot happen inside CUDA graph capture: prepare the "
                              "call (or run it once) before capturing")
        cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        size = need
        if ctx is not None:
            self.comm.barrier("grow context")
            size = max(size, 2 * ctx.scratch_bytes)   # geometric: few contexts per plan, at most 2x held
            lp.retired.append(ctx)
        lp.ctx = self._make(lp, size)
        # a peer still compiling or setting up must not look like a hang: meet before launching
        self.comm.barrier("context ready")
        return lp.ctx

    def _make(self, lp: LoadedPlan, scratch_bytes: int) -> Context:
        comm = self.comm
        plan = lp.plan
        r = comm.rank
        sync = lp.table(r).sync
        scratch_bytes = max(int(scratch_bytes), 256)
        sync_base = cu.mem_alloc(sync.size)
        scratch_base = cu.mem_alloc(scratch_bytes)
        peer_sync: dict[int, int] = {}
        peer_scratch: dict[int, int] = {}
        try:
            self.init_sync(plan, sync, sync_base)
            cu.memset_d8(scratch_base, 0, scratch_bytes, 0)
            cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
            mine = cu.ipc_handle(sync_base) + cu.ipc_handle(scratch_base)
            allh = comm.allgather_bytes(mine, f"context of plan {plan.name}")   # scratch sizes may differ by rank
            if lp.engine_keys and lp.serial < 0:
                lp.serial = self._engine_serial
                self._engine_serial += 1
                lp.engine_keys = [replace(k, namespace=lp.serial) for k in lp.engine_keys]
                self.engine.connect(lp.engine_keys, comm.allgather_bytes)
            for q in mapped_peers(plan, r, self.topology):
                peer_sync[q] = cu.ipc_open(allh[q][:64])
                peer_scratch[q] = cu.ipc_open(allh[q][64:128])
        except BaseException:
            # e.g. CallMismatch: the ranks disagreed; leave nothing behind, the next call retries
            for p in list(peer_sync.values()) + list(peer_scratch.values()):
                cu.ipc_close(p)
            cu.mem_free(sync_base)
            cu.mem_free(scratch_base)
            raise
        return Context(sync, sync_base, scratch_base, scratch_bytes, peer_sync, peer_scratch)

    def init_sync(self, plan: Plan, sync: SyncLayout, base: int) -> None:
        """Zero a sync area, flags at 1, semaphores at their initial values."""
        cu.memset_d8(base, 0, sync.size, 0)
        cu.memset_d32(base + SYNC_FLAGS_OFF, 1, MAX_FLAGS, 0)
        sems = plan.gpus[self.comm.rank].semaphores
        if sems:
            data = b"".join(int(s.init_value).to_bytes(8, "little", signed=True) for s in sems)
            cu.htod(base + sync.semaphores, data, 0)

    def reset(self, lp: LoadedPlan) -> None:
        """Clear every context of ``lp`` (the device is idle): sync areas and scratch."""
        for ctx in [lp.ctx, *lp.retired]:
            if ctx is not None:
                self.init_sync(lp.plan, ctx.sync, ctx.sync_base)
                cu.memset_d8(ctx.scratch_base, 0, ctx.scratch_bytes, 0)

    def free(self, lp: LoadedPlan) -> None:
        """Free every context of ``lp`` and its device plans (the device is idle)."""
        for ctx in [lp.ctx, *lp.retired]:
            if ctx is None:
                continue
            for p in list(ctx.peer_sync.values()) + list(ctx.peer_scratch.values()):
                cu.ipc_close(p)
            for dp in ctx.plans.values():
                free_device_plan(dp)
            cu.mem_free(ctx.sync_base)
            cu.mem_free(ctx.scratch_base)
        lp.ctx = None
        lp.retired.clear()

    # device plans ---------------------------------------------------------------------------------
    def device_plan(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, sym_in: Any, sym_out: Any,
                    stream: int = 0, row: int = 0) -> DevPlan:
        """The device plan of these sizes and buffers on the plan's context (made or grown first),
        built now if new: packed on the host, uploaded on ``stream`` (ordered before the launch that
        follows on it); ``row``: a row-chunked plan's input row bytes."""
        ctx = self.ensure(lp, in_bytes, out_bytes, row)
        key = DevPlanKey(in_bytes, out_bytes, getattr(sym_in, "index", None), getattr(sym_out, "index", None), row)
        dp = ctx.plans.get(key)
        return dp if dp is not None else self.upload(lp, ctx, key, self.packed(lp, in_bytes, out_bytes, row),
                                                     sym_in, sym_out, stream)

    def upload(self, lp: LoadedPlan, ctx: Context, key: DevPlanKey, packed: Any, sym_in: Any, sym_out: Any,
               stream: int, finish: Optional[Callable[[bytes], bytes]] = None) -> DevPlan:
        """Device plan ``key`` on ``ctx`` from a rank's ``packed`` blocks: its port area (zeroed),
        its addresses and its blob (``finish``: what a counted launch appends to it), uploaded on
        ``stream``."""
        area = 0
        if packed.port is not None:
            area = cu.mem_alloc(packed.port.area_bytes)
            cu.memset_d8(area, 0, packed.port.area_bytes, stream)
        addr = self.addresses(lp, ctx, sym_in, sym_out, packed, area)
        blob = pack_blob(lp.plan, packed, addr, ctx.sync)
        blob = finish(blob) if finish is not None else blob
        p = cu.mem_alloc(len(blob))
        cu.htod(p, blob, stream)
        ctx.plans[key] = dp = DevPlan(p, len(blob), len(packed.blocks), packed.smem, packed.packet_align,
                                      packed.uses_packets, packed, addr, area)
        return dp

    def addresses(self, lp: LoadedPlan, ctx: Context, sym_in: Any, sym_out: Any, packed: Any = None,
                  area: int = 0) -> Addresses:
        """The device addresses of a device plan on ``ctx``: sync area, scratch, channels, and the
        peers' buffers (scratch mappings, or ``sym_in``/``sym_out``'s peer bases: a symmetric
        allocation or a registration)."""
        port = packed is not None and packed.port is not None
        key = (id(ctx), id(sym_in), id(sym_out))
        bases = (_bases(sym_in), _bases(sym_out))
        got = None if port else lp.addresses.get(key)
        if (got is not None and got.ctx is ctx and got.sym_in is sym_in and got.sym_out is sym_out
                and got.bases == bases):
            return got.addr
        plan = lp.plan
        r = self.comm.rank
        g = plan.gpus[r]
        me = lp.table(r)
        remote = []
        for rb in g.remote_buffers:
            if not self.topology.same_node(r, rb.rank):
                remote.append((0, KIND_CODE[rb.type]))   # reached only through the engine
                continue
            if rb.type == BufferKind.scratch:
                base = ctx.peer_scratch[rb.rank]
            else:
                sa = sym_in if rb.type == BufferKind.input else sym_out
                if sa is None:
                    raise RuntimeUnavailable("internal: zero-copy plan without symmetric buffers")
                base = sa.peer_bases[rb.rank]
            remote.append((base, KIND_CODE[rb.type]))
        chans = []
        for j, c in enumerate(me.memory):
            q = c.peer
            tq = lp.table(q)
            chans.append((ctx.sync_base + ctx.sync.inbound + 8 * me.memory_slots[(q, c.ordinal)],
                          ctx.peer_sync[q] + tq.sync.inbound + 8 * tq.memory_slots[(r, c.ordinal)],
                          ctx.sync_base + ctx.sync.expected + 8 * j))
        if port:
            for k, c in enumerate(me.port):
                chans.append((ctx.sync_base + ctx.sync.port_inbound + 8 * me.port_slots[(c.peer, c.ordinal)],
                              area + packed.port.block_offset(k),
                              ctx.sync_base + ctx.sync.port_counters + 16 * k))
        peers = mapped_peers(plan, r, self.topology)
        # one half size per context: launches of different sizes must never overlap halves
        half = (ctx.scratch_bytes // 2) // 16 * 16 if plan.use_double_scratch_buffer else 0
        addr = Addresses(ctx.sync_base, ctx.scratch_base, half, self.error_record,
                         [ctx.peer_sync[q] + SYNC_ABORT_OFF for q in peers], remote, chans)
        if not port:
            if len(lp.addresses) >= 256:
                lp.addresses.clear()
            # the objects and their peers' bases are kept with the addresses: an id reused by a
            # new buffer, or a buffer whose peers' mappings changed, never matches
            lp.addresses[key] = CachedAddresses(ctx, sym_in, sym_out, bases, addr)
        return addr

    def memory(self, lp: LoadedPlan, out: dict[str, int]) -> None:
        """Add ``lp``'s contexts and device plans to a memory report."""
        for ctx, live in [(lp.ctx, True)] + [(c, False) for c in lp.retired]:
            if ctx is None:
                continue
            pre = "" if live else "retired_"
            out[pre + "scratch"] += ctx.scratch_bytes
            out[pre + "sync"] += ctx.sync.size
            out["contexts" if live else "retired_contexts"] += 1
            out["device_plans"] += sum(dp.nbytes for dp in ctx.plans.values())


def _bases(buf: Any) -> Optional[tuple]:
    """The peers' bases of a symmetric buffer or registration, as a comparable value."""
    pb = getattr(buf, "peer_bases", None)
    return None if pb is None else tuple(sorted(pb.items()))


def free_device_plan(dp: DevPlan) -> None:
    """Free a device plan's memory (the device finished with it)."""
    cu.mem_free(dp.blob)
    if dp.port_area:
        cu.mem_free(dp.port_area)


def drop_device_plans(lp: LoadedPlan, doomed: Optional[Callable[[DevPlanKey], bool]]) -> int:
    """Free the device plans of ``lp``'s contexts for which ``doomed(key)`` holds (every one when
    ``doomed`` is None); the device is idle. Returns how many."""
    n = 0
    for ctx in [lp.ctx, *lp.retired]:
        if ctx is None:
            continue
        for k in [k for k in ctx.plans if doomed is None or doomed(k)]:
            free_device_plan(ctx.plans.pop(k))
            n += 1
    return n
