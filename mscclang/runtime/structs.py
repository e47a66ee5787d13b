"""Host-side description of the device structs of ``executor/plan_layout.cuh``.

Each struct is described field by field with C types; offsets follow C's natural alignment. The
same description packs the bytes (``Struct.pack``) and generates ``static_assert(offsetof(...) ==
N)`` / ``sizeof`` lines (``layout_asserts``) that CI compiles with NVRTC against the real header,
so the host and device layouts cannot drift.
"""

from __future__ import annotations

import struct as _struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any

_CTYPES = {
    "u8": ("B", 1, "u8"), "u16": ("H", 2, "u16"), "u32": ("I", 4, "u32"), "i32": ("i", 4, "i32"),
    "u64": ("Q", 8, "u64"), "i64": ("q", 8, "i64"), "f32": ("f", 4, "float"),
}


@dataclass(frozen=True)
class Struct:
    """A C struct: ordered (name, ctype) fields with natural alignment."""

    name: str
    fields: tuple[tuple[str, str], ...]

    @cached_property
    def offsets(self) -> dict[str, int]:
        off = 0
        out: dict[str, int] = {}
        for fname, ct in self.fields:
            _, size, _ = _CTYPES[ct]
            off = (off + size - 1) // size * size
            out[fname] = off
            off += size
        return out

    @cached_property
    def alignment(self) -> int:
        return max(_CTYPES[ct][1] for _, ct in self.fields)

    @cached_property
    def size(self) -> int:
        last_name, last_ct = self.fields[-1]
        end = self.offsets[last_name] + _CTYPES[last_ct][1]
        a = self.alignment
        return (end + a - 1) // a * a

    @cached_property
    def format(self) -> str:
        fmt = "<"
        pos = 0
        offs = self.offsets
        for fname, ct in self.fields:
            o = offs[fname]
            if o > pos:
                fmt += f"{o - pos}x"
            fmt += _CTYPES[ct][0]
            pos = o + _CTYPES[ct][1]
        if self.size > pos:
            fmt += f"{self.size - pos}x"
        return fmt

    @cached_property
    def _codec(self) -> _struct.Struct:
        return _struct.Struct(self.format)

    @cached_property
    def _names(self) -> tuple[str, ...]:
        return tuple(f for f, _ in self.fields)

    @cached_property
    def _name_set(self) -> frozenset[str]:
        return frozenset(self._names)

    def pack(self, **values: Any) -> bytes:
        """Pack the struct; missing fields are zero. (The layout is computed once per struct: a
        new message size packs thousands of records.)"""
        if not values.keys() <= self._name_set:
            raise KeyError(f"{self.name} has no field(s) {sorted(set(values) - self._name_set)}")
        return self._codec.pack(*[float(values.get(f, 0)) if ct == "f32" else int(values.get(f, 0))
                                  for f, ct in self.fields])

    def unpack(self, data: bytes, offset: int = 0) -> dict[str, int]:
        vals = self._codec.unpack_from(data, offset)
        return dict(zip(self._names, vals))

    def asserts(self) -> list[str]:
        lines = [f'static_assert(sizeof({self.name}) == {self.size}, "sizeof({self.name}) drifted");']
        for fname, off in self.offsets.items():
            lines.append(
                f'static_assert(__builtin_offsetof({self.name}, {fname}) == {off}, '
                f'"offsetof({self.name}, {fname}) drifted");')
        return lines


PLAN_HEADER = Struct("PlanHeader", (
    ("magic", "u32"), ("version", "u32"), ("n_blocks", "u32"), ("rank", "u32"),
    ("sync_base", "u64"), ("scratch_base", "u64"), ("scratch_half", "u64"), ("flags", "u64"),
    ("abort_word", "u64"), ("error_record", "u64"), ("semaphores", "u64"), ("barriers", "u64"),
    ("n_peers", "u32"), ("n_remote", "u32"), ("n_channels", "u32"), ("n_semaphores", "u32"),
    ("peer_abort_table", "u64"), ("remote_table", "u64"), ("channel_table", "u64"),
    ("block_table", "u64"), ("counts", "u64"), ("row_bytes", "u64"), ("capacity", "u64"), ("seg_table", "u64"),
    ("check_table", "u64"), ("n_ranks", "u32"), ("n_checks", "u32"),
))
COUNT_CHECK = Struct("CountCheck", (("kind", "u32"), ("rank", "u32"), ("first", "u32"), ("count", "u32")))
REMOTE_BUF = Struct("RemoteBuf", (("base", "u64"), ("kind", "u32"), ("pad", "u32")))
CHANNEL_DEV = Struct("ChannelDev", (("inbound", "u64"), ("remote_inbound", "u64"), ("expected", "u64")))
BLOCK_ENTRY = Struct("BlockEntry", (("offset", "u32"), ("bytes", "u32")))
BLOCK_HEADER = Struct("BlockHeader", (("n_ops", "u32"), ("bytes", "u32"), ("n_finals", "u32"), ("pad", "u32")))
DEV_OP = Struct("DevOp", (
    ("kind", "u8"), ("n_src", "u8"), ("n_dst", "u8"), ("n_ids", "u8"), ("n_pieces", "u16"),
    ("flags", "u16"), ("bytes", "u32"), ("index", "u32"), ("tbg_member", "u32"), ("tbg_size", "u32"),
    ("total", "u64"), ("aux0", "u32"), ("aux1", "u32"), ("tbg_unit", "u64"),
))
ERROR_RECORD = Struct("ErrorRecord", (
    ("state", "u32"), ("rank", "i32"), ("block", "i32"), ("op_index", "i32"), ("what", "i32"),
    ("channel", "i32"), ("expected", "u64"), ("seen", "u64"), ("elapsed_ns", "u64"),
    ("host_ack", "u32"), ("pad", "u32"),
))

