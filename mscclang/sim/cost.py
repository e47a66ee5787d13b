"""A cost model of a plan on a GPU topology: a predicted time per op, per thread block and in
total, with no GPU.

The model replays every rank's thread blocks as sequential workers (the plan's own op order) and
times each op:

* a data op moves its bytes (from :mod:`mscclang.plan.layout` at the call's sizes) at the rate of
  the slowest resource it uses: one thread block's copy rate, or its share of a link when an
  operand is on a peer (the link's bandwidth per direction split among the rank's thread blocks
  that use that link), or its share of local memory; LL-packet operands move twice their bytes
  (the flag words) at the packet rate; a remote write lands a link latency later;
* a ``signal`` becomes visible to the paired channel's waits a flag latency later (the pairing
  rule of :meth:`~mscclang.plan.models.Plan.paired_end`; the n-th wait consumes the n-th signal),
  and a ``wait`` ends at the latest of its signals; a read of packets waits for the op that wrote
  them; barriers and semaphores join the rank's thread blocks;
* the launch costs a fixed time before the first op.

Links: memory channels and zero-copy buffers between GPUs of one node (NVLink, SM stores), port
channels (copy engine) within a node, and port channels between nodes (the engine). A
:class:`Topology` names the node layout and the :class:`CostModel` rates; :data:`H200` holds the
rates calibrated from the 2x H200 bench (``mscclang/sim/h200_calibration.json``, refitted with
``mscclang predict --calibrate``). What it does not model: contention between concurrent
kernels, L2 effects, the host, the specialised kernel's unrolling (the bench runs it where it
exists), and pipelines beyond their total bytes.
"""

from __future__ import annotations

import math

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from mscclang.errors import PlanError
from mscclang.plan.layout import make_layouts
from mscclang.plan.models import SIGNAL_OPS, SYNC_OPS, WAIT_OPS, BufferKind, BufferRef, ChannelType, Op, OpName, Plan
from mscclang.plan.topology import Topology as NodeLayout, check_topology

_CALIBRATION = Path(__file__).with_name("h200_calibration.json")
_SYNC = SYNC_OPS | {OpName.barrier, OpName.nop}


@dataclass(frozen=True)
class CostModel:
    """Rates and latencies (GB/s are 1e9 bytes per second, per direction; times in us)."""

    link_gbps: float = 363.0        # NVLink per direction, SM stores (2x H200 floor)
    port_gbps: float = 386.5        # copy engine per direction within a node
    engine_gbps: float = 45.0       # between nodes, per direction
    link_us: float = 0.9            # a remote write's latency
    engine_us: float = 8.0          # a transfer between nodes
    block_gbps: float = 40.0        # what one thread block copies or reduces
    packet_gbps: float = 20.0       # what one thread block moves in LL packets (payload and flags)
    local_gbps: float = 2500.0      # HBM shared by a rank's blocks (read + write)
    flag_us: float = 1.21           # a signal seen by its wait (half the 2.42 us round trip)
    launch_us: float = 0.6          # a CUDA-graph kernel launch
    op_us: float = 0.05             # per op, what any op costs
    peer_exponent: float = 0.0      # a GPU reaching k peers of its node gets link_gbps * k**-peer_exponent


@dataclass(frozen=True)
class Topology:
    """``nodes`` nodes of ``gpus_per_node`` GPUs, with ``model``'s rates."""

    gpus_per_node: int
    nodes: int = 1
    model: CostModel = field(default_factory=CostModel)

    def same_node(self, a: int, b: int) -> bool:
        return a // self.gpus_per_node == b // self.gpus_per_node


def calibrated() -> CostModel:
    """The H200 model: defaults overridden by the shipped calibration file."""
    try:
        data = json.loads(_CALIBRATION.read_text())
    except (OSError, ValueError):
        return CostModel()
    return replace(CostModel(), **{k: float(v) for k, v in data.get("model", {}).items()
                                   if k in CostModel.__dataclass_fields__})


