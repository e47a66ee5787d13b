"""Small port-channel programs for the runtime's tests (CPU packing tests and GPU runs).

* :func:`allgather_pwsf`: every rank puts its input into every peer's output with one
  ``put_with_signal_and_flush`` per peer, after a relaxed "ready" handshake on memory channels.
* :func:`allgather_put_flush_signal`: the same with a plain ``put``, a ``flush`` and a separate
  port ``signal`` (the three-step form).
* :func:`allgather_port_only`: no memory channels at all (ready handshake by port signals), so it
  runs between "nodes" through the engine.
* :func:`sendrecv_pipelined`: rank 0 streams its input to rank 1's output through rank 1's scratch
  in pipelined ``put_with_signal`` iterations, rank 1 acknowledging each (port ops inside a
  pipeline).
* :func:`sendrecv_memory_scratch`: the same transfer on a memory channel, in one put: like the
  pipelined one, its ranks need different scratch (rank 0 none), which the runtime's context
  growth must handle alike on both ranks.

Each is a correct program of its collective (verified in the simulator by the tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from mscclang import AllGather, Buffer, CollectiveProgram, LoopIterationContext, MemoryChannel, PortChannel, Rank, SyncType
from mscclang.dsl.collectives import TestCollective
from mscclang.plan.models import Plan


def _inp(r: int):
    return Rank(r).get_input_buffer()


def _out(r: int):
    return Rank(r).get_output_buffer()


def _port_pairs(n: int) -> dict:
    """A port channel from every rank r to every other rank q, keyed (r, q)."""
    return {(r, q): PortChannel(q, r) for r in range(n) for q in range(n) if q != r}


def _wait_every_peer(port: dict, n: int) -> None:
    """Every rank waits for every peer's last signal on its port channel (the data arrived)."""
    for r in range(n):
        for q in range(n):
            if q != r:
                port[(r, q)].wait(tb=0)


def _mem_ready(n: int) -> dict:
    """Memory channels between every pair and a relaxed "ready" signal on each: rank q tells rank
    r that its output may be written in this launch (rank r waits before its put)."""
    mem = {(r, q): MemoryChannel(q, r) for r in range(n) for q in range(n) if q != r}
    for q in range(n):
        for r in range(n):
            if q != r:
                mem[(q, r)].signal(tb=0, data_sync=SyncType.none, relaxed=True)
    return mem


def allgather_pwsf(n: int = 2, name: str = "test_port_allgather_pwsf", inplace: bool = False) -> Plan:
    """Allgather by port puts (pwsf), ready handshake on memory channels. ``inplace``: the input
    is the output's own block, so no SM copies anything (every byte moves by copy engine)."""
    name = name + ("_inplace" if inplace else "")
    with CollectiveProgram(name, AllGather(n, 1, inplace), n, protocol="Simple") as p:
        port = _port_pairs(n)
        mem = _mem_ready(n)
        for r in range(n):
            if not inplace:
                Rank(r).copy(_out(r)[r:r + 1], _inp(r)[0:1], tb=0)
            for q in range(n):
                if q != r:
                    mem[(r, q)].wait(tb=0, data_sync=SyncType.after, relaxed=True)
                    port[(r, q)].put_with_signal_and_flush(_out(q)[r:r + 1], _inp(r)[0:1], tb=0)
        _wait_every_peer(port, n)
    return p.to_plan()


def allgather_put_flush_signal(n: int = 2, name: str = "test_port_allgather_put") -> Plan:
    """Allgather by plain port puts, then flush, then a port signal."""
    with CollectiveProgram(name, AllGather(n, 1, False), n, protocol="Simple") as p:
        port = _port_pairs(n)
        mem = _mem_ready(n)
        for r in range(n):
            Rank(r).copy(_out(r)[r:r + 1], _inp(r)[0:1], tb=0)
            for q in range(n):
                if q != r:
                    mem[(r, q)].wait(tb=0, data_sync=SyncType.after, relaxed=True)
                    port[(r, q)].put(_out(q)[r:r + 1], _inp(r)[0:1], tb=0)
            for q in range(n):
                if q != r:
                    port[(r, q)].flush(tb=0)
                    port[(r, q)].signal(tb=0)
        _wait_every_peer(port, n)
    return p.to_plan()


