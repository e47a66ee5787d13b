"""Pass 6: channel and remote-buffer numbering, and emission of the plan.

* Per rank, channel descriptors: one ``memory`` descriptor listing the memory channels' peers in
  creation order, then one ``port`` descriptor, then the switch channels in creation order
  (consecutive ones over the same buffer kind share one descriptor, one rank group each).
* Per rank, ``remote_buffers``: one entry per (peer, buffer kind) the rank accesses, in order of
  first use (blocks in id order, ops in order, sources before destinations), with the channel
  types used to access it.
* Per thread block: its channels of each type and the remote buffers of each access type, in
  order of first use; ops refer to them by thread-block-local index (``channel_ids``,
  ``buffer_id``, ``switch_channel_id``).
* ``channel_ids`` of an op: for ``put``/``pws``/``pwsf``/``ppkt``/``rppkt``/``get`` one entry per
  remote operand (the channel that reaches it); for signal/wait/flush and reductions the distinct
  channels the op uses.
* Each op's ``src``: the program line that recorded it (see :mod:`mscclang.compiler.source`).
* Plan fields of ours: ``num_ranks``, ``chunk_factor`` (the collective's factor times
  ``instances``; not for test collectives, whose chunk counts are free), ``root`` (broadcast), ``reduce_op`` when every reduction of the program uses the
  same operator.
"""

from __future__ import annotations

from typing import Iterator

from mscclang.compiler.ir import IROp, IRProgram, IRRank, Ref
from mscclang.compiler.meter import each_rank
from mscclang.plan.models import (
    EPILOGUE_OPS,
    REDUCE_OPS,
    BufferRef,
    ChannelDesc,
    ChannelType,
    Gpu,
    IterContext,
    Op,
    OpName,
    Plan,
    RankGroup,
    RemoteBuffer,
    RemoteBufferRefs,
    SegmentedBuffer,
    SemaphoreDesc,
    TbgInfo,
    ThreadBlock,
    ThreadBlockChannels,
    plan_format,
)

_TYPES = (ChannelType.memory, ChannelType.port, ChannelType.switch)


def _all_ops(ops: list[IROp]) -> Iterator[IROp]:
    for op in ops:
        yield op
        yield from op.body or ()


def _channel_descs(r: IRRank) -> list[ChannelDesc]:
    out: list[ChannelDesc] = []
    if r.memory:
        out.append(ChannelDesc(channel_type=ChannelType.memory, connected_to=list(r.memory)))
    if r.port:
        out.append(ChannelDesc(channel_type=ChannelType.port, connected_to=list(r.port)))
    for sw in r.switch:
        group = RankGroup(size=len(sw.ranks), ranks=list(sw.ranks))
        if out and out[-1].channel_type == ChannelType.switch and out[-1].buffer_type == sw.buffer:
            out[-1].rank_groups.append(group)
        else:
            out.append(ChannelDesc(channel_type=ChannelType.switch, buffer_type=sw.buffer, rank_groups=[group]))
    return out


class _TbTables:
    """Thread-block-local channel and remote-buffer tables, filled in order of first use (each
    with the position of every entry, so a lookup costs the same however long the table)."""

    def __init__(self, remote_index: dict[tuple[int, object], int]) -> None:
        self.channels: dict[ChannelType, dict[int, int]] = {t: {} for t in _TYPES}
        self.remotes: dict[ChannelType, dict[int, int]] = {ChannelType.memory: {}, ChannelType.port: {}}
        self.remote_index = remote_index

    def channel(self, ctype: ChannelType, c: int) -> int:
        return self.channels[ctype].setdefault(c, len(self.channels[ctype]))

    def remote(self, ctype: ChannelType, ref: Ref) -> int:
        table = self.remotes[ctype]
        return table.setdefault(self.remote_index[(ref.rank, ref.buffer)], len(table))


def _ref(ref: Ref, op: IROp, tables: _TbTables) -> BufferRef:
    if ref.switch is not None:
        return BufferRef(switch_channel_id=tables.channel(ChannelType.switch, ref.switch), index=ref.index,
                         size=ref.size)
    if ref.remote:
        return BufferRef(buffer_id=tables.remote(op.channel_type, ref), index=ref.index, size=ref.size)
    return BufferRef(type=ref.buffer, index=ref.index, size=ref.size)


