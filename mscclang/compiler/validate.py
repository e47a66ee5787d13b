"""Pass 1: validation.

Checks, raising :class:`~mscclang.errors.DSLError` with the rank, thread block, op index and the
DSL call that recorded the op:

* thread block ids within ``0 .. MAX_THREADBLOCKS-1``; barrier members exist and carry the
  barrier;
* every chunk reference inside its buffer (remote: the peer's; switch: every member's);
* sizes agree between the operands of an op; local operands belong to the op's rank, remote ones
  to a peer of the op's channels; channel and semaphore ids exist;
* LL packets only in scratch buffers; pipeline bodies hold at least one data op (the longest
  data op of a body sets its iteration count, see :mod:`mscclang.plan.layout`);
* signal/wait balance **per channel** and per direction: the signals sent on rank A's ``j``-th
  channel to B (``signal``, ``rlxsignal`` and, for port channels, ``pws``/``pwsf``) equal the
  waits on B's paired channel (the one with the same ordinal among B's channels to A), counted
  separately per pipeline context. An imbalance is a :class:`~mscclang.errors.DSLWarning` (the
  plan is emitted, as MSCCL++'s DSL does, and the simulator reports the deadlock) unless the
  program is compiled with ``strict=True``, which makes it a ``DSLError``;
* semaphores: acquires equal releases per semaphore; a semaphore that starts at 0 needs a thread
  block that releases it before acquiring it;
* segments (plan/3): an op's operands are all segments or all chunks, their ``t``-th segments
  name the same count-matrix entry, a port put moves scratch segments only
  (:func:`mscclang.plan.segments.moves_whole_slots`), and no pipeline, switch op, epilogue op or replicated
  program (``instances > 1``) moves a segment (:func:`check_segment_op`);
* with ``instances > 1`` and the interleaved replication policy, overlapping chunks of one buffer
  are addressed with identical ranges everywhere
  (:func:`mscclang.compiler.replicate.check_interleaved_ranges`).
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from mscclang.compiler.ir import IROp, IRProgram, IRRank, Ref, op_where, signal_side
from mscclang.compiler.meter import each_rank
from mscclang.compiler.replicate import check_interleaved_ranges
from mscclang.compiler.source import user_frame, user_stacklevel
from mscclang.errors import DSLError, DSLWarning
from mscclang.plan.segments import moves_whole_slots
from mscclang.plan.models import (PACKET_DST_FROM, PACKET_SRC_FROM, REDUCE_OPS, SWITCH_OPS, BufferKind, ChannelType,
                                  OpName, paired_index, paired_indices)

#: the largest number of thread blocks one rank may use
MAX_THREADBLOCKS = 1024

_SAME_SIZE_PAIRS = frozenset({OpName.copy, OpName.cpkt, OpName.upkt, OpName.put, OpName.pws, OpName.pwsf,
                              OpName.ppkt, OpName.get})


where = op_where


def packet_refs(op: IROp) -> list[tuple[str, Ref]]:
    """Operands of ``op`` that hold LL packets (they must be in scratch)."""
    out: list[tuple[str, Ref]] = []
    # gstorepkt reads its scratch source as packets (PACKET_SRC_FROM lists packet reads that wait for flags)
    for role, refs, start in (("source", op.src, 0 if op.name == OpName.gstorepkt else PACKET_SRC_FROM.get(op.name)),
                              ("destination", op.dst, PACKET_DST_FROM.get(op.name))):
        if start is not None:   # a packet reduction's packet operands follow its plain one
            out += [(f"packet {role}" if start else role, x) for x in refs[start:]]
    return out


def _check_op(ir: IRProgram, r: IRRank, tb: int, idx: str, op: IROp) -> None:
    w = where(r.rank, tb, idx, op)
    if op.name == OpName.pipeline:
        if op.iter_context is None or op.body is None:
            raise DSLError(f"{w}: a pipeline needs an iteration context and a body")
        if not any(inner.src or inner.dst for inner in op.body):
            raise DSLError(f"{w}: a pipeline body needs at least one data op: its iteration count is that of "
                           f"its longest data op, so a body of sync ops only would run 0 times")
        for j, inner in enumerate(op.body):
            if inner.name == OpName.pipeline:
                raise DSLError(f"{where(r.rank, tb, f'{idx}.{j}', inner)}: pipelines cannot be nested")
            _check_op(ir, r, tb, f"{idx}.{j}", inner)
            check_segment_op(ir, where(r.rank, tb, f"{idx}.{j}", inner), inner, in_pipeline=True)
        return
    # channels
    if op.channel_type in (ChannelType.memory, ChannelType.port):
        peers = r.peers(op.channel_type)
        for c in op.channels:
            if not 0 <= c < len(peers):
                raise DSLError(f"{w}: {op.channel_type.value} channel {c} does not exist (rank {r.rank} has {len(peers)})")
    elif op.channel_type == ChannelType.switch:
        for c in op.channels:
            if not 0 <= c < len(r.switch):
                raise DSLError(f"{w}: switch channel {c} does not exist (rank {r.rank} has {len(r.switch)})")
    # semaphores
    for s in op.semaphores:
        if not 0 <= s < len(r.semaphores):
            raise DSLError(f"{w}: semaphore {s} does not exist (rank {r.rank} has {len(r.semaphores)})")
    # references: rank, bounds
    peer_set = {r.peers(op.channel_type)[c] for c in op.channels
                if op.channel_type in (ChannelType.memory, ChannelType.port) and 0 <= c < len(r.peers(op.channel_type))}
    for role, refs in (("source", op.src), ("destination", op.dst)):
        for ref in refs:
            if ref.size < 1 or ref.index < 0:
                raise DSLError(f"{w}: {role} {ref.describe()} is empty or negative")
            if ref.switch is not None:
                if op.name not in SWITCH_OPS:
                    raise DSLError(f"{w}: {role} {ref.describe()} is a multicast reference outside a switch op")
                if not 0 <= ref.switch < len(r.switch):
                    raise DSLError(f"{w}: {role} uses switch channel {ref.switch}, which rank {r.rank} does not have")
                sw = r.switch[ref.switch]
                for member in sw.ranks:
                    n = ir.ranks[member].chunks(sw.buffer)
                    if ref.end > n:
                        raise DSLError(f"{w}: {role} {ref.describe()} is out of bounds of rank {member}'s "
                                       f"{sw.buffer.name} buffer ({n} chunks)")
                continue
            if ref.remote:
                if op.channel_type not in (ChannelType.memory, ChannelType.port):
                    raise DSLError(f"{w}: {role} {ref.describe()} is remote but the op uses no channel")
                if ref.rank not in peer_set:
                    raise DSLError(f"{w}: {role} {ref.describe()} is on rank {ref.rank}, which the op's channels "
                                   f"do not reach (peers {sorted(peer_set)})")
            elif ref.rank != r.rank:
                raise DSLError(f"{w}: local {role} {ref.describe()} belongs to rank {ref.rank}, not {r.rank}")
            if not 0 <= ref.rank < ir.num_ranks:
                raise DSLError(f"{w}: {role} names rank {ref.rank}, outside the program's {ir.num_ranks} ranks")
            n = ir.ranks[ref.rank].chunks(ref.buffer)
            if ref.end > n:
                raise DSLError(f"{w}: {role} {ref.describe()} is out of bounds (rank {ref.rank}'s "
                               f"{ref.buffer.name} buffer has {n} chunks)")
    # sizes
    if op.name in _SAME_SIZE_PAIRS:
        if len(op.src) != len(op.dst):
            raise DSLError(f"{w}: {len(op.src)} sources but {len(op.dst)} destinations")
        for s, d in zip(op.src, op.dst):
            if s.size != d.size:
                raise DSLError(f"{w}: size mismatch: source {s.describe()} has {s.size} chunks, "
                               f"destination {d.describe()} has {d.size}")
    elif op.name in REDUCE_OPS or op.name in (OpName.rppkt, OpName.gstore, OpName.gstorepkt):
        refs = op.src + op.dst
        if refs and any(x.size != refs[0].size for x in refs):
            sizes = ", ".join(f"{x.describe()}: {x.size}" for x in refs)
            raise DSLError(f"{w}: size mismatch among operands ({sizes})")
    check_segment_op(ir, w, op)
    # packets only in scratch
    for role, ref in packet_refs(op):
        if ref.buffer != BufferKind.scratch:
            raise DSLError(f"{w}: {role} {ref.describe()} holds LL packets and must be a scratch buffer")


def paired_channel(ir: IRProgram, rank: int, ctype: ChannelType, j: int) -> Optional[int]:
    """The channel of the peer paired with ``rank``'s ``j``-th channel of ``ctype`` (same ordinal
    among the channels that join the two ranks: :func:`mscclang.plan.models.paired_index`), or
    ``None``."""
    peers = ir.ranks[rank].peers(ctype)
    return paired_index(rank, peers, j, ir.ranks[peers[j]].peers(ctype))


def channel_pairs(ir: IRProgram) -> dict[tuple[int, ChannelType, int], Optional[int]]:
    """:func:`paired_channel` of every channel, keyed ``(rank, channel type, channel)``, in time
    linear in the number of channels (:func:`mscclang.plan.models.paired_indices`)."""
    out: dict[tuple[int, ChannelType, int], Optional[int]] = {}
    for ctype in (ChannelType.memory, ChannelType.port):
        table = paired_indices([r.peers(ctype) for r in ir.ranks])
        for r, row in zip(ir.ranks, table):
            for j, back in enumerate(row):
                out[(r.rank, ctype, j)] = back
    return out


@dataclass(frozen=True)
class Imbalance:
    """One unbalanced channel and direction: the message, and the source line (``file.py:42``)
    of the first signal or wait of the side that has more (the DSL call to look at), if known."""

    message: str
    source: Optional[str] = None


def signal_wait_counts(ir: IRProgram, sources: Optional[dict] = None) -> tuple[Counter, Counter]:
    """(signals, waits): Counters keyed by ``(rank, channel type, channel, pipeline context)``;
    ``sources`` (when given) gets ``("signal" or "wait", key) -> the first op's source line``."""
    sig: Counter = Counter()
    wai: Counter = Counter()

    def visit(rank: int, ops: list[IROp], ctx: Optional[tuple[int, int]]) -> None:
        for op in ops:
            if op.body is not None:
                visit(rank, op.body, op.iter_context)
                continue
            side = signal_side(op)
            for c in op.channels if side else ():
                key = (rank, op.channel_type, c, ctx)
                (sig if side == "signal" else wai)[key] += 1
                if sources is not None:
                    sources.setdefault((side, key), op.source)

    for r in ir.ranks:
        for ops in r.tbs:
            visit(r.rank, ops, None)
    return sig, wai


