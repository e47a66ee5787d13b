"""The library of collective algorithms: generation of plans/ and verification in the simulator.

Fast tests (CI): ``generate --check`` passes against the committed plans/, the index matches the
plans, every shipped plan verifies (deadlock, races, numeric and symbolic postcondition) at one
small and one odd size with two schedules, and a few structural properties of the programs.
``-m slow``: the full sweep (more sizes, ten schedules, every dtype, reduce op and packet type,
non-shipped rank counts and pipelines with many iterations).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from mscclang.algorithms import ALGORITHMS, build
from mscclang.algorithms.generate import (
    check_files,
    generate_files,
    render_plan,
    variant_stem,
    write_files,
)
from mscclang.cli.main import main as generate_main
from mscclang.algorithms.index import INDEX_FILE, default_plans_dir, load_index, select
from mscclang.errors import DSLError, MscclangError
from mscclang.plan.io import load_plan
from mscclang.plan.collectives import collective
from mscclang.plan.models import ChannelType, OpName, Plan
from mscclang.sim import default_sizes, verify

PLANS = default_plans_dir()


def _index_entries() -> list[dict]:
    try:
        return load_index(PLANS)
    except MscclangError:
        return []


ENTRIES = _index_entries()


@lru_cache(maxsize=None)
def _shipped_plan(fname: str) -> Plan:
    """A plan of plans/, parsed once per test session (the index test and the verification of
    each plan read the same files; nothing here modifies a plan)."""
    return load_plan(PLANS / fname)


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return generate_files()


def _small_sizes(plan: Plan) -> list[int]:
    """One small size where every chunk is one alignment unit and one odd size whose last chunk
    is short (the simulator's own choice, ignoring the plan's suggested minimum size)."""
    return default_sizes(plan.model_copy(update={"min_message_size": 0}))[:2]


def _problems(rep) -> str:
    return "\n".join(f"{p.kind} [{p.context}]: {p.message}" for p in rep.problems[:5])


# -- generation -------------------------------------------------------------------------------

def test_generate_check_passes(generated: dict[str, str]) -> None:
    problems = check_files(PLANS, generated)
    assert problems == [], "plans/ is stale; run `mscclang generate-plans`:\n" + "\n".join(problems)


def test_generation_is_deterministic(generated: dict[str, str]) -> None:
    a = generate_files(only=["broadcast_ll", "sendrecv_simple"])
    plans = {f: t for f, t in a.items() if f != INDEX_FILE}
    assert plans and plans == {f: generated[f] for f in plans}
    # and building twice in one process gives the same plan text
    p1 = build("allreduce_twostep_ll", 4)
    p2 = build("allreduce_twostep_ll", 4)
    assert render_plan(p1) == render_plan(p2)


def test_check_reports_missing_differing_and_stale(tmp_path: Path) -> None:
    files = generate_files(only=["sendrecv_ll"])
    assert check_files(tmp_path, files) == [f"missing: {tmp_path / f}" for f in sorted(files)]
    write_files(tmp_path, files)
    assert check_files(tmp_path, files) == []
    victim = sorted(f for f in files if f != INDEX_FILE)[0]
    doc = json.loads((tmp_path / victim).read_text())
    doc["gpus"][1]["threadblocks"][0]["ops"][0]["name"] = "put"
    (tmp_path / victim).write_text(json.dumps(doc))
    (tmp_path / "old_plan.r2.i1.json").write_text("{}")
    problems = check_files(tmp_path, files)
    assert any(p.startswith(f"differs: {tmp_path / victim}") and "$.gpus[1].threadblocks[0].ops[0].name" in p
               for p in problems), problems
    assert f"stale: {tmp_path / 'old_plan.r2.i1.json'} (no shipped variant produces it)" in problems
    # writing again repairs the file and prunes the stale one
    changed = write_files(tmp_path, files)
    assert victim in changed and "old_plan.r2.i1.json (deleted)" in changed
    assert check_files(tmp_path, files) == []


def test_generate_cli_check_fails_on_empty_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert generate_main(["generate-plans", "--check", "--out", str(tmp_path), "--only", "sendrecv_ll"]) == 1
    assert "missing:" in capsys.readouterr().err
    assert generate_main(["generate-plans", "--out", str(tmp_path), "--only", "sendrecv_ll"]) == 0
    assert generate_main(["generate-plans", "--check", "--out", str(tmp_path), "--only", "sendrecv_ll"]) == 0
    assert "up to date" in capsys.readouterr().out


# -- index ------------------------------------------------------------------------------------

def test_index_describes_every_plan_file(generated: dict[str, str], shipped_plans: list) -> None:
    files = {p.name for p in shipped_plans}
    assert {e["file"] for e in ENTRIES} == files
    assert len(ENTRIES) == sum(len(info.variants) for info in ALGORITHMS.values())
    for e in ENTRIES:
        info = ALGORITHMS[e["algorithm"]]
        plan = _shipped_plan(e["file"])
        assert plan.name == e["name"] == e["file"][:-len(".json")]
        assert (e["collective"], e["protocol"], e["buffer_mode"]) == (info.collective, info.protocol, info.buffer_mode)
        assert (plan.collective, plan.protocol, plan.inplace) == (e["collective"], e["protocol"], e["inplace"])
        assert e["ranks"] == plan.world_size and e["threadblocks"] == plan.max_threadblocks()
        assert e["num_threads_per_block"] == plan.num_threads_per_block
        assert (e["min_message_size"], e["max_message_size"]) == (plan.min_message_size, plan.max_message_size)
        assert e["size_of"] == ("output" if e["collective"] == "allgather" else "input")
        assert plan.use_double_scratch_buffer == e["use_double_scratch_buffer"] == (plan.protocol == "LL")
        assert e["port_channels"] == plan.uses_port_channels() == info.port_channels
        assert e["gpus_per_node"] == dict(next(v.params for v in info.variants
                                               if variant_stem(info, v) == plan.name)).get("gpus_per_node")


def test_every_algorithm_ships_2_4_8_ranks() -> None:
    """... every rank count of 2, 4 and 8 it builds (hierarchical programs need two nodes of at
    least two GPUs: 4 and 8)."""
    for name, info in ALGORITHMS.items():
        ranks = {e["ranks"] for e in ENTRIES if e["algorithm"] == name}
        assert ranks == {n for n in (2, 4, 8) if info.min_ranks <= n <= info.max_ranks}, name
        assert info.buffer_mode in ("any", "symmetric")
        modes = {e["inplace"] for e in ENTRIES if e["algorithm"] == name}
        assert modes <= set(info.inplace_modes)


def test_any_buffer_plans_cover_every_size() -> None:
    """For every collective and rank count, "any"-mode plans cover all message sizes, so a
    selector always finds a plan for non-symmetric tensors."""
    for coll in {info.collective for info in ALGORITHMS.values()}:
        for n in (2, 4, 8):
            for size in (0, 1024, 300 * 1024, 64 << 20, 1 << 40):
                assert select(ENTRIES, coll, n, size, buffer_mode="any", inplace=False), (coll, n, size)


def test_bandwidth_variants_ship() -> None:
    """notes/perf.md (2x H200): plain puts need >= 16 thread blocks for 220 GB/s and 32 for
    ~265 GB/s per direction, LL plans scale to 32 blocks. Every algorithm ships grids of 16 and
    32 blocks at 2 ranks and one of 14-16 blocks at 4 and 8 ranks; no grid exceeds 64 blocks
    (all blocks of a plan must be co-resident). Port-channel plans move their data with copy
    engines, not thread blocks, and are exempt (one instance each), and so are the fused
    allreduce + RMSNorm plans (one instance: their instances would split rows), and so are the
    all-to-all-v plans (one instance: a segment's rows are known at run time only, so
    instances cannot split it)."""
    for name, info in ALGORITHMS.items():
        if info.port_channels or info.collective == "allreduce_add_rms_norm" or collective(info.collective).counted:
            continue
        grids = {n: {e["threadblocks"] for e in ENTRIES if e["algorithm"] == name and e["ranks"] == n}
                 for n in (2, 4, 8)}
        assert {16, 32} <= grids[2], (name, grids[2])
        for n in (4, 8):
            assert any(14 <= g <= 16 for g in grids[n]), (name, n, grids[n])
    assert ENTRIES and max(e["threadblocks"] for e in ENTRIES) <= 64


def _flat_ops(plan: Plan, rank: int):
    for tb in plan.gpus[rank].threadblocks:
        for op in tb.ops:
            for inner in (op.ops or [op]):
                yield tb, inner


@pytest.mark.parametrize("name", ["allreduce_rsag_simple", "allreduce_rsag_pipelined"])
def test_rsag_writes_back_into_the_slots_it_read(name: str) -> None:
    """The reduced chunk goes back into the peers' scratch slots it was read from (one fused
    ``rres`` per instance), so the scratch holds one slot per chunk: ``ranks * instances``."""
    for n, k, ip in ((2, 1, False), (4, 2, True), (3, 3, False)):
        plan = build(name, n, instances=k, inplace=ip)
        for g in plan.gpus:
            assert g.scratch_chunks == n * k, (name, n, k, g.id)
            rres = [(tb, op) for tb, op in _flat_ops(plan, g.id) if op.name == OpName.rres]
            assert len(rres) == k, (name, n, k, g.id)
            for tb, op in rres:
                refs = tb.remote_buffer_list(ChannelType.memory)

                def remote(bufs):
                    return sorted((g.remote_buffers[refs[b.buffer_id]].rank, b.index, b.size)
                                  for b in bufs if b.is_remote)
                assert len(remote(op.src_buff)) == n - 1
                assert remote(op.dst_buff) == remote(op.src_buff), (name, n, k, g.id, tb.id)


# -- simulator verification of every shipped plan ---------------------------------------------

@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_shipped_plan_verifies(entry: dict) -> None:
    plan = _shipped_plan(entry["file"])
    # a plan with segments runs over its count matrices (mscclang.plan.segments.count_cases)
    sizes = None if plan.has_segments() else _small_sizes(plan)
    rep = verify(plan, sizes=sizes, schedules=2, seed=7)
    assert not rep.problems, f"{entry['file']}:\n{_problems(rep)}"
    assert rep.runs >= 3


# -- structure of the programs ----------------------------------------------------------------

def test_oneshot_has_two_ops_per_block() -> None:
    """The latency path: one multi-destination ppkt and one repkt per thread block."""
    for n in (2, 4, 8):
        plan = build("allreduce_oneshot_ll", n, instances=2)
        for g in plan.gpus:
            assert len(g.threadblocks) == 2 * n
            for tb in g.threadblocks:
                assert [op.name for op in tb.ops] == [OpName.ppkt, OpName.repkt]
                assert len(tb.ops[0].dst_buff) == n - 1 and len(tb.ops[1].src_buff) == n


def test_reductions_fuse_into_single_ops() -> None:
    twostep = build("allreduce_twostep_ll", 4)
    names = [op.name for op in twostep.gpus[0].threadblocks[0].ops]
    assert names == [OpName.ppkt, OpName.respkt, OpName.upkt]
    simple = build("allreduce_rsag_simple", 4, instances=1)
    ops = [op for op in simple.gpus[0].threadblocks[0].ops if op.name == OpName.rres]
    assert len(ops) == 1 and len(ops[0].src_buff) == 4 and len(ops[0].dst_buff) == 4
    zc = build("allreduce_rsag_zero_copy", 4, instances=1)
    assert [op.name for op in zc.gpus[0].threadblocks[0].ops].count(OpName.rres) == 1


def test_zero_copy_programs_start_with_a_relaxed_handshake() -> None:
    """Every block that touches a peer's buffers waits for the peers' ready words first: a
    relaxed wait, or a port wait where the ready word comes over a port channel (between
    nodes); blocks that only work locally (copy-engine programs' SM blocks) touch nothing."""
    for name, info in ALGORITHMS.items():
        if info.buffer_mode != "symmetric":
            continue
        plan = info.build(4, instances=1, **dict(info.variants[0].params))
        for g in plan.gpus:
            for tb in g.threadblocks:
                remote = [i for i, op in enumerate(tb.ops) if any(b.is_remote for b in op.dst_buff + op.src_buff)]
                if not remote:
                    assert info.port_channels, (name, g.id, tb.id)
                    continue
                before = tb.ops[:remote[0]]
                assert OpName.rlxwait in [op.name for op in before] or (info.port_channels and any(
                    op.name == OpName.wait and op.channel_type == ChannelType.port for op in before)), (name, g.id, tb.id)


@pytest.mark.parametrize("unit", [16, 48])
def test_pipelined_many_iterations(unit: int) -> None:
    for n, k, ip in ((2, 1, False), (3, 2, True)):
        plan = build("allreduce_rsag_pipelined", n, instances=k, inplace=ip, unit=unit, min_message_size=0)
        sizes = [n * k * 16 * 5 + 4, n * k * 100 + 8]   # several iterations, short last chunk
        rep = verify(plan, sizes=sizes, schedules=2, dtypes=["float32", "bfloat16"], seed=3)
        assert not rep.problems, _problems(rep)


def test_odd_rank_counts_verify() -> None:
    for name in ("allreduce_oneshot_ll", "allreduce_twostep_ll", "allreduce_rsag_zero_copy",
                 "reducescatter_ll", "sendrecv_simple", "broadcast_simple"):
        plan = build(name, 3, instances=1)
        rep = verify(plan, sizes=_small_sizes(plan)[1:], schedules=1, seed=5)
        assert not rep.problems, f"{name}:\n{_problems(rep)}"


def _receives_from(plan: Plan) -> dict[int, set[int]]:
    """``r -> {p}``: ranks ``p`` that send rank ``r`` something it waits for in every launch
    (packets into its scratch, or a signal on a channel to it)."""
    got: dict[int, set[int]] = {g.id: set() for g in plan.gpus}
    for g in plan.gpus:
        mem_peers = g.peers(ChannelType.memory)
        for tb in g.threadblocks:
            ops = [i for op in tb.ops for i in (op.ops or [op])]
            for op in ops:
                if op.name in (OpName.signal, OpName.rlxsignal):
                    chans = tb.channel_list(ChannelType.memory)
                    for c in op.channel_ids:
                        got[mem_peers[chans[c]]].add(g.id)
                if op.name in (OpName.ppkt, OpName.rppkt, OpName.respkt, OpName.recspkt):
                    refs = tb.remote_buffer_list(op.channel_type)
                    for b in op.dst_buff:
                        if b.is_remote:
                            got[g.remote_buffers[refs[b.buffer_id]].rank].add(g.id)
    return got


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["protocol"] == "LL"], ids=lambda e: e["file"])
def test_ll_writers_stay_within_one_launch(entry: dict) -> None:
    """Double-buffered packets are safe only if a rank that writes packets into peer ``p``'s
    scratch cannot run two launches ahead of ``p``: in every launch it must (transitively)
    receive something from ``p``. (The simulator finds such run-aheads only with rare
    schedules, so this is checked on the plans' structure.)"""
    plan = _shipped_plan(entry["file"])
    got = _receives_from(plan)
    for g in plan.gpus:
        deps, todo = set(), [g.id]
        while todo:
            for p in got[todo.pop()]:
                if p not in deps:
                    deps.add(p)
                    todo.append(p)
        for tb in g.threadblocks:
            refs = tb.remote_buffer_list(ChannelType.memory)
            for op in tb.ops:
                if op.name in (OpName.ppkt, OpName.rppkt, OpName.respkt, OpName.recspkt):
                    for b in op.dst_buff:
                        if b.is_remote:
                            p = g.remote_buffers[refs[b.buffer_id]].rank
                            assert p in deps, f"rank {g.id} tb {tb.id} writes packets to rank {p} but never hears from it"


