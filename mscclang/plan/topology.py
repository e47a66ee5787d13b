"""Which ranks share a node, and which transport carries each channel of a plan: the rule the GPU
runtime loads plans by (:mod:`mscclang.runtime.topology` reads the layout from the launcher) and
the cost model prices them by (``mscclang predict --topology``), so that nothing is predicted that
the runtime refuses.

Transports (docs/semantics.md, "Transports"): a memory channel needs the peer's memory mapped (CUDA
IPC), so both ends on one node; a port channel is a copy-engine copy into the peer's IPC mapping on
one node, and goes through an existing engine (NCCL point-to-point) between nodes; a switch channel
(NVLink multicast) spans one node. :func:`check_topology` refuses a plan whose channels a layout
cannot carry, naming the rank, the channel and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from mscclang.errors import PlanError
from mscclang.plan.models import ChannelType, Plan

#: transport names
NVLINK = "nvlink"            # memory channel: SM loads/stores through the peer's IPC mapping
COPY_ENGINE = "copy-engine"  # port channel within a node
ENGINE = "engine"            # port channel between nodes (NCCL point-to-point)
MULTICAST = "multicast"      # switch channel (NVLink SHARP)


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks, ``gpus_per_node`` consecutive ranks per node; PlanError when the
    ranks do not split into such nodes."""

    world_size: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.gpus_per_node < 1 or self.world_size % self.gpus_per_node:
            raise PlanError(f"{self.world_size} ranks do not split into nodes of {self.gpus_per_node} GPUs")

    @property
    def nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)


def transport(kind: ChannelType, a: int, b: int, topo: Topology) -> str:
    """The transport of a channel of type ``kind`` between ranks ``a`` and ``b``; PlanError (no
    path) when the layout cannot carry it."""
    same = topo.same_node(a, b)
    if kind == ChannelType.memory:
        if not same:
            raise PlanError(f"a memory channel needs the peer's memory mapped, but ranks {a} and {b} are on "
                            f"different nodes ({topo.node_of(a)} and {topo.node_of(b)})")
        return NVLINK
    if kind == ChannelType.port:
        return COPY_ENGINE if same else ENGINE
    if kind == ChannelType.switch:
        if not same:
            raise PlanError(f"a switch channel (NVLink multicast) spans one node, but ranks {a} and {b} are "
                            f"on different nodes ({topo.node_of(a)} and {topo.node_of(b)})")
        return MULTICAST
    raise PlanError(f"channel type {kind} has no transport")


def channel_transports(plan: Plan, rank: int, topo: Topology) -> list[tuple[ChannelType, int, int, str]]:
    """``(type, index, peer, transport)`` of every channel of ``rank``, numbered per type as the
    plan's ops number them (a switch channel: one row per other member); PlanError naming the
    rank, the channel and the reason for the first one the layout cannot carry."""
    if plan.world_size != topo.world_size:
        raise PlanError(f"the plan has {plan.world_size} ranks, the topology {topo.world_size}")
    g = plan.gpus[rank]
    links = [(kind, k, q) for kind in (ChannelType.memory, ChannelType.port) for k, q in enumerate(g.peers(kind))]
    links += [(ChannelType.switch, k, q) for k, (_, ranks) in enumerate(g.switch_groups()) for q in ranks if q != rank]
    rows: list[tuple[ChannelType, int, int, str]] = []
    for kind, k, q in links:
        try:
            rows.append((kind, k, q, transport(kind, rank, q, topo)))
        except PlanError as e:
            raise PlanError(f"rank {rank} {kind.value} channel {k} to rank {q}: {e.message}",
                            f"gpus[{rank}].channels") from None
    return rows


def check_topology(plan: Plan, topo: Topology) -> None:
    """Refuse ``plan`` when this layout cannot carry one of its channels (every rank's)."""
    for r in range(plan.world_size):
        channel_transports(plan, r, topo)
