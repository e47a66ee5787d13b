"""The port-channel programs of the library: copy-engine allgather, all-to-all and pipelined
allreduce for one node (2, 4, 8 ranks) and the hierarchical allreduce / allgather for several
nodes (2x2, 2x4, 4x2: nodes x GPUs per node).

Each program compiles, verifies in the simulator (postcondition, no deadlock, no race, over
three launches so that a port copy still reading a source when the next launch reuses it is
seen), keeps to what the copy-engine runtime accepts (Simple protocol, single scratch, no packet
port ops, few port requests, one chunk range per copy), and respects its node layout. Broken
copies of the plans (a dropped wait, a missing flush, a dropped ready handshake) are caught.
The selector never picks them by itself; a tuning rule naming them does.
"""

from __future__ import annotations

import json
from functools import lru_cache

import pytest

from mscclang.algorithms import ALGORITHMS, build
from mscclang.algorithms.common import MAX_PORT_REQUESTS, local_peers, port_requests, remote_peers
from mscclang.algorithms.generate import variant_stem
from mscclang.algorithms.index import default_plans_dir
from mscclang.comm.catalog import Catalog
from mscclang.comm.selector import Selector
from mscclang.comm.tuning import DEFAULT_TUNING_FILE, Candidate, Rule, TuningTable
from mscclang.errors import DSLError, PlanError
from mscclang.plan.call import message_call
from mscclang.plan.io import load_plan, plan_from_dict, plan_to_dict
from mscclang.plan.models import ChannelType, OpName, Plan
from mscclang.runtime.topology import Topology, check_topology
from mscclang.sim import default_sizes, verify

CE = ("allgather_port", "alltoall_port", "allreduce_port_pipelined")
HIER = ("allreduce_hierarchical", "allgather_hierarchical")
LAYOUTS = ((2, 2), (2, 4), (4, 2))      # nodes x GPUs per node (2x1 ships too; see below)
PORT_DATA = (OpName.put, OpName.pws, OpName.pwsf, OpName.ppkt, OpName.rppkt)
MiB = 1 << 20


def _shipped(stem: str) -> Plan:
    """A shipped plan (plans/ is checked to be up to date by test_algorithms.py)."""
    return load_plan(default_plans_dir() / f"{stem}.json")


@lru_cache(maxsize=None)
def _plan(name: str, ranks: int, inplace: bool = False, **kw) -> Plan:
    return build(name, ranks, inplace=inplace, min_message_size=0, **kw)


def _ce_cases() -> list[tuple[str, int, bool, tuple]]:
    out = []
    for name in CE:
        for n in (2, 4, 8):
            for ip in ALGORITHMS[name].inplace_modes:
                # a small pipeline at 8 ranks keeps the test quick; the shipped steps verify in
                # test_algorithms.py
                kw = (("steps", 2 if n == 8 else 3),) if name == "allreduce_port_pipelined" else ()
                out.append((name, n, ip, kw))
    return out


def _hier_cases() -> list[tuple[str, int, bool, tuple]]:
    return [(name, nodes * g, ip, (("gpus_per_node", g),))
            for name in HIER for nodes, g in LAYOUTS for ip in (False, True)]


def _id(case) -> str:
    name, n, ip, kw = case
    return f"{name}-r{n}" + "".join(f"-{k}{v}" for k, v in kw) + ("-inplace" if ip else "")


def _report(rep) -> str:
    return "\n".join(f"{p.kind}: {p.message}" for p in rep.problems[:4])


def _sizes(plan: Plan) -> list[int]:
    """The simulator's small sizes: one where every chunk is one alignment unit and one whose
    last chunk is short."""
    return default_sizes(plan.model_copy(update={"min_message_size": 0}))[:2]


# -- every program verifies -----------------------------------------------------------------------

@pytest.mark.parametrize("case", _ce_cases() + _hier_cases(), ids=_id)
def test_program_verifies(case) -> None:
    name, n, ip, kw = case
    plan = _plan(name, n, ip, **dict(kw))
    rep = verify(plan, sizes=_sizes(plan), schedules=2, seed=5, launches=3, dtypes=("float16", "int32"))
    assert rep.ok and not rep.problems, f"{_id(case)}:\n{_report(rep)}"


def test_pipeline_steps_and_reducers_are_parameters() -> None:
    """Odd step counts and a small reducing group (several steps per block, a short last step)."""
    for n, steps, blocks in ((2, 5, 3), (3, 2, 2)):
        for ip in (False, True):
            plan = _plan("allreduce_port_pipelined", n, ip, steps=steps, reduce_blocks=blocks)
            assert plan.gpus[0].input_chunks == n * steps
            assert plan.max_threadblocks() == blocks
            rep = verify(plan, sizes=[n * steps * 16 * 3 + 8], schedules=2, seed=2, dtypes=("float32",))
            assert not rep.problems, _report(rep)


# -- what the copy-engine runtime accepts ---------------------------------------------------------

def _port_ops(plan: Plan):
    for g in plan.gpus:
        for tb in g.threadblocks:
            for op in tb.ops:
                if op.channel_type == ChannelType.port:
                    yield g, tb, op