def load_topology(spec: str, world_size: int) -> Topology:
    """A topology from ``spec`` (case-insensitive): ``"nvlink"`` (one node of ``world_size`` GPUs),
    ``"NxM"`` (N nodes of M GPUs) or a JSON file ``{"gpus_per_node": M, "nodes": N, "model": {...}}``
    (``nodes`` default 1) whose model entries override the calibrated rates. PlanError naming the
    spec and what is wrong with it (the entry of the file), or that it does not fit the plan."""
    form = spec.strip().lower()
    if form == "nvlink":
        return Topology(world_size, 1, calibrated())
    if re.fullmatch(r"\d+x\d+", form):
        n, m, over = *(int(v) for v in form.split("x")), {}
    else:
        n, m, over = _topology_file(spec)
    if n < 1 or m < 1:
        raise PlanError(f"topology {spec!r}: {n} nodes of {m} GPUs; a topology has at least one node of one GPU")
    if n * m != world_size:
        raise PlanError(f"topology {spec!r} has {n} x {m} = {n * m} GPUs; the plan has {world_size} ranks")
    return Topology(m, n, replace(calibrated(), **{k: float(v) for k, v in over.items()}))


class _TopologyFile(BaseModel):
    """A topology file: ``{"gpus_per_node": M, "nodes": N, "model": {RATE: VALUE, ...}}``."""

    model_config = ConfigDict(extra="forbid")
    gpus_per_node: Annotated[int, Strict(), Field(ge=1)]
    nodes: Annotated[int, Strict(), Field(ge=1)] = 1
    model: dict[Literal[tuple(CostModel.__dataclass_fields__)], Annotated[float, Strict(), Field(  # type: ignore[misc]
        ge=0, allow_inf_nan=False)]] = {}


def _topology_file(spec: str) -> tuple[int, int, dict]:
    """(nodes, GPUs per node, model entries) of a topology file; PlanError naming the wrong entry."""
    from mscclang.plan.io import validation_error

    try:
        f = _TopologyFile.model_validate_json(Path(spec).read_text())
    except OSError as e:
        raise PlanError(f"topology {spec!r}: not 'nvlink', 'NxM' or a readable JSON file ({e.strerror})") from None
    except ValidationError as e:
        err = validation_error(e)
        raise PlanError(f"topology {spec}: {err.path + ': ' if err.path else ''}{err.message}") from None
    return f.nodes, f.gpus_per_node, f.model


@dataclass(frozen=True)
class OpTime:
    """One op's predicted interval on one thread block."""

    rank: int
    tb: int
    index: int
    name: str
    start_us: float
    end_us: float
    nbytes: int
    peer: Optional[int]
    waited_us: float
    src: Optional[str]


@dataclass(frozen=True)
class Prediction:
    """The predicted ops and the total (the last op's end)."""

    plan: str
    input_bytes: int
    output_bytes: int
    total_us: float
    ops: list[OpTime]

    def chrome_trace(self) -> dict:
        """Chrome trace-event JSON: one process per rank, one thread per thread block."""
        ev: list[dict[str, Any]] = []
        for o in self.ops:
            args = {"op": o.name, "bytes": o.nbytes, "index": o.index, "waited_us": round(o.waited_us, 3)}
            if o.peer is not None:
                args["peer"] = o.peer
            if o.src:
                args["src"] = o.src
            ev.append({"name": o.name, "ph": "X", "pid": o.rank, "tid": o.tb, "ts": o.start_us,
                       "dur": max(o.end_us - o.start_us, 0.0), "args": args})
        for r in sorted({o.rank for o in self.ops}):
            ev.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r} (predicted)"}})
        return {"traceEvents": ev, "displayTimeUnit": "ns",
                "otherData": {"plan": self.plan, "predicted_total_us": round(self.total_us, 3)}}


@dataclass(eq=False)
class _Block:
    rank: int
    tb: Any
    pc: int = 0
    t: float = 0.0
    barriers: dict = field(default_factory=dict)   # barrier id -> how many this block passed


