"""Mutation testing of the verifier: plant one small bug in a correct plan, run the plan through
the loader and a default :func:`mscclang.sim.verify`, and see whether the bug is found.

A *mutant* is a plan document with one operator applied at one *site* (an op of a thread block,
or an op inside a pipeline's body, or a semaphore). Each mutant ends in one of:

* ``killed``: ``verify`` reports a problem;
* ``rejected``: the loader refuses the plan (``PlanError`` from :func:`mscclang.plan.load_plan`);
* ``survived``: ``verify`` says OK. A survivor is either *equivalent* (the mutated plan is still
  correct: dropping a redundant ``nop``, swapping two independent ops) or a *miss*;
* ``timeout``: ``verify`` ran past the time limit (counted apart, never as killed);
* ``error``: anything else (a traceback from the verifier is a bug of its own).

Operators (:data:`OPERATORS`): ``drop_wait``, ``drop_signal``, ``shift_chunk``, ``swap_buffer``,
``drop_reduce_source``, ``swap_ops``, ``change_channel`` (the seven of the reliability plan), and
``drop_nop``, ``dup_packet_op``, ``pipeline_unit``, ``sem_init`` and ``drop_ready_pair`` (the
bugs issue 14 item 6 lists as once missed by the default verify), and ``drop_trigger_nop`` and
``swap_trigger_nop`` (issue 33: the nop between a wait and a multi-entry port request, signal or
semaphore release, deleted or swapped with the wait), and ``alignment`` (issue 33: another
``buffer_alignment`` for the whole plan, where chunk boundaries fall).

Use :func:`sites` to list where an operator applies, :func:`mutate` to build one mutant,
:func:`classify` to run one, and :func:`sweep` (or ``python -m tools.mutation``) for
a whole set of plans.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

from mscclang.errors import MscclangError, PlanError

#: op names of the plan format, grouped as the operators need them
WAITS = ("wait", "rlxwait")
SIGNALS = ("signal", "rlxsignal")
REDUCES = ("re", "res", "rre", "rres", "repkt", "respkt", "recpkt", "recspkt", "glre", "glres")
PACKET_WRITERS = ("cpkt", "ppkt", "rppkt", "respkt", "recpkt", "recspkt", "gstorepkt")
_SWAP = {"i": "o", "o": "i", "s": "o"}          # buffer kinds as the plan spells them
_COUNT_KEY = {"i": "input_chunks", "o": "output_chunks", "s": "scratch_chunks"}

OUTCOMES = ("killed", "rejected", "survived", "timeout", "error")


@dataclass(frozen=True)
class Site:
    """Where an operator applies: ``rank``, thread block ``tb``, op ``op`` of the block and, for
    an op in a pipeline's body, its index ``inner`` there; ``arg`` picks a variant (which operand,
    which direction). ``sem_init`` sites name a semaphore in ``op`` (``tb`` is -1); ``alignment``
    sites are the whole plan (rank, tb and op -1; ``arg`` picks the alignment)."""

    operator: str
    rank: int
    tb: int
    op: int
    inner: Optional[int] = None
    arg: int = 0

    def __str__(self) -> str:
        if self.operator == "sem_init":
            return f"sem_init rank {self.rank} semaphore {self.op}"
        if self.operator == "alignment":
            return f"alignment {ALIGNMENTS[self.arg]}"
        where = f"rank {self.rank} tb {self.tb} op {self.op}" + (
            f".{self.inner}" if self.inner is not None else "")
        return f"{self.operator} {where}" + (f" arg {self.arg}" if self.arg else "")

    def key(self) -> tuple:
        return (self.operator, self.rank, self.tb, self.op,
                -1 if self.inner is None else self.inner, self.arg)


@dataclass
class Result:
    """The outcome of one mutant: ``outcome`` (one of :data:`OUTCOMES`), the problem kinds
    ``verify`` reported, the first message, and the seconds it took."""

    plan: str
    site: Site
    outcome: str
    kinds: list[str] = field(default_factory=list)
    message: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        s = self.site
        return {"plan": self.plan, "operator": s.operator, "rank": s.rank, "tb": s.tb, "op": s.op,
                "inner": s.inner, "arg": s.arg, "outcome": self.outcome, "kinds": self.kinds,
                "message": self.message, "seconds": round(self.seconds, 3)}


# ------------------------------------------------------------------------------- plan walking
def _ops_of(doc: dict, rank: int, tb: int) -> list[dict]:
    return doc["gpus"][rank]["threadblocks"][tb]["ops"]


def _each_op(doc: dict) -> Iterator[tuple[int, int, int, Optional[int], dict, list[dict]]]:
    """(rank, tb, op, inner, the op, the list holding it) for every op, pipeline bodies too."""
    for r, g in enumerate(doc["gpus"]):
        for t, tb in enumerate(g["threadblocks"]):
            for i, op in enumerate(tb["ops"]):
                yield r, t, i, None, op, tb["ops"]
                for j, inner in enumerate(op.get("ops") or []):
                    yield r, t, i, j, inner, op["ops"]


def _locate(doc: dict, site: Site) -> tuple[dict, list[dict], int]:
    ops = _ops_of(doc, site.rank, site.tb)
    if site.inner is None:
        return ops[site.op], ops, site.op
    body = ops[site.op]["ops"]
    return body[site.inner], body, site.inner


def _tb_channels(doc: dict, rank: int, tb: int, ctype: str) -> list[int]:
    for c in doc["gpus"][rank]["threadblocks"][tb].get("channels", []):
        if c["channel_type"] == ctype:
            return c["channel_ids"]
    return []


def _peers(doc: dict, rank: int, ctype: str) -> list[int]:
    return [p for c in doc["gpus"][rank].get("channels", []) if c["channel_type"] == ctype
            for p in c.get("connected_to", [])]


def _peer_of(doc: dict, rank: int, tb: int, ctype: str, local: int) -> Optional[int]:
    ids = _tb_channels(doc, rank, tb, ctype)
    peers = _peers(doc, rank, ctype)
    if 0 <= local < len(ids) and 0 <= ids[local] < len(peers):
        return peers[ids[local]]
    return None


def _ref_count(doc: dict, rank: int, tb: int, op: dict, ref: dict) -> Optional[int]:
    """Chunk count of the buffer ``ref`` names (None for a multicast reference)."""
    if ref.get("type") is not None:
        return doc["gpus"][rank][_COUNT_KEY[ref["type"]]]
    if ref.get("buffer_id") is not None:
        ctype = op.get("channel_type", "none")
        lst = next((r["remote_buffer_ids"] for r in doc["gpus"][rank]["threadblocks"][tb].get(
            "remote_buffer_refs", []) if r["access_channel_type"] == ctype), [])
        if ref["buffer_id"] >= len(lst):
            return None
        rb = doc["gpus"][rank]["remote_buffers"][lst[ref["buffer_id"]]]
        if rb["rank"] >= len(doc["gpus"]):
            return None
        return doc["gpus"][rb["rank"]][_COUNT_KEY[rb["type"]]]
    return None


# ------------------------------------------------------------------------------- operators
def _sites_by_name(names: Sequence[str]) -> Callable[[dict, str], list[Site]]:
    def find(doc: dict, operator: str) -> list[Site]:
        return [Site(operator, r, t, i, j) for r, t, i, j, op, _ in _each_op(doc)
                if op["name"] in names]
    return find


def _delete(doc: dict, site: Site) -> None:
    _, lst, k = _locate(doc, site)
    del lst[k]


def _shift_sites(doc: dict, operator: str) -> list[Site]:
    out = []
    for r, t, i, j, op, _ in _each_op(doc):
        for arg, key in enumerate(("dst_buff", "src_buff")):
            refs = op.get(key) or []
            if refs and _ref_count(doc, r, t, op, refs[0]) is not None:
                out.append(Site(operator, r, t, i, j, arg))
    return out


def _shift(doc: dict, site: Site) -> None:
    op, _, _ = _locate(doc, site)
    ref = op["dst_buff" if site.arg == 0 else "src_buff"][0]
    count = _ref_count(doc, site.rank, site.tb, op, ref) or 0
    if ref["index"] + ref["size"] < count:
        ref["index"] += 1
    elif ref["index"] > 0:
        ref["index"] -= 1
    else:
        ref["index"] += 1  # nowhere to go: out of range, for the loader to refuse


def _swap_buffer_sites(doc: dict, operator: str) -> list[Site]:
    out = []
    for r, t, i, j, op, _ in _each_op(doc):
        for arg, key in enumerate(("dst_buff", "src_buff")):
            if any(ref.get("type") is not None for ref in op.get(key) or []):
                out.append(Site(operator, r, t, i, j, arg))
    return out


def _swap_buffer(doc: dict, site: Site) -> None:
    op, _, _ = _locate(doc, site)
    ref = next(x for x in op["dst_buff" if site.arg == 0 else "src_buff"] if x.get("type") is not None)
    ref["type"] = _SWAP[ref["type"]]


def _reduce_sites(doc: dict, operator: str) -> list[Site]:
    return [Site(operator, r, t, i, j) for r, t, i, j, op, _ in _each_op(doc)
            if op["name"] in REDUCES and len(op.get("src_buff") or []) >= 2]


def _drop_source(doc: dict, site: Site) -> None:
    op, _, _ = _locate(doc, site)
    op["src_buff"].pop()


def _swap_sites(doc: dict, operator: str) -> list[Site]:
    out = []
    for r, g in enumerate(doc["gpus"]):
        for t, tb in enumerate(g["threadblocks"]):
            for lst, inner in [(tb["ops"], None)] + [(op["ops"], i) for i, op in enumerate(tb["ops"])
                                                     if op.get("ops")]:
                for k in range(len(lst) - 1):
                    if lst[k] != lst[k + 1]:
                        out.append(Site(operator, r, t, k if inner is None else inner,
                                        None if inner is None else k))
    return out


def _swap_ops(doc: dict, site: Site) -> None:
    _, lst, k = _locate(doc, site)
    lst[k], lst[k + 1] = lst[k + 1], lst[k]


def _channel_sites(doc: dict, operator: str) -> list[Site]:
    out = []
    for r, t, i, j, op, _ in _each_op(doc):
        ids = op.get("channel_ids") or []
        ctype = op.get("channel_type", "none")
        if ids and ctype in ("memory", "port") and len(_tb_channels(doc, r, t, ctype)) >= 2:
            out.append(Site(operator, r, t, i, j))
    return out


def _change_channel(doc: dict, site: Site) -> None:
    op, _, _ = _locate(doc, site)
    n = len(_tb_channels(doc, site.rank, site.tb, op["channel_type"]))
    op["channel_ids"][0] = (op["channel_ids"][0] + 1) % n


def _dup_sites(doc: dict, operator: str) -> list[Site]:
    return [Site(operator, r, t, i, j, arg) for r, t, i, j, op, _ in _each_op(doc)
            if op["name"] in PACKET_WRITERS for arg in (0, 1)]


def _dup(doc: dict, site: Site) -> None:
    """arg 0: the op again right after itself; arg 1: at the end of its block (or body)."""
    op, lst, k = _locate(doc, site)
    lst.insert(k + 1 if site.arg == 0 else len(lst), copy.deepcopy(op))


def _unit_sites(doc: dict, operator: str) -> list[Site]:
    return [Site(operator, r, t, i, None, arg) for r, t, i, j, op, _ in _each_op(doc)
            if j is None and op["name"] == "pipeline" for arg in (0, 1)]


def _unit(doc: dict, site: Site) -> None:
    """arg 0: half the unit size; arg 1: twice it."""
    ctx = _ops_of(doc, site.rank, site.tb)[site.op]["iter_context"]
    u = ctx["unit_size"]
    ctx["unit_size"] = max(1, u // 2) if site.arg == 0 else u * 2


def _sem_sites(doc: dict, operator: str) -> list[Site]:
    return [Site(operator, r, -1, s) for r, g in enumerate(doc["gpus"])
            for s in range(len(g.get("semaphores", [])))]


def _sem(doc: dict, site: Site) -> None:
    doc["gpus"][site.rank]["semaphores"][site.op]["init_value"] += 1


def _ready_pair_sites(doc: dict, operator: str) -> list[Site]:
    """An ``rlxsignal`` channel of rank b to rank a whose paired channel end on a has an
    ``rlxwait``: the ready (back-pressure) handshake of that pair."""
    out = []
    for r, t, i, j, op, _ in _each_op(doc):
        if op["name"] != "rlxsignal" or op.get("channel_type") != "memory":
            continue
        for k in range(len(op.get("channel_ids") or [])):
            if _paired_wait(doc, Site(operator, r, t, i, j, k)) is not None:
                out.append(Site(operator, r, t, i, j, k))
    return out


def _paired_wait(doc: dict, site: Site) -> Optional[tuple[Site, int]]:
    """The ``rlxwait`` (site, position in its channel list) on the channel end paired with the
    channel of the ``rlxsignal`` at ``site`` (arg: the position of that channel): the j-th memory
    channel from b to a is paired with the j-th from a to b."""
    op, _, _ = _locate(doc, site)
    b = site.rank
    gidx = _tb_channels(doc, b, site.tb, "memory")[op["channel_ids"][site.arg]]
    peers_b = _peers(doc, b, "memory")
    a = peers_b[gidx]
    j = peers_b[:gidx].count(a)
    back = [g for g, p in enumerate(_peers(doc, a, "memory")) if p == b]
    if j >= len(back):
        return None
    want = back[j]
    for r, t, i, jj, w, _ in _each_op(doc):
        if r != a or w["name"] != "rlxwait" or w.get("channel_type") != "memory":
            continue
        ids = _tb_channels(doc, a, t, "memory")
        for k, c in enumerate(w.get("channel_ids") or []):
            if 0 <= c < len(ids) and ids[c] == want:
                return Site("drop_wait", a, t, i, jj), k
    return None


def _drop_channel_or_op(doc: dict, site: Site, k: int) -> None:
    op, lst, idx = _locate(doc, site)
    if len(op["channel_ids"]) <= 1:
        del lst[idx]
    else:
        del op["channel_ids"][k]


def _drop_ready_pair(doc: dict, site: Site) -> None:
    found = _paired_wait(doc, site)
    if found is None:
        raise MutationError(f"{site}: no relaxed wait of the peer to drop")
    wsite, k = found
    _drop_channel_or_op(doc, wsite, k)  # on the peer's rank: the signal's site is unaffected
    _drop_channel_or_op(doc, site, site.arg)


ACQUIRES = ("wait", "rlxwait", "sem_acquire")
PORT_TRIGGERS = ("put", "pws", "pwsf", "signal", "rlxsignal")


def _ids(op: dict) -> list:
    """What thread ``k`` of an acquiring or publishing op handles, by ``k``: its channels, its
    semaphores, or (a port data op) its destination entries."""
    if op["name"] in ("put", "pws", "pwsf"):
        return op.get("dst_buff") or []
    return op.get("semaphore_ids") or op.get("channel_ids") or []


def _publishes(op: dict) -> bool:
    """A port request, memory signal or semaphore release: sent by one thread per entry."""
    if op["name"] in ("signal", "rlxsignal", "sem_release"):
        return True
    return op["name"] in PORT_TRIGGERS and op.get("channel_type") == "port"


def _trigger_nop_sites(doc: dict, operator: str) -> list[Site]:
    """A ``nop`` right after a wait (``wait``, ``rlxwait``, ``sem_acquire``) and right before a
    port request, signal or semaphore release, one of them with two or more entries: without the
    nop, thread ``k`` of the second op has only what thread ``k`` acquired (issue 33). The site
    is the nop (``drop_trigger_nop``) or the wait (``swap_trigger_nop``: the nop moves before it)."""
    out = []
    for r, t, i, j, op, lst in _each_op(doc):
        k = i if j is None else j
        if op["name"] != "nop" or not 0 < k < len(lst) - 1:
            continue
        w, p = lst[k - 1], lst[k + 1]
        if w["name"] in ACQUIRES and _publishes(p) and max(len(_ids(w)), len(_ids(p))) >= 2:
            at = k if operator == "drop_trigger_nop" else k - 1
            out.append(Site(operator, r, t, at) if j is None else Site(operator, r, t, i, at))
    return out


#: the buffer alignments the ``alignment`` operator gives a plan (each one other than its own)
ALIGNMENTS = (4, 8, 32, 64, 256)


def _alignment_sites(doc: dict, operator: str) -> list[Site]:
    """One site per alignment of :data:`ALIGNMENTS` other than the plan's (``arg``: its index);
    a plan-level site (rank and tb -1)."""
    own = doc.get("buffer_alignment", 16)
    return [Site(operator, -1, -1, -1, None, k) for k, a in enumerate(ALIGNMENTS) if a != own]


def _alignment(doc: dict, site: Site) -> None:
    doc["buffer_alignment"] = ALIGNMENTS[site.arg]


class MutationError(MscclangError):
    """An operator does not apply at the site it was given."""


@dataclass(frozen=True)
class Operator:
    """A mutation operator: where it applies, how it changes a plan, what it means."""

    name: str
    find: Callable[[dict, str], list[Site]]
    apply: Callable[[dict, Site], None]
    doc: str


OPERATORS: dict[str, Operator] = {o.name: o for o in (
    Operator("drop_wait", _sites_by_name(WAITS), _delete, "delete a wait/rlxwait"),
    Operator("drop_signal", _sites_by_name(SIGNALS), _delete, "delete a signal/rlxsignal"),
    Operator("shift_chunk", _shift_sites, _shift,
             "move the first destination (arg 0) or source (arg 1) reference by one chunk"),
    Operator("swap_buffer", _swap_buffer_sites, _swap_buffer,
             "input <-> output, scratch -> output in the first local destination/source reference"),
    Operator("drop_reduce_source", _reduce_sites, _drop_source, "drop a reduction's last source"),
    Operator("swap_ops", _swap_sites, _swap_ops, "swap an op with the next one of its block"),
    Operator("change_channel", _channel_sites, _change_channel,
             "use the block's next channel of the same type for the op's first channel"),
    Operator("drop_nop", _sites_by_name(("nop",)), _delete, "delete a nop"),
    Operator("dup_packet_op", _dup_sites, _dup,
             "repeat a packet-writing op right after itself (arg 0) or at the end of its block (arg 1)"),
    Operator("pipeline_unit", _unit_sites, _unit, "halve (arg 0) or double (arg 1) a pipeline's unit_size"),
    Operator("sem_init", _sem_sites, _sem, "raise a semaphore's initial value by one"),
    Operator("drop_ready_pair", _ready_pair_sites, _drop_ready_pair,
             "delete one relaxed ready signal and the peer's relaxed wait for it (back-pressure)"),
    Operator("drop_trigger_nop", _trigger_nop_sites, _delete,
             "delete the nop between a wait and a multi-entry port request, signal or release"),
    Operator("swap_trigger_nop", _trigger_nop_sites, _swap_ops,
             "swap a wait with the nop after it, before a multi-entry port request, signal or release"),
    Operator("alignment", _alignment_sites, _alignment,
             "give the plan another buffer_alignment (arg: the index in ALIGNMENTS)"),
)}
#: the seven operators of the reliability plan (issue 11)
CORE_OPERATORS = ("drop_wait", "drop_signal", "shift_chunk", "swap_buffer", "drop_reduce_source",
                  "swap_ops", "change_channel")


def sites(doc: dict, operators: Iterable[str] = tuple(OPERATORS)) -> list[Site]:
    """Every site of ``doc`` (a plan document) where each of ``operators`` applies."""
    out: list[Site] = []
    for name in operators:
        if name not in OPERATORS:
            raise MutationError(f"unknown mutation operator {name!r}; known: {', '.join(OPERATORS)}")
        out.extend(OPERATORS[name].find(doc, name))
    return out


def mutate(doc: dict, site: Site) -> dict:
    """A copy of plan document ``doc`` with ``site``'s operator applied there."""
    if site.operator not in OPERATORS:
        raise MutationError(f"unknown mutation operator {site.operator!r}")
    out = copy.deepcopy(doc)
    try:
        OPERATORS[site.operator].apply(out, site)
    except (IndexError, KeyError, TypeError, StopIteration) as e:
        raise MutationError(f"{site} does not apply to this plan ({type(e).__name__}: {e})") from None
    return out


