"""``mscclang show PLAN.json``: a text summary of a plan.

Per rank: chunk counts, channels (with their peers), remote buffers and semaphores; per thread
block: its channel and remote-buffer lists, then each op with its chunk ranges and channels.

Chunk ranges read ``i[0:2]`` (input chunks 0 and 1 of this rank), ``s[4:6]@r1`` (scratch chunks
4 and 5 of rank 1, reached through a remote buffer) and ``o[0:2]@sw0`` (output chunks 0 and 1
through switch channel 0, i.e. every member of its group). Channels read ``ch3->r2``: the rank's
channel 3 of the op's type, leading to rank 2. MSCCL++ plans are converted on the fly.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
from typing import Optional

from mscclang.cli.args import suffix_arg
from mscclang.errors import PlanError
from mscclang.plan.io import plan_from_document, read_plan_document
from mscclang.plan.segments import moves_whole_slots
from mscclang.plan.models import (
    BufferKind,
    BufferRef,
    ChannelType,
    Gpu,
    Op,
    OpName,
    Plan,
    REDUCE_OPS,
    ThreadBlock,
)

__all__ = ["add_parser", "run", "format_plan", "format_op"]

_PAIRED = frozenset({OpName.copy, OpName.cpkt, OpName.upkt, OpName.put, OpName.pws, OpName.pwsf,
                     OpName.get, OpName.ppkt})


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "show", help="print a plan per rank and thread block",
        description="Print a text summary of a plan (mscclang or MSCCL++ format): per rank, per "
                    "thread block, each op with its chunk ranges (i[0:2], s[4:6]@r1) and channels "
                    "(ch3->r2).")
    p.add_argument("plan", metavar="PLAN.json", help="plan file ('-' reads standard input)")
    p.add_argument("--rank", type=int, default=None, help="show only this rank")
    p.add_argument("--tb", type=int, default=None, help="show only this thread block")
    p.add_argument("--no-check", action="store_true",
                   help="show a plan that fails the semantic checks (indexes out of range print as ?)")
    p.add_argument("--png", metavar="OUT.png", default=None, type=suffix_arg(".png"),
                   help="draw the plan as a picture instead (per rank, per thread block, ops as a timeline "
                        "with signal/wait, data and packet edges; --rank/--tb restrict it). A long timeline "
                        "wraps into rows; rows that do not fit a page go to OUT-2.png, OUT-3.png...; "
                        "needs matplotlib")
    p.add_argument("--trace", metavar="TRACE.json", default=None,
                   help="with --png: place the ops at the times of a Chrome trace of this plan (mscclang "
                        "predict --trace, or a traced run), waits as long as they waited, the critical path "
                        "outlined")
    p.set_defaults(func=run)


def refuse_other_files(source: str, data: object, what: str = "a plan", want: str = "mscclang.plan/") -> None:
    """PlanError naming ``source`` when the document is another mscclang file: its ``format`` is
    ``mscclang.*`` but does not start with ``want`` ("": no mscclang format is ``what``)."""
    fmt = data.get("format") if isinstance(data, dict) else None
    if isinstance(fmt, str) and fmt.startswith("mscclang.") and not (want and fmt.startswith(want)):
        raise PlanError(f"{source} is a {fmt!r} file, not {what}")


def read_plan_any(source: str, check: bool = True) -> tuple[Plan, bool]:
    """Load a plan file in either format; returns (plan, was_mscclpp)."""
    from mscclang.plan.mscclpp import from_mscclpp, is_mscclpp_plan

    data = read_plan_document(source)
    refuse_other_files(source, data)
    if is_mscclpp_plan(data):
        return from_mscclpp(data, check=check), True
    return plan_from_document(data, check=check), False


def check_tb(plan: Plan, tb: int, rank: Optional[int]) -> None:
    """PlanError naming the valid range unless thread block ``tb`` exists on ``rank`` (or, without
    a rank, on some rank)."""
    ranks = [rank] if rank is not None else list(range(len(plan.gpus)))
    counts = [len(plan.gpus[r].threadblocks) for r in ranks]
    if 0 <= tb < max(counts, default=0):
        return
    where = f"rank {rank} has" if rank is not None else "the plan has"
    most = max(counts, default=0)
    have = f"thread blocks 0..{most - 1}" if most > 1 else ("thread block 0 only" if most == 1 else "no thread blocks")
    raise PlanError(f"--tb {tb}: {where} {have}")


def run(args: argparse.Namespace) -> int:
    plan, was_mscclpp = read_plan_any(args.plan, check=not args.no_check)
    if args.rank is not None and not 0 <= args.rank < len(plan.gpus):
        raise PlanError(f"--rank {args.rank}: the plan has ranks 0..{len(plan.gpus) - 1}")
    if args.tb is not None:
        check_tb(plan, args.tb, args.rank)
    trace = None
    if getattr(args, "trace", None):
        if not getattr(args, "png", None):
            raise PlanError("--trace draws a picture: give --png OUT.png too")
        import json

        try:
            trace = json.loads(Path(args.trace).read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"--trace {args.trace}: cannot read a JSON trace ({e})") from None
        refuse_other_files(f"--trace {args.trace}", trace, "a Chrome trace", want="")
        if not isinstance(trace.get("traceEvents") if isinstance(trace, dict) else trace, list):
            raise PlanError(f"--trace {args.trace}: not a Chrome trace (no traceEvents list)")
    if getattr(args, "png", None):
        from mscclang.viz import draw_plan

        pic = draw_plan(plan, args.png, ranks=None if args.rank is None else [args.rank],
                        tbs=None if args.tb is None else [args.tb], trace=trace)
        wrapped = f", timeline wrapped into {pic.panels} rows" if pic.panels > 1 else ""
        if len(pic.paths) > 1:
            sys.stdout.write(f"wrote {len(pic.paths)} pages: {', '.join(str(p) for p in pic.paths)} "
                             f"({pic.width_px} px wide, {pic.num_ops} ops{wrapped})\n")
        else:
            sys.stdout.write(f"wrote {pic.path} ({pic.width_px} x {pic.height_px} px, {pic.num_ops} ops{wrapped})\n")
        return 0
    text = format_plan(plan, rank=args.rank, tb=args.tb)
    if was_mscclpp:
        text = "(converted from an MSCCL++ plan)\n" + text
    sys.stdout.write(text)
    return 0


def _size(n: int) -> str:
    if n == 2**64 - 1:
        return "max"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


class _Names:
    """Resolves a thread block's local indexes into readable names (``?`` when out of range)."""

    def __init__(self, gpu: Gpu, tb: ThreadBlock) -> None:
        self.gpu = gpu
        self.tb = tb
        self._peers: dict[ChannelType, list[int]] = {}
        self._groups: Optional[list] = None

    def peers(self, ct: ChannelType) -> list[int]:
        got = self._peers.get(ct)
        if got is None:
            got = self._peers[ct] = self.gpu.peers(ct)
        return got

    def ref(self, ref: BufferRef, ct: ChannelType) -> str:
        rng = f"[{ref.index}:{ref.index + ref.size}]"
        if ref.type is not None:
            return f"{ref.type.value}{rng}"
        if ref.buffer_id is not None:
            lst = self.tb.remote_buffer_list(ct)
            if ref.buffer_id < len(lst) and lst[ref.buffer_id] < len(self.gpu.remote_buffers):
                rb = self.gpu.remote_buffers[lst[ref.buffer_id]]
                return f"{rb.type.value}{rng}@r{rb.rank}"
            return f"?{rng}@remote#{ref.buffer_id}"
        lst = self.tb.channel_list(ChannelType.switch)
        if self._groups is None:
            self._groups = self.gpu.switch_groups()
        groups = self._groups
        sid = ref.switch_channel_id
        if sid is not None and sid < len(lst) and lst[sid] < len(groups):
            kind, _ = groups[lst[sid]]
            return f"{kind.value}{rng}@sw{lst[sid]}"
        return f"?{rng}@sw?{sid}"

    def channel(self, cid: int, ct: ChannelType) -> str:
        lst = self.tb.channel_list(ct)
        if cid >= len(lst):
            return f"ch?{cid}"
        g = lst[cid]
        if ct == ChannelType.switch:
            return f"sw{g}"
        peers = self.peers(ct)
        return f"ch{g}->r{peers[g]}" if g < len(peers) else f"ch{g}->?"


