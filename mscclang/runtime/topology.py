"""The node layout of this process's ranks, from the launcher: ``LOCAL_WORLD_SIZE`` (torchrun and
launchers like it) GPUs per node, ranks numbered node by node; ``MSCCLANG_GPUS_PER_NODE`` overrides
it (e.g. ``1`` runs one machine's GPUs as one-GPU "nodes", so that traffic between them takes the
inter-node path). Without either, every rank is on one node.

Which transport carries each channel, and which plans a layout refuses, is
:mod:`mscclang.plan.topology`'s rule (re-exported here), the one ``mscclang predict`` applies too.
"""

from __future__ import annotations

from typing import Mapping, Optional

from mscclang.config import Settings
from mscclang.errors import PlanError, RuntimeUnavailable
from mscclang.plan.topology import (COPY_ENGINE, ENGINE, MULTICAST, NVLINK, Topology,  # noqa: F401 (re-exported)
                                    channel_transports, check_topology, transport)


def topology_from_env(world_size: int, env: Optional[Mapping[str, str]] = None) -> Topology:
    """The launcher's layout in ``env`` (default ``os.environ``): ``MSCCLANG_GPUS_PER_NODE``, else
    ``LOCAL_WORLD_SIZE`` (at most ``world_size``), else one node. RuntimeUnavailable names a
    variable that is not a number of GPUs per node, or one the ranks do not split by."""
    s = Settings(env)
    gpn = s.gpus_per_node
    if gpn is None:
        text = (s.local_world_size or "").strip()
        try:
            gpn = min(int(text), world_size) if text else world_size
        except ValueError:
            raise RuntimeUnavailable(f"LOCAL_WORLD_SIZE={text!r} is not a number of GPUs per node") from None
    try:
        return Topology(world_size, gpn)
    except PlanError as e:
        raise RuntimeUnavailable(f"{e} (LOCAL_WORLD_SIZE / MSCCLANG_GPUS_PER_NODE)") from None
