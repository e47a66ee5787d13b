"""The cost model (mscclang.sim.cost, ``mscclang predict``): a predicted timeline per op for
shipped plans, its Chrome trace, topologies, refusals, and its error against bench files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mscclang.errors import PlanError
from mscclang.plan.io import load_plan
from mscclang.sim import cost

ROOT = Path(__file__).resolve().parent.parent


def _plan(name: str):
    f = ROOT / "plans" / f"{name}.json"
    if not f.is_file():
        pytest.skip("the shipped plans are not here")
    return load_plan(f)


@pytest.mark.parametrize("name", ["allreduce_oneshot_ll.r2.i1.inplace", "allreduce_rsag_zero_copy.r2.i32.inplace",
                                  "allgather_ll.r2.i4", "reducescatter_zero_copy.r2.i32", "alltoall_ll.r2.i4",
                                  "allreduce_rsag_zero_copy.r4.i16.inplace"])
def test_every_op_gets_an_interval_in_plan_order(name):
    plan = _plan(name)
    coll = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter"}.get(
        plan.collective, "all_to_all")
    pred = cost.predict(plan, *cost.call_sizes(coll, plan.world_size << 20, plan.world_size))
    n_ops = sum(len(tb.ops) for g in plan.gpus for tb in g.threadblocks)
    assert len(pred.ops) == n_ops
    assert pred.total_us > cost.calibrated().launch_us
    for g in plan.gpus:
        for tb in g.threadblocks:
            mine = [o for o in pred.ops if o.rank == g.id and o.tb == tb.id]
            assert [o.index for o in mine] == list(range(len(tb.ops)))
            assert all(a.end_us <= b.start_us + 1e-9 for a, b in zip(mine, mine[1:]))   # sequential
            assert all(o.end_us >= o.start_us for o in mine)
    tr = pred.chrome_trace()
    json.dumps(tr)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == set(range(plan.world_size)) and len(xs) == n_ops


@pytest.mark.parametrize("name,topo", [("allgather_port.r4.i1", "nvlink"),
                                       ("allgather_hierarchical.r4.i4.gpus_per_node2", "2x2")])
def test_port_plans_finish_their_puts_with_signal(name, topo):
    """Found by the model's first run: a put with signal (pws/pwsf) signals its peer; the model
    left the peer's wait unsatisfied and called the plan stuck."""
    plan = _plan(name)
    pred = cost.predict(plan, 1 << 20, 4 << 20, cost.load_topology(topo, 4))
    assert pred.total_us > 0 and len(pred.ops) == sum(len(tb.ops) for g in plan.gpus for tb in g.threadblocks)


def test_bigger_messages_take_longer_and_more_ranks_share_the_links():
    plan = _plan("allreduce_rsag_zero_copy.r2.i32.inplace")
    t = [cost.predict(plan, n, n).total_us for n in (1 << 16, 1 << 20, 1 << 24, 1 << 28)]
    assert t == sorted(t) and t[-1] > 100 * t[0] / 10
    # the large-message time is the link: twice the bandwidth, about half the time
    m = cost.calibrated()
    fast = cost.Topology(2, 1, cost.CostModel(**{**cost.model_dict(m), "link_gbps": 2 * m.link_gbps,
                                                  "block_gbps": 1e4}))
    slow = cost.Topology(2, 1, cost.CostModel(**{**cost.model_dict(m), "block_gbps": 1e4}))
    a, b = cost.predict(plan, 1 << 28, 1 << 28, slow).total_us, cost.predict(plan, 1 << 28, 1 << 28, fast).total_us
    assert 0.4 < b / a < 0.6


def test_a_wait_that_no_signal_satisfies_is_refused_with_where():
    plan = _plan("allreduce_rsag_zero_copy.r2.i32.inplace")
    bad = plan.model_copy(deep=True)
    tb = bad.gpus[1].threadblocks[0]
    tb.ops = [o for o in tb.ops if o.name.value not in ("signal", "rlxsignal")]   # rank 1 never signals
    with pytest.raises(PlanError, match=r"rank 0 thread block 0 op \d+"):
        cost.predict(bad, 1 << 20, 1 << 20)


def test_topologies():
    assert cost.load_topology("nvlink", 4).gpus_per_node == 4
    t = cost.load_topology("2x4", 8)
    assert (t.nodes, t.gpus_per_node) == (2, 4) and not t.same_node(3, 4) and t.same_node(4, 7)
    with pytest.raises(PlanError, match="8 ranks"):
        cost.load_topology("2x2", 8)
    with pytest.raises(PlanError, match="not 'nvlink'"):
        cost.load_topology("/nonexistent/topo.json", 2)


