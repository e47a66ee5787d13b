"""Chunk-to-byte rule: the one place that turns chunk references into byte ranges.

The simulator and the GPU runtime both use this module, so odd message sizes behave the same on
the CPU and on the GPU.

The rule (a superset of MSCCL++'s, identical to it whenever the reference size divides evenly):

* The collective defines a *block*: ``block_bytes`` bytes cut into ``block_chunks`` chunks. For
  allgather the block is the input (the output holds ``n`` blocks, one per rank); for
  reducescatter it is the output (the input holds ``n`` blocks); for alltoall it is ``1/n`` of the
  input (both buffers hold ``n`` blocks); otherwise it is the input buffer, or the output buffer
  when the input has no chunks.
* With ``u = ceil(block_bytes / alignment)`` alignment units (a fused plan whose ``chunk_unit``
  is ``"row"``: rows of the call's hidden size instead, so no chunk cuts a row), every chunk is
  ``chunk_bytes = alignment * ceil(u / block_chunks)`` bytes long, except that spans are clipped
  at the end of their block: so the last non-empty chunk of a block may be short and chunks after
  it may be empty. When ``block_bytes`` is a multiple of ``alignment * block_chunks`` this is
  exactly MSCCL++'s near-equal split.
* Chunk ``k`` of a user buffer (input/output) lies in block ``k // block_chunks`` at
  ``block * block_bytes + (k % block_chunks) * chunk_bytes``. A buffer whose chunk count is not a
  multiple of ``block_chunks`` (only possible for test/custom collectives) gets its own grid
  computed the same way over its own size.
* Scratch chunk ``k`` is a slot of ``chunk_bytes`` bytes at ``k * chunk_bytes``; slots are never
  clipped. A scratch slot that holds LL packets lives at twice its plain offset (LL8 and LL16 both
  double the bytes), which callers apply themselves.
* An op moves data chunk by chunk: chunk ``t`` of every operand corresponds to chunk ``t`` of the
  others. The length moved for a chunk is the shortest clipped length among the operands in user
  buffers, or ``chunk_bytes`` when every operand is in scratch. Adjacent chunks are merged into one
  piece when every operand continues contiguously, so evenly divisible sizes give one piece.
* Packet writes into scratch cover whole slots (payload past the source's end is zero), so a
  later op that reads a whole slot of packets never waits for bytes that nobody writes.
* A thread-block group splits an op's bytes (the concatenation of its pieces) again with the same
  near-equal rule in units of ``max(alignment, 8)`` bytes; member ``i`` takes part ``i``.
* A pipeline runs its inner ops over slices ``[j * unit_size, (j + 1) * unit_size)`` of each inner
  op's bytes, ``j = 0 .. ceil(longest inner op / unit_size) - 1``; the thread-block-group split
  applies to each slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from mscclang.errors import PlanError
from mscclang.plan.collectives import TABLE
from mscclang.plan.models import PACKET_OPS, BufferKind, Plan


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def near_equal_split(total_units: int, parts: int, index: int) -> tuple[int, int]:
    """Unit range ``[start, end)`` of part ``index`` when ``total_units`` are split into
    ``parts`` near-equal parts, the remainder going to the first parts."""
    q, r = divmod(total_units, parts)
    start = index * q + min(index, r)
    end = start + q + (1 if index < r else 0)
    return start, end


@dataclass(frozen=True)
class Grid:
    """Chunk grid of one user buffer: ``num_blocks`` blocks of ``block_bytes`` bytes, each cut
    into ``block_chunks`` chunks of ``chunk_bytes`` (clipped at the block end)."""

    block_bytes: int
    block_chunks: int
    chunk_bytes: int
    num_blocks: int

    @property
    def num_chunks(self) -> int:
        return self.block_chunks * self.num_blocks

    @property
    def size(self) -> int:
        return self.block_bytes * self.num_blocks

    def span(self, k: int) -> tuple[int, int]:
        """(offset, length) of chunk ``k``; length 0 for chunks past the clipped end."""
        if self.block_chunks == 0:
            return 0, 0
        blk, j = divmod(k, self.block_chunks)
        start = j * self.chunk_bytes
        length = max(0, min(self.chunk_bytes, self.block_bytes - start))
        return blk * self.block_bytes + min(start, self.block_bytes), length


def make_grid(block_bytes: int, block_chunks: int, alignment: int, num_blocks: int = 1) -> Grid:
    """Grid of ``num_blocks`` blocks of ``block_bytes`` bytes with ``block_chunks`` chunks each."""
    if block_chunks <= 0:
        return Grid(block_bytes, 0, 0, num_blocks)
    units = _ceil_div(block_bytes, alignment)
    return Grid(block_bytes, block_chunks, alignment * _ceil_div(units, block_chunks), num_blocks)


@dataclass(frozen=True)
class Piece:
    """One contiguous stretch of an op: ``offsets[i]`` is the plain byte offset in operand ``i``
    (operands in the order the caller listed them), ``length`` bytes long."""

    offsets: tuple[int, ...]
    length: int


@dataclass(frozen=True)
class Layout:
    """Byte layout of one rank's buffers for one message size."""

    input: Grid
    output: Grid
    chunk_bytes: int
    scratch_chunks: int
    alignment: int
    input_bytes: int
    output_bytes: int
    #: :func:`scratch_factor` of the plan: allocated scratch bytes per plain slot byte
    scratch_factor: int = 1
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def scratch_bytes(self) -> int:
        """Plain bytes of scratch (before packet doubling and double buffering)."""
        return self.chunk_bytes * self.scratch_chunks

    @property
    def scratch_alloc_bytes(self) -> int:
        """Bytes of scratch the rank allocates: the plain slots times :attr:`scratch_factor`
        (doubled for LL packets, doubled again with double scratch buffering)."""
        return self.scratch_bytes * self.scratch_factor

    def grid(self, kind: BufferKind) -> Optional[Grid]:
        """The chunk grid of a user buffer; the residual (plan/2) has the input's."""
        if kind in (BufferKind.input, BufferKind.residual):
            return self.input
        if kind == BufferKind.output:
            return self.output
        return None

    def span(self, kind: BufferKind, k: int) -> tuple[int, int]:
        """(plain offset, clipped length) of chunk ``k`` of buffer ``kind``; scratch slots are
        never clipped."""
        if kind == BufferKind.scratch:
            return k * self.chunk_bytes, self.chunk_bytes
        g = self.grid(kind)
        assert g is not None
        return g.span(k)

    def ref_span(self, kind: BufferKind, index: int, size: int) -> tuple[int, int]:
        """Byte extent ``[start, end)`` covered by chunks ``index .. index+size-1``."""
        if size == 0:
            off, _ = self.span(kind, index) if kind == BufferKind.scratch or index < self._nchunks(kind) else (0, 0)
            return off, off
        first, _ = self.span(kind, index)
        last_off, last_len = self.span(kind, index + size - 1)
        return first, last_off + last_len

    def _nchunks(self, kind: BufferKind) -> int:
        if kind == BufferKind.scratch:
            return self.scratch_chunks
        g = self.grid(kind)
        return g.num_chunks if g is not None else 0

    def pieces(self, operands: Sequence[tuple[BufferKind, int]], size: int) -> list[Piece]:
        """Pieces of an op whose operands start at chunk ``operands[i] = (kind, index)`` and span
        ``size`` chunks each. Operands are compared chunk by chunk (see the module docstring)."""
        out: list[Piece] = []
        for t in range(size):
            offs = []
            length: Optional[int] = None
            for kind, index in operands:
                off, ln = self.span(kind, index + t)
                offs.append(off)
                if kind != BufferKind.scratch:
                    length = ln if length is None else min(length, ln)
            if length is None:
                length = self.chunk_bytes
            if length <= 0:
                continue
            if out:
                prev = out[-1]
                if all(p + prev.length == o for p, o in zip(prev.offsets, offs)):
                    out[-1] = Piece(prev.offsets, prev.length + length)
                    continue
            out.append(Piece(tuple(offs), length))
        return out


