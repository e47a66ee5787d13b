"""A fuzzer for everything that reads a plan file: :func:`mscclang.plan.load_plan`,
``mscclang verify``, ``mscclang show`` and ``mscclang import-mscclpp``.

It takes the shipped plans and the tests' plans as seeds and mutates them, structurally (type
flips, extreme and negative numbers, indexes out of range, giant counts, missing and unknown
fields, deep nesting, duplicated ops and ranks, strings that are not valid Unicode, other
top-level values, conversion to the MSCCL++ format) and as bytes (truncation, bytes that are not
UTF-8, UTF-16, numbers of thousands of digits, ``NaN``, garbage); ``verify`` and ``show`` also get
mutated arguments. Every file runs through the four targets, in worker processes that each take
a batch of files under a memory limit (``RLIMIT_AS``) with a time limit per run, and each run is
classified:

* ``ok``: exit status 0 (``load``: a plan came back);
* ``clear``: exit status 1 with a message and no traceback (``load``: a
  :class:`~mscclang.errors.MscclangError`);
* ``traceback``: any other exception escaped, or a traceback was printed;
* ``memory``: a ``MemoryError`` (the address-space limit was hit), or the worker was killed;
* ``hang``: the run passed its time limit;
* ``crash``: the worker died (a signal) or exited otherwise.

The target is 0 runs outside ``ok`` and ``clear``. Usage::

    python -m tools.fuzz --count 10000 --seed 1 --out fuzz-out [--mem-limit 4G]
        [--timeout 60] [--batch 250] [--jobs 1]

It writes ``fuzz-out/results.jsonl`` (one line per run), ``fuzz-out/summary.json`` and keeps the
file of every finding under ``fuzz-out/findings/``. Workers run with ``MSCCLANG_SIM_MAX_MEMORY`` and
``MSCCLANG_SIM_MAX_SECONDS`` below the memory and time limits (``--sim-memory``, ``--sim-seconds``),
so a run that the simulator's budget accepts must stay within them.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

__all__ = ["fully_connected_plan", "Case", "Outcome", "seed_documents", "generate_cases",
           "run_case", "run_target", "campaign", "main", "CLASSES", "BAD_CLASSES"]

CLASSES = ("ok", "clear", "traceback", "memory", "hang", "crash")
BAD_CLASSES = ("traceback", "memory", "hang", "crash")
TARGETS = ("load", "show", "verify", "import")
_COMMANDS = {"show": "show", "verify": "verify", "import": "import-mscclpp"}
ROOT = Path(__file__).resolve().parents[1]


# ====================================================================== seeds
def fully_connected_plan(n: int) -> dict[str, Any]:
    """A valid ``n``-rank plan (collective ``test``) in which every rank signals every other
    rank on one memory channel each and then waits for all of them: ``n * (n - 1)`` channels,
    the shape that makes a simulation quadratic in the ranks."""
    gpus = []
    for r in range(n):
        peers = [p for p in range(n) if p != r]
        ch = list(range(n - 1))
        gpus.append({"id": r, "input_chunks": 1, "output_chunks": 1, "scratch_chunks": 0,
                     "channels": [{"channel_type": "memory", "connected_to": peers}],
                     "threadblocks": [{
                         "id": 0, "channels": [{"channel_type": "memory", "channel_ids": ch}],
                         "ops": [{"name": "signal", "channel_type": "memory", "channel_ids": ch},
                                 {"name": "wait", "channel_type": "memory", "channel_ids": ch}]}]})
    return {"format": "mscclang.plan/1", "name": f"fully_connected.r{n}", "collective": "test",
            "gpus": gpus}


def seed_documents(root: Path = ROOT, max_bytes: int = 600_000) -> list[tuple[str, Any]]:
    """(name, parsed JSON) of every seed: the shipped plans, the tests' golden and broken plans,
    the hand-built plans of :mod:`mscclang.plan.samples`, MSCCL++ conversions of a few of
    them and small fully connected plans. Files above ``max_bytes`` are left out."""
    files = (sorted((root / "plans").glob("*.json")) + sorted((root / "tests" / "golden").glob("*.json"))
             + sorted((root / "tests" / "plans_broken").glob("*.json")))
    out: list[tuple[str, Any]] = []
    for f in files:
        if f.name == "index.json" or f.stat().st_size > max_bytes:
            continue
        try:
            out.append((f"{f.parent.name}/{f.name}", json.loads(f.read_text())))
        except (OSError, ValueError):
            continue
    from mscclang.errors import MscclangError
    from mscclang.plan import load_plan, plan_to_dict, to_mscclpp
    from mscclang.plan import samples as sample_plans

    for fname in ("allreduce_oneshot_ll", "allreduce_twostep_ll", "allreduce_copyfwd_ll",
                  "allreduce_scratch_simple", "allreduce_read_simple", "allgather_simple", "allgather_put",
                  "allgather_pipeline", "missing_signal"):
        out.append((f"sample_plans/{fname}", plan_to_dict(getattr(sample_plans, fname)())))
    for name, doc in list(out)[::9]:
        try:
            out.append((f"mscclpp:{name}", to_mscclpp(load_plan(doc))))
        except MscclangError:
            continue
    out += [(f"generated/fully_connected.r{n}", fully_connected_plan(n)) for n in (3, 8)]
    return out


# ====================================================================== cases
@dataclass
class Case:
    """One fuzzed file and the runs it gets: ``runs`` holds (target, extra arguments)."""

    id: int
    seed: str
    mutations: list[str]
    data: bytes = field(repr=False)
    runs: list[tuple[str, list[str]]]


def _paths(doc: Any, limit: int = 200_000) -> list[tuple]:
    """Every path (tuple of keys and indexes) into ``doc``, the root included, iteratively."""
    out: list[tuple] = []
    stack: list[tuple[tuple, Any]] = [((), doc)]
    while stack and len(out) < limit:
        path, node = stack.pop()
        out.append(path)
        if isinstance(node, dict):
            stack.extend((path + (k,), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((path + (i,), v) for i, v in enumerate(node))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _set(doc: Any, path: tuple, value: Any) -> Any:
    """``doc`` with the node at ``path`` replaced (the root when ``path`` is empty)."""
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def _fmt_path(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path) or "$"


_EXTREME = [-1, 0, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**200,
            -(2**63), -(2**200), 10**30]
_INDEX_KEYS = ("index", "size", "buffer_id", "switch_channel_id", "channel_ids", "connected_to",
               "rank", "id", "semaphore_ids", "barrier_id", "tb_id", "remote_buffer_ids", "ranks",
               "barrier_tbs", "num_threadblocks", "tbg_size", "root", "num_ranks")
_COUNT_KEYS = ("input_chunks", "output_chunks", "scratch_chunks", "chunk_factor", "num_chunks",
               "unit_size", "num_threads_per_block", "buffer_alignment", "min_message_size",
               "max_message_size", "init_value", "size")
_ENUM_VALUES = {
    "name": ["nop", "barrier", "signal", "wait", "put", "get", "copy", "cpkt", "upkt", "ppkt", "rppkt",
             "re", "res", "rre", "rres", "repkt", "respkt", "recpkt", "recspkt", "glre", "glres",
             "gstore", "gstorepkt", "sem_acquire", "sem_release", "pipeline", "flush", "pws", "pwsf",
             "rlxsignal", "rlxwait", "PUT", "bogus"],
    "channel_type": ["memory", "port", "switch", "none", "nvls", ""],
    "type": ["i", "o", "s", "x", "input"],
    "buffer_type": ["i", "o", "s", "q"],
    "protocol": ["Simple", "LL", "ll", "LL128"],
    "collective": ["allreduce", "allgather", "reducescatter", "alltoall", "sendrecv", "broadcast", "test",
                   "custom", "allreduc", ""],
    "reduce_op": ["sum", "min", "max", "prod"],
    "packet_type": ["LL8", "LL16", "LL32"],
    "access_channel_type": ["memory", "port", "switch", "none"],
    "format": ["mscclang.plan/1", "mscclang.plan/2", "", "MSCCLANG.PLAN/1"],
}
_WEIRD_STRINGS = ["", "\ud800", "a\udfffb", "\x00", "\u202e", "x" * 5000, "😀", "\\", "\"", "ü"]


def _leaf_paths(doc: Any, paths: list[tuple]) -> list[tuple]:
    return [p for p in paths if not isinstance(_get(doc, p), (dict, list))]


def _m_flip_type(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    p = rng.choice(paths)
    old = _get(doc, p)
    choices: list[Any] = [None, True, False, [], {}, "x", 1.5, [old], {"v": old}]
    if isinstance(old, bool):
        choices += [int(old), str(old).lower()]
    elif isinstance(old, int):
        choices += [str(old), float(old), bool(old), old + 0.5]
    elif isinstance(old, str):
        choices += [len(old), [old]]
    return _set(doc, p, rng.choice(choices)), f"flip_type {_fmt_path(p)}"


def _m_number(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    leaves = [p for p in paths if isinstance(_get(doc, p), int) and not isinstance(_get(doc, p), bool)]
    if not leaves:
        return _m_flip_type(rng, doc, paths)
    p = rng.choice(leaves)
    old = _get(doc, p)
    new = rng.choice(_EXTREME + [old + 1, old - 1, old * 2, old * 1000, -old, old + 2**32])
    return _set(doc, p, new), f"number {_fmt_path(p)} {old} -> {new}"


def _m_keyed(rng: random.Random, doc: Any, paths: list[tuple], keys: Sequence[str],
             values: Callable[[Any], list[Any]], tag: str) -> tuple[Any, str]:
    cands = [p for p in paths if p and p[-1] in keys or (len(p) > 1 and isinstance(p[-1], int)
                                                         and p[-2] in keys)]
    if not cands:
        return _m_number(rng, doc, paths)
    p = rng.choice(cands)
    old = _get(doc, p)
    if isinstance(old, list):
        new: Any = (rng.choice(values(old[0] if old else 0)) if rng.random() < 0.3
                    else [rng.choice(values(x)) for x in old] or [rng.choice(values(0))])
    else:
        new = rng.choice(values(old))
    return _set(doc, p, new), f"{tag} {_fmt_path(p)} -> {str(new)[:40]}"


def _m_index(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    def values(old: Any) -> list[Any]:
        o = old if isinstance(old, int) and not isinstance(old, bool) else 0
        return [o + 1, o + 2, o + 8, o - 1, -1, 7, 63, 1000, 2**31 - 1, 2**31, 2**200]
    return _m_keyed(rng, doc, paths, _INDEX_KEYS, values, "index")


def _m_count(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    def values(old: Any) -> list[Any]:
        o = old if isinstance(old, int) and not isinstance(old, bool) else 16
        return [0, 1, 2, 3, 4, 8, o * 2, o * 64, o * 1024, 2**20, 2**21, 2**31 - 1, 2**40, 2**63,
                2**64 - 1, 2**64, -16]
    return _m_keyed(rng, doc, paths, _COUNT_KEYS, values, "count")


def _m_enum(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    cands = [p for p in paths if p and p[-1] in _ENUM_VALUES and isinstance(_get(doc, p), str)]
    if not cands:
        return _m_flip_type(rng, doc, paths)
    p = rng.choice(cands)
    new = rng.choice(_ENUM_VALUES[p[-1]])
    return _set(doc, p, new), f"enum {_fmt_path(p)} -> {new!r}"


def _m_delete_key(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    cands = [p for p in paths if p and isinstance(p[-1], str)]
    if not cands:
        return _m_flip_type(rng, doc, paths)
    p = rng.choice(cands)
    del _get(doc, p[:-1])[p[-1]]
    return doc, f"delete {_fmt_path(p)}"


def _m_add_key(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    dicts = [p for p in paths if isinstance(_get(doc, p), dict)]
    if not dicts:
        return _m_flip_type(rng, doc, paths)
    p = rng.choice(dicts)
    key = rng.choice(["extra", "ops", "gpus", "index", "tbg", "buff", "rank", "id", "src", "name",
                      "iter_context", "channel_ids", "format"])
    value = rng.choice([0, 1, -1, "x", None, [], {}, [0], {"unit_size": 1, "num_chunks": 1}])
    _get(doc, p)[key] = value
    return doc, f"add {_fmt_path(p)}.{key}"


def _m_list(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    lists = [p for p in paths if isinstance(_get(doc, p), list)]
    if not lists:
        return _m_flip_type(rng, doc, paths)
    p = rng.choice(lists)
    lst = _get(doc, p)
    kind = rng.choice(["dup", "drop", "shuffle", "empty", "reverse", "many"])
    if kind == "dup" and lst:
        i = rng.randrange(len(lst))
        lst.insert(i, copy.deepcopy(lst[i]))
    elif kind == "drop" and lst:
        del lst[rng.randrange(len(lst))]
    elif kind == "shuffle":
        rng.shuffle(lst)
    elif kind == "empty":
        lst.clear()
    elif kind == "reverse":
        lst.reverse()
    elif kind == "many" and lst:
        lst.extend([lst[-1]] * rng.choice([10, 100, 1000]))
    return doc, f"list-{kind} {_fmt_path(p)}"


def _m_swap(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    if len(paths) < 3:
        return _m_flip_type(rng, doc, paths)
    a, b = rng.sample(paths[1:], 2)
    if a[: len(b)] == b or b[: len(a)] == a:  # one inside the other
        return _m_flip_type(rng, doc, paths)
    va = copy.deepcopy(_get(doc, a))
    _set(doc, a, copy.deepcopy(_get(doc, b)))
    _set(doc, b, va)
    return doc, f"swap {_fmt_path(a)} {_fmt_path(b)}"


def _m_nest(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    p = rng.choice(paths)
    depth = rng.choice([2, 30, 200, 900, 3000])
    node = _get(doc, p)
    if rng.random() < 0.5:
        op = {"name": "pipeline", "iter_context": {"unit_size": 1024, "num_chunks": 1}, "ops": [{"name": "nop"}]}
        for _ in range(depth):
            op = {"name": "pipeline", "iter_context": {"unit_size": 1024, "num_chunks": 1}, "ops": [op]}
        ops = [q for q in paths if q and q[-1] == "ops" and isinstance(_get(doc, q), list)]
        if ops:
            q = rng.choice(ops)
            _get(doc, q).append(op)
            return doc, f"nested-pipelines {_fmt_path(q)} x{depth}"
    for _ in range(depth):
        node = [node] if rng.random() < 0.5 else {"a": node}
    return _set(doc, p, node), f"nest {_fmt_path(p)} x{depth}"


def _m_string(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    strs = [p for p in paths if isinstance(_get(doc, p), str)]
    if not strs:
        return _m_flip_type(rng, doc, paths)
    p = rng.choice(strs)
    new = rng.choice(_WEIRD_STRINGS)
    if rng.random() < 0.5:
        new = _get(doc, p) + new
    return _set(doc, p, new), f"string {_fmt_path(p)}"


def _m_top(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    new = rng.choice([None, [], [doc], 0, -1, 1.5, "plan", True, {}, {"format": "mscclang.plan/1"},
                      {"gpus": []}, {"gpus": None}, {"gpus": 5}, {"gpus": [None]}])
    return new, f"top-level {json.dumps(new)[:30] if new is not doc else 'wrapped'}"


def _m_scale(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    """Giant plans: ops or ranks multiplied, or a fully connected plan of many ranks."""
    kind = rng.choice(["ops", "ranks", "connected"])
    if kind == "connected":
        n = rng.choice([30, 120, 400, 1000])
        return fully_connected_plan(n), f"fully-connected r{n}"
    if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list) or not doc["gpus"]:
        return _m_flip_type(rng, doc, paths)
    if kind == "ops":
        tbs = [tb for g in doc["gpus"] if isinstance(g, dict) for tb in g.get("threadblocks") or []
               if isinstance(tb, dict) and isinstance(tb.get("ops"), list) and tb["ops"]]
        if not tbs:
            return _m_flip_type(rng, doc, paths)
        tb = rng.choice(tbs)
        k = rng.choice([10, 1000, 250_000 // len(tb["ops"]) + 1, 700_000 // len(tb["ops"]) + 1])
        tb["ops"] = tb["ops"] * k
        return doc, f"ops x{k}"
    k = rng.choice([2, 4, 16, 128])
    gpus = doc["gpus"]
    more = []
    for j in range(k):
        for g in gpus:
            g2 = copy.deepcopy(g) if k <= 4 else g
            if isinstance(g2, dict) and k <= 4:
                g2["id"] = len(gpus) * j + (g.get("id", 0) if isinstance(g.get("id"), int) else 0)
            more.append(g2)
    doc["gpus"] = more
    if "num_ranks" in doc:
        doc["num_ranks"] = len(more)
    return doc, f"ranks x{k}"


def _ops_lists(doc: Any) -> list[list]:
    if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
        return []
    return [tb["ops"] for g in doc["gpus"] if isinstance(g, dict) and isinstance(g.get("threadblocks"), list)
            for tb in g["threadblocks"] if isinstance(tb, dict) and isinstance(tb.get("ops"), list) and tb["ops"]]


def _m_plausible(rng: random.Random, doc: Any, paths: list[tuple]) -> tuple[Any, str]:
    """Changes that often keep the plan valid, so the simulator and ``show`` see odd but loadable
    plans: another alignment, thread count, size range, reduce op or flag; ops dropped, moved or
    duplicated; a chunk index shifted by one; more scratch; pipeline units and thread-block
    groups changed."""
    if not isinstance(doc, dict):
        return _m_flip_type(rng, doc, paths)
    kind = rng.choice(["align", "threads", "range", "reduce", "flag", "drop-op", "move-op", "dup-op",
                       "shift", "scratch", "unit", "tbg", "packet"])
    ops_lists = _ops_lists(doc)
    if kind == "align":
        doc["buffer_alignment"] = rng.choice([8, 16, 32, 64, 128, 1024, 65536, 1 << 20])
    elif kind == "threads":
        doc["num_threads_per_block"] = rng.choice([32, 64, 96, 256, 1000, 1024])
    elif kind == "range":
        lo = rng.choice([0, 1, 4, 1024, 1 << 20, 2**40, 2**64 - 1])
        doc["min_message_size"] = lo
        doc["max_message_size"] = rng.choice([lo, lo + 1, 2**64 - 1, max(lo, 4096)])
    elif kind == "reduce":
        doc["reduce_op"] = rng.choice(["sum", "min", "max"])
    elif kind == "flag":
        key = rng.choice(["inplace", "use_double_scratch_buffer", "reuse_resources"])
        doc[key] = not doc.get(key, False)
    elif kind == "packet":
        doc["packet_type"] = rng.choice(["LL8", "LL16"])
    elif kind in ("drop-op", "move-op", "dup-op") and ops_lists:
        ops = rng.choice(ops_lists)
        i = rng.randrange(len(ops))
        if kind == "drop-op":
            del ops[i]
        elif kind == "move-op":
            ops.insert(rng.randrange(len(ops)), ops.pop(i))
        else:
            ops.insert(i, copy.deepcopy(ops[i]))
    elif kind == "shift":
        refs = [p for p in paths if p and p[-1] == "index" and isinstance(_get(doc, p), int)]
        if refs:
            p = rng.choice(refs)
            _set(doc, p, max(0, _get(doc, p) + rng.choice([-1, 1])))
    elif kind == "scratch":
        for g in doc.get("gpus") or []:
            if isinstance(g, dict) and isinstance(g.get("scratch_chunks"), int):
                g["scratch_chunks"] += rng.choice([1, 8, 1000])
    elif kind == "unit":
        ctx = [p for p in paths if p and p[-1] == "iter_context" and isinstance(_get(doc, p), dict)]
        if ctx:
            _get(doc, rng.choice(ctx))["unit_size"] = rng.choice([1, 8, 16, 24, 4096, 1 << 30])
    elif kind == "tbg":
        tbg = [p for p in paths if p and p[-1] == "tbg_info" and isinstance(_get(doc, p), dict)]
        if tbg:
            t = _get(doc, rng.choice(tbg))
            t["tbg_size"] = rng.choice([1, 2, 3, 64])
            t["tb_id"] = rng.randrange(t["tbg_size"])
    return doc, f"plausible {kind}"


_STRUCTURAL: list[tuple[float, Callable]] = [
    (18, _m_plausible),
    (10, _m_flip_type), (12, _m_number), (14, _m_index), (12, _m_count), (8, _m_enum),
    (8, _m_delete_key), (5, _m_add_key), (8, _m_list), (5, _m_swap), (2, _m_nest), (3, _m_string),
    (1.5, _m_top), (0.4, _m_scale),
]


def _serialize(rng: random.Random, doc: Any) -> tuple[bytes, str]:
    try:
        if rng.random() < 0.8:
            return json.dumps(doc).encode("ascii"), ""
        return json.dumps(doc, ensure_ascii=False, indent=rng.choice([None, 1])).encode(
            "utf-8", "surrogatepass"), "raw-utf8"
    except (ValueError, RecursionError):  # very deep nesting: fall back to a text form
        return b"[" * 5000 + b"]" * 5000, "deep-text"


def _b_truncate(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    k = rng.randrange(len(data) + 1)
    return data[:k], f"truncate {k}"


def _b_bad_utf8(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    bad = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xfe\xff", b"\xf8\x88\x80\x80\x80"])
    k = rng.randrange(len(data) + 1)
    return data[:k] + bad + data[k:], f"bad-utf8 at {k}"


def _b_encoding(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    enc = rng.choice(["utf-16", "utf-16-le", "utf-32", "utf-8-sig", "latin-1"])
    text = data.decode("utf-8", "replace")
    try:
        return text.encode(enc), f"encoding {enc}"
    except UnicodeEncodeError:
        return text.encode(enc, "replace"), f"encoding {enc}"


def _b_number_text(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    digits = [i for i in range(len(data)) if 48 <= data[i] <= 57 and (i == 0 or not 48 <= data[i - 1] <= 57)]
    if not digits:
        return _b_bad_utf8(rng, data)
    i = rng.choice(digits)
    j = i
    while j < len(data) and 48 <= data[j] <= 57:
        j += 1
    new = rng.choice([b"9" * 5000, b"1" * 4300, b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-0",
                      b"1.0", b"1e2", b"0x10", b"01", b"+1"])
    return data[:i] + new + data[j:], f"number-text at {i} -> {new[:12]!r}"


def _b_flip(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    if not data:
        return b"\x00", "flip empty"
    b = bytearray(data)
    for _ in range(rng.choice([1, 2, 8])):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b), "byte-flip"


def _b_garbage(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    kind = rng.choice(["empty", "random", "deep", "ws", "dupkey"])
    if kind == "empty":
        return b"", "empty file"
    if kind == "random":
        return bytes(rng.randrange(256) for _ in range(rng.choice([1, 10, 1000]))), "random bytes"
    if kind == "deep":
        n = rng.choice([500, 990, 1000, 100_000])
        return b"{\"format\": \"mscclang.plan/1\", \"gpus\": " + b"[" * n + b"]" * n + b"}", f"deep-text {n}"
    if kind == "ws":
        return b" \n\t" * rng.choice([1, 1000]) + data, "leading whitespace"
    return data.replace(b'"gpus"', b'"gpus": [], "gpus"', 1), "duplicate key"


_BYTES: list[tuple[float, Callable]] = [
    (3, _b_truncate), (3, _b_bad_utf8), (2, _b_encoding), (3, _b_number_text), (2, _b_flip), (2, _b_garbage),
]


def _pick(rng: random.Random, table: list[tuple[float, Callable]]) -> Callable:
    total = sum(w for w, _ in table)
    x = rng.random() * total
    for w, f in table:
        x -= w
        if x <= 0:
            return f
    return table[-1][1]


_VERIFY_ARGS: list[tuple[float, list[str]]] = [
    (45, ["--schedules", "1"]),
    (15, ["--schedules", "2", "--dtype", "fp32", "--sizes", "1K", "3000"]),
    (8, []),
    (3, ["--seed", "-1"]), (2, ["--seed", "7"]), (3, ["--schedules", "0"]), (3, ["--schedules", "1000000000"]),
    (3, ["--launches", "0"]), (3, ["--launches", "1000000000"]), (2, ["--launches", "3", "--schedules", "1"]),
    (3, ["--sizes", "64G"]), (2, ["--sizes", "0"]), (2, ["--sizes", "-1"]), (2, ["--sizes", "3"]),
    (2, ["--sizes", "1.5K"]), (1, ["--sizes", "abc"]), (2, ["--sizes", "17", "--schedules", "1"]),
    (2, ["--dtype", "fp8_e4m3", "--schedules", "1"]), (1, ["--dtype", "bogus"]),
    (2, ["--reduce-op", "max", "--schedules", "1"]), (2, ["--packet-type", "LL8", "--schedules", "1"]),
    (1, ["--no-symbolic", "--schedules", "1"]),
]
_SHOW_ARGS: list[tuple[float, list[str]]] = [
    (45, []), (8, ["--rank", "0"]), (5, ["--rank", "-1"]), (5, ["--rank", "99"]), (5, ["--tb", "0"]),
    (4, ["--tb", "-3"]), (4, ["--tb", "999"]), (25, ["--no-check"]), (3, ["--rank", "1", "--tb", "1"]),
    (3, ["--no-check", "--rank", "1"]), (3, ["--png", "{dir}/fuzz.png"]), (1, ["--png", "{dir}/fuzz.png", "--rank", "0"]),
]


def _pick_args(rng: random.Random, table: list[tuple[float, list[str]]]) -> list[str]:
    total = sum(w for w, _ in table)
    x = rng.random() * total
    for w, a in table:
        x -= w
        if x <= 0:
            return list(a)
    return list(table[-1][1])


def generate_cases(count: int, seed: int = 0, seeds: Optional[list[tuple[str, Any]]] = None,
                   start: int = 0) -> Iterator[Case]:
    """``count`` fuzzed cases, deterministic for a given ``seed`` (and seed corpus). Small seed
    files are picked more often (weight ``1 / sqrt(size)``)."""
    corpus = seeds if seeds is not None else seed_documents()
    weights = [1 / math.sqrt(len(json.dumps(d)) + 100) for _, d in corpus]
    paths_cache: dict[int, list[tuple]] = {}
    for i in range(start, start + count):
        rng = random.Random(f"{seed}:{i}")
        k = rng.choices(range(len(corpus)), weights)[0]
        name, base = corpus[k]
        muts: list[str] = []
        r = rng.random()
        if r < 0.04:
            data, what = json.dumps(base).encode(), "unmodified"
            muts.append(what)
        else:
            doc = copy.deepcopy(base)
            paths = paths_cache.get(k) or paths_cache.setdefault(k, _paths(base))
            plausible_only = r < 0.34  # a third of the files: changes that tend to keep a plan valid
            for j in range(rng.choice([1, 1, 1, 2, 3])):
                if j:
                    paths = _paths(doc)
                if not paths:
                    break
                mutate = _m_plausible if plausible_only else _pick(rng, _STRUCTURAL)
                try:
                    doc, what = mutate(rng, doc, paths)
                except RecursionError:  # a deep nest made by an earlier mutation: keep it as it is
                    break
                muts.append(what)
            data, what = _serialize(rng, doc)
            if what:
                muts.append(what)
            if r > 0.78:
                data, what = _pick(rng, _BYTES)(rng, data)
                muts.append(what)
        runs = [("load", []), ("show", _pick_args(rng, _SHOW_ARGS)), ("verify", _pick_args(rng, _VERIFY_ARGS)),
                ("import", ["--no-check"] if rng.random() < 0.3 else [])]
        yield Case(i, name, muts, data, runs)


# ====================================================================== running
@dataclass
class Outcome:
    """How one run of one case ended."""

    id: int
    target: str
    argv: list[str]
    cls: str
    rc: Optional[int]
    seconds: float
    message: str = ""


class _Timeout(BaseException):
    """Raised by the alarm: not an Exception, so no ``except Exception`` swallows it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


