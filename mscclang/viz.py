"""Pictures of execution plans: :func:`draw_plan` renders a plan as a PNG timeline.

Per rank a horizontal band, per thread block a row; each op is a box (coloured by op family,
labelled with its name and short chunk references) placed at its *earliest step*: the layout is
an as-soon-as-possible schedule of the plan's happens-before graph, so every op sits to the right
of the ops it waits for and the arrows between blocks point forward in time. Edges:

* ``signal`` -> ``wait`` (solid red; relaxed pairs dashed orange): the k-th signal into a channel
  end is paired with the k-th wait on it. Channels are paired as in ``docs/semantics.md``: on rank
  A the j-th memory channel to B is bound to the j-th memory channel to A on rank B (port channels
  likewise, numbered separately). ``pws``/``pwsf`` signal too.
* packets (blue): an op that writes LL packets into a scratch slot (``ppkt``, ``cpkt``,
  ``rppkt``, ``respkt``, ``recpkt``, ``recspkt``, ``gstorepkt``) -> every op that reads packets
  from an overlapping slot of that rank (``upkt``, ``rppkt``, the packet reductions).
* semaphores (purple): the k-th ``sem_release`` -> the (k + initial value)-th ``sem_acquire``.
* barriers: a black vertical bar through the blocks that meet; a dotted bracket groups the inner
  ops of a pipeline (labelled ``i.j``: op j of pipeline op i).

Chunk references read ``i0:2`` (input chunks 0 and 1), ``s4@r1`` (scratch chunk 4 of rank 1),
``o0:2@sw0`` (through switch channel 0). A plan whose graph has a cycle (it deadlocks) is drawn
with ops at their op index instead, and the title says so.

The module needs matplotlib (the ``plot`` extra); it draws on an Agg canvas of its own and leaves
pyplot's backend and figures alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from mscclang.errors import MscclangError, PlanError
from mscclang.plan.models import BufferKind, BufferRef, ChannelType, Gpu, Op, OpName, Plan, ThreadBlock

__all__ = ["Edge", "OpNode", "PlanGraph", "PlanPicture", "build_graph", "draw_plan", "op_family",
           "FAMILY_COLORS", "EDGE_STYLES", "LABEL_LIMIT"]

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
}

_FAMILY: dict[OpName, str] = {}
for _n in (OpName.signal, OpName.rlxsignal, OpName.wait, OpName.rlxwait, OpName.flush):
    _FAMILY[_n] = "signal/wait"
for _n in (OpName.sem_acquire, OpName.sem_release):
    _FAMILY[_n] = "semaphore"
for _n in (OpName.nop, OpName.barrier):
    _FAMILY[_n] = "block sync"
for _n in (OpName.copy, OpName.put, OpName.get, OpName.pws, OpName.pwsf):
    _FAMILY[_n] = "copy/put/get"
for _n in (OpName.cpkt, OpName.upkt, OpName.ppkt, OpName.rppkt):
    _FAMILY[_n] = "packets"
for _n in (OpName.re, OpName.res, OpName.rre, OpName.rres):
    _FAMILY[_n] = "reduce"
for _n in (OpName.repkt, OpName.respkt, OpName.recpkt, OpName.recspkt):
    _FAMILY[_n] = "packet reduce"
for _n in (OpName.glre, OpName.glres, OpName.gstore, OpName.gstorepkt):
    _FAMILY[_n] = "switch"

_SIGNALLING = frozenset({OpName.signal, OpName.rlxsignal, OpName.pws, OpName.pwsf})
_WAITING = frozenset({OpName.wait, OpName.rlxwait})
#: op -> which dst operands it writes as packets (slice start, or None for none)
_PACKET_DST_FROM: dict[OpName, int] = {
    OpName.ppkt: 0, OpName.cpkt: 0, OpName.rppkt: 0, OpName.gstorepkt: 0,
    OpName.respkt: 1, OpName.recpkt: 1, OpName.recspkt: 1,
}
#: op -> which src operands it reads as packets
_PACKET_SRC_FROM: dict[OpName, int] = {
    OpName.upkt: 0, OpName.rppkt: 0,
    OpName.repkt: 1, OpName.respkt: 1, OpName.recpkt: 1, OpName.recspkt: 1,
}

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
        out: dict[str, int] = {k: 0 for k in EDGE_STYLES}
        for e in self.edges:
            out[e.kind] += 1
        return out

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


def _paired_end(plan: Plan, r: int, ct: ChannelType, g: int) -> tuple[int, int]:
    """(peer rank, peer's global channel index) of rank ``r``'s channel ``g`` of type ``ct``."""
    peers = plan.gpus[r].peers(ct)
    if not 0 <= g < len(peers):
        raise PlanError(f"rank {r}: {ct.value} channel {g} does not exist", f"gpus[{r}].channels")
    peer = peers[g]
    j = sum(1 for p in peers[:g] if p == peer)
    if not 0 <= peer < len(plan.gpus):
        raise PlanError(f"rank {r}: {ct.value} channel {g} leads to rank {peer}, which is not in the plan",
                        f"gpus[{r}].channels")
    back = [i for i, p in enumerate(plan.gpus[peer].peers(ct)) if p == r]
    if j >= len(back):
        raise PlanError(f"rank {r}: {ct.value} channel {g} is its channel {j} to rank {peer}, but rank {peer} "
                        f"has only {len(back)} {ct.value} channel(s) to rank {r}", f"gpus[{peer}].channels")
    return peer, back[j]


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
                        peer, pg = _paired_end(plan, r, op.channel_type, g)
                        signals[(peer, op.channel_type, pg)].append(key)
                    if name == OpName.rlxsignal:
                        relaxed_sig.add(key)
                elif name in _WAITING and op.channel_type in (ChannelType.memory, ChannelType.port):
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
                if name in _PACKET_DST_FROM:
                    for ref in op.dst_buff[_PACKET_DST_FROM[name]:]:
                        for rank, kind in _ref_targets(plan, gpu, tb, op, ref):
                            if kind == BufferKind.scratch:
                                writers[rank].append((ref.index, ref.index + max(ref.size, 1), key))
                if name in _PACKET_SRC_FROM:
                    for ref in op.src_buff[_PACKET_SRC_FROM[name]:]:
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
    return graph


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


# ------------------------------------------------------------------------------------------------
# labels


def _chunks(ref: BufferRef) -> str:
    return f"{ref.index}" if ref.size == 1 else f"{ref.index}:{ref.index + ref.size}"


def _short_ref(gpu: Gpu, tb: ThreadBlock, op: Op, ref: BufferRef) -> str:
    if ref.type is not None:
        return f"{ref.type.value}{_chunks(ref)}"
    if ref.buffer_id is not None:
        lst = tb.remote_buffer_list(op.channel_type)
        if ref.buffer_id < len(lst) and lst[ref.buffer_id] < len(gpu.remote_buffers):
            rb = gpu.remote_buffers[lst[ref.buffer_id]]
            return f"{rb.type.value}{_chunks(ref)}@r{rb.rank}"
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
    if op.name in _SIGNALLING | _WAITING | {OpName.flush} and op.name not in (OpName.pws, OpName.pwsf):
        peers = gpu.peers(op.channel_type) if op.channel_type in (ChannelType.memory, ChannelType.port) else []
        lst = tb.channel_list(op.channel_type)
        names = []
        for cid in op.channel_ids:
            g = lst[cid] if cid < len(lst) else None
            names.append(f"r{peers[g]}" if g is not None and g < len(peers) else "?")
        if len(names) > 3:
            return "r: " + ",".join(names[:2]) + f",+{len(names) - 2}"
        return ("\u2192" if op.name in _SIGNALLING else "\u2190") + ",".join(names) if names else ""
    if op.name in (OpName.sem_acquire, OpName.sem_release):
        return "sem " + ",".join(str(s) for s in op.semaphore_ids)
    if op.name == OpName.barrier:
        return f"id {op.barrier_id}"
    srcs = [_short_ref(gpu, tb, op, x) for x in op.src_buff]
    dsts = [_short_ref(gpu, tb, op, x) for x in op.dst_buff]
    if not srcs and not dsts:
        return ""
    return f"{_refs(srcs)}\u2192{_refs(dsts)}"


# ------------------------------------------------------------------------------------------------
# drawing


def _select_ranks(plan: Plan, ranks: Optional[Iterable[int]]) -> list[int]:
    if ranks is None:
        return list(range(len(plan.gpus)))
    out = sorted(set(int(r) for r in ranks))
    bad = [r for r in out if not 0 <= r < len(plan.gpus)]
    if bad:
        raise PlanError(f"rank {bad[0]} is not in the plan (ranks 0..{len(plan.gpus) - 1})")
    if not out:
        raise PlanError("no rank selected to draw")
    return out


def draw_plan(plan: Union[Plan, str, Path, dict], path: Union[str, Path], *,
              ranks: Optional[Sequence[int]] = None, tbs: Optional[Sequence[int]] = None, dpi: int = 120,
              title: Optional[str] = None, labels: Optional[bool] = None) -> PlanPicture:
    """Draw ``plan`` (a Plan, or a plan file / JSON text / dict for :func:`load_plan`) as a PNG
    timeline at ``path`` and return what was written.

    ``ranks`` / ``tbs`` restrict the picture to those ranks / thread block ids (the layout is
    still computed over the whole plan, so positions agree between pictures); edges to ops that
    are not drawn are left out. Figure size grows with the number of steps and rows, fonts stay
    small, and ``dpi`` is lowered when needed to keep the picture under 16000 pixels a side.
    ``labels``: write op names and chunk references into the boxes; by default only while at most
    :data:`LABEL_LIMIT` ops are drawn (text dominates the drawing time), else the title says how
    to zoom in. Uses matplotlib's Agg canvas directly: pyplot's global state is not touched.
    """
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.lines import Line2D
    from matplotlib.collections import LineCollection, PolyCollection
    from matplotlib.patches import Patch, Rectangle

    if not isinstance(plan, Plan):
        from mscclang.plan.io import load_plan

        plan = load_plan(plan)
    graph = build_graph(plan)
    shown_ranks = _select_ranks(plan, ranks)
    tb_filter = None if tbs is None else set(int(t) for t in tbs)
    n_shown = sum(1 for k in graph.nodes if k[0] in shown_ranks and (tb_filter is None or k[1] in tb_filter))
    auto_off = labels is None and n_shown > LABEL_LIMIT
    labels = (n_shown <= LABEL_LIMIT) if labels is None else labels

    # rows: y coordinate per (rank, tb); bands per rank
    rows: dict[tuple[int, int], float] = {}
    bands: list[tuple[int, float, float]] = []
    y = 0.0
    for r in shown_ranks:
        top = y
        tb_ids = [tb.id for tb in plan.gpus[r].threadblocks if tb_filter is None or tb.id in tb_filter]
        for t in tb_ids:
            rows[(r, t)] = y
            y -= 1.0
        if not tb_ids:
            y -= 1.0  # an empty band still shows the rank
        bands.append((r, top + 0.5, y + 0.5))
        y -= 0.5
    bottom = y + 0.5
    n_rows = max(1.0, -bottom)
    span = max(graph.span, 1.0)

    row_in = 0.34
    height_in = min(max(3.0, n_rows * row_in + 1.6), 300.0)
    # at least 0.8 inch per step; tall pictures get wider steps, so arrows between far rows spread
    col_in = max(0.8, min(2.5, 0.55 * height_in / span))
    width_in = min(max(8.0, span * col_in + 2.2), 300.0)
    dpi_eff = max(20, min(dpi, int(16000 / max(width_in, height_in))))

    fig = Figure(figsize=(width_in, height_in), dpi=dpi_eff)
    FigureCanvasAgg(fig)
    left = 1.3 / width_in
    ax = fig.add_axes((left, 0.55 / height_in, 1 - left - 0.2 / width_in, 1 - 1.45 / height_in))
    ax_w_in = width_in * ax.get_position().width
    ax_h_in = height_in * ax.get_position().height
    ax.set_xlim(-0.3, span + 0.3)
    ax.set_ylim(bottom - 0.2, 0.7)
    # thread block labels as plain texts (matplotlib's tick objects are costly by the hundred);
    # with many rows only every 8th block of a rank is labelled
    ax.set_yticks([])
    every = 1 if len(rows) <= 96 else 8
    ytrans = ax.get_yaxis_transform()
    for (r, t), yy in rows.items():
        if t % every == 0:
            ax.text(-0.006, yy, f"tb {t}", transform=ytrans, ha="right", va="center", fontsize=6)
    ax.tick_params(axis="x", labelsize=6)
    ax.set_xlabel("step (earliest time each op can start: after its block's previous op and the ops it waits for)"
                  if graph.acyclic else "op index (the dependency graph has a cycle)", fontsize=7)
    for s in ("top", "right"):
        ax.spines[s].set_visible(False)

    for i, (r, top, bot) in enumerate(bands):
        ax.add_patch(Rectangle((-0.3, bot), span + 0.6, top - bot,
                               facecolor="#f3f3f3" if i % 2 == 0 else "#ffffff", edgecolor="none", zorder=0))
        # horizontal, left of the block labels (0.45 inch), so one-row bands stay legible
        ax.text(-0.45 / ax_w_in, (top + bot) / 2, f"rank {r}", transform=ytrans, ha="right",
                va="center", fontsize=8, fontweight="bold")

    # pipeline brackets
    pipes: dict[tuple[int, int, int], list[OpNode]] = defaultdict(list)
    for node in graph.nodes.values():
        if node.pipeline is not None and (node.rank, node.tb) in rows:
            pipes[(node.rank, node.tb, node.pipeline)].append(node)
    for (r, t, i), members in pipes.items():
        x0 = min(m.x for m in members)
        x1 = max(m.x + m.width for m in members)
        yy = rows[(r, t)]
        # inner ops are labelled "i.j" (op j of pipeline i); the bracket groups them
        ax.add_patch(Rectangle((x0 - 0.08, yy - 0.45), x1 - x0 + 0.16, 0.9, facecolor="#fafafa",
                               edgecolor="#444444", linestyle=":", linewidth=0.9, zorder=1))

    drawn = 0
    boxes: list[list[tuple[float, float]]] = []
    fills: list[str] = []
    for node in graph.nodes.values():
        yy = rows.get((node.rank, node.tb))
        if yy is None:
            continue
        drawn += 1
        x0, x1 = node.x, node.x + node.width
        boxes.append([(x0, yy - 0.38), (x1, yy - 0.38), (x1, yy + 0.38), (x0, yy + 0.38)])
        fills.append(FAMILY_COLORS.get(op_family(node.op.name), "#ffffff"))
        if node.op.name == OpName.nop or not labels:
            continue
        detail = _detail(plan, node)
        if len(detail) > 17:
            detail = detail[:16] + "\u2026"
        text = f"{node.label} {node.op.name.value}" + (f"\n{detail}" if detail else "")
        ax.text(node.x + node.width / 2, yy, text, ha="center", va="center", fontsize=5, linespacing=1.1,
                zorder=3, clip_on=True)

    ax.add_collection(PolyCollection(boxes, facecolors=fills, edgecolors="#333333", linewidths=0.5, zorder=2))

    for group in graph.barriers:
        members = [graph.nodes[k] for k in group if (k[0], k[1]) in rows]
        if len(members) < 2:
            continue
        xs = members[0].x + members[0].width / 2
        ys = [rows[(m.rank, m.tb)] for m in members]
        ax.add_line(Line2D([xs, xs], [min(ys), max(ys)], color="black", linewidth=1.6, alpha=0.7, zorder=4))

    # edges: one LineCollection per kind (quadratic curves, sampled) plus arrow heads as polygons,
    # computed in inches so heads keep their shape whatever the aspect ratio
    sx = (span + 0.6) / ax_w_in  # data units per inch
    sy = (0.9 - bottom) / ax_h_in
    visible = [e for e in graph.edges
               if (e.src[0], e.src[1]) in rows and (e.dst[0], e.dst[1]) in rows]
    alpha = max(0.2, min(0.8, 40.0 / max(len(visible), 1) ** 0.5 * 0.25))
    lw = 0.7 if len(visible) < 100 else 0.45
    curves: dict[str, list] = defaultdict(list)
    heads: dict[str, list] = defaultdict(list)
    for e in visible:
        a, b = graph.nodes[e.src], graph.nodes[e.dst]
        p0 = ((a.x + a.width) / sx, rows[(a.rank, a.tb)] / sy)  # in inches
        p2 = (b.x / sx, rows[(b.rank, b.tb)] / sy)
        dx, dy = p2[0] - p0[0], p2[1] - p0[1]
        bend = 0.35 if abs(dy) < 1e-9 else 0.08
        ctrl = ((p0[0] + p2[0]) / 2 - dy * bend, (p0[1] + p2[1]) / 2 + dx * bend)
        pts = []
        for i in range(13):
            t = i / 12
            u = 1 - t
            pts.append(((u * u * p0[0] + 2 * u * t * ctrl[0] + t * t * p2[0]) * sx,
                        (u * u * p0[1] + 2 * u * t * ctrl[1] + t * t * p2[1]) * sy))
        curves[e.kind].append(pts)
        tx, ty = p2[0] - ctrl[0], p2[1] - ctrl[1]
        norm = max((tx * tx + ty * ty) ** 0.5, 1e-9)
        tx, ty = tx / norm, ty / norm
        hl, hw = 0.07, 0.025
        base = (p2[0] - tx * hl, p2[1] - ty * hl)
        heads[e.kind].append([(p2[0] * sx, p2[1] * sy),
                              ((base[0] - ty * hw) * sx, (base[1] + tx * hw) * sy),
                              ((base[0] + ty * hw) * sx, (base[1] - tx * hw) * sy)])
    for kind, segs in curves.items():
        color, style = EDGE_STYLES[kind]
        ax.add_collection(LineCollection(segs, colors=color, linestyles=style, linewidths=lw, alpha=alpha,
                                         zorder=5))
        ax.add_collection(PolyCollection(heads[kind], facecolors=color, edgecolors="none",
                                         alpha=min(1.0, alpha + 0.2), zorder=5))

    # legend: only the families and edge kinds that appear in the picture
    fams = {op_family(n.op.name) for k, n in graph.nodes.items() if (k[0], k[1]) in rows}
    kinds = {e.kind for e in visible}
    handles = [Patch(facecolor=c, edgecolor="#333333", label=f) for f, c in FAMILY_COLORS.items() if f in fams]
    handles += [Line2D([0], [0], color=c, linestyle=s, label=f"{k} edge")
                for k, (c, s) in EDGE_STYLES.items() if k in kinds]
    if any(sum(1 for k in g if (k[0], k[1]) in rows) > 1 for g in graph.barriers):
        handles.append(Line2D([0], [0], color="black", linewidth=1.6, label="barrier"))
    if "pipeline" in fams or any(n.pipeline is not None for n in graph.nodes.values()):
        handles.append(Patch(facecolor="none", edgecolor="#555555", linestyle=":",
                             label="pipeline (ops i.0, i.1, ...)"))
    fig.legend(handles=handles, loc="upper left", ncol=max(1, min(len(handles), int((width_in - 1.6) / 1.35))),
               fontsize=6, frameon=False,
               bbox_to_anchor=(left, 1 - 0.32 / height_in))
    if title is None:
        extras = [f"{len(plan.gpus)} ranks", plan.protocol, "in place" if plan.inplace else "out of place"]
        if len(shown_ranks) < len(plan.gpus):
            extras.append("ranks " + ",".join(str(r) for r in shown_ranks))
        if not graph.acyclic:
            extras.append("CYCLE: ops drawn at their op index")
        if auto_off:
            extras.append(f"labels left out ({n_shown} ops): draw fewer ranks or blocks to see them")
        title = f"{plan.name} ({plan.collective}): " + ", ".join(extras)
    fig.text(left, 1 - 0.08 / height_in, title, fontsize=9, fontweight="bold", va="top", ha="left")

    out = Path(path)
    try:
        fig.savefig(out, format="png", dpi=dpi_eff, pil_kwargs={"compress_level": 1})
    except OSError as e:
        raise MscclangError(f"cannot write {out}: {e.strerror or e}") from None
    w, h = fig.canvas.get_width_height()
    return PlanPicture(out, int(w), int(h), shown_ranks, drawn,
                       graph.edge_counts(), graph.acyclic, bool(labels))
