"""The GPU executor's side of data-dependent counts (plans with segmented buffers,
docs/semantics.md "Data-dependent counts"): the device format of segment ops and count checks,
and what a launch of such a plan needs.

A segment op's device record (flag ``FLAG_SEGMENTS``) holds no lengths: piece ``t`` names its
count entry ``i * n + j``, and each operand a word that the kernel turns into a byte offset with
the call's count matrix, ``row_bytes`` and ``capacity`` (``executor/plan_layout.cuh``): a scratch
slot ``k`` starts at ``k * capacity * row_bytes``; segment ``k`` of a packed input or output
after the rows of the ``k`` segments before it in the owner rank's buffer, whose entries lie in
the plan's *segment table* (one u32 list per segmented buffer, identical lists stored once). So
the records depend on the plan alone; the sizes, the matrix's device address and the tables go
into the header (:func:`counted_blob`). Every block checks the matrix against the plan's
*count checks* (:func:`count_tables`, the same on every rank) before any data moves and aborts
with ``WHAT_COUNTS``, which the host raises as :class:`~mscclang.errors.CountsError`
(:func:`counts_error_text`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from mscclang.errors import PlanError
from mscclang.plan.layout import Layout, counted_layouts
from mscclang.plan.models import BufferKind, BufferRef, Op, Plan, ThreadBlock
from mscclang.plan.segments import ref_entries, ref_target
from mscclang.runtime.structs import CONSTANTS, COUNT_CHECK, PLAN_HEADER

if TYPE_CHECKING:
    from mscclang.runtime.packing import PackedRank
    from mscclang.runtime.trace import RankTrace

SEG_SLOT = CONSTANTS["SEG_SLOT"]
CHECK_NONNEG, CHECK_EXPECT, CHECK_INPUT, CHECK_OUTPUT, CHECK_SCRATCH = (
    CONSTANTS[k] for k in ("CHECK_NONNEG", "CHECK_EXPECT", "CHECK_INPUT", "CHECK_OUTPUT", "CHECK_SCRATCH"))
WHAT_COUNTS = CONSTANTS["WHAT_COUNTS"]
_KINDS = (BufferKind.input, BufferKind.output, BufferKind.scratch)


@dataclass(frozen=True)
class CountedLaunch:
    """What one launch of a plan with segments needs beyond a plain call: ``counts_ptr``, the
    device address of the int32 count matrix ``[n][2n+2]`` (fixed per communicator, so a CUDA
    graph replays with the counts written between replays), ``row_bytes``, ``capacity`` (rows of
    a scratch slot, the same on every rank) and this rank's ``in_rows`` / ``out_rows``."""

    counts_ptr: int
    row_bytes: int
    capacity: int
    in_rows: int
    out_rows: int

    @property
    def in_bytes(self) -> int:
        return self.in_rows * self.row_bytes

    @property
    def out_bytes(self) -> int:
        return self.out_rows * self.row_bytes


@dataclass(frozen=True)
class CountCheck:
    """One constraint on the count matrix (``CHECK_*`` of plan_layout.cuh): ``kind``, the
    ``rank`` it bounds, and the ``count`` entries of the segment table from ``first`` (for
    ``CHECK_EXPECT``: the senders ``0 .. count-1``)."""

    kind: int
    rank: int
    first: int
    count: int


@dataclass(frozen=True)
class CountTables:
    """The segment table of a plan (``words``: count entries ``i * n + j``; ``lists``: where
    rank ``r``'s buffer ``kind`` starts in it) and its count checks, in the order the kernel
    reports the first that fails. The same on every rank."""

    n: int
    words: tuple[int, ...]
    lists: dict[tuple[int, BufferKind], int]
    checks: tuple[CountCheck, ...]

    def entries(self, first: int, count: int) -> list[tuple[int, int]]:
        """The ``(i, j)`` entries of ``count`` words from ``first``."""
        return [divmod(w, self.n) for w in self.words[first:first + count]]