def _head(text: str, n: int = 300) -> str:
    text = text.strip()
    lines = text.splitlines()
    return (lines[-1] if lines else "")[:n]


def _where(e: BaseException) -> str:
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return ""
    code = last.tb_frame.f_code
    return f" at {Path(code.co_filename).name}:{last.tb_lineno} ({code.co_name})"


def run_target(target: str, path: str, args: Sequence[str], timeout: float) -> tuple[str, Optional[int], str]:
    """Run one target on one file in this process, bounded by an alarm of ``timeout`` seconds;
    returns (class, exit status, message). Standard output and error are captured through a
    strict UTF-8 encoder, as a terminal's would be."""
    from mscclang.errors import MscclangError

    args = [a.replace("{dir}", str(Path(path).parent)) for a in args]  # e.g. where --png writes
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    use_alarm = timeout > 0 and hasattr(signal, "setitimer")
    old = signal.signal(signal.SIGALRM, _on_alarm) if use_alarm else None
    rc: Optional[int] = None
    try:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            if target == "load":
                from mscclang.plan import load_plan

                try:
                    load_plan(Path(path))
                    rc = 0
                except MscclangError as e:
                    rc = 1
                    err.write(f"{e}\n")
            else:
                from mscclang.cli.main import main

                with redirect_stdout(out), redirect_stderr(err):
                    try:
                        rc = main([_COMMANDS[target], path, *args])
                    except SystemExit as e:
                        rc = e.code if isinstance(e.code, int) else 1
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        return "hang", None, f"no result after {timeout:g} s"
    except MemoryError as e:
        return "memory", None, f"MemoryError{_where(e)}"
    except RecursionError as e:
        return "traceback", None, f"RecursionError{_where(e)}"
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        return "traceback", None, f"{type(e).__name__}: {str(e)[:200]}{_where(e)}"
    finally:
        if use_alarm:
            signal.signal(signal.SIGALRM, old)
    try:
        err.flush()
        text = err.buffer.getvalue().decode("utf-8", "replace")  # type: ignore[attr-defined]
    except ValueError:
        text = ""
    if "Traceback (most recent call last)" in text:
        return "traceback", rc, _head(text)
    if rc == 0:
        return "ok", rc, ""
    if rc == 1:
        return "clear", rc, _head(text)
    return "crash", rc, f"exit status {rc}: {_head(text)}"