# ------------------------------------------------------------------------------- judging
SYNC_OPS = ("nop", "barrier", "signal", "rlxsignal", "wait", "rlxwait", "flush", "sem_acquire",
            "sem_release", "pipeline")
PACKET_OPS = ("cpkt", "upkt", "ppkt", "rppkt", "repkt", "respkt", "recpkt", "recspkt", "gstorepkt")


def _refs(doc: dict, rank: int, tb: int, op: dict) -> list[tuple[Optional[tuple], bool, tuple]]:
    """(buffer: (rank, kind) or None for a multicast view, written?, (index, size)) of every
    operand of ``op``."""
    out = []
    for key, write in (("src_buff", False), ("dst_buff", True)):
        for ref in op.get(key) or []:
            if ref.get("type") is not None:
                buf: Optional[tuple] = (rank, ref["type"])
            elif ref.get("buffer_id") is not None:
                ctype = op.get("channel_type", "none")
                lst = next((r["remote_buffer_ids"] for r in doc["gpus"][rank]["threadblocks"][tb].get(
                    "remote_buffer_refs", []) if r["access_channel_type"] == ctype), [])
                rb = doc["gpus"][rank]["remote_buffers"][lst[ref["buffer_id"]]]
                buf = (rb["rank"], rb["type"])
            else:
                buf = None
            out.append((buf, write, (ref["index"], ref["size"])))
    return out


