"""Node layout from the launcher and the transport of every channel (CPU): memory channels only
within a node, port channels by copy engine within a node and through the engine between nodes,
switch channels within a node; plans the layout cannot carry are refused naming the rank, the
channel and the reason, and the communicator then picks another plan (or NCCL)."""

from __future__ import annotations

import pytest

from mscclang.errors import PlanError, RuntimeUnavailable
from mscclang.plan import load_plan, plan_from_dict
from mscclang.plan.models import ChannelType
from mscclang.runtime.device_plan import check_runnable
from mscclang.runtime.topology import (COPY_ENGINE, ENGINE, NVLINK, Topology, channel_transports, check_topology,
                                       topology_from_env, transport)
from tests.harness.plan_samples import kitchen_sink

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_layout_from_the_launcher_with_an_override():
    assert topology_from_env(8, {}) == Topology(8, 8)
    assert topology_from_env(8, {"LOCAL_WORLD_SIZE": "4"}) == Topology(8, 4)
    assert topology_from_env(2, {"LOCAL_WORLD_SIZE": "8"}) == Topology(2, 2)
    assert topology_from_env(2, {"LOCAL_WORLD_SIZE": "2", "MSCCLANG_GPUS_PER_NODE": "1"}) == Topology(2, 1)
    t = Topology(8, 4)
    assert t.nodes == 2 and t.node_of(5) == 1 and t.same_node(4, 7) and not t.same_node(3, 4)
    with pytest.raises(RuntimeUnavailable, match="do not split"):
        topology_from_env(6, {"MSCCLANG_GPUS_PER_NODE": "4"})
    with pytest.raises(RuntimeUnavailable, match="not a number"):
        topology_from_env(2, {"MSCCLANG_GPUS_PER_NODE": "two"})


def test_transport_choice():
    two_nodes = Topology(4, 2)
    assert transport(ChannelType.memory, 0, 1, two_nodes) == NVLINK
    assert transport(ChannelType.port, 0, 1, two_nodes) == COPY_ENGINE
    assert transport(ChannelType.port, 1, 2, two_nodes) == ENGINE
    with pytest.raises(PlanError, match="ranks 1 and 2 are on different nodes"):
        transport(ChannelType.memory, 1, 2, two_nodes)
    with pytest.raises(PlanError, match="multicast"):
        transport(ChannelType.switch, 0, 3, two_nodes)


def test_library_plan_as_two_one_gpu_nodes_is_refused_naming_the_channel():
    plan = load_plan(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.json")
    check_topology(plan, Topology(2, 2))
    rows = channel_transports(plan, 0, Topology(2, 2))
    assert rows and all(r[0] == ChannelType.memory and r[2] == 1 and r[3] == NVLINK for r in rows)
    with pytest.raises(PlanError, match=r"rank 0 memory channel 0 to rank 1: .*different nodes") as e:
        check_runnable(plan, topology=Topology(2, 1))
    assert e.value.path == "gpus[0].channels"


def test_port_channels_get_their_transport():
    plan = plan_from_dict(kitchen_sink())
    try:
        check_runnable(plan, allow_switch=True)
    except PlanError as e:   # whatever the kitchen sink breaks, it is not the port channels' transport
        assert "port channels do not run" not in str(e)
    rows = [r for r in channel_transports(plan, 0, Topology(plan.world_size, plan.world_size))
            if r[0] == ChannelType.port]
    assert rows and {r[3] for r in rows} == {COPY_ENGINE}
    one = Topology(plan.world_size, 1)
    assert {transport(ChannelType.port, 0, q, one) for _, _, q, _ in rows} == {ENGINE}


def test_communicator_skips_plans_the_layout_cannot_carry():
    """With one GPU per node every library plan (memory channels) is refused by the runtime, so
    the call goes to the torch.distributed fallback instead of failing."""
    import torch

    from mscclang.comm import Communicator
    from mscclang.comm.sim_backend import SimWorld
    from mscclang.comm.tuning import TuningTable
    from mscclang.comm.sim_ranks import catalog_of

    def one_gpu_nodes(plan):
        try:
            check_runnable(plan, topology=Topology(2, 1))
        except PlanError as e:
            return str(e)
        return None

    class Fallback:
        def __init__(self) -> None:
            self.calls = 0

        def all_reduce(self, inp, out, op):
            self.calls += 1

    plan = load_plan(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json")
    be, fb, executed = SimWorld(2).backend(0), Fallback(), []
    be.launch.runnable = one_gpu_nodes
    be.launch.run_call = lambda *a, **k: executed.append(a)
    comm = Communicator(backend=be, plans=catalog_of([plan]), tuning=TuningTable(), fallback=fb)
    comm.all_reduce(torch.ones(256))
    assert comm.last.mode == "nccl" and fb.calls == 1 and executed == []
