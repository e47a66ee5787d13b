"""Turning the simulator's raw findings into diagnoses a person can act on.

* :func:`race_problem`: a race as what each side did and, where the cause is known, what would
  order them;
* :func:`group_key`: what makes two findings the same bug (so a bug seen at many sizes, dtypes,
  schedules and launches is reported once, with its count and cases);
* :func:`classify`: a race that only a relaxed signal/wait publishing multimem stores leaves
  unordered becomes a ``multimem-relaxed`` warning; any other race that only a relaxed edge
  orders names that ``rlxsignal -> rlxwait`` (:func:`relaxed_edge`);
* :func:`attribute_writers`: a wrong output chunk names the ops that wrote it and their sources;
* :func:`rotate_cycle`: a wait-for cycle is printed from the op the author wrote first;
* :func:`annotate_sources`: every ``rank R tb T op I`` gets the op's DSL source line
  (``program.py:42``) when the plan records it (the optional ``src`` field of an op).
"""

from __future__ import annotations

import re
from itertools import groupby
from typing import Any, Optional, Sequence

from mscclang.plan.check import iter_op_paths
from mscclang.plan.collectives import spec_from_plan
from mscclang.plan.models import PACKET_OPS, REDUCE_OPS, SIGNAL_OPS, WAIT_OPS, BufferKind, ChannelType, Op, Plan
from mscclang.sim.races import RaceInfo, Unpublished, ordered
from mscclang.sim.report import Problem

_LAUNCH = re.compile(r"launch \d+")
_RANGE = re.compile(r"\[\d+, \d+\)")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(\.\d+)?(e[+-]?\d+)?")
#: ``rank 2 tb 0 op 16`` (plain text) and ``(rank 2, tb 0, op 16)`` (cycle summaries)
_OP_TEXT = re.compile(r"rank (\d+) tb (\d+) op (\d+(?:\.\d+)*)")
_OP_TUPLE = re.compile(r"\(rank (\d+), tb (\d+), op (\d+(?:\.\d+)*)\)")


def op_at(plan: Plan, rank: int, tb: int, index: Any) -> Optional[Op]:
    """The op ``index`` (``"3"``, or ``"3.1"``: inner op 1 of pipeline op 3) of ``rank``'s
    thread block ``tb``; ``None`` when there is no such op."""
    if index is None or not 0 <= rank < len(plan.gpus):
        return None
    tbs = plan.gpus[rank].threadblocks
    if not 0 <= tb < len(tbs):
        return None
    ops: Optional[list] = tbs[tb].ops
    op: Optional[Op] = None
    try:
        parts = [int(x) for x in str(index).split(".")]
    except ValueError:
        return None
    for k in parts:
        if not ops or not 0 <= k < len(ops):
            return None
        op = ops[k]
        ops = op.ops
    return op


def src_of(plan: Plan, rank: int, tb: int, index: Any) -> Optional[str]:
    """The DSL source line (``"program.py:42"``) that made the op, when the plan records it;
    an inner op of a pipeline without one inherits the pipeline's."""
    op = op_at(plan, rank, tb, index)
    src = getattr(op, "src", None) if op is not None else None
    if not src and index is not None and "." in str(index):
        return src_of(plan, rank, tb, str(index).rsplit(".", 1)[0])
    return src if isinstance(src, str) and src else None


def _src_order(src: str) -> tuple:
    path, _, line = src.rpartition(":")
    return (path, int(line)) if line.isdigit() else (src, 0)


def _index_order(index: Any) -> tuple:
    try:
        return tuple(int(x) for x in str(index).split("."))
    except ValueError:
        return (1 << 62,)


def author_order(plan: Plan, rank: int, tb: int, index: Any) -> tuple:
    """Sort key: ops with a source line first, by file and line; then by rank, thread block
    and op index."""
    src = src_of(plan, rank, tb, index)
    if src is not None:
        return (0, _src_order(src), (rank, tb), _index_order(index))
    return (1, (), (rank, tb), _index_order(index))


