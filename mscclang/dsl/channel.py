"""Channels: ``MemoryChannel`` (peer memory through IPC), ``PortChannel`` (proxy-driven copies)
and ``SwitchChannel`` (NVLink multicast).

Every ``MemoryChannel(dst, src)`` call creates a new channel of rank ``src``; its id is its
position among ``src``'s memory channels. The ``j``-th memory channel from A to B is paired with
the ``j``-th memory channel from B to A (port channels likewise), and signals on one end are
consumed by waits on the other end.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mscclang.compiler.ir import IROp, IRSwitch, Ref
from mscclang.dsl._context import get_program
from mscclang.dsl.program import CollectiveProgram
from mscclang.dsl.thread_block_group import ThreadBlockGroup
from mscclang.dsl.types import BufferType, ChannelType, Chunk, RankGroup, ReduceOperationType, SyncType
from mscclang.errors import DSLError
from mscclang.plan.models import OpName

__all__ = ["MemoryChannel", "PortChannel", "SwitchChannel", "read_reduce"]


def _local(c: Chunk) -> Ref:
    return Ref(c.rank, c.buffer, c.index, c.size)


def _remote(c: Chunk) -> Ref:
    return Ref(c.rank, c.buffer, c.index, c.size, remote=True)


class _PeerChannel:
    """Shared part of memory and port channels."""

    channel_type = ChannelType.memory
    _kind = "MemoryChannel"

    def __init__(self, dst_rank: int, src_rank: int) -> None:
        prog = get_program()
        call = f"{self._kind}(dst_rank={dst_rank}, src_rank={src_rank})"
        prog.check_rank(src_rank, call, "src_rank")
        prog.check_rank(dst_rank, call, "dst_rank")
        if src_rank == dst_rank:
            raise prog.error(src_rank, None, call, "a channel connects two different ranks")
        peers = prog.gpus[src_rank].peers(self.channel_type)
        self.channel_id = len(peers)
        peers.append(dst_rank)
        self.dst_rank = dst_rank
        self.src_rank = src_rank
        prog.touch()

    def __repr__(self) -> str:
        return f"{self._kind}(dst_rank={self.dst_rank}, src_rank={self.src_rank}, id={self.channel_id})"

    def _call(self, method: str) -> str:
        return f"{self._kind}(dst={self.dst_rank}, src={self.src_rank}).{method}"

    def _sync_op(self, name: OpName, method: str, tb: int, data_sync: SyncType) -> None:
        prog = get_program()
        call = self._call(method)
        prog.check_tb(self.src_rank, tb, call)
        ds = int(SyncType(data_sync))
        prog.add_op(self.src_rank, tb, IROp(name, channel_type=self.channel_type, channels=[self.channel_id],
                                            data_sync=ds, origin=f"{call}(tb={tb})"))

    def _transfer(self, name: OpName, method: str, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int],
                  tb_group: Optional[ThreadBlockGroup], dst_packets: bool = False,
                  src_packets: bool = False) -> None:
        prog = get_program()
        call = self._call(method)
        targets = prog.tb_targets(self.src_rank, call, tb, tb_group)
        t0 = targets[0][0]
        pull = name == OpName.get   # the source is the peer's (checked after the local destination)
        checks = ([(dst_chunk, "destination", None), (src_chunk, "source", self.dst_rank)] if pull
                  else [(src_chunk, "source", None), (dst_chunk, "destination", self.dst_rank)])
        for chunk, what, owner in checks:
            prog.check_chunk(chunk, call, self.src_rank, t0, what, owner=owner)
        prog.check_same_size(self.src_rank, t0, call, ("destination", dst_chunk), ("source", src_chunk))
        if dst_packets:
            prog.check_scratch(self.src_rank, t0, call, "destination", dst_chunk)
        if src_packets:
            prog.check_scratch(self.src_rank, t0, call, "source", src_chunk)
        for t, tbg in targets:
            src, dst = (_remote(src_chunk), _local(dst_chunk)) if pull else (_local(src_chunk), _remote(dst_chunk))
            prog.add_op(self.src_rank, t, IROp(name, src=[src], dst=[dst],
                                               channel_type=self.channel_type, channels=[self.channel_id],
                                               tbg=tbg, origin=f"{call}(tb={t})"))


class MemoryChannel(_PeerChannel):
    """A memory channel from ``src_rank`` to ``dst_rank``: ops run on ``src_rank`` and reach
    ``dst_rank``'s buffers directly."""

    channel_type = ChannelType.memory
    _kind = "MemoryChannel"

    def signal(self, tb: int, data_sync: SyncType = SyncType.both, relaxed: bool = False) -> None:
        """Bump the peer's semaphore (release; ``relaxed``: order execution only)."""
        self._sync_op(OpName.rlxsignal if relaxed else OpName.signal, "signal", tb, data_sync)

    def wait(self, tb: int, data_sync: SyncType = SyncType.both, relaxed: bool = False) -> None:
        """Wait for the peer's next signal (acquire; ``relaxed``: order execution only)."""
        self._sync_op(OpName.rlxwait if relaxed else OpName.wait, "wait", tb, data_sync)

    def put(self, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int] = None,
            tb_group: Optional[ThreadBlockGroup] = None) -> None:
        """Copy local ``src_chunk`` into the peer's ``dst_chunk`` (``put``)."""
        self._transfer(OpName.put, "put", dst_chunk, src_chunk, tb, tb_group)

    def get(self, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int] = None,
            tb_group: Optional[ThreadBlockGroup] = None) -> None:
        """Copy the peer's ``src_chunk`` into local ``dst_chunk`` (``get``)."""
        self._transfer(OpName.get, "get", dst_chunk, src_chunk, tb, tb_group)

    def put_packets(self, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int] = None,
                    tb_group: Optional[ThreadBlockGroup] = None) -> None:
        """Pack local ``src_chunk`` into LL packets in the peer's scratch ``dst_chunk`` (``ppkt``)."""
        self._transfer(OpName.ppkt, "put_packets", dst_chunk, src_chunk, tb, tb_group, dst_packets=True)

    def read_put_packets(self, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int] = None,
                         tb_group: Optional[ThreadBlockGroup] = None) -> None:
        """Forward the LL packets of local scratch ``src_chunk`` to the peer's scratch ``dst_chunk``
        (``rppkt``)."""
        self._transfer(OpName.rppkt, "read_put_packets", dst_chunk, src_chunk, tb, tb_group,
                       dst_packets=True, src_packets=True)

    def reduce(self, local_src_chunk: Chunk, remote_src_chunks: Sequence[Chunk], tb: Optional[int] = None,
               tb_group: Optional[ThreadBlockGroup] = None, local_dst_chunk: Optional[Chunk] = None,
               reduce_op: ReduceOperationType = ReduceOperationType.sum, src_position: int = 0) -> None:
        """``local_dst = local_src OP remote_0 OP ...`` reading the peer's chunks (``rre``);
        ``local_src`` enters the order after the first ``src_position`` remote chunks (see
        :meth:`mscclang.dsl.Rank.reduce`)."""
        remotes = list(remote_src_chunks) if remote_src_chunks is not None else []
        _read_reduce(self._call("reduce"), [self] * max(len(remotes), 1), local_src_chunk, remotes, tb, tb_group,
                     local_dst_chunk, reduce_op, src_position)