def _ctx_text(ctx: Optional[tuple[int, int]]) -> str:
    return "" if ctx is None else f" (inside pipelines with unit={ctx[0]}, num_chunks={ctx[1]}, per iteration)"


def signal_wait_imbalances(ir: IRProgram) -> list[Imbalance]:
    """One :class:`Imbalance` per unbalanced channel and direction (see the module docstring),
    naming the ranks, channels and counts; empty when every channel is balanced."""
    src: dict = {}
    sig, wai = signal_wait_counts(ir, src)
    pairs = channel_pairs(ir)
    sig_ctxs: dict[tuple, set] = {}
    wai_ctxs: dict[tuple, set] = {}
    for counts, index in ((sig, sig_ctxs), (wai, wai_ctxs)):
        for key in counts:
            index.setdefault(key[:3], set()).add(key[3])
    out: list[str] = []
    for r in ir.ranks:
        for ctype in (ChannelType.memory, ChannelType.port):
            for j, peer in enumerate(r.peers(ctype)):
                pj = pairs.get((r.rank, ctype, j))
                ctxs = set(sig_ctxs.get((r.rank, ctype, j), ()))
                if pj is not None:
                    ctxs |= wai_ctxs.get((peer, ctype, pj), set())
                for ctx in sorted(ctxs, key=lambda c: (1, 0, 0) if c is None else (0, *c)):
                    s = sig[(r.rank, ctype, j, ctx)]
                    if pj is None:
                        out.append(Imbalance(
                            f"unbalanced signal/wait: rank {r.rank} signals {s} times on its {ctype.value} channel "
                            f"{j} to rank {peer}, but rank {peer} has no {ctype.value} channel paired with it "
                            f"(so nothing waits){_ctx_text(ctx)}", src.get(("signal", (r.rank, ctype, j, ctx)))))
                        continue
                    wv = wai[(peer, ctype, pj, ctx)]
                    if s != wv:
                        more = ("signal", (r.rank, ctype, j, ctx)) if s > wv else ("wait", (peer, ctype, pj, ctx))
                        out.append(Imbalance(
                            f"unbalanced signal/wait: rank {r.rank} signals {s} times on its {ctype.value} channel "
                            f"{j} to rank {peer}, but rank {peer} waits {wv} times on the paired {ctype.value} "
                            f"channel {pj}{_ctx_text(ctx)}", src.get(more)))
    # waits on channels whose peer has no paired channel at all
    for (rank, ctype, j, ctx), n in sorted(wai.items(), key=lambda kv: (kv[0][0], kv[0][1].value, kv[0][2])):
        if n and pairs.get((rank, ctype, j)) is None:
            peer = ir.ranks[rank].peers(ctype)[j]
            out.append(Imbalance(
                f"unbalanced signal/wait: rank {rank} waits {n} times on its {ctype.value} channel {j} from rank "
                f"{peer}, but rank {peer} has no {ctype.value} channel paired with it (so nothing signals)"
                f"{_ctx_text(ctx)}", src.get(("wait", (rank, ctype, j, ctx)))))
    return out