def annotate_sources(problem: Problem, plan: Plan) -> None:
    """Append ``(program.py:42)`` after every op a message names whose op records ``src``."""
    found: dict[tuple[int, int, str], str] = {}

    def sub(m: re.Match, as_tuple: bool) -> str:
        r, tb, idx = int(m.group(1)), int(m.group(2)), m.group(3)
        src = src_of(plan, r, tb, idx)
        if src is None:
            return m.group(0)
        found[(r, tb, idx)] = src
        if as_tuple:
            return f"(rank {r}, tb {tb}, op {idx}, {src})"
        tail = problem.message[m.end(): m.end() + len(src) + 3]
        return m.group(0) if src in tail else f"{m.group(0)} ({src})"

    problem.message = _OP_TUPLE.sub(lambda m: sub(m, True), problem.message)
    problem.message = _OP_TEXT.sub(lambda m: sub(m, False), problem.message)
    if found:
        problem.details.setdefault("src", {}).update(found)


def rotate_cycle(problem: Problem, plan: Plan) -> None:
    """Start a deadlock's wait-for cycle at the op the author wrote first (:func:`author_order`):
    the ``cycle`` detail, the ``wait-for cycle:`` line, the per-block lines after it and the
    ``first ...`` of the headline. Messages of another shape are left as they are."""
    cyc = problem.details.get("cycle") if problem.kind == "deadlock" else None
    if not cyc or len(cyc) < 2:
        return
    keys = [author_order(plan, e[0], e[1], e[2]) for e in cyc]
    s = min(range(len(cyc)), key=lambda i: keys[i])
    if s == 0:
        return
    k = len(cyc)
    lines = problem.message.split("\n")
    at = next((i for i, ln in enumerate(lines) if ln.startswith("wait-for cycle: ")), None)
    if at is None or at + k >= len(lines):
        return
    parts = lines[at][len("wait-for cycle: "):].split(" -> ")
    if len(parts) != k + 1 or parts[0] != parts[-1]:
        return
    body = lines[at + 1: at + 1 + k]
    for e, ln in zip(cyc, body):
        if not ln.lstrip().startswith(f"rank {e[0]} tb {e[1]}"):
            return
    parts = parts[s:k] + parts[:s]
    lines[at] = "wait-for cycle: " + " -> ".join(parts + parts[:1])
    body = body[s:] + body[:s]
    lines[at + 1: at + 1 + k] = body
    head = re.match(r"^(all \d+ live blocks wait; first ).*$", lines[0])
    if head:
        first = body[0].strip()
        cut = first.find(" (launch ")
        lines[0] = head.group(1) + (first[:cut] if cut > 0 else first)
    problem.message = "\n".join(lines)
    problem.details["cycle"] = list(cyc[s:]) + list(cyc[:s])


def _opkey(ref: Any) -> tuple:
    """An op reference without its launch: (rank, tb, index, name)."""
    if all(hasattr(ref, a) for a in ("rank", "tb", "index", "name")):
        return (ref.rank, ref.tb, ref.index, _LAUNCH.sub("launch N", str(ref.name)))
    return (str(ref),)


def group_key(problem: Problem) -> tuple:
    """What identifies a finding across sizes, dtypes, reduce ops, packet types, schedules and
    launches: the ops, ranks, chunks or channels it names, not the byte ranges or values."""
    d = problem.details
    k = problem.kind
    if k in ("race", "multimem-relaxed") and "first" in d and "second" in d:
        a, b = sorted((_opkey(d["first"]), _opkey(d["second"])), key=str)
        return (k, a, b, d.get("storage"))
    if k in ("postcondition", "symbolic") and "rank" in d and "chunk" in d:
        return (k, d["rank"], d["chunk"], d.get("what", ""))
    if k == "plan" and "op" in d:   # a plan that fails at one op, whatever the sizes
        return (k, d["op"])
    if k == "inconsistent" and "ranks" in d:  # one cause: a rank pair and the ops they differ in
        return (k, tuple(d["ranks"]), d.get("how"), repr(d.get("cause")))
    if k == "batch-variant" and "cause" in d:   # one cause: the form and the op that computed the value
        return (k, repr(d["cause"]))
    if k == "deadlock":
        for what in ("cycle", "blocked"):
            if d.get(what):
                return (k, what, frozenset((e[0], e[1], e[2]) for e in d[what]))
    if k == "unsynced-signal" and "op" in d:
        return (k, _opkey(d["op"]))
    if k == "unbalanced-semaphore" and "rank" in d:
        return (k, d["rank"], d.get("semaphore"))
    if k == "unbalanced-channel" and "end" in d:
        return (k, tuple(d["end"]))
    first = problem.message.splitlines()[0] if problem.message else ""
    first = _RANGE.sub("[a, b)", _LAUNCH.sub("launch N", first))
    if k in ("postcondition", "symbolic"):
        first = _NUMBER.sub("#", first)
    return (k, first)