def read_reduce(channels: Sequence[MemoryChannel], local_src_chunk: Chunk, remote_src_chunks: Sequence[Chunk],
                tb: Optional[int] = None, tb_group: Optional[ThreadBlockGroup] = None,
                local_dst_chunk: Optional[Chunk] = None,
                reduce_op: ReduceOperationType = ReduceOperationType.sum, src_position: int = 0) -> None:
    """(ours) ``local_dst = local_src OP remote_0 OP ...`` as one ``rre`` that reads
    ``remote_src_chunks[i]`` through ``channels[i]`` (memory channels of one rank, to any of its
    peers); ``local_src`` enters the order after the first ``src_position`` remote chunks. A chain
    of :meth:`MemoryChannel.reduce` calls fuses into the same op, but a chain starts with its
    local source, so only this call places it anywhere: the ranks' chunks in rank order with the
    own at its rank's place is the canonical sum (docs/semantics.md, "Batch invariance")."""
    chans = list(channels) if channels is not None else []
    if not chans or not all(isinstance(c, MemoryChannel) for c in chans):
        raise DSLError(f"read_reduce: channels must be a non-empty list of MemoryChannels, got {channels!r}")
    remotes = list(remote_src_chunks) if remote_src_chunks is not None else []
    call = f"read_reduce(rank {chans[0].src_rank})"
    if len(remotes) != len(chans) or len({c.src_rank for c in chans}) != 1:
        raise get_program().error(chans[0].src_rank, tb, call, f"needs one remote chunk per channel and channels "
                                  f"of one rank: {len(chans)} channels, {len(remotes)} remote chunks")
    _read_reduce(call, chans, local_src_chunk, remotes, tb, tb_group, local_dst_chunk, reduce_op, src_position)