def _alias(doc: dict, buf: Optional[tuple]) -> Optional[tuple]:
    """In-place allreduce-like plans: input and output are one buffer, chunk for chunk."""
    if buf is None or not _same_grid_inplace(doc) or buf[1] not in ("i", "o"):
        return buf
    return (buf[0], "io")


def _same_grid_inplace(doc: dict) -> bool:
    return (bool(doc.get("inplace")) and doc.get("collective") in ("allreduce", "broadcast", "sendrecv")
            and all(g["input_chunks"] == g["output_chunks"] for g in doc["gpus"]))


def _conflicts(doc: dict, rank: int, tb: int, a: dict, b: dict) -> list[tuple[tuple, tuple, tuple]]:
    """Operands of ``a`` and ``b`` that overlap, one of them written: (buffer, a's range, b's range)."""
    out = []
    for ba, wa, ra in _refs(doc, rank, tb, a):
        for bb, wb, rb in _refs(doc, rank, tb, b):
            if not (wa or wb):
                continue
            if ba is None or bb is None:
                out.append((None, ra, rb))
                continue
            if _alias(doc, ba) != _alias(doc, bb):
                continue
            if ra[0] < rb[0] + rb[1] and rb[0] < ra[0] + ra[1]:
                out.append((ba, ra, rb))
    return out