class _Model:
    def __init__(self, plan: Plan, topo: Topology, in_bytes: int, out_bytes: int, row_bytes: int = 0) -> None:
        self.plan, self.topo, self.m = plan, topo, topo.model
        self.layouts = make_layouts(plan, in_bytes, out_bytes, row_bytes)
        self.signals: dict[tuple, list[float]] = {}    # (rank, type, channel) -> visible times
        self.waits: dict[tuple, int] = {}               # (rank, type, channel) -> waits consumed
        self.written: dict[tuple, float] = {}           # (rank, scratch chunk) -> packets land
        self.barrier: dict[tuple, list] = {}
        self.sharers = self._sharers()
        #: how many peers of its node each rank reaches in this plan (at least 1)
        self.reach = [max(1, len({q for tb in g.threadblocks for op in tb.ops for o in (op.ops or [op])
                                  for q in self.peers_of(g.id, tb, o) if topo.same_node(g.id, q)}))
                      for g in plan.gpus]

    # what an operand is ------------------------------------------------------------------------
    def where(self, rank: int, tb: Any, op: Op, ref: BufferRef) -> tuple[int, BufferKind, ChannelType]:
        if ref.type is not None:
            return rank, ref.type, ChannelType.none
        ct = op.channel_type if op.channel_type != ChannelType.none else ChannelType.memory
        k = tb.remote_buffer_list(ct)[ref.buffer_id or 0]
        rb = self.plan.gpus[rank].remote_buffers[k]
        return rb.rank, rb.type, ct

    def peers_of(self, rank: int, tb: Any, op: Op) -> set[int]:
        return {self.where(rank, tb, op, ref)[0] for ref in list(op.src_buff) + list(op.dst_buff)
                if ref.type is None and ref.buffer_id is not None} - {rank}

    def _sharers(self) -> dict[tuple[int, int], int]:
        """Thread blocks of each rank sharing each link (rank, peer). Within a node the GPUs hang
        off a switch: a GPU's NVLink bandwidth is shared by all its blocks that reach any peer of
        the node (key (rank, -1)); between nodes, per peer."""
        n: dict[tuple[int, int], int] = {}
        for g in self.plan.gpus:
            for tb in g.threadblocks:
                used: set[int] = set()
                for o in tb.all_ops():   # a pipeline op itself names no peer
                    used |= self.peers_of(g.id, tb, o)
                keys = {q if not self.topo.same_node(g.id, q) else -1 for q in used}
                for q in keys:
                    n[(g.id, q)] = n.get((g.id, q), 0) + 1
        return n

    def nbytes(self, rank: int, ref: BufferRef, kind: BufferKind) -> int:
        lay = self.layouts[rank]
        if ref.size == 0:
            return 0
        a, b = lay.ref_span(kind, ref.index, ref.size)
        return max(b - a, 0)

    # one op -----------------------------------------------------------------------------------
    def data_time(self, rank: int, tb: Any, op: Op) -> tuple[float, int, Optional[int], float]:
        """(duration, bytes, peer, earliest start) of a data op."""
        m = self.m
        refs = list(op.src_buff) + list(op.dst_buff)
        if not refs:
            return m.op_us, 0, None, 0.0
        kinds = [self.where(rank, tb, op, r) for r in refs]
        size = max(self.nbytes(rank, r, k[1]) for r, k in zip(refs, kinds))
        packet = op.name in (OpName.cpkt, OpName.ppkt, OpName.upkt, OpName.rppkt, OpName.repkt,
                             OpName.respkt, OpName.recpkt, OpName.recspkt)
        moved = size * len(refs) // 2 if len(refs) > 2 else size   # reads of a reduce add up
        # the copy engine moves a port put: no thread block's copy rate limits it
        engine_op = op.channel_type == ChannelType.port or op.name in (OpName.pws, OpName.pwsf)
        rate = m.packet_gbps if packet else (float("inf") if engine_op else m.block_gbps)
        peer = None
        ready = 0.0
        remote_write = False
        for i, (ref, (q, kind, ct)) in enumerate(zip(refs, kinds)):
            if q == rank:
                continue
            peer = q
            if ct == ChannelType.port or not self.topo.same_node(rank, q):
                link = m.port_gbps if self.topo.same_node(rank, q) else m.engine_gbps
            else:
                link = m.link_gbps
            if self.topo.same_node(rank, q):
                link *= self.reach[rank] ** -m.peer_exponent
            share = self.sharers.get((rank, -1 if self.topo.same_node(rank, q) else q), 1)
            rate = min(rate, link / max(share, 1))
            remote_write |= i >= len(op.src_buff)
        local = m.local_gbps / max(len(self.plan.gpus[rank].threadblocks), 1)
        rate = min(rate, local)
        if packet:
            moved *= 2
            # a packet read waits for the packets it reads (written by a peer into this scratch)
            for ref, (q, kind, _) in zip(op.src_buff, kinds):
                if q == rank and kind == BufferKind.scratch and op.name not in (OpName.cpkt, OpName.ppkt):
                    for c in range(ref.index, ref.index + ref.size):
                        ready = max(ready, self.written.get((rank, c), 0.0))
        dur = m.op_us + moved / (rate * 1e3)
        if remote_write and peer is not None:
            lat = m.link_us if self.topo.same_node(rank, peer) else m.engine_us
            dur += lat
        return dur, size, peer, ready

    def note_packet_writes(self, rank: int, tb: Any, op: Op, end: float) -> None:
        for ref in op.dst_buff:
            q, kind, _ = self.where(rank, tb, op, ref)
            if kind == BufferKind.scratch and q != rank:
                for c in range(ref.index, ref.index + ref.size):
                    self.written[(q, c)] = max(self.written.get((q, c), 0.0), end)

    def channel_key(self, rank: int, tb: Any, op: Op, c: int) -> tuple:
        ct = op.channel_type if op.channel_type != ChannelType.none else ChannelType.memory
        return rank, ct, tb.channel_list(ct)[c]