def test_topology_file_overrides_the_rates(tmp_path):
    f = tmp_path / "topo.json"
    f.write_text(json.dumps({"gpus_per_node": 2, "model": {"link_us": 10.0}}))
    plan = _plan("allreduce_oneshot_ll.r2.i1.inplace")
    slow = cost.predict(plan, 1024, 1024, cost.load_topology(str(f), 2)).total_us
    assert slow > cost.predict(plan, 1024, 1024).total_us
    f.write_text(json.dumps({"gpus_per_node": 2, "model": {"warp_speed": 1}}))
    with pytest.raises(PlanError, match="warp_speed"):
        cost.load_topology(str(f), 2)


def test_error_table_against_a_bench_file(tmp_path):
    rows = [{"coll": "all_reduce", "impl": "mscclang", "mode": "graph", "bytes": 1024, "us": 2.0, "ok": True,
             "plan": "allreduce_oneshot_ll.r2.i1.inplace (direct)"},
            {"coll": "all_reduce", "impl": "nccl", "mode": "graph", "bytes": 1024, "us": 9.0, "ok": True},
            {"coll": "all_reduce", "impl": "mscclang", "mode": "graph", "bytes": 1 << 24, "us": 60.0, "ok": True,
             "plan": "allreduce_rsag_zero_copy.r2.i32.inplace (direct)"},
            {"coll": "all_reduce", "impl": "mscclang", "mode": "eager", "bytes": 1024, "us": 9.0, "ok": True,
             "plan": "allreduce_oneshot_ll.r2.i1.inplace (direct)"}]
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"format": "x", "meta": {"world_size": 2}, "results": rows}))
    br = cost.bench_rows(f)
    assert [(r.nbytes, r.us) for r in br] == [(1024, 2.0), (1 << 24, 60.0)]   # mscclang, graph only
    errs = cost.errors(br, ROOT / "plans", cost.calibrated())
    table = {(t["collective"], t["sizes"]): t for t in cost.error_table(errs)}
    assert table[("all", "all")]["rows"] == 2
    assert table[("all_reduce", "<= 64 KiB")]["rows"] == 1 and table[("all_reduce", "> 4 MiB")]["rows"] == 1
    one = errs[0]
    assert one.error == pytest.approx((one.predicted_us - 2.0) / 2.0)