_IMBALANCE_HINT = " (the plan can hang: `mscclang verify` reports where)"


def check_signal_wait(ir: IRProgram) -> None:
    """Signal/wait balance per channel and direction (see the module docstring).

    MSCCL++'s DSL only balances signals and waits per rank pair and compiles programs that are
    unbalanced on one channel, so by default each imbalance is a
    :class:`~mscclang.errors.DSLWarning` and the plan is still emitted; with ``ir.strict`` the
    first one raises :class:`~mscclang.errors.DSLError` (naming how many there are)."""
    problems = signal_wait_imbalances(ir)
    if not problems:
        return
    if ir.strict:
        more = f" (and {len(problems) - 1} more unbalanced channels)" if len(problems) > 1 else ""
        raise DSLError(_at(problems[0]) + problems[0].message + more + " [strict mode]")
    for p in problems:
        warning = DSLWarning(p.message + _IMBALANCE_HINT)
        file, _, line = (p.source or "").rpartition(":")
        if file and line.isdigit():  # the signal or wait call, not the line that compiled
            frame = user_frame()  # its full path, when the compiling line is in the same file
            if frame is not None and os.path.basename(frame.f_code.co_filename) == file:
                file = frame.f_code.co_filename
            warnings.warn_explicit(warning, DSLWarning, file, int(line))
        else:
            warnings.warn(warning, stacklevel=user_stacklevel())


