"""Box labels of the plan picture: short chunk references and the key that explains them."""

from __future__ import annotations

from typing import Iterable, Optional

from mscclang.plan.models import SEMAPHORE_OPS, SIGNAL_OPS, SYNC_OPS, BufferKind, BufferRef, ChannelType, Gpu, Op, OpName, Plan, ThreadBlock
from mscclang.viz.graph import OpNode
# ------------------------------------------------------------------------------------------------
# labels


def _chunks(ref: BufferRef, owner: Optional[Gpu] = None, kind: Optional[BufferKind] = None) -> str:
    """``4`` or ``4:6`` (chunks), or for a segment of ``owner``'s buffer ``kind`` its count entry
    (``[c1,2]``: the rows of counts[1][2]; ``[c1,2+1]`` two segments)."""
    seg = owner.segmented(kind) if owner is not None and kind is not None else None
    if seg is not None and ref.index < len(seg.counts):
        i, j = seg.counts[ref.index]
        return f"[c{i},{j}{f'+{ref.size - 1}' if ref.size > 1 else ''}]"
    return f"{ref.index}" if ref.size == 1 else f"{ref.index}:{ref.index + ref.size}"


def _short_ref(plan: Plan, gpu: Gpu, tb: ThreadBlock, op: Op, ref: BufferRef) -> str:
    if ref.type is not None:
        return f"{ref.type.value}{_chunks(ref, gpu, ref.type)}"
    if ref.buffer_id is not None:
        lst = tb.remote_buffer_list(op.channel_type)
        if ref.buffer_id < len(lst) and lst[ref.buffer_id] < len(gpu.remote_buffers):
            rb = gpu.remote_buffers[lst[ref.buffer_id]]
            owner = plan.gpus[rb.rank] if rb.rank < len(plan.gpus) else None
            return f"{rb.type.value}{_chunks(ref, owner, rb.type)}@r{rb.rank}"
        return f"?{_chunks(ref)}@?"
    lst = tb.channel_list(ChannelType.switch)
    sid = ref.switch_channel_id
    g = lst[sid] if sid is not None and sid < len(lst) else "?"
    groups = gpu.switch_groups()
    kind = groups[g][0].value if isinstance(g, int) and g < len(groups) else "?"
    return f"{kind}{_chunks(ref)}@sw{g}"


def _refs(parts: list[str]) -> str:
    if not parts:
        return ""
    return parts[0] if len(parts) == 1 else f"{parts[0]}+{len(parts) - 1}"


def _detail(plan: Plan, node: OpNode) -> str:
    """Second label line: short chunk refs, or peers for channel ops."""
    gpu = plan.gpus[node.rank]
    tb = gpu.threadblocks[node.tb]
    op = node.op
    if op.name in SYNC_OPS - SEMAPHORE_OPS:
        peers = gpu.peers(op.channel_type) if op.channel_type in (ChannelType.memory, ChannelType.port) else []
        lst = tb.channel_list(op.channel_type)
        ids = [lst[cid] if cid < len(lst) else None for cid in op.channel_ids]
        names = [f"r{peers[g]}" if g is not None and g < len(peers) else "?" for g in ids]
        if len(names) > 3:
            return "r: " + ",".join(names[:2]) + f",+{len(names) - 2}"
        return ("\u2192" if op.name in SIGNAL_OPS else "\u2190") + ",".join(names) if names else ""
    if op.name in (OpName.sem_acquire, OpName.sem_release):
        return "sem " + ",".join(str(s) for s in op.semaphore_ids)
    if op.name == OpName.barrier:
        return f"id {op.barrier_id}"
    srcs = [_short_ref(plan, gpu, tb, op, x) for x in op.src_buff]
    dsts = [_short_ref(plan, gpu, tb, op, x) for x in op.dst_buff]
    if not srcs and not dsts:
        return ""
    return f"{_refs(srcs)}\u2192{_refs(dsts)}"


# ------------------------------------------------------------------------------------------------
# the label key

#: what each op name does, for the key under the legend (only names in the picture are listed)
OP_GLOSSARY: dict[OpName, str] = {
    OpName.nop: "block sync", OpName.barrier: "blocks meet",
    OpName.signal: "signal the peer (publishes earlier writes)", OpName.rlxsignal: "relaxed signal",
    OpName.wait: "wait for the peer's signal", OpName.rlxwait: "relaxed wait",
    OpName.flush: "wait for the port channel's puts",
    OpName.put: "write into a peer's buffer", OpName.pws: "put + signal", OpName.pwsf: "put + signal + flush",
    OpName.get: "read a peer's buffer", OpName.copy: "local copy",
    OpName.cpkt: "copy into packets", OpName.upkt: "unpack packets", OpName.ppkt: "put packets to a peer",
    OpName.rppkt: "forward packets to peers",
    OpName.re: "reduce", OpName.res: "reduce + write the result to peers",
    OpName.rre: "reduce with peers' buffers", OpName.rres: "rre + write the result to peers",
    OpName.repkt: "reduce packets", OpName.respkt: "reduce packets + send packets",
    OpName.recpkt: "reduce packets + keep a packet copy", OpName.recspkt: "recpkt + send packets",
    OpName.glre: "multicast load-reduce", OpName.glres: "multicast load-reduce-store",
    OpName.gstore: "multicast store", OpName.gstorepkt: "multicast store of packets",
    OpName.sem_acquire: "acquire a semaphore", OpName.sem_release: "release a semaphore",
    OpName.pipeline: "pipelined loop",
}

#: how to read a box's label
LABEL_KEY = ("Box labels: 'k name' is op k of its thread block ('i.j': op j of pipeline i); the second line is "
             "the chunks it moves, src\u2192dst (i input, o output, s scratch; 4:6 chunks 4 and 5; [c1,2] the "
             "segment of counts[1][2] rows; @r2 on "
             "rank 2; @sw0 through switch channel 0; +n: n more operands), or the peers it signals "
             "(\u2192r2) or waits for (\u2190r2). Narrow grey boxes are nops (block syncs).")


def _key_lines(names: Iterable[OpName], chars: int) -> list[str]:
    """The label key and a glossary of ``names``, wrapped to ``chars`` characters a line."""
    import textwrap

    gloss = "; ".join(f"{n.value} = {OP_GLOSSARY[n]}" for n in sorted(set(names), key=lambda n: n.value)
                      if n in OP_GLOSSARY and n is not OpName.nop)
    lines = textwrap.wrap(LABEL_KEY, chars)
    if gloss:
        lines += textwrap.wrap("Ops: " + gloss + ".", chars)
    return lines


