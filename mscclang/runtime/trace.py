"""The per-op GPU timeline of a traced launch: the trace buffer's layout and its decoding into
Chrome trace events.

A traced launch runs the interpreter's ``_trace`` kernel variant (:func:`mscclang.runtime.build.
kernel_name` with ``traced=True``, built as a module of its own: the untraced kernels are the same
with or without tracing). It takes one more parameter, a buffer of u64 words: word 0 is the
per-block stride (2 x the most device records of a block, :func:`trace_words`); block ``b``'s
record ``i`` gets its {start, end} global-timer nanoseconds at ``1 + b * stride + 2 i``.

:func:`decode` turns one rank's buffer into one event per plan op (a plan op may be several device
records, and a pipeline's inner records belong to it): the earliest start and the latest end of
its records, with the op's name, chunk ranges, channel peers and DSL source line. Times are in
microseconds from the rank's first record, and the record's global-timer value comes with them
(:class:`RankTrace`), so :func:`align` puts every rank on one time base: the GPU global timer,
which the driver sets from the host clock on every GPU (ranks sharing a GPU read one clock; across
GPUs an offset between their timers would show as a shift of that rank's events). Each decoding
also checks the launch against the plan: every op of every block ran, in the block's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from mscclang.errors import PlanError
from mscclang.plan.models import ChannelType, Plan
from mscclang.plan.segments import CountedCall, moves_whole_slots, ref_entries
from mscclang.runtime import cuda as cu
from mscclang.runtime.ports import DOP_PORT_FINAL
from mscclang.runtime.structs import BLOCK_HEADER, DEV_OP


@dataclass(frozen=True)
class TraceLayout:
    """The buffer of one rank's traced launch: ``stride`` u64 per block, ``words`` in all."""

    stride: int
    words: int

    @property
    def nbytes(self) -> int:
        return 8 * self.words


def trace_words(n_records: Sequence[int]) -> TraceLayout:
    """The buffer for blocks holding ``n_records`` device records each (``BlockPlan.n_records``)."""
    stride = 2 * max(n_records, default=0)
    return TraceLayout(stride, 1 + stride * len(n_records))


def run_traced(launcher: Any, n_records: Sequence[int], stream: int, run: Callable[[], None]) -> list[int]:
    """``run()`` (one launch through ``launcher``, on ``stream``) with a zeroed trace buffer for
    blocks of ``n_records`` device records handed to the launcher, then the buffer read back (a
    wait for the launch) and freed: its u64 words, for :func:`decode`."""
    lay = trace_words(n_records)
    buf = cu.mem_alloc(lay.nbytes)
    try:
        cu.memset_d8(buf, 0, lay.nbytes, stream)
        cu.htod(buf, int(lay.stride).to_bytes(8, "little"), stream)
        launcher.trace_ptr = buf
        try:
            run()
        finally:
            launcher.trace_ptr = 0
        raw = cu.dtoh(buf, lay.nbytes, stream)
    finally:
        cu.mem_free(buf)
    return [int.from_bytes(raw[8 * i:8 * i + 8], "little") for i in range(lay.words)]


def record_ops(region: bytes) -> list[tuple[int, int]]:
    """(kind, plan op index) of each device record of a packed block region, in order."""
    head = BLOCK_HEADER.unpack(region, 0)
    out = []
    off = BLOCK_HEADER.size
    for _ in range(head["n_ops"]):
        rec = DEV_OP.unpack(region, off)
        out.append((rec["kind"], rec["index"]))
        off += rec["bytes"]
    return out


@dataclass
class RankTrace:
    """One rank's traced launch: ``events`` (Chrome trace events, microseconds from ``t0_ns``),
    ``t0_ns`` the global timer at its first record (0 when nothing ran) and ``problems``, where
    the launch departs from the plan (an op of a block that did not run, or ran before the op
    before it in its block had ended); empty when it followed the plan."""

    rank: int
    t0_ns: int
    events: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def align(traces: Sequence[RankTrace]) -> list[dict]:
    """Every rank's events on one time base: microseconds from the earliest first record of any
    rank (copies; the traces are left as they are)."""
    ran = [t for t in traces if t.events]
    if not ran:
        return []
    base = min(t.t0_ns for t in ran)
    return [dict(e, ts=e["ts"] + (t.t0_ns - base) / 1e3) for t in ran for e in t.events]


