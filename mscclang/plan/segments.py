"""Segmented buffers (plan/3): the rules of data-dependent counts, the one home of each.

A segmented buffer (:class:`~mscclang.plan.models.SegmentedBuffer`) is cut into segments whose
row counts are entries of the call's *count matrix*, an ``n x n`` matrix of non-negative ints
that lives in device memory and is read at run time (docs/semantics.md, "Data-dependent
counts"). A call of a plan with segments has these parameters (:class:`CountedCall`):

* ``counts``: the matrix; entry ``(i, j)`` is a number of rows (all-to-all-v: the rows rank
  ``i`` sends to rank ``j``);
* ``row_bytes``: the bytes of one row, the same on every rank;
* ``in_rows`` / ``out_rows``: the rows each rank's input and output hold (their capacities);
* ``capacity``: the rows of one scratch slot, the same on every rank.

Where segment ``k`` lies: in the input and the output (packed), it starts where segment
``k - 1`` ends; in scratch (slots), at ``k * capacity`` rows. The counts are valid when every
entry is at least 0, every packed buffer's segments fit its rows, and every scratch segment fits
its slot (:func:`check_counts`); an op moves the same entry's rows in every operand
(:func:`check_segments`), so for valid counts no op reads or writes past its segment
(:func:`prove_capacity` shows it from the plan alone).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from mscclang.errors import CountsError, PlanError
from mscclang.plan.collectives import TABLE
from mscclang.plan.models import PACKET_OPS, PAIRWISE_OPS, BufferKind, BufferRef, ChannelType, Op, OpName, Plan, ThreadBlock

#: the buffers a counted call's sizes name, by kind
_ROWS = {BufferKind.input: "in_rows", BufferKind.output: "out_rows"}


@dataclass(frozen=True)
class CountedCall:
    """The run-time parameters of one call of a plan with segments (see the module docstring).
    ``counts[i][j]`` is entry ``(i, j)``; ``in_rows[r]`` / ``out_rows[r]`` rank ``r``'s input
    and output rows; ``capacity`` the rows of a scratch slot."""

    counts: tuple[tuple[int, ...], ...]
    row_bytes: int
    in_rows: tuple[int, ...]
    out_rows: tuple[int, ...]
    capacity: int

    def rows(self, entry: tuple[int, int]) -> int:
        """The row count of ``entry``."""
        return self.counts[entry[0]][entry[1]]

    def buffer_rows(self, kind: BufferKind, rank: int) -> int:
        """The rows of ``rank``'s input or output."""
        return (self.in_rows if kind == BufferKind.input else self.out_rows)[rank]


def counted_call(plan: Plan, counts: Sequence[Sequence[int]], row_bytes: int,
                 in_rows: Optional[Sequence[int]] = None, out_rows: Optional[Sequence[int]] = None,
                 capacity: Optional[int] = None) -> CountedCall:
    """A :class:`CountedCall` of ``plan``, its counts checked (:func:`check_counts`). Sizes left
    out are the least that hold the counts: each rank's input and output rows the sum of its
    segments, and the slot capacity the largest entry. :class:`CountsError` for a matrix that is
    not ``n x n`` ints, sizes of the wrong length, or counts the plan cannot run."""
    n = len(plan.gpus)
    if len(counts) != n or any(len(row) != n for row in counts):
        raise CountsError(f"the count matrix must be {n} x {n} (one row and one column per rank), got "
                          f"{len(counts)} rows of {sorted({len(r) for r in counts})} entries")
    m = tuple(tuple(int(v) for v in row) for row in counts)
    if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes < 1:
        raise CountsError(f"row_bytes must be a positive int, got {row_bytes!r}")
    need = {k: [_packed_rows(plan, m, r, k) for r in range(n)] for k in _ROWS}
    sizes = {}
    for k, given in ((BufferKind.input, in_rows), (BufferKind.output, out_rows)):
        if given is not None and len(given) != n:
            raise CountsError(f"{_ROWS[k]} has {len(given)} entries, the plan has {n} ranks")
        sizes[k] = tuple(int(v) for v in given) if given is not None else tuple(max(0, v) for v in need[k])
    cap = capacity if capacity is not None else max([v for row in m for v in row] + [0])
    call = CountedCall(m, row_bytes, sizes[BufferKind.input], sizes[BufferKind.output], max(0, cap))
    check_counts(plan, call)
    return call


def _packed_rows(plan: Plan, m: tuple[tuple[int, ...], ...], rank: int, kind: BufferKind) -> int:
    sb = plan.gpus[rank].segmented(kind)
    return sum(m[i][j] for i, j in sb.entries()) if sb is not None else 0