def _read_reduce(call: str, chans: list[MemoryChannel], local_src_chunk: Chunk, remotes: list[Chunk],
                 tb: Optional[int], tb_group: Optional[ThreadBlockGroup], local_dst_chunk: Optional[Chunk],
                 reduce_op: ReduceOperationType, src_position: int) -> None:
    """Record the ``rre`` of :meth:`MemoryChannel.reduce` and :func:`read_reduce` (remote chunk
    ``i`` read through ``chans[i]``), after checking every argument."""
    prog = get_program()
    rank = chans[0].src_rank
    targets = prog.tb_targets(rank, call, tb, tb_group)
    t0 = targets[0][0]
    if local_dst_chunk is None:
        local_dst_chunk = local_src_chunk
    prog.check_chunk(local_src_chunk, call, rank, t0, "local source")
    prog.check_chunk(local_dst_chunk, call, rank, t0, "local destination")
    if not remotes:
        raise prog.error(rank, t0, call, "remote_src_chunks is empty: nothing to reduce with")
    for i, (ch, c) in enumerate(zip(chans, remotes)):
        prog.check_chunk(c, call, rank, t0, f"remote source {i}", owner=ch.dst_rank)
    prog.check_same_size(rank, t0, call, ("local source", local_src_chunk), ("local destination", local_dst_chunk),
                         *[(f"remote source {i}", c) for i, c in enumerate(remotes)])
    rop = ReduceOperationType(reduce_op)
    pos = prog.check_src_position(rank, t0, call, src_position, len(remotes))
    ids = list(dict.fromkeys(ch.channel_id for ch in chans))   # each channel once, in first use order
    for t, tbg in targets:
        prog.add_op(rank, t, IROp(OpName.rre, src=[_local(local_src_chunk)] + [_remote(c) for c in remotes],
                                  dst=[_local(local_dst_chunk)], channel_type=ChannelType.memory, channels=ids,
                                  tbg=tbg, reduce_op=rop, origin=f"{call}(tb={t})", src_position=pos))


