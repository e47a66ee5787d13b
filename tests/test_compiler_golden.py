"""Golden plans: one small program per op name of the plan format (31, ``glre`` included).

Each program's plan is compared byte for byte with ``tests/golden/op_<name>.json``. Regenerate
with ``MSCCLANG_REGEN_GOLDEN=1 python -m pytest tests/test_compiler_golden.py`` and review the diff.
Every plan must also pass :func:`mscclang.plan.check.validate_plan`, contain the op it is named for,
verify in the simulator (each program is a correct program of its collective: ready handshakes
before touching peers, writes published, port sources flushed) and (where MSCCL++ can express it)
survive ``from_mscclpp(to_mscclpp(plan))``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest

from mscclang import (
    AllGather,
    AllReduce,
    Buffer,
    BufferType,
    CollectiveProgram,
    LoopIterationContext,
    MemoryChannel,
    PortChannel,
    Rank,
    Semaphore,
    SwitchChannel,
    SyncType,
    TestCollective,
)
from mscclang.plan import load_plan
from mscclang.plan.check import validate_plan
from mscclang.plan.models import OpName, Plan

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("MSCCLANG_REGEN_GOLDEN") == "1"


def inp(r):
    return Rank(r).get_input_buffer()


def out(r):
    return Rank(r).get_output_buffer()


def P(name, **kw):
    return CollectiveProgram(f"op_{name}", TestCollective(2, 2, 2), 2, **kw)


def ready(a, b, tb=0):
    """Rank b tells rank a (relaxed) that its buffers may be written in this launch."""
    b.signal(tb, data_sync=SyncType.none, relaxed=True)
    a.wait(tb, data_sync=SyncType.after, relaxed=True)


def _nop():
    with P("nop") as p:
        Rank(0).copy(out(0)[0:1], inp(0)[0:1], tb=0)
        Rank(0).barrier([0])
        Rank(0).copy(out(0)[1:2], inp(0)[1:2], tb=0)
    return p


def _barrier():
    with P("barrier") as p:
        Rank(0).copy(out(0)[0:1], inp(0)[0:1], tb=0)
        Rank(0).barrier([0, 1])
        Rank(0).copy(out(0)[1:2], out(0)[0:1], tb=1)
    return p


def _signal_wait(relaxed):
    with P("rlx" if relaxed else "sw") as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        if relaxed:
            ready(a, b)  # relaxed ops only order execution: the "ready to be written" handshake
        else:
            b.signal(0)
            a.wait(0)
        a.put(out(1)[0:1], inp(0)[0:1], tb=0)
        a.signal(0)  # publishing data needs the release/acquire pair
        b.wait(0)
    return p


def _port(method):
    """A port put into the peer's output after the ready handshake, its data published by the
    port signal. ``put``: flush, then a separate signal. ``put_with_signal``: the flush comes
    after it (the proxy may read the source after the block, even the kernel, ended: without
    the flush the next launch's input write races with that read; the flush orders the proxy's
    read and write before the rest of the block, so before the launch ends). ``pwsf`` flushes
    by itself."""
    def build():
        with P(method) as p:
            ready(MemoryChannel(1, 0), MemoryChannel(0, 1))
            a, b = PortChannel(1, 0), PortChannel(0, 1)
            getattr(a, method)(out(1)[0:1], inp(0)[0:1], 0)
            if method == "put":
                a.flush(0)
                a.signal(0)
            elif method == "put_with_signal":
                a.flush(0, data_sync=SyncType.none)  # the whole block waits: no nop needed
            b.wait(0)
        return p
    return build


def _put():
    with P("put") as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        ready(a, b)
        a.put(out(1)[0:2], inp(0)[0:2], tb=0)
        a.signal(0)
        b.wait(0)
    return p


def _get():
    with P("get") as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        b.signal(0)
        a.wait(0)
        a.get(out(0)[0:2], inp(1)[0:2], tb=0)
        a.signal(0)  # done reading: rank 1 may overwrite its input
        b.wait(0)
    return p


def _copy():
    with P("copy") as p:
        Rank(1).copy(out(1)[0:2], inp(1)[0:2], tb=0)
    return p


def _cpkt_upkt():
    with P("cpkt") as p:
        s = Buffer(0, 2)
        Rank(0).copy_packets(s[0:2], inp(0)[0:2], tb=0)
        Rank(0).unpack_packets(out(0)[0:2], s[0:2], tb=1)
    return p


def _ppkt():
    with P("ppkt", protocol="LL", use_double_scratch_buffer=True) as p:
        Buffer(0, 2)
        s1 = Buffer(1, 2)
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        # back-pressure: without it rank 0 may run two launches ahead and overwrite the scratch
        # half rank 1 has not read yet (nothing else leads from rank 1 back to rank 0)
        ready(a, b)
        a.put_packets(s1[0:2], inp(0)[0:2], tb=0)
        Rank(1).unpack_packets(out(1)[0:2], s1[0:2], tb=0)
    return p


def _rppkt():
    with P("rppkt", protocol="LL", use_double_scratch_buffer=True) as p:
        s0, s1 = Buffer(0, 2), Buffer(1, 2)
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        a.put_packets(s1[0:1], inp(0)[0:1], tb=0)
        b.read_put_packets(s0[1:2], s1[0:1], tb=0)
        Rank(0).unpack_packets(out(0)[0:1], s0[1:2], tb=1)
    return p


def _re():
    with P("re") as p:
        Rank(0).reduce(inp(0)[0:1], [inp(0)[1:2]], tb=0, dst_chunk=out(0)[0:1])
    return p


def _res():
    with P("res") as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        ready(a, b)
        Rank(0).reduce(inp(0)[0:1], [inp(0)[1:2]], tb=0, dst_chunk=out(0)[0:1])
        a.put(out(1)[0:1], out(0)[0:1], tb=0)
        a.signal(0)
        b.wait(0)
    return p


def _rre(send):
    def build():
        with P("rres" if send else "rre") as p:
            a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
            b.signal(0)
            a.wait(0)
            a.reduce(inp(0)[0:1], [inp(1)[0:1]], tb=0, local_dst_chunk=out(0)[0:1])
            if send:
                a.put(out(1)[0:1], out(0)[0:1], tb=0)
            a.signal(0)
            b.wait(0)
        return p
    return build


def _packet_reduce(kind):
    def build():
        with P(kind, protocol="LL", use_double_scratch_buffer=True) as p:
            s0, s1 = Buffer(0, 4), Buffer(1, 4)
            a = MemoryChannel(1, 0)
            b = MemoryChannel(0, 1)
            if kind not in ("respkt", "recspkt"):
                # back-pressure (with respkt/recspkt, rank 0's packets back to rank 1 give it)
                ready(b, a)
            b.put_packets(s0[0:1], inp(1)[0:1], tb=0)
            Rank(0).reduce(inp(0)[0:1], [s0[0:1]], tb=0, dst_chunk=out(0)[0:1], packet=True)
            if kind in ("recpkt", "recspkt"):
                Rank(0).copy_packets(s0[2:3], out(0)[0:1], tb=0)
            if kind in ("respkt", "recspkt"):
                a.put_packets(s1[1:2], out(0)[0:1], tb=0)
                Rank(1).unpack_packets(out(1)[0:1], s1[1:2], tb=0)
        return p
    return build


def _both_ways(a, b, relaxed, ready_only=False, tb=0):
    """Each rank signals the other, then waits for the other's signal (no rank waits first).

    ``ready_only``: the signal needs no block sync before it (it announces that the launch
    started, it publishes nothing), the wait one after it."""
    sig = SyncType.none if ready_only else SyncType.both
    a.signal(tb, data_sync=sig, relaxed=relaxed)
    b.signal(tb, data_sync=sig, relaxed=relaxed)
    a.wait(tb, data_sync=SyncType.after if ready_only else SyncType.both, relaxed=relaxed)
    b.wait(tb, data_sync=SyncType.after if ready_only else SyncType.both, relaxed=relaxed)


def _switch(kind):
    """One switch op in a correct program of its collective, with the ready handshake before
    any rank touches a peer's buffer through the multicast range and, after it, the writes
    published (or, for ``glre``, which only reads peers, a relaxed "done reading" signal).

    * ``glre``: out-of-place allreduce, each rank reduces the whole multicast input into its
      own output (``glre`` alone: the destination is not in the multicast range).
    * ``glres``: in-place allreduce, rank r reduces chunk r over the group and stores it back
      into every member's chunk r (``glre`` + ``gstore`` fused).
    * ``gstore``: allgather, rank r stores its input into every member's output chunk r.
    * ``gstorepkt``: LL allgather, rank r packs its input into local scratch and re-emits the
      packets into every member's scratch slot 2 + r, then unpacks both slots. Packets carry
      their own flags and the scratch is double buffered, so no handshake is needed.
    """
    def build():
        if kind == "glre":
            coll, kw = AllReduce(2, 1, False), {}
        elif kind == "glres":
            coll, kw = AllReduce(2, 1, True), {}
        elif kind == "gstore":
            coll, kw = AllGather(2, 1, False), {}
        else:
            coll, kw = AllGather(2, 1, False), {"protocol": "LL", "use_double_scratch_buffer": True}
        with CollectiveProgram(f"op_{kind}", coll, 2, **kw) as p:
            if kind == "gstorepkt":
                scratch = [Buffer(r, 4) for r in range(2)]
                sw = SwitchChannel([0, 1], BufferType.scratch)
                for r in range(2):
                    Rank(r).copy_packets(scratch[r][r:r + 1], inp(r)[0:1], tb=0)
                    sw.at_rank(r).broadcast_packets(scratch[r][r:r + 1], 2 + r, 1, tb=0)
                for r in range(2):
                    Rank(r).unpack_packets(out(r)[0:2], scratch[r][2:4], tb=0)
                return p
            sw = SwitchChannel([0, 1], BufferType.output if kind == "gstore" else BufferType.input)
            a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
            # ready: each rank's launch started, so peers may touch its buffers
            _both_ways(a, b, relaxed=True, ready_only=True)
            for r in range(2):
                v = sw.at_rank(r)
                if kind == "glre":
                    v.reduce(0, 2, out(r)[0:2], tb=0)
                elif kind == "glres":
                    v.reduce(r, 1, inp(r)[r:r + 1], tb=0)
                    v.broadcast(inp(r)[r:r + 1], r, 1, tb=0)
                else:
                    v.broadcast(inp(r)[0:1], r, 1, tb=0)
            if kind == "glre":
                # only peers' inputs were read: a relaxed "done reading" (after a block sync, so
                # it covers every thread's reads) lets each rank's launch end, and the next
                # launch rewrite its input, only after the peer's reads
                _both_ways(a, b, relaxed=True)
            else:
                _both_ways(a, b, relaxed=False)  # publish the multicast writes
        return p
    return build


def _sem():
    with P("sem") as p:
        s = Semaphore(0, 0)
        Rank(0).copy(out(0)[0:1], inp(0)[0:1], tb=0)
        s.release(0)
        s.acquire(1)
        Rank(0).copy(out(0)[1:2], out(0)[0:1], tb=1)
    return p


def _pipeline():
    with P("pipeline") as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        s1 = Buffer(1, 2)
        Buffer(0, 2)
        ready(a, b)
        with LoopIterationContext(unit=1 << 16, num_chunks=2):
            a.put(s1[0:2], inp(0)[0:2], tb=0)
            a.signal(0)
            b.wait(0)
            Rank(1).copy(out(1)[0:2], s1[0:2], tb=0)
            b.signal(0)  # slot consumed: rank 0 may overwrite it in the next iteration
            a.wait(0)
    return p


def _epilogue():
    """plan/2: a two-rank one-shot allreduce whose sums go into the residual (radd), then the
    FP8 norm of all rows (rmsnorm) after a barrier."""
    from mscclang import AllReduceAddRMSNorm

    with CollectiveProgram("op_epilogue", AllReduceAddRMSNorm(2, 1, False), 2, protocol="LL",
                           use_double_scratch_buffer=True) as p:
        pk = [Buffer(r, 2) for r in range(2)]
        for r in range(2):
            Buffer(r, 2)
        sums = [Buffer(r, 2) for r in range(2)]
        for r in range(2):
            res = Rank(r).get_residual_buffer()
            for c in range(2):
                MemoryChannel(1 - r, r).put_packets(pk[1 - r][c], inp(r)[c], tb=c)
                Rank(r).reduce(inp(r)[c], [pk[r][c]], tb=c, dst_chunk=sums[r][c], packet=True)
                Rank(r).add_residual(res[c], sums[r][c], tb=c)
            Rank(r).barrier([0, 1])
            Rank(r).rms_norm(out(r)[0:2], res[0:2], tb=0, quantize=True)
    return p


BUILDERS: dict[str, Callable[[], CollectiveProgram]] = {
    "nop": _nop, "barrier": _barrier, "signal": lambda: _signal_wait(False),
    "wait": lambda: _signal_wait(False), "rlxsignal": lambda: _signal_wait(True),
    "rlxwait": lambda: _signal_wait(True), "flush": _port("put"), "put": _put,
    "pws": _port("put_with_signal"), "pwsf": _port("put_with_signal_and_flush"), "get": _get,
    "copy": _copy, "cpkt": _cpkt_upkt, "upkt": _cpkt_upkt, "ppkt": _ppkt, "rppkt": _rppkt,
    "re": _re, "res": _res, "rre": _rre(False), "rres": _rre(True), "repkt": _packet_reduce("repkt"),
    "respkt": _packet_reduce("respkt"), "recpkt": _packet_reduce("recpkt"),
    "recspkt": _packet_reduce("recspkt"), "glre": _switch("glre"), "glres": _switch("glres"),
    "gstore": _switch("gstore"), "gstorepkt": _switch("gstorepkt"), "sem_acquire": _sem,
    "sem_release": _sem, "pipeline": _pipeline, "radd": _epilogue, "rmsnorm": _epilogue,
}


def _op_names(plan: Plan) -> set[str]:
    out_: set[str] = set()
    for g in plan.gpus:
        for tb in g.threadblocks:
            for op in tb.ops:
                out_.add(op.name.value)
                for inner in op.ops or []:
                    out_.add(inner.name.value)
    return out_


def test_every_op_name_has_a_program():
    assert set(BUILDERS) == {o.value for o in OpName}
    assert len(BUILDERS) == 33


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_golden_plan(name):
    prog = BUILDERS[name]()
    text = prog.to_json()
    plan = load_plan(text)
    validate_plan(plan)
    assert name in _op_names(plan)
    if name == "glre":  # the lone multicast load-reduce, not fused into glres
        assert "glres" not in _op_names(plan)
    path = GOLDEN / f"op_{name}.json"
    if REGEN or not path.exists():
        if not REGEN:
            pytest.fail(f"missing golden file {path}; run with MSCCLANG_REGEN_GOLDEN=1")
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; regenerate with MSCCLANG_REGEN_GOLDEN=1 if intended"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_deterministic(name):
    assert BUILDERS[name]().to_json() == BUILDERS[name]().to_json()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_mscclpp_round_trip(name):
    from mscclang.errors import PlanError
    from mscclang.plan.mscclpp import from_mscclpp, to_mscclpp

    plan = BUILDERS[name]().to_plan()
    try:
        doc = to_mscclpp(plan)
    except PlanError as e:
        assert name in ("glre", "radd", "rmsnorm"), f"to_mscclpp refused {name}: {e}"
        assert ("glre" if name == "glre" else "no epilogue ops") in str(e)
        return
    back = from_mscclpp(doc)
    a = plan.model_dump(mode="json", exclude_none=True)
    b = back.model_dump(mode="json", exclude_none=True)
    # MSCCL++ keeps the reduce op in the ops only and has no chunk_factor (it is implied by the
    # chunk counts, which the round trip keeps); ops' source lines are ours (debug info, dropped)
    for key in ("reduce_op", "chunk_factor"):
        a.pop(key, None)
        b.pop(key, None)
    assert "\"src\":" not in json.dumps(doc)
    assert a != b  # the source lines are the only difference
    assert _without_src(a) == b


def _without_src(doc):
    """``doc`` with every op's ``src`` removed."""
    if isinstance(doc, dict):
        return {k: _without_src(v) for k, v in doc.items() if k != "src"}
    if isinstance(doc, list):
        return [_without_src(x) for x in doc]
    return doc


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_op_program_verifies_in_simulator(name):
    """Every op's program is a correct program of its collective (no race, deadlock, or wrong
    output under several schedules and the default launches: three for double scratch)."""
    sim = pytest.importorskip("mscclang.sim")
    plan = BUILDERS[name]().to_plan()
    report = sim.verify(plan, schedules=4)
    assert report.passed(), str(report)
    if plan.collective == "test":  # op-emission tests: no postcondition, never "OK"
        assert report.status == "NO POSTCONDITION", str(report)
