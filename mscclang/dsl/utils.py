"""``AlgoSpec`` and ``ReplicationPolicy`` (MSCCL++'s ``language/utils.py`` names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["AlgoSpec", "ReplicationPolicy"]


class ReplicationPolicy(Enum):
    """How ``instances=k`` lays out the k copies of a program's chunks.

    ``interleaved``: chunk ``(c, s)`` of instance ``i`` becomes ``(c*k + i*s, s)``.
    ``none``: each block of the collective's buffers (see :mod:`mscclang.compiler.replicate`)
    holds the k instances' copies one after the other.
    """

    interleaved = "interleaved"
    none = "none"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class AlgoSpec:
    """Everything ``CollectiveProgram.from_spec`` needs (same fields as MSCCL++)."""

    name: str
    collective: Any
    nranks_per_node: int
    world_size: int
    in_place: bool
    instances: int
    protocol: str
    instr_fusion: bool = True
    auto_sync: bool = True
    replication_policy: ReplicationPolicy = ReplicationPolicy.interleaved
    reuse_resources: bool = False
    num_threads_per_block: int = 1024
    use_double_scratch_buffer: bool = False
    buffer_alignment: int = 16
    min_message_size: int = 0
    max_message_size: int = 2**64 - 1
    tags: dict = field(default_factory=dict)
