"""Semantic validation of execution plans.

The pydantic models (``mscclang.plan.models``) check the shape of each field; :func:`validate_plan`
checks what only the whole plan can tell: that every index points at something that exists,
that every op has the operands its kind needs, and that the chunk counts fit the collective.
Every failure raises :class:`~mscclang.errors.PlanError` whose ``path`` is the JSON path of the
offending field, e.g. ``gpus[1].threadblocks[2].ops[3].channel_ids[0]``.

What is checked:

* rank channels: memory/port peers are ranks of the plan other than the owner; switch channels
  name a buffer kind and rank groups whose ``size`` equals the number of (distinct, valid) ranks
  and which contain the owner;
* remote buffers: a valid peer rank (not the owner) and memory/port access channel types;
* thread blocks: at most one channel list and one remote-buffer list per channel type, every
  index within the rank's channels / remote buffers (and the buffer is accessible through that
  channel type);
* ops: the channel type, channel ids and operands each op kind needs (e.g. ``copy`` exactly one
  local source and one local destination, ``res`` at least two destinations: a local one then
  remote ones), channel ids within the thread block's list for the op's channel type, remote
  buffer ids within the block's refs, chunk ranges within the buffers' chunk counts (remote ones
  against the peer's counts, switch ones against every member's), packet operands in scratch,
  equal chunk counts of corresponding operands, semaphore ids in range, port channels matching
  the peer of the buffer they write;
* barriers: every op with one ``barrier_id`` on a rank agrees on ``num_threadblocks`` (and
  ``barrier_tbs``), and exactly that many thread blocks use the id;
* thread-block groups: the members of one grouped op agree on ``tbg_size`` and each position
  ``0 .. tbg_size-1`` occurs equally often;
* packets: a plan with packet ops has ``buffer_alignment`` of at least 8 and its packet
  pipelines a ``unit_size`` divisible by 8 (an LL16 packet carries 8 payload bytes);
* reduce ops: every reduction that names a reduce op names the same one (and the plan's
  ``reduce_op``, when set), since one launch runs one reduce op;
* epilogue ops (plan/2): ``radd`` reads one local input/output/scratch range into the same
  number of residual chunks; ``rmsnorm`` reads residual chunks into the output chunks of the same
  index; neither stands in a pipeline and rmsnorm takes no thread-block group; the weight buffer
  ``w`` is never referenced; a ``/1`` plan holds no epilogue op;
* the collective: chunk counts of every rank equal the collective's (``spec_from_plan``); an
  in-place plan whose input is its output may give one of the two buffers zero chunks, as
  MSCCL++ plans do.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from mscclang.errors import PlanError
from mscclang.plan.collectives import FUSED_NORM, TABLE, spec_from_plan
from mscclang.plan.segments import check_segments
from mscclang.plan.models import (
    EPILOGUE_OPS,
    BufferKind,
    BufferRef,
    ChannelType,
    Gpu,
    PACKET_OPS,
    PLAN_FORMAT_2,
    PLAN_FORMAT_3,
    REDUCE_OPS,
    SEMAPHORE_OPS,
    SYNC_OPS,
    Op,
    OpName,
    Plan,
    ThreadBlock,
)

__all__ = ["validate_plan", "OP_RULES", "OpRule"]

# operand kinds of the rule table
L = "local"  # a local buffer of any kind
S = "scratch"  # a local scratch buffer (packets)
R = "remote"  # a peer's buffer through remote_buffer_refs
RS = "remote-scratch"  # a peer's scratch buffer (packets)
W = "switch"  # the multicast view of a switch channel
D = "data"  # a local input, output or scratch buffer (radd's source)
RES = "residual"  # the local residual buffer ('r')
OUT = "output"  # the local output buffer ('o')
_LOCAL_WANTS = {L: None, S: frozenset({BufferKind.scratch}),
                D: frozenset({BufferKind.input, BufferKind.output, BufferKind.scratch}),
                RES: frozenset({BufferKind.residual}), OUT: frozenset({BufferKind.output})}

_MEM = frozenset({ChannelType.memory})
_PORT = frozenset({ChannelType.port})
_MEMPORT = frozenset({ChannelType.memory, ChannelType.port})
_NONE = frozenset({ChannelType.none})
_SWITCH = frozenset({ChannelType.switch})


@dataclass(frozen=True)
class OpRule:
    """What one op kind needs.

    ``src``/``dst`` describe the operand lists: ``head`` is a fixed prefix of operand kinds,
    ``tail`` the kind of the remaining operands (``None``: none allowed) and ``min_tail`` how
    many of them there must be at least. ``pairs``: ``src[i]`` corresponds to ``dst[i]`` (copy-like
    ops, equal list lengths) rather than every operand having the same chunk count.
    ``channels``: whether ``channel_ids`` are required, optional or forbidden.
    """

    channel_types: frozenset
    src_head: tuple[str, ...] = ()
    src_tail: Optional[str] = None
    src_min_tail: int = 0
    dst_head: tuple[str, ...] = ()
    dst_tail: Optional[str] = None
    dst_min_tail: int = 0
    pairs: bool = False
    channels: str = "forbidden"  # "required" | "optional" | "forbidden"


_WEIGHT_REF = ("the weight buffer ('w') is read whole by every rmsnorm: plans never reference it "
               "in buffer refs, remote buffers or switch channels")


def _copy_like(src: str, dst: str, types: frozenset, channels: str = "forbidden") -> OpRule:
    return OpRule(types, src_tail=src, src_min_tail=1, dst_tail=dst, dst_min_tail=1, pairs=True,
                  channels=channels)


OP_RULES: dict[OpName, OpRule] = {
    OpName.nop: OpRule(_NONE),
    OpName.barrier: OpRule(_NONE),
    OpName.sem_acquire: OpRule(_NONE),
    OpName.sem_release: OpRule(_NONE),
    OpName.pipeline: OpRule(_NONE),
    OpName.signal: OpRule(_MEMPORT, channels="required"),
    OpName.wait: OpRule(_MEMPORT, channels="required"),
    OpName.rlxsignal: OpRule(_MEM, channels="required"),
    OpName.rlxwait: OpRule(_MEM, channels="required"),
    OpName.flush: OpRule(_PORT, channels="required"),
    OpName.copy: OpRule(_NONE, src_head=(L,), dst_head=(L,), pairs=True),
    OpName.cpkt: _copy_like(L, S, _NONE),
    OpName.upkt: _copy_like(S, L, _NONE),
    OpName.put: _copy_like(L, R, _MEMPORT, "optional"),
    OpName.pws: _copy_like(L, R, _PORT, "required"),
    OpName.pwsf: _copy_like(L, R, _PORT, "required"),
    OpName.get: _copy_like(R, L, _MEM, "optional"),
    OpName.ppkt: _copy_like(L, RS, _MEMPORT, "optional"),
    # one packet source forwarded to every destination (or one source per destination)
    OpName.rppkt: OpRule(_MEMPORT, src_tail=S, src_min_tail=1, dst_tail=RS, dst_min_tail=1,
                         channels="optional"),
    OpName.re: OpRule(_NONE, src_tail=L, src_min_tail=2, dst_head=(L,)),
    OpName.res: OpRule(_MEM, src_tail=L, src_min_tail=2, dst_head=(L,), dst_tail=R,
                       dst_min_tail=1, channels="optional"),
    OpName.rre: OpRule(_MEM, src_head=(L,), src_tail=R, src_min_tail=1, dst_head=(L,),
                       channels="optional"),
    OpName.rres: OpRule(_MEM, src_head=(L,), src_tail=R, src_min_tail=1, dst_head=(L,),
                        dst_tail=R, dst_min_tail=1, channels="optional"),
    OpName.repkt: OpRule(_NONE, src_head=(L,), src_tail=S, src_min_tail=1, dst_head=(L,)),
    OpName.respkt: OpRule(_MEM, src_head=(L,), src_tail=S, src_min_tail=1, dst_head=(L,),
                          dst_tail=RS, dst_min_tail=1, channels="optional"),
    OpName.recpkt: OpRule(_NONE, src_head=(L,), src_tail=S, src_min_tail=1, dst_head=(L, S)),
    OpName.recspkt: OpRule(_MEM, src_head=(L,), src_tail=S, src_min_tail=1,
                           dst_head=(L, S), dst_tail=RS, dst_min_tail=1, channels="optional"),
    OpName.glre: OpRule(_SWITCH, src_head=(W,), dst_head=(L,), channels="optional"),
    OpName.gstore: OpRule(_SWITCH, src_head=(L,), dst_head=(W,), channels="optional"),
    OpName.glres: OpRule(_SWITCH, src_head=(W,), dst_head=(W,), channels="optional"),
    OpName.gstorepkt: OpRule(_SWITCH, src_head=(L,), dst_head=(W,), channels="optional"),
    # plan/2 epilogue: r[dst] += src; o[dst] = norm(r[src]) (the same chunks)
    OpName.radd: OpRule(_NONE, src_head=(D,), dst_head=(RES,)),
    OpName.rmsnorm: OpRule(_NONE, src_head=(RES,), dst_head=(OUT,)),
}

# ops that never carry a thread-block group (they are not split over threads by bytes)
_NO_TBG = SYNC_OPS | frozenset({OpName.nop, OpName.barrier,
                     OpName.rmsnorm})
# ops whose channel i serves remote operand i
_CHANNEL_PER_REMOTE = frozenset({OpName.put, OpName.pws, OpName.pwsf, OpName.get, OpName.ppkt,
                                 OpName.rppkt})
# switch refs of these ops are packet destinations (the switch buffer must be scratch)
_PACKET_SWITCH_DST = frozenset({OpName.gstorepkt})


def _check_fields(plan: Plan) -> None:
    """The plan's own fields: at least one rank, and ``root``, ``replicated_residual``,
    ``chunk_unit`` and epilogue ops only for the collectives they are about."""
    if not plan.gpus:
        raise PlanError("a plan needs at least one rank", "gpus")
    row = TABLE.get(plan.collective)
    rooted, fused = row is not None and row.rooted, row is not None and row.fused
    if plan.root is not None and not rooted:
        raise PlanError(f"'root' is only meaningful for broadcast, not {plan.collective}", "root")
    if plan.replicated_residual is not None and not fused:
        raise PlanError(f"'replicated_residual' is about the residual of {FUSED_NORM} plans, not "
                        f"{plan.collective}", "replicated_residual")
    if fused and not plan.has_epilogue_ops():
        raise PlanError(f"an {FUSED_NORM} plan adds the residual and normalises: it needs radd and rmsnorm "
                        "ops (docs/semantics.md, \"Epilogue ops\")", "collective")
    if plan.chunk_unit is not None and not fused:
        raise PlanError(f"'chunk_unit' \"row\" cuts chunks at rows of the epilogue's hidden size: only "
                        f"{FUSED_NORM} plans have rows, not {plan.collective}", "chunk_unit")


def _check_packet_alignment(plan: Plan) -> None:
    """Packet offsets are multiples of the alignment (chunk slots), of 8 (thread-block
    group shares) and of a pipeline's ``unit_size`` (its slices). An LL16 packet carries 8
    payload bytes, so a plan with packet ops needs ``buffer_alignment`` of at least 8 and
    packet pipelines a ``unit_size`` divisible by 8, as the GPU's device plan does."""
    first: Optional[str] = None
    for path, op in iter_op_paths(plan):
        if op.name in PACKET_OPS and first is None:
            first = path
        if op.name == OpName.pipeline and op.iter_context is not None and op.iter_context.unit_size % 8:
            inner = [o.name.value for o in op.ops or [] if o.name in PACKET_OPS]
            if inner:
                raise PlanError(f"a pipeline with packet ops ({inner[0]}) needs unit_size divisible "
                                f"by 8 (the payload of one LL16 packet), got {op.iter_context.unit_size}",
                                f"{path}.iter_context.unit_size")
    a = plan.buffer_alignment
    if first is not None and a < 8:
        raise PlanError(f"a plan with packet ops (the first at {first}) needs buffer_alignment of at "
                        f"least 8 (the payload of one LL16 packet), got {a}", "buffer_alignment")