def slice_pieces(pieces: Sequence[Piece], start: int, end: int) -> list[Piece]:
    """The part of ``pieces`` (seen as one byte stream) between stream positions start and end."""
    out: list[Piece] = []
    pos = 0
    for p in pieces:
        a, b = max(start, pos), min(end, pos + p.length)
        if a < b:
            d = a - pos
            out.append(Piece(tuple(o + d for o in p.offsets), b - a))
        pos += p.length
        if pos >= end:
            break
    return out


def total_length(pieces: Iterable[Piece]) -> int:
    return sum(p.length for p in pieces)


def group_slice(pieces: Sequence[Piece], member: int, group_size: int, alignment: int) -> list[Piece]:
    """Member ``member``'s share of an op split over a thread-block group of ``group_size``."""
    if group_size <= 1:
        return list(pieces)
    unit = max(alignment, 8)
    total = total_length(pieces)
    s, e = near_equal_split(_ceil_div(total, unit), group_size, member)
    return slice_pieces(pieces, min(s * unit, total), min(e * unit, total))


def pipeline_iterations(inner_lengths: Sequence[int], unit_size: int) -> int:
    """Number of pipeline iterations: the longest inner op over ``unit_size``."""
    longest = max(inner_lengths, default=0)
    return _ceil_div(longest, unit_size) if longest > 0 else 0