def predict(plan: Plan, input_bytes: int, output_bytes: int, topology: Optional[Topology] = None,
            row_bytes: Optional[int] = None) -> Prediction:
    """The predicted timeline of one launch of ``plan`` at these sizes (bytes) on ``topology``
    (default: one node of the plan's ranks, the calibrated H200 rates). A plan whose chunks are
    rows (``chunk_unit`` "row") takes the call's input row bytes; by default rows of up to 8 KiB
    (4096 bf16 elements) that divide the input. PlanError when the GPU
    runtime would refuse the plan on that node layout (its rule and message,
    :func:`mscclang.plan.topology.check_topology`: a memory channel between nodes, say), or when
    the plan would never finish (a wait with no signal: the simulator's verify says why)."""
    topo = topology or Topology(plan.world_size, 1, calibrated())
    try:
        check_topology(plan, NodeLayout(plan.world_size, topo.gpus_per_node))
    except PlanError as e:
        raise PlanError(f"the GPU runtime refuses this plan on {topo.nodes} x {topo.gpus_per_node} GPUs: "
                        f"{e.message}", e.path) from None
    if row_bytes is None:
        row_bytes = math.gcd(input_bytes, 8192) if plan.chunk_unit == "row" else 0
    md = _Model(plan, topo, input_bytes, output_bytes, row_bytes)
    m = topo.model
    blocks = [_Block(g.id, tb, 0, m.launch_us) for g in plan.gpus for tb in g.threadblocks]
    ops: list[OpTime] = []
    pending = len(blocks)
    while pending:
        progressed = False
        for b in blocks:
            while b.pc < len(b.tb.ops):
                op = b.tb.ops[b.pc]
                step = _step(md, b, op)
                if step is None:
                    break
                ops.append(step)
                b.t = step.end_us
                b.pc += 1
                progressed = True
                if b.pc == len(b.tb.ops):
                    pending -= 1
        if not progressed and pending:
            stuck = [f"rank {b.rank} thread block {b.tb.id} op {b.pc}" for b in blocks if b.pc < len(b.tb.ops)][:4]
            raise PlanError(f"plan {plan.name}: the model cannot finish it (waiting forever at {', '.join(stuck)}); "
                            "run `mscclang verify` for the diagnosis")
    total = max((o.end_us for o in ops), default=m.launch_us)
    return Prediction(plan.name, input_bytes, output_bytes, total, ops)