class PortChannel(_PeerChannel):
    """A port channel from ``src_rank`` to ``dst_rank``: a host proxy (or copy engine) moves the
    data; ops run on one thread block each."""

    channel_type = ChannelType.port
    _kind = "PortChannel"

    def signal(self, tb: int, data_sync: SyncType = SyncType.both) -> None:
        """Signal the peer after every earlier put of this channel has landed."""
        self._sync_op(OpName.signal, "signal", tb, data_sync)

    def wait(self, tb: int, data_sync: SyncType = SyncType.both) -> None:
        """Wait for the peer's next signal."""
        self._sync_op(OpName.wait, "wait", tb, data_sync)

    def flush(self, tb: int, data_sync: SyncType = SyncType.both) -> None:
        """Wait until the proxy finished every earlier op of this channel (``flush``)."""
        self._sync_op(OpName.flush, "flush", tb, data_sync)

    def put(self, dst_chunk: Chunk, src_chunk: Chunk, tb: int) -> None:
        """Copy local ``src_chunk`` into the peer's ``dst_chunk`` through the proxy (``put``)."""
        self._transfer(OpName.put, "put", dst_chunk, src_chunk, tb, None)

    def put_with_signal(self, dst_chunk: Chunk, src_chunk: Chunk, tb: int) -> None:
        """``put`` then signal, in one request (``pws``)."""
        self._transfer(OpName.pws, "put_with_signal", dst_chunk, src_chunk, tb, None)

    def put_with_signal_and_flush(self, dst_chunk: Chunk, src_chunk: Chunk, tb: int) -> None:
        """``put``, signal, then wait for completion (``pwsf``)."""
        self._transfer(OpName.pwsf, "put_with_signal_and_flush", dst_chunk, src_chunk, tb, None)

    def put_packets(self, dst_chunk: Chunk, src_chunk: Chunk, tb: int) -> None:
        """Send ``src_chunk`` as LL packets into the peer's scratch ``dst_chunk`` (``ppkt``)."""
        self._transfer(OpName.ppkt, "put_packets", dst_chunk, src_chunk, tb, None, dst_packets=True)

    def read_put_packets(self, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int] = None,
                         tb_group: Optional[ThreadBlockGroup] = None) -> None:
        """Forward local scratch packets to the peer's scratch (``rppkt``)."""
        self._transfer(OpName.rppkt, "read_put_packets", dst_chunk, src_chunk, tb, tb_group,
                       dst_packets=True, src_packets=True)