def iteration_slice(pieces: Sequence[Piece], iteration: int, unit_size: int) -> list[Piece]:
    """The bytes of one pipeline iteration of an inner op."""
    return slice_pieces(pieces, iteration * unit_size, (iteration + 1) * unit_size)


def reference_block(plan: Plan, input_bytes: int, output_bytes: int) -> tuple[int, int, int, int]:
    """(block_bytes, block_chunks, input blocks, output blocks) of rank 0's chunk counts.

    Raises PlanError when the sizes do not fit the collective (e.g. an allgather output that is
    not ``n`` times its input).
    """
    g = plan.gpus[0] if plan.gpus else None
    cin = g.input_chunks if g else 0
    cout = g.output_chunks if g else 0
    n = len(plan.gpus)
    coll = plan.collective
    row = TABLE.get(coll)
    bi, bo = row.blocks(n) if row is not None else (1, 1)
    if bi > 1 or bo > 1:   # the buffers hold bi and bo blocks of one size
        if input_bytes % bi or output_bytes != input_bytes // bi * bo:
            raise PlanError(f"{coll} needs {bi} x output bytes = {bo} x input bytes (whole blocks of {n} ranks), "
                            f"got {input_bytes} input and {output_bytes} output bytes")
        if cin == 0 or cin % bi or cout != cin // bi * bo:
            raise PlanError(f"{coll} plan needs {bi} x output_chunks = {bo} x input_chunks (whole blocks), got "
                            f"{cin} input and {cout} output chunks", "gpus[0]")
        return input_bytes // bi, cin // bi, bi, bo
    if cin > 0:
        bb, bc = input_bytes, cin
    else:
        bb, bc = output_bytes, cout
    nin = 1
    nout = 1
    return bb, bc, nin, nout


def row_units(plan: Plan, input_bytes: int, output_bytes: int, row_bytes: int) -> tuple[int, int]:
    """The chunking units (input, output) of a plan whose ``chunk_unit`` is ``"row"``: one row of
    the input (``row_bytes``: the epilogue's hidden size times the activation's element size) and
    the same row of the output (``output_bytes`` has as many rows); PlanError when the call's
    sizes are not whole rows or no row size is given."""
    if not isinstance(row_bytes, int) or row_bytes <= 0:
        raise PlanError(f"plan {plan.name} cuts its chunks at rows (chunk_unit \"row\"): the call's row size "
                        "is needed (the epilogue's hidden size)", "chunk_unit")
    rows, rem = divmod(input_bytes, row_bytes)
    if rem or rows == 0 or output_bytes % rows:
        raise PlanError(f"plan {plan.name} cuts its chunks at rows of {row_bytes} bytes: {input_bytes} input and "
                        f"{output_bytes} output bytes are not whole rows", "chunk_unit")
    return row_bytes, output_bytes // rows


