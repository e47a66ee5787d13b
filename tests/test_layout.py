"""Property tests of the chunk-to-byte rule (mscclang.plan.layout)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mscclang.plan.layout import (
    Piece,
    group_slice,
    iteration_slice,
    make_grid,
    make_layout,
    near_equal_split,
    pipeline_iterations,
    total_length,
)
from mscclang.plan.models import BufferKind, Plan

SETTINGS = settings(derandomize=True, max_examples=150, deadline=None)

alignments = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128])
elem_sizes = st.sampled_from([1, 2, 4])


def _intervals(spans):
    """Sorted, merged half-open intervals of (offset, length) spans, empty ones dropped."""
    out: list[list[int]] = []
    for off, ln in sorted(s for s in spans if s[1] > 0):
        if out and out[-1][1] == off:
            out[-1][1] = off + ln
        else:
            out.append([off, off + ln])
    return [tuple(x) for x in out]


def _stream(pieces):
    """Pieces merged where every operand continues contiguously (a canonical form)."""
    out: list[Piece] = []
    for p in pieces:
        if p.length == 0:
            continue
        if out and all(a + out[-1].length == b for a, b in zip(out[-1].offsets, p.offsets)):
            out[-1] = Piece(out[-1].offsets, out[-1].length + p.length)
        else:
            out.append(p)
    return out


def _plan(collective: str, n: int, cin: int, cout: int, scratch: int, alignment: int) -> Plan:
    gpus = [{"id": r, "input_chunks": cin, "output_chunks": cout, "scratch_chunks": scratch}
            for r in range(n)]
    return Plan.model_validate({"name": "t", "collective": collective, "gpus": gpus,
                                "buffer_alignment": alignment})


# ------------------------------------------------------------------------------------- grids

@SETTINGS
@given(st.integers(0, 5000), st.integers(1, 40), alignments, st.integers(1, 5))
def test_user_buffer_chunks_tile_exactly(block_bytes, chunks, alignment, blocks):
    g = make_grid(block_bytes, chunks, alignment, blocks)
    spans = [g.span(k) for k in range(g.num_chunks)]
    # in chunk order, each chunk starts where the previous one ended: no gap, no overlap
    pos = 0
    for off, ln in spans:
        assert off == pos and ln >= 0
        pos += ln
    assert pos == g.size == block_bytes * blocks
    assert _intervals(spans) == ([(0, g.size)] if g.size else [])


@SETTINGS
@given(st.integers(1, 5000), st.integers(1, 40), alignments, st.integers(1, 4))
def test_chunk_starts_aligned_within_block(block_bytes, chunks, alignment, blocks):
    g = make_grid(block_bytes, chunks, alignment, blocks)
    assert g.chunk_bytes % alignment == 0
    for k in range(g.num_chunks):
        off, ln = g.span(k)
        blk = k // chunks
        inner = off - blk * block_bytes
        assert 0 <= inner <= block_bytes
        if ln:
            assert inner % alignment == 0
            assert ln <= g.chunk_bytes
            # only the last non-empty chunk of a block may be short
            if ln < g.chunk_bytes:
                assert inner + ln == block_bytes


@SETTINGS
@given(st.integers(1, 64), st.integers(1, 24), alignments)
def test_matches_mscclpp_when_sizes_divide(units_per_chunk, chunks, alignment):
    """MSCCL++'s rule: chunk k starts at unit k*floor(n/C) + min(k, n mod C)."""
    n = units_per_chunk * chunks
    size = n * alignment
    g = make_grid(size, chunks, alignment)
    q, r = divmod(n, chunks)
    for k in range(chunks):
        start = alignment * (k * q + min(k, r))
        end = alignment * ((k + 1) * q + min(k + 1, r))
        assert g.span(k) == (start, end - start)


@SETTINGS
@given(st.integers(0, 1000), st.integers(1, 50))
def test_near_equal_split_tiles(total, parts):
    pos = 0
    sizes = []
    for i in range(parts):
        s, e = near_equal_split(total, parts, i)
        assert s == pos and e >= s
        sizes.append(e - s)
        pos = e
    assert pos == total
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the remainder goes to the first parts


# ------------------------------------------------------------------------------------- layouts

@st.composite
def layouts(draw):
    """A layout of a random collective plan and a message size (a multiple of the element
    size, not necessarily of the alignment)."""
    n = draw(st.integers(1, 8))
    f = draw(st.integers(1, 6))
    a = draw(alignments)
    esize = draw(elem_sizes)
    elems = draw(st.integers(0, 600))
    coll = draw(st.sampled_from(["allreduce", "allgather", "reducescatter", "alltoall", "sendrecv"]))
    scratch = draw(st.integers(0, 3 * n * f))
    if coll == "allgather":
        cin, cout, ib = f, n * f, elems * esize
        ob = n * ib
    elif coll == "reducescatter":
        cin, cout, ob = n * f, f, elems * esize
        ib = n * ob
    elif coll == "alltoall":
        cin = cout = n * f
        ib = ob = n * elems * esize
    elif coll == "allreduce":
        cin = cout = n * f
        ib = ob = elems * esize
    else:
        cin = cout = f
        ib = ob = elems * esize
    plan = _plan(coll, n, cin, cout, scratch, a)
    rank = draw(st.integers(0, n - 1))
    return plan, make_layout(plan, rank, ib, ob)


@SETTINGS
@given(layouts())
def test_layout_user_buffers_tile_their_sizes(pl):
    plan, lay = pl
    g = plan.gpus[0]
    for kind, count, nbytes in ((BufferKind.input, g.input_chunks, lay.input_bytes),
                                (BufferKind.output, g.output_chunks, lay.output_bytes)):
        spans = [lay.span(kind, k) for k in range(count)]
        pos = 0
        for off, ln in spans:
            assert off == pos
            pos += ln
        assert pos == nbytes