def format_op(op: Op, names: _Names, label: str) -> list[str]:
    """One op (and, for a pipeline, its inner ops) as text lines."""
    ct = op.channel_type
    srcs = [names.ref(x, ct) for x in op.src_buff]
    dsts = [names.ref(x, ct) for x in op.dst_buff]
    if op.name == OpName.pipeline:
        assert op.iter_context is not None and op.ops is not None  # the model guarantees both
        head = (f"{label:>6}  pipeline   unit {_size(op.iter_context.unit_size)}, "
                f"{op.iter_context.num_chunks} chunk(s) per iteration{_src(op)}")
        lines = [head]
        for j, inner in enumerate(op.ops):
            lines.extend(format_op(inner, names, f"{label}.{j}"))
        return lines
    if op.name in _PAIRED and len(srcs) == len(dsts):
        body = ", ".join(f"{s} -> {d}" for s, d in zip(srcs, dsts))
    elif op.name in REDUCE_OPS:
        body = " + ".join(srcs) + " -> " + ", ".join(dsts)
    elif srcs or dsts:
        body = ", ".join(srcs) + " -> " + ", ".join(dsts)
    else:
        body = ""
    extras = []
    if op.channel_ids:
        extras.append(" ".join(names.channel(c, ct) for c in op.channel_ids))
    elif ct != ChannelType.none:
        extras.append(ct.value)
    if op.name == OpName.barrier:
        members = f" tbs {op.barrier_tbs}" if op.barrier_tbs is not None else ""
        extras.append(f"id {op.barrier_id}, {op.num_threadblocks} thread blocks{members}")
    if op.semaphore_ids:
        extras.append("sem " + " ".join(f"#{s}" for s in op.semaphore_ids))
    if op.tbg_info is not None:
        extras.append(f"tbg {op.tbg_info.tb_id}/{op.tbg_info.tbg_size}")
    if op.reduce_op is not None:
        extras.append(op.reduce_op.value)
    if moves_whole_slots(op) and names.gpu.segmented(BufferKind.scratch) is not None:
        extras.append("whole slots")   # a port put of segments copies each slot's capacity
    tail = ("  [" + "; ".join(extras) + "]") if extras else ""
    sep = "  " if body else ""
    return [f"{label:>6}  {op.name.value:<10}{sep}{body}{tail}".rstrip() + _src(op)]