def _same_mapping(a: dict, b: dict, conflicts: list) -> bool:
    """Every conflict between ``a`` and ``b`` is over the same chunks, split among the block's
    threads the same way (same range, both packet ops or both plain, same thread-block group)."""
    if (a["name"] in PACKET_OPS) != (b["name"] in PACKET_OPS) or a.get("tbg_info") != b.get("tbg_info"):
        return not conflicts
    return all(buf is not None and ra == rb for buf, ra, rb in conflicts)


def _epoch_around(lst: list[dict], k: int, step: int) -> list[dict]:
    """Data ops from position ``k`` walking by ``step`` up to the first sync op."""
    out = []
    while 0 <= k < len(lst) and lst[k]["name"] not in SYNC_OPS:
        out.append(lst[k])
        k += step
    return out


def _meet_ok(doc: dict, site: Site, xs: list[dict], ys: list[dict]) -> bool:
    return all(_same_mapping(x, y, _conflicts(doc, site.rank, site.tb, x, y)) for x in xs for y in ys)


def _alignment_equivalent(doc: dict) -> Optional[str]:
    """Why a plan is correct at any buffer alignment the loader accepts, when it is: only an
    epilogue's rows can be cut by a chunk boundary (every other op moves or reduces chunk to
    chunk, elementwise, on one grid for every rank)."""
    norms = [op for _, _, _, _, op, _ in _each_op(doc) if op["name"] == "rmsnorm"]
    if not norms:
        return "no epilogue: ops move and reduce chunk to chunk, elementwise, at any alignment"
    if doc.get("chunk_unit") == "row":
        return ("chunks are whole rows (chunk_unit \"row\"): the alignment cuts no row, it only splits "
                "thread-block groups' shares")
    whole = all(ref.get("index") == 0 and ref.get("size") == g["input_chunks"]
                for g in doc["gpus"] for tb in g["threadblocks"] for op in tb["ops"] if op["name"] == "rmsnorm"
                for ref in op["src_buff"])
    if whole:
        return "every rmsnorm normalises the whole buffer: no chunk boundary falls inside its rows"
    return None