def _multimem_store(op: Optional[Op]) -> bool:
    """Whether ``op`` writes through a switch channel (a multimem store)."""
    return op is not None and op.channel_type == ChannelType.switch and op.name.value in (
        "gstore", "glres", "gstorepkt")


def classify(problem: Problem, plan: Plan) -> None:
    """Reclassify a race that exists only because a relaxed signal/wait is the edge that
    publishes a multimem (switch-channel) store: the later access is ordered after the store in
    execution order (``exec_ordered``), not by a data-synchronising edge. It becomes a
    ``multimem-relaxed`` warning; every other race stays a ``race``."""
    if problem.kind != "race" or not problem.details.get("exec_ordered"):
        return
    first = problem.details.get("first")
    if first is None or getattr(first, "tb", -1) < 0:
        return
    if not _multimem_store(op_at(plan, first.rank, first.tb, first.index)):
        edge = relaxed_edge(plan, first.rank, first.tb, first.index)
        problem.details["relaxed"] = edge
        problem.message += (f" (only a relaxed signal/wait orders them: "
                            f"{edge or 'an rlxsignal -> rlxwait'}; a relaxed signal does not "
                            "publish the data written before it: use signal/wait)")
        return
    problem.kind = "multimem-relaxed"
    problem.message += (" (only a relaxed signal/wait orders the multimem store before it: a "
                        "weaker hazard than a missing synchronisation; use signal/wait to publish "
                        "the store, or accept it: a warning unless --strict)")


def _peer(plan: Plan, rank: int, tb: int, op: Op, cid: int) -> Optional[int]:
    """The rank at the other end of channel ``cid`` (TB-local) of ``op``."""
    lst = plan.gpus[rank].threadblocks[tb].channel_list(op.channel_type)
    peers = plan.gpus[rank].peers(op.channel_type)
    if not 0 <= cid < len(lst) or not 0 <= lst[cid] < len(peers):
        return None
    return peers[lst[cid]]


def _waits_on(plan: Plan, rank: int, tb: int, peer: int, ctype: ChannelType) -> list[tuple[int, Op]]:
    """(index, op) of the signals (or waits) of block ``tb`` on ``ctype`` channels to ``peer``."""
    return [(k, w) for k, w in enumerate(plan.gpus[rank].threadblocks[tb].ops)
            if w.channel_type == ctype and any(_peer(plan, rank, tb, w, c) == peer for c in w.channel_ids)]


def relaxed_edge(plan: Plan, rank: int, tb: int, index: Any) -> Optional[str]:
    """The relaxed edge that publishes what op ``index`` of ``rank``'s block ``tb`` wrote: the
    first ``rlxsignal`` after it in its block (before any ``signal``) and the ``rlxwait`` that
    takes that signal (the n-th wait of a peer block on the channel back, when the n-th signal);
    ``None`` when the block has no such signal."""
    ops = plan.gpus[rank].threadblocks[tb].ops if op_at(plan, rank, tb, index) is not None else []
    for j in range(_index_order(index)[0] + 1, len(ops)):
        sig = ops[j]
        if sig.name.value == "signal":
            return None
        if sig.name.value != "rlxsignal":
            continue
        text = f"rank {rank} tb {tb} op {j} rlxsignal"
        for cid in sig.channel_ids:
            peer = _peer(plan, rank, tb, sig, cid)
            sent = [k for k, s in _waits_on(plan, rank, tb, peer, sig.channel_type)
                    if s.name in SIGNAL_OPS] if peer is not None else []
            n = sent.index(j) if j in sent else -1
            for t2 in range(len(plan.gpus[peer].threadblocks) if peer is not None else 0):
                got = [(k, w) for k, w in _waits_on(plan, peer, t2, rank, sig.channel_type)
                       if w.name in WAIT_OPS]
                if 0 <= n < len(got) and got[n][1].name.value == "rlxwait":
                    return f"{text} -> rank {peer} tb {t2} op {got[n][0]} rlxwait"
        return text
    return None


def _kernel_writers(sim: Any, rank: int, kind: BufferKind, off: int, ln: int) -> list:
    """The ops (no host) whose writes of ``rank``'s buffer ``kind`` bytes [off, off + ln) the
    run's access log holds last (either scratch half), one per op."""
    mem = sim.mem[rank]
    out: dict[tuple, Any] = {}
    for half in {0, mem.scratch_half if kind == BufferKind.scratch else 0}:
        key, a = mem.addr(kind, off, half)
        wm = sim.log.writes.get(f"rank{rank}.{key}") if sim.log is not None else None
        for _, _, acc in (wm.overlapping(a, a + ln) if wm is not None else ()):
            if not acc.host:
                out.setdefault((acc.op.rank, acc.op.tb, acc.op.index), acc.op)
    return list(out.values())