def test_one_way_ll_plans_survive_many_launches() -> None:
    for name in ("broadcast_ll", "sendrecv_ll"):
        for n in (2, 3):
            plan = build(name, n)
            rep = verify(plan, sizes=[16 * n], schedules=6, launches=6, dtypes=["float32"], seed=0)
            assert not rep.problems, _problems(rep)


def test_broadcast_other_root() -> None:
    plan = build("broadcast_ll", 4, root=2)
    assert plan.root == 2 and plan.name == "broadcast_ll.r4.i1.root2"
    rep = verify(plan, sizes=[64, 212], schedules=1)
    assert not rep.problems, _problems(rep)


def test_build_rejects_bad_arguments() -> None:
    with pytest.raises(DSLError, match="unknown algorithm"):
        build("allreduce_magic", 2)
    with pytest.raises(DSLError, match="ranks"):
        build("allreduce_oneshot_ll", 1)
    with pytest.raises(DSLError, match="ranks"):
        build("allreduce_oneshot_ll", 9)
    with pytest.raises(DSLError, match="instances"):
        build("allreduce_oneshot_ll", 2, instances=0)
    with pytest.raises(DSLError, match="inplace"):
        build("alltoall_zero_copy", 2, inplace=True)
    with pytest.raises(DSLError, match="root"):
        build("broadcast_simple", 2, root=2)
    with pytest.raises(DSLError, match="unit"):
        build("allreduce_rsag_pipelined", 2, unit=10)