def _signal(md: _Model, r: int, tb: Any, op: Op, at: float) -> None:
    """Signals of ``op`` sent at ``at``: each becomes visible on the paired channel a flag (or,
    between nodes, an engine) latency later."""
    m = md.m
    for c in op.channel_ids:
        rank, ct, idx = md.channel_key(r, tb, op, c)
        end = md.plan.paired_end(rank, ct, idx)
        lat = m.flag_us if md.topo.same_node(r, end.rank) else m.engine_us
        md.signals.setdefault((end.rank, ct, end.index), []).append(at + lat)


def _step(md: _Model, b: _Block, op: Op) -> Optional[OpTime]:
    """Time ``op`` on block ``b``, or None when it must wait for another block first."""
    m, r, tb = md.m, b.rank, b.tb
    start = b.t
    if op.name in SIGNAL_OPS:
        _signal(md, r, tb, op, start + m.op_us)
        return OpTime(r, tb.id, b.pc, op.name.value, start, start + m.op_us, 0, None, 0.0, op.src)
    if op.name in WAIT_OPS:
        ready = start
        keys = [md.channel_key(r, tb, op, c) for c in op.channel_ids]
        for k in keys:
            seen = md.signals.get(k, [])
            n = md.waits.get(k, 0)
            if n >= len(seen):
                return None
            ready = max(ready, seen[n])
        for k in keys:
            md.waits[k] = md.waits.get(k, 0) + 1
        return OpTime(r, tb.id, b.pc, op.name.value, start, ready + m.op_us, 0, None, ready - start, op.src)
    if op.name == OpName.barrier:
        bid = op.barrier_id or 0
        key = (r, bid, b.barriers.get(bid, 0))
        group = md.barrier.setdefault(key, [])
        if not any(x is b for x in group):
            group.append(b)
        if len(group) < (op.num_threadblocks or len(md.plan.gpus[r].threadblocks)):
            return None
        t = max(x.t for x in group)
        b.barriers[bid] = b.barriers.get(bid, 0) + 1
        return OpTime(r, tb.id, b.pc, "barrier", start, t + m.op_us, 0, None, t - start, op.src)
    if op.name in _SYNC:
        return OpTime(r, tb.id, b.pc, op.name.value, start, start + m.op_us, 0, None, 0.0, op.src)
    inner = op.ops if op.name == OpName.pipeline else [op]
    dur, size, peer, ready = 0.0, 0, None, start
    for o in inner or []:
        d, s, p, rd = md.data_time(r, tb, o)
        dur, size, peer, ready = dur + d, size + s, peer if peer is not None else p, max(ready, rd)
    end = ready + dur
    for o in inner or []:
        md.note_packet_writes(r, tb, o, end)
        if o.name in (OpName.pws, OpName.pwsf):   # a put with signal: the signal follows the data
            _signal(md, r, tb, o, end)
    return OpTime(r, tb.id, b.pc, op.name.value, start, end, size, peer, ready - start, op.src)


def model_dict(model: CostModel) -> dict:
    """The model's rates as a JSON-ready dict."""
    return asdict(model)


# ------------------------------------------------------------------------------------------------
# against measurements


@dataclass(frozen=True)
class BenchRow:
    """One measured mscclang figure of a bench file: a collective's CUDA-graph time per call."""

    coll: str
    nbytes: int       # the bench's size: allgather's output, every other collective's input
    us: float
    plan: str
    world: int


@dataclass(frozen=True)
class RowError:
    row: BenchRow
    predicted_us: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_us - self.row.us) / self.row.us