def _target(plan: Plan, rank: int, tb: int, op: Op, b: Any) -> Optional[tuple[int, BufferKind]]:
    """(rank, buffer kind) a buffer reference ``b`` of ``op`` (on ``rank``'s block ``tb``) names,
    through the block's remote buffers; ``None`` for a switch reference or an index out of range."""
    if not b.is_remote:
        return (rank, b.type) if b.type is not None else None
    ids = plan.gpus[rank].threadblocks[tb].remote_buffer_list(op.channel_type)
    rbs = plan.gpus[rank].remote_buffers
    if not 0 <= b.buffer_id < len(ids) or not 0 <= ids[b.buffer_id] < len(rbs):
        return None
    return rbs[ids[b.buffer_id]].rank, rbs[ids[b.buffer_id]].type


def _plan_writes(plan: Plan, sim: Any) -> dict[int, list[tuple[str, int, int, str]]]:
    """Per rank, every byte range the plan's ops (pipelines' inner ops included) write into its
    buffers, as the simulator of ``sim`` lays them out (in-place aliases too): (storage, start,
    end, ``rank 0 tb 1 op 4 put``)."""
    out: dict[int, list[tuple[str, int, int, str]]] = {}
    for path, op in iter_op_paths(plan):
        r, t, *index = map(int, re.findall(r"\d+", path))
        for b in op.dst_buff:
            at = _target(plan, r, t, op, b)
            if at is None or not 0 <= at[0] < len(sim.mem):
                continue
            mem = sim.mem[at[0]]
            s0, s1 = mem.layout.ref_span(at[1], b.index, b.size)
            key, a = mem.addr(at[1], s0, 0)
            out.setdefault(at[0], []).append((key, a, a + s1 - s0, f"rank {r} tb {t} op {'.'.join(map(str, index))} "
                                                                   f"{op.name.value}"))
    return out


def _sources(plan: Plan, sim: Any, ref: Any) -> list[tuple[str, bool]]:
    """(``rank 1 scratch chunk 0``, never written) for every source of the op ``ref`` names:
    never written when it is an output or scratch chunk that no kernel op wrote."""
    op = op_at(plan, ref.rank, ref.tb, ref.index)
    out: list[tuple[str, bool]] = []
    for b in (op.src_buff if op is not None else ()):
        at = _target(plan, ref.rank, ref.tb, op, b)
        if at is None or not 0 <= at[0] < len(sim.mem):
            continue
        rank, kind = at
        chunks = f"chunk {b.index}" if b.size == 1 else f"chunks {b.index}-{b.index + b.size - 1}"
        off, end = sim.mem[rank].layout.ref_span(kind, b.index, b.size)
        never = kind != BufferKind.input and end > off and not _kernel_writers(sim, rank, kind, off, end - off)
        out.append((f"rank {rank} {kind.name} {chunks}" + (", which no op wrote" if never else ""), never))
    return out


_HEAD = re.compile(r"^rank \d+ output chunk \d+ \(launch [^)]*\)")


