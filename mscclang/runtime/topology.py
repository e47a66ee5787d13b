"""Which ranks share a node, and which transport carries each channel of a plan.

The node layout comes from the launcher: ``LOCAL_WORLD_SIZE`` (torchrun and launchers like it)
GPUs per node, ranks numbered node by node; ``MSCCLANG_GPUS_PER_NODE`` overrides it (e.g. ``1``
runs one machine's GPUs as one-GPU "nodes", so that traffic between them takes the inter-node
path). Without either, every rank is on one node.

Transports (docs/semantics.md, "Transports"): a memory channel needs the peer's memory mapped (CUDA IPC), so both ends
on one node; a port channel is a copy-engine copy into the peer's IPC mapping on one node, and
goes through an existing engine (NCCL point-to-point) between nodes; a switch channel (NVLink
multicast) spans one node. :func:`check_topology` refuses a plan whose channels this layout
cannot carry, naming the rank, the channel and the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from mscclang.config import Settings
from mscclang.errors import PlanError, RuntimeUnavailable
from mscclang.plan.models import ChannelType, Plan

#: transport names
NVLINK = "nvlink"            # memory channel: SM loads/stores through the peer's IPC mapping
COPY_ENGINE = "copy-engine"  # port channel within a node
ENGINE = "engine"            # port channel between nodes (NCCL point-to-point)
MULTICAST = "multicast"      # switch channel (NVLink SHARP)


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks, ``gpus_per_node`` consecutive ranks per node."""

    world_size: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.gpus_per_node < 1:
            raise RuntimeUnavailable(f"a topology needs at least one rank and one GPU per node, got "
                                     f"{self.world_size} ranks and {self.gpus_per_node} GPUs per node")
        if self.world_size % self.gpus_per_node:
            raise RuntimeUnavailable(f"{self.world_size} ranks do not split into nodes of {self.gpus_per_node} "
                                     "GPUs (LOCAL_WORLD_SIZE / MSCCLANG_GPUS_PER_NODE)")

    @property
    def nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)


def topology_from_env(world_size: int, env: Optional[Mapping[str, str]] = None) -> Topology:
    """The launcher's layout in ``env`` (default ``os.environ``): ``MSCCLANG_GPUS_PER_NODE``, else
    ``LOCAL_WORLD_SIZE`` (at most ``world_size``), else one node. RuntimeUnavailable names a
    variable that is not a number of GPUs per node."""
    gpn = Settings(env).gpus_per_node
    if gpn is not None:
        return Topology(world_size, gpn)
    text = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE", "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            raise RuntimeUnavailable(f"LOCAL_WORLD_SIZE={text!r} is not a number of GPUs per node") from None
        return Topology(world_size, min(n, world_size))
    return Topology(world_size, world_size)


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