def test_cli(tmp_path):
    plan = ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json"
    if not plan.is_file():
        pytest.skip("the shipped plans are not here")
    trace = tmp_path / "t.json"
    p = subprocess.run([sys.executable, "-m", "mscclang", "predict", str(plan), "--size", "4K,1M", "--trace", str(trace),
                        "--ops"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "predicted" in p.stdout and "rank 0 tb" in p.stdout
    assert json.loads(trace.read_text())["traceEvents"]
    p = subprocess.run([sys.executable, "-m", "mscclang", "predict", str(plan), "--topology", "3x3"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and "mscclang predict:" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "mscclang", "predict"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 1 and p.stderr.startswith("mscclang predict: error: give a plan")


def test_tune_ranks_candidates_by_prediction_and_writes_nothing(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mscclang", "tune", "--dry-run", "--predict", "--no-extra",
                        "--collectives", "allreduce", "--sizes", "1K,64M", "--ranks", "2",
                        "-o", str(tmp_path / "t.json")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("predicted allreduce")]
    assert len(lines) == 2 and all(" us" in ln for ln in lines)
    assert "oneshot" in lines[0]   # the small size: a one-shot LL plan is predicted fastest
    # seen: "allreduce_rsag_zero_copy i16 t1024 206.7 us, allreduce_rsag_zero_copy i16 t1024 206.7 us"
    # (the in-place and the out-of-place plan, unlabelled): every candidate says which it is
    for ln in lines:
        names = [c.rsplit(" ", 2)[0] for c in ln.split(": ", 1)[1].split(", ")]
        assert all(n.endswith((" in place", " out of place")) for n in names) and len(set(names)) == len(names), ln
    assert not (tmp_path / "t.json").exists()


def test_rank_by_prediction_orders_the_candidates():
    from mscclang.comm.catalog import Catalog, default_plans_dir
    from mscclang.comm.tune import rank_by_prediction

    d = default_plans_dir()
    if d is None or not Path(d).is_dir():
        pytest.skip("the shipped plans are not installed")
    ranked = rank_by_prediction(Catalog.from_dir(d), "allreduce", 2, 1 << 20)
    assert len(ranked) > 3 and [p.us for p in ranked] == sorted(p.us for p in ranked)


# ------------------------------------------------------- placements the GPU runtime refuses

def _layouts(world: int) -> list[tuple[int, int]]:
    return [(world // g, g) for g in range(1, world + 1) if world % g == 0]


def test_prediction_refuses_what_the_runtime_refuses_with_its_message(shipped_plans):
    """Seen: a memory-channel plan on 2x1 was predicted at 37.18 us, an 8-rank ring on 2x4 at
    1804.53 us; the runtime refuses both. Every shipped plan on every node layout of its ranks:
    where the runtime's rule (check_runnable, the load-time check) refuses the plan, the model
    refuses it with the runtime's own message."""
    from mscclang.runtime.device_plan import check_runnable
    from mscclang.runtime.topology import Topology as Layout

    refused = 0
    for f in shipped_plans:
        plan = load_plan(f)
        for nodes, gpn in _layouts(plan.world_size):
            try:
                check_runnable(plan, allow_switch=True, topology=Layout(plan.world_size, gpn))
            except PlanError as e:
                if "nodes" not in e.message:
                    continue   # refused for a reason of its own, not the layout
                with pytest.raises(PlanError) as got:
                    cost.predict(plan, 1 << 20, 1 << 20, cost.load_topology(f"{nodes}x{gpn}", plan.world_size))
                assert e.message in got.value.message and got.value.path == e.path, (f.name, nodes, gpn)
                assert f"on {nodes} x {gpn} GPUs" in got.value.message
                refused += 1
    assert refused > 100   # the quoted cases among them
    with pytest.raises(PlanError, match="memory channel needs the peer's memory mapped"):
        cost.predict(_plan("allgather_ll.r8.i1"), 1 << 17, 1 << 20, cost.load_topology("2x4", 8))


def test_tune_ranks_only_placements_the_runtime_takes():
    from mscclang.comm.catalog import Catalog, default_plans_dir
    from mscclang.comm.tune import rank_by_prediction

    d = default_plans_dir()
    if d is None or not Path(d).is_dir():
        pytest.skip("the shipped plans are not installed")
    ranked = rank_by_prediction(Catalog.from_dir(d), "allgather", 4, 1 << 20, "2x2")
    assert ranked and all("hierarchical" in p.label for p in ranked), [p.label for p in ranked]


# ----------------------------------------------------------------------- --topology grammar

@pytest.mark.parametrize("spec,needle", [
    ("0x2", "0 nodes of 2 GPUs"), ("2x0", "2 nodes of 0 GPUs"), ("3x3", "3 x 3 = 9 GPUs"),
    ('{"nodes": 1}', "topology FILE: gpus_per_node: Field required"),
    ("[2]", "topology FILE: $: Input should be an object"),
    ('{"gpus_per_node": 2, "model": 3}', "topology FILE: model: Input should be an object"),
    ('{"gpus_per_node": "2"}', "topology FILE: gpus_per_node: Input should be a valid integer"),
    ('{"gpus_per_node": true}', "topology FILE: gpus_per_node: Input should be a valid integer"),
    ('{"gpus_per_node": 0}', "topology FILE: gpus_per_node: Input should be greater than or equal to 1"),
    ('{"gpus_per_node": 2, "nodes": 1.5}', "topology FILE: nodes: Input should be a valid integer"),
    ('{"gpus_per_node": 2, "model": {"link_us": "fast"}}', "topology FILE: model.link_us: Input should be a valid number"),
    ('{"gpus_per_node": 2, "model": {"link_us": -1}}', "model.link_us: Input should be greater than or equal to 0"),
    ('{"gpus_per_node": 2, "model": {"warp": 1}}', "model.warp: Input should be 'link_gbps'"),
    ('{"gpus_per_node": 2, "racks": 1}', "topology FILE: racks: Extra inputs are not permitted"),
    ("{", "topology FILE: $: Invalid JSON"),
])
def test_a_bad_topology_is_named(tmp_path, spec, needle):
    if not spec[0].isdigit():
        f = tmp_path / "topo.json"
        f.write_text(spec)
        spec, needle = str(f), needle.replace("FILE", str(f))
    with pytest.raises(PlanError) as e:
        cost.load_topology(spec, 2)
    assert needle in str(e.value)
    assert "KeyError" not in str(e.value) and "Traceback" not in str(e.value)


def test_topology_names_are_case_insensitive():
    assert cost.load_topology("NVLink", 4).gpus_per_node == 4
    t = cost.load_topology(" 2X2 ", 4)
    assert (t.nodes, t.gpus_per_node) == (2, 2)


def test_predict_states_the_launch_in_its_total(capsys):
    """predict printed 39.34 us where `show --trace` of its trace drew 38.74 us: the total holds
    the launch, the picture spans the ops. The line says so, with both figures."""
    from mscclang.cli.main import main

    plan = _plan("allreduce_oneshot_ll.r2.i1.inplace")
    pred = cost.predict(plan, 1 << 20, 1 << 20)
    launch = cost.calibrated().launch_us
    span = max(o.end_us for o in pred.ops) - min(o.start_us for o in pred.ops)
    assert main(["predict", str(ROOT / "plans" / f"{plan.name}.json"), "--size", "1M"]) == 0
    line = capsys.readouterr().out.strip()
    assert f"predicted {pred.total_us:.2f} us (the {launch:.2f} us launch, then {span:.2f} us" in line
    assert "show --trace" in line
