"""Pass 2: instruction fusion.

Per thread block, left to right, each op is merged into the previous (already fused) op when a
rule applies; pipeline bodies are fused on their own. The rules (``a`` then ``b``):

* ``nop + nop -> nop``; ``nop + barrier -> barrier``; ``barrier + nop -> barrier``; a pipeline
  whose last inner op syncs after itself, followed by ``nop`` -> the pipeline.
* ``signal``/``rlxsignal``/``wait``/``rlxwait``/``flush`` + the same op on the same channel type
  over disjoint channels -> one op over both channel sets (``data_sync`` flags are or-ed);
  ``sem_acquire``/``sem_release`` likewise over disjoint semaphores.
* ``put``/``pws``/``pwsf``/``ppkt`` + the same op (same channel type, equal chunk sizes) ->
  multi-source/multi-destination op (``src_buff[i]`` pairs with ``dst_buff[i]``);
  ``rppkt + rppkt`` reading the same source -> one ``rppkt`` with several destinations;
  ``get + get`` -> multi get.
* ``re``/``repkt``/``rre`` + the same op whose first source and destination are the first op's
  destination -> one reduction with the second op's other sources appended (same order of
  evaluation: ``((a0 OP a1) OP b1)``).
* ``re``/``res``/``rre``/``rres`` + memory ``put`` of the reduction's destination -> ``res``/``rres``.
  The put may write the result back into a peer range the ``rre``/``rres`` read (a *write-back*:
  its destination is exactly one of the reduction's remote sources, same rank, buffer, chunk
  index and size): every element of that range is read, reduced and written back by the same
  thread within the one fused op, since all operands of a reduction are split among the threads
  identically (chunk by chunk, byte for byte). A put that only partly overlaps a range the
  reduction touches still refuses fusion.
* ``repkt``/``respkt`` + memory ``ppkt`` of the destination -> ``respkt``.
* ``repkt`` + ``cpkt`` of the destination -> ``recpkt`` (``dst_buff[1]`` is the local packet copy).
* ``recpkt``/``recspkt`` + memory ``ppkt`` of the destination, or ``rppkt`` of the packet copy ->
  ``recspkt``.
* ``glre`` + ``gstore`` on the same switch channel storing the reduction's destination, when that
  destination is this rank's own part of the multicast range being stored -> ``glres`` (the
  multicast store writes the local destination too). Otherwise ``glre`` stays alone (ours can run
  a lone ``glre``).

Every rule needs equal thread-block-group info. Merges of independent ops are refused when the
second op's accesses conflict with the first's (see :func:`mscclang.compiler.ir.conflicts`; for
in-place collectives input and output ranges are compared as the same bytes, see
:func:`mscclang.compiler.ir.alias_range`), so fusion never reorders dependent data movement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from mscclang.compiler.ir import SYNC_AFTER, Access, AccessIndex, IROp, IRProgram, Ref, accesses, alias_range
from mscclang.compiler.meter import each_rank
from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.models import SEMAPHORE_OPS, SYNC_OPS, ChannelType, OpName

_CHANNEL_SYNC = SYNC_OPS - SEMAPHORE_OPS
_PUTS = frozenset({OpName.put, OpName.pws, OpName.pwsf, OpName.ppkt})
_REDUCES = (OpName.re, OpName.res, OpName.rre, OpName.rres)
#: (a, b): the kinds of op some rule may merge (``b`` into ``a``)
_KINDS = frozenset({(OpName.nop, OpName.nop), (OpName.nop, OpName.barrier), (OpName.barrier, OpName.nop),
                    (OpName.pipeline, OpName.nop), (OpName.repkt, OpName.cpkt), (OpName.glre, OpName.gstore)}
                   | {(n, n) for n in SYNC_OPS | _PUTS | {OpName.get, OpName.rppkt, OpName.re,
                                                                        OpName.repkt, OpName.rre}}
                   | {(n, OpName.put) for n in _REDUCES}
                   | {(n, OpName.ppkt) for n in (OpName.repkt, OpName.respkt, OpName.recpkt, OpName.recspkt)}
                   | {(n, OpName.rppkt) for n in (OpName.recpkt, OpName.recspkt)})

@dataclass
class Run:
    """What :func:`fuse_ops` keeps of the op it is growing (the last one of its output): the
    index of its accesses, the sets of its channels and semaphores, and its parts' origins
    (joined once the run ends). A merge into a run grows the op in place (copied at the first
    merge), so fusing ``k`` ops costs ``O(k)``, not ``O(k^2)``."""

    index: AccessIndex
    channels: set[int]
    semaphores: set[int]
    origins: list[str]
    owned: bool = False

    @classmethod
    def of(cls, op: IROp, accs: list[Access]) -> "Run":
        return cls(AccessIndex(accs), set(op.channels), set(op.semaphores), [op.origin])


def _independent(a: IROp, b: IROp, allowed: Optional[Ref] = None, also_writes: bool = False,
                 spec: Optional[CollectiveSpec] = None, writeback: bool = False,
                 prior: Optional[AccessIndex] = None) -> bool:
    """No access of ``b`` conflicts with one of ``a`` (ignoring ``b``'s reads of ``allowed``,
    the value being forwarded from ``a`` to ``b``, which the fused op reads after writing it, and
    with ``also_writes`` its writes of ``allowed`` too: the accumulator of a merged reduction).

    With ``writeback`` (``a`` is a read-reduce), a write of ``b`` that covers exactly a remote
    range ``a`` only reads (same peer, buffer and chunks) is allowed: in the fused op each thread
    reads, reduces and writes back the same elements. Any other access of ``a`` that the write
    overlaps still refuses the merge. ``prior``: the :class:`AccessIndex` of ``a``'s accesses (or
    of a superset that conflicts with the same accesses), when the caller keeps one."""
    acc_a = AccessIndex(accesses(a, spec=spec)) if prior is None else prior
    for y in accesses(b, spec=spec):
        if allowed is not None and (also_writes or not y.write) and _is_ref(y, allowed, spec):
            continue
        if any(not (writeback and _is_writeback(x, y)) for x in acc_a.conflicting(y)):
            return False
    return True


def _is_writeback(read: Access, write: Access) -> bool:
    """``write`` stores into exactly the remote plain range ``read`` loads."""
    return (not read.write and write.write and read.key[0] == "R" and read.key == write.key
            and not read.packet and not write.packet
            and (read.start, read.end) == (write.start, write.end))


def _is_ref(acc: Access, ref: Ref, spec: Optional[CollectiveSpec] = None) -> bool:
    scale = 2 if acc.packet else 1
    buffer, start, end = alias_range(spec, ref.rank, ref.buffer, scale * ref.index, scale * ref.end)
    key = ("R", ref.rank, buffer) if ref.remote else ("L", buffer)
    return acc.key == key and (acc.start, acc.end) == (start, end)


def _grow(a: IROp, b: IROp, run: Optional[Run], src: list[Ref] = (), dst: list[Ref] = (),
          channels: list[int] = (), union: bool = False, semaphores: list[int] = (), **fields) -> IROp:
    """``a`` merged with ``b``: ``src``, ``dst`` and ``semaphores`` appended to ``a``'s, ``channels``
    too (with ``union`` only those ``a`` lacks, once each), ``fields`` set and the origins joined;
    a new op, or with ``run`` (the state of ``a``) ``a`` itself grown in place."""
    chans = run.channels if run else set(a.channels)
    if union:
        add = []
        for c in channels:
            if c not in chans:
                chans.add(c)
                add.append(c)
        channels = add
    if run is None:
        return replace(a, src=a.src + list(src), dst=a.dst + list(dst), channels=a.channels + list(channels),
                       semaphores=a.semaphores + list(semaphores), origin=f"{a.origin} + {b.origin}", **fields)
    if not run.owned:
        a, run.owned = a.copy(), True
    a.src += src
    a.dst += dst
    a.channels += channels
    a.semaphores += semaphores
    run.channels.update(channels)
    run.semaphores.update(semaphores)
    run.origins.append(b.origin)
    for k, v in fields.items():
        setattr(a, k, v)
    return a


def may_fuse(a: IROp, b: IROp) -> bool:
    """Whether a rule could merge ``b`` into ``a``, judged by their kinds and thread-block groups
    only: :func:`try_fuse` merges nothing else (it checks this first, then the operands)."""
    return (a.name, b.name) in _KINDS and (a.tbg == b.tbg or OpName.nop in (a.name, b.name))


def try_fuse(a: IROp, b: IROp, spec: Optional[CollectiveSpec] = None, run: Optional[Run] = None) -> Optional[IROp]:
    """The op that does ``a`` then ``b``, or ``None`` when no rule applies; ``spec`` (the
    program's collective) makes in-place input/output aliases count as the same bytes. Neither
    op is changed, unless ``run`` is given: :func:`fuse_ops`' state of ``a``, which a merge then
    grows in place (see :class:`Run`)."""
    if not may_fuse(a, b):
        return None
    na, nb = a.name, b.name
    prior = run.index if run else None
    # nops and barriers
    if na == OpName.nop and nb == OpName.nop:
        return a
    if na == OpName.nop and nb == OpName.barrier:
        return b
    if na == OpName.barrier and nb == OpName.nop:
        return a
    if na == OpName.pipeline and nb == OpName.nop and a.body:
        last = a.body[-1]
        if last.name == OpName.nop or (last.name in SYNC_OPS and last.data_sync & SYNC_AFTER):
            return a
    # channel sync ops
    if na in _CHANNEL_SYNC and nb == na and a.channel_type == b.channel_type:
        if not (run.channels if run else set(a.channels)).isdisjoint(b.channels):
            return None
        return _grow(a, b, run, channels=b.channels, data_sync=a.data_sync | b.data_sync)
    if na in SEMAPHORE_OPS and nb == na:
        if not (run.semaphores if run else set(a.semaphores)).isdisjoint(b.semaphores):
            return None
        return _grow(a, b, run, semaphores=b.semaphores, data_sync=a.data_sync | b.data_sync)
    # multi puts / gets
    if na in _PUTS | {OpName.get} and nb == na and a.channel_type == b.channel_type:
        if a.src[0].size != b.src[0].size or not _independent(a, b, spec=spec, prior=prior):
            return None
        return _grow(a, b, run, src=b.src, dst=b.dst, channels=b.channels)
    if na == OpName.rppkt and nb == OpName.rppkt and a.channel_type == b.channel_type:
        if a.src != b.src or not _independent(a, b, spec=spec, prior=prior):
            return None
        return _grow(a, b, run, dst=b.dst, channels=b.channels)
    # reductions with more sources
    if na in (OpName.re, OpName.repkt, OpName.rre) and nb == na and len(a.dst) == 1 and len(b.dst) == 1:
        d = a.dst[0]
        if b.src[0] != d or b.dst[0] != d or a.reduce_op != b.reduce_op or b.src_position:
            return None   # b adds its sources after a's result, or the merged order would differ
        if not _independent(a, b, allowed=d, also_writes=True, spec=spec, prior=prior):
            return None
        return _grow(a, b, run, src=b.src[1:], channels=b.channels, union=True,
                     channel_type=a.channel_type if a.channel_type != ChannelType.none else b.channel_type)
    # reduce + put of its result
    if (na in _REDUCES and nb == OpName.put
            and b.channel_type == ChannelType.memory and a.channel_type in (ChannelType.none, ChannelType.memory)):
        d = a.dst[0]
        writeback = na in (OpName.rre, OpName.rres)
        if all(s == d for s in b.src) and _independent(a, b, allowed=d, spec=spec, writeback=writeback, prior=prior):
            name = OpName.res if na in (OpName.re, OpName.res) else OpName.rres
            return _grow(a, b, run, dst=b.dst, channels=b.channels, union=True, name=name,
                         channel_type=ChannelType.memory)
        return None
    # packet reductions
    if na in (OpName.repkt, OpName.respkt) and nb == OpName.ppkt and b.channel_type == ChannelType.memory:
        d = a.dst[0]
        if all(s == d for s in b.src) and _independent(a, b, allowed=d, spec=spec, prior=prior):
            return _grow(a, b, run, dst=b.dst, channels=b.channels, union=True, name=OpName.respkt,
                         channel_type=ChannelType.memory)
        return None
    if na == OpName.repkt and nb == OpName.cpkt and len(a.dst) == 1:
        d = a.dst[0]
        if b.src == [d] and _independent(a, b, allowed=d, spec=spec, prior=prior):
            return _grow(a, b, run, dst=b.dst, name=OpName.recpkt)
        return None
    if (na in (OpName.recpkt, OpName.recspkt) and nb in (OpName.ppkt, OpName.rppkt)
            and b.channel_type == ChannelType.memory):
        fwd = a.dst[0] if nb == OpName.ppkt else a.dst[1]
        if all(s == fwd for s in b.src) and _independent(a, b, allowed=fwd, spec=spec, prior=prior):
            return _grow(a, b, run, dst=b.dst, channels=b.channels, union=True, name=OpName.recspkt,
                         channel_type=ChannelType.memory)
        return None
    # switch: load-reduce + store
    if na == OpName.glre and nb == OpName.gstore and a.channels == b.channels:
        d = a.dst[0]
        store = b.dst[0]
        if (b.src == [d] and store.size == d.size and d.buffer == store.buffer and d.index == store.index
                and not d.remote and d.switch is None):
            fused = _grow(a, b, run, name=OpName.glres)
            fused.dst = [store]
            return fused
        return None
    return None


def fuse_ops(ops: list[IROp], spec: Optional[CollectiveSpec] = None) -> list[IROp]:
    """Fuse one thread block's op list (pipeline bodies recursively); ``ops`` are not changed."""
    out: list[IROp] = []
    # the state of out[-1]; a merged op makes no access that its two parts do not (for
    # conflicts: a reduction merge also lists the reads of the accumulator it writes)
    run: Optional[Run] = None
    for op in ops:
        if op.body is not None:
            op = replace(op, body=fuse_ops(op.body, spec))
        acc = accesses(op, spec=spec)
        merged = try_fuse(out[-1], op, spec, run) if out else None
        if merged is not None and merged is not op:
            out[-1] = merged
            run.index.add(acc)
            continue
        _end(out, run)
        if merged is op:
            out[-1] = op
        else:
            out.append(op)
        run = Run.of(op, acc)
    _end(out, run)
    return out


def _end(out: list[IROp], run: Optional[Run]) -> None:
    """A run ends: its op gets the origins of its parts."""
    if run is not None and len(run.origins) > 1:
        out[-1].origin = " + ".join(run.origins)


def fuse(ir: IRProgram) -> IRProgram:
    """Pass 2: fuse adjacent ops of every thread block (see the module docstring)."""
    out = ir.copy()
    for r in each_rank(out.ranks):
        r.tbs = [fuse_ops(ops, ir.spec) for ops in r.tbs]
    return out
