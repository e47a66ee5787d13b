"""Local operations of one rank, buffers, and thread-block semaphores."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from mscclang.compiler.ir import IROp, Ref
from mscclang.dsl._context import get_program
from mscclang.dsl.thread_block_group import ThreadBlockGroup
from mscclang.dsl.types import BufferType, Chunk, ReduceOperationType, SyncType
from mscclang.errors import DSLError
from mscclang.plan.models import MAX_COUNT, OpName

if TYPE_CHECKING:
    from mscclang.dsl.program import CollectiveProgram

__all__ = ["BaseBuffer", "Buffer", "Rank", "Semaphore"]


def _local(c: Chunk) -> Ref:
    return Ref(c.rank, c.buffer, c.index, c.size)


class BaseBuffer:
    """``size`` chunks of one buffer of ``rank`` starting at chunk ``offset``; slice it
    (``buf[a:b]``) to get a :class:`Chunk`."""

    def __init__(self, rank: int, buffer_type: BufferType, offset: int, size: int) -> None:
        self.rank = rank
        self.buffer_type = buffer_type
        self.offset = offset
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: object) -> Chunk:
        where = f"rank {self.rank} {self.buffer_type.name} buffer"
        if isinstance(key, int) and not isinstance(key, bool):
            start, stop = key, key + 1
        elif isinstance(key, slice):
            if key.step not in (None, 1):
                raise DSLError(f"{where}[{key.start}:{key.stop}:{key.step}]: slices must have step 1")
            start = 0 if key.start is None else key.start
            stop = self.size if key.stop is None else key.stop
        else:
            raise DSLError(f"{where}[{key!r}]: index with a slice [a:b]")
        if not isinstance(start, int) or not isinstance(stop, int):
            raise DSLError(f"{where}[{start!r}:{stop!r}]: slice bounds must be ints")
        if start < 0 or stop > self.size or start >= stop:
            raise DSLError(f"{where}[{start}:{stop}]: out of bounds or empty (the buffer has {self.size} chunks)")
        return Chunk(self.rank, self.buffer_type, self.offset + start, stop - start)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, {self.buffer_type.name}, offset={self.offset}, size={self.size})"


class Buffer(BaseBuffer):
    """``size`` fresh scratch chunks of ``rank`` (allocated after the rank's earlier ones).

    With ``segments`` (ours; docs/dsl.md, "Data-dependent counts"), a list of count-matrix entries
    ``(i, j)``, the buffer is that many scratch *segments* instead: slot ``k`` holds up to the
    call's capacity rows, and segment ``k`` is ``counts[i][j]`` rows of it. ``size`` may then be
    left out (it must equal the number of segments). A rank's scratch is all chunks or all
    segments."""

    def __init__(self, rank: int, size: Optional[int] = None,
                 segments: Optional[Sequence[tuple[int, int]]] = None) -> None:
        prog = get_program()
        call = f"Buffer(rank={rank}, size={size})" if segments is None else f"Buffer(rank={rank}, segments=...)"
        prog.check_rank(rank, call)
        entries = _check_entries(prog, rank, call, segments) if segments is not None else None
        if entries is not None and size is None:
            size = len(entries)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise prog.error(rank, None, call, f"size must be a positive int, got {size!r}")
        gpu = prog.gpus[rank]
        if entries is not None and size != len(entries):
            raise prog.error(rank, None, call, f"size {size} but {len(entries)} segments")
        has = BufferType.scratch in gpu.segments
        if gpu.scratch_chunks and has != (entries is not None):
            raise prog.error(rank, None, call, "a rank's scratch is all chunks or all segments: "
                             f"rank {rank} already has scratch {'segments' if has else 'chunks'}")
        super().__init__(rank, BufferType.scratch, gpu.scratch_chunks, size)
        gpu.scratch_chunks += size
        if entries is not None:
            gpu.segments.setdefault(BufferType.scratch, []).extend(entries)
        prog.touch()


def _check_entries(prog, rank: int, call: str, segments: object) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """``segments`` as a non-empty list of count-matrix entries ``(i, j)`` of the program's
    ranks (DSLError naming the bad one)."""
    n = len(prog.gpus)
    if isinstance(segments, (str, bytes)) or not hasattr(segments, "__len__") or not len(segments):  # type: ignore[arg-type]
        raise prog.error(rank, None, call, f"segments must be a non-empty list of (i, j) count entries, got {segments!r}")
    out = []
    for k, e in enumerate(segments):  # type: ignore[union-attr, arg-type]
        ok = isinstance(e, (tuple, list)) and len(e) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n for v in e)
        if not ok:
            raise prog.error(rank, None, call, f"segments[{k}] = {e!r} is not an entry (i, j) of the {n} x {n} "
                             "count matrix")
        out.append((e[0], e[1]))
    return out


class Semaphore:
    """A counting semaphore shared by the thread blocks of one rank (value persists across
    launches, so every launch must release as often as it acquires)."""

    def __init__(self, rank: int, initial_value: int) -> None:
        prog = get_program()
        call = f"Semaphore(rank={rank}, initial_value={initial_value})"
        prog.check_rank(rank, call)
        if not isinstance(initial_value, int) or isinstance(initial_value, bool) or not 0 <= initial_value <= MAX_COUNT:
            raise prog.error(rank, None, call, f"initial_value must be an int in 0..{MAX_COUNT}, got {initial_value!r}")
        sems = prog.gpus[rank].semaphores
        self.id = len(sems)
        self.rank = rank
        self.initial_value = initial_value
        sems.append(initial_value)
        prog.touch()

    def _op(self, name: OpName, tb: int, data_sync: SyncType, what: str) -> None:
        prog = get_program()
        call = f"Semaphore(rank={self.rank}, id={self.id}).{what}(tb={tb})"
        prog.check_tb(self.rank, tb, call)
        prog.add_op(self.rank, tb, IROp(name, semaphores=[self.id], data_sync=int(data_sync), origin=call))

    def acquire(self, tb: int, data_sync: SyncType = SyncType.both) -> None:
        """Wait until the value is positive, then decrement it (``sem_acquire``)."""
        self._op(OpName.sem_acquire, tb, data_sync, "acquire")

    def release(self, tb: int, data_sync: SyncType = SyncType.both) -> None:
        """Increment the value (``sem_release``)."""
        self._op(OpName.sem_release, tb, data_sync, "release")


class Rank:
    """Local operations of rank ``rank``."""

    def __init__(self, rank: int) -> None:
        get_program().check_rank(rank, f"Rank({rank})")
        self.rank = rank

    def __repr__(self) -> str:
        return f"Rank({self.rank})"

    def get_input_buffer(self) -> BaseBuffer:
        """This rank's input buffer."""
        return get_program().buffers[self.rank][BufferType.input]

    def get_output_buffer(self) -> BaseBuffer:
        """This rank's output buffer."""
        return get_program().buffers[self.rank][BufferType.output]

    def get_residual_buffer(self) -> BaseBuffer:
        """This rank's residual buffer (the input's chunks; only the fused collective
        :class:`~mscclang.dsl.AllReduceAddRMSNorm` has one)."""
        bufs = get_program().buffers[self.rank]
        if BufferType.residual not in bufs:
            raise DSLError(f"Rank({self.rank}).get_residual_buffer(): only an AllReduceAddRMSNorm "
                           "program has a residual buffer")
        return bufs[BufferType.residual]

    def _epilogue(self, method: str, tb: int, residual_chunk: Chunk, other: Chunk,
                  what: str) -> tuple["CollectiveProgram", str, int]:
        """The checks an epilogue op starts with: the block, both chunks (``other`` named
        ``what``), and a residual chunk of the residual buffer; (program, call, block)."""
        prog = get_program()
        call = f"Rank({self.rank}).{method}"
        t = prog.check_tb(self.rank, tb, call)
        prog.check_chunk(residual_chunk, call, self.rank, t, "residual chunk")
        prog.check_chunk(other, call, self.rank, t, what)
        if residual_chunk.buffer != BufferType.residual:
            raise prog.error(self.rank, t, call, f"residual chunk {residual_chunk} must be a chunk of the residual buffer")
        return prog, call, t

    def add_residual(self, residual_chunk: Chunk, src_chunk: Chunk, tb: int) -> None:
        """``residual_chunk += src_chunk`` elementwise, each sum through fp32 rounded to the
        activation dtype (``radd``). ``src_chunk`` is an input, output or scratch chunk of this
        rank, ``residual_chunk`` the same number of residual chunks."""
        prog, call, t = self._epilogue("add_residual", tb, residual_chunk, src_chunk, "source")
        if src_chunk.buffer not in (BufferType.input, BufferType.output, BufferType.scratch):
            raise prog.error(self.rank, t, call, f"source {src_chunk} must be an input, output or scratch chunk")
        prog.check_same_size(self.rank, t, call, ("residual chunk", residual_chunk), ("source", src_chunk))
        prog.add_op(self.rank, t, IROp(OpName.radd, src=[_local(src_chunk)], dst=[_local(residual_chunk)],
                                       origin=f"{call}(tb={t})"))

    def rms_norm(self, dst_chunk: Chunk, residual_chunk: Chunk, tb: int, quantize: bool = False) -> None:
        """``dst_chunk = RMSNorm(residual_chunk) * weight`` row by row (``rmsnorm``); with
        ``quantize`` the output is FP8 with the call's static scale. ``dst_chunk`` is the output
        chunks (an in-place program's input chunks, which are the output) of the same index and size: row k of the residual goes to row k of the output.
        At execution the chunks must hold whole rows (the hidden size is a parameter of the
        call). The compiler puts a ``nop`` between an ``add_residual`` and the norm of its rows
        in one block; rows added in another block must be ordered before the norm (a barrier)."""
        prog, call, t = self._epilogue("rms_norm", tb, residual_chunk, dst_chunk, "destination")
        if dst_chunk.buffer == BufferType.input and prog.ir.spec.inplace:  # the input is the output
            dst_chunk = Chunk(dst_chunk.rank, BufferType.output, dst_chunk.index, dst_chunk.size)
        if dst_chunk.buffer != BufferType.output or (dst_chunk.index, dst_chunk.size) != (residual_chunk.index, residual_chunk.size):
            raise prog.error(self.rank, t, call, f"destination {dst_chunk} must be the output chunks "
                                                 f"[{residual_chunk.index}:{residual_chunk.index + residual_chunk.size}] "
                                                 "(the rows of the residual chunk)")
        prog.add_op(self.rank, t, IROp(OpName.rmsnorm, src=[_local(residual_chunk)], dst=[_local(dst_chunk)],
                                       quant=bool(quantize), origin=f"{call}(tb={t})"))

    def _copy(self, name: OpName, what: str, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int],
              tb_group: Optional[ThreadBlockGroup]) -> None:
        prog = get_program()
        call = f"Rank({self.rank}).{what}"
        targets = prog.tb_targets(self.rank, call, tb, tb_group)
        t0 = targets[0][0]
        prog.check_chunk(dst_chunk, call, self.rank, t0, "destination")
        prog.check_chunk(src_chunk, call, self.rank, t0, "source")
        prog.check_same_size(self.rank, t0, call, ("destination", dst_chunk), ("source", src_chunk))
        if name == OpName.cpkt:
            prog.check_scratch(self.rank, t0, call, "destination", dst_chunk)
        if name == OpName.upkt:
            prog.check_scratch(self.rank, t0, call, "source", src_chunk)
        for t, tbg in targets:
            prog.add_op(self.rank, t, IROp(name, src=[_local(src_chunk)], dst=[_local(dst_chunk)], tbg=tbg,
                                           origin=f"{call}(tb={t})"))

    def copy(self, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int] = None,
             tb_group: Optional[ThreadBlockGroup] = None) -> None:
        """Copy ``src_chunk`` to ``dst_chunk`` (``copy``)."""
        self._copy(OpName.copy, "copy", dst_chunk, src_chunk, tb, tb_group)

    def copy_packets(self, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int] = None,
                     tb_group: Optional[ThreadBlockGroup] = None) -> None:
        """Pack ``src_chunk`` into LL packets in scratch ``dst_chunk`` (``cpkt``)."""
        self._copy(OpName.cpkt, "copy_packets", dst_chunk, src_chunk, tb, tb_group)

    def unpack_packets(self, dst_chunk: Chunk, src_chunk: Chunk, tb: Optional[int] = None,
                       tb_group: Optional[ThreadBlockGroup] = None) -> None:
        """Wait for the LL packets of scratch ``src_chunk`` and unpack them into ``dst_chunk``
        (``upkt``)."""
        self._copy(OpName.upkt, "unpack_packets", dst_chunk, src_chunk, tb, tb_group)

    def reduce(self, src_chunk: Chunk, other_chunks: Sequence[Chunk], tb: Optional[int] = None,
               tb_group: Optional[ThreadBlockGroup] = None, dst_chunk: Optional[Chunk] = None,
               reduce_op: ReduceOperationType = ReduceOperationType.sum, packet: bool = False,
               src_position: int = 0) -> None:
        """``dst = src OP other_0 OP other_1 ...`` (``re``); with ``packet=True`` the other chunks
        are LL packets in scratch (``repkt``). ``dst`` defaults to ``src``. The sources combine in
        the order written, ``src`` entering after the first ``src_position`` other chunks
        (``other_0 OP ... OP src OP ...``): a reduction every rank writes in the same order (the
        ranks' chunks in rank order, each rank's own at its rank's place) gives every rank the same
        bits (docs/semantics.md, "Rank consistency")."""
        prog = get_program()
        call = f"Rank({self.rank}).reduce"
        targets = prog.tb_targets(self.rank, call, tb, tb_group)
        t0 = targets[0][0]
        if dst_chunk is None:
            dst_chunk = src_chunk
        prog.check_chunk(src_chunk, call, self.rank, t0, "source")
        prog.check_chunk(dst_chunk, call, self.rank, t0, "destination")
        others = list(other_chunks) if other_chunks is not None else []
        if not others:
            raise prog.error(self.rank, t0, call, "other_chunks is empty: nothing to reduce with")
        for i, c in enumerate(others):
            prog.check_chunk(c, call, self.rank, t0, f"other chunk {i}")
            if packet:
                prog.check_scratch(self.rank, t0, call, f"other chunk {i}", c)
        prog.check_same_size(self.rank, t0, call, ("source", src_chunk), ("destination", dst_chunk),
                             *[(f"other chunk {i}", c) for i, c in enumerate(others)])
        rop = ReduceOperationType(reduce_op)
        pos = prog.check_src_position(self.rank, t0, call, src_position, len(others))
        name = OpName.repkt if packet else OpName.re
        for t, tbg in targets:
            prog.add_op(self.rank, t, IROp(name, src=[_local(src_chunk)] + [_local(c) for c in others],
                                           dst=[_local(dst_chunk)], tbg=tbg, reduce_op=rop,
                                           origin=f"{call}(tb={t})", src_position=pos))

    def barrier(self, tb_list: Sequence[int]) -> None:
        """Synchronise thread blocks of this rank: one block -> ``nop``; several -> ``barrier``."""
        prog = get_program()
        call = f"Rank({self.rank}).barrier(tb_list={list(tb_list)})"
        tbs = list(tb_list)
        if not tbs:
            raise prog.error(self.rank, None, call, "a barrier needs at least one thread block")
        for t in tbs:
            prog.check_tb(self.rank, t, call)
        if len(set(tbs)) != len(tbs):
            raise prog.error(self.rank, None, call, "a thread block is listed twice")
        if len(tbs) == 1:
            prog.add_op(self.rank, tbs[0], IROp(OpName.nop, origin=call))
            return
        bid = prog.barrier_id(self.rank, tbs)
        for t in tbs:
            prog.add_op(self.rank, t, IROp(OpName.barrier, barrier_id=bid, barrier_tbs=sorted(tbs), origin=call))