def bench_rows(path: Path) -> list[BenchRow]:
    """The mscclang CUDA-graph rows of a ``mscclang bench`` JSON file that ran a shipped plan;
    PlanError naming the file when it is not one (OSError when it cannot be read)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
        world = int(data.get("meta", {}).get("world_size", 0) or 0)
        out = []
        for r in data.get("results", []):
            plan = str(r.get("plan") or "").split(" ")[0]
            if r.get("impl") != "mscclang" or r.get("mode") != "graph" or not r.get("ok") or plan in ("", "nccl"):
                continue
            n = world or int(plan.split(".r")[1].split(".")[0]) if ".r" in plan else world
            out.append(BenchRow(r["coll"], int(r["bytes"]), float(r["us"]), plan, n))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise PlanError(f"{path}: not a `mscclang bench` JSON file ({type(e).__name__}: {e})") from None
    return out


def call_sizes(coll: str, nbytes: int, world: int) -> tuple[int, int]:
    """(input, output) bytes of a bench row (the collective's rule)."""
    from mscclang.plan.collectives import collective

    return collective(coll).call_bytes(world, nbytes)


def errors(rows: list[BenchRow], plans_dir: Path, model: CostModel) -> list[RowError]:
    """The model's prediction for every row (rows whose plan is not in ``plans_dir`` are left out)."""
    from mscclang.plan.io import load_plan

    cache: dict[str, Plan] = {}
    out = []
    for row in rows:
        f = Path(plans_dir) / f"{row.plan}.json"
        if not f.is_file():
            continue
        plan = cache.get(row.plan) or cache.setdefault(row.plan, load_plan(f))
        pred = predict(plan, *call_sizes(row.coll, row.nbytes, plan.world_size), Topology(plan.world_size, 1, model))
        out.append(RowError(row, pred.total_us))
    return out


def size_range(nbytes: int) -> str:
    return "<= 64 KiB" if nbytes <= 1 << 16 else ("<= 4 MiB" if nbytes <= 1 << 22 else "> 4 MiB")


def error_table(errs: list[RowError]) -> list[dict]:
    """Median and worst absolute error per collective and size range, and over all rows."""
    import statistics

    groups: dict[tuple[str, str], list[RowError]] = {}
    for e in errs:
        groups.setdefault((e.row.coll, size_range(e.row.nbytes)), []).append(e)
    groups[("all", "all")] = list(errs)
    out = []
    for (coll, rng), es in groups.items():
        if not es:
            continue
        worst = max(es, key=lambda e: abs(e.error))
        out.append({"collective": coll, "sizes": rng, "rows": len(es),
                    "median_abs_error": round(statistics.median(abs(e.error) for e in es), 3),
                    "worst_error": round(worst.error, 3), "worst_at": f"{worst.row.nbytes} B {worst.row.plan}"})
    return out


#: what a calibration may change, and the bounds it stays in
FIT = {"link_gbps": (100.0, 900.0), "block_gbps": (5.0, 400.0), "packet_gbps": (2.0, 200.0),
       "link_us": (0.1, 5.0), "flag_us": (0.2, 5.0), "launch_us": (0.1, 5.0), "op_us": (0.0, 1.0),
       "peer_exponent": (0.0, 2.0)}


_ADDITIVE = frozenset({"peer_exponent", "op_us"})


def fit(rows: list[BenchRow], plans_dir: Path, start: Optional[CostModel] = None, rounds: int = 6) -> CostModel:
    """A model refitted to ``rows``: coordinate descent on :data:`FIT`'s entries (steps of x1.25,
    or a tenth of the range for the exponent and the per-op cost, shrinking each round),
    minimising the median absolute error (then the mean)."""
    import statistics

    def score(mdl: CostModel) -> tuple[float, float]:
        es = [abs(e.error) for e in errors(rows, plans_dir, mdl)]
        return (statistics.median(es), statistics.fmean(es)) if es else (0.0, 0.0)

    best = start or calibrated()
    cur = score(best)
    step = 1.25
    for _ in range(rounds):
        for name, (lo, hi) in FIT.items():
            for f in (step, 1 / step):
                v = getattr(best, name)
                # rates and latencies scale; the exponent and the per-op cost step by a share of their range
                nv = v + (hi - lo) * 0.4 * (step - 1) * (1 if f > 1 else -1) if name in _ADDITIVE else v * f
                trial = replace(best, **{name: min(max(nv, lo), hi)})
                s = score(trial)
                if s < cur:
                    best, cur = trial, s
        step = 1 + (step - 1) * 0.6
    return best