def judge(doc: dict, site: Site) -> Optional[str]:
    """Why the mutant of ``doc`` at ``site`` is *equivalent* (still a correct plan), when it
    falls in one of the classes judged so by hand in notes/reliability_mutation.md; None
    otherwise (a survivor ``judge`` does not explain is a candidate miss). The rules assume the
    mutant passed ``verify`` (no deadlock, no wrong output at the sizes run)."""
    if site.operator == "sem_init":
        return None
    if site.operator == "alignment":
        return _alignment_equivalent(doc)
    op, lst, k = _locate(doc, site)
    if site.operator == "swap_buffer" and _same_grid_inplace(doc):
        ref = next(x for x in op["dst_buff" if site.arg == 0 else "src_buff"] if x.get("type") is not None)
        if ref["type"] in ("i", "o"):
            return "in place: input and output are one buffer, chunk for chunk"
    back_pressure = ("a relaxed back-pressure wait of a double-buffered LL plan: what it orders "
                     "(the receiver's previous launch before this rank's packet writes into the "
                     "same half) is needed only by this rank's next launch, which the kernel's end "
                     "orders after the wait; no thread of this launch needs it, so no nop after it")
    ll_double = doc.get("protocol") == "LL" and bool(doc.get("use_double_scratch_buffer"))

    def packet_writes_follow(at: int) -> bool:
        """The data ops from ``at`` to the next sync op touch peers only by writing packets."""
        ops = _epoch_around(lst, at, 1)
        return bool(ops) and all(x["name"] in PACKET_WRITERS or not any(
            ref.get("buffer_id") is not None or ref.get("switch_channel_id") is not None
            for ref in (x.get("src_buff") or []) + (x.get("dst_buff") or [])) for x in ops)
    if site.operator == "drop_nop":
        prev = lst[k - 1]["name"] if k > 0 else None
        nxt = lst[k + 1]["name"] if k + 1 < len(lst) else None
        if nxt is None and site.inner is None:
            return "the block's last op: the kernel's end orders everything before it"
        if (prev is not None and nxt is not None and prev not in SYNC_OPS and nxt not in SYNC_OPS
                and _meet_ok(doc, site, _epoch_around(lst, k - 1, -1), _epoch_around(lst, k + 1, 1))):
            return ("the ops the nop separated touch no common bytes, or the same bytes split among "
                    "the threads the same way")
        if prev == "rlxwait" and ll_double and packet_writes_follow(k + 1):
            return back_pressure
    if site.operator in ("drop_trigger_nop", "swap_trigger_nop", "drop_nop") and 0 < k and k + 2 < len(lst):
        w, p = (lst[k], lst[k + 2]) if site.operator == "swap_trigger_nop" else (lst[k - 1], lst[k + 1])
        waited = [_peer_of(doc, site.rank, site.tb, w.get("channel_type", "none"), c) for c in _ids(w)]
        posted = [_peer_of(doc, site.rank, site.tb, "port", c) for c in p.get("channel_ids") or []]
        if (w["name"] in ACQUIRES and p["name"] in ("put", "pws", "pwsf") and p.get("channel_type") == "port"
                and all(ref.get("type") == "i" for ref in p.get("src_buff") or [])
                and len(posted) <= len(waited) and None not in posted and posted == waited[:len(posted)]):
            return ("every entry k of the port request goes to the peer that thread k waited on and sends "
                    "the rank's input: thread k has the only edge entry k needs, the peer's ready signal")
    if site.operator == "drop_ready_pair":
        mutant = mutate(doc, site)
        pairs = [x for x in sites(mutant, ["drop_ready_pair"]) if x.rank == site.rank]
        peer = _peer_of(doc, site.rank, site.tb, "memory", op["channel_ids"][site.arg])
        if any(_peer_of(mutant, x.rank, x.tb, "memory",
                        _locate(mutant, x)[0]["channel_ids"][x.arg]) == peer for x in pairs):
            return ("another block's ready pair between the same two ranks remains (an other "
                    "instance): its signal comes from the receiver's launch after the one that "
                    "read the packets, since a launch ends as a whole, so it orders the sender's "
                    "reuse as well")
    if site.operator == "swap_ops":
        a, b = lst[k], lst[k + 1]
        names = {a["name"], b["name"]}
        if a["name"] not in SYNC_OPS and b["name"] not in SYNC_OPS:
            if not _conflicts(doc, site.rank, site.tb, a, b):
                return ("two data ops over different bytes: their order orders nothing (a receive "
                        "moved before a send could only deadlock, and none did)")
        elif [a["name"], b["name"]] == ["rlxwait", "nop"] and ll_double and packet_writes_follow(k + 2):
            return back_pressure
        elif names == {"rlxsignal", "rlxwait"}:
            return ("the relaxed ready signal and wait in the other order on one rank: the wait still "
                    "precedes the block's accesses, the signal still follows the launch start")
        elif k + 2 == len(lst) and site.inner is None and names <= {"nop", "wait", "rlxwait"}:
            return "the block's last wait and nop in the other order: the kernel's end orders both"
        elif "nop" in names and (a if b["name"] == "nop" else b)["name"] not in SYNC_OPS:
            # the data op crosses the nop and now shares an epoch with the ops on the other side
            if a["name"] == "nop":
                crossing, side = b, _epoch_around(lst, k - 1, -1)
            else:
                crossing, side = a, _epoch_around(lst, k + 2, 1)
            if _meet_ok(doc, site, [crossing], side):
                return ("a data op moved across a nop meets only ops over other bytes, or the same "
                        "bytes split among the threads the same way")
    return None