def _at(p: Imbalance) -> str:
    return f"{p.source}: " if p.source else ""


def check_semaphores(ir: IRProgram) -> None:
    """Acquire/release balance and the initial-value rule (see the module docstring)."""
    for r in ir.ranks:
        acq: Counter = Counter()
        rel: Counter = Counter()
        first: dict[int, dict[int, OpName]] = {}
        for tb, ops in enumerate(r.tbs):
            flat = []
            for op in ops:
                flat.extend(op.body if op.body is not None else [op])
            for op in flat:
                for s in op.semaphores:
                    if op.name == OpName.sem_acquire:
                        acq[s] += 1
                    elif op.name == OpName.sem_release:
                        rel[s] += 1
                    first.setdefault(s, {}).setdefault(tb, op.name)
        for s, init in enumerate(r.semaphores):
            if acq[s] != rel[s]:
                raise DSLError(f"unbalanced semaphore: semaphore {s} of rank {r.rank} is acquired {acq[s]} times "
                               f"and released {rel[s]} times per launch")
            if init == 0 and acq[s] and all(n == OpName.sem_acquire for n in first.get(s, {}).values()):
                tbs = sorted(first.get(s, {}))
                raise DSLError(f"semaphore {s} of rank {r.rank} starts at 0, but every thread block that uses it "
                               f"(tbs {tbs}) acquires it before releasing it: the first acquire can never succeed")