def run_case(case: Case, workdir: Path, timeout: float) -> list[Outcome]:
    """Write ``case``'s file under ``workdir`` and run each of its runs in this process."""
    path = workdir / f"case{case.id}.json"
    path.write_bytes(case.data)
    out = []
    try:
        for target, args in case.runs:
            t = time.perf_counter()
            cls, rc, msg = run_target(target, str(path), args, timeout)
            out.append(Outcome(case.id, target, args, cls, rc, round(time.perf_counter() - t, 3), msg))
    finally:
        path.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------- worker processes
def _parse_bytes(text: str) -> int:
    """``"4G"`` -> 4 GiB (suffixes K, M, G, T: powers of 1024)."""
    t = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    return int(float(t[:-1] if scale > 1 else t) * scale)


def _worker(args: argparse.Namespace) -> int:
    """Run the cases of a batch directory in order; one result line per run, flushed, with a
    ``start`` line before each run so the parent can tell which run a dead worker was in."""
    if args.mem_limit:
        lim = _parse_bytes(args.mem_limit)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    batch = Path(args.batch_dir)
    cases = json.loads((batch / "cases.json").read_text())
    done_file = batch / "done.json"
    done = set(json.loads(done_file.read_text())) if done_file.exists() else set()
    with open(batch / "results.jsonl", "a", encoding="utf-8") as res:
        for c in cases:
            path = batch / c["file"]
            for target, argv in c["runs"]:
                if f"{c['id']}:{target}" in done:
                    continue
                res.write(json.dumps({"id": c["id"], "target": target, "start": True}) + "\n")
                res.flush()
                t = time.perf_counter()
                cls, rc, msg = run_target(target, str(path), argv, args.timeout)
                o = Outcome(c["id"], target, argv, cls, rc, round(time.perf_counter() - t, 3), msg)
                res.write(json.dumps(asdict(o)) + "\n")
                res.flush()
                if cls in ("memory", "hang"):
                    return 3  # the process may be in a bad state: let the parent start a fresh one
    return 0