def _check_double_scratch(plan: Plan) -> None:
    """With double scratch a launch picks a half of every scratch it touches, the peer's too,
    by the same offset rule: every rank must have the same scratch chunk count."""
    if not plan.use_double_scratch_buffer:
        return
    first = plan.gpus[0].scratch_chunks
    for r, gpu in enumerate(plan.gpus):
        if gpu.scratch_chunks != first:
            raise PlanError(
                f"use_double_scratch_buffer needs the same scratch_chunks on every rank: rank {r} "
                f"has {gpu.scratch_chunks}, rank 0 has {first} (give every rank the largest count)",
                f"gpus[{r}].scratch_chunks")


def _check_reduce_ops(plan: Plan) -> None:
    """A launch runs one reduce op: the reductions that name one must agree (with the
    plan's ``reduce_op`` when it is set)."""
    want = plan.reduce_op
    where = "reduce_op" if want is not None else None
    for path, op in iter_op_paths(plan):
        if op.reduce_op is None:
            continue
        if want is None:
            want, where = op.reduce_op, f"{path}.reduce_op"
        elif op.reduce_op != want:
            raise PlanError(f"this op reduces with {op.reduce_op.value} but {where} says {want.value}: "
                            "one launch runs one reduce op", f"{path}.reduce_op")