@pytest.mark.parametrize("name", CE + HIER)
def test_shipped_plans_suit_the_copy_engine_runtime(name: str) -> None:
    info = ALGORITHMS[name]
    assert info.port_channels and info.buffer_mode == "symmetric" and info.protocol == "Simple"
    for v in info.variants:
        plan = _shipped(variant_stem(info, v))
        assert plan.protocol == "Simple" and not plan.use_double_scratch_buffer and plan.uses_port_channels()
        assert 0 < port_requests(plan) <= MAX_PORT_REQUESTS, (name, v)
        for g, tb, op in _port_ops(plan):
            assert op.name not in (OpName.ppkt, OpName.rppkt), (name, v, op.name)
            if op.name in PORT_DATA:
                # one source range and one destination range per copy, each a single chunk
                assert len(op.src_buff) == len(op.dst_buff) == len(op.channel_ids)
                assert all(b.size == 1 for b in op.src_buff + op.dst_buff), (name, v)
        # every port request is posted by one thread block per rank and instance
        assert all(len({tb.id for g2, tb, _ in _port_ops(plan) if g2.id == g.id}) == v.instances
                   for g in plan.gpus), (name, v)


def test_port_request_budget_is_enforced() -> None:
    n = port_requests(_plan("allreduce_port_pipelined", 8, steps=2))
    assert n == 2 * 7 * 2 + 7          # puts of both phases, one flush per peer
    with pytest.raises(DSLError, match="217 port requests per launch"):
        build("allreduce_port_pipelined", 8, steps=15, reduce_blocks=1)


def test_pipelined_allreduce_posts_every_reduce_scatter_copy_first() -> None:
    """The copy engines get all reduce-scatter copies at once (one ``pws`` over every step and
    peer, steps in order), so they stream while the SMs reduce."""
    plan = _plan("allreduce_port_pipelined", 4, steps=3)
    ops = plan.gpus[1].threadblocks[0].ops
    first = next(op for op in ops if op.channel_type == ChannelType.port)
    assert first.name == OpName.pws and len(first.dst_buff) == 3 * 3
    assert [b.index for b in first.src_buff] == [p * 3 + s for s in range(3) for p in (0, 2, 3)]
    names = [op.name for op in ops if op.channel_type == ChannelType.port and op.name in PORT_DATA]
    assert names == [OpName.pws, OpName.put, OpName.put, OpName.pwsf]


