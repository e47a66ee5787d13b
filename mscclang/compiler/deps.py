"""Dependencies between ops as a networkx graph, and cycle detection.

Nodes are ``(rank, tb, index)`` for top-level ops and ``(rank, tb, index, j)`` for op ``j`` of a
pipeline body (the body is taken once, as one iteration). Edges:

* program order inside each thread block (a pipeline node precedes its body, whose last op
  precedes the block's next op);
* signal -> wait, per channel end and launch, across thread blocks: a wait that is the ``j``-th
  wait on its channel end in its own block (program order) needs at least ``j`` signals on the
  paired end (waits of other blocks can only raise its expected count). When the signals come
  from blocks ``B`` with ``n_B`` signals each (``N`` in all), at least ``j - (N - n_B)`` of them
  must come from ``B``, so ``B``'s signal number ``j - (N - n_B)`` (program order) precedes the
  wait whenever that number is positive. With one signalling block this pairs the ``j``-th signal
  with the ``j``-th wait; with several it still gives every edge that holds whatever the
  blocks' relative speed, so cycles through channels shared by several blocks are found too.
  (A signal of a later launch cannot stand in: a rank starts its next launch only after all its
  blocks finished this one.) Channel ends with a signal or wait inside a pipeline body are paired
  only when one block signals and one block waits (``m``-th with ``m``-th, the body taken once);
* barriers: every member's barrier op precedes a virtual node that precedes every member's next op;
* semaphores: when one block acquires a semaphore and one block releases it, the ``(m - v)``-th
  release precedes the ``m``-th acquire (``v`` the initial value);
* LL packets: every op that writes packets into a scratch range of a rank precedes every op of
  that rank that reads packets from an overlapping range.

A cycle means a deadlock: :func:`check_acyclic` raises :class:`~mscclang.errors.CompileError`
naming the ops of the cycle.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from typing import Optional

import networkx as nx

from mscclang.compiler.ir import IROp, IRProgram, signal_side
from mscclang.compiler.validate import channel_pairs
from mscclang.errors import CompileError
from mscclang.plan.models import PACKET_DST_FROM, PACKET_SRC_FROM, BufferKind, OpName

Node = tuple


def _flat(rank: int, tb: int, ops: list[IROp]) -> list[tuple[Node, IROp]]:
    out: list[tuple[Node, IROp]] = []
    for i, op in enumerate(ops):
        out.append(((rank, tb, i), op))
        if op.body is not None:
            for j, inner in enumerate(op.body):
                out.append(((rank, tb, i, j), inner))
    return out


def _packet_writes(op: IROp) -> list[tuple[int, int, int]]:
    """(owner rank, start, end) of scratch packet ranges written by ``op`` (plain chunk units)."""
    start = PACKET_DST_FROM.get(op.name)
    refs = op.dst[start:] if start is not None else []
    return [(r.rank, r.index, r.end) for r in refs if r.buffer == BufferKind.scratch and r.switch is None]


def _packet_reads(op: IROp) -> list[tuple[int, int, int]]:
    start = 0 if op.name == OpName.gstorepkt else PACKET_SRC_FROM.get(op.name)   # gstorepkt: its scratch source
    refs = op.src[start:] if start is not None else []
    return [(r.rank, r.index, r.end) for r in refs if r.buffer == BufferKind.scratch and not r.remote]


def signal_wait_pairs(sends: list[Node], waits: list[Node]) -> list[tuple[Node, Node]]:
    """The (signal, wait) edges of one channel end pair (see the module docstring). ``sends`` and
    ``waits`` are nodes in program order within each block (blocks may be interleaved)."""
    if not sends or not waits:
        return []
    in_pipeline = any(len(x) > 3 for x in sends + waits)
    send_blocks = {s[:2] for s in sends}
    wait_blocks = {w[:2] for w in waits}
    if in_pipeline:
        if len(send_blocks) != 1 or len(wait_blocks) != 1:
            return []
        return list(zip(sends, waits))
    per_block: dict[tuple, list[Node]] = defaultdict(list)
    for s in sends:
        per_block[s[:2]].append(s)
    total = len(sends)
    out: list[tuple[Node, Node]] = []
    seen: dict[tuple, int] = defaultdict(int)
    for w in waits:
        seen[w[:2]] += 1
        j = seen[w[:2]]
        for blk, lst in sorted(per_block.items()):
            need = j - (total - len(lst))
            if 1 <= need <= len(lst):
                out.append((lst[need - 1], w))
    return out


def build_graph(ir: IRProgram) -> nx.DiGraph:
    """The dependency graph of ``ir`` (see the module docstring); nodes carry ``label``."""
    g = nx.DiGraph()
    flat_by_tb: dict[tuple[int, int], list[tuple[Node, IROp]]] = {}
    for r in ir.ranks:
        for t, ops in enumerate(r.tbs):
            flat = _flat(r.rank, t, ops)
            flat_by_tb[(r.rank, t)] = flat
            prev: Optional[Node] = None
            for node, op in flat:
                idx = ".".join(str(x) for x in node[2:])
                at = f", {op.source}" if op.source else ""
                g.add_node(node, label=f"rank {node[0]} tb {node[1]} op {idx} ({op.name.value}{at})")
                if prev is not None:
                    g.add_edge(prev, node)
                prev = node

    # signal -> wait per channel end
    sig: dict[tuple, list[Node]] = defaultdict(list)
    wai: dict[tuple, list[Node]] = defaultdict(list)
    for (rank, _t), flat in flat_by_tb.items():
        for node, op in flat:
            side = signal_side(op)
            for c in op.channels if side else ():
                (sig if side == "signal" else wai)[(rank, op.channel_type, c)].append(node)
    pairs = channel_pairs(ir)
    for (rank, ctype, c), sends in sig.items():
        pj = pairs.get((rank, ctype, c))
        if pj is None:
            continue
        peer = ir.ranks[rank].peers(ctype)[c]
        waits = wai.get((peer, ctype, pj), [])
        for s, w in signal_wait_pairs(sends, waits):
            g.add_edge(s, w)

    # barriers
    occurrences: dict[tuple[int, int], dict[int, list[Node]]] = defaultdict(lambda: defaultdict(list))
    for (rank, t), flat in flat_by_tb.items():
        for node, op in flat:
            if op.name == OpName.barrier and op.barrier_id is not None:
                occurrences[(rank, op.barrier_id)][t].append(node)
    position = {node: i for flat in flat_by_tb.values() for i, (node, _) in enumerate(flat)} if occurrences else {}
    for (rank, bid), per_tb in occurrences.items():
        rounds = min(len(v) for v in per_tb.values())
        for m in range(rounds):
            v = ("barrier", rank, bid, m)
            g.add_node(v, label=f"rank {rank} barrier {bid} (round {m})")
            for t, nodes in per_tb.items():
                node = nodes[m]
                g.add_edge(node, v)
                flat = flat_by_tb[(rank, t)]
                pos = position[node]
                if pos + 1 < len(flat):
                    g.add_edge(v, flat[pos + 1][0])

    # semaphores
    for r in ir.ranks:
        acq: dict[int, list[Node]] = defaultdict(list)
        rel: dict[int, list[Node]] = defaultdict(list)
        for t in range(len(r.tbs)):
            for node, op in flat_by_tb[(r.rank, t)]:
                for s in op.semaphores:
                    if op.name == OpName.sem_acquire:
                        acq[s].append(node)
                    elif op.name == OpName.sem_release:
                        rel[s].append(node)
        for s, acquires in acq.items():
            releases = rel.get(s, [])
            if len({a[:2] for a in acquires}) != 1 or len({x[:2] for x in releases}) > 1:
                continue
            v0 = r.semaphores[s] if s < len(r.semaphores) else 0
            for m, a in enumerate(acquires, start=1):
                need = m - v0
                if 1 <= need <= len(releases):
                    g.add_edge(releases[need - 1], a)

    # LL packets: per owner, writes sorted by start (the overlapping ones found by bisection,
    # in the order they were listed, so the graph is the same however many there are)
    writes: dict[int, list[tuple[int, int, int, Node]]] = defaultdict(list)
    for flat in flat_by_tb.values():
        for node, op in flat:
            for owner, a, b in _packet_writes(op):
                writes[owner].append((a, len(writes[owner]), b, node))
    for ws in writes.values():
        ws.sort()
    starts = {o: [w[0] for w in ws] for o, ws in writes.items()}
    longest = {o: max(b - a for a, _, b, _ in ws) for o, ws in writes.items()}
    for flat in flat_by_tb.values():
        for node, op in flat:
            for owner, a, b in _packet_reads(op):
                if owner not in writes:
                    continue
                ws = writes[owner][bisect_left(starts[owner], a - longest[owner] + 1):bisect_left(starts[owner], b)]
                for _, wnode in sorted((k, wnode) for _, k, wb, wnode in ws if a < wb and wnode != node):
                    g.add_edge(wnode, node)
    return g


def check_acyclic(ir: IRProgram) -> nx.DiGraph:
    """Build the graph; raise CompileError naming the ops of a cycle if there is one."""
    g = build_graph(ir)
    if nx.is_directed_acyclic_graph(g):  # linear; find_cycle alone is quadratic on a DAG
        return g
    cycle = nx.find_cycle(g)
    names = [g.nodes[u].get("label", str(u)) for u, _v in cycle]
    names.append(names[0])
    raise CompileError("dependency cycle (the program would deadlock): " + " -> ".join(names))