def decode(plan: Plan, rank: int, regions: Sequence[bytes], words: Sequence[int],
           counted: Optional[CountedCall] = None) -> RankTrace:
    """The Chrome trace events (``ph: X``; ``pid`` the rank, ``tid`` the thread block) of one
    rank's traced launch, and its departures from the plan (:class:`RankTrace`): ``regions`` the
    packed block regions it ran, ``words`` its trace buffer read back. Records that did not run
    (an aborted launch) are left out. For a plan with segments, ``counted`` (the call's count
    matrix as it ran) gives each segment op's ``segments`` (``"[i,j]=rows"`` per segment of its
    first operand), ``rows`` and ``bytes``. PlanError when the buffer does not fit the regions."""
    if not words:
        raise PlanError(f"rank {rank}: empty trace buffer")
    stride = int(words[0])
    lay = trace_words([len(record_ops(r)) for r in regions])
    if stride != lay.stride or len(words) < lay.words:
        raise PlanError(f"rank {rank}: the trace buffer ({len(words)} words, stride {stride}) does not fit the "
                        f"launch's {len(regions)} blocks (stride {lay.stride}, {lay.words} words)")
    spans: dict[tuple[int, int], list[int]] = {}
    expected: dict[int, list[int]] = {}
    for b, region in enumerate(regions):
        for i, (kind, index) in enumerate(record_ops(region)):
            if kind != DOP_PORT_FINAL and index not in expected.setdefault(b, []):
                expected[b].append(index)
            s, e = int(words[1 + b * stride + 2 * i]), int(words[2 + b * stride + 2 * i])
            if kind == DOP_PORT_FINAL or s == 0 or e < s:
                continue
            cur = spans.setdefault((b, index), [s, e])
            cur[0], cur[1] = min(cur[0], s), max(cur[1], e)
    if not spans:
        return RankTrace(rank, 0, [], [f"rank {rank}: no op ran"] if expected else [])
    t0 = min(s for s, _ in spans.values())
    g = plan.gpus[rank]
    out = []
    for (b, index), (s, e) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        tb = g.threadblocks[b]
        op = tb.ops[index]
        args: dict[str, Any] = {"op": op.name.value, "index": index}
        refs = [f"{'s' if r.type is None else r.type.value}[{r.index}:{r.index + r.size}]"
                for r in list(op.src_buff) + list(op.dst_buff)]
        if refs:
            args["chunks"] = " ".join(refs)
        peers = _peers(g, tb, op)
        if peers:
            args["peers"] = peers
        if op.src:
            args["src"] = op.src
        if counted is not None:
            args.update(_segment_args(plan, rank, tb, op, counted))
        out.append({"name": op.name.value, "ph": "X", "pid": rank, "tid": tb.id, "ts": (s - t0) / 1e3,
                    "dur": (e - s) / 1e3, "args": args})
    return RankTrace(rank, t0, out, _order_problems(rank, expected, spans))


def _order_problems(rank: int, expected: dict[int, list[int]], spans: dict[tuple[int, int], list[int]]) -> list[str]:
    """Where a block's ops did not all run, one after the other, in the plan's order."""
    out = []
    for b, indices in sorted(expected.items()):
        prev: Optional[tuple[int, int]] = None   # (op index, end)
        for index in sorted(indices):
            span = spans.get((b, index))
            if span is None:
                out.append(f"rank {rank} thread block {b} op {index}: did not run")
                continue
            if prev is not None and span[0] < prev[1]:
                out.append(f"rank {rank} thread block {b} op {index}: started {(prev[1] - span[0]) / 1e3:.3f} us "
                           f"before op {prev[0]} ended")
            prev = (index, span[1])
    return out


def _segment_args(plan: Plan, rank: int, tb: Any, op: Any, counted: CountedCall) -> dict[str, Any]:
    """The rows a segment op moved in this call and its bytes (a port put's: its whole slots;
    nothing for a chunk op)."""
    for ref in list(op.src_buff) + list(op.dst_buff):
        entries = ref_entries(plan, rank, tb, op, ref)
        if entries is not None:
            rows = [counted.rows(e) for e in entries]
            moved = len(rows) * counted.capacity if moves_whole_slots(op) else sum(rows)
            return {"segments": " ".join(f"[{i},{j}]={v}" for (i, j), v in zip(entries, rows)),
                    "rows": sum(rows), "bytes": moved * counted.row_bytes}
    return {}


def _peers(g: Any, tb: Any, op: Any) -> list[int]:
    ct = op.channel_type if op.channel_type != ChannelType.none else ChannelType.memory
    try:
        chans = tb.channel_list(ct)
        peers = g.peers(ct)
        return sorted({peers[chans[c]] for c in op.channel_ids})
    except (IndexError, ValueError):
        return []


def chrome_trace(events: list[dict], plan: Optional[Plan] = None) -> dict:
    """The Chrome trace-event JSON of decoded events (every rank's), with process names."""
    ranks = sorted({e["pid"] for e in events})
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in ranks]
    return {"traceEvents": events + meta, "displayTimeUnit": "ns",
            "otherData": {"plan": plan.name if plan is not None else None, "source": "GPU global timer"}}