# -- node layouts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", HIER)
@pytest.mark.parametrize("nodes,g", LAYOUTS)
def test_hierarchical_channels_follow_the_node_layout(name: str, nodes: int, g: int) -> None:
    n = nodes * g
    plan = _plan(name, n, False, gpus_per_node=g)
    for gpu in plan.gpus:
        r = gpu.id
        assert sorted(set(gpu.peers(ChannelType.memory))) == local_peers(r, g)
        assert sorted(set(gpu.peers(ChannelType.port))) == remote_peers(r, g, nodes)
    check_topology(plan, Topology(n, g))          # accepted on its layout
    check_topology(plan, Topology(n, n))          # and on one node
    if g % 2 == 0:
        with pytest.raises(PlanError, match="memory channel"):
            check_topology(plan, Topology(n, g // 2))   # smaller nodes: a memory channel leaves its node


def test_node_layout_is_checked() -> None:
    for bad, match in (({}, "gpus_per_node"), ({"gpus_per_node": 3}, "do not split"),
                       ({"gpus_per_node": 4}, "one node"), ({"gpus_per_node": True}, "gpus_per_node")):
        with pytest.raises(DSLError, match=match):
            build("allreduce_hierarchical", 4, **bad)
    with pytest.raises(DSLError, match="ranks must be"):
        build("allgather_hierarchical", 1, gpus_per_node=1)
    with pytest.raises(DSLError, match="inplace"):
        build("alltoall_port", 4, inplace=True)
    with pytest.raises(DSLError, match="steps"):
        build("allreduce_port_pipelined", 2, steps=0)
    # one GPU per node: every channel is a port channel
    plan = _plan("allreduce_hierarchical", 3, False, gpus_per_node=1)
    assert all(not g.peers(ChannelType.memory) for g in plan.gpus)
    assert verify(plan, sizes=_sizes(plan), schedules=2, launches=3).ok


# -- broken variants are caught -------------------------------------------------------------------

def _edit(plan: Plan, fn) -> Plan:
    doc = plan_to_dict(plan)
    fn(doc)
    return plan_from_dict(json.loads(json.dumps(doc)))


def _tb0(doc: dict, rank: int) -> list[dict]:
    return doc["gpus"][rank]["threadblocks"][0]["ops"]


def _check(plan: Plan):
    return verify(plan, sizes=_sizes(plan)[:1], schedules=2, seed=1, launches=3, symbolic=False,
                  dtypes=("float16",))


def _kinds(plan: Plan) -> set[str]:
    return {p.kind for p in _check(plan).problems}


def test_dropped_reduce_scatter_wait_is_caught() -> None:
    """Rank 0 reduces step 1 without waiting for the peer's copy of it."""
    plan = _plan("allreduce_port_pipelined", 2, steps=3)

    def drop(doc):
        ops = _tb0(doc, 0)
        waits = [i for i, op in enumerate(ops) if op["name"] == "wait" and op["channel_type"] == "port"]
        del ops[waits[1]]
    rep = _check(_edit(plan, drop))
    assert {"race", "unbalanced-channel"} <= {p.kind for p in rep.problems}, _report(rep)
    # the reduction reads the slot while the peer's copy writes it
    assert any("rank 1 port proxy 0 (proxy for tb 0 pws" in p.message and "rank 0 tb 0" in p.message
               and " re " in p.message and "rank0.scr" in p.message for p in rep.problems), _report(rep)


@pytest.mark.parametrize("name,ranks,kw", [("allreduce_port_pipelined", 2, {"steps": 2}),
                                            ("allgather_port", 4, {}),
                                            ("allreduce_hierarchical", 4, {"gpus_per_node": 2})])
def test_missing_flush_is_caught(name: str, ranks: int, kw: dict) -> None:
    """The last request of each channel without its flush (``pwsf`` -> ``pws``, or the flush op
    dropped): the next launch reuses a buffer a copy may still read."""
    plan = _plan(name, ranks, False, **kw)

    def unflush(doc):
        for g in doc["gpus"]:
            for tb in g["threadblocks"]:
                tb["ops"] = [dict(op, name="pws") if op["name"] == "pwsf" else op
                             for op in tb["ops"] if op["name"] != "flush"]
    broken = _edit(plan, unflush)
    assert _kinds(plan) == set()
    rep = _check(broken)
    assert {p.kind for p in rep.problems} == {"race"}, _report(rep)
    assert any("port proxy" in p.message and "kernel exit does not wait for the proxy" in p.message
               for p in rep.problems), _report(rep)


def test_dropped_remote_ready_handshake_is_caught() -> None:
    """Hierarchical allreduce whose ranks put into remote peers' buffers without waiting for
    their ready signal (the port signal and wait of the handshake dropped on both sides)."""
    plan = _plan("allreduce_hierarchical", 4, False, gpus_per_node=2)

    def drop(doc):
        for r in range(4):
            ops = _tb0(doc, r)
            sig = next(i for i, op in enumerate(ops) if op["name"] == "signal" and op["channel_type"] == "port")
            del ops[sig]
            wait = next(i for i, op in enumerate(ops) if op["name"] == "wait" and op["channel_type"] == "port")
            del ops[wait]
    rep = _check(_edit(plan, drop))
    assert any(p.kind == "race" and "launch start: scratch reused" in p.message and "port proxy" in p.message
               for p in rep.problems), _report(rep)


# -- selection ------------------------------------------------------------------------------------

def test_catalog_marks_port_variants(catalog: Catalog) -> None:
    ports = {v.algorithm for v in catalog if v.uses_port_channels()}
    assert ports == set(CE + HIER) | {"alltoallv_port"}   # the all-to-all-v one: tests/test_segments.py
    v = catalog.get("allreduce_hierarchical.r8.i1.gpus_per_node4")
    assert v is not None and v.port_channels is True and v.ranks == 8 and v.symmetric


def test_selector_never_picks_port_variants_by_itself(catalog: Catalog) -> None:
    sel = Selector(TuningTable(rules=[]), catalog)
    for coll in ("allreduce", "allgather", "alltoall"):
        for n in (2, 4, 8):
            for nbytes in (64 * 1024, 64 * MiB, 1 << 30):
                call = message_call(coll, n, nbytes, "bfloat16")
                got = [v.algorithm for c in sel.choices(call) for v in c.variants]
                assert got and not set(got) & set(CE + HIER), (coll, n, nbytes)
                extra = [v.algorithm for c in sel.extra_choices(call) for v in c.variants]
                assert not set(extra) & set(CE + HIER)
    # the shipped defaults do not name them either
    assert not any(a in DEFAULT_TUNING_FILE.read_text() for a in CE + HIER)


def test_a_tuning_rule_selects_them_by_name(catalog: Catalog) -> None:
    rule = Rule(collective="allreduce", world_size=2, candidates=[
        Candidate(plan="allreduce_port_pipelined.r2.i1.steps8.inplace"), Candidate(plan="nccl")])
    sel = Selector(TuningTable(rules=[rule]), catalog)
    first = sel.choices(message_call("all_reduce", 2, 1 << 30, "bfloat16"))[0]
    assert [v.key for v in first.variants] == ["allreduce_port_pipelined.r2.i1.steps8.inplace"]
    # by algorithm: every shipped variant of it for the world size
    rule = Rule(collective="allgather", world_size=8, candidates=[Candidate(plan="allgather_hierarchical")])
    keys = {v.key for v in Selector(TuningTable(rules=[rule]), catalog).choices(
        message_call("all_gather", 8, 1 << 30, "bfloat16"))[0].variants}
    assert {"allgather_hierarchical.r8.i1.gpus_per_node2", "allgather_hierarchical.r8.i4.gpus_per_node4.inplace"} <= keys