def count_tables(plan: Plan) -> CountTables:
    """:class:`CountTables` of ``plan``: every count a segment of any rank names is at least 0;
    every rank's stated expectations match the senders' counts; each rank's packed input and
    output segments fit its rows; each scratch segment fits a slot."""
    n = len(plan.gpus)
    words: list[int] = []
    seen: dict[tuple[int, ...], int] = {}
    lists: dict[tuple[int, BufferKind], int] = {}
    for g in plan.gpus:
        for kind in _KINDS:
            sb = g.segmented(kind)
            if sb is None:
                continue
            key = tuple(i * n + j for i, j in sb.entries())
            if key not in seen:
                seen[key] = len(words)
                words += key
            lists[(g.id, kind)] = seen[key]
    sizes = {k: len(plan.gpus[k[0]].segmented(k[1]).entries()) for k in lists}  # type: ignore[union-attr]
    checks = [CountCheck(CHECK_NONNEG, r, lists[(r, k)], sizes[(r, k)]) for (r, k) in lists]
    checks += [CountCheck(CHECK_EXPECT, i, 0, n) for i in range(n)] if lists else []
    for kind, code in ((BufferKind.input, CHECK_INPUT), (BufferKind.output, CHECK_OUTPUT),
                       (BufferKind.scratch, CHECK_SCRATCH)):
        checks += [CountCheck(code, r, lists[(r, k)], sizes[(r, k)]) for (r, k) in lists if k == kind]
    return CountTables(n, tuple(words), lists, tuple(checks))


def segment_pieces(plan: Plan, tables: CountTables, rank: int, tb: ThreadBlock, op: Op,
                   refs: Sequence[BufferRef]) -> Optional[list[tuple[int, int, tuple[int, ...]]]]:
    """The device pieces of one record over segments, ``(entry, 0, operand words)`` per
    segment (None: the record moves chunks). The plan check holds the operands to one entry per
    segment (:func:`mscclang.plan.segments.check_segments`)."""
    entries = ref_entries(plan, rank, tb, op, refs[0])
    if entries is None:
        return None
    targets = [ref_target(plan, rank, tb, op, r) for r in refs]
    out = []
    for t, (i, j) in enumerate(entries):
        words = []
        for ref, target in zip(refs, targets):
            if target is None:
                raise PlanError(f"rank {rank} thread block {tb.id}: a segment operand does not resolve")
            k = ref.index + t
            words.append((k << 32) | (SEG_SLOT if target[1] == BufferKind.scratch else tables.lists[target]))
        out.append((i * tables.n + j, 0, tuple(words)))
    return out


def counted_layout_of(plan: Plan, rank: int, launch: CountedLaunch) -> Layout:
    """``rank``'s layout for ``launch`` (its chunk ops' grid, its scratch)."""
    n = len(plan.gpus)
    return counted_layouts(plan, [launch.in_bytes] * n, [launch.out_bytes] * n,
                           launch.capacity * launch.row_bytes)[rank]


def counted_scratch_bytes(plan: Plan, launch: CountedLaunch) -> int:
    """Scratch bytes every rank allocates for ``launch``: the largest rank's slots."""
    n = len(plan.gpus)
    return max(lay.scratch_alloc_bytes for lay in counted_layouts(
        plan, [launch.in_bytes] * n, [launch.out_bytes] * n, launch.capacity * launch.row_bytes))


def counted_blob(blob: bytes, tables: CountTables, launch: CountedLaunch) -> bytes:
    """A device plan (``pack_blob``'s bytes) with the counts in its header and the segment
    table and count checks appended (16-byte aligned)."""
    head = PLAN_HEADER.unpack(blob)
    out = bytearray(blob)
    out += b"\0" * (-len(out) % 16)
    seg_off = len(out)
    out += b"".join(w.to_bytes(4, "little") for w in tables.words)
    out += b"\0" * (-len(out) % 16)
    check_off = len(out)
    for c in tables.checks:
        out += COUNT_CHECK.pack(kind=c.kind, rank=c.rank, first=c.first, count=c.count)
    if len(out) >= 2**32:
        raise PlanError(f"device plan of {len(out)} bytes exceeds 4 GiB")
    head.update(counts=launch.counts_ptr, row_bytes=launch.row_bytes, capacity=launch.capacity,
                seg_table=seg_off, check_table=check_off, n_ranks=tables.n, n_checks=len(tables.checks))
    out[:PLAN_HEADER.size] = PLAN_HEADER.pack(**head)
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# the host's side of the count matrix