def attribute_writers(problems: list[Problem], plan: Plan, sim: Any) -> None:
    """Name, in every wrong-output problem (``postcondition``, ``symbolic``), the ops that wrote
    the output chunk last in ``sim`` (a finished run with an access log) and their sources. A
    chunk that ops wrote from sources no op wrote (never written themselves) is reported as
    written only from sources never written, not as never written (details: ``unwritten``
    false, ``unwritten_sources`` true)."""
    writes: Optional[dict] = None
    for pr in problems:
        d = pr.details
        if pr.kind not in ("postcondition", "symbolic") or "chunk" not in d or sim.log is None:
            continue
        off, ln = sim.mem[d["rank"]].layout.span(BufferKind.output, d["chunk"])
        writers = _kernel_writers(sim, d["rank"], BufferKind.output, off, ln)[:3]
        head = _HEAD.match(pr.message)
        srcs = [_sources(plan, sim, w) for w in writers]
        by = "; ".join(f"rank {w.rank} tb {w.tb} op {w.index} {w.name}"
                       + (f" from {', '.join(t for t, _ in s)}" if s else "") for w, s in zip(writers, srcs))
        if not writers and d.get("unwritten") and head:   # the launch's start overwrote what the plan wrote
            writes = _plan_writes(plan, sim) if writes is None else writes
            key, a = sim.mem[d["rank"]].addr(BufferKind.output, off, 0)
            by = "; ".join(list(dict.fromkeys(w for k, lo, hi, w in writes.get(d["rank"], ())
                                              if k == key and lo < a + ln and a < hi))[:3])
        never = bool(writers) and all(s and all(n for _, n in s) for s in srcs)
        if not by:
            continue
        if d.get("unwritten") and head is not None and not never:   # docs/verify.md's wording
            flag, when = (("written_late", "before the launch's outputs were read") if writers else
                          ("written_early", "between the launch's start and the read of its outputs"))
            pr.message = (f"{head.group(0)} was written by {by}, but not {when}"
                          f"{pr.message[head.end():].replace(' was never written', '', 1)}")
            d["unwritten"], d[flag] = False, True
            continue
        if head is None or not never:
            pr.message += f" (written by {by})"
            continue
        rest = pr.message[head.end():].strip()
        rest = rest[rest.find(": ") + 2:] if d.get("unwritten") else f"it {rest}"
        pr.message = f"{head.group(0)} was written only from sources never written: written by {by}; {rest}"
        d["unwritten"], d["unwritten_sources"] = False, True


#: the notes of a report on output chunks that held no data when read: (detail flag, what)
CHUNK_NOTES = (("unwritten", "never written"),
               ("written_late", "written, but not before the launch's outputs were read"),
               ("written_early", "written, but not between the launch's start and the read of its outputs"),
               ("unwritten_sources", "written only from sources never written"))