def allgather_port_only(n: int = 2, name: str = "test_port_allgather_engine") -> Plan:
    """Allgather with port channels only (the ready handshake is a port signal), so every
    channel can cross nodes."""
    with CollectiveProgram(name, AllGather(n, 1, False), n, protocol="Simple") as p:
        port = _port_pairs(n)
        for q in range(n):
            for r in range(n):
                if q != r:
                    port[(q, r)].signal(tb=0, data_sync=SyncType.none)
        for r in range(n):
            Rank(r).copy(_out(r)[r:r + 1], _inp(r)[0:1], tb=0)
            for q in range(n):
                if q != r:
                    port[(r, q)].wait(tb=0, data_sync=SyncType.after)
                    port[(r, q)].put_with_signal_and_flush(_out(q)[r:r + 1], _inp(r)[0:1], tb=0)
        _wait_every_peer(port, n)
    return p.to_plan()


def sendrecv_pipelined(unit: int = 1 << 16, name: str = "test_port_pipeline") -> Plan:
    """Rank 0 streams its input through rank 1's scratch into rank 1's output: per pipeline
    iteration one put_with_signal, rank 1 copying the slice out and acknowledging it (port ops
    inside a pipeline: trigger and slot numbers advance per iteration)."""
    with CollectiveProgram(name, TestCollective(2, 2, 2), 2, protocol="Simple") as p:
        a, b = PortChannel(1, 0), PortChannel(0, 1)
        s1 = Buffer(1, 2)
        b.signal(tb=0, data_sync=SyncType.none)
        a.wait(tb=0, data_sync=SyncType.after)
        with LoopIterationContext(unit=unit, num_chunks=2):
            a.put_with_signal(s1[0:2], _inp(0)[0:2], tb=0)
            b.wait(tb=0)
            Rank(1).copy(_out(1)[0:2], s1[0:2], tb=0)
            b.signal(tb=0)
            a.wait(tb=0)
        a.flush(tb=0)
        Rank(0).copy(_out(0)[0:2], _inp(0)[0:2], tb=0)
    return p.to_plan()


def pingpong(port: bool = True, name: str = "") -> Plan:
    """A two-rank allgather of three one-way hops: rank 1 says ready; rank 0 puts its chunk into
    rank 1 and signals; rank 1 waits, puts its chunk back and signals; rank 0 waits. ``port``:
    port channels only (signal, pwsf), else memory channels only (relaxed signal, put, signal):
    the two to compare (a launch's time over three is the one-way hop)."""
    name = name or ("test_pingpong_port" if port else "test_pingpong_memory")
    with CollectiveProgram(name, AllGather(2, 1, False), 2, protocol="Simple") as p:
        a = PortChannel(1, 0) if port else MemoryChannel(1, 0)
        b = PortChannel(0, 1) if port else MemoryChannel(0, 1)
        if port:
            b.signal(tb=0, data_sync=SyncType.none)
            a.wait(tb=0, data_sync=SyncType.after)
        else:
            b.signal(tb=0, data_sync=SyncType.none, relaxed=True)
            a.wait(tb=0, data_sync=SyncType.after, relaxed=True)
        if port:
            a.put_with_signal_and_flush(_out(1)[0:1], _inp(0)[0:1], tb=0)
        else:
            a.put(_out(1)[0:1], _inp(0)[0:1], tb=0)
            a.signal(tb=0)
        b.wait(tb=0)
        if port:
            b.put_with_signal_and_flush(_out(0)[1:2], _inp(1)[0:1], tb=0)
        else:
            b.put(_out(0)[1:2], _inp(1)[0:1], tb=0)
            b.signal(tb=0)
        a.wait(tb=0)
        Rank(0).copy(_out(0)[0:1], _inp(0)[0:1], tb=0)
        Rank(1).copy(_out(1)[1:2], _inp(1)[0:1], tb=0)
    return p.to_plan()