def matrix(counts: Sequence[Sequence[int]], in_rows: Sequence[int], out_rows: Sequence[int],
           expect: Optional[Sequence[Sequence[int]]] = None) -> list[list[int]]:
    """The device count matrix ``[n][2n+2]``: row ``i`` is ``counts[i]``, ``in_rows[i]``,
    ``out_rows[i]``, then the rows rank ``i`` expects from each rank (``-1``: not stated)."""
    n = len(counts)
    return [list(counts[i]) + [in_rows[i], out_rows[i]] + (list(expect[i]) if expect else [-1] * n)
            for i in range(n)]


def counts_error_text(kind: int, rank: int, i: int, j: int, seen: int, bound: int) -> str:
    """The one line of a failed count check (from the kernel's error record)."""
    if kind == CHECK_NONNEG:
        return f"count [{i}][{j}] is {seen} (a segment of rank {rank}): counts must be at least 0"
    if kind == CHECK_EXPECT:
        return f"rank {i} expects {bound} rows from rank {j}, rank {j} sends {seen}"
    if kind == CHECK_SCRATCH:
        return f"rank {rank}: count [{i}][{j}] = {seen} rows passes the capacity of {bound} rows (a scratch segment)"
    what, verb = ("input", "sends") if kind == CHECK_INPUT else ("output", "receives")
    return (f"rank {rank}: its {what} segments hold {seen} rows (the counts it {verb}), more than its {what}'s "
            f"{bound} rows")


def pack_counted(plan: Plan, rank: int, launch: CountedLaunch, static: Optional[dict] = None) -> PackedRank:
    """``rank``'s block regions for ``launch`` (:func:`mscclang.runtime.packing.pack_blocks` on
    the counted layout; the segment records do not depend on it, chunk ops on scratch do)."""
    from mscclang.runtime.packing import pack_blocks

    return pack_blocks(plan, rank, launch.in_bytes, launch.out_bytes, static,
                       layout=counted_layout_of(plan, rank, launch))


# ---------------------------------------------------------------------------------------------
# launching (the executor's entry point for plans with segments)


def run_counted_launch(ex: Any, plan: Plan, input: Any, output: Any, launch: CountedLaunch,  # noqa: A002
                       packet_type: Any = None, stream: Any = None) -> None:
    """Launch ``plan`` (a plan with segments) on this rank of executor ``ex`` with torch tensors
    ``input`` (at least ``launch.in_bytes``) and ``output`` (at least ``launch.out_bytes``) on
    the current torch stream (or ``stream``). The kernel reads the count matrix at
    ``launch.counts_ptr`` when it runs and checks it first (every rank reaches the same verdict;
    a failed check raises :class:`~mscclang.errors.CountsError` at the next call or
    synchronisation, on every rank). The first launch of a (sizes, capacity, counts address,
    buffers) builds its device plan (collective when the scratch grows): do it before a CUDA
    graph capture; the capture then replays with whatever counts the matrix holds. A zero-copy
    plan runs on symmetric buffers only. InvalidCall for a plan without segments, a row size
    the plan cannot move or tensors smaller than the launch. Collective: every rank calls it
    with the same plan, ``row_bytes`` and ``capacity``."""
    from mscclang.errors import InvalidCall
    from mscclang.plan.call import check_tensor
    from mscclang.plan.dtypes import kernel_code, torch_dtype_info

    r = ex.comm.rank
    for what, t, need in (("input", input, launch.in_bytes), ("output", output, launch.out_bytes)):
        check_tensor(t, what, r, ex.comm.device)
        if t.numel() * t.element_size() < need:
            raise InvalidCall(f"rank {r}: the {what} holds {t.numel() * t.element_size()} bytes, the launch "
                              f"needs {need}")
    info = torch_dtype_info(input.dtype)
    if info is None or not info.gpu:
        raise InvalidCall(f"rank {r}: dtype {input.dtype} is not one the GPU runs")
    launch_counted(ex, plan, input.data_ptr(), output.data_ptr(), kernel_code(info.code), launch, packet_type, stream)