def _run_batch(batch: Path, cases: list[Case], mem_limit: str, timeout: float, env: dict) -> list[Outcome]:
    """Run a batch of cases in worker processes until every run has an outcome: a worker that
    dies is replaced, its current run classified (killed: ``memory``, past the watchdog: ``hang``,
    another signal or status: ``crash``)."""
    by_id = {c.id: c for c in cases}
    meta = []
    for c in cases:
        f = f"case{c.id}.json"
        (batch / f).write_bytes(c.data)
        meta.append({"id": c.id, "file": f, "runs": c.runs})
    (batch / "cases.json").write_text(json.dumps(meta))
    results = batch / "results.jsonl"
    outcomes: dict[tuple[int, str], Outcome] = {}
    while len(outcomes) < sum(len(c.runs) for c in cases):
        (batch / "done.json").write_text(json.dumps([f"{i}:{t}" for i, t in outcomes]))
        cmd = [sys.executable, "-m", "tools.fuzz", "worker", "--batch-dir", str(batch),
               "--timeout", str(timeout), "--mem-limit", mem_limit]
        start_len = results.stat().st_size if results.exists() else 0
        errbuf = tempfile.TemporaryFile()  # a file, not a pipe: a chatty worker cannot block on it
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errbuf, cwd=ROOT)
        last_change = time.monotonic()
        last_size = start_len
        killed_for_hang = False
        while proc.poll() is None:
            time.sleep(0.2)
            size = results.stat().st_size if results.exists() else 0
            if size != last_size:
                last_size, last_change = size, time.monotonic()
            elif time.monotonic() - last_change > 2 * timeout + 30:
                proc.kill()
                killed_for_hang = True
                proc.wait()
        errbuf.seek(0)
        errtext = errbuf.read()[-20000:].decode("utf-8", "replace")
        errbuf.close()
        with open(results, encoding="utf-8") as fh:
            fh.seek(start_len)
            lines = [json.loads(x) for x in fh.read().splitlines() if x.strip()]
        pending: Optional[dict] = None
        for d in lines:
            if d.get("start"):
                pending = d
                continue
            o = Outcome(**d)
            outcomes[(o.id, o.target)] = o
            pending = None
        if pending is not None:  # the worker stopped inside this run
            rc = proc.returncode
            if killed_for_hang:
                cls, msg = "hang", f"killed after {2 * timeout + 30:g} s without a result"
            elif rc == -signal.SIGKILL:
                cls, msg = "memory", "worker killed (SIGKILL: out of memory?)"
            else:
                cls, msg = "crash", f"worker ended with status {rc}: {_head(errtext)}"
            cid, tgt = pending["id"], pending["target"]
            argv = next(a for t, a in by_id[cid].runs if t == tgt)
            outcomes[(cid, tgt)] = Outcome(cid, tgt, argv, cls, None, 0.0, msg)
        elif proc.returncode not in (0, 3):
            raise RuntimeError(f"fuzz worker failed outside any run (status {proc.returncode}): {errtext[-2000:]}")
    return [outcomes[(c.id, t)] for c in cases for t, _ in c.runs]


