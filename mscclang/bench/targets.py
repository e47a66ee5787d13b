"""The performance targets (2x H200, CUDA graph, 16-bit), checked on a result: the one table of
goals of the project (no other module keeps goals of its own).

* allreduce on symmetric tensors (implementation ``mscclang``, :data:`ALLREDUCE_US`) at or below
  2.4 / 2.5 / 3.0 / 3.3 / 4.0 / 9 / 17 / 52 us at 1K / 4K / 16K / 64K / 256K / 1M / 4M / 16M, and
  from 64M up at or below the best peer;
* allreduce on ordinary tensors in a CUDA graph (implementation ``ordinary``: ``torch.empty``
  tensors, captured inside ``comm.graph_capture()``; :data:`ORDINARY_ALLREDUCE_US`) at or below
  2.0 / 2.7 / 3.6 / 7 / 15 / 50 / 195 us at 1K / 64K / 256K / 1M / 4M / 16M / 64M;
* allgather and reduce-scatter: at most 0.8x NCCL's time below 1 MiB and at least 1.1x its bus
  bandwidth above 64 MiB;
* all-to-all: at most 0.8x NCCL's time below 1 MiB and at least NCCL's bandwidth above 64 MiB;
* host time per queued call (``mscclang bench --host``, in torch launches timed the same way in
  the same process, :data:`HOST_LAUNCHES`): a memo hit on symmetric tensors at most 1.5 torch
  launches, on ordinary tensors at most 3, the fused call at most 2; ``dist.all_reduce`` at most
  the Communicator's call on the same tensor + 20%; the largest message within 10% of the
  smallest;
* first calls (``mscclang bench --first-calls``): a plan's first call at most 20 ms, a new size of
  a loaded plan at most 1.2x a repeated call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mscclang.bench.results import ORDINARY, BenchResult
from mscclang.bench.sizes import format_size

KiB, MiB = 1 << 10, 1 << 20
#: allreduce on symmetric tensors (``comm.empty``), CUDA graph: microseconds per call
ALLREDUCE_US = {1 * KiB: 2.4, 4 * KiB: 2.5, 16 * KiB: 3.0, 64 * KiB: 3.3, 256 * KiB: 4.0,
                1 * MiB: 9.0, 4 * MiB: 17.0, 16 * MiB: 52.0}
#: allreduce on ordinary tensors (``torch.empty``) in a CUDA graph: microseconds per call
ORDINARY_ALLREDUCE_US = {1 * KiB: 2.0, 64 * KiB: 2.7, 256 * KiB: 3.6, 1 * MiB: 7.0, 4 * MiB: 15.0,
                         16 * MiB: 50.0, 64 * MiB: 195.0}
PEER_FROM = 64 * MiB
#: ``bench --host``: the rows whose mean is a torch launch, the unit of the other rows
TORCH_LAUNCHES = ("add", "copy")
#: ``bench --host``: at most this many torch launches per queued call, by row
HOST_LAUNCHES = {"symmetric": 1.5, "ordinary": 3.0, "fused": 2.0}
#: ``bench --host``: ``dist.all_reduce`` at most this times the Communicator's call on the same tensor
DIST_OVER_COMM = 1.2
#: ``bench --host``: the rows whose host time may not grow with the message, and by how much it may
HOST_SIZED, HOST_GROWTH = ("symmetric", "ordinary", "dist"), 1.1
#: ``bench --first-calls``: a plan's first call (ms); a new size of a loaded plan over a repeated call
FIRST_CALL_MS, NEW_SIZE_RATIO = 20.0, 1.2


@dataclass(frozen=True)
class LatencyTargets:
    """A named set of latency goals: ``impl``'s ``coll`` at or below ``us[size]`` microseconds
    per call at each listed size (CUDA graph)."""

    name: str
    coll: str
    impl: str
    us: dict[int, float]


#: every latency target set, in report order
LATENCY_TARGETS: tuple[LatencyTargets, ...] = (
    LatencyTargets("symmetric tensors", "all_reduce", "mscclang", ALLREDUCE_US),
    LatencyTargets("ordinary tensors", "all_reduce", ORDINARY, ORDINARY_ALLREDUCE_US),
)


@dataclass
class Verdict:
    """One target on one result: the goal, the measured value (text) and whether it was met."""

    coll: str
    bytes: int
    goal: str
    value: Optional[str]
    ok: Optional[bool]  # None: not measured
    fallback: bool = False  # the library ran NCCL (a tuning rule put NCCL first): never "met"
    impl: str = "mscclang"

    def row(self) -> str:
        mark = {True: "met", False: "MISSED", None: "not measured"}[self.ok]
        if self.fallback:
            mark = "MISSED (the library fell back to NCCL here)"
        what = self.coll if self.impl == "mscclang" else f"{self.coll} ({self.impl} tensors)"
        return f"| {what} | {format_size(self.bytes)} | {self.goal} | {self.value or '-'} | {mark} |"


def check_targets(res: BenchResult, mode: str = "graph") -> list[Verdict]:
    """Verdicts for every target size the result covers (mscclang vs the peers, one mode); the
    ordinary-tensor goals only where the result has the ``ordinary`` implementation."""
    out: list[Verdict] = []

    def us(coll: str, impl: str, nbytes: int) -> Optional[float]:
        r = res.find(coll, impl, mode, nbytes)
        return r.us if r is not None and r.measured else None

    def bw(coll: str, impl: str, nbytes: int) -> Optional[float]:
        r = res.find(coll, impl, mode, nbytes)
        return r.busbw if r is not None and r.measured else None

    def fell_back(coll: str, nbytes: int, impl: str) -> bool:
        r = res.find(coll, impl, mode, nbytes)
        return r is not None and (r.plan or "").startswith(("nccl", "gloo"))

    def verdict(coll: str, nbytes: int, goal: str, value: Optional[str], ok: Optional[bool],
                impl: str = "mscclang") -> Verdict:
        fb = fell_back(coll, nbytes, impl)
        return Verdict(coll, nbytes, goal, value, False if fb and ok is not None else ok, fb, impl)

    for ts in LATENCY_TARGETS:
        # the symmetric-tensor goals are judged (as not measured) even without mscclang records
        if ts.coll not in res.colls() or (ts.impl != "mscclang" and ts.impl not in res.impls()):
            continue
        for nbytes in res.sizes(ts.coll):
            if nbytes not in ts.us:
                continue
            mine, goal = us(ts.coll, ts.impl, nbytes), ts.us[nbytes]
            out.append(verdict(ts.coll, nbytes, f"<= {goal} us", f"{mine:.2f} us" if mine is not None else None,
                               None if mine is None else mine <= goal, ts.impl))
    if "all_reduce" in res.colls():
        for nbytes in res.sizes("all_reduce"):
            mine = us("all_reduce", "mscclang", nbytes)
            if nbytes >= PEER_FROM and nbytes not in ALLREDUCE_US:
                peers = [u for u in (us("all_reduce", i, nbytes) for i in ("nccl", "symm")) if u is not None]
                best = min(peers) if peers else None
                ok = None if mine is None or best is None else mine <= best
                out.append(verdict("all_reduce", nbytes,
                                   f"<= best peer ({best:.1f} us)" if best is not None else "<= best peer",
                                   f"{mine:.1f} us" if mine is not None else None, ok))
    for coll, bw_factor in (("all_gather", 1.1), ("reduce_scatter", 1.1), ("all_to_all", 1.0)):
        if coll not in res.colls():
            continue
        for nbytes in res.sizes(coll):
            if nbytes < 1 * MiB:
                mine, ref = us(coll, "mscclang", nbytes), us(coll, "nccl", nbytes)
                ok = None if mine is None or ref is None else mine <= 0.8 * ref
                out.append(verdict(coll, nbytes,
                                   f"<= 0.8 x NCCL ({0.8 * ref:.2f} us)" if ref is not None else "<= 0.8 x NCCL",
                                   f"{mine:.2f} us" if mine is not None else None, ok))
            elif nbytes > 64 * MiB:
                mine, ref = bw(coll, "mscclang", nbytes), bw(coll, "nccl", nbytes)
                ok = None if mine is None or ref is None else mine >= bw_factor * ref
                goal = f">= {bw_factor} x NCCL busbw" + (f" ({bw_factor * ref:.1f} GB/s)" if ref is not None else "")
                out.append(verdict(coll, nbytes, goal, f"{mine:.1f} GB/s" if mine is not None else None, ok))
    return out


def torch_launch_us(records: Sequence[Any]) -> Optional[float]:
    """A torch launch's host time: the mean of the measured :data:`TORCH_LAUNCHES` rows of a
    ``bench --host`` result (None unless both were measured)."""
    us = [r.us for r in records if r.call in TORCH_LAUNCHES and r.ok and r.us]
    return sum(us) / len(us) if len(us) == len(TORCH_LAUNCHES) else None


def check_host_targets(records: Sequence[Any]) -> list[Verdict]:
    """Verdicts on a ``bench --host`` result (:class:`~mscclang.bench.host.HostRecord` rows, in
    order): every :data:`HOST_LAUNCHES` row against the torch launch, every ``dist`` row against
    the Communicator's call on an ordinary tensor of its size (with the least ratio a Python
    backend can reach, given the ``floor`` row), and each :data:`HOST_SIZED` row kind's largest
    size against its smallest; not measured where a figure is missing."""
    unit = torch_launch_us(records)
    us = {(r.call, r.elements): r.us for r in records if r.ok}
    # the ``floor`` row: torch.distributed's own time per call, through a group that does nothing
    floor = next((r.us for r in records if r.call == "floor" and r.ok), None)
    out: list[Verdict] = []

    def judged(what: str, r: Any, goal: str, mine: Optional[float], limit: Optional[float], note: str = "") -> None:
        out.append(Verdict(what, r.bytes, goal + ("" if limit is None else f" ({limit:.1f} us)"),
                           None if mine is None else f"{mine:.1f} us{note}",
                           None if mine is None or limit is None else mine <= limit))

    for r in records:
        what, mine = f"{r.label}, {format_size(r.elements)} elements", us.get((r.call, r.elements))
        if r.call in HOST_LAUNCHES:
            lim = HOST_LAUNCHES[r.call]
            judged(what, r, f"<= {lim} torch launches", mine, None if unit is None else lim * unit,
                   "" if unit is None or mine is None else f" = {mine / unit:.2f} launches")
        elif r.call == "dist":
            comm = us.get(("ordinary", r.elements))
            note = "" if comm is None or mine is None else f" = {mine / comm:.2f}x"
            if comm is not None and floor is not None:
                note += f"; torch's own part {floor:.1f} us: {(comm + floor) / comm:.2f}x at the least"
            judged(what, r, f"<= {DIST_OVER_COMM} x Communicator.all_reduce, ordinary tensor", mine,
                   None if comm is None else DIST_OVER_COMM * comm, note)
    for call in HOST_SIZED:
        rows = sorted((r for r in records if r.call == call), key=lambda r: r.elements)
        if len(rows) < 2:
            continue
        lo, hi = rows[0], rows[-1]
        a, b = us.get((call, lo.elements)), us.get((call, hi.elements))
        judged(f"{hi.label}: {format_size(hi.elements)} against {format_size(lo.elements)} elements", hi,
               f"<= {HOST_GROWTH} x {format_size(lo.elements)}'s", b, None if a is None else HOST_GROWTH * a,
               "" if a is None or b is None else f" = {b / a:.2f}x")
    return out


def check_first_call_targets(records: Sequence[Any]) -> list[Verdict]:
    """Verdicts on a ``bench --first-calls`` result (:class:`~mscclang.bench.first_call.FirstCallRecord`
    rows): a size whose first call ran a plan no earlier call of the process ran is a plan's first
    call (at most :data:`FIRST_CALL_MS`); any other is a new size of a loaded plan (at most
    :data:`NEW_SIZE_RATIO` times its repeated call). Rows that failed, and rows from before the
    records said which they are, are not judged."""
    out: list[Verdict] = []
    for r in records:
        if not r.ok or r.new_plan is None:
            continue
        if r.new_plan:
            out.append(Verdict(f"{r.coll}: a plan's first call", r.bytes, f"<= {FIRST_CALL_MS:g} ms",
                               f"{r.first_ms:.2f} ms", r.first_ms <= FIRST_CALL_MS))
        else:
            lim = NEW_SIZE_RATIO * r.second_ms
            out.append(Verdict(f"{r.coll}: a new size of a loaded plan", r.bytes,
                               f"<= {NEW_SIZE_RATIO} x the repeated call ({lim:.2f} ms)",
                               f"{r.first_ms:.2f} ms ({r.first_ms / r.second_ms:.2f}x)", r.first_ms <= lim))
    return out