def check_counts(plan: Plan, call: CountedCall) -> None:
    """The counts are valid for ``plan`` (the rule the kernel checks on the GPU too): every entry
    a segment names is at least 0, each rank's packed input and output segments fit its rows,
    and each scratch segment fits a slot of ``capacity`` rows. :class:`CountsError` naming the
    rank, the buffer and the entry otherwise."""
    for r, g in enumerate(plan.gpus):
        for sb in g.segments or ():
            for k, (i, j) in enumerate(sb.entries()):
                if call.counts[i][j] < 0:
                    raise CountsError(f"rank {r}: count [{i}][{j}] is {call.counts[i][j]}: counts must be at "
                                      f"least 0")
                if sb.type == BufferKind.scratch and call.counts[i][j] > call.capacity:
                    raise CountsError(f"rank {r}: count [{i}][{j}] = {call.counts[i][j]} rows passes the "
                                      f"capacity of {call.capacity} rows (scratch segment {k})")
            if sb.type in _ROWS:
                total, rows = _packed_rows(plan, call.counts, r, sb.type), call.buffer_rows(sb.type, r)
                if total > rows:
                    what = "sends" if sb.type == BufferKind.input else "receives"
                    raise CountsError(f"rank {r}: its {sb.type.name} segments hold {total} rows (the counts "
                                      f"{what}: {[call.counts[i][j] for i, j in sb.entries()]}), more than "
                                      f"its {sb.type.name}'s {rows} rows")


@dataclass(frozen=True)
class SegmentSpan:
    """Where one segment of one rank's buffer lies for one call, in rows: ``start`` and
    ``rows`` (its count)."""

    start: int
    rows: int


def segment_span(plan: Plan, call: CountedCall, rank: int, kind: BufferKind, index: int) -> SegmentSpan:
    """Segment ``index`` of ``rank``'s buffer ``kind`` for ``call``: packed buffers (input,
    output) after the segments before it, scratch at its slot ``index * capacity``."""
    sb = plan.gpus[rank].segmented(kind)
    if sb is None:
        raise PlanError(f"rank {rank}'s {kind.name} buffer has no segments")
    entries = sb.entries()
    rows = call.rows(entries[index])
    if kind == BufferKind.scratch:
        return SegmentSpan(index * call.capacity, rows)
    return SegmentSpan(sum(call.rows(e) for e in entries[:index]), rows)


# ---------------------------------------------------------------------------------------------
# the plan's own rules


def ref_target(plan: Plan, rank: int, tb: ThreadBlock, op: Op, ref: BufferRef) -> Optional[tuple[int, BufferKind]]:
    """(owner rank, buffer kind) of a local or remote reference (None: a switch reference, or one
    whose ids do not resolve: other checks report those)."""
    if ref.type is not None:
        return rank, ref.type
    if ref.buffer_id is None:
        return None
    ids = tb.remote_buffer_list(op.channel_type)
    if ref.buffer_id >= len(ids) or ids[ref.buffer_id] >= len(plan.gpus[rank].remote_buffers):
        return None
    rb = plan.gpus[rank].remote_buffers[ids[ref.buffer_id]]
    return (rb.rank, rb.type) if rb.rank < len(plan.gpus) else None


def ref_entries(plan: Plan, rank: int, tb: ThreadBlock, op: Op, ref: BufferRef) -> Optional[list[tuple[int, int]]]:
    """The count-matrix entries of the segments ``ref`` spans (None: a chunk reference)."""
    target = ref_target(plan, rank, tb, op, ref)
    if target is None:
        return None
    sb = plan.gpus[target[0]].segmented(target[1])
    if sb is None:
        return None
    return sb.entries()[ref.index: ref.index + ref.size]


def moves_whole_slots(op: Op) -> bool:
    """Whether ``op`` moves each of its segments as the segment's whole scratch slot: a put over
    a port channel (``put``, ``pws``, ``pwsf``) is a copy the host enqueues for the copy engine
    (or a network send) with its length fixed when the launch is enqueued, and neither can read a
    count from device memory without a host round trip. So it copies the slot's ``capacity``
    rows whatever the count (the rows past the count carry the source slot's unspecified
    contents), and both its operands must be scratch segments, whose places do not depend on the
    counts (:func:`check_segments`)."""
    return op.channel_type == ChannelType.port and op.name in (OpName.put, OpName.pws, OpName.pwsf)