def test_variant_names() -> None:
    info = ALGORITHMS["broadcast_simple"]
    v = next(v for v in info.variants if v.inplace and v.ranks == 2)
    assert variant_stem(info, v) == f"broadcast_simple.r2.i{v.instances}.root0.inplace"


# -- full sweep -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_shipped_plan_full_sweep(entry: dict) -> None:
    plan = load_plan(PLANS / entry["file"])
    sizes = sorted(set(default_sizes(plan.model_copy(update={"min_message_size": 0}))) | set(default_sizes(plan)))
    rep = verify(plan, sizes=sizes, schedules=10, seed=11, launches=4)
    assert not rep.problems, f"{entry['file']}:\n{_problems(rep)}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("ranks", [3, 5, 6, 7])
def test_all_rank_counts_full_sweep(name: str, ranks: int) -> None:
    info = ALGORITHMS[name]
    params = dict(info.variants[0].params)   # e.g. a hierarchical program's gpus_per_node (1)
    for ip in info.inplace_modes:
        plan = info.build(ranks, instances=2, inplace=ip, min_message_size=0, **params)
        rep = verify(plan, schedules=6, seed=13, launches=4)
        assert not rep.problems, f"{name} r{ranks} inplace={ip}:\n{_problems(rep)}"


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_pipelined_full_sweep(ranks: int) -> None:
    for ip in (False, True):
        plan = build("allreduce_rsag_pipelined", ranks, instances=2, inplace=ip, unit=32, min_message_size=0)
        sizes = [ranks * 2 * 16, ranks * 2 * 16 * 7 + 4, ranks * 2 * 1000 + 12]
        rep = verify(plan, sizes=sizes, schedules=6, seed=17)
        assert not rep.problems, _problems(rep)