def _src(op: Op) -> str:
    """``  # program.py:42`` when the op records the DSL line that made it, else ``""``."""
    src = getattr(op, "src", None)
    return f"  # {src}" if src else ""


def _rank_lines(plan: Plan, r: int, tb_filter: Optional[int]) -> list[str]:
    g = plan.gpus[r]
    n_tb = len(g.threadblocks)
    lines = [f"rank {r}: input {g.input_chunks} chunk(s), output {g.output_chunks}, "
             f"scratch {g.scratch_chunks}; {n_tb} thread block{'s' if n_tb != 1 else ''}"]
    for sb in g.segments or ():   # plan/3: what each segment's rows are
        lines.append(f"  {sb.type.name} segments (rows of counts[i][j]): "
                     + " ".join(f"{k}=c[{i}][{j}]" for k, (i, j) in enumerate(sb.entries())))
    chan_parts = []
    for ct in (ChannelType.memory, ChannelType.port):
        peers = g.peers(ct)
        if peers:
            chan_parts.append(f"{ct.value} " + " ".join(f"ch{i}->r{p}" for i, p in enumerate(peers)))
    sw = g.switch_groups()
    if sw:
        chan_parts.append("switch " + " ".join(
            f"sw{i}:{k.value}{{{','.join(str(x) for x in ranks)}}}" for i, (k, ranks) in enumerate(sw)))
    lines.append("  channels: " + ("; ".join(chan_parts) if chan_parts else "none"))
    if g.remote_buffers:
        lines.append("  remote buffers: " + " ".join(
            f"#{i}={b.type.value}@r{b.rank}({','.join(c.value for c in b.access_channel_types)})"
            for i, b in enumerate(g.remote_buffers)))
    if g.semaphores:
        lines.append("  semaphores: " + " ".join(f"#{i}={s.init_value}" for i, s in enumerate(g.semaphores)))
    for t, tb in enumerate(g.threadblocks):
        if tb_filter is not None and t != tb_filter:
            continue
        names = _Names(g, tb)
        desc = []
        for c in tb.channels:
            if c.channel_type == ChannelType.switch:
                desc.append("switch " + " ".join(f"sw{x}" for x in c.channel_ids))
            else:
                peers = g.peers(c.channel_type)
                desc.append(f"{c.channel_type.value} " + " ".join(
                    f"ch{x}->r{peers[x]}" if x < len(peers) else f"ch{x}->?" for x in c.channel_ids))
        for ref in tb.remote_buffer_refs:
            bufs = []
            for x in ref.remote_buffer_ids:
                if x < len(g.remote_buffers):
                    b = g.remote_buffers[x]
                    bufs.append(f"{b.type.value}@r{b.rank}")
                else:
                    bufs.append(f"?#{x}")
            desc.append(f"remote via {ref.access_channel_type.value}: " + " ".join(bufs))
        header = f"  tb {t}: {len(tb.ops)} op{'s' if len(tb.ops) != 1 else ''}"
        if desc:
            header += " | " + " | ".join(desc)
        lines.append(header)
        for i, op in enumerate(tb.ops):
            lines.extend(format_op(op, names, str(i)))
    return lines


def format_plan(plan: Plan, rank: Optional[int] = None, tb: Optional[int] = None) -> str:
    """The text summary ``mscclang show`` prints (optionally only one rank / thread block)."""
    place = "in place" if plan.inplace else "out of place"
    extras = []
    if plan.use_double_scratch_buffer:
        extras.append("double scratch")
    if plan.reuse_resources:
        extras.append("reuses resources")
    if plan.root is not None:
        extras.append(f"root {plan.root}")
    if plan.reduce_op is not None:
        extras.append(f"reduce {plan.reduce_op.value}")
    if plan.packet_type is not None:
        extras.append(f"packets {plan.packet_type.value}")
    head = (f"plan {plan.name}: {plan.collective} over {len(plan.gpus)} ranks, protocol {plan.protocol}, "
            f"{place}, {plan.num_threads_per_block} threads per block, alignment {plan.buffer_alignment} B, "
            f"messages {_size(plan.min_message_size)} .. {_size(plan.max_message_size)}")
    if extras:
        head += ", " + ", ".join(extras)
    lines = [head]
    for r in range(len(plan.gpus)):
        if rank is not None and r != rank:
            continue
        lines.extend(_rank_lines(plan, r, tb))
    return "\n".join(lines) + "\n"