def _op(op: IROp, tables: _TbTables) -> Op:
    if op.body is not None and op.iter_context is not None:
        inner = [_op(x, tables) for x in op.body]
        return Op(name=op.name, iter_context=IterContext(unit_size=op.iter_context[0],
                                                         num_chunks=op.iter_context[1]), ops=inner,
                  src=op.source)
    # channels first (first-use order follows the op's channel list), then buffers
    chan_ids = [tables.channel(op.channel_type, c) for c in op.channels] if op.channel_type != ChannelType.none else []
    src = [_ref(x, op, tables) for x in op.src]
    dst = [_ref(x, op, tables) for x in op.dst]
    fields: dict = dict(name=op.name, src_buff=src, dst_buff=dst, channel_ids=chan_ids,
                        channel_type=op.channel_type)
    if op.tbg is not None:
        fields["tbg_info"] = TbgInfo(tb_id=op.tbg[0], tbg_size=op.tbg[1])
    if op.name in REDUCE_OPS:
        fields["reduce_op"] = op.reduce_op
    if op.src_position:
        fields["src0_position"] = op.src_position
    if op.barrier_id is not None:
        fields["barrier_id"] = op.barrier_id
        fields["num_threadblocks"] = len(op.barrier_tbs or [])
        fields["barrier_tbs"] = list(op.barrier_tbs or [])
    if op.semaphores:
        fields["semaphore_ids"] = list(op.semaphores)
    if op.source is not None:
        fields["src"] = op.source
    if op.name == OpName.rmsnorm and op.quant:
        fields["quant"] = True
    return Op(**fields)


def _rank(r: IRRank) -> Gpu:
    # remote buffers in order of first use
    remote_index: dict[tuple[int, object], int] = {}
    remote_list: list[RemoteBuffer] = []
    for ops in r.tbs:
        for op in _all_ops(ops):
            for ref in op.src + op.dst:
                if not ref.remote:
                    continue
                key = (ref.rank, ref.buffer)
                if key not in remote_index:
                    remote_index[key] = len(remote_list)
                    remote_list.append(RemoteBuffer(rank=ref.rank, type=ref.buffer, access_channel_types=[]))
                rb = remote_list[remote_index[key]]
                if op.channel_type not in rb.access_channel_types:
                    rb.access_channel_types.append(op.channel_type)
    tbs: list[ThreadBlock] = []
    for t, ops in enumerate(r.tbs):
        tables = _TbTables(remote_index)
        emitted = [_op(op, tables) for op in ops]
        chans = [ThreadBlockChannels(channel_type=ct, channel_ids=list(ids))
                 for ct, ids in tables.channels.items() if ids]
        rrefs = [RemoteBufferRefs(access_channel_type=ct, remote_buffer_ids=list(ids))
                 for ct, ids in tables.remotes.items() if ids]
        tbs.append(ThreadBlock(id=t, ops=emitted, channels=chans, remote_buffer_refs=rrefs))
    return Gpu(id=r.rank, input_chunks=r.input_chunks, output_chunks=r.output_chunks,
               scratch_chunks=r.scratch_chunks, threadblocks=tbs, channels=_channel_descs(r),
               remote_buffers=remote_list, semaphores=[SemaphoreDesc(init_value=v) for v in r.semaphores],
               segments=[SegmentedBuffer(type=k, counts=[list(e) for e in v]) for k, v in sorted(
                   r.segments.items(), key=lambda kv: "ios".index(kv[0].value))] or None)


def emit(ir: IRProgram) -> Plan:
    """Pass 6: number channels and remote buffers and build the plan (see the module docstring)."""
    gpus = [_rank(r) for r in each_rank(ir.ranks)]
    every = [op for r in ir.ranks for ops in r.tbs for op in _all_ops(ops)]
    reduce_ops = {op.reduce_op for op in every if op.name in REDUCE_OPS and op.reduce_op is not None}
    spec = ir.spec
    epilogue = any(op.name in EPILOGUE_OPS for op in every)
    return Plan(
        format=plan_format(epilogue, any(r.segments for r in ir.ranks)),
        name=ir.name,
        collective=spec.name,
        protocol=ir.protocol,  # type: ignore[arg-type]
        inplace=spec.inplace,
        reuse_resources=ir.reuse_resources,
        num_threads_per_block=ir.num_threads_per_block,
        use_double_scratch_buffer=ir.use_double_scratch_buffer,
        buffer_alignment=ir.buffer_alignment,
        min_message_size=ir.min_message_size,
        max_message_size=ir.max_message_size,
        num_ranks=ir.num_ranks,
        root=spec.root if spec.row.rooted else None,
        chunk_factor=spec.chunk_factor * ir.instances if spec.row.sized else None,
        reduce_op=next(iter(reduce_ops)) if len(reduce_ops) == 1 else None,
        consistent=ir.consistent,
        batch_invariant=ir.batch_invariant,
        chunk_unit=ir.chunk_unit,  # type: ignore[arg-type]
        replicated_residual=ir.replicated_residual,
        gpus=gpus,
    )