class SwitchChannel:
    """NVLink multicast over buffer ``buffer_type`` of every rank in ``rank_list``; one switch
    channel per member rank (its id is its position among that rank's switch channels)."""

    channel_type = ChannelType.switch

    def __init__(self, rank_list: Sequence[int], buffer_type: BufferType) -> None:
        prog = get_program()
        ranks = list(rank_list)
        call = f"SwitchChannel(rank_list={ranks}, buffer_type={BufferType(buffer_type).name})"
        if len(ranks) < 1:
            raise prog.error(None, None, call, "a switch channel needs at least one rank")
        if len(set(ranks)) != len(ranks):
            raise prog.error(None, None, call, "a rank is listed twice")
        for r in ranks:
            prog.check_rank(r, call)
        self.buffer_type = BufferType(buffer_type)
        self.rank_group = RankGroup(len(ranks), tuple(ranks))
        self.channel_ids: dict[int, int] = {}
        for r in ranks:
            sw = prog.gpus[r].switch
            self.channel_ids[r] = len(sw)
            sw.append(IRSwitch(self.buffer_type, list(ranks)))
        prog.touch()

    def __repr__(self) -> str:
        return f"SwitchChannel({list(self.rank_group.ranks)}, {self.buffer_type.name})"

    def at_rank(self, rank: int) -> "SwitchChannel.SwitchChannelRankView":
        """The operations of this channel as run by ``rank``."""
        if rank not in self.rank_group.ranks:
            raise get_program().error(rank, None, f"{self!r}.at_rank({rank})", "the rank is not in the group")
        return SwitchChannel.SwitchChannelRankView(self, rank)

    def _check_range(self, prog: CollectiveProgram, rank: int, tb: int, call: str, offset: int, size: int) -> None:
        if not isinstance(offset, int) or not isinstance(size, int) or offset < 0 or size < 1:
            raise prog.error(rank, tb, call, f"bad range buffer_offset={offset!r}, size={size!r}")
        for r in self.rank_group.ranks:
            n = prog.gpus[r].chunks(self.buffer_type)
            if offset + size > n:
                raise prog.error(rank, tb, call, f"chunks {offset}..{offset + size - 1} are out of bounds of rank {r}'s "
                                                 f"{self.buffer_type.name} buffer ({n} chunks)")

    def _op(self, name: OpName, method: str, rank: int, chunk: Chunk, offset: int, size: int, tb: int,
            reduce_op: Optional[ReduceOperationType] = None) -> None:
        """Record switch op ``name`` of ``rank`` between its local ``chunk`` (a reduce's
        destination, a store's source) and every member's buffer[offset:offset+size], after
        checking every argument."""
        prog = get_program()
        call = f"{self!r}.at_rank({rank}).{method}"
        what = "destination" if name == OpName.glre else "source"
        if rank not in self.rank_group.ranks:
            raise prog.error(rank, tb, call, "the rank is not in the group")
        prog.check_tb(rank, tb, call)
        self._check_range(prog, rank, tb, call, offset, size)
        prog.check_chunk(chunk, call, rank, tb, what)
        if chunk.size != size:
            raise prog.error(rank, tb, call, f"size mismatch: {what} {chunk} has {chunk.size} chunks, size is {size}")
        if name == OpName.gstorepkt:
            prog.check_scratch(rank, tb, call, "source", chunk)
            if self.buffer_type != BufferType.scratch:
                raise prog.error(rank, tb, call, "broadcast_packets needs a switch channel over scratch buffers")
        local, switch = [_local(chunk)], [Ref(rank, self.buffer_type, offset, size, switch=self.channel_ids[rank])]
        reads = name == OpName.glre
        prog.add_op(rank, tb, IROp(name, src=switch if reads else local, dst=local if reads else switch,
                                   channel_type=ChannelType.switch, channels=[self.channel_ids[rank]],
                                   reduce_op=None if reduce_op is None else ReduceOperationType(reduce_op),
                                   origin=f"{call}(tb={tb})"))

    def reduce(self, rank: int, buffer_offset: int, size: int, dst_chunk: Chunk, tb: int,
               reduce_op: ReduceOperationType = ReduceOperationType.sum) -> None:
        """On ``rank``: ``dst_chunk = OP over the group of buffer[offset:offset+size]`` (``glre``)."""
        self._op(OpName.glre, "reduce", rank, dst_chunk, buffer_offset, size, tb, reduce_op)

    def broadcast(self, rank: int, src_chunk: Chunk, buffer_offset: int, size: int, tb: int) -> None:
        """On ``rank``: store ``src_chunk`` into every member's buffer[offset:offset+size] (``gstore``)."""
        self._op(OpName.gstore, "broadcast", rank, src_chunk, buffer_offset, size, tb)

    def broadcast_packets(self, rank: int, src_chunk: Chunk, buffer_offset: int, size: int, tb: int) -> None:
        """On ``rank``: re-emit the LL packets of local scratch ``src_chunk`` into every member's
        scratch[offset:offset+size] (``gstorepkt``)."""
        self._op(OpName.gstorepkt, "broadcast_packets", rank, src_chunk, buffer_offset, size, tb)

    class SwitchChannelRankView:
        """``SwitchChannel.at_rank(r)``: the channel's ops with the rank filled in."""

        def __init__(self, channel: "SwitchChannel", rank: int) -> None:
            self._channel = channel
            self._rank = rank

        def reduce(self, buffer_offset: int, size: int, dst_chunk: Chunk, tb: int,
                   reduce_op: ReduceOperationType = ReduceOperationType.sum) -> None:
            self._channel.reduce(self._rank, buffer_offset, size, dst_chunk, tb, reduce_op)

        def broadcast(self, src_chunk: Chunk, buffer_offset: int, size: int, tb: int) -> None:
            self._channel.broadcast(self._rank, src_chunk, buffer_offset, size, tb)

        def broadcast_packets(self, src_chunk: Chunk, buffer_offset: int, size: int, tb: int) -> None:
            self._channel.broadcast_packets(self._rank, src_chunk, buffer_offset, size, tb)