def chunk_notes(problems: list[Problem]) -> list[str]:
    """One note per :data:`CHUNK_NOTES` case the problems show: ``output chunks never written
    (5): rank 0 chunks 4-7; rank 1 chunk 0`` (the first eight ranks)."""
    notes = []
    for flag, what in CHUNK_NOTES:
        per: dict[int, list[int]] = {}
        for r, c in sorted({(p.details["rank"], p.details["chunk"]) for p in problems if p.details.get(flag)}):
            per.setdefault(r, []).append(c)
        if per:
            shown = [f"rank {r} chunk{'s' * (len(cs) != 1)} {_ranges(cs)}" for r, cs in list(per.items())[:8]]
            more = f"; and {len(per) - 8} more ranks" if len(per) > 8 else ""
            notes.append(f"output chunks {what} ({sum(map(len, per.values()))}): " + "; ".join(shown) + more)
    return notes


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs = [[x for _, x in run] for _, run in groupby(enumerate(xs), lambda p: p[1] - p[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def plan_uses(plan: Plan) -> tuple[bool, bool]:
    """(whether a reduce op applies to the plan: a reduction collective, or a reduce op in it;
    whether it has packet ops): what a report lists reduce ops and packet types for."""
    names = {op.name for _, op in iter_op_paths(plan)}
    return spec_from_plan(plan).is_reduction or bool(names & REDUCE_OPS), bool(names & PACKET_OPS)


def protocol_warnings(plan: Plan, packets: bool) -> list[Problem]:
    """A ``protocol`` warning for a plan that declares the LL protocol but has no packet op
    (``packets`` false): every byte then moves plainly, so the plan is not the low-latency plan
    its protocol says (a selector or tuner would treat it as one)."""
    if plan.protocol != "LL" or packets:
        return []
    return [Problem("protocol", "the plan declares protocol LL but has no packet op: every byte moves "
                                "plainly (put, copy, reduce), not in LL packets; declare protocol Simple, or "
                                "move the data with packet ops")]


class Findings:
    """The problems of many runs of one plan, one :class:`Problem` per cause (:func:`group_key`):
    each classified (:func:`classify`), its wait-for cycle rotated and its ops' program lines
    added once, then counted with the contexts it was seen in. ``report.problems`` gets each
    new cause; :meth:`add` takes a run's problems and that run's context."""

    def __init__(self, plan: Plan, report: Any) -> None:
        self.plan = plan
        self.report = report
        self.groups: dict[tuple, Problem] = {}

    def known(self, problem: Problem) -> None:
        """Count ``problem`` (already in the report) as its cause's entry."""
        self.groups[group_key(problem)] = problem

    def add(self, problems: list[Problem], context: str) -> None:
        for pr in problems:
            classify(pr, self.plan)
            key = group_key(pr)
            known = self.groups.get(key)
            if known is not None:
                known.seen(context)
                continue
            rotate_cycle(pr, self.plan)
            annotate_sources(pr, self.plan)
            pr.context = context
            pr.count, pr.cases, pr.ncases = 1, [], 0
            pr.add_case(context)
            self.groups[key] = pr
            self.report.problems.append(pr)


def race_problem(info: RaceInfo, unpublished: Sequence[Unpublished], double_scratch: bool) -> Problem:
    """A race the simulator found as a problem a person can act on: what each side did to which
    bytes, and why nothing orders them where the cause is known (a launch handed a buffer its own
    rank's proxy still uses, scratch reused across launches, data arriving after its owner may
    have finished, a thread publishing without an acquisition another thread of its block made:
    :func:`_unpublished_hint` over ``unpublished``). ``double_scratch``: the plan's
    ``use_double_scratch_buffer``."""
    a, b = info.first, info.second
    kinds = ("write" if a.write else "read", "write" if b.write else "read")
    hint = ""
    handover = ((a.host and a.op.name.startswith("launch start: scratch"))
                or (b.host and b.op.name.startswith("launch start: scratch")))
    host = a if a.host else b
    other = b if a.host else a
    started = host.host and host.op.name.startswith("launch start")
    if started and other.op.tb <= -2 and other.op.rank == host.op.rank:
        # a new launch is handed a buffer (scratch, inputs or outputs) its own rank's proxy
        # still reads or writes for an earlier launch
        if handover:
            half = " half" if double_scratch else ""
            what = f"reuses this scratch{half}"
        else:
            what = "is handed this buffer"
        hint = (f" (the launch that {what} is not ordered after this "
                "rank's port proxy's access of an earlier launch: a kernel exit does not wait "
                "for the proxy; a flush of the channel, in that launch or a later one before "
                "the reuse, or an edge from a rank that received the proxy's data would order "
                "it)")
    elif handover:
        pk = a.packet or b.packet
        hint = (" (scratch reused by the next launch while a peer writes it with no edge from "
                "this rank's current launch" + ("; packet scratch reused across launches needs "
                "use_double_scratch_buffer" if pk and not double_scratch else "") + ")")
    elif (a.launch != b.launch and ((a.packet and a.write) or (b.packet and b.write))
          and info.storage.endswith(".scr") and not double_scratch):
        hint = (" (packet scratch reused by a later launch: no chain of edges orders the "
                "earlier launch's access before the reuse; use_double_scratch_buffer, or an "
                "edge from the reader to the writer's next launch, would order it)")
    elif (a.host and a.op.name.startswith("launch start")) or (b.host and b.op.name.startswith("launch start")):
        hint = " (a peer touches this rank's buffer with no ready edge from its current launch)"
    elif (a.host and a.op.name.startswith("launch end")) or (b.host and b.op.name.startswith("launch end")):
        hint = " (data arrives after the owner may have finished: no signal->wait publishes it)"
    hint += _unpublished_hint(info, unpublished)
    return Problem(
        "race",
        f"{a.op} {kinds[0]}s and {b.op} {kinds[1]}s bytes [{info.start}, {info.end}) of "
        f"{info.storage} with no happens-before order between them{hint}",
        details={"first": a.op, "second": b.op, "storage": info.storage,
                 "range": (info.start, info.end), "exec_ordered": info.exec_ordered})


def _unpublished_hint(info: RaceInfo, unpublished: Sequence[Unpublished]) -> str:
    """Why the later access of a race missed the earlier one, when a thread published
    without an acquisition that another thread of its block made (and that would have
    ordered them) and the later access comes after what that thread published (by the proxy
    that carried it out, for a port request)."""
    for e in unpublished:
        if e.via is not None and info.second.op.tb <= -2 and info.second.tid != e.via:
            continue  # a proxy's access: that of the request's own proxy
        a = next((a for a in e.missing if ordered(info.first, a.vc, a.rvc)), None)
        if a and info.rvc is not None and not (info.rvc < e.rvc).any() and not ordered(info.first, e.vc, e.rvc):
            return (f" ({e.what} of {e.op} is sent by thread {e.thread} of its block, which did not make the "
                    f"wait of {a.op} on {a.what}: thread {a.thread} did; what a thread acquires reaches the "
                    "block's other threads only at a later nop or barrier)")
    return ""
