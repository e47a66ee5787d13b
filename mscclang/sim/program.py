"""Compile a plan, for one message size, into per-block lists of resolved ops.

Resolution turns buffer references into operands (rank, buffer kind, packet or plain) and byte
pieces through :mod:`mscclang.plan.layout` (the only byte math), applies thread-block-group and
pipeline slicing, and checks bounds. The result does not depend on the launch, the packet type
or the schedule, so one compiled program serves every run at that size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

from mscclang.errors import PlanError
from mscclang.plan.layout import (
    Layout,
    counted_layouts,
    Piece,
    group_slice,
    iteration_slice,
    make_layouts,
    near_equal_split,
    pipeline_iterations,
    total_length,
)
from mscclang.plan.models import (PACKET_DST_FROM, PACKET_SRC_FROM, PAIRWISE_OPS, BufferKind, BufferRef, ChannelType,
                                  Op, OpName, Plan, ThreadBlock)
from mscclang.plan.segments import CountedCall, moves_whole_slots, segment_span

DATA_OPS = frozenset({
    OpName.put, OpName.pws, OpName.pwsf, OpName.get, OpName.copy, OpName.cpkt, OpName.upkt,
    OpName.ppkt, OpName.rppkt, OpName.re, OpName.res, OpName.rre, OpName.rres, OpName.repkt,
    OpName.respkt, OpName.recpkt, OpName.recspkt, OpName.glre, OpName.glres, OpName.gstore,
    OpName.gstorepkt, OpName.radd,
})


@dataclass(frozen=True)
class Operand:
    """A buffer an op reads or writes: ``rank``'s buffer ``kind``; ``packet``: LL packets in
    scratch (plain offsets are payload offsets; the bytes live at twice the offset)."""

    rank: int
    kind: BufferKind
    packet: bool = False


@dataclass
class Group:
    """Sources reduced (or one source copied) into every destination, chunk by chunk."""

    srcs: list[Operand]
    dsts: list[Operand]
    pieces: list[Piece]                     # offsets: srcs then dsts
    reduce: bool = False
    pads: list[tuple[int, int, int]] = field(default_factory=list)  # (dst index, start, end)
    channel: Optional[int] = None           # port channel (global index) for proxy puts

    def stream_length(self) -> int:
        return total_length(self.pieces)


@dataclass
class COp:
    """One resolved op of a thread block."""

    index: str
    op: Op
    groups: list[Group] = field(default_factory=list)
    channels: list[int] = field(default_factory=list)    # global channel indexes
    iterations: list[list["COp"]] = field(default_factory=list)  # pipelines

    @property
    def name(self) -> str:
        return self.op.name.value


@dataclass
class Program:
    """A plan resolved for one message size."""

    plan: Plan
    input_bytes: int
    output_bytes: int
    layouts: list[Layout]
    blocks: list[list[list[COp]]]          # [rank][tb] -> ops

    def groups(self) -> Iterator[Group]:
        """Every group of every op of every block, a pipeline's iterations' included."""
        def walk(cops: list[COp]) -> Iterator[Group]:
            for c in cops:
                yield from c.groups
                for it in c.iterations:
                    yield from walk(it)
        return (g for blocks in self.blocks for cops in blocks for g in walk(cops))


def _where(rank: int, tb: int, index: str, name: str) -> str:
    return f"rank {rank} tb {tb} op {index} ({name})"


class _Resolver:
    def __init__(self, plan: Plan, layouts: list[Layout], counted: Optional[CountedCall] = None) -> None:
        self.plan = plan
        self.layouts = layouts
        self.counted = counted

    def segment_pieces(self, operands: list[Operand], refs: list[BufferRef], size: int, where: str,
                       whole: bool = False) -> list[Piece]:
        """The pieces of an op over segments: segment ``t`` of every operand is one piece of its
        count's rows (zero-row segments move nothing), adjacent pieces merged; with ``whole``
        (a port put, :func:`mscclang.plan.segments.moves_whole_slots`) the piece is the whole
        scratch slot, ``capacity`` rows whatever the count, as the copy engine moves it."""
        c = self.counted
        if c is None:
            raise PlanError(f"{where}: the plan moves segments: a run needs the call's counts")
        out: list[Piece] = []
        for t in range(size):
            spans = [segment_span(self.plan, c, o.rank, o.kind, r.index + t) for o, r in zip(operands, refs)]
            length = (c.capacity if whole else spans[0].rows) * c.row_bytes
            if length <= 0:
                continue
            offs = tuple(sp.start * c.row_bytes for sp in spans)
            if out and all(p + out[-1].length == o for p, o in zip(out[-1].offsets, offs)):
                out[-1] = Piece(out[-1].offsets, out[-1].length + length)
            else:
                out.append(Piece(offs, length))
        return out

    def ref(self, rank: int, tb: ThreadBlock, op: Op, ref: BufferRef, packet: bool,
            where: str) -> list[Operand]:
        gpu = self.plan.gpus[rank]
        if ref.type is not None:
            return [Operand(rank, ref.type, packet)]
        if ref.buffer_id is not None:
            lst = tb.remote_buffer_list(op.channel_type)
            if ref.buffer_id >= len(lst):
                raise PlanError(f"{where}: buffer_id {ref.buffer_id} is not in the thread block's "
                                f"remote_buffer_refs for {op.channel_type.value} ({len(lst)} entries)")
            k = lst[ref.buffer_id]
            if k >= len(gpu.remote_buffers):
                raise PlanError(f"{where}: remote buffer {k} does not exist on rank {rank}")
            rb = gpu.remote_buffers[k]
            if rb.rank >= len(self.plan.gpus):
                raise PlanError(f"{where}: remote buffer names rank {rb.rank}, not in the plan")
            return [Operand(rb.rank, rb.type, packet)]
        lst = tb.channel_list(ChannelType.switch)
        sid = ref.switch_channel_id
        assert sid is not None
        if sid >= len(lst):
            raise PlanError(f"{where}: switch_channel_id {sid} is not in the thread block's switch channels")
        groups = gpu.switch_groups()
        g = lst[sid]
        if g >= len(groups):
            raise PlanError(f"{where}: switch channel {g} does not exist on rank {rank}")
        kind, ranks = groups[g]
        return [Operand(r, kind, packet) for r in ranks]

    def channels(self, rank: int, tb: ThreadBlock, op: Op, where: str) -> list[int]:
        if op.channel_type == ChannelType.none:
            return []
        lst = tb.channel_list(op.channel_type)
        out = []
        for c in op.channel_ids:
            if c >= len(lst):
                raise PlanError(f"{where}: channel id {c} is not in the thread block's "
                                f"{op.channel_type.value} channels ({len(lst)} entries)")
            out.append(lst[c])
        if op.channel_type in (ChannelType.memory, ChannelType.port):
            npeers = len(self.plan.gpus[rank].peers(op.channel_type))
            for g in out:
                if g >= npeers:
                    raise PlanError(f"{where}: {op.channel_type.value} channel {g} does not exist on rank {rank}")
        return out

    def groups(self, rank: int, tb: ThreadBlock, op: Op, where: str) -> list[Group]:
        name = op.name
        lay = self.layouts[rank]
        srcs_r, dsts_r = op.src_buff, op.dst_buff
        if not srcs_r or not dsts_r:
            raise PlanError(f"{where}: needs at least one source and one destination")

        def pk_src(i: int) -> bool:
            if name == OpName.gstorepkt:
                return srcs_r[i].type == BufferKind.scratch
            return name in PACKET_SRC_FROM and i >= PACKET_SRC_FROM[name]

        def pk_dst(i: int) -> bool:
            return name in PACKET_DST_FROM and i >= PACKET_DST_FROM[name]

        plans: list[tuple[list[int], list[int], bool]] = []
        if name in PAIRWISE_OPS:
            if len(srcs_r) == len(dsts_r):
                plans = [([i], [i], False) for i in range(len(srcs_r))]
            elif len(srcs_r) == 1:
                plans = [([0], list(range(len(dsts_r))), False)]
            else:
                raise PlanError(f"{where}: {len(srcs_r)} sources and {len(dsts_r)} destinations do not pair up")
        elif name == OpName.gstore or name == OpName.gstorepkt:
            plans = [([0], list(range(len(dsts_r))), False)]
        elif name == OpName.radd:  # r[dst] = src + r[dst]: the residual is the second source
            srcs_r = [srcs_r[0], dsts_r[0]]
            plans = [([0, 1], [0], True)]
        else:  # a reduction: its sources in their reduction order (Op.reduction_order)
            plans = [(op.reduction_order(), list(range(len(dsts_r))), True)]
        out: list[Group] = []
        chans = self.channels(rank, tb, op, where) if op.channel_type == ChannelType.port else []
        for gi, (si, di, red) in enumerate(plans):
            refs = [srcs_r[i] for i in si] + [dsts_r[i] for i in di]
            size = refs[0].size
            for r in refs:
                if r.size != size:
                    raise PlanError(f"{where}: operands span different chunk counts ({r.size} vs {size})")
            srcs: list[Operand] = []
            dsts: list[Operand] = []
            src_refs: list[BufferRef] = []
            dst_refs: list[BufferRef] = []
            for i in si:
                ops_ = self.ref(rank, tb, op, srcs_r[i], pk_src(i), where)
                srcs.extend(ops_)
                src_refs.extend([srcs_r[i]] * len(ops_))
            for i in di:
                ops_ = self.ref(rank, tb, op, dsts_r[i], pk_dst(i), where)
                dsts.extend(ops_)
                dst_refs.extend([dsts_r[i]] * len(ops_))
            if len(srcs) > 1 and not red:
                raise PlanError(f"{where}: a copy needs exactly one source")
            if self.plan.gpus[(srcs + dsts)[0].rank].segmented((srcs + dsts)[0].kind) is not None:
                g = Group(srcs, dsts, self.segment_pieces(srcs + dsts, src_refs + dst_refs, size, where,
                                                          moves_whole_slots(op)), red, [],
                          chans[min(gi, len(chans) - 1)] if chans else None)
                g._chunk_lens = []  # type: ignore[attr-defined]
                out.append(g)
                continue
            operands = [(o.kind, r.index) for o, r in zip(srcs + dsts, src_refs + dst_refs)]
            for o, r in zip(srcs + dsts, src_refs + dst_refs):
                if o.packet and o.kind != BufferKind.scratch:
                    raise PlanError(f"{where}: packets must live in scratch, not buffer {o.kind.value!r}")
                nchunks = self._nchunks(o)
                if r.index + r.size > nchunks:
                    raise PlanError(f"{where}: chunks {r.index}..{r.index + r.size - 1} of rank {o.rank} "
                                    f"buffer {o.kind.value!r} are out of range ({nchunks} chunks)")
            pieces = lay.pieces(operands, size)
            pads: list[tuple[int, int, int]] = []
            if any(d.packet for d in dsts):
                # slot tails past the data are written as zero-payload packets
                for t in range(size):
                    ln: Optional[int] = None
                    for kind, idx in operands:
                        if kind != BufferKind.scratch:
                            _, l2 = lay.span(kind, idx + t)
                            ln = l2 if ln is None else min(ln, l2)
                    if ln is None or ln >= lay.chunk_bytes:
                        continue
                    for k, (d, r) in enumerate(zip(dsts, dst_refs)):
                        if d.packet:
                            s0 = (r.index + t) * lay.chunk_bytes
                            pads.append((k, t, s0 + ln, s0 + lay.chunk_bytes))  # type: ignore[arg-type]
            ch = chans[min(gi, len(chans) - 1)] if chans else None
            g = Group(srcs, dsts, pieces, red, pads, ch)
            g._chunk_lens = self._chunk_lens(lay, operands, size)  # type: ignore[attr-defined]
            out.append(g)
        return out

    def norm_group(self, rank: int, tb: ThreadBlock, op: Op, where: str) -> list[Group]:
        """An rmsnorm's one group: the residual range it reads (one piece, its byte extent) and
        the output it writes; the rows are cut at execution, where the row length is known."""
        if len(op.src_buff) != 1 or len(op.dst_buff) != 1:
            raise PlanError(f"{where}: rmsnorm takes one source and one destination")
        s, d = op.src_buff[0], op.dst_buff[0]
        lay = self.layouts[rank]
        src = self.ref(rank, tb, op, s, False, where)[0]
        dst = self.ref(rank, tb, op, d, False, where)[0]
        for o, r in ((src, s), (dst, d)):
            if r.index + r.size > self._nchunks(o):
                raise PlanError(f"{where}: chunks {r.index}..{r.index + r.size - 1} of buffer "
                                f"{o.kind.value!r} are out of range ({self._nchunks(o)} chunks)")
        a, b = lay.ref_span(s.type, s.index, s.size)  # type: ignore[arg-type]
        oa, _ = lay.ref_span(d.type, d.index, d.size)  # type: ignore[arg-type]
        return [Group([src], [dst], [Piece((a, oa), b - a)])]

    def _chunk_lens(self, lay: Layout, operands, size: int) -> list[int]:
        lens = []
        for t in range(size):
            ln = None
            for kind, idx in operands:
                if kind != BufferKind.scratch:
                    _, l2 = lay.span(kind, idx + t)
                    ln = l2 if ln is None else min(ln, l2)
            lens.append(lay.chunk_bytes if ln is None else max(ln, 0))
        return lens

    def _nchunks(self, o: Operand) -> int:
        return self.plan.gpus[o.rank].chunks(o.kind)


def _owner(total: int, pos: int, size: int, alignment: int) -> int:
    """The member of a group of ``size`` whose share of ``total`` stream bytes holds ``pos``."""
    if size <= 1:
        return 0
    unit = max(alignment, 8)
    nunits = -(-total // unit)
    u = pos // unit
    for m in range(size):
        s, e = near_equal_split(nunits, size, m)
        if s <= u < e:
            return m
    return size - 1


def _slice_group(g: Group, pieces: list[Piece], pads: list[tuple[int, int, int]]) -> Group:
    return Group(g.srcs, g.dsts, pieces, g.reduce, pads, g.channel)


def _pads_for(g: Group, member: int, size: int, alignment: int, iteration: Optional[int],
              unit: Optional[int]) -> list[tuple[int, int, int]]:
    """Pads this (member, iteration) writes: those of chunks whose data ends in its share."""
    if not g.pads:
        return []
    lens: list[int] = g._chunk_lens  # type: ignore[attr-defined]
    ends = []
    acc = 0
    for ln in lens:
        acc += ln
        ends.append(acc)
    total = acc
    out = []
    for (k, t, a, b) in g.pads:  # type: ignore[misc]
        pos = max(ends[t] - 1, 0)
        if unit is not None:
            it = pos // unit
            if it != iteration:
                continue
            sl_total = min(total, (it + 1) * unit) - it * unit
            m = _owner(sl_total, pos - it * unit, size, alignment)
        else:
            m = _owner(total, pos, size, alignment)
        if m == member:
            out.append((k, a, b))
    return out


def sim_program(plan: Plan, input_bytes: int, output_bytes: int, row_bytes: int = 0,
                counted: Optional[CountedCall] = None) -> Program:
    """Resolve every op of every block of ``plan`` for the given byte sizes (``row_bytes``: a
    row-chunked fused plan's input row, :func:`mscclang.plan.layout.make_layout`). A plan with
    segments is resolved for one call, ``counted`` (its counts and sizes; ``input_bytes`` and
    ``output_bytes`` are then rank 0's)."""
    if counted is not None:
        rb = counted.row_bytes
        layouts = counted_layouts(plan, [v * rb for v in counted.in_rows], [v * rb for v in counted.out_rows],
                                  counted.capacity * rb)
    else:
        layouts = make_layouts(plan, input_bytes, output_bytes, row_bytes)
    res = _Resolver(plan, layouts, counted)
    align = plan.buffer_alignment
    blocks: list[list[list[COp]]] = []
    for r, gpu in enumerate(plan.gpus):
        rank_blocks = []
        for tb in gpu.threadblocks:
            rank_blocks.append([_compile_op(res, r, tb, op, str(i), align) for i, op in enumerate(tb.ops)])
        blocks.append(rank_blocks)
    return Program(plan, input_bytes, output_bytes, layouts, blocks)


def _member(op: Op) -> tuple[int, int]:
    if op.tbg_info is None:
        return 0, 1
    return op.tbg_info.tb_id, op.tbg_info.tbg_size


def _compile_op(res: _Resolver, r: int, tb: ThreadBlock, op: Op, index: str, align: int) -> COp:
    where = _where(r, tb.id, index, op.name.value)
    if op.name == OpName.pipeline:
        assert op.iter_context is not None and op.ops is not None
        unit = op.iter_context.unit_size
        inner_full = []
        for k, inner in enumerate(op.ops):
            iw = _where(r, tb.id, f"{index}.{k}", inner.name.value)
            if inner.name in DATA_OPS:
                inner_full.append(res.groups(r, tb, inner, iw))
            else:
                inner_full.append(None)
        lengths = [g.stream_length() for gs in inner_full if gs for g in gs]
        niter = pipeline_iterations(lengths, unit)
        c = COp(index, op)
        for j in range(niter):
            it_ops = []
            for k, inner in enumerate(op.ops):
                sub = f"{index}.{k}"
                gs = inner_full[k]
                if gs is None:
                    it_ops.append(COp(sub, inner, [], res.channels(r, tb, inner, _where(r, tb.id, sub, inner.name.value))))
                    continue
                m, size = _member(inner)
                sliced = []
                for g in gs:
                    p = group_slice(iteration_slice(g.pieces, j, unit), m, size, align)
                    sliced.append(_slice_group(g, p, _pads_for(g, m, size, align, j, unit)))
                it_ops.append(COp(sub, inner, sliced, res.channels(r, tb, inner, where) if inner.channel_type != ChannelType.none else []))
            c.iterations.append(it_ops)
        return c
    if op.name in DATA_OPS:
        gs = res.groups(r, tb, op, where)
        m, size = _member(op)
        if size > 1:
            gs = [_slice_group(g, group_slice(g.pieces, m, size, align), _pads_for(g, m, size, align, None, None)) for g in gs]
        else:
            gs = [_slice_group(g, g.pieces, [(k, a, b) for (k, _t, a, b) in g.pads]) for g in gs]  # type: ignore[misc]
        chans = res.channels(r, tb, op, where) if op.channel_type == ChannelType.port else []
        return COp(index, op, gs, chans)
    if op.name == OpName.rmsnorm:
        return COp(index, op, res.norm_group(r, tb, op, where), [])
    return COp(index, op, [], res.channels(r, tb, op, where))
