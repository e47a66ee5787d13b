"""CUDA source of a plan-specialised kernel, generated from the packed device plan (it keeps the
semantics of docs/semantics.md, as the interpreter kernel does).

The interpreter kernel walks a rank's packed block regions at run time; this module reads the same
regions on the host and writes one kernel for (plan, rank, sizes, dtype, packet type, reduce op):
each block's ops become straight-line calls of the templates of ``executor/specialized.cuh`` with
every length, unit count, loop bound and operand offset a compile-time constant (thread-block
group splits and pipeline iterations resolved here, exactly as the interpreter's ``op_range`` and
piece walk do). Device addresses are not part of the source: they reach the kernel as one
``__grid_constant__`` parameter struct (:class:`ArgsLayout`), so a source depends only on the plan
and the sizes, and its cubin can be cached on disk by source hash (and prebuilt on another
machine).

Public API: :func:`parse_region`, :func:`generate` (returns a :class:`SpecSource`), and
:class:`SpecUnsupported` (raised for what the generator does not specialise; the runtime then uses
the interpreter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from mscclang.config import settings
from mscclang.errors import SpecUnsupported
from mscclang.plan.dtypes import EPILOGUE_DTYPES, KERNEL_CODES, kernel_dtype
from mscclang.plan.models import BufferKind, ChannelType, PacketType, Plan
from mscclang.runtime.device_plan import (
    DOP_BARRIER, DOP_DATA, DOP_NOP, DOP_PIPELINE, DOP_RADD, DOP_RMSNORM, DOP_SEM_ACQUIRE, DOP_SEM_RELEASE,
    DOP_SIGNAL, DOP_WAIT, FLAG_READS_PACKETS, FLAG_RELAXED, MODE_PACKET, SLOT_INPUT, SLOT_OUTPUT, SLOT_REMOTE0,
    SLOT_RESIDUAL, SLOT_SCRATCH,
)
from mscclang.runtime.packing import PackedRank
from mscclang.runtime.structs import BLOCK_HEADER, DEV_OP, EPI_ARGS

KERNEL_NAME = "mscclang_spec"
MAX_STEPS = 512          # emitted op segments of one rank, all blocks together
MAX_ARGS_BYTES = 4096    # kernel parameter struct (the classic limit, safe on every driver)
_DT = {c: (f"DT_{c.upper()}", kernel_dtype(c).itemsize) for c in KERNEL_CODES}
_OP = {"sum": "ROP_SUM", "min": "ROP_MIN", "max": "ROP_MAX"}




# --------------------------------------------------------------------------------------------
# reading packed regions


@dataclass
class Rec:
    """One device op record of a packed block region (``DevOp`` + operands, ids and pieces)."""

    kind: int
    index: int
    n_src: int
    operands: list[int]
    ids: list[int]
    pieces: list[tuple[int, int, tuple[int, ...]]]   # (length, valid, plain offset per operand)
    flags: int
    tbg_member: int
    tbg_size: int
    total: int
    aux0: int
    aux1: int
    tbg_unit: int
    inner: list["Rec"] = field(default_factory=list)  # pipeline: the inner records


def _u16s(b: bytes, off: int, n: int) -> list[int]:
    return [int.from_bytes(b[off + 2 * i:off + 2 * i + 2], "little") for i in range(n)]


def parse_region(region: bytes) -> list[Rec]:
    """The top-level records of a packed block region, pipelines holding their inner records."""
    head = BLOCK_HEADER.unpack(region)
    pos = BLOCK_HEADER.size
    flat: list[Rec] = []
    for _ in range(head["n_ops"]):
        d = DEV_OP.unpack(region, pos)
        n = d["n_src"] + d["n_dst"]
        q = pos + DEV_OP.size
        operands = _u16s(region, q, n)
        q += (2 * n + 7) // 8 * 8
        ids = _u16s(region, q, d["n_ids"])
        q += (2 * d["n_ids"] + 7) // 8 * 8
        pieces = []
        for _ in range(d["n_pieces"]):
            w = [int.from_bytes(region[q + 8 * i:q + 8 * i + 8], "little") for i in range(2 + n)]
            pieces.append((w[0], w[1], tuple(w[2:])))
            q += 8 * (2 + n)
        flat.append(Rec(d["kind"], d["index"], d["n_src"], operands, ids, pieces, d["flags"], d["tbg_member"],
                        d["tbg_size"], d["total"], d["aux0"], d["aux1"], d["tbg_unit"]))
        pos += d["bytes"]
    out: list[Rec] = []
    i = 0
    while i < len(flat):
        r = flat[i]
        if r.kind == DOP_PIPELINE:
            r.inner = flat[i + 1:i + 1 + r.aux0]
            i += 1 + r.aux0
        else:
            i += 1
        out.append(r)
    return out


def op_range(r: Rec, it: Optional[int], unit: int) -> tuple[int, int]:
    """Stream range [A, B) of a data record for this block: the pipeline iteration's slice, then
    the thread-block-group split (the interpreter's ``op_range``)."""
    total = r.total
    a, b = 0, total
    if it is not None:
        a = min(it * unit, total)
        b = min(it * unit + unit, total)
    if r.tbg_size > 1:
        length, u = b - a, r.tbg_unit
        units = (length + u - 1) // u
        q, rem, m = units // r.tbg_size, units % r.tbg_size, r.tbg_member
        s = m * q + min(m, rem)
        e = s + q + (1 if m < rem else 0)
        return a + min(s * u, length), a + min(e * u, length)
    return a, b


@dataclass(frozen=True)
class SubRange:
    """A data record's piece clipped to the block's range: ``length`` bytes of the plain stream,
    the first ``valid`` of them from the plain sources, operand k at byte offset ``offsets[k]`` of
    its buffer (already doubled for packet operands)."""

    length: int
    valid: int
    offsets: tuple[int, ...]


def sub_ranges(r: Rec, it: Optional[int] = None, unit: int = 0) -> list[SubRange]:
    """The interpreter's piece walk of ``run_data`` for one record, on the host."""
    lo_b, hi_b = op_range(r, it, unit)
    out: list[SubRange] = []
    if lo_b >= hi_b:
        return out
    pos = 0
    for plen, pvalid, offs in r.pieces:
        lo, hi = max(lo_b, pos), min(hi_b, pos + plen)
        if lo < hi:
            d = lo - pos
            ln = hi - lo
            o = tuple((2 * (x + d) if (r.operands[k] >> 8) & MODE_PACKET else x + d) for k, x in enumerate(offs))
            out.append(SubRange(ln, min(max(pvalid - d, 0), ln), o))
        pos += plen
        if pos >= hi_b:
            break
    return out


# --------------------------------------------------------------------------------------------
# kernel parameters


@dataclass(frozen=True)
class ArgsLayout:
    """The kernel's parameter struct ``SpecArgs``: fixed u64 fields, then peer abort words,
    remote buffer bases and channels (three u64 each). Everything is 8-byte aligned."""

    n_peers: int
    n_remote: int
    n_channels: int
    epi: bool = False    # the call's EpiArgs follow the fixed fields (plans with epilogue ops)

    HEAD = ("in", "out", "in_delta", "out_delta", "timeout_ns", "flags", "abort_word", "err", "sems", "bars",
            "scratch", "half", "rank_npeers")

    @property
    def epi_args(self) -> int:
        """Offset of the EpiArgs (written per launch, like the first five words)."""
        return 8 * len(self.HEAD)

    @property
    def peer_abort(self) -> int:
        return 8 * len(self.HEAD) + (EPI_ARGS.size if self.epi else 0)

    @property
    def remote(self) -> int:
        return self.peer_abort + 8 * max(self.n_peers, 1)

    @property
    def chan(self) -> int:
        return self.remote + 8 * max(self.n_remote, 1)

    @property
    def size(self) -> int:
        return self.chan + 24 * max(self.n_channels, 1)

    def offset(self, name: str) -> int:
        return 8 * self.HEAD.index(name)

    def c_struct(self) -> str:
        f = [
            "  u8* in;", "  u8* out;", "  u64 in_delta;", "  u64 out_delta;", "  u64 timeout_ns;",
            "  u32* flags;", "  u32* abort_word;", "  ErrorRecord* err;", "  i64* sems;", "  u64* bars;",
            "  u8* scratch;", "  u64 half;", "  i32 rank;", "  u32 n_peers;", *(["  EpiArgs epi;"] if self.epi else []),
            f"  u64 peer_abort[{max(self.n_peers, 1)}];", f"  u8* remote[{max(self.n_remote, 1)}];",
            f"  ChannelDev chan[{max(self.n_channels, 1)}];",
        ]
        lines = ["struct SpecArgs {"] + f + ["};"]
        checks = [(n, self.offset(n)) for n in self.HEAD if n != "rank_npeers"]
        checks += [("epi", self.epi_args)] if self.epi else []
        checks += [("rank", self.offset("rank_npeers")), ("n_peers", self.offset("rank_npeers") + 4),
                   ("peer_abort", self.peer_abort), ("remote", self.remote), ("chan", self.chan)]
        lines.append(f'static_assert(sizeof(SpecArgs) == {self.size}, "sizeof(SpecArgs) drifted");')
        # field offsets: checked where the compiler has __builtin_offsetof (CI defines the macro;
        # NVRTC 13.0 on the GPU machines lacks the builtin)
        lines.append("#ifdef MSCCLANG_CHECK_LAYOUT")
        for n, o in checks:
            lines.append(f'static_assert(__builtin_offsetof(SpecArgs, {n}) == {o}, "SpecArgs.{n} drifted");')
        lines.append("#endif")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# generation


@dataclass(frozen=True)
class SpecSource:
    """A generated kernel: its CUDA source, launch shape and parameter layout."""

    source: str
    kernel: str
    n_blocks: int
    nthreads: int
    args: ArgsLayout
    steps: int


def _ull(x: int) -> str:
    return f"{int(x)}ull"


class _Gen:
    def __init__(self, plan: Plan, packed: PackedRank, dtype: str, packet: str, reduce_op: str, nt: int,
                 remote_kinds: Sequence[BufferKind]) -> None:
        self.plan = plan
        self.packed = packed
        self.dt, self.es = _DT[dtype]
        self.op = _OP[reduce_op]
        pt = PacketType.of(packet)
        self.pkt, self.P = pt.size, pt.align
        self.nt = nt
        self.remote_kinds = list(remote_kinds)
        self.steps = 0
        self.n_blocks = len(packed.blocks)
        # early: advance the flag right after the first op, behind a block barrier, so the flag stores
        # drain while the block waits for its peers; a launch that finds the abort word set leaves them
        self.early_flags = settings.spec_flags == "early"

    # operand pointer expressions --------------------------------------------------------------
    def base(self, desc: int) -> str:
        slot = desc & 0xFF
        if slot == SLOT_RESIDUAL:
            return "res"
        if slot == SLOT_INPUT:
            return "a.in"
        if slot == SLOT_OUTPUT:
            return "a.out"
        if slot == SLOT_SCRATCH:
            return "scr"
        k = slot - SLOT_REMOTE0
        if not 0 <= k < len(self.remote_kinds):
            raise SpecUnsupported(f"operand slot {slot} names remote buffer {k}, not declared")
        kind = self.remote_kinds[k]
        return {BufferKind.input: f"rin{k}", BufferKind.output: f"rout{k}", BufferKind.scratch: f"rscr{k}"}[kind]

    def ptrs(self, r: Rec, offs: Sequence[int], shift: int = 0, packet_scale: bool = False) -> str:
        parts = []
        for k, (d, o) in enumerate(zip(r.operands, offs)):
            extra = shift * (2 if ((d >> 8) & MODE_PACKET and packet_scale) else 1)
            parts.append(f"{self.base(d)} + {_ull(o + extra)}")
        return "{" + ", ".join(parts) + "}"

    # data ops -----------------------------------------------------------------------------------
    def plain(self, r: Rec, sr: SubRange, gate: bool) -> list[str]:
        ns, nd = r.n_src, len(r.operands) - r.n_src
        o0 = sr.offsets[0]
        mis16 = mis4 = 0
        for o in sr.offsets[1:]:
            mis16 |= (o ^ o0) & 15
            mis4 |= (o ^ o0) & 3
        ln = sr.length
        segs: list[tuple[int, int, int]] = []   # (start, bytes, unit)
        if mis16 == 0 or mis4 == 0:
            a = 16 if mis16 == 0 else 4
            head = min((a - o0 % a) % a, ln)
            body = (ln - head) // a * a
            tail = ln - head - body
            segs = [(0, head, self.es), (head, body, a), (head + body, tail, self.es)]
        else:
            if self.es == 4:
                raise SpecUnsupported("4-byte elements at offsets that are not 4-byte aligned")
            segs = [(0, ln, self.es)]
        out = []
        for start, nbytes, v in segs:
            if nbytes == 0:
                continue
            if nbytes % v or any((o + start) % v for o in sr.offsets):
                raise SpecUnsupported(f"op {r.index}: a plain range of {nbytes} bytes at offsets {sr.offsets} "
                                      f"does not split into {v}-byte units")
            n = nbytes // v
            u = max(1, min(4, math.ceil(n / (self.nt)), 8 // max(ns, 1)))
            if n >= 2**32:
                raise SpecUnsupported("range too large")
            self.steps += 1
            out.append(f"  {{ u8* const p[{ns + nd}] = {self.ptrs(r, sr.offsets, start)};\n"
                       f"    ok = ok && sp_plain<DT, OP, {ns}, {nd}, NT, {u}, {v}, {n}u, {str(gate).lower()}>"
                       f"(p, stop); }}")
        return out

    def packets(self, r: Rec, sr: SubRange, gate: bool) -> list[str]:
        ns, nd = r.n_src, len(r.operands) - r.n_src
        P = self.P
        pmask = 0
        for k, d in enumerate(r.operands):
            if (d >> 8) & MODE_PACKET:
                pmask |= 1 << k
                if sr.offsets[k] % (2 * P):
                    raise SpecUnsupported(f"op {r.index}: packet operand {k} at byte offset {sr.offsets[k]} is not "
                                          f"aligned to {2 * P}-byte packets")
        aligned = all(sr.offsets[k] % P == 0 for k in range(len(r.operands)) if not pmask >> k & 1)
        valid = min(sr.valid, sr.length)
        nfull = valid // P if aligned else 0
        nunits = (sr.length + P - 1) // P
        if nunits >= 2**32:
            raise SpecUnsupported("range too large")
        g = str(gate).lower()
        out = []
        if nfull:
            u = max(1, min(4, math.ceil(nfull / self.nt), 8 // max(ns, 1)))
            self.steps += 1
            out.append(f"  {{ u8* const p[{ns + nd}] = {self.ptrs(r, sr.offsets)};\n"
                       f"    ok = ok && sp_packets<DT, OP, PKT, NT, {u}, {ns}, {nd}, {pmask:#x}u, {nfull}u, {g}>"
                       f"(a, {r.index}, p, flag, stop); }}")
        if nunits > nfull:
            self.steps += 1
            out.append(f"  {{ u8* const p[{ns + nd}] = {self.ptrs(r, sr.offsets)};\n"
                       f"    ok = ok && sp_packets_generic<DT, OP, PKT, NT, {ns}, {nd}, {pmask:#x}u, {_ull(nfull)}, "
                       f"{_ull(nunits)}, {_ull(sr.length)}, {_ull(valid)}, {g}>(a, {r.index}, p, flag, stop); }}")
        return out

    def data(self, r: Rec, it: Optional[int], unit: int, gate: bool, last: bool) -> list[str]:
        lines = [f"  // op {r.index}: data, {r.n_src} src, {len(r.operands) - r.n_src} dst"
                 + (f", pipeline iteration {it}" if it is not None else "")]
        packet = any((d >> 8) & MODE_PACKET for d in r.operands)
        for sr in sub_ranges(r, it, unit):
            lines += self.packets(r, sr, gate) if packet else self.plain(r, sr, gate)
        if gate:
            lines.append(_STOP_CHECK)
        if (r.flags & FLAG_READS_PACKETS) and not last:
            lines.append("  if (__syncthreads_or(!ok)) return;")
        else:
            lines.append("  if (!ok) return;")
        return lines

    # other ops ----------------------------------------------------------------------------------
    def sync(self, r: Rec) -> list[str]:
        k = r.kind
        self.steps += 1
        if k == DOP_NOP:
            return [f"  __syncthreads();  // op {r.index}: nop"]
        if k == DOP_BARRIER:
            return [f"  {{ bool okb = true;  // op {r.index}: barrier {r.aux0} of {r.aux1} blocks",
                    "    __syncthreads();",
                    f"    if (tid == 0) okb = block_group_barrier(a, {r.index}, {r.aux0}u, {r.aux1}u);",
                    "    if (__syncthreads_or(!okb)) return; }"]
        if k in (DOP_SIGNAL, DOP_WAIT, DOP_SEM_ACQUIRE, DOP_SEM_RELEASE):
            if len(r.ids) > self.nt:
                raise SpecUnsupported(f"op {r.index} has {len(r.ids)} ids for {self.nt} threads")
            relaxed = "true" if r.flags & FLAG_RELAXED else "false"
            body = []
            for i, c in enumerate(r.ids):
                if k == DOP_SIGNAL:
                    stmt = f"channel_signal(a.chan[{c}], {relaxed});"
                elif k == DOP_WAIT:
                    stmt = f"okw = channel_wait(a, {r.index}, a.chan[{c}], {c}, {relaxed});"
                elif k == DOP_SEM_ACQUIRE:
                    stmt = f"okw = semaphore_acquire(a, {r.index}, {c});"
                else:
                    stmt = f"semaphore_release(a, {c});"
                body.append(f"    {'if' if i == 0 else 'else if'} (tid == {i}) {stmt}")
            name = {DOP_SIGNAL: "signal", DOP_WAIT: "wait", DOP_SEM_ACQUIRE: "sem_acquire",
                    DOP_SEM_RELEASE: "sem_release"}[k]
            if k in (DOP_SIGNAL, DOP_SEM_RELEASE):
                return [f"  {{  // op {r.index}: {name} {r.ids}"] + body + ["  }"]
            return ([f"  {{ bool okw = true;  // op {r.index}: {name} {r.ids}"] + body
                    + ["    if (__syncthreads_or(!okw)) return; }"])
        raise SpecUnsupported(f"op {r.index}: device op kind {k} is not specialised")

    def norm(self, r: Rec) -> list[str]:
        """An rmsnorm record: the epilogue's row loop (epilogue.cuh) over its pieces."""
        self.steps += 1
        words = ", ".join(_ull(x) for ln, v, offs in r.pieces for x in (ln, v, *offs))
        return [f"  {{ const u64 pc[{max(4 * len(r.pieces), 1)}] = {{{words}}};  // op {r.index}: rmsnorm",
                f"    epi_rmsnorm<DT>(res, a.out, a.epi, pc, {len(r.pieces)}u); }}"]

    # blocks ---------------------------------------------------------------------------------------
    def block(self, b: int, recs: list[Rec]) -> list[str]:
        flat: list[tuple[Rec, Optional[int], int, bool]] = []   # (record, iteration, unit, last)
        for i, r in enumerate(recs):
            if r.kind == DOP_PIPELINE:
                for it in range(r.aux1):
                    for x in r.inner:
                        if x.kind == DOP_PIPELINE:
                            raise SpecUnsupported("nested pipeline")
                        flat.append((x, it, r.total, False))
            else:
                flat.append((r, None, 0, i + 1 == len(recs)))
        lines = [f"    case {b}: {{"]
        body: list[str] = []
        advance = ["  __syncthreads();  // every warp has read the flag: advance it now, its stores drain meanwhile",
                   f"  sp_advance_flags<NT, {self.n_blocks}u>(a.flags, flag);"]
        for j, (r, it, unit, last) in enumerate(flat):
            if r.kind in (DOP_DATA, DOP_RADD):   # radd: a sum of (src, residual) into the residual
                body += self.data(r, it, unit, j == 0, last)
            else:
                if j == 0:
                    body.append(_STOP_CHECK)
                body += self.norm(r) if r.kind == DOP_RMSNORM else self.sync(r)
            if j == 0 and self.early_flags:
                body += advance
        if not flat:
            body.append(_STOP_CHECK)
            if self.early_flags:
                body += advance
        if not self.early_flags and self.nt > 32 and not any("__syncthreads" in ln for ln in body):
            # every warp must have read the flag before thread 0 advances it
            body.append("  __syncthreads();  // flag reads before the flag advances")
        lines += ["  " + ln for ln in "\n".join(body).split("\n")]
        lines.append("    } break;")
        return lines


_STOP_CHECK = ("  if (stop) {  // a peer or an earlier launch aborted\n"
               "    if (tid == 0) { record_error(a, -1, WHAT_PEER_ABORT, -1, 0ull, 0ull, 0ull); hold_for_host(a); }\n"
               "    return;\n"
               "  }")


def _needed_threads(g: _Gen, blocks: list[list[Rec]]) -> int:
    """Threads that give every thread at most one unit of each data range (and one id per
    channel op)."""
    need = 32
    P = g.P
    for recs in blocks:
        for r in recs:
            for x in (r.inner if r.kind == DOP_PIPELINE else [r]):
                if x.kind == DOP_RMSNORM:
                    need = 1024   # rows of any length (H is the call's): the plan's threads
                elif x.kind in (DOP_DATA, DOP_RADD):
                    its = range(r.aux1) if r.kind == DOP_PIPELINE else [None]
                    for it in its:
                        packet = any((d >> 8) & MODE_PACKET for d in x.operands)
                        for sr in sub_ranges(x, it, r.total if r.kind == DOP_PIPELINE else 0):
                            need = max(need, (sr.length + P - 1) // P if packet else (sr.length + 15) // 16)
                else:
                    need = max(need, len(x.ids))
    return need


def choose_threads(plan: Plan, packed: PackedRank, packet: str = "ll16", mode: Optional[str] = None) -> int:
    """Threads per block of the specialised kernel: ``mode`` (default ``$MSCCLANG_SPEC_THREADS``)
    'plan' keeps the plan's ``num_threads_per_block``; 'auto' (default) uses the fewest warps that
    give every thread at most one packet / 16-byte vector of each data range, capped at the plan's
    count; a number forces that count. Anything else is SpecUnsupported naming the variable."""
    mode = (mode if mode is not None else settings.spec_threads).strip().lower()
    nt_plan = plan.num_threads_per_block
    if mode == "plan":
        return nt_plan
    if mode.isdigit():
        n = int(mode)
        if not 1 <= n <= 1024:
            raise SpecUnsupported(f"MSCCLANG_SPEC_THREADS={mode}: need 1..1024")
        return n
    if mode != "auto":
        raise SpecUnsupported(f"MSCCLANG_SPEC_THREADS={mode!r}: use auto, plan or a count 1..1024")
    g = _Gen(plan, packed, "f16", packet, "sum", nt_plan, [])
    need = _needed_threads(g, [parse_region(b.region) for b in packed.blocks])
    return min(nt_plan, (need + 31) // 32 * 32)


def generate(plan: Plan, packed: PackedRank, dtype: str, packet: str, reduce_op: str,
             nthreads: Optional[int] = None, max_steps: int = MAX_STEPS) -> SpecSource:
    """The specialised kernel of ``packed`` (one rank's device plan at one size) for ``dtype``
    ('f16', 'bf16', 'f32', 'i32', 'f8e4m3_a32', ...: :data:`~mscclang.plan.dtypes.KERNEL_CODES`), ``packet`` ('ll16', 'll8') and ``reduce_op`` ('sum', 'min',
    'max'). Raises SpecUnsupported for what it does not specialise (port/switch ops, more than
    ``max_steps`` op segments, parameters over 4 KiB, misaligned packet offsets)."""
    if (dtype not in _DT or packet not in {p.code for p in PacketType} or reduce_op not in _OP
            or (kernel_dtype(dtype).accumulates and reduce_op != "sum")):
        raise SpecUnsupported(f"unsupported combination {dtype}/{packet}/{reduce_op}")
    if plan.has_segments():
        raise SpecUnsupported("a plan with segments runs on the interpreter (its lengths come from the count matrix)")
    rank = packed.rank
    g_plan = plan.gpus[rank]
    remote_kinds = [rb.type for rb in g_plan.remote_buffers]
    blocks = [parse_region(b.region) for b in packed.blocks]
    nt = nthreads or choose_threads(plan, packed, packet)
    from mscclang.runtime.device_plan import peers_of

    epi = any(r.kind in (DOP_RADD, DOP_RMSNORM) or any((d & 0xFF) == SLOT_RESIDUAL for d in r.operands)
              for recs in blocks for top in recs for r in [top, *top.inner])
    if epi and (reduce_op != "sum" or kernel_dtype(dtype).name not in EPILOGUE_DTYPES):
        raise SpecUnsupported(f"epilogue ops run sum on f16, bf16 or f32, not {reduce_op} on {dtype}")
    args = ArgsLayout(len(peers_of(plan, rank)), len(remote_kinds),
                      len(plan.channel_ordinals(rank, ChannelType.memory)), epi)
    if args.size > MAX_ARGS_BYTES:
        raise SpecUnsupported(f"kernel parameters of {args.size} bytes exceed {MAX_ARGS_BYTES}")
    g = _Gen(plan, packed, dtype, packet, reduce_op, nt, remote_kinds)
    cases: list[str] = []
    for b, recs in enumerate(blocks):
        cases += g.block(b, recs)
        if g.steps > max_steps:
            raise SpecUnsupported(f"rank {rank}: more than {max_steps} op segments to specialise")
    nb = len(blocks)
    remote_lines = []
    for k, kind in enumerate(remote_kinds):
        expr = {BufferKind.input: ("rin", "a.in_delta"), BufferKind.output: ("rout", "a.out_delta"),
                BufferKind.scratch: ("rscr", "half")}[kind]
        remote_lines.append(f"  u8* const {expr[0]}{k} = a.remote[{k}] + {expr[1]};")
    src = "\n".join([
        "// mscclang plan-specialised kernel (generated by mscclang.runtime.spec_source; do not edit)",
        f"// plan {plan.name!r} ({plan.collective}), rank {rank} of {plan.world_size}, input {packed.input_bytes} B, "
        f"output {packed.output_bytes} B, {dtype} {packet} {reduce_op}, {nb} blocks x {nt} threads",
        '#include "specialized.cuh"',
        f"#define DT {g.dt}",
        f"#define OP {g.op}",
        f"#define PKT {g.pkt}",
        f"#define NT {nt}",
        args.c_struct(),
        f'extern "C" __global__ void __launch_bounds__({nt}, 1) {KERNEL_NAME}(const __grid_constant__ SpecArgs a) {{',
        "  const u32 tid = threadIdx.x;",
        "  // flag and abort word load together (no dependent load before data moves)",
        "  const u32 flag = __ldcg(a.flags + blockIdx.x);",
        "  const u32 stop = __any_sync(__activemask(), __ldcg(a.abort_word) != 0u) ? 1u : 0u;",
        "  const u64 half = (flag & 1u) ? 0ull : a.half;",
        "  u8* const scr = a.scratch + half;",
        *(["  u8* const res = (u8*)a.epi.residual;"] if epi else []),
        *remote_lines,
        "  bool ok = true;",
        "  switch (blockIdx.x) {",
        *cases,
        "    default: break;",
        "  }",
        *([] if g.early_flags else [f"  sp_advance_flags<NT, {nb}u>(a.flags, flag);"]),
        "}",
        "",
    ])
    return SpecSource(src, KERNEL_NAME, nb, nt, args, g.steps)