def campaign(count: int, out: Path, seed: int = 0, mem_limit: str = "4G", timeout: float = 60.0,
             batch_size: int = 250, sim_memory: str = "1536M", sim_seconds: float = 20.0,
             progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Fuzz ``count`` files in batches of ``batch_size`` (one worker process at a time, replaced
    when it dies) and write ``out/results.jsonl``, ``out/summary.json`` and ``out/findings/``.
    Returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    findings = out / "findings"
    findings.mkdir(exist_ok=True)
    env = dict(os.environ, MSCCLANG_SIM_MAX_MEMORY=sim_memory, MSCCLANG_SIM_MAX_SECONDS=str(sim_seconds),
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    seeds = seed_documents()
    t0 = time.monotonic()
    counts: dict[str, dict[str, int]] = {t: {c: 0 for c in CLASSES} for t in TARGETS}
    files_bad = 0
    n_done = 0
    with open(out / "results.jsonl", "w", encoding="utf-8") as res:
        gen = generate_cases(count, seed, seeds)
        while n_done < count:
            cases = [c for _, c in zip(range(min(batch_size, count - n_done)), gen)]
            with tempfile.TemporaryDirectory(prefix="mscclang-fuzz-") as tmp:
                outs = _run_batch(Path(tmp), cases, mem_limit, timeout, env)
            by_case: dict[int, list[Outcome]] = {}
            for o in outs:
                counts[o.target][o.cls] += 1
                by_case.setdefault(o.id, []).append(o)
                res.write(json.dumps(asdict(o)) + "\n")
            for c in cases:
                bad = [o for o in by_case[c.id] if o.cls in BAD_CLASSES]
                if bad:
                    files_bad += 1
                    (findings / f"case{c.id}.json").write_bytes(c.data)
                    (findings / f"case{c.id}.txt").write_text(json.dumps(
                        {"seed": c.seed, "mutations": c.mutations, "runs": [asdict(o) for o in by_case[c.id]]},
                        indent=1))
            res.flush()
            n_done += len(cases)
            if progress:
                bad_runs = sum(counts[t][c] for t in TARGETS for c in BAD_CLASSES)
                progress(f"{n_done}/{count} files, {bad_runs} bad runs, {time.monotonic() - t0:.0f} s")
    summary = {
        "files": count, "runs": sum(sum(v.values()) for v in counts.values()), "seed": seed,
        "mem_limit": mem_limit, "timeout_s": timeout, "sim_memory": sim_memory, "sim_seconds": sim_seconds,
        "seconds": round(time.monotonic() - t0, 1), "files_with_findings": files_bad, "by_target": counts,
        "totals": {c: sum(counts[t][c] for t in TARGETS) for c in CLASSES},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: a campaign (default) or, internally, a ``worker``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        p = argparse.ArgumentParser(prog="python -m tools.fuzz worker")
        p.add_argument("--batch-dir", required=True)
        p.add_argument("--timeout", type=float, default=60.0)
        p.add_argument("--mem-limit", default="")
        return _worker(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="python -m tools.fuzz",
                                description="Fuzz load_plan / mscclang show / mscclang verify with mutated plan files.")
    p.add_argument("--count", type=int, default=1000, help="files to generate (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="fuzz-out", help="output directory (default fuzz-out)")
    p.add_argument("--mem-limit", default="4G", help="address-space limit of each worker (default 4G)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per run (default 60)")
    p.add_argument("--batch", type=int, default=250, help="files per worker process (default 250)")
    p.add_argument("--sim-memory", default="1536M", help="MSCCLANG_SIM_MAX_MEMORY of the workers")
    p.add_argument("--sim-seconds", type=float, default=20.0, help="MSCCLANG_SIM_MAX_SECONDS of the workers")
    a = p.parse_args(argv)
    s = campaign(a.count, Path(a.out), a.seed, a.mem_limit, a.timeout, a.batch, a.sim_memory, a.sim_seconds,
                 progress=lambda m: print(m, flush=True))
    print(json.dumps(s["totals"]), flush=True)
    bad = sum(s["totals"][c] for c in BAD_CLASSES)
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