def make_layouts(plan: Plan, input_bytes: int, output_bytes: int, row_bytes: int = 0) -> list[Layout]:
    """:func:`make_layout` of every rank (the plan's :func:`scratch_factor` found once, not once
    per rank: a per-rank scan of the whole plan is quadratic in the ranks)."""
    factor = scratch_factor(plan)
    return [make_layout(plan, r, input_bytes, output_bytes, row_bytes, factor=factor)
            for r in range(len(plan.gpus))]


def make_layout(plan: Plan, rank: int, input_bytes: int, output_bytes: int, row_bytes: int = 0, *,
                factor: Optional[int] = None) -> Layout:
    """Layout of ``rank``'s buffers for one call with the given byte sizes. A plan whose
    ``chunk_unit`` is ``"row"`` (fused plans whose chunks are whole rows) cuts its user buffers
    in rows instead of ``buffer_alignment`` units: ``row_bytes`` is the call's input row
    (:func:`row_units`); other plans ignore it. ``factor``: the plan's :func:`scratch_factor`
    when the caller has it (else it is found here, a walk over the plan's ops)."""
    if not 0 <= rank < len(plan.gpus):
        raise PlanError(f"rank {rank} is not in the plan (it has {len(plan.gpus)} ranks)")
    gpu = plan.gpus[rank]
    a = plan.buffer_alignment
    ua = uo = a
    if plan.chunk_unit == "row":
        ua, uo = row_units(plan, input_bytes, output_bytes, row_bytes)
    bb, bc, nin, nout = reference_block(plan, input_bytes, output_bytes)
    ref = make_grid(bb, bc, ua)

    def grid_for(nbytes: int, nchunks: int, nblocks: int, unit: int) -> Grid:
        if bc > 0 and nchunks == nblocks * bc and nbytes == nblocks * bb:
            return Grid(bb, bc, ref.chunk_bytes, nblocks)
        if bc > 0 and nchunks % bc == 0 and nbytes == (nchunks // bc) * bb:
            return Grid(bb, bc, ref.chunk_bytes, nchunks // bc)
        return make_grid(nbytes, nchunks, unit)

    gin = grid_for(input_bytes, gpu.input_chunks, nin, ua)
    gout = grid_for(output_bytes, gpu.output_chunks, nout, uo)
    return Layout(
        input=gin,
        output=gout,
        chunk_bytes=ref.chunk_bytes,
        scratch_chunks=gpu.scratch_chunks,
        alignment=a,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        scratch_factor=scratch_factor(plan) if factor is None else factor,
    )


def counted_layouts(plan: Plan, in_bytes: Sequence[int], out_bytes: Sequence[int], slot_bytes: int) -> list[Layout]:
    """The layouts of a plan with segmented buffers (plan/3) for one call: rank ``r``'s input and
    output hold ``in_bytes[r]`` and ``out_bytes[r]`` bytes and no chunk grid (their segments'
    spans come from the count matrix, :func:`mscclang.plan.segments.segment_span`), and each
    scratch slot (segment or chunk) is ``slot_bytes`` long (the call's capacity rows)."""
    factor = scratch_factor(plan)
    return [Layout(input=Grid(in_bytes[r], 0, 0, 1), output=Grid(out_bytes[r], 0, 0, 1), chunk_bytes=slot_bytes,
                   scratch_chunks=g.scratch_chunks, alignment=plan.buffer_alignment, input_bytes=in_bytes[r],
                   output_bytes=out_bytes[r], scratch_factor=factor)
            for r, g in enumerate(plan.gpus)]


def scratch_factor(plan: Plan) -> int:
    """Allocated scratch bytes per plain slot byte: 2 for LL packets (an LL plan, or one with
    packet ops), times 2 again with double scratch buffering."""
    f = 2 if plan.protocol == "LL" or _has_packet_scratch(plan) else 1
    return f * 2 if plan.use_double_scratch_buffer else f


def _has_packet_scratch(plan: Plan) -> bool:
    return any(op.name in PACKET_OPS for op in plan.all_ops())
