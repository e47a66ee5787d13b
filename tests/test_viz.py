"""Plan pictures (:mod:`mscclang.viz`, ``mscclang show --png``): every golden plan and the library's
plans render to valid PNGs of plausible size, and the drawn edges follow the plan semantics
(channel pairing, packet slots, semaphores, barriers, timeline order).

Default run: every golden plan at the default settings; every library plan's dependency graph
(edges, timeline order); every library plan drawn without labels. ``-m
slow`` draws every library plan at the default settings (2-3 minutes on 2 cores)."""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path

import pytest

from mscclang.dsl import CollectiveProgram, MemoryChannel, TestCollective
from mscclang.errors import PlanError
from mscclang.plan import load_plan
from mscclang.plan.models import OpName, Plan
from mscclang.viz import LABEL_LIMIT, PlanGraph, build_graph, draw_plan
from tests.harness.shipped import shipped_plan_files

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.json"))
LIBRARY = shipped_plan_files()

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; fails unless the file is a PNG."""
    head = path.read_bytes()[:33]
    assert head[:8] == PNG_MAGIC, f"{path} is not a PNG"
    length, kind = struct.unpack(">I4s", head[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", head[16:24])


def check_png(pic, min_bytes: int = 10_000, min_side: int = 100) -> None:
    assert pic.path.is_file()
    w, h = png_size(pic.path)
    assert (w, h) == (pic.width_px, pic.height_px)
    assert 4 * min_side <= w <= 16_000 and min_side <= h <= 16_000, (w, h)
    assert pic.path.stat().st_size > min_bytes


def flat_op_count(plan: Plan, ranks=None) -> int:
    n = 0
    for g in plan.gpus:
        if ranks is not None and g.id not in ranks:
            continue
        for tb in g.threadblocks:
            for op in tb.ops:
                n += len(op.ops) if op.name == OpName.pipeline and op.ops else 1
    return n


def check_timeline(graph: PlanGraph) -> None:
    """Ops of a block advance left to right; every edge points forward; barrier members align."""
    assert graph.acyclic
    for keys in graph.blocks.values():
        for a, b in zip(keys, keys[1:]):
            na, nb = graph.nodes[a], graph.nodes[b]
            assert nb.x >= na.x + na.width - 1e-9
    for e in graph.edges:
        a, b = graph.nodes[e.src], graph.nodes[e.dst]
        assert b.x >= a.x + a.width - 1e-9, e
    for group in graph.barriers:
        assert len({graph.nodes[k].x for k in group}) == 1


def _signal_wait_balance(plan: Plan, graph: PlanGraph) -> None:
    """Each wait on a memory/port channel end gets exactly one incoming signal edge per channel."""
    incoming = defaultdict(int)
    for e in graph.edges:
        if e.kind in ("signal", "relaxed"):
            incoming[e.dst] += 1
    for key, node in graph.nodes.items():
        if node.op.name in (OpName.wait, OpName.rlxwait):
            assert incoming[key] == len(node.op.channel_ids), (key, node.label)


# ------------------------------------------------------------------------------------------------
# golden plans


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_golden_plan_renders(path, tmp_path):
    plan = load_plan(path)
    pic = draw_plan(plan, tmp_path / "p.png")
    check_png(pic)
    assert pic.num_ops == flat_op_count(plan)
    assert pic.ranks == list(range(plan.world_size))
    assert pic.timeline and pic.labels == (pic.num_ops <= LABEL_LIMIT)


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_golden_graph_is_a_forward_timeline(path):
    plan = load_plan(path)
    graph = build_graph(plan)
    check_timeline(graph)
    _signal_wait_balance(plan, graph)


def _golden(name: str) -> Plan:
    return load_plan(ROOT / "tests" / "golden" / f"{name}.json")


def test_signal_wait_edges_of_op_signal():
    # rank 0: wait, put, signal; rank 1: signal, wait (with nops between)
    g = build_graph(_golden("op_signal"))
    edges = {(e.kind, g.nodes[e.src].rank, g.nodes[e.src].op.name.value, g.nodes[e.dst].rank,
              g.nodes[e.dst].op.name.value) for e in g.edges}
    assert edges == {("signal", 1, "signal", 0, "wait"), ("signal", 0, "signal", 1, "wait")}
    put = next(n for n in g.nodes.values() if n.op.name == OpName.put)
    wait1 = next(n for n in g.nodes.values() if n.op.name == OpName.wait and n.rank == 1)
    assert wait1.x > put.x  # rank 1's wait comes after rank 0's put in the timeline


def test_packet_edges_of_oneshot_allreduce():
    plan = _golden("prog_allreduce_ll_oneshot_2")
    g = build_graph(plan)
    packets = [e for e in g.edges if e.kind == "packet"]
    assert packets and all(e.kind == "packet" for e in g.edges)
    for e in packets:
        src, dst = g.nodes[e.src], g.nodes[e.dst]
        assert src.op.name == OpName.ppkt and src.rank != dst.rank
        assert dst.op.name in (OpName.repkt, OpName.respkt, OpName.recpkt, OpName.recspkt, OpName.upkt)
    # every packet reduction hears from the one peer
    readers = {e.dst for e in packets}
    assert readers == {k for k, n in g.nodes.items() if n.op.name == OpName.repkt}


def test_packet_edges_of_eight_rank_oneshot_reach_every_peer():
    g = build_graph(_golden("prog_allreduce_ll_oneshot_8"))
    senders = defaultdict(set)
    for e in g.edges:
        senders[e.dst].add(e.src[0])
    assert len(senders) == 8 * 8  # 8 reducing blocks on each of 8 ranks
    for dst, ranks in senders.items():
        assert ranks == set(range(8)) - {dst[0]}


def test_semaphore_and_barrier_edges():
    g = build_graph(_golden("op_sem_acquire"))
    (e,) = [e for e in g.edges if e.kind == "semaphore"]
    assert g.nodes[e.src].op.name == OpName.sem_release and g.nodes[e.dst].op.name == OpName.sem_acquire
    # tb 0 copies into o[0:1] before the release; tb 1 copies o[0:1] after the acquire
    (d,) = [e for e in g.edges if e.kind == "data"]
    assert (d.src, d.dst) == ((0, 0, 0), (0, 1, 3))
    g = build_graph(_golden("op_barrier"))
    assert len(g.barriers) == 1 and len(g.barriers[0]) == 2
    a, b = (g.nodes[k] for k in g.barriers[0])
    assert a.x == b.x and {a.tb, b.tb} == {0, 1}


def _two_channel_program(swap: bool) -> Plan:
    """Two memory channels between ranks 0 and 1; rank 0 signals through its j-th channel from
    block j, rank 1 waits on its channel j in block (1 - j if swap else j)."""
    prog = CollectiveProgram("pairing", TestCollective(2, 1, 1), 2)
    with prog:
        c01 = [MemoryChannel(1, 0), MemoryChannel(1, 0)]
        c10 = [MemoryChannel(0, 1), MemoryChannel(0, 1)]
        for j in range(2):
            c01[j].signal(tb=j, relaxed=True)
            c10[j].wait(tb=(1 - j) if swap else j, relaxed=True)
        for j in range(2):
            c10[j].signal(tb=j, relaxed=True)
            c01[j].wait(tb=j, relaxed=True)
    return prog.to_plan()


@pytest.mark.parametrize("swap", [False, True])
def test_channels_pair_by_position_per_peer(swap):
    plan = _two_channel_program(swap)
    g = build_graph(plan)
    edges = sorted((e.src, e.dst) for e in g.edges if e.src[0] == 0 and e.dst[0] == 1)
    assert len(edges) == 2
    for (sr, stb, _), (dr, dtb, _) in edges:
        assert dtb == ((1 - stb) if swap else stb)


def test_a_deadlocking_plan_is_drawn_at_op_indexes(tmp_path):
    # both ranks wait before they signal: the happens-before graph has a cycle
    data = json.loads((ROOT / "tests" / "golden" / "op_signal.json").read_text())
    ops0 = data["gpus"][0]["threadblocks"][0]["ops"]
    ops1 = data["gpus"][1]["threadblocks"][0]["ops"]
    i_sig = next(i for i, o in enumerate(ops1) if o["name"] == "signal")
    i_wait = next(i for i, o in enumerate(ops1) if o["name"] == "wait")
    ops1[i_sig], ops1[i_wait] = ops1[i_wait], ops1[i_sig]
    assert next(i for i, o in enumerate(ops0) if o["name"] == "wait") < \
        next(i for i, o in enumerate(ops0) if o["name"] == "signal")
    plan = load_plan(data)
    g = build_graph(plan)
    assert not g.acyclic
    pic = draw_plan(plan, tmp_path / "cycle.png")
    assert not pic.timeline
    check_png(pic)


def test_rank_and_block_selection(tmp_path):
    plan = _golden("prog_allreduce_ll_twostep_8")
    pic = draw_plan(plan, tmp_path / "r3.png", ranks=[3])
    check_png(pic)
    assert pic.ranks == [3] and pic.num_ops == flat_op_count(plan, ranks={3})
    pic = draw_plan(plan, tmp_path / "r3t0.png", ranks=[3, 5], tbs=[0])
    assert pic.num_ops == sum(len(plan.gpus[r].threadblocks[0].ops) for r in (3, 5))
    with pytest.raises(PlanError, match="rank 9"):
        draw_plan(plan, tmp_path / "bad.png", ranks=[9])


def test_labels_can_be_forced_off_and_pyplot_is_untouched(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    plan = _golden("prog_allgather_simple_8")
    with_labels = draw_plan(plan, tmp_path / "a.png")
    without = draw_plan(plan, tmp_path / "b.png", labels=False)
    assert with_labels.labels and not without.labels
    assert with_labels.path.stat().st_size > without.path.stat().st_size  # the text is drawn
    assert matplotlib.get_backend() == backend


def test_cli_show_png(tmp_path, capsys):
    from mscclang.cli.main import main

    out = tmp_path / "plan.png"
    plan_file = ROOT / "tests" / "golden" / "prog_allreduce_ll_twostep_2.json"
    assert main(["show", str(plan_file), "--png", str(out)]) == 0
    text = capsys.readouterr().out
    assert str(out) in text and "rank 0" not in text  # the picture replaces the text listing
    w, h = png_size(out)
    assert w >= 400 and h >= 100 and out.stat().st_size > 10_000
    assert main(["show", str(plan_file), "--png", str(tmp_path / "no" / "such" / "dir.png")]) == 1
    assert "cannot write" in capsys.readouterr().err


def test_an_8_rank_8_block_plan_is_readable(tmp_path):
    """8 ranks x 8 blocks: labels on, at least 0.3 inch of picture per block row at 120 dpi."""
    plan = _golden("prog_allreduce_ll_oneshot_8")
    pic = draw_plan(plan, tmp_path / "p.png")
    assert max(len(g.threadblocks) for g in plan.gpus) == 8
    assert pic.labels
    rows = sum(len(g.threadblocks) for g in plan.gpus)
    dpi = 120
    assert pic.height_px / dpi >= rows * 0.3
    check_png(pic, min_bytes=100_000)


# ------------------------------------------------------------------------------------------------
# the library (plans/, when generated)


@pytest.fixture(scope="module")
def library(shipped_plans) -> list[tuple[Path, Plan]]:
    return [(path, load_plan(path, check=False)) for path in shipped_plans]


#: plans the fast render test draws: every collective's first plan, plus the largest plan
SAMPLE_RENDERS = 8


def _render_sample(library: list[tuple[Path, Plan]]) -> list[tuple[Path, Plan]]:
    """A small spread of the library: the first plan of each collective and protocol, and the plan
    with the most ops (at most :data:`SAMPLE_RENDERS` plans)."""
    firsts: dict[tuple[str, str], tuple[Path, Plan]] = {}
    for path, plan in library:
        firsts.setdefault((plan.collective, plan.protocol), (path, plan))
    pick = list(firsts.values())[:SAMPLE_RENDERS - 1]
    biggest = max(library, key=lambda item: flat_op_count(item[1]))
    if biggest not in pick:
        pick.append(biggest)
    return pick


def test_a_sample_of_library_plans_renders_without_labels(library, tmp_path):
    """A few shipped plans render (labels off, low dpi); ``-m slow`` draws every one."""
    sample = _render_sample(library)
    assert 1 <= len(sample) <= SAMPLE_RENDERS
    for path, plan in sample:
        pic = draw_plan(plan, tmp_path / f"{path.stem}.png", labels=False, dpi=60)
        check_png(pic, min_bytes=3_000, min_side=60)
        assert pic.num_ops == flat_op_count(plan), path.name


def test_library_graphs_are_forward_timelines(library):
    for path, plan in library:
        graph = build_graph(plan)
        check_timeline(graph)
        _signal_wait_balance(plan, graph)
        assert len(graph.nodes) == flat_op_count(plan), path.name


@pytest.mark.slow
def test_every_library_plan_renders_without_labels(library, tmp_path):
    """Every shipped plan renders (labels off and a low dpi: text dominates the time; the golden
    plans cover labelled pictures of every op kind). ``-m slow`` draws every plan with labels."""
    for path, plan in library:
        pic = draw_plan(plan, tmp_path / f"{path.stem}.png", labels=False, dpi=60)
        check_png(pic, min_bytes=3_000, min_side=60)
        assert pic.num_ops == flat_op_count(plan), path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.stem)
def test_every_library_plan_renders(path, tmp_path):
    plan = load_plan(path)
    pic = draw_plan(plan, tmp_path / "p.png")
    check_png(pic)
    assert pic.num_ops == flat_op_count(plan)


# ------------------------------------------------------------------------------------------------
# long plans: wrapped, paged, readable


@pytest.fixture(scope="module")
def ring8() -> Plan:
    """An 8-rank ring allreduce: 75 ops per rank on one thread block (one 7512 px strip before)."""
    from mscclang.cli.compile_cmd import compile_file

    plan = compile_file(ROOT / "tests" / "programs" / "allreduce_ring.py", ["--num_gpus", "8"])
    assert all(flat_op_count(plan, ranks={r}) == 75 for r in range(8))
    return plan


def _overlaps(boxes, slack: float = 0.5) -> list[tuple[str, str]]:
    """Pairs of texts whose pixel boxes intersect (by more than ``slack`` px each way)."""
    found = []
    items = sorted(boxes, key=lambda b: b[1][0])
    for i, (ta, (ax0, ay0, ax1, ay1)) in enumerate(items):
        for tb, (bx0, by0, bx1, by1) in items[i + 1:]:
            if bx0 >= ax1 - slack:
                break  # sorted by left edge: no later box reaches back
            if min(ay1, by1) - max(ay0, by0) > slack:
                found.append((ta, tb))
    return found


def test_a_long_plan_wraps_into_rows_of_bounded_width(ring8, tmp_path):
    pic = draw_plan(ring8, tmp_path / "ring.png", measure_text=True)
    check_png(pic)
    assert pic.width_px <= 3000 and pic.panels >= 2 and pic.paths == [pic.path]
    assert pic.labels and pic.num_ops == 600
    (boxes,) = pic.text_boxes
    texts = [t for t, _ in boxes]
    # every op but the nops carries its label, exactly once, each fitting its box (0.8 inch)
    for r in range(8):
        assert texts.count(f"rank {r}") == pic.panels
    labelled = [t for t in texts if "\n" in t]  # "k name\ndetail"; every op of this plan has a detail
    assert len(labelled) == sum(1 for g in ring8.gpus for op in g.threadblocks[0].ops if op.name != OpName.nop)
    for t, (x0, _, x1, _) in boxes:
        if t in labelled:
            assert x1 - x0 <= 0.8 * 120, t
    assert _overlaps(boxes) == []


def test_labels_of_the_old_layout_would_have_overlapped():
    """The check above can fail: two texts drawn on top of each other are reported."""
    a = ("rank 0", (10.0, 10.0, 60.0, 20.0))
    b = ("tb 0", (50.0, 12.0, 70.0, 18.0))
    c = ("tb 1", (50.0, 30.0, 70.0, 40.0))
    assert _overlaps([a, b, c]) == [("rank 0", "tb 0")]


def test_every_page_of_a_paged_plan(ring8, tmp_path):
    pic = draw_plan(ring8, tmp_path / "ring.png", max_width_px=1500, max_height_px=1200, measure_text=True)
    assert len(pic.paths) >= 3 and pic.paths[0] == tmp_path / "ring.png"
    assert [p.name for p in pic.paths[1:3]] == ["ring-2.png", "ring-3.png"]
    for path, (w, h), boxes in zip(pic.paths, pic.page_sizes, pic.text_boxes):
        assert png_size(path) == (w, h)
        assert w <= 1500 and h <= 1200, (path, w, h)
        assert _overlaps(boxes) == []
        texts = " ".join(t for t, _ in boxes)
        assert "Box labels:" in texts and "put = write into a peer's buffer" in texts  # the key, per page
        assert "page " in texts
    # every op is drawn once over all pages
    labels = [t for boxes in pic.text_boxes for t, _ in boxes if "\n" in t]
    assert len(labels) == 8 * sum(1 for op in ring8.gpus[0].threadblocks[0].ops if op.name != OpName.nop)


def test_wrapped_edges_leave_and_enter_at_the_panel_borders(ring8, tmp_path):
    from mscclang.viz.draw import _cuts

    graph = build_graph(ring8)
    pic = draw_plan(ring8, tmp_path / "ring.png", labels=False)
    cuts = _cuts(graph, list(graph.nodes), graph.span, 8.0)
    assert len(cuts) > 3 and cuts == sorted(cuts)
    for c in cuts[1:-1]:  # no box is cut in two
        assert not any(n.x < c - 1e-9 < c + 1e-9 < n.x + n.width for n in graph.nodes.values())
    assert pic.panels >= 2


def test_data_edges_follow_the_ring(ring8):
    """Each put/res into the next rank's buffer -> the op of the next rank that reads it."""
    g = build_graph(ring8)
    data = [e for e in g.edges if e.kind == "data"]
    # 7 reduce-scatter steps + 6 allgather forwards (the last one's chunk is not read again), per rank
    assert len(data) == 8 * 13
    for e in data:
        a, b = g.nodes[e.src], g.nodes[e.dst]
        assert b.rank == (a.rank + 1) % 8
        assert a.op.name in (OpName.put, OpName.res) and b.op.name in (OpName.res, OpName.put)
        assert b.x >= a.x + a.width
    check_timeline(g)


def test_cli_show_png_of_a_long_plan(ring8, tmp_path, capsys):
    from mscclang.cli.main import main
    from mscclang.plan import plan_to_json

    f = tmp_path / "ring.json"
    f.write_text(plan_to_json(ring8))
    assert main(["show", str(f), "--png", str(tmp_path / "ring.png")]) == 0
    out = capsys.readouterr().out
    assert "timeline wrapped into" in out
    w, _ = png_size(tmp_path / "ring.png")
    assert w <= 3000
