"""Mismatched calls between ranks on the torch.distributed fallback (the CPU path), with 2
spawned ranks. Seen: rank 0 all_reduce of 8 floats against rank 1's 16 ended in
``gloo::EnforceNotMet`` and SIGABRT; all_reduce against all_gather in a 20 s timeout and an
unusable group; float32 against bfloat16 in "Connection reset by peer" and SIGABRT. Every call
is now compared first (a digest all-gathered on the group, the descriptions through the store
when they differ): CallMismatch on every rank, naming what each rank called, and the group stays
usable; through ``Communicator.from_torch`` and through the ``mscclang`` torch.distributed
backend alike."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from mscclang.plan.call import make_call
from tests.harness.dist_ranks import spawn_ranks

#: (what rank 0 calls, what rank 1 calls, the words CallMismatch must hold); each call is
#: ``call(api, rank)`` where api runs a collective by name. The backend compares its calls
#: before the Communicator sees them, in its words (:meth:`Backend.words`); ``a|b``: ``a`` through the
#: Communicator, ``b`` through the backend
CASES = [
    ("sizes", lambda c, r: c.all_reduce(torch.ones(8 if r == 0 else 16)),
     "rank 0: allreduce of 8 x float32 sum (torch.distributed fallback), "
     "rank 1: allreduce of 16 x float32 sum (torch.distributed fallback)"),
    ("collectives", lambda c, r: c.all_reduce(torch.ones(8)) if r == 0 else c.all_gather(torch.ones(8)),
     "rank 0: allreduce of 8 x float32 sum (torch.distributed fallback), "
     "rank 1: allgather of 8 x float32 into 16 (torch.distributed fallback)"),
    ("dtypes", lambda c, r: c.all_reduce(torch.ones(8, dtype=torch.float32 if r == 0 else torch.bfloat16)),
     "rank 1: allreduce of 8 x bfloat16 sum"),
    ("reduce ops", lambda c, r: c.all_reduce(torch.ones(4), op="sum" if r == 0 else "max"),
     "rank 1: allreduce of 4 x float32 max"),
    ("roots", lambda c, r: c.broadcast(torch.ones(4), root=r), "rank 0: broadcast of 4 x float32 from rank 0"
     "|rank 0: broadcast of a tensor of shape (4,), torch.float32, on cpu from rank 0"),
    # calls each rank has made before (all_reduce of 8 runs after every case) are compared too
    ("a call made before against a new one", lambda c, r: c.all_reduce(torch.ones(8 if r == 0 else 32)),
     "rank 0: allreduce of 8 x float32 sum (torch.distributed fallback), rank 1: allreduce of 32 x float32 sum"),
    ("sizes again", lambda c, r: c.all_reduce(torch.ones(8 if r == 0 else 16)), "rank 1: allreduce of 16 x float32"),
]


class Comm:
    """The calls of :data:`CASES` on a Communicator."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def words(self, words: str) -> str:
        return words.partition("|")[0]

    def all_reduce(self, t: Any, op: str = "sum") -> None:
        self.comm.all_reduce(t, op=op)

    def all_gather(self, t: Any) -> None:
        self.comm.all_gather(t)

    def broadcast(self, t: Any, root: int) -> None:
        self.comm.broadcast(t, root=root)


class Backend:
    """The same calls through torch.distributed on the ``mscclang`` backend."""

    def words(self, words: str) -> str:
        comm, _, mine = words.partition("|")
        return mine or comm.replace("torch.distributed fallback", "torch.distributed backend")

    def all_reduce(self, t: Any, op: str = "sum") -> None:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])

    def all_gather(self, t: Any) -> None:
        dist.all_gather_into_tensor(torch.empty(2 * t.numel()), t)

    def broadcast(self, t: Any, root: int) -> None:
        dist.broadcast(t, src=root)


def _mismatches(rank: int, api: Any) -> list[str]:
    """Every case on this rank: what went wrong (empty: nothing)."""
    from mscclang.errors import CallMismatch

    wrong = []
    for name, call, words in CASES:
        try:
            call(api, rank)
            wrong.append(f"{name}: no CallMismatch")
        except CallMismatch as e:
            if api.words(words) not in str(e):
                wrong.append(f"{name}: {e} (wanted {api.words(words)!r})")
        t = torch.full((8,), float(rank + 1))   # the group still works
        api.all_reduce(t)
        if not torch.equal(t, torch.full((8,), 3.0)):
            wrong.append(f"{name}: the next all_reduce gave {t.tolist()}")
    return wrong


def through_from_torch(rank: int) -> dict:
    import mscclang

    comm = mscclang.Communicator.from_torch()   # a gloo default group: every call falls back
    return {"wrong": _mismatches(rank, Comm(comm))}


def through_the_backend(rank: int) -> dict:
    return {"wrong": _mismatches(rank, Backend())}


def _run(tmp_path: Any, target: str, backend: str) -> list:
    res = spawn_ranks(tmp_path, f"tests.test_comm_fallback_calls:{target}", backend=backend, timeout_s=4,
                      wait_s=120)
    assert all(r.ok for r in res), [r.error or f"died with exit code {r.exitcode}" for r in res]
    for r in res:
        assert r.value["wrong"] == [], r.value["wrong"]
    return [r.value for r in res]


def test_mismatched_calls_through_the_communicator_raise_call_mismatch_on_every_rank(tmp_path):
    _run(tmp_path, "through_from_torch", "gloo")


def test_mismatched_calls_through_the_backend_raise_call_mismatch_on_every_rank(tmp_path):
    _run(tmp_path, "through_the_backend", "mscclang")


def test_every_call_is_compared_and_the_store_only_asked_on_a_difference(monkeypatch):
    """Each gloo fallback call costs one all-gather of an 8-byte digest of its description on the
    fallback's group (whether a rank checks cannot depend on its own call, or ranks making
    different calls would not check alike); the descriptions go through the store only when the
    digests differ."""
    from mscclang.comm.fallback import FallbackCalls
    from mscclang.runtime.store_group import StoreGroup

    asked = []
    monkeypatch.setattr(StoreGroup, "exchange", lambda self, data, tag, timeout_s=None: asked.append(self.call))

    class Peer:   # the fallback's all_gather; the peer's digest is ours, or another's
        def __init__(self):
            self.gathers, self.other = 0, None

        def all_gather(self, inp, out):
            self.gathers += 1
            out.copy_(torch.cat([inp, inp if self.other is None else self.other]))

    fb, calls, x = Peer(), FallbackCalls(dist.HashStore(), 0, 2, 5.0), torch.ones(8)

    def check(coll, out, op="sum", root=0, accum=None):
        call = replace(make_call(coll, 0, 2, torch.device("cpu"), x, out, op, root=root), accum=accum)
        calls.check(fb, call, x, out)

    for _ in range(3):
        check("allreduce", x)
    check("broadcast", x, root=1)
    assert fb.gathers == 4 and asked == []
    fb.other = torch.tensor([12345], dtype=torch.int64)
    check("allgather", torch.ones(16))
    check("allreduce", x, "max", accum="float32")
    assert fb.gathers == 6 and asked == ["allgather of 8 x float32 into 16",
                                         "allreduce of 8 x float32 max accumulated in float32"]