def check_segments(plan: Plan) -> None:
    """The rules of segmented buffers, beyond each field's shape: a counted collective (its row
    of the collective table says ``counted``) segments every rank's input and output exactly as
    the collective says (:meth:`~mscclang.plan.collectives.Collective.segment_entries`), and no
    other sized collective has segments; a segmented plan is out of place; an op's operands are
    all segments or all chunks; the operands' ``t``-th segments name the same count entry (so
    every operand moves the same rows); a reference stays within its buffer's segments; a port
    put moves scratch segments only (:func:`moves_whole_slots`); and no pipeline, switch channel
    or epilogue op touches a segment. PlanError with the JSON path."""
    n = len(plan.gpus)
    row = TABLE.get(plan.collective)
    for r, g in enumerate(plan.gpus):
        for kind, output in ((BufferKind.input, False), (BufferKind.output, True)):
            sb = g.segmented(kind)
            if row is not None and row.counted:
                want = row.segment_entries(n, r, output)
                if sb is None or sb.entries() != want:
                    raise PlanError(f"{plan.collective} cuts rank {r}'s {kind.name} into the segments "
                                    f"{[list(e) for e in want]}, the plan says "
                                    f"{None if sb is None else [list(e) for e in sb.entries()]}",
                                    f"gpus[{r}].segments")
            elif sb is not None and row is not None and row.sized:
                raise PlanError(f"{plan.collective} has fixed chunks: its buffers take no segments",
                                f"gpus[{r}].segments")
    if not plan.has_segments():
        return
    if plan.inplace:
        raise PlanError("a plan with segmented buffers runs out of place", "inplace")
    for r, g in enumerate(plan.gpus):
        for t, tb in enumerate(g.threadblocks):
            for i, op in enumerate(tb.ops):
                path = f"gpus[{r}].threadblocks[{t}].ops[{i}]"
                for j, inner in enumerate(op.ops or []):
                    if any(ref_entries(plan, r, tb, inner, x) is not None for x in inner.src_buff + inner.dst_buff):
                        raise PlanError("a pipeline cannot move segments (their lengths are known at run time "
                                        "only)", f"{path}.ops[{j}]")
                _check_op(plan, r, tb, op, path)


def _check_op(plan: Plan, rank: int, tb: ThreadBlock, op: Op, path: str) -> None:
    refs = [("src_buff", k, x) for k, x in enumerate(op.src_buff)] + [("dst_buff", k, x) for k, x in enumerate(op.dst_buff)]
    # the operands that move the same rows: every one, or source i with destination i of a
    # pairwise op with as many of each (a fused put to several peers)
    pairs = op.name in PAIRWISE_OPS and len(op.src_buff) == len(op.dst_buff) > 1
    seen: list[tuple[str, int, list[tuple[int, int]]]] = []
    chunked: Optional[str] = None
    for side, k, ref in refs:
        where = f"{path}.{side}[{k}]"
        if ref.switch_channel_id is not None:
            continue
        target = ref_target(plan, rank, tb, op, ref)
        if target is None:
            continue
        sb = plan.gpus[target[0]].segmented(target[1])
        if sb is None:
            chunked = chunked or where
            continue
        if op.name in (OpName.radd, OpName.rmsnorm):
            raise PlanError(f"{op.name.value} cannot take a segment", where)
        if target[1] != BufferKind.scratch and moves_whole_slots(op):
            raise PlanError(f"a port put copies each segment as its whole scratch slot (the copy engine cannot read "
                            f"a count), and rank {target[0]}'s {target[1].name} segments lie where the counts put "
                            "them: copy them through a scratch slot", where)
        if ref.index + ref.size > len(sb.counts):
            raise PlanError(f"segments {ref.index}..{ref.index + ref.size - 1} of rank {target[0]}'s "
                            f"{target[1].name} are out of range ({len(sb.counts)} segments)", where)
        seen.append((where, k if pairs else 0, sb.entries()[ref.index: ref.index + ref.size]))
    if seen and chunked:
        raise PlanError(f"an op moves segments or chunks, not both: {seen[0][0]} is a segment, {chunked} a chunk "
                        "range", path)
    if seen and any(op.name == x for x in (OpName.glre, OpName.glres, OpName.gstore, OpName.gstorepkt)):
        raise PlanError("switch channels do not take segments", path)
    first: dict[int, tuple[str, list[tuple[int, int]]]] = {}
    for where, group, entries in seen:
        w0, e0 = first.setdefault(group, (where, entries))
        if entries != e0:
            raise PlanError(f"the operands' segments hold different counts: {[list(e) for e in entries]} here, "
                            f"{[list(e) for e in e0]} at {w0} (an op moves one count's rows in every operand"
                            + (" pair" if pairs else "") + ")", where)


def row_alignment(plan: Plan) -> int:
    """The multiple of which a call's ``row_bytes`` must be: 8 when some op moves LL packets (an
    LL16 packet carries 8 payload bytes, so a segment never ends inside a packet), else 4."""
    for g in plan.gpus:
        for tb in g.threadblocks:
            for op in tb.ops:
                if op.name in PACKET_OPS or any(i.name in PACKET_OPS for i in op.ops or []):
                    return 8
    return 4


