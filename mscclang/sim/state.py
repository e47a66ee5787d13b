"""Per-rank memory of a simulation: user buffers (with in-place aliasing), scratch with LL
packets, and the optional symbolic shadow that follows every byte moved (one row of symbol
counts per ``granule`` bytes, and the id of the value's reduction expression).

Packets: payload word ``w`` (plain scratch bytes ``4w .. 4w+3``) lives at scratch byte
``half + 8w`` with its flag word at ``half + 8w + 4``. This is exactly the LL8 layout
``{data, flag}`` and the LL16 layout ``{data0, flag, data1, flag}`` (packet ``w // 2``); LL16
writes whole 16-byte packets, so its writes are rounded to an even number of words.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.layout import Layout
from mscclang.plan.models import BufferKind, Plan


#: the simulator's default and least symbolic granule: the bytes of a buffer one row of a
#: symbolic shadow stands for (a run may take any larger power of two that divides what it moves)
SYM_GRANULE = 4
#: the largest row of a symbolic shadow, in bytes (``verify``'s coarsest granule)
MAX_SYMBOLIC_GRANULE = 4096


def granule_of(values: Iterable[int]) -> int:
    """The largest power of two from :data:`SYM_GRANULE` to :data:`MAX_SYMBOLIC_GRANULE` that
    divides every one of ``values`` (:data:`SYM_GRANULE` when no larger one does)."""
    g = MAX_SYMBOLIC_GRANULE
    for v in values:
        while g > SYM_GRANULE and v % g:
            g //= 2
    return g


class RankMemory:
    """Buffers of one rank. Storage keys: ``"in"``, ``"out"``, ``"scr"``."""

    def __init__(self, plan: Plan, spec: CollectiveSpec, rank: int, layout: Layout,
                 nsym: int = 0, granule: int = SYM_GRANULE, residual: bool = False) -> None:
        self.rank = rank
        self.layout = layout
        ib, ob = layout.input_bytes, layout.output_bytes
        self.alias: dict[BufferKind, tuple[str, int]] = {}
        self.storage: dict[str, np.ndarray] = {}
        ii = spec.input_in_output(rank)
        oi = spec.output_in_input(rank)
        if ii is not None:
            off = layout.span(BufferKind.output, ii)[0] if layout.output.num_chunks else 0
            self.storage["out"] = np.zeros(max(ob, off + ib), dtype=np.uint8)
            self.alias[BufferKind.output] = ("out", 0)
            self.alias[BufferKind.input] = ("out", off)
        elif oi is not None:
            off = layout.span(BufferKind.input, oi)[0] if layout.input.num_chunks else 0
            self.storage["in"] = np.zeros(max(ib, off + ob), dtype=np.uint8)
            self.alias[BufferKind.input] = ("in", 0)
            self.alias[BufferKind.output] = ("in", off)
        else:
            self.storage["in"] = np.zeros(ib, dtype=np.uint8)
            self.storage["out"] = np.zeros(ob, dtype=np.uint8)
            self.alias[BufferKind.input] = ("in", 0)
            self.alias[BufferKind.output] = ("out", 0)
        # plan/2: the residual, laid out as the input (empty when the plan has no epilogue:
        # ``residual``, Plan.has_epilogue_ops, found once for every rank by the caller)
        self.storage["res"] = np.zeros(ib if residual else 0, dtype=np.uint8)
        self.alias[BufferKind.residual] = ("res", 0)
        sb = layout.scratch_alloc_bytes
        sb += (-sb) % 8
        self.storage["scr"] = np.zeros(sb, dtype=np.uint8)
        self.alias[BufferKind.scratch] = ("scr", 0)
        self.double = plan.use_double_scratch_buffer
        self.scratch_half = sb // 2 if self.double else 0
        self.scr32 = self.storage["scr"].view(np.uint32)
        self.half = 0
        self.flag = 0
        self.shadow: Optional[dict[str, np.ndarray]] = None
        #: per granule the id of its value's reduction expression (mscclang.sim.exprs)
        self.expr: Optional[dict[str, np.ndarray]] = None
        if nsym:
            self.shadow = {k: np.zeros((-(-v.shape[0] // granule), nsym), dtype=np.int16)
                           for k, v in self.storage.items()}
            self.expr = {k: np.zeros(v.shape[0], dtype=np.int32) for k, v in self.shadow.items()}

    def set_launch(self, launch: int) -> None:
        """Launch ``launch`` (1-based) uses flag ``launch``; with double scratch, half 0 when the
        flag is odd and half 1 when it is even."""
        self.flag = launch
        self.half = self.scratch_half if (self.double and launch % 2 == 0) else 0

    def addr(self, kind: BufferKind, off: int, half: int) -> tuple[str, int]:
        """(storage key, byte address) of plain offset ``off`` of buffer ``kind``; scratch adds
        ``half`` (the executing rank's half)."""
        key, base = self.alias[kind]
        if kind == BufferKind.scratch:
            base += half
        return key, base + off

    # packets -----------------------------------------------------------------------------
    def ready_bytes(self, off: int, n: int, flag: int, half: int) -> int:
        """How many leading payload bytes of plain scratch range [off, off+n) carry ``flag``."""
        w0 = off // 4
        w1 = -(-(off + n) // 4)
        h4 = half // 4
        flags = self.scr32[h4 + 2 * w0 + 1: h4 + 2 * w1 + 1: 2]
        ok = flags == flag
        if ok.all():
            return n
        k = int(np.argmin(ok))
        return max(0, min(n, 4 * (w0 + k) - off))

    def read_packets(self, off: int, n: int, half: int) -> np.ndarray:
        w0 = off // 4
        w1 = -(-(off + n) // 4)
        h4 = half // 4
        data = self.scr32[h4 + 2 * w0: h4 + 2 * w1: 2].copy().view(np.uint8)
        s = off - 4 * w0
        return data[s: s + n]

    def packet_words(self, off: int, n: int, ll16: bool) -> tuple[int, int]:
        w0 = off // 4
        w1 = -(-(off + n) // 4)
        if ll16 and w1 % 2:
            w1 += 1
        return w0, w1

    def write_packets(self, off: int, data: np.ndarray, flag: int, ll16: bool,
                      half: int) -> tuple[int, int]:
        """Pack payload ``data`` for plain scratch offset ``off``; payload past the data is zero.
        Returns the scratch byte range written."""
        n = data.shape[0]
        w0, w1 = self.packet_words(off, n, ll16)
        h = half
        h4 = h // 4
        words = np.zeros(w1 - w0, dtype=np.uint32)
        wb = words.view(np.uint8)
        s = off - 4 * w0
        wb[s: s + n] = data
        self.scr32[h4 + 2 * w0: h4 + 2 * w1: 2] = words
        self.scr32[h4 + 2 * w0 + 1: h4 + 2 * w1 + 1: 2] = flag
        return h + 8 * w0, h + 8 * w1

    def pad_packets(self, a: int, b: int, flag: int, ll16: bool, half: int) -> tuple[int, int]:
        """Zero-payload packets for plain scratch bytes [a, b) (a slot tail)."""
        w0 = -(-a // 4)
        if ll16 and w0 % 2:
            w0 += 1
        w1 = -(-b // 4)
        if ll16 and w1 % 2:
            w1 += 1
        if w1 <= w0:
            return 0, 0
        h4 = half // 4
        self.scr32[h4 + 2 * w0: h4 + 2 * w1: 2] = 0
        self.scr32[h4 + 2 * w0 + 1: h4 + 2 * w1 + 1: 2] = flag
        return half + 8 * w0, half + 8 * w1