@SETTINGS
@given(layouts())
def test_collective_blocks_line_up(pl):
    """allgather output block r holds input-shaped chunks; reducescatter's input likewise."""
    plan, lay = pl
    n = len(plan.gpus)
    g = plan.gpus[0]
    if plan.collective == "allgather":
        f = g.input_chunks
        for r in range(n):
            for j in range(f):
                off, ln = lay.span(BufferKind.input, j)
                assert lay.span(BufferKind.output, r * f + j) == (r * lay.input_bytes + off, ln)
    if plan.collective == "reducescatter":
        f = g.output_chunks
        for r in range(n):
            for j in range(f):
                off, ln = lay.span(BufferKind.output, j)
                assert lay.span(BufferKind.input, r * f + j) == (r * lay.output_bytes + off, ln)


@SETTINGS
@given(layouts())
def test_scratch_slots_disjoint_and_sized(pl):
    plan, lay = pl
    spans = [lay.span(BufferKind.scratch, k) for k in range(lay.scratch_chunks)]
    for k, (off, ln) in enumerate(spans):
        assert ln == lay.chunk_bytes and off == k * lay.chunk_bytes
    assert _intervals(spans) == ([(0, lay.scratch_bytes)] if lay.scratch_bytes else [])
    # every user chunk fits in a scratch slot (so a chunk can always be staged in scratch)
    for kind in (BufferKind.input, BufferKind.output):
        for k in range(plan.gpus[0].input_chunks if kind == BufferKind.input else plan.gpus[0].output_chunks):
            assert lay.span(kind, k)[1] <= lay.chunk_bytes


@st.composite
def layout_and_op(draw):
    plan, lay = draw(layouts())
    g = plan.gpus[0]
    counts = {BufferKind.input: g.input_chunks, BufferKind.output: g.output_chunks,
              BufferKind.scratch: g.scratch_chunks}
    kinds = [k for k, c in counts.items() if c > 0]
    if not kinds:
        kinds = [BufferKind.scratch]
        counts[BufferKind.scratch] = 1
        lay = make_layout(_plan(plan.collective, len(plan.gpus), g.input_chunks, g.output_chunks, 1,
                                plan.buffer_alignment), 0, lay.input_bytes, lay.output_bytes)
    nops = draw(st.integers(1, 3))
    chosen = [draw(st.sampled_from(kinds)) for _ in range(nops)]
    size = draw(st.integers(1, min(counts[k] for k in chosen)))
    operands = [(k, draw(st.integers(0, counts[k] - size))) for k in chosen]
    return plan, lay, operands, size


@SETTINGS
@given(layout_and_op())
def test_pieces_equal_union_of_chunk_spans(x):
    plan, lay, operands, size = x
    pieces = lay.pieces(operands, size)
    # one operand: its pieces are exactly the union of its chunks' spans
    for i, (kind, index) in enumerate(operands):
        own = _intervals((p.offsets[0], p.length) for p in lay.pieces([(kind, index)], size))
        assert own == _intervals(lay.span(kind, index + t) for t in range(size))
    # several operands: chunk t moves the shortest length among user-buffer operands
    expect_total = 0
    for t in range(size):
        lens = [lay.span(k, i + t)[1] for k, i in operands if k != BufferKind.scratch]
        expect_total += min(lens) if lens else lay.chunk_bytes
    assert total_length(pieces) == expect_total
    for i, (kind, index) in enumerate(operands):
        covered = _intervals(lay.span(kind, index + t) for t in range(size))
        for p in pieces:
            assert any(a <= p.offsets[i] and p.offsets[i] + p.length <= b for a, b in covered)
        # no byte of an operand is moved twice
        mine = sorted((p.offsets[i], p.offsets[i] + p.length) for p in pieces)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(mine, mine[1:]))
    # merged form: already canonical
    assert _stream(pieces) == pieces


@SETTINGS
@given(layout_and_op(), st.integers(1, 12))
def test_group_slices_tile_the_op(x, group_size):
    plan, lay, operands, size = x
    pieces = lay.pieces(operands, size)
    unit = max(plan.buffer_alignment, 8)
    parts = [group_slice(pieces, m, group_size, plan.buffer_alignment) for m in range(group_size)]
    joined = [p for part in parts for p in part]
    assert _stream(joined) == _stream(pieces)
    assert sum(total_length(p) for p in parts) == total_length(pieces)
    # each member's share starts on a unit boundary of the op's byte stream
    pos = 0
    for part in parts:
        if total_length(part):
            assert pos % unit == 0
        pos += total_length(part)


@SETTINGS
@given(layout_and_op(), st.integers(1, 3000), st.integers(1, 6))
def test_pipeline_slices_tile(x, unit_size, group_size):
    plan, lay, operands, size = x
    pieces = lay.pieces(operands, size)
    iters = pipeline_iterations([total_length(pieces)], unit_size)
    slices = [iteration_slice(pieces, j, unit_size) for j in range(iters)]
    assert _stream([p for s in slices for p in s]) == _stream(pieces)
    for j, s in enumerate(slices):
        assert 0 < total_length(s) <= unit_size
        if j < iters - 1:
            assert total_length(s) == unit_size
    # a thread-block group splits every iteration again; the parts still tile it
    for s in slices:
        parts = [group_slice(s, m, group_size, plan.buffer_alignment) for m in range(group_size)]
        assert _stream([p for part in parts for p in part]) == _stream(s)
    assert iteration_slice(pieces, iters, unit_size) == []


def test_pipeline_iterations_follow_longest_op():
    assert pipeline_iterations([100, 250, 0], 100) == 3
    assert pipeline_iterations([], 64) == 0
    assert pipeline_iterations([0], 64) == 0