# ---------------------------------------------------------------------------------------------
# the proof that no op passes its buffer, for every valid count matrix


@dataclass
class CapacityProof:
    """What :func:`prove_capacity` showed: ``checked`` operand references, each bounded for
    every valid count matrix, and ``problems`` (one line each) where a bound does not follow."""

    checked: int = 0
    problems: list[str] = field(default_factory=list)


def _bound_of(plan: Plan, rank: int, kind: BufferKind) -> Counter:
    """The linear form a valid count matrix bounds by the buffer's rows: the sum of its segments'
    entries (packed), or one entry per slot (scratch)."""
    sb = plan.gpus[rank].segmented(kind)
    return Counter(sb.entries()) if sb is not None else Counter()


def prove_capacity(plan: Plan) -> CapacityProof:
    """Show, from the plan alone, that no op reads or writes past a segmented buffer for any
    valid count matrix (:func:`check_counts`'s constraints). Each reference to segments
    ``[a, b)`` of a packed buffer ends at the linear form ``sum of entries[0..b)``, which the
    buffer's constraint ``sum of all its entries <= rows`` bounds term by term (counts are not
    negative); a scratch segment ``k`` ends at ``k * capacity + c``, which ``c <= capacity``
    keeps inside slot ``k``, and slot ``k`` is one of the rank's scratch chunks. Every operand of
    an op moves the same entries (:func:`check_segments`), so the rows read equal the rows
    written. Problems name the rank, thread block, op and operand."""
    proof = CapacityProof()
    for r, g in enumerate(plan.gpus):
        for t, tb in enumerate(g.threadblocks):
            for i, op in enumerate(tb.ops):
                for side, refs in (("src", op.src_buff), ("dst", op.dst_buff)):
                    for k, ref in enumerate(refs):
                        target = ref_target(plan, r, tb, op, ref)
                        if target is None or plan.gpus[target[0]].segmented(target[1]) is None:
                            continue
                        proof.checked += 1
                        owner, kind = target
                        entries = plan.gpus[owner].segmented(kind).entries()  # type: ignore[union-attr]
                        where = f"rank {r} tb {t} op {i} ({op.name.value}) {side}[{k}]"
                        if ref.index + ref.size > len(entries):
                            proof.problems.append(f"{where}: segments past the {len(entries)} of rank {owner}'s "
                                                  f"{kind.name}")
                            continue
                        if kind == BufferKind.scratch:
                            continue   # slot k + its count <= capacity: inside the slot, by the constraint
                        extent = Counter(entries[: ref.index + ref.size])
                        bound = _bound_of(plan, owner, kind)
                        over = [e for e, c in extent.items() if c > bound[e]]
                        if over:
                            proof.problems.append(f"{where}: its end counts {over} more often than rank {owner}'s "
                                                  f"{kind.name} rows bound them")
    return proof


# ---------------------------------------------------------------------------------------------
# the count matrices a verify runs


@dataclass(frozen=True)
class CountCase:
    """One count matrix a verify runs: a ``name`` for reports and the ``counts``."""

    name: str
    counts: tuple[tuple[int, ...], ...]


def count_cases(n: int, rows: int = 3, seed: int = 0) -> list[CountCase]:
    """The count matrices every segmented plan is verified on (``rows``: a typical entry): all
    zeros; one receiver (rank 0) taking everything; every entry at ``rows`` (every segment at a
    capacity of ``rows``); single rows; random skewed ones (most rows to a few ranks, zeros
    among them); and one sender (the last rank) sending nothing."""
    rng = random.Random(seed)

    def mat(f) -> tuple[tuple[int, ...], ...]:  # type: ignore[no-untyped-def]
        return tuple(tuple(f(i, j) for j in range(n)) for i in range(n))

    hot = rng.randrange(n)
    cases = [
        CountCase("all zeros", mat(lambda i, j: 0)),
        CountCase("one receiver takes everything", mat(lambda i, j: rows * n if j == 0 else 0)),
        CountCase("every segment at capacity", mat(lambda i, j: rows)),
        CountCase("single rows", mat(lambda i, j: 1)),
        CountCase("random skewed", mat(lambda i, j: rng.choice((0, 1, rows, rows * n)) if j == hot or rng.random() < 0.3
                                       else rng.choice((0, 1)))),
        CountCase("random skewed 2", mat(lambda i, j: rng.choice((0, 0, 1, 2, rows * 2)))),
        CountCase("one sender sends nothing", mat(lambda i, j: 0 if i == n - 1 else (i + j) % (rows + 1) + 1)),
    ]
    return cases