def allreduce_port_2(name: str = "test_port_allreduce_2") -> Plan:
    """Two-rank allreduce by port channels only (so it runs between two one-GPU nodes): ready
    handshake, each rank puts the peer's half of its input into the peer's scratch (pwsf), reduces
    its own half on its SMs, puts the reduced half into the peer's output (pwsf), waits."""
    from mscclang import AllReduce

    with CollectiveProgram(name, AllReduce(2, 1, False), 2, protocol="Simple") as p:
        port = {(r, q): PortChannel(q, r) for r in range(2) for q in range(2) if q != r}
        scr = {r: Buffer(r, 1) for r in range(2)}
        for r in range(2):
            q = 1 - r
            port[(q, r)].signal(tb=0, data_sync=SyncType.none)
        for r in range(2):
            q = 1 - r
            port[(r, q)].wait(tb=0, data_sync=SyncType.after)
            port[(r, q)].put_with_signal_and_flush(scr[q][0:1], _inp(r)[q:q + 1], tb=0)
        for r in range(2):
            q = 1 - r
            port[(r, q)].wait(tb=0)
            Rank(r).reduce(_inp(r)[r:r + 1], [scr[r][0:1]], tb=0, dst_chunk=_out(r)[r:r + 1])
            port[(r, q)].put_with_signal_and_flush(_out(q)[r:r + 1], _out(r)[r:r + 1], tb=0)
        for r in range(2):
            q = 1 - r
            port[(r, q)].wait(tb=0)
    return p.to_plan()


SAMPLES = {
    "allgather_pwsf": allgather_pwsf,
    "allgather_put_flush_signal": allgather_put_flush_signal,
    "allgather_port_only": allgather_port_only,
    "sendrecv_pipelined": lambda n=2: sendrecv_pipelined(),
}


def shipped_port_plans(files: Optional[Sequence[Path]] = None, counted: bool = False) -> list[tuple[str, Plan, int]]:
    """(file stem, plan, GPUs per node) of every plan of ``files`` (default: the checkout's
    shipped plans, :func:`tests.harness.shipped.shipped_plan_files`) that uses port channels; GPUs
    per node from the stem's ``gpus_per_node<N>`` part (default: all ranks on one node). Plans with
    segments (sized by a call's counts, not a message size) only with ``counted``, and then only
    they."""
    from mscclang.plan.io import load_plan
    from tests.harness.shipped import shipped_plan_files

    out = []
    for f in (shipped_plan_files() if files is None else files):
        text = f.read_text()
        if '"port"' not in text:
            continue
        plan = load_plan(text)
        if plan.has_segments() != counted:
            continue
        gpn = plan.world_size
        for part in f.stem.split("."):
            if part.startswith("gpus_per_node"):
                gpn = int(part[len("gpus_per_node"):])
        out.append((f.stem, plan, gpn))
    return out


def sendrecv_memory_scratch(name: str = "test_memory_sendrecv_scratch") -> Plan:
    """Rank 0 puts its input into rank 1's scratch on a memory channel after rank 1 says its
    scratch is free; rank 1 copies it into its output; rank 0 copies its input into its own
    output. Only rank 1 has scratch."""
    with CollectiveProgram(name, TestCollective(2, 2, 2), 2, protocol="Simple") as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        s1 = Buffer(1, 2)
        b.signal(tb=0, data_sync=SyncType.none, relaxed=True)
        a.wait(tb=0, data_sync=SyncType.after, relaxed=True)
        a.put(s1[0:2], _inp(0)[0:2], tb=0)
        a.signal(tb=0)
        b.wait(tb=0)
        Rank(1).copy(_out(1)[0:2], s1[0:2], tb=0)
        Rank(0).copy(_out(0)[0:2], _inp(0)[0:2], tb=0)
    return p.to_plan()
