"""Drawing the plan picture with matplotlib (the ``plot`` extra), on an Agg canvas of its own:
pyplot's backend and figures are left alone."""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

from mscclang.errors import MscclangError, PlanError
from mscclang.plan.models import OpName, Plan
from mscclang.viz.graph import (EDGE_STYLES, FAMILY_COLORS, LABEL_LIMIT, Edge, NodeKey, OpNode, PlanGraph,
                                PlanPicture, build_graph, op_family)
from mscclang.viz.labels import _detail, _key_lines

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
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


#: inches: left margin (rank and block labels), right margin, one block row, one step at least
_LEFT_IN = 1.3
_RIGHT_IN = 0.25
_ROW_IN = 0.34
_MIN_STEP_IN = 0.8
#: inches: a panel's axis (tick labels) below its rows; the gap between panels
_AXIS_IN = 0.3
_PANEL_GAP_IN = 0.25


def _cuts(graph: PlanGraph, keys: list[NodeKey], span: float, per_panel: float) -> list[float]:
    """Panel boundaries ``[0, c1, ..., span]``: each panel holds at most ``per_panel`` steps and
    no box is cut in two (a cut falls where no box is)."""
    starts = sorted({graph.nodes[k].x for k in keys})
    intervals = sorted((graph.nodes[k].x, graph.nodes[k].x + graph.nodes[k].width) for k in keys)
    lefts = [a for a, _ in intervals]
    reach: list[float] = []  # reach[i]: right end of the longest box among the first i + 1
    for _, b in intervals:
        reach.append(max(b, reach[-1]) if reach else b)

    def free(c: float) -> bool:  # no box starts before c and ends after it
        i = bisect.bisect_left(lefts, c - 1e-9)
        return i == 0 or reach[i - 1] <= c + 1e-9

    cuts = [0.0]
    while span - cuts[-1] > per_panel + 1e-9:
        lo = cuts[-1]
        options = [x for x in starts if lo + 1e-9 < x <= lo + per_panel + 1e-9 and free(x)]
        cuts.append(max(options) if options else lo + per_panel)
    cuts.append(span)
    return cuts


@dataclass
class _Panel:
    """One row of the wrapped picture: the steps ``x0 .. x1`` of every drawn block row."""

    index: int
    x0: float
    x1: float
    ax: object = None