def _segments_of(ir: IRProgram, ref: Ref) -> Optional[list[tuple[int, int]]]:
    seg = ir.ranks[ref.rank].segments.get(ref.buffer) if ref.switch is None else None
    return None if seg is None else seg[ref.index: ref.end]


def check_segment_op(ir: IRProgram, w: str, op: IROp, in_pipeline: bool = False) -> None:
    """The segment rules of one op (see the module docstring); ``w`` names it."""
    refs = op.src + op.dst
    segs = [(x, _segments_of(ir, x)) for x in refs]
    moved = [(x, e) for x, e in segs if e is not None]
    if not moved:
        return
    first, entries = moved[0]
    if in_pipeline:
        raise DSLError(f"{w}: a pipeline cannot move segments ({first.describe()}): their lengths are known at "
                       "run time only")
    if ir.instances > 1:
        raise DSLError(f"{w}: a program that moves segments runs one instance (instances={ir.instances}): a "
                       "segment is not split")
    if op.name in SWITCH_OPS or op.name in (OpName.radd, OpName.rmsnorm):
        raise DSLError(f"{w}: {op.name.value} cannot take a segment ({first.describe()})")
    packed = [x for x, e in moved if x.buffer != BufferKind.scratch]
    if packed and moves_whole_slots(op):  # type: ignore[arg-type]
        raise DSLError(f"{w}: a port put copies each segment as its whole scratch slot (the copy engine cannot read "
                       f"a count), and rank {packed[0].rank}'s {packed[0].describe()} lies where the counts put it: "
                       "copy it through a scratch slot")
    for x, e in segs:
        if e is None:
            raise DSLError(f"{w}: {first.describe()} is a segment of rank {first.rank} but {x.describe()} is a chunk "
                           "range: an op moves segments or chunks, not both")
        if e != entries:
            raise DSLError(f"{w}: {x.describe()} holds the counts {[list(c) for c in e]} but {first.describe()} holds "
                           f"{[list(c) for c in entries]}: every operand of an op moves the same count's rows")


def validate(ir: IRProgram) -> IRProgram:
    """Check the program (see the module docstring); return an unchanged copy."""
    out = ir.copy()
    for r in each_rank(out.ranks):
        if len(r.tbs) > MAX_THREADBLOCKS:
            raise DSLError(f"rank {r.rank} uses {len(r.tbs)} thread blocks; at most {MAX_THREADBLOCKS} are allowed")
        for s, init in enumerate(r.semaphores):
            if init < 0:
                raise DSLError(f"semaphore {s} of rank {r.rank} has a negative initial value {init}")
        barrier_members: dict[int, list[set[int]]] = {}
        for tb, ops in enumerate(r.tbs):
            for i, op in enumerate(ops):
                _check_op(out, r, tb, str(i), op)
                for inner in ([op] if op.body is None else op.body):
                    if inner.name == OpName.barrier:
                        tbs = inner.barrier_tbs or []
                        if inner.barrier_id is None or tb not in tbs:
                            raise DSLError(f"{where(r.rank, tb, str(i), inner)}: barrier must list its own thread block")
                        for t in tbs:
                            if not 0 <= t < len(r.tbs):
                                raise DSLError(f"{where(r.rank, tb, str(i), inner)}: barrier member tb {t} does not exist")
                        barrier_members.setdefault(inner.barrier_id, []).append(set(tbs))
        for bid, sets in barrier_members.items():
            if any(s != sets[0] for s in sets):
                raise DSLError(f"rank {r.rank}: barrier id {bid} is used by different sets of thread blocks")
            count = Counter()
            for tb, ops in enumerate(r.tbs):
                for op in ops:
                    for inner in ([op] if op.body is None else op.body):
                        if inner.name == OpName.barrier and inner.barrier_id == bid:
                            count[tb] += 1
            members = sorted(sets[0])
            if len({count[t] for t in members}) != 1:
                per = ", ".join(f"tb {t}: {count[t]}" for t in members)
                raise DSLError(f"rank {r.rank}: barrier id {bid} is reached a different number of times by its "
                               f"thread blocks ({per})")
    check_signal_wait(out)
    check_semaphores(out)
    check_interleaved_ranges(out)
    return out
