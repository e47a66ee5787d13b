"""Small value types of the DSL (MSCCL++'s ``internal/types.py`` names).

``BufferType``, ``ChannelType`` and ``ReduceOperationType`` are the plan's enums under the names
MSCCL++ programs use, so a DSL value goes into the plan unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntFlag

from mscclang.plan.models import BufferKind, ChannelType, ReduceOp

BufferType = BufferKind
ReduceOperationType = ReduceOp

__all__ = ["BufferType", "ChannelType", "Chunk", "RankGroup", "ReduceOperationType", "SyncType"]


class SyncType(IntFlag):
    """Where a signal/wait/flush/semaphore op synchronises the whole thread block (``nop``):
    ``before`` it, ``after`` it, ``both`` or ``none``. Values combine with ``|``."""

    none = 0
    before = 1
    after = 2
    both = 3


@dataclass(frozen=True)
class Chunk:
    """``size`` consecutive chunks of one buffer of ``rank``, starting at chunk ``index``."""

    rank: int
    buffer: BufferKind
    index: int
    size: int

    def __str__(self) -> str:
        return f"rank {self.rank} {self.buffer.name}[{self.index}:{self.index + self.size}]"


@dataclass(frozen=True)
class RankGroup:
    """The ranks of one switch (NVLink multicast) channel."""

    size: int
    ranks: tuple[int, ...]