def draw_plan(plan: Union[Plan, str, Path, dict], path: Union[str, Path], *,
              ranks: Optional[Sequence[int]] = None, tbs: Optional[Sequence[int]] = None, dpi: int = 120,
              title: Optional[str] = None, labels: Optional[bool] = None, max_width_px: int = 3000,
              max_height_px: int = 6000, measure_text: bool = False, trace: Any = None) -> PlanPicture:
    """Draw ``plan`` (a Plan, or a plan file / JSON text / dict for :func:`load_plan`) as a PNG
    timeline at ``path`` and return what was written.

    ``ranks`` / ``tbs`` restrict the picture to those ranks / thread block ids (the layout is
    still computed over the whole plan, so positions agree between pictures); edges to ops that
    are not drawn are left out.

    A long plan is wrapped like text: the timeline is cut (between boxes) into panels of at most
    ``max_width_px`` pixels, stacked top to bottom, each showing every drawn block row for its
    steps; an edge between two panels leaves the first at its right border and enters the next at
    its left border. Panels that do not fit ``max_height_px`` go to further pages, written next to
    ``path`` as ``NAME-2.png``, ``NAME-3.png``... (:attr:`PlanPicture.paths`). A plan taller than a
    page (many block rows) gets one panel per page and a lower ``dpi``, keeping every side under
    16000 pixels. Each page has the legend (op families, edge kinds) and a key of the box labels
    with the names of the ops it shows.

    ``labels``: write op names and chunk references into the boxes; by default only while at most
    :data:`LABEL_LIMIT` ops are drawn (text dominates the drawing time), else the title says how
    to zoom in. ``measure_text``: record every text's pixel box in :attr:`PlanPicture.text_boxes`
    (to check that none overlap). ``trace``: a Chrome trace of this plan (a dict, as ``mscclang
    predict --trace`` or a traced run writes it): the boxes are placed at its times instead of
    steps (the axis in microseconds), waits are as long as they waited, and the critical path is
    outlined in red (:mod:`mscclang.viz.timing`). Uses matplotlib's Agg canvas directly: pyplot's
    global state is not touched.
    """
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not isinstance(plan, Plan):
        from mscclang.plan.io import load_plan

        plan = load_plan(plan)
    graph = build_graph(plan)
    timed = None
    if trace is not None:
        from mscclang.viz.timing import apply_trace

        timed = apply_trace(graph, trace)
    shown_ranks = _select_ranks(plan, ranks)
    tb_filter = None if tbs is None else set(int(t) for t in tbs)

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
    shown = [k for k in graph.nodes if (k[0], k[1]) in rows]
    n_shown = len(shown)
    auto_off = labels is None and n_shown > LABEL_LIMIT
    labels = (n_shown <= LABEL_LIMIT) if labels is None else labels
    span = max(graph.span, 1.0)

    # geometry (inches): panel height, step width, panels, pages
    rows_h = n_rows * _ROW_IN + 0.35
    panel_h = rows_h + _AXIS_IN
    max_w_in = max(8.0, max_width_px / dpi)
    # wide steps for tall pictures (arrows between far rows spread), as long as it fits one panel
    col_in = max(_MIN_STEP_IN, min(2.5, 0.55 * (panel_h + 1.3) / span))
    if span * col_in + _LEFT_IN + _RIGHT_IN > max_w_in:
        col_in = _MIN_STEP_IN
    per_panel = max(4.0, (max_w_in - _LEFT_IN - _RIGHT_IN) / col_in - 0.6)
    cuts = _cuts(graph, shown, span, per_panel)
    panels = [_Panel(i, cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]
    panel_steps = max(p.x1 - p.x0 for p in panels) if len(panels) > 1 else span
    width_in = max(8.0, panel_steps * col_in + 0.6 * col_in + _LEFT_IN + _RIGHT_IN)

    # the header: title, legend, label key
    fams = {op_family(graph.nodes[k].op.name) for k in shown}
    visible = [e for e in graph.edges if (e.src[0], e.src[1]) in rows and (e.dst[0], e.dst[1]) in rows]
    kinds = {e.kind for e in visible}
    has_barrier = any(sum(1 for k in g if (k[0], k[1]) in rows) > 1 for g in graph.barriers)
    has_pipe = any(graph.nodes[k].pipeline is not None for k in shown)
    n_handles = len(fams - {"pipeline"}) + len(kinds) + has_barrier + has_pipe
    legend_cols = max(1, min(n_handles, int((width_in - _LEFT_IN - 0.3) / 1.45)))
    legend_h = 0.17 * -(-n_handles // legend_cols)
    key_chars = min(220, int((width_in - _LEFT_IN - 0.3) / 0.047))
    key = _key_lines({graph.nodes[k].op.name for k in shown}, key_chars) if labels else []
    header_h = 0.42 + legend_h + 0.05 + 0.125 * len(key) + 0.2

    max_h_in = max(header_h + panel_h + 0.4, max_height_px / dpi)
    pages: list[list[_Panel]] = [[]]
    used = header_h
    for p in panels:
        need = panel_h + (_PANEL_GAP_IN if pages[-1] else 0.0)
        if pages[-1] and used + need > max_h_in - 0.4:
            pages.append([])
            used, need = header_h, panel_h
        pages[-1].append(p)
        used += need

    out = Path(path)
    paths = [out] + [out.with_name(f"{out.stem}-{k}{out.suffix or '.png'}") for k in range(2, len(pages) + 1)]
    if title is None:
        extras = [f"{len(plan.gpus)} ranks", plan.protocol, "in place" if plan.inplace else "out of place"]
        if len(shown_ranks) < len(plan.gpus):
            extras.append("ranks " + ",".join(str(r) for r in shown_ranks))
        if not graph.acyclic:
            extras.append("CYCLE: ops drawn at their op index")
        if auto_off:
            extras.append(f"labels left out ({n_shown} ops): draw fewer ranks or blocks to see them")
        if timed is not None:
            extras.append(f"timed: {timed.total_us:.2f} us, critical path in red")
        title = f"{plan.name} ({plan.collective}): " + ", ".join(extras)

    sizes: list[tuple[int, int]] = []
    text_boxes: list[list[tuple[str, tuple[float, float, float, float]]]] = []
    for pg, page in enumerate(pages):
        height_in = header_h + sum(panel_h for _ in page) + _PANEL_GAP_IN * (len(page) - 1) + 0.45
        dpi_eff = max(20, min(dpi, int(16000 / max(width_in, height_in))))
        fig = Figure(figsize=(width_in, height_in), dpi=dpi_eff)
        FigureCanvasAgg(fig)
        page_title = title
        if len(pages) > 1:
            page_title += f" (page {pg + 1} of {len(pages)}: steps {page[0].x0:g}-{page[-1].x1:g})"
        fig.text(_LEFT_IN / width_in, 1 - 0.08 / height_in, page_title, fontsize=9, fontweight="bold",
                 va="top", ha="left")
        _legend(fig, width_in, height_in, fams, kinds, has_barrier, has_pipe, legend_cols)
        top_in = 0.42 + legend_h + 0.05
        for line in key:
            fig.text(_LEFT_IN / width_in, 1 - top_in / height_in, line, fontsize=6, va="top", ha="left",
                     color="#333333")
            top_in += 0.125
        y_in = header_h  # from the top
        for p in page:
            ax_bottom = height_in - y_in - rows_h
            ax = fig.add_axes((_LEFT_IN / width_in, ax_bottom / height_in,
                               (width_in - _LEFT_IN - _RIGHT_IN) / width_in, rows_h / height_in))
            p.ax = ax
            y_in += panel_h + _PANEL_GAP_IN
            _draw_panel(fig, ax, graph, plan, p, cuts, rows, bands, bottom, labels,
                        (width_in - _LEFT_IN - _RIGHT_IN) / col_in, timed)
        caption = ("time (us) from the trace; a box spans its op, a wait as long as it waited"
                   if timed is not None else
                   "step: earliest time each op can start (after its block's previous op and the ops it "
                   "waits for)" if graph.acyclic else "op index (the dependency graph has a cycle)")
        fig.text(_LEFT_IN / width_in, 0.12 / height_in, caption, fontsize=7, va="bottom", ha="left")
        _draw_edges(graph, visible, rows, bottom, cuts, panels, page, col_in, rows_h)
        try:
            fig.savefig(paths[pg], format="png", dpi=dpi_eff, pil_kwargs={"compress_level": 1})
        except OSError as e:
            raise MscclangError(f"cannot write {paths[pg]}: {e.strerror or e}") from None
        w, h = fig.canvas.get_width_height()
        sizes.append((int(w), int(h)))
        if measure_text:
            text_boxes.append(_text_boxes(fig))
    return PlanPicture(paths[0], sizes[0][0], sizes[0][1], shown_ranks, n_shown,
                       graph.edge_counts(), graph.acyclic, bool(labels), paths=paths, page_sizes=sizes,
                       panels=len(panels), text_boxes=text_boxes,
                       critical=sorted(timed.critical) if timed is not None else [])


def _panel_of(cuts: list[float], x: float) -> int:
    """Index of the panel that holds a box starting at step ``x``."""
    return min(max(bisect.bisect_right(cuts, x + 1e-9) - 1, 0), len(cuts) - 2)


def _legend(fig: "Figure", width_in: float, height_in: float, fams: set, kinds: set, has_barrier: bool,
            has_pipe: bool, ncol: int) -> None:
    """Op families, edge kinds, barriers and pipelines that appear in the picture."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, edgecolor="#333333", label=f) for f, c in FAMILY_COLORS.items() if f in fams]
    handles += [Line2D([0], [0], color=c, linestyle=st, label=f"{k} edge")
                for k, (c, st) in EDGE_STYLES.items() if k in kinds]
    if has_barrier:
        handles.append(Line2D([0], [0], color="black", linewidth=1.6, label="barrier"))
    if has_pipe:
        handles.append(Patch(facecolor="none", edgecolor="#555555", linestyle=":",
                             label="pipeline (ops i.0, i.1, ...)"))
    if handles:
        fig.legend(handles=handles, loc="upper left", ncol=ncol, fontsize=6, frameon=False,
                   borderaxespad=0.0, borderpad=0.0, columnspacing=1.2,
                   bbox_to_anchor=(_LEFT_IN / width_in, 1 - 0.36 / height_in))


def _panel_nodes(graph: PlanGraph, rows: dict, cuts: list[float], p: _Panel) -> list[OpNode]:
    return [n for k, n in graph.nodes.items() if (k[0], k[1]) in rows and _panel_of(cuts, n.x) == p.index]


def _draw_panel(fig: "Figure", ax: "Axes", graph: PlanGraph, plan: Plan, p: _Panel, cuts: list[float],
                rows: dict[tuple[int, int], float], bands: list[tuple[int, float, float]], bottom: float,
                labels: bool, steps_wide: float, timed: Any = None) -> None:
    """Rows, bands, boxes, labels, pipeline brackets and barriers of one panel (``timed``: the
    axis in microseconds and the critical path outlined)."""
    from matplotlib.collections import PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle
    from matplotlib.transforms import ScaledTranslation

    x_lo, x_hi = p.x0 - 0.3, p.x0 - 0.3 + steps_wide
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(bottom - 0.2, 0.7)
    ax.set_yticks([])
    ax.tick_params(axis="x", labelsize=6, pad=1.5)
    if timed is not None:
        from matplotlib.ticker import FuncFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v * timed.us_per_step:.3g}"))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    # block and rank labels at fixed distances (inches) left of the axes, whatever its width
    ytrans = ax.get_yaxis_transform()
    tb_trans = ytrans + ScaledTranslation(-0.06, 0, fig.dpi_scale_trans)
    rank_trans = ytrans + ScaledTranslation(-0.42, 0, fig.dpi_scale_trans)
    every = 1 if len(rows) <= 96 else 8
    for (r, t), yy in rows.items():
        if t % every == 0:
            ax.text(0, yy, f"tb {t}", transform=tb_trans, ha="right", va="center", fontsize=6)
    for i, (r, top, bot) in enumerate(bands):
        ax.add_patch(Rectangle((x_lo, bot), x_hi - x_lo, top - bot,
                               facecolor="#f3f3f3" if i % 2 == 0 else "#ffffff", edgecolor="none", zorder=0))
        ax.text(0, (top + bot) / 2, f"rank {r}", transform=rank_trans, ha="right", va="center", fontsize=8,
                fontweight="bold")

    nodes = _panel_nodes(graph, rows, cuts, p)
    pipes: dict[tuple[int, int, int], list[OpNode]] = defaultdict(list)
    for node in nodes:
        if node.pipeline is not None:
            pipes[(node.rank, node.tb, node.pipeline)].append(node)
    for (r, t, _), members in pipes.items():
        x0 = min(m.x for m in members)
        x1 = max(m.x + m.width for m in members)
        yy = rows[(r, t)]
        # inner ops are labelled "i.j" (op j of pipeline i); the bracket groups them
        ax.add_patch(Rectangle((x0 - 0.08, yy - 0.45), x1 - x0 + 0.16, 0.9, facecolor="#fafafa",
                               edgecolor="#444444", linestyle=":", linewidth=0.9, zorder=1))

    boxes: list[list[tuple[float, float]]] = []
    fills: list[str] = []
    crit = timed.critical if timed is not None else frozenset()
    edges = ["#d62728" if node.key in crit else "#333333" for node in nodes]
    widths = [1.6 if node.key in crit else 0.5 for node in nodes]
    for node in nodes:
        yy = rows[(node.rank, node.tb)]
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
    ax.add_collection(PolyCollection(boxes, facecolors=fills, edgecolors=edges, linewidths=widths, zorder=2))

    for group in graph.barriers:
        members = [graph.nodes[k] for k in group if (k[0], k[1]) in rows]
        if len(members) < 2 or _panel_of(cuts, members[0].x) != p.index:
            continue
        xs = members[0].x + members[0].width / 2
        ys = [rows[(m.rank, m.tb)] for m in members]
        ax.add_line(Line2D([xs, xs], [min(ys), max(ys)], color="black", linewidth=1.6, alpha=0.7, zorder=4))


def _draw_edges(graph: PlanGraph, visible: list[Edge], rows: dict[tuple[int, int], float], bottom: float,
                cuts: list[float], panels: list[_Panel], page: list[_Panel], col_in: float,
                rows_h: float) -> None:
    """Edges as quadratic curves (computed in inches, so arrow heads keep their shape), one
    LineCollection per kind and panel. An edge between panels is drawn in two halves: out of the
    first panel's border, into the second's."""
    from matplotlib.collections import LineCollection, PolyCollection

    sx = 1.0 / col_in  # data units per inch
    sy = (0.9 - bottom) / rows_h
    alpha = max(0.2, min(0.8, 40.0 / max(len(visible), 1) ** 0.5 * 0.25))
    lw = 0.7 if len(visible) < 100 else 0.45
    on_page = {p.index for p in page}
    curves: dict[tuple[int, str], list] = defaultdict(list)
    heads: dict[tuple[int, str], list] = defaultdict(list)

    def curve(panel: int, kind: str, p0: tuple[float, float], p2: tuple[float, float], head: bool) -> None:
        p0 = (p0[0] / sx, p0[1] / sy)  # to inches
        p2 = (p2[0] / sx, p2[1] / sy)
        dx, dy = p2[0] - p0[0], p2[1] - p0[1]
        bend = 0.35 if abs(dy) < 1e-9 else 0.08
        ctrl = ((p0[0] + p2[0]) / 2 - dy * bend, (p0[1] + p2[1]) / 2 + dx * bend)
        pts = []
        for i in range(13):
            t = i / 12
            u = 1 - t
            pts.append(((u * u * p0[0] + 2 * u * t * ctrl[0] + t * t * p2[0]) * sx,
                        (u * u * p0[1] + 2 * u * t * ctrl[1] + t * t * p2[1]) * sy))
        curves[(panel, kind)].append(pts)
        if not head:
            return
        tx, ty = p2[0] - ctrl[0], p2[1] - ctrl[1]
        norm = max((tx * tx + ty * ty) ** 0.5, 1e-9)
        tx, ty = tx / norm, ty / norm
        hl, hw = 0.07, 0.025
        base = (p2[0] - tx * hl, p2[1] - ty * hl)
        heads[(panel, kind)].append([(p2[0] * sx, p2[1] * sy),
                                     ((base[0] - ty * hw) * sx, (base[1] + tx * hw) * sy),
                                     ((base[0] + ty * hw) * sx, (base[1] - tx * hw) * sy)])

    for e in visible:
        a, b = graph.nodes[e.src], graph.nodes[e.dst]
        ya, yb = rows[(a.rank, a.tb)], rows[(b.rank, b.tb)]
        i, j = _panel_of(cuts, a.x), _panel_of(cuts, b.x)
        start, end = (a.x + a.width, ya), (b.x, yb)
        if i == j:
            if i in on_page:
                curve(i, e.kind, start, end, True)
            continue
        forward = j > i
        lim_i = panels[i].ax.get_xlim() if i in on_page else (0.0, 0.0)
        lim_j = panels[j].ax.get_xlim() if j in on_page else (0.0, 0.0)
        if i in on_page:  # out of the source's panel, towards the destination's row
            curve(i, e.kind, start, (lim_i[1] if forward else lim_i[0], yb), False)
        if j in on_page:  # into the destination's panel, from the source's row
            curve(j, e.kind, (lim_j[0] if forward else lim_j[1], ya), end, True)

    for (panel, kind), segs in curves.items():
        ax = panels[panel].ax
        color, style = EDGE_STYLES[kind]
        ax.add_collection(LineCollection(segs, colors=color, linestyles=style, linewidths=lw, alpha=alpha,
                                         zorder=5))
        if heads.get((panel, kind)):
            ax.add_collection(PolyCollection(heads[(panel, kind)], facecolors=color, edgecolors="none",
                                             alpha=min(1.0, alpha + 0.2), zorder=5))


def _text_boxes(fig: "Figure") -> list[tuple[str, tuple[float, float, float, float]]]:
    """(text, (x0, y0, x1, y1) in pixels) of every non-empty text drawn on ``fig``."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    out = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip():
            continue
        bb = t.get_window_extent(renderer)
        out.append((t.get_text(), (float(bb.x0), float(bb.y0), float(bb.x1), float(bb.y1))))
    return out

