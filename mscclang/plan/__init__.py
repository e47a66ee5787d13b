"""The execution plan: models, loading/saving, the chunk-to-byte rule, collective specs."""

from mscclang.plan.check import validate_plan
from mscclang.plan.collectives import CollectiveSpec, Expect, spec_from_plan
from mscclang.plan.io import load_plan, plan_from_dict, plan_to_dict, plan_to_json, save_plan
from mscclang.plan.layout import Layout, Piece, make_layout
from mscclang.plan.models import (
    PLAN_FORMAT,
    BufferKind,
    BufferRef,
    ChannelDesc,
    ChannelOrdinal,
    ChannelType,
    Gpu,
    Op,
    OpName,
    PacketType,
    PairedEnd,
    Plan,
    ReduceOp,
    RemoteBuffer,
    SemaphoreDesc,
    ThreadBlock,
)
from mscclang.plan.mscclpp import from_mscclpp, to_mscclpp

__all__ = [
    "PLAN_FORMAT", "BufferKind", "BufferRef", "ChannelDesc", "ChannelOrdinal", "ChannelType", "CollectiveSpec",
    "Expect", "Gpu", "Layout", "Op", "OpName", "PacketType", "PairedEnd", "Piece", "Plan", "ReduceOp",
    "RemoteBuffer", "SemaphoreDesc", "ThreadBlock", "validate_plan", "from_mscclpp", "load_plan", "make_layout", "plan_from_dict",
    "plan_to_dict", "plan_to_json", "save_plan", "spec_from_plan", "to_mscclpp",
]
