"""The DSL, source-compatible with MSCCL++'s (``mscclpp.language``).

``from mscclang.dsl import *`` (or ``from mscclang import *``) replaces every
``from mscclpp.language.<module> import *`` line of an MSCCL++ program. The modules mirror
MSCCL++'s: ``program``, ``collectives``, ``rank``, ``channel``, ``general``, ``loop``,
``thread_block_group``, ``utils`` (plus ``types``).
"""

from mscclang.dsl.channel import MemoryChannel, PortChannel, SwitchChannel, read_reduce
from mscclang.dsl.collectives import (
    AllGather,
    AllGatherV,
    AllReduce,
    AllReduceAddRMSNorm,
    AllToAll,
    AllToAllV,
    Broadcast,
    Collective,
    ReduceScatter,
    SendRecv,
    TestCollective,
)
from mscclang.dsl.general import JSON
from mscclang.dsl.loop import LoopIterationContext
from mscclang.dsl.program import CollectiveProgram
from mscclang.dsl.rank import BaseBuffer, Buffer, Rank, Semaphore
from mscclang.dsl.thread_block_group import ThreadBlockGroup
from mscclang.dsl.types import BufferType, ChannelType, Chunk, RankGroup, ReduceOperationType, SyncType
from mscclang.dsl.utils import AlgoSpec, ReplicationPolicy

__all__ = [
    "AlgoSpec", "AllGather", "AllGatherV", "AllReduce", "AllReduceAddRMSNorm", "AllToAll", "AllToAllV", "BaseBuffer", "Broadcast", "Buffer",
    "BufferType", "ChannelType", "Chunk", "Collective", "CollectiveProgram", "JSON",
    "LoopIterationContext", "MemoryChannel", "PortChannel", "Rank", "RankGroup",
    "ReduceOperationType", "ReduceScatter", "ReplicationPolicy", "Semaphore", "SendRecv",
    "SwitchChannel", "SyncType", "TestCollective", "ThreadBlockGroup", "read_reduce",
]
