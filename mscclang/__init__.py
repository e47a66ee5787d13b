"""mscclang: GPU collective communication programmed in Python.

``from mscclang import *`` gives the whole DSL (compatible with the MSCCL++ DSL)."""

from mscclang.errors import (  # noqa: F401
    CallMismatch, CollectiveTimeout, CommError, CountsError, CompileError, DSLError, DSLWarning, InvalidCall, LimitError,
    MscclangError, MscclangWarning, NotPrepared, PlanError, RegistrationError, RuntimeUnavailable, SettingError,
    SpecUnsupported, VerificationError, WorkerError)

from mscclang.dsl import (  # noqa: F401
    JSON, AlgoSpec, AllGather, AllGatherV, AllReduce, AllReduceAddRMSNorm, AllToAll, AllToAllV, BaseBuffer, Broadcast, Buffer,
    BufferType, ChannelType, Chunk, Collective, CollectiveProgram, LoopIterationContext, MemoryChannel,
    PortChannel, Rank, RankGroup, ReduceOperationType, ReduceScatter, ReplicationPolicy, Semaphore,
    SendRecv, SwitchChannel, SyncType, TestCollective, ThreadBlockGroup, read_reduce)

__version__ = "0.1.0"

__all__ = [# the errors (mscclang.errors)
           "CallMismatch", "CollectiveTimeout", "CommError", "CountsError", "CompileError", "DSLError", "DSLWarning", "InvalidCall",
           "LimitError", "MscclangError", "MscclangWarning", "NotPrepared", "PlanError", "RegistrationError",
           "RuntimeUnavailable", "SettingError", "SpecUnsupported", "VerificationError", "WorkerError",
           # the DSL (mscclang.dsl.__all__)
           "AlgoSpec", "AllGather", "AllGatherV", "AllReduce", "AllReduceAddRMSNorm", "AllToAll", "AllToAllV",
           "BaseBuffer", "Broadcast", "Buffer",
           "BufferType", "ChannelType", "Chunk", "Collective", "CollectiveProgram", "JSON",
           "LoopIterationContext", "MemoryChannel", "PortChannel", "Rank", "RankGroup",
           "ReduceOperationType", "ReduceScatter", "ReplicationPolicy", "Semaphore", "SendRecv",
           "SwitchChannel", "SyncType", "TestCollective", "ThreadBlockGroup", "read_reduce"]


def __getattr__(name: str):
    """Heavier entry points load on first use, so ``import mscclang`` (and DSL programs) stay
    fast: ``mscclang.verify``, ``mscclang.Communicator``, ``mscclang.Executor`` and the module
    ``mscclang.reference`` (the canonical results, torch on the CPU)."""
    if name == "verify":
        from mscclang.sim.verify import verify

        return verify
    if name == "Communicator":
        from mscclang.comm import Communicator

        return Communicator
    if name == "Executor":
        from mscclang.runtime.executor import Executor

        return Executor
    if name == "reference":
        import mscclang.reference

        return mscclang.reference
    raise AttributeError(f"module 'mscclang' has no attribute {name!r}")
