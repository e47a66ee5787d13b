"""The plan's picture as data (no matplotlib): ops as nodes placed at their earliest step of the
happens-before graph, and the edges between them (signal -> wait, packets, semaphores, data,
barriers). What the edges mean: the package docstring (:mod:`mscclang.viz`)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mscclang.errors import PlanError
from mscclang.plan.models import PACKET_DST_FROM, PACKET_SRC_FROM, PUT_SIGNAL_OPS, SEMAPHORE_OPS, SIGNAL_OPS, SYNC_OPS, WAIT_OPS, BufferKind, BufferRef, ChannelType, Gpu, Op, OpName, Plan, ThreadBlock

__all__ = ["Edge", "OpNode", "PlanGraph", "PlanPicture", "build_graph", "op_family", "FAMILY_COLORS",
           "EDGE_STYLES", "LABEL_LIMIT", "NodeKey"]

#: node key: (rank, thread block, position in the block's flattened op list)
NodeKey = tuple[int, int, int]

#: op family -> fill colour
FAMILY_COLORS: dict[str, str] = {
    "signal/wait": "#f4a6a6",
    "semaphore": "#d7b5e8",
    "block sync": "#d9d9d9",
    "copy/put/get": "#a6cee3",
    "packets": "#b2df8a",
    "reduce": "#fdbf6f",
    "packet reduce": "#ffe680",
    "switch": "#8dd3c7",
}

#: edge kind -> (colour, line style)
EDGE_STYLES: dict[str, tuple[str, str]] = {
    "signal": ("#d62728", "-"),
    "relaxed": ("#ff7f0e", "--"),
    "packet": ("#1f4e9c", "-"),
    "semaphore": ("#7b3294", "-."),
    "data": ("#2e8b3e", "-"),
}

_FAMILY: dict[OpName, str] = {name: family for family, names in (
    ("signal/wait", SYNC_OPS - SEMAPHORE_OPS),
    ("semaphore", SEMAPHORE_OPS),
    ("block sync", (OpName.nop, OpName.barrier)),
    ("copy/put/get", (OpName.copy, OpName.put, OpName.get, OpName.pws, OpName.pwsf)),
    ("packets", (OpName.cpkt, OpName.upkt, OpName.ppkt, OpName.rppkt)),
    ("reduce", (OpName.re, OpName.res, OpName.rre, OpName.rres)),
    ("packet reduce", (OpName.repkt, OpName.respkt, OpName.recpkt, OpName.recspkt)),
    ("switch", (OpName.glre, OpName.glres, OpName.gstore, OpName.gstorepkt)),
) for name in names}

_SIGNALLING = SIGNAL_OPS | PUT_SIGNAL_OPS

#: most ops drawn with labels by default
LABEL_LIMIT = 1200

_NOP_WIDTH = 0.3
_GAP = 0.3


def op_family(name: OpName) -> str:
    """The colour family of an op name (a key of :data:`FAMILY_COLORS`); ``pipeline`` is its own."""
    return _FAMILY.get(name, "pipeline")


@dataclass
class OpNode:
    """One op as drawn: top-level ops and the inner ops of a pipeline each get a node."""

    rank: int
    tb: int
    pos: int
    label: str  # op index as `mscclang show` prints it ("3" or "2.1" inside pipeline 2)
    op: Op
    pipeline: Optional[int] = None  # index of the enclosing pipeline op, if any
    x: float = 0.0
    width: float = field(init=False)  # in steps: 1, or less for a nop

    def __post_init__(self) -> None:
        self.width = _NOP_WIDTH if self.op.name is OpName.nop else 1.0

    @property
    def key(self) -> NodeKey:
        return (self.rank, self.tb, self.pos)


@dataclass(frozen=True)
class Edge:
    """A cross-block dependency: ``kind`` is a key of :data:`EDGE_STYLES`."""

    kind: str
    src: NodeKey
    dst: NodeKey


@dataclass
class PlanGraph:
    """Ops of a plan with their dependencies and timeline positions."""

    plan: Plan
    nodes: dict[NodeKey, OpNode]
    blocks: dict[tuple[int, int], list[NodeKey]]
    edges: list[Edge]
    barriers: list[list[NodeKey]]
    acyclic: bool = True

    def edge_counts(self) -> dict[str, int]:
        counts = Counter(e.kind for e in self.edges)
        return {k: counts[k] for k in EDGE_STYLES}

    @property
    def span(self) -> float:
        """Right end of the last box (in steps)."""
        return max((n.x + n.width for n in self.nodes.values()), default=1.0)


@dataclass
class PlanPicture:
    """What :func:`draw_plan` wrote."""

    path: Path
    width_px: int
    height_px: int
    ranks: list[int]
    num_ops: int
    edge_counts: dict[str, int] = field(default_factory=dict)  # edges of the whole plan, by kind
    timeline: bool = True  # False when a cycle forced op-index positions
    labels: bool = True
    paths: list[Path] = field(default_factory=list)  # every page: path, then NAME-2.png, ...
    page_sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height) px per page
    panels: int = 1  # rows the timeline was wrapped into
    #: per page, (text, (x0, y0, x1, y1) px) of every text (``draw_plan(measure_text=True)``)
    text_boxes: list[list[tuple[str, tuple[float, float, float, float]]]] = field(default_factory=list)
    #: with a trace: the ops of the critical path (rank, block, position)
    critical: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------------
# the graph


def _where(r: int, t: int, label: str) -> str:
    return f"gpus[{r}].threadblocks[{t}].ops[{label.replace('.', '].ops[')}]"


def _global_channel(gpu: Gpu, tb: ThreadBlock, op: Op, cid: int, r: int, label: str) -> int:
    lst = tb.channel_list(op.channel_type)
    if not 0 <= cid < len(lst):
        raise PlanError(f"rank {r} thread block {tb.id} op {label} ({op.name.value}): channel id {cid} is "
                        f"not in the block's {op.channel_type.value} channel list", _where(r, tb.id, label))
    return lst[cid]


def _ref_targets(plan: Plan, gpu: Gpu, tb: ThreadBlock, op: Op, ref: BufferRef) -> list[tuple[int, BufferKind]]:
    """(rank, buffer kind) pairs a reference addresses; empty when it cannot be resolved."""
    if ref.type is not None:
        return [(gpu.id, ref.type)]
    if ref.buffer_id is not None:
        lst = tb.remote_buffer_list(op.channel_type)
        if ref.buffer_id < len(lst) and lst[ref.buffer_id] < len(gpu.remote_buffers):
            rb = gpu.remote_buffers[lst[ref.buffer_id]]
            return [(rb.rank, rb.type)]
        return []
    lst = tb.channel_list(ChannelType.switch)
    groups = gpu.switch_groups()
    sid = ref.switch_channel_id
    if sid is not None and sid < len(lst) and lst[sid] < len(groups):
        kind, ranks = groups[lst[sid]]
        return [(x, kind) for x in ranks]
    return []


def _flatten(gpu: Gpu, tb: ThreadBlock) -> list[tuple[str, Op, Optional[int]]]:
    out: list[tuple[str, Op, Optional[int]]] = []
    for i, op in enumerate(tb.ops):
        if op.name == OpName.pipeline and op.ops:
            for j, inner in enumerate(op.ops):
                out.append((f"{i}.{j}", inner, i))
        else:
            out.append((str(i), op, None))
    return out


def build_graph(plan: Plan) -> PlanGraph:
    """Collect the ops of ``plan``, their cross-block edges and their timeline positions.

    Raises :class:`~mscclang.errors.PlanError` (naming rank, thread block and op) when an op's
    channel cannot be resolved."""
    nodes: dict[NodeKey, OpNode] = {}
    blocks: dict[tuple[int, int], list[NodeKey]] = {}
    signals: dict[tuple, list[NodeKey]] = defaultdict(list)
    waits: dict[tuple, list[tuple[NodeKey, bool]]] = defaultdict(list)
    relaxed_sig: set[NodeKey] = set()
    releases: dict[tuple[int, int], list[NodeKey]] = defaultdict(list)
    acquires: dict[tuple[int, int], list[NodeKey]] = defaultdict(list)
    writers: dict[int, list[tuple[int, int, NodeKey]]] = defaultdict(list)  # rank -> (lo, hi, node)
    readers: dict[int, list[tuple[int, int, NodeKey]]] = defaultdict(list)
    barrier_groups: dict[tuple[int, int, int], list[NodeKey]] = defaultdict(list)

    for gpu in plan.gpus:
        r = gpu.id
        for tb in gpu.threadblocks:
            keys: list[NodeKey] = []
            seen_barrier: dict[int, int] = defaultdict(int)
            for pos, (label, op, pipe) in enumerate(_flatten(gpu, tb)):
                key = (r, tb.id, pos)
                nodes[key] = OpNode(r, tb.id, pos, label, op, pipe)
                keys.append(key)
                name = op.name
                if name in _SIGNALLING and op.channel_type in (ChannelType.memory, ChannelType.port):
                    for cid in op.channel_ids:
                        g = _global_channel(gpu, tb, op, cid, r, label)
                        end = plan.paired_end(r, op.channel_type, g)
                        signals[(end.rank, op.channel_type, end.index)].append(key)
                    if name == OpName.rlxsignal:
                        relaxed_sig.add(key)
                elif name in WAIT_OPS and op.channel_type in (ChannelType.memory, ChannelType.port):
                    for cid in op.channel_ids:
                        g = _global_channel(gpu, tb, op, cid, r, label)
                        waits[(r, op.channel_type, g)].append((key, name == OpName.rlxwait))
                elif name == OpName.sem_release:
                    for s in op.semaphore_ids:
                        releases[(r, s)].append(key)
                elif name == OpName.sem_acquire:
                    for s in op.semaphore_ids:
                        acquires[(r, s)].append(key)
                elif name == OpName.barrier and op.barrier_id is not None:
                    k = seen_barrier[op.barrier_id]
                    seen_barrier[op.barrier_id] += 1
                    barrier_groups[(r, op.barrier_id, k)].append(key)
                if name in PACKET_DST_FROM:
                    for ref in op.dst_buff[PACKET_DST_FROM[name]:]:
                        for rank, kind in _ref_targets(plan, gpu, tb, op, ref):
                            if kind == BufferKind.scratch:
                                writers[rank].append((ref.index, ref.index + max(ref.size, 1), key))
                if name in PACKET_SRC_FROM:
                    for ref in op.src_buff[PACKET_SRC_FROM[name]:]:
                        if ref.type == BufferKind.scratch:
                            readers[r].append((ref.index, ref.index + max(ref.size, 1), key))
            blocks[(r, tb.id)] = keys

    edges: list[Edge] = []
    for end, sigs in signals.items():
        for k, (wkey, wrelaxed) in enumerate(waits.get(end, [])):
            if k < len(sigs):
                s = sigs[k]
                kind = "relaxed" if (wrelaxed or s in relaxed_sig) else "signal"
                edges.append(Edge(kind, s, wkey))
    for (r, s), acqs in acquires.items():
        init = 0
        sems = plan.gpus[r].semaphores
        if 0 <= s < len(sems):
            init = sems[s].init_value
        rels = releases.get((r, s), [])
        for k, akey in enumerate(acqs):
            if 0 <= k - init < len(rels):
                edges.append(Edge("semaphore", rels[k - init], akey))
    for rank, rds in readers.items():
        wrs = writers.get(rank, [])
        for lo, hi, rkey in rds:
            for wlo, whi, wkey in wrs:
                if wlo < hi and lo < whi and wkey != rkey:
                    edges.append(Edge("packet", wkey, rkey))
    edges = sorted(set(edges), key=lambda e: (e.kind, e.src, e.dst))
    barriers = [sorted(v) for _, v in sorted(barrier_groups.items()) if len(v) > 1]
    graph = PlanGraph(plan, nodes, blocks, edges, barriers)
    _place(graph)
    if graph.acyclic:
        graph.edges = sorted(set(graph.edges) | set(_data_edges(graph)), key=lambda e: (e.kind, e.src, e.dst))
    return graph


def _plain_refs(op: Op) -> tuple[list[BufferRef], list[BufferRef]]:
    """(sources read, destinations written) as plain data, i.e. not as LL packets."""
    srcs = op.src_buff[:PACKET_SRC_FROM.get(op.name, len(op.src_buff))]
    dsts = op.dst_buff[:PACKET_DST_FROM.get(op.name, len(op.dst_buff))]
    return list(srcs), list(dsts)


def _data_edges(graph: PlanGraph) -> list[Edge]:
    """Data edges: from the op that last wrote a chunk (plainly, e.g. a ``put`` into a peer's
    buffer) to each op of another thread block that reads it next. "Last" and "next" follow the
    timeline: a reader at step x reads what the latest overlapping write ending by x left (so an
    unordered write, a race, draws no edge). One edge per writer and reading block (its first
    read)."""
    plan = graph.plan
    writes: dict[tuple[int, BufferKind], list[tuple[int, int, NodeKey]]] = defaultdict(list)
    reads: dict[tuple[int, BufferKind], list[tuple[int, int, NodeKey]]] = defaultdict(list)
    for key, node in graph.nodes.items():
        gpu = plan.gpus[node.rank]
        tb = gpu.threadblocks[node.tb]
        srcs, dsts = _plain_refs(node.op)
        for refs, table in ((srcs, reads), (dsts, writes)):
            for ref in refs:
                for rank, kind in _ref_targets(plan, gpu, tb, node.op, ref):
                    table[(rank, kind)].append((ref.index, ref.index + max(ref.size, 1), key))
    first: dict[tuple[NodeKey, tuple[int, int]], NodeKey] = {}
    for where, rds in reads.items():
        wrs = sorted(writes.get(where, []), key=lambda w: graph.nodes[w[2]].x)
        for lo, hi, rkey in rds:
            rx = graph.nodes[rkey].x
            latest: Optional[NodeKey] = None
            for wlo, whi, wkey in wrs:
                wn = graph.nodes[wkey]
                if wn.x + wn.width > rx + 1e-9:
                    break
                if wlo < hi and lo < whi:
                    latest = wkey
            if latest is None or latest[:2] == rkey[:2]:
                continue
            slot = (latest, rkey[:2])
            if slot not in first or graph.nodes[first[slot]].x > rx:
                first[slot] = rkey
    return [Edge("data", w, r) for (w, _), r in first.items()]


def _place(graph: PlanGraph) -> None:
    """Longest-path (as soon as possible) x positions; op indexes when the graph has a cycle."""
    import networkx as nx

    rep: dict[NodeKey, NodeKey] = {k: k for k in graph.nodes}
    for group in graph.barriers:
        for k in group:
            rep[k] = group[0]
    g = nx.DiGraph()
    g.add_nodes_from(set(rep.values()))

    def link(a: NodeKey, b: NodeKey) -> None:
        ra, rb = rep[a], rep[b]
        if ra == rb:
            return
        w = graph.nodes[a].width + _GAP
        if not g.has_edge(ra, rb) or g[ra][rb]["w"] < w:
            g.add_edge(ra, rb, w=w)

    for keys in graph.blocks.values():
        for a, b in zip(keys, keys[1:]):
            link(a, b)
    for e in graph.edges:
        link(e.src, e.dst)
    try:
        order = list(nx.topological_sort(g))
    except nx.NetworkXUnfeasible:
        graph.acyclic = False
        for keys in graph.blocks.values():
            x = 0.0
            for k in keys:
                graph.nodes[k].x = x
                x += graph.nodes[k].width + _GAP
        return
    xs: dict[NodeKey, float] = {}
    for v in order:
        xs[v] = max((xs[u] + d["w"] for u, _, d in g.in_edges(v, data=True)), default=0.0)
    for k, node in graph.nodes.items():
        node.x = xs[rep[k]]