# ------------------------------------------------------------------------------- running
class _Timeout(Exception):
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise _Timeout()


def classify(plan_name: str, doc: dict, site: Site, timeout: float = 0.0,
             verify_kwargs: Optional[dict] = None) -> Result:
    """Build the mutant of ``doc`` at ``site``, load it and run a default verify (``verify_kwargs``
    overrides options, for quick tests only). ``timeout`` (seconds, 0: none) bounds the run: as
    the simulator's time limit (its budget refuses, or its deadline stops, a run that would take
    longer), with ``SIGALRM`` as a backstop (main thread only) for time spent outside the
    simulator's steps."""
    from mscclang.errors import LimitError
    from mscclang.plan import load_plan
    from mscclang.sim import verify
    from mscclang.sim.budget import Limits

    t0 = time.perf_counter()
    mutant = mutate(doc, site)
    old = None
    kw = dict(verify_kwargs or {})
    if timeout > 0:
        kw.setdefault("limits", Limits(Limits.from_env().memory_bytes, timeout))
        old = signal.signal(signal.SIGALRM, _on_alarm)
        # repeating: an alarm that lands in a garbage-collector callback or a finaliser is
        # swallowed there (Python reports it as unraisable), so the next one must follow
        backstop = 2 * timeout + 1.0
        signal.setitimer(signal.ITIMER_REAL, backstop, backstop)
    try:
        try:
            plan = load_plan(json.dumps(mutant))
        except PlanError as e:
            return Result(plan_name, site, "rejected", ["load"], str(e).splitlines()[0],
                          time.perf_counter() - t0)
        try:
            rep = verify(plan, max_problems=1, **kw)
        except LimitError as e:   # the budget refused it, or its deadline stopped it
            return Result(plan_name, site, "timeout", [], str(e).splitlines()[0], time.perf_counter() - t0)
        if rep.ok:
            return Result(plan_name, site, "survived", [], "", time.perf_counter() - t0)
        first = rep.problems[0] if rep.problems else None
        return Result(plan_name, site, "killed", sorted({p.kind for p in rep.problems}),
                      first.message.splitlines()[0] if first else "", time.perf_counter() - t0)
    except _Timeout:
        return Result(plan_name, site, "timeout", [], f"over {timeout:g} s", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a traceback from the verifier is an outcome to report
        tb = traceback.format_exc().strip().splitlines()
        return Result(plan_name, site, "error", [type(e).__name__], f"{e} ({tb[-3].strip() if len(tb) > 2 else ''})",
                      time.perf_counter() - t0)
    finally:
        if timeout > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def pick(all_sites: Sequence[Site], per_operator: int) -> list[Site]:
    """At most ``per_operator`` sites of each operator, spread evenly over the plan (the first,
    the last, and evenly between), so every part of the plan is reached; 0: all."""
    if per_operator <= 0:
        return list(all_sites)
    by: dict[str, list[Site]] = {}
    for s in all_sites:
        by.setdefault(s.operator, []).append(s)
    out: list[Site] = []
    for lst in by.values():
        if len(lst) <= per_operator:
            out.extend(lst)
        elif per_operator == 1:
            out.append(lst[0])
        else:
            idx = sorted({round(k * (len(lst) - 1) / (per_operator - 1)) for k in range(per_operator)})
            out.extend(lst[k] for k in idx)
    return out


def sweep(plan_paths: Sequence[Path], operators: Iterable[str] = tuple(OPERATORS),
          per_operator: int = 0, timeout: float = 300.0,
          on_result: Optional[Callable[[Result], None]] = None,
          skip: Optional[set] = None) -> list[Result]:
    """Run every picked mutant of every plan (``per_operator`` sites of each operator per plan,
    0: all); ``on_result`` sees each result as it comes; ``skip`` holds ``(plan, site key)``
    pairs already done (to resume a sweep)."""
    ops = list(operators)
    results: list[Result] = []
    for path in plan_paths:
        doc = json.loads(Path(path).read_text())
        name = Path(path).name
        for site in pick(sites(doc, ops), per_operator):
            if skip and (name, site.key()) in skip:
                continue
            try:
                res = classify(name, doc, site, timeout)
            except MutationError as e:
                res = Result(name, site, "error", ["MutationError"], str(e))
            results.append(res)
            if on_result is not None:
                on_result(res)
    return results


def summarize(results: Iterable[Result]) -> dict:
    """Counts per outcome, overall and per operator."""
    res = list(results)
    total = Counter(r.outcome for r in res)
    per_op: dict[str, Counter] = {}
    for r in res:
        per_op.setdefault(r.site.operator, Counter())[r.outcome] += 1
    return {"mutants": len(res), "outcomes": dict(total),
            "per_operator": {k: dict(v) for k, v in sorted(per_op.items())}}


def load_results(path: Path) -> list[Result]:
    """Results saved one JSON object per line by :func:`main`."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        site = Site(d["operator"], d["rank"], d["tb"], d["op"], d["inner"], d["arg"])
        out.append(Result(d["plan"], site, d["outcome"], d["kinds"], d["message"], d["seconds"]))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m tools.mutation [PLAN ...] --out results.jsonl``: sweep the shipped
    plans (or the given ones), one JSON line per mutant, resuming where ``--out`` left off."""
    ap = argparse.ArgumentParser(prog="python -m tools.mutation", description=main.__doc__)
    ap.add_argument("plans", nargs="*", help="plan files (default: every plan in plans/)")
    ap.add_argument("--out", required=True, help="results file (JSON lines; appended, resumed)")
    ap.add_argument("--operators", nargs="+", default=list(OPERATORS), choices=list(OPERATORS))
    ap.add_argument("--per-operator", type=int, default=0,
                    help="sites per operator per plan, spread over the plan (default 0: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant (default 300)")
    ap.add_argument("--max-memory", type=float, default=8.0,
                    help="address-space limit of the sweep in GiB (a mutant over it ends as an "
                         "'error' with MemoryError; default 8, 0: none)")
    args = ap.parse_args(argv)
    if args.max_memory > 0:
        import resource
        lim = int(args.max_memory * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    if args.plans:
        paths = [Path(p) for p in args.plans]
    else:
        root = Path(__file__).resolve().parent.parent.parent / "plans"
        paths = sorted(p for p in root.glob("*.json") if p.name != "index.json")
    out = Path(args.out)
    done = {(r.plan, r.site.key()) for r in load_results(out)} if out.exists() else set()
    with out.open("a") as f:
        def emit(r: Result) -> None:
            f.write(json.dumps(r.to_dict()) + "\n")
            f.flush()
        t0 = time.perf_counter()
        results = sweep(paths, args.operators, args.per_operator, args.timeout, emit, done)
    print(json.dumps(summarize(results), indent=2), f"\n{len(results)} mutants in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