def run_counted_call(ex: Any, plan: Plan, call: Any, packet_type: Any = None, stream: Any = None,
                     traced: bool = False) -> Optional["RankTrace"]:
    """:func:`run_counted_launch` of a call the collective API checked
    (:func:`mscclang.plan.call.make_counted_call`): its addresses, dtype and counted part. With
    ``traced``, :func:`launch_counted`'s traced launch and its trace."""
    a = call.counted
    launch = CountedLaunch(a.counts_ptr, a.row_bytes, a.capacity, a.in_rows, a.out_rows)
    return launch_counted(ex, plan, call.in_ptr, call.out_ptr, call.kernel_code, launch, packet_type, stream, traced)


def launch_counted(ex: Any, plan: Plan, in_ptr: int, out_ptr: int, dt: str, launch: CountedLaunch,
                   packet_type: Any = None, stream: Any = None, traced: bool = False) -> Optional["RankTrace"]:
    """The launch of :func:`run_counted_launch` on checked buffers at ``in_ptr``/``out_ptr`` of
    kernel dtype code ``dt``. With ``traced`` it runs the interpreter's traced variant, waits for
    it, reads the count matrix back and returns this rank's trace, whose segment ops carry the
    rows and bytes they moved (:func:`mscclang.runtime.trace.decode`); never inside a capture."""
    from mscclang.errors import InvalidCall, NotPrepared
    from mscclang.plan.segments import row_alignment
    from mscclang.runtime import cuda as cu
    from mscclang.runtime.state import DevPlanKey, LaunchEntry, Operands, describe_call

    ab = ex.abort
    if ab.aborted or ab.state():
        ab.check()
    r = ex.comm.rank
    lp = ex.load(plan)
    if not plan.has_segments():
        raise InvalidCall(f"rank {r}: plan {plan.name} has no segments: run it with execute")
    align = row_alignment(plan)
    if launch.row_bytes < 1 or launch.row_bytes % align or launch.capacity < 0 or min(launch.in_rows, launch.out_rows) < 0:
        raise InvalidCall(f"rank {r}: row_bytes must be a positive multiple of {align} and capacity and rows at least "
                          f"0, got row_bytes={launch.row_bytes}, capacity={launch.capacity}, in_rows={launch.in_rows}, "
                          f"out_rows={launch.out_rows}")
    pkt = ex._packet(lp, packet_type)
    s = ex.launcher.current_stream() if stream is None else int(getattr(stream, "cuda_stream", stream))
    sym_in = sym_out = None
    opr = Operands()
    if lp.zero_copy:
        sym_in, sym_out = ex.comm.symmetric_of(in_ptr), ex.comm.symmetric_of(out_ptr)
        if sym_in is None or sym_out is None or sym_in.internal or sym_out.internal:
            raise InvalidCall(f"rank {r}: plan {plan.name} writes into the peers' buffers: run it on symmetric "
                              "buffers (Communicator.alloc)")
        opr = Operands("sym", in_ptr - sym_in.base, out_ptr - sym_out.base)
    row = ("counted", launch.counts_ptr, launch.row_bytes, launch.capacity)
    key = DevPlanKey(launch.in_bytes, launch.out_bytes, getattr(sym_in, "index", None),
                     getattr(sym_out, "index", None), row)   # type: ignore[arg-type]
    ctx = lp.ctx
    dp = ctx.plans.get(key) if ctx is not None and ctx.scratch_bytes >= counted_scratch_bytes(plan, launch) else None
    if traced and ex.launcher.stream_capturing(s):
        raise NotPrepared(f"rank {r}: a traced launch cannot be captured in a CUDA graph")
    f = ex.kernels.interpreter(dt, pkt, lp.default_op, lp.nthreads, traced=traced)
    if dp is None:
        if ex.launcher.stream_capturing(s):
            raise NotPrepared(f"rank {r}: the first launch of plan {plan.name} at these sizes sets up its device "
                              "plan: launch it once before capturing")
        # the slots' offsets in a peer's scratch are computed with this rank's sizes: they must agree
        theirs = ex.comm.allgather_bytes(f"{launch.row_bytes} {launch.capacity}".encode(), f"counted launch of {plan.name}")
        if len(set(theirs)) > 1:
            raise InvalidCall(f"rank {r}: plan {plan.name} needs the same row_bytes and capacity on every rank, got "
                              + ", ".join(f"rank {q}: {b.decode()}" for q, b in enumerate(theirs)))
        ctx = ex.contexts.ensure(lp, launch.in_bytes, launch.out_bytes, need=counted_scratch_bytes(plan, launch))
        packed = pack_counted(plan, r, launch, lp.static)
        # before the upload: a device plan kept for a launch that cannot run would skip this check
        ex.kernels.fit(f, lp.nthreads, packed.smem, len(packed.blocks), f"rank {r}", packed.uses_packets,
                       packed.packet_align, pkt)
        dp = ex.contexts.upload(lp, ctx, key, packed, sym_in, sym_out, s,
                                lambda blob: counted_blob(blob, count_tables(plan), launch))
        if lp.has_port:   # port puts copy whole scratch slots: the proxy's script has fixed lengths
            dp.port_launch = ex.entries.port_launch(lp, dp, launch.in_bytes, launch.out_bytes,
                                                    lambda q: pack_counted(plan, q, launch, lp.static).port)
    ent = LaunchEntry(f, dp.blob, dp.n_blocks, lp.nthreads, dp.smem, cu.ptr(f), None, None, ctx, dp.port_launch)
    ab.user_thread = threading.get_ident()
    ex._last_call = (describe_call(plan, launch.in_bytes, launch.out_bytes, dt, pkt, lp.default_op) + " (counted"
                     + (", traced)" if traced else ")"))
    if not traced:
        ex.run(lp, ent, opr, in_ptr, out_ptr, launch.in_bytes, launch.out_bytes, s)
        return None
    return _traced_run(ex, plan, lp, ent, opr, dp, in_ptr, out_ptr, launch, s)