#: the epilogue kernels' parameter (executor/epilogue.cuh; mscclang.runtime.epilogue packs it)
EPI_ARGS = Struct("EpiArgs", (
    ("residual", "u64"), ("weight", "u64"), ("hidden", "u32"), ("wdt", "u32"), ("quant", "u32"),
    ("eps", "f32"), ("scale", "f32"), ("pad", "u32"),
))

ALL_STRUCTS = (PLAN_HEADER, REMOTE_BUF, CHANNEL_DEV, BLOCK_ENTRY, BLOCK_HEADER, DEV_OP, ERROR_RECORD, EPI_ARGS,
               COUNT_CHECK)

# constants that must match plan_layout.cuh (asserted too)
CONSTANTS = {
    "MSCCLANG_PLAN_MAGIC": 0x4C43534D,
    "MSCCLANG_PLAN_VERSION": 2,
    "MSCCLANG_MAX_FLAGS": 1024,
    "MSCCLANG_MAX_BARRIERS": 64,
    "MSCCLANG_MAX_OPERANDS": 16,
    "MSCCLANG_MAX_IDS": 32,
    "DOP_NOP": 0, "DOP_BARRIER": 1, "DOP_SIGNAL": 2, "DOP_WAIT": 3, "DOP_DATA": 4,
    "DOP_SEM_ACQUIRE": 5, "DOP_SEM_RELEASE": 6, "DOP_PIPELINE": 7,
    "OPND_SLOT_INPUT": 0, "OPND_SLOT_OUTPUT": 1, "OPND_SLOT_SCRATCH": 2, "OPND_SLOT_REMOTE0": 3,
    "OPND_MODE_PACKET": 1, "BUF_KIND_INPUT": 0, "BUF_KIND_OUTPUT": 1, "BUF_KIND_SCRATCH": 2,
    "WHAT_SIGNAL": 1, "WHAT_PACKET": 2, "WHAT_BARRIER": 3, "WHAT_SEMAPHORE": 4,
    "WHAT_PEER_ABORT": 5, "WHAT_PORT_FLUSH": 6, "WHAT_COUNTS": 7,
    "FLAG_RELAXED": 1, "FLAG_READS_PACKETS": 2, "FLAG_SEGMENTS": 4, "SEG_SLOT": 0xFFFFFFFF,
    "CHECK_NONNEG": 0, "CHECK_EXPECT": 1, "CHECK_INPUT": 2, "CHECK_OUTPUT": 3, "CHECK_SCRATCH": 4,
    "DOP_PORT_TRIGGER": 8, "DOP_PORT_FLUSH": 9, "DOP_PORT_FINAL": 10,
    "DOP_RADD": 13, "DOP_RMSNORM": 14, "OPND_SLOT_RESIDUAL": 255,
    "EPI_W_F32": 0, "EPI_W_ACT": 1, "EPI_Q_NONE": 0, "EPI_Q_E4M3": 1, "EPI_Q_E5M2": 2, "EPI_MAX_HIDDEN": 65536,
}


def layout_asserts() -> str:
    """C++ source with one static_assert per struct size, field offset and constant."""
    lines = ['#include "epilogue.cuh"']
    for s in ALL_STRUCTS:
        lines += s.asserts()
    for name, val in CONSTANTS.items():
        lines.append(f'static_assert((u64)({name}) == {val}ull, "{name} drifted");')
    return "\n".join(lines) + "\n"