def _check_collective(plan: Plan) -> None:
    """Every rank's input and output chunk counts are the collective's (an in-place plan whose
    input is its whole output may leave one of them 0), and ``chunk_factor`` is positive."""
    try:
        spec = spec_from_plan(plan)
    except PlanError as e:
        raise PlanError(e.message, e.path or "collective") from None
    if plan.chunk_factor is not None and plan.chunk_factor < 1:
        raise PlanError(f"chunk_factor must be positive, got {plan.chunk_factor}", "chunk_factor")
    full_alias = (spec.inplace and spec.input_in_output(0) == 0
                  and spec.input_chunks == spec.output_chunks)
    for r, gpu in enumerate(plan.gpus):
        got, need = (gpu.input_chunks, gpu.output_chunks), (spec.input_chunks, spec.output_chunks)
        for k, what in enumerate(("input", "output")):
            if got[k] != need[k] and not (full_alias and got[k] == 0 and got[1 - k] == need[1 - k]):
                raise PlanError(
                    f"rank {r} has {got[k]} {what} chunks but {spec.name} over {spec.num_ranks} ranks "
                    f"with chunk factor {spec.chunk_factor} needs {need[k]}", f"gpus[{r}].{what}_chunks")


class _Checker:
    """The checks of each rank of a plan (:meth:`check_gpu`: its channels, remote buffers,
    thread blocks, ops and their operands, barriers and thread-block groups), with the per-rank
    lookups its ops repeat; the plan-level checks are the functions above."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.n = len(plan.gpus)
        self._memo: dict[tuple, list] = {}

    def _once(self, key: tuple, make: Callable[[], list]) -> list:
        """``make()``, computed once per ``key`` (ops look the rank's lists up again and again)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def peers(self, gpu: Gpu, ct: ChannelType) -> list[int]:
        """``gpu.peers(ct)``, computed once per rank."""
        return self._once((gpu.id, ct), lambda: gpu.peers(ct))

    def switch_groups(self, gpu: Gpu) -> list:
        """``gpu.switch_groups()``, computed once per rank."""
        return self._once((gpu.id, "switch groups"), gpu.switch_groups)

    # ------------------------------------------------------------------ rank level
    def check_gpu(self, r: int, gpu: Gpu) -> None:
        base = f"gpus[{r}]"
        for c, ch in enumerate(gpu.channels):
            p = f"{base}.channels[{c}]"
            if ch.channel_type == ChannelType.switch:
                if ch.connected_to:
                    raise PlanError("a switch channel has rank_groups, not connected_to", f"{p}.connected_to")
                if not ch.rank_groups:
                    raise PlanError("a switch channel needs at least one rank group", f"{p}.rank_groups")
                if ch.buffer_type == BufferKind.weight:
                    raise PlanError(_WEIGHT_REF, f"{p}.buffer_type")
                for g, grp in enumerate(ch.rank_groups):
                    gp = f"{p}.rank_groups[{g}]"
                    for k, rank in enumerate(grp.ranks):
                        self.valid_rank(rank, f"{gp}.ranks[{k}]")
                    if len(set(grp.ranks)) != len(grp.ranks):
                        raise PlanError(f"rank group {grp.ranks} lists a rank twice", f"{gp}.ranks")
                    if grp.size != len(grp.ranks):
                        raise PlanError(f"rank group size is {grp.size} but it lists {len(grp.ranks)} ranks",
                                        f"{gp}.size")
                    if r not in grp.ranks:
                        raise PlanError(f"rank {r} holds a switch channel over {grp.ranks} without being a member",
                                        f"{gp}.ranks")
            else:
                if ch.buffer_type is not None:
                    raise PlanError(f"a {ch.channel_type.value} channel has no buffer_type", f"{p}.buffer_type")
                if ch.rank_groups:
                    raise PlanError(f"a {ch.channel_type.value} channel has no rank_groups", f"{p}.rank_groups")
                for k, peer in enumerate(ch.connected_to):
                    self.valid_peer(r, peer, f"{p}.connected_to[{k}]")
        for b, rb in enumerate(gpu.remote_buffers):
            p = f"{base}.remote_buffers[{b}]"
            self.valid_peer(r, rb.rank, f"{p}.rank")
            if rb.type == BufferKind.weight:
                raise PlanError(_WEIGHT_REF, f"{p}.type")
            if rb.type == BufferKind.residual:
                raise PlanError(f"rank {r} maps rank {rb.rank}'s residual: a rank's residual is its own, passed with "
                                "each call and mapped by no peer (move residual rows through scratch)", f"{p}.type")
            if not rb.access_channel_types:
                raise PlanError("a remote buffer needs at least one access channel type",
                                f"{p}.access_channel_types")
            for k, ct in enumerate(rb.access_channel_types):
                if ct not in (ChannelType.memory, ChannelType.port):
                    raise PlanError(f"remote buffers are accessed through memory or port channels, not {ct.value}",
                                    f"{p}.access_channel_types[{k}]")
            if len(set(rb.access_channel_types)) != len(rb.access_channel_types):
                raise PlanError("an access channel type is listed twice", f"{p}.access_channel_types")
        for t, tb in enumerate(gpu.threadblocks):
            self.check_tb(r, gpu, t, tb)
        self.check_barriers(r, gpu)
        self.check_groups(r, gpu)

    def valid_rank(self, rank: int, path: str) -> None:
        if not 0 <= rank < self.n:
            raise PlanError(f"rank {rank} is not a rank of this {self.n}-rank plan", path)

    def valid_peer(self, me: int, peer: int, path: str) -> None:
        self.valid_rank(peer, path)
        if peer == me:
            raise PlanError(f"rank {me} cannot have itself as a peer", path)

    def num_channels(self, gpu: Gpu, ct: ChannelType) -> int:
        if ct == ChannelType.switch:
            return len(self.switch_groups(gpu))
        return len(self.peers(gpu, ct))

    # ------------------------------------------------------------------ thread block level
    def check_tb(self, r: int, gpu: Gpu, t: int, tb: ThreadBlock) -> None:
        base = f"gpus[{r}].threadblocks[{t}]"
        seen: set[ChannelType] = set()
        for c, chl in enumerate(tb.channels):
            p = f"{base}.channels[{c}]"
            if chl.channel_type == ChannelType.none:
                raise PlanError("channel_type 'none' is not a channel", f"{p}.channel_type")
            if chl.channel_type in seen:
                raise PlanError(f"a second {chl.channel_type.value} channel list in one thread block",
                                f"{p}.channel_type")
            seen.add(chl.channel_type)
            avail = self.num_channels(gpu, chl.channel_type)
            for k, cid in enumerate(chl.channel_ids):
                if not 0 <= cid < avail:
                    raise PlanError(
                        f"{chl.channel_type.value} channel {cid} does not exist: rank {r} has {avail}",
                        f"{p}.channel_ids[{k}]")
        seen = set()
        for c, ref in enumerate(tb.remote_buffer_refs):
            p = f"{base}.remote_buffer_refs[{c}]"
            ct = ref.access_channel_type
            if ct not in (ChannelType.memory, ChannelType.port):
                raise PlanError(f"remote buffers are accessed through memory or port channels, not {ct.value}",
                                f"{p}.access_channel_type")
            if ct in seen:
                raise PlanError(f"a second {ct.value} remote buffer list in one thread block",
                                f"{p}.access_channel_type")
            seen.add(ct)
            for k, bid in enumerate(ref.remote_buffer_ids):
                if not 0 <= bid < len(gpu.remote_buffers):
                    raise PlanError(
                        f"remote buffer {bid} does not exist: rank {r} has {len(gpu.remote_buffers)}",
                        f"{p}.remote_buffer_ids[{k}]")
                if ct not in gpu.remote_buffers[bid].access_channel_types:
                    raise PlanError(f"remote buffer {bid} is not accessible through {ct.value} channels",
                                    f"{p}.remote_buffer_ids[{k}]")
        for i, op in enumerate(tb.ops):
            self.check_op(r, gpu, t, tb, op, f"{base}.ops[{i}]")
            if op.ops:
                for j, inner in enumerate(op.ops):
                    if inner.name in EPILOGUE_OPS:
                        raise PlanError(f"{inner.name.value} cannot stand inside a pipeline (an epilogue "
                                        "op runs over whole rows, not slices)", f"{base}.ops[{i}].ops[{j}].name")
                    self.check_op(r, gpu, t, tb, inner, f"{base}.ops[{i}].ops[{j}]")

    # ------------------------------------------------------------------ op level
    def check_op(self, r: int, gpu: Gpu, t: int, tb: ThreadBlock, op: Op, path: str) -> None:
        rule = OP_RULES[op.name]
        name = op.name.value
        ct = op.channel_type
        if ct not in rule.channel_types:
            allowed = " or ".join(sorted(c.value for c in rule.channel_types))
            raise PlanError(f"{name} needs channel_type {allowed}, got {ct.value}", f"{path}.channel_type")
        # fields that belong to other op kinds
        if op.name != OpName.barrier:
            for field in ("barrier_id", "num_threadblocks", "barrier_tbs"):
                if getattr(op, field) is not None:
                    raise PlanError(f"{name} does not take '{field}'", f"{path}.{field}")
        if op.name not in SEMAPHORE_OPS and op.semaphore_ids:
            raise PlanError(f"{name} does not take 'semaphore_ids'", f"{path}.semaphore_ids")
        if op.reduce_op is not None and op.name not in REDUCE_OPS:
            raise PlanError(f"{name} is not a reduction and takes no 'reduce_op'", f"{path}.reduce_op")
        if op.tbg_info is not None and op.name in _NO_TBG:
            raise PlanError(f"{name} cannot be split over a thread-block group", f"{path}.tbg_info")
        # channels
        if rule.channels == "forbidden" and op.channel_ids:
            raise PlanError(f"{name} takes no channel_ids", f"{path}.channel_ids")
        if rule.channels == "required" and not op.channel_ids:
            raise PlanError(f"{name} needs at least one channel in channel_ids", f"{path}.channel_ids")
        if ct == ChannelType.port and not op.channel_ids:
            raise PlanError(f"a port {name} needs channel_ids (the proxy channel of each remote operand)",
                            f"{path}.channel_ids")
        tb_list = tb.channel_list(ct) if ct != ChannelType.none else []
        for k, cid in enumerate(op.channel_ids):
            if not 0 <= cid < len(tb_list):
                raise PlanError(
                    f"channel id {cid} is outside thread block {t}'s {ct.value} channel list "
                    f"(length {len(tb_list)}) on rank {r}", f"{path}.channel_ids[{k}]")
        if op.name in SYNC_OPS - SEMAPHORE_OPS:
            if len(set(op.channel_ids)) != len(op.channel_ids):
                raise PlanError(f"{name} lists a channel twice", f"{path}.channel_ids")
        # semaphores and barriers
        for k, sid in enumerate(op.semaphore_ids):
            if not 0 <= sid < len(gpu.semaphores):
                raise PlanError(f"semaphore {sid} does not exist: rank {r} has {len(gpu.semaphores)}",
                                f"{path}.semaphore_ids[{k}]")
        if op.name == OpName.barrier:
            assert op.num_threadblocks is not None  # guaranteed by the model
            if op.num_threadblocks > len(gpu.threadblocks):
                raise PlanError(f"barrier of {op.num_threadblocks} thread blocks on a rank with "
                                f"{len(gpu.threadblocks)}", f"{path}.num_threadblocks")
            if op.barrier_tbs is not None:
                tbs = op.barrier_tbs
                for k, m in enumerate(tbs):
                    if not 0 <= m < len(gpu.threadblocks):
                        raise PlanError(f"thread block {m} does not exist on rank {r}", f"{path}.barrier_tbs[{k}]")
                if len(set(tbs)) != len(tbs):
                    raise PlanError("barrier_tbs lists a thread block twice", f"{path}.barrier_tbs")
                if len(tbs) != op.num_threadblocks:
                    raise PlanError(f"barrier_tbs lists {len(tbs)} thread blocks but num_threadblocks "
                                    f"is {op.num_threadblocks}", f"{path}.barrier_tbs")
                if t not in tbs:
                    raise PlanError(f"thread block {t} takes part in a barrier whose barrier_tbs {tbs} "
                                    "leave it out", f"{path}.barrier_tbs")
        if op.name == OpName.pipeline and op.tbg_info is not None:
            raise PlanError("a pipeline op carries no tbg_info (its inner ops do)", f"{path}.tbg_info")
        # operands
        self.check_operands(r, gpu, t, tb, op, rule, path)
        if op.name == OpName.rmsnorm and op.src_buff[0].index != op.dst_buff[0].index:
            raise PlanError(f"rmsnorm writes row k of the residual to row k of the output: src_buff[0] "
                            f"starts at chunk {op.src_buff[0].index}, dst_buff[0] at {op.dst_buff[0].index}",
                            f"{path}.dst_buff[0].index")

    def check_operands(self, r: int, gpu: Gpu, t: int, tb: ThreadBlock, op: Op, rule: OpRule,
                       path: str) -> None:
        name = op.name.value
        for side, refs, head, tail, mn in (
            ("src_buff", op.src_buff, rule.src_head, rule.src_tail, rule.src_min_tail),
            ("dst_buff", op.dst_buff, rule.dst_head, rule.dst_tail, rule.dst_min_tail),
        ):
            ntail = len(refs) - len(head)
            if tail is None:
                if len(refs) != len(head):
                    raise PlanError(f"{name} takes exactly {len(head)} operand(s) in {side}, got {len(refs)}",
                                    f"{path}.{side}")
            elif ntail < mn:
                need = len(head) + mn
                raise PlanError(f"{name} takes at least {need} operand(s) in {side}, got {len(refs)}",
                                f"{path}.{side}")
            for k, ref in enumerate(refs):
                want = head[k] if k < len(head) else tail
                assert want is not None
                self.check_ref(r, gpu, t, tb, op, ref, want, f"{path}.{side}[{k}]")
        # sizes
        if rule.pairs:
            if len(op.src_buff) != len(op.dst_buff):
                raise PlanError(f"{name} pairs src_buff[i] with dst_buff[i] but has {len(op.src_buff)} "
                                f"sources and {len(op.dst_buff)} destinations", f"{path}.dst_buff")
            for k, (s, d) in enumerate(zip(op.src_buff, op.dst_buff)):
                if s.size != d.size:
                    raise PlanError(f"{name} copies {s.size} chunk(s) from src_buff[{k}] into "
                                    f"{d.size} chunk(s)", f"{path}.dst_buff[{k}].size")
        else:
            refs = ([("src_buff", k, x) for k, x in enumerate(op.src_buff)]
                    + [("dst_buff", k, x) for k, x in enumerate(op.dst_buff)])
            if refs:
                size0 = refs[0][2].size
                for side, k, ref in refs[1:]:
                    if ref.size != size0:
                        raise PlanError(f"{name} operands must all span the same number of chunks: "
                                        f"{refs[0][0]}[0] spans {size0}, this one {ref.size}",
                                        f"{path}.{side}[{k}].size")
            if op.name == OpName.rppkt and len(op.src_buff) not in (1, len(op.dst_buff)):
                raise PlanError("rppkt takes one source or one per destination", f"{path}.src_buff")
        # port channels (and explicit memory channels) serve the remote operand of the same index
        if op.name in _CHANNEL_PER_REMOTE and op.channel_ids:
            remotes = [x for x in (op.src_buff if op.name == OpName.get else op.dst_buff)]
            if len(op.channel_ids) != len(remotes):
                raise PlanError(f"{name} needs one channel per remote operand: {len(op.channel_ids)} "
                                f"channel(s) for {len(remotes)} operand(s)", f"{path}.channel_ids")
            ct = op.channel_type
            tb_list = tb.channel_list(ct)
            peers = self.peers(gpu, ct)
            rbl = tb.remote_buffer_list(ct)
            side = "src_buff" if op.name == OpName.get else "dst_buff"
            for k, (cid, ref) in enumerate(zip(op.channel_ids, remotes)):
                peer = peers[tb_list[cid]]
                owner = gpu.remote_buffers[rbl[ref.buffer_id]].rank  # type: ignore[index]
                if peer != owner:
                    raise PlanError(f"channel_ids[{k}] leads to rank {peer} but {side}[{k}] is a buffer "
                                    f"of rank {owner}", f"{path}.channel_ids[{k}]")

    def check_ref(self, r: int, gpu: Gpu, t: int, tb: ThreadBlock, op: Op, ref: BufferRef, want: str,
                  path: str) -> None:
        name = op.name.value
        if want in _LOCAL_WANTS:
            if not ref.is_local:
                raise PlanError(f"{name} needs a local buffer here ('type'), not a "
                                f"{'remote' if ref.is_remote else 'switch'} reference", path)
            assert ref.type is not None
            kinds = _LOCAL_WANTS[want]
            if ref.type == BufferKind.weight:
                raise PlanError(_WEIGHT_REF, f"{path}.type")
            if want == S and ref.type != BufferKind.scratch:
                raise PlanError(f"{name} keeps packets here, so this operand must be scratch ('s'), "
                                f"not {ref.type.name}", f"{path}.type")
            if kinds is not None and ref.type not in kinds:
                allowed = " or ".join(f"{k.name} ('{k.value}')" for k in sorted(kinds, key=lambda k: k.value))
                raise PlanError(f"{name} needs {allowed} here, not {ref.type.name}", f"{path}.type")
            self.in_range(gpu, ref.type, ref, f"rank {r}", path)
        elif want in (R, RS):
            if not ref.is_remote:
                raise PlanError(f"{name} needs a remote buffer here ('buffer_id'), not a "
                                f"{'local' if ref.is_local else 'switch'} reference", path)
            assert ref.buffer_id is not None
            ct = op.channel_type
            rbl = tb.remote_buffer_list(ct)
            if not 0 <= ref.buffer_id < len(rbl):
                raise PlanError(f"buffer_id {ref.buffer_id} is outside thread block {t}'s {ct.value} "
                                f"remote_buffer_refs (length {len(rbl)}) on rank {r}", f"{path}.buffer_id")
            rb = gpu.remote_buffers[rbl[ref.buffer_id]]
            if want == RS and rb.type != BufferKind.scratch:
                raise PlanError(f"{name} writes packets, so its remote destination must be scratch, "
                                f"not rank {rb.rank}'s {rb.type.name}", f"{path}.buffer_id")
            self.in_range(self.plan.gpus[rb.rank], rb.type, ref, f"rank {rb.rank} (remote)", path)
        else:  # switch
            if not ref.is_switch:
                raise PlanError(f"{name} needs a switch reference here ('switch_channel_id')", path)
            assert ref.switch_channel_id is not None
            tb_list = tb.channel_list(ChannelType.switch)
            if not 0 <= ref.switch_channel_id < len(tb_list):
                raise PlanError(f"switch_channel_id {ref.switch_channel_id} is outside thread block {t}'s "
                                f"switch channel list (length {len(tb_list)}) on rank {r}",
                                f"{path}.switch_channel_id")
            kind, ranks = self.switch_groups(gpu)[tb_list[ref.switch_channel_id]]
            if op.name in _PACKET_SWITCH_DST and kind != BufferKind.scratch:
                raise PlanError(f"{name} stores packets, so its switch channel must bind scratch, "
                                f"not {kind.name}", f"{path}.switch_channel_id")
            for member in ranks:
                self.in_range(self.plan.gpus[member], kind, ref, f"rank {member} (switch member)", path)

    def in_range(self, gpu: Gpu, kind: BufferKind, ref: BufferRef, who: str, path: str) -> None:
        if kind == BufferKind.weight:
            raise PlanError(_WEIGHT_REF, path)
        count = gpu.chunks(kind)
        if ref.index + ref.size > count:
            raise PlanError(f"chunks {ref.index}..{ref.index + ref.size - 1} are outside {who}'s "
                            f"{kind.name} buffer of {count} chunk(s)", f"{path}.index")

    # ------------------------------------------------------------------ cross-op checks
    def _all_ops(self, gpu: Gpu):
        for t, tb in enumerate(gpu.threadblocks):
            for i, op in enumerate(tb.ops):
                yield t, f"threadblocks[{t}].ops[{i}]", op, None
                for j, inner in enumerate(op.ops or []):
                    yield t, f"threadblocks[{t}].ops[{i}].ops[{j}]", inner, op.iter_context

    def check_barriers(self, r: int, gpu: Gpu) -> None:
        first: dict[int, tuple[str, Op]] = {}
        members: dict[int, set[int]] = defaultdict(set)
        for t, sub, op, _ in self._all_ops(gpu):
            if op.name != OpName.barrier:
                continue
            bid = op.barrier_id
            assert bid is not None
            path = f"gpus[{r}].{sub}"
            members[bid].add(t)
            if bid not in first:
                first[bid] = (path, op)
                continue
            p0, op0 = first[bid]
            if op.num_threadblocks != op0.num_threadblocks:
                raise PlanError(f"barrier {bid} has num_threadblocks {op.num_threadblocks} here but "
                                f"{op0.num_threadblocks} at {p0}", f"{path}.num_threadblocks")
            if (op.barrier_tbs is not None and op0.barrier_tbs is not None
                    and sorted(op.barrier_tbs) != sorted(op0.barrier_tbs)):
                raise PlanError(f"barrier {bid} meets thread blocks {op.barrier_tbs} here but "
                                f"{op0.barrier_tbs} at {p0}", f"{path}.barrier_tbs")
        for bid, tbs in members.items():
            p0, op0 = first[bid]
            if len(tbs) != op0.num_threadblocks:
                raise PlanError(f"barrier {bid} on rank {r} expects {op0.num_threadblocks} thread blocks "
                                f"but thread blocks {sorted(tbs)} use it", f"{p0}.num_threadblocks")
            if op0.barrier_tbs is not None and set(op0.barrier_tbs) != tbs:
                raise PlanError(f"barrier {bid} on rank {r} names thread blocks {sorted(op0.barrier_tbs)} "
                                f"but thread blocks {sorted(tbs)} use it", f"{p0}.barrier_tbs")

    def _resolve(self, gpu: Gpu, tb: ThreadBlock, op: Op, ctx) -> tuple:
        """A rank-global description of ``op`` (TB-local indexes replaced by what they name)."""
        ct = op.channel_type

        def ref_key(ref: BufferRef) -> tuple:
            if ref.is_local:
                return ("l", ref.type.value, ref.index, ref.size)  # type: ignore[union-attr]
            if ref.is_remote:
                rb = gpu.remote_buffers[tb.remote_buffer_list(ct)[ref.buffer_id]]  # type: ignore[index]
                return ("r", rb.rank, rb.type.value, ref.index, ref.size)
            sw = tb.channel_list(ChannelType.switch)[ref.switch_channel_id]  # type: ignore[index]
            return ("w", sw, ref.index, ref.size)

        chans = tuple(tb.channel_list(ct)[c] for c in op.channel_ids) if ct != ChannelType.none else ()
        ctx_key = (ctx.unit_size, ctx.num_chunks) if ctx is not None else None
        return (op.name.value, ct.value, chans, tuple(ref_key(x) for x in op.src_buff),
                tuple(ref_key(x) for x in op.dst_buff), op.reduce_op, ctx_key)

    def check_groups(self, r: int, gpu: Gpu) -> None:
        groups: dict[tuple, list[tuple[str, int, int]]] = defaultdict(list)
        for t, sub, op, ctx in self._all_ops(gpu):
            if op.tbg_info is None:
                continue
            key = self._resolve(gpu, gpu.threadblocks[t], op, ctx)
            groups[key].append((f"gpus[{r}].{sub}.tbg_info", op.tbg_info.tb_id, op.tbg_info.tbg_size))
        for entries in groups.values():
            p0, _, size0 = entries[0]
            for path, _, size in entries[1:]:
                if size != size0:
                    raise PlanError(f"members of one thread-block group disagree on tbg_size: {size} here, "
                                    f"{size0} at {p0}", f"{path}.tbg_size")
            counts = Counter(tb_id for _, tb_id, _ in entries)
            reps = max(counts.values())
            for pos in range(size0):
                if counts.get(pos, 0) != reps:
                    raise PlanError(f"thread-block group of size {size0} on rank {r} has no member at "
                                    f"position {pos} for every use of this op (positions used: "
                                    f"{dict(sorted(counts.items()))})", p0)


def check_format(plan: Plan) -> None:
    """The format rule: a plan holding an epilogue op (``radd``, ``rmsnorm``) must say
    ``mscclang.plan/2``, a plan with segmented buffers ``mscclang.plan/3``, and no plan has
    both; PlanError naming the first op or segmented buffer the format does not allow."""
    ops = plan.epilogue_ops()
    if ops and plan.format != PLAN_FORMAT_2:
        path, op = ops[0]
        raise PlanError(f"{op.name.value} is an epilogue op: a plan holding it must say format "
                        f"{PLAN_FORMAT_2!r}, not {plan.format!r}", f"{path}.name")
    seg = next((r for r, g in enumerate(plan.gpus) if g.segments), None)
    if seg is not None and plan.format != PLAN_FORMAT_3:
        raise PlanError(f"rank {seg} has segmented buffers: a plan with them must say format "
                        f"{PLAN_FORMAT_3!r}, not {plan.format!r}", f"gpus[{seg}].segments")


def validate_plan(plan: Plan) -> None:
    """Check a validated plan's cross-references and op shapes (and the format rule:
    epilogue ops only in ``mscclang.plan/2`` plans).

    Raises :class:`~mscclang.errors.PlanError` with the JSON path of the first offending field;
    returns ``None`` when the plan is consistent. See the module docstring for what is checked.
    """
    check_format(plan)
    _check_fields(plan)
    check_segments(plan)
    _check_collective(plan)
    checker = _Checker(plan)
    for r, gpu in enumerate(plan.gpus):
        checker.check_gpu(r, gpu)
    _check_reduce_ops(plan)
    _check_double_scratch(plan)
    _check_packet_alignment(plan)


def iter_op_paths(plan: Plan) -> Sequence[tuple[str, Op]]:
    """Every op of the plan with its JSON path (pipeline inner ops after their pipeline)."""
    out: list[tuple[str, Op]] = []
    for r, g in enumerate(plan.gpus):
        for t, tb in enumerate(g.threadblocks):
            for i, op in enumerate(tb.ops):
                out.append((f"gpus[{r}].threadblocks[{t}].ops[{i}]", op))
                for j, inner in enumerate(op.ops or []):
                    out.append((f"gpus[{r}].threadblocks[{t}].ops[{i}].ops[{j}]", inner))
    return out