def _traced_run(ex: Any, plan: Plan, lp: Any, ent: Any, opr: Any, dp: Any, in_ptr: int, out_ptr: int,
                launch: CountedLaunch, s: int) -> "RankTrace":
    """The traced launch of :func:`launch_counted`: a zeroed trace buffer, the launch, then the
    buffer and the count matrix read back (a wait) and decoded with the call's counts."""
    from mscclang.plan.segments import counted_call
    from mscclang.runtime import cuda as cu
    from mscclang.runtime.trace import decode, run_traced

    n, cols = len(plan.gpus), 2 * len(plan.gpus) + 2
    words = run_traced(ex.launcher, [b.n_records for b in dp.packed.blocks], s, lambda: ex.run(
        lp, ent, opr, in_ptr, out_ptr, launch.in_bytes, launch.out_bytes, s))
    mat = cu.dtoh(launch.counts_ptr, 4 * n * cols, s)
    ex.abort.check()
    m = [[int.from_bytes(mat[4 * (i * cols + j): 4 * (i * cols + j) + 4], "little", signed=True) for j in range(cols)]
         for i in range(n)]
    call = counted_call(plan, [row[:n] for row in m], launch.row_bytes, [row[n] for row in m],
                        [row[n + 1] for row in m], launch.capacity)
    return decode(plan, ex.comm.rank, [b.region for b in dp.packed.blocks], words, counted=call)
