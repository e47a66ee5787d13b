"""Port channels in the device plan: what the kernel posts and what the proxy must do.

A port channel's ops run in two places. The thread block that owns the channel posts *triggers*
(``put``, ``pws``, ``pwsf``, ``signal``), waits for the proxy (``flush``, and ``pwsf`` after its
trigger) and waits for the peer's signals (``wait``). The proxy (:mod:`mscclang.runtime.proxy`)
processes one channel's triggers in order: it copies the put's bytes into the peer's buffer, then,
for a signal, writes the channel's sent count into the peer's inbound counter, then marks the
trigger done. This module packs the kernel's side (device records) and, from the same walk of the
plan, the proxy's script for one message size (:class:`PortScript`): per channel, the triggers in
order with their copies as (buffer, offset) ranges. Addresses are filled per launch.

Numbering (the kernel computes the same numbers): the k-th trigger a launch posts on a channel is
``t = k`` (1-based); a trigger inside a pipeline op gets ``base + iteration * stride``. Signals
take consecutive slots of the channel the same way. At block exit the kernel sets each of its
channels' trigger word to the launch's final count, so no wait the proxy enqueued can outlive the
kernel, even when the block aborts.

Rules checked here (PlanError naming rank, thread block, op): a port op names exactly one channel
of the thread block; each port channel is used by one thread block; a port put copies from a
local buffer into a remote buffer reached through port channels; port ops are not in a
thread-block group and carry no packets; a plan with a double scratch buffer may not move scratch
through a port channel (the proxy's copies are enqueued with fixed addresses, the halves alternate
on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from mscclang.errors import PlanError
from mscclang.plan.models import BufferKind, ChannelType, Op, OpName, Plan, ThreadBlock

#: device op kinds (executor/plan_layout.cuh)
DOP_PORT_TRIGGER, DOP_PORT_FLUSH, DOP_PORT_FINAL = 8, 9, 10
#: DOP_PORT_TRIGGER flags (executor/primitives.cuh)
PORT_SIGNAL, PORT_FLUSH = 1, 2

PORT_DATA_OPS = frozenset({OpName.put, OpName.pws, OpName.pwsf})
PORT_SYNC_OPS = frozenset({OpName.signal, OpName.wait, OpName.flush})


def is_port_op(op: Op) -> bool:
    """Whether ``op`` (not a pipeline) runs on a port channel."""
    return op.channel_type == ChannelType.port or op.name in (OpName.flush, OpName.pws, OpName.pwsf)


def pair_slots(plan: Plan, rank: int, kind: ChannelType) -> dict[tuple[int, int], int]:
    """Slot of each inbound counter of ``rank`` for channels of ``kind``, keyed by (peer,
    ordinal): the peer's ordinal-th channel to this rank signals it, and this rank's ordinal-th
    channel to the peer waits on it (the pairing rule of
    :func:`mscclang.plan.models.paired_index`). A pair gets max(channels A->B, channels B->A)
    slots, so an unpaired channel still has a counter (a wait on it times out, as the simulator's
    deadlock report says, instead of failing the set-up)."""
    mine: dict[int, int] = {}
    for c in plan.channel_ordinals(rank, kind):
        mine[c.peer] = c.ordinal + 1
    theirs: dict[int, int] = {}
    for g in plan.gpus:
        if g.id == rank:
            continue
        for c in plan.channel_ordinals(g.id, kind):
            if c.peer == rank:
                theirs[g.id] = c.ordinal + 1
    slots: dict[tuple[int, int], int] = {}
    for q in sorted(set(mine) | set(theirs)):
        for o in range(max(mine.get(q, 0), theirs.get(q, 0))):
            slots[(q, o)] = len(slots)
    return slots


def port_inbound_slots(plan: Plan, rank: int) -> dict[tuple[int, int], int]:
    """:func:`pair_slots` of the port channels (the counters the peers' proxies write)."""
    return pair_slots(plan, rank, ChannelType.port)


@dataclass(frozen=True)
class Copy:
    """``length`` bytes from local buffer ``src`` at ``src_off`` to remote buffer ``dst`` (index
    into the rank's ``remote_buffers``) at ``dst_off``."""

    src: BufferKind
    src_off: int
    dst: int
    dst_off: int
    length: int


@dataclass
class Trigger:
    """One trigger of a channel: its number, copies, and the signal slot it publishes (or None)."""

    t: int
    copies: list[Copy] = field(default_factory=list)
    slot: Optional[int] = None
    op: str = ""     # "rank r thread block b op i" for error messages


@dataclass
class ChannelScript:
    """Everything the proxy does for one port channel in one launch."""

    index: int          # port channel index of the rank
    peer: int
    ordinal: int        # among this rank's port channels to ``peer``
    block: int          # the thread block that owns it
    triggers: list[Trigger] = field(default_factory=list)
    n_slots: int = 0


@dataclass
class PortScript:
    """The proxy's work for one rank at one message size, and the layout of the device plan's port
    area: one block per channel, ``{u32 trigger, u32 done, u64 slot[n_slots]}``. The host zeroes
    the whole area before every launch (the kernel writes a slot before its trigger)."""

    channels: list[ChannelScript]

    def block_offset(self, k: int) -> int:
        """Byte offset of channel k's block in the port area."""
        return sum(8 + 8 * c.n_slots for c in self.channels[:k])

    @property
    def area_bytes(self) -> int:
        return max(16, (self.block_offset(len(self.channels)) + 15) // 16 * 16)


@dataclass
class _Pending:
    """A trigger op inside a pipeline, expanded per iteration once the count is known."""

    ch: int
    rel_t: int
    rel_slot: Optional[int]
    pieces: list            # Piece-like (length, offsets) of the op's stream, or []
    kinds: tuple = ()       # (src kind, dst remote index) per copy pair
    op: str = ""


class PortPacker:
    """Port-channel part of one rank's packing (used by device_plan's packer)."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan = plan
        self.rank = rank
        self.gpu = plan.gpus[rank]
        self.n_mem = len(self.gpu.peers(ChannelType.memory))
        peers = plan.channel_ordinals(rank, ChannelType.port)
        self.scripts = [ChannelScript(k, c.peer, c.ordinal, -1) for k, c in enumerate(peers)]
        self.count = [0] * len(peers)     # triggers posted so far (this launch)
        self.slots = [0] * len(peers)
        self.pipe: Optional[dict] = None  # inside a pipeline: {"t": [...], "s": [...], "pending": [...], "recs": [...]}

    # ------------------------------------------------------------------------------------------
    def channel(self, op: Op, tb: ThreadBlock, index: int, where: str, n_max: int = 1) -> list[int]:
        """Port channel indices named by ``op`` (checked)."""
        lst = tb.channel_list(ChannelType.port)
        ids = list(op.channel_ids)
        if not ids or len(ids) > n_max:
            raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({op.name.value}) must name "
                            f"{'one port channel' if n_max == 1 else f'1..{n_max} port channels'}, got {ids}",
                            where + ".channel_ids")
        out = []
        for c in ids:
            if not 0 <= c < len(lst):
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({op.name.value}): channel id {c} is "
                                f"not in the thread block's {len(lst)} port channels", where + ".channel_ids")
            k = lst[c]
            if not 0 <= k < len(self.scripts):
                raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({op.name.value}): port channel {k} "
                                f"is not declared (rank has {len(self.scripts)})", where + ".channel_ids")
            s = self.scripts[k]
            if s.block not in (-1, tb.id):
                raise PlanError(f"rank {self.rank} port channel {k} is used by thread blocks {s.block} and {tb.id}; "
                                "a port channel's triggers must come from one thread block",
                                where + ".channel_ids")
            s.block = tb.id
            out.append(k)
        return out

    def check(self, op: Op, tb: ThreadBlock, index: int, where: str) -> None:
        if op.tbg_info is not None and op.tbg_info.tbg_size > 1:
            raise PlanError(f"rank {self.rank} thread block {tb.id} op {index} ({op.name.value}): port channel ops "
                            "cannot be shared by a thread-block group", where + ".tbg_info")

    # ------------------------------------------------------------------------------------------
    def _new_trigger(self, k: int) -> tuple[int, int, int]:
        """(t as the record stores it, stride, relative index) of a new trigger on channel k."""
        if self.pipe is None:
            self.count[k] += 1
            return self.count[k], 0, self.count[k]
        pt = self.pipe["t"]
        pt[k] += 1
        return self.count[k] + pt[k], 0, pt[k]

    def _new_slot(self, k: int) -> int:
        if self.pipe is None:
            self.slots[k] += 1
            return self.slots[k] - 1
        ps = self.pipe["s"]
        ps[k] += 1
        return self.slots[k] + ps[k] - 1

    def trigger(self, op: Op, tb: ThreadBlock, index: int, where: str, signal: bool, flush: bool,
                pairs: Sequence[tuple[BufferKind, int, list]], rec_factory) -> list:
        """Records of a put/pws/pwsf/signal on its channel. ``pairs``: (source kind, destination
        remote buffer index, pieces as (length, (src off, dst off))) per source/destination pair."""
        self.check(op, tb, index, where)
        ks = self.channel(op, tb, index, where, n_max=1 if pairs else 32)
        out = []
        for k in ks:
            out.append(self._trigger_one(k, op, tb, index, signal, flush, pairs, rec_factory))
        return out

    def _trigger_one(self, k: int, op: Op, tb: ThreadBlock, index: int, signal: bool, flush: bool,
                     pairs: Sequence[tuple[BufferKind, int, list]], rec_factory):
        t, _, rel = self._new_trigger(k)
        slot = self._new_slot(k) if signal else None
        label = f"rank {self.rank} thread block {tb.id} op {index} ({op.name.value})"
        flags = (PORT_SIGNAL if signal else 0) | (PORT_FLUSH if flush else 0)
        rec = rec_factory(DOP_PORT_TRIGGER, index, [self.n_mem + k], flags, t, slot or 0)
        pieces = [(src_kind, dst, pcs) for src_kind, dst, pcs in pairs]
        if self.pipe is None:
            trig = Trigger(t, [], slot, label)
            for src_kind, dst, pcs in pieces:
                for ln, (so, do) in pcs:
                    if ln:
                        trig.copies.append(Copy(src_kind, so, dst, do, ln))
            self.scripts[k].triggers.append(trig)
        else:
            self.pipe["pending"].append(_Pending(k, rel, None if slot is None else slot - self.slots[k], pieces,
                                                 (), label))
            self.pipe["recs"].append((rec, k, signal))
        return rec

    def flush(self, op: Op, tb: ThreadBlock, index: int, where: str, rec_factory) -> list:
        self.check(op, tb, index, where)
        return self.flush_channels(self.channel(op, tb, index, where, n_max=32), index, rec_factory)

    def flush_channels(self, ks: Sequence[int], index: int, rec_factory) -> list:
        """DOP_PORT_FLUSH records: wait until the proxy finished every trigger posted so far on
        each channel of ``ks``."""
        out = []
        for k in ks:
            if self.pipe is None:
                out.append(rec_factory(DOP_PORT_FLUSH, index, [self.n_mem + k], 0, self.count[k], 0))
            else:
                rec = rec_factory(DOP_PORT_FLUSH, index, [self.n_mem + k], 0, self.count[k] + self.pipe["t"][k], 0)
                self.pipe["recs"].append((rec, k, None))
                out.append(rec)
        return out

    def puts(self, op: Op, tb: ThreadBlock, index: int, where: str, signal: bool, flush: bool,
             pairs: Sequence[tuple[BufferKind, int, list]], rec_factory) -> list:
        """Records of a (possibly fused) put / pws / pwsf: source/destination pair i goes through
        the op's channel i (the last one for the pairs beyond), one trigger each (with a signal
        for pws/pwsf); a pwsf then waits for the proxy on every channel it used (the simulator's
        order)."""
        self.check(op, tb, index, where)
        ks = self.channel(op, tb, index, where, n_max=max(1, len(pairs)))
        out = []
        used: list[int] = []
        if flush and len(pairs) == 1:   # one trigger that waits for itself (one block barrier)
            return [self._trigger_one(ks[0], op, tb, index, signal, True, list(pairs), rec_factory)]
        for i, pair in enumerate(pairs):
            k = ks[min(i, len(ks) - 1)]
            out.append(self._trigger_one(k, op, tb, index, signal, False, [pair], rec_factory))
            if k not in used:
                used.append(k)
        if flush:
            out += self.flush_channels(sorted(used), index, rec_factory)
        return out

    def wait_ids(self, op: Op, tb: ThreadBlock, index: int, where: str) -> list[int]:
        self.check(op, tb, index, where)
        return [self.n_mem + k for k in self.channel(op, tb, index, where, n_max=32)]

    # pipelines ---------------------------------------------------------------------------------
    def begin_pipeline(self) -> None:
        n = len(self.scripts)
        self.pipe = {"t": [0] * n, "s": [0] * n, "pending": [], "recs": []}

    def pipe_totals(self) -> list[int]:
        """Stream lengths of the current pipeline's port puts (they count for its iterations)."""
        if self.pipe is None:
            return []
        return [sum(ln for ln, _ in pcs) for pend in self.pipe["pending"] for _, _, pcs in pend.pieces]

    def end_pipeline(self, iters: int, unit: int) -> None:
        """Patch the strides of the pipeline's port records and expand its triggers per iteration
        (iteration-major, the order the block posts them)."""
        p = self.pipe
        self.pipe = None
        if p is None:
            return
        for rec, k, signal in p["recs"]:
            if signal is None:          # flush: stride in total
                rec.total = p["t"][k]
            else:
                rec.total = p["t"][k] | (p["s"][k] << 32)
        for it in range(iters):
            lo, hi = it * unit, (it + 1) * unit
            for pend in p["pending"]:
                k = pend.ch
                t = self.count[k] + it * p["t"][k] + pend.rel_t
                slot = None if pend.rel_slot is None else self.slots[k] + it * p["s"][k] + pend.rel_slot
                trig = Trigger(t, [], slot, pend.op + f" iteration {it}")
                for src_kind, dst, pcs in pend.pieces:
                    for ln, (so, do), a in _clip(pcs, lo, hi):
                        trig.copies.append(Copy(src_kind, so, dst, do, ln))
                self.scripts[k].triggers.append(trig)
        for k in range(len(self.scripts)):
            self.count[k] += iters * p["t"][k]
            self.slots[k] += iters * p["s"][k]
        for s in self.scripts:
            s.triggers.sort(key=lambda x: x.t)

    # end ---------------------------------------------------------------------------------------
    def finals(self, tb: ThreadBlock, rec_factory) -> list:
        """DOP_PORT_FINAL records of the channels ``tb`` owns (the end of its region)."""
        return [rec_factory(DOP_PORT_FINAL, len(tb.ops), [self.n_mem + s.index], 0, self.count[s.index], 0)
                for s in self.scripts if s.block == tb.id]

    def script(self) -> Optional[PortScript]:
        if not self.scripts:
            return None
        for s in self.scripts:
            s.n_slots = self.slots[s.index]
            if s.block < 0:
                s.block = -1
        return PortScript(self.scripts)


def _clip(pcs: list, lo: int, hi: int) -> list:
    """Pieces (length, (src off, dst off)) of an op's byte stream, clipped to [lo, hi)."""
    out = []
    pos = 0
    for ln, offs in pcs:
        a, b = max(lo, pos), min(hi, pos + ln)
        if a < b:
            d = a - pos
            out.append((b - a, tuple(o + d for o in offs), a))
        pos += ln
        if pos >= hi:
            break
    return out


def check_port_plan(plan: Plan, rank: int) -> None:
    """Load-time rules for the port-channel ops of ``rank`` (the packer checks them again)."""
    g = plan.gpus[rank]
    pk = PortPacker(plan, rank)
    for tb in g.threadblocks:
        for i, op in enumerate(tb.ops):
            for j, o in enumerate(op.ops if op.name == OpName.pipeline and op.ops else [op]):
                if not is_port_op(o):
                    continue
                where = f"gpus[{rank}].threadblocks[{tb.id}].ops[{i}]" + (f".ops[{j}]" if op.name == OpName.pipeline else "")
                if o.name not in PORT_DATA_OPS | PORT_SYNC_OPS:
                    raise PlanError(f"rank {rank} thread block {tb.id} op {i} ({o.name.value}): port channels carry "
                                    "put, put_with_signal(_and_flush), signal, wait and flush only (no packets, no "
                                    "get)", where)
                pk.check(o, tb, i, where)
                pk.channel(o, tb, i, where, n_max=max(1, len(o.src_buff)) if o.name in PORT_DATA_OPS else 32)
                if plan.use_double_scratch_buffer and o.name in PORT_DATA_OPS and any(
                        b.type == BufferKind.scratch or (b.buffer_id is not None and _remote_kind(g, tb, b.buffer_id)
                                                         == BufferKind.scratch)
                        for b in list(o.src_buff) + list(o.dst_buff)):
                    raise PlanError(f"rank {rank} thread block {tb.id} op {i} ({o.name.value}) moves scratch through a "
                                    "port channel in a plan with use_double_scratch_buffer; the proxy's copies have "
                                    "fixed addresses while the halves alternate: use a single scratch buffer", where)


def _remote_kind(g, tb: ThreadBlock, buffer_id: int) -> Optional[BufferKind]:
    lst = tb.remote_buffer_list(ChannelType.port)
    if 0 <= buffer_id < len(lst) and 0 <= lst[buffer_id] < len(g.remote_buffers):
        return g.remote_buffers[lst[buffer_id]].type
    return None
