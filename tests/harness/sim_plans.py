"""Hand-built plans for the simulator tests (correct ones, and a few with one thing damaged),
shared by the test modules that verify, run or diagnose them."""

from __future__ import annotations

from mscclang.plan.models import Plan
from mscclang.sim.planbuilder import L, PlanBuilder, R, S


def ll_allreduce(double: bool = True, n_tbs: int = 2) -> Plan:
    """2-rank in-place LL allreduce (MSCCL++'s allreduce_packet shape, mscclpp-notes 2.5)."""
    b = PlanBuilder("ll_allreduce", "allreduce", 2, 4, 4, 4, protocol="LL", inplace=True,
                    use_double_scratch_buffer=double)
    for r in range(2):
        p = 1 - r
        mine = 0 if r == 0 else 2
        theirs = 2 if r == 0 else 0
        b.op(r, 0, "ppkt", src=[L("i", theirs, 2)], dst=[R(p, "s", 0, 2)])
        b.op(r, 0, "respkt", src=[L("i", mine, 1), L("s", 0, 1)],
             dst=[L("o", mine, 1), R(p, "s", 2, 1)], reduce_op="sum")
        b.op(r, 1, "respkt", src=[L("i", mine + 1, 1), L("s", 1, 1)],
             dst=[L("o", mine + 1, 1), R(p, "s", 3, 1)], reduce_op="sum")
        b.op(r, 1, "upkt", src=[L("s", 2, 2)], dst=[L("o", theirs, 2)])
    return b.build()


def ll_oneshot_allreduce(double: bool = True) -> Plan:
    """2-rank out-of-place one-shot LL allreduce: each rank packs its whole input into the peer's
    scratch, then reduces every chunk from its input and the peer's packets. Without double
    scratch this is a hazard: a rank's next launch may overwrite packets its peer has not read,
    since nothing the peer does after reading reaches the writer."""
    b = PlanBuilder("ll_oneshot_allreduce", "allreduce", 2, 2, 2, 2, protocol="LL",
                    use_double_scratch_buffer=double)
    for r in range(2):
        p = 1 - r
        b.op(r, 0, "ppkt", src=[L("i", 0, 2)], dst=[R(p, "s", 0, 2)])
        for c in range(2):
            b.op(r, c, "repkt", src=[L("i", c, 1), L("s", c, 1)], dst=[L("o", c, 1)], reduce_op="sum")
    return b.build()


def simple_allgather(n: int = 3, final_wait: bool = True, relaxed_publish: bool = False,
                     nop_before_signal: bool = True, wrong_chunk: bool = False,
                     handshake: bool = True) -> Plan:
    """n-rank out-of-place allgather: ready handshake, put into every peer's output, signal."""
    b = PlanBuilder("simple_allgather", "allgather", n, 1, n)
    for r in range(n):
        b.op(r, 0, "copy", src=[L("i", 0, 1)], dst=[L("o", r, 1)])
        for k, p in enumerate(q for q in range(n) if q != r):
            tb = k + 1
            if handshake:
                b.nop(r, tb)
                b.op(r, tb, "rlxsignal", channels=[p])
                b.op(r, tb, "rlxwait", channels=[p])
                b.nop(r, tb)
            dst_chunk = (r + 1) % n if (wrong_chunk and r == 0 and p == 1) else r
            b.op(r, tb, "put", src=[L("i", 0, 1)], dst=[R(p, "o", dst_chunk, 1)])
            if nop_before_signal:
                b.nop(r, tb)
            b.op(r, tb, "rlxsignal" if relaxed_publish else "signal", channels=[p])
            if final_wait:
                b.op(r, tb, "rlxwait" if relaxed_publish else "wait", channels=[p])
            b.nop(r, tb)
    return b.build()


def zero_copy_allreduce(handshake: bool = True, double_src: bool = False) -> Plan:
    """2-rank allreduce reading the peer's input directly (rres) and writing its output."""
    b = PlanBuilder("zc_allreduce", "allreduce", 2, 2, 2)
    for r in range(2):
        p = 1 - r
        if handshake:
            b.nop(r, 0)
            b.op(r, 0, "rlxsignal", channels=[p])
            b.op(r, 0, "rlxwait", channels=[p])
            b.nop(r, 0)
        srcs = [L("i", r, 1), R(p, "i", r, 1)] + ([R(p, "i", r, 1)] if double_src and r == 0 else [])
        b.op(r, 0, "rres", src=srcs, dst=[L("o", r, 1), R(p, "o", r, 1)], reduce_op="sum")
        b.nop(r, 0)
        b.op(r, 0, "signal", channels=[p])
        b.op(r, 0, "wait", channels=[p])
        b.nop(r, 0)
    return b.build()


def get_allreduce() -> Plan:
    """2-rank allreduce with get into scratch, a local reduce, and a put of the result."""
    b = PlanBuilder("get_allreduce", "allreduce", 2, 2, 2, 1)
    for r in range(2):
        p = 1 - r
        b.nop(r, 0)
        b.op(r, 0, "rlxsignal", channels=[p])
        b.op(r, 0, "rlxwait", channels=[p])
        b.nop(r, 0)
        b.op(r, 0, "get", src=[R(p, "i", r, 1)], dst=[L("s", 0, 1)])
        b.nop(r, 0)
        b.op(r, 0, "re", src=[L("i", r, 1), L("s", 0, 1)], dst=[L("o", r, 1)], reduce_op="sum")
        b.nop(r, 0)
        b.op(r, 0, "put", src=[L("o", r, 1)], dst=[R(p, "o", r, 1)])
        b.nop(r, 0)
        b.op(r, 0, "signal", channels=[p])
        b.op(r, 0, "wait", channels=[p])
        b.nop(r, 0)
    return b.build()


def sem_barrier_allgather(bad_barrier: bool = False, extra_release: bool = False,
                          double_acquire: bool = False) -> Plan:
    """2-rank allgather: tb0 stages the input in scratch and releases a semaphore; tb1 acquires
    it and sends; tb2 copies the local part; tbs 0..2 meet at a barrier at the end."""
    b = PlanBuilder("sem_barrier_allgather", "allgather", 2, 1, 2, 1)
    for r in range(2):
        p = 1 - r
        sem = b.semaphore(r, 0)
        b.op(r, 0, "copy", src=[L("i", 0, 1)], dst=[L("s", 0, 1)])
        b.nop(r, 0)
        b.op(r, 0, "sem_release", semaphore_ids=[sem])
        if extra_release:
            b.op(r, 0, "sem_release", semaphore_ids=[sem])
        b.op(r, 1, "sem_acquire", semaphore_ids=[sem])
        if double_acquire:
            b.op(r, 1, "sem_acquire", semaphore_ids=[sem])
        b.nop(r, 1)
        b.op(r, 1, "rlxsignal", channels=[p])
        b.op(r, 1, "rlxwait", channels=[p])
        b.nop(r, 1)
        b.op(r, 1, "put", src=[L("s", 0, 1)], dst=[R(p, "o", r, 1)])
        b.nop(r, 1)
        b.op(r, 1, "signal", channels=[p])
        b.op(r, 1, "wait", channels=[p])
        b.nop(r, 1)
        b.op(r, 2, "copy", src=[L("i", 0, 1)], dst=[L("o", r, 1)])
        members = [0, 1, 2] if not bad_barrier else [0, 1, 2, 3]
        if bad_barrier:
            # tb 3 meets the others once, at the start; their second barrier waits for it forever
            for tb in (0, 1, 2, 3):
                b._tb(r, tb)["ops"].insert(0, b.mkop(r, tb, "barrier", barrier_id=0, num_threadblocks=4,
                                                     barrier_tbs=members))
        for tb in (0, 1, 2):
            b.op(r, tb, "barrier", barrier_id=0, num_threadblocks=len(members), barrier_tbs=members)
    return b.build()


def pipelined_allgather(unit: int = 64, tbg: bool = True) -> Plan:
    """2-rank allgather: the input goes through the peer's scratch in a pipeline (put slice,
    signal; the peer waits and copies the slice out); the local copy is split over a
    thread-block group of two blocks."""
    b = PlanBuilder("pipelined_allgather", "allgather", 2, 2, 4, 2)
    for r in range(2):
        p = 1 - r
        b.nop(r, 0)
        b.op(r, 0, "rlxsignal", channels=[(p, 2)])
        b.op(r, 0, "rlxwait", channels=[(p, 2)])
        b.nop(r, 0)
        send = [b.mkop(r, 0, "put", src=[L("i", 0, 2)], dst=[R(p, "s", 0, 2)]),
                b.mkop(r, 0, "nop"),
                b.mkop(r, 0, "signal", channels=[p])]
        b.pipeline(r, 0, unit, 2, send)
        b.op(r, 0, "wait", channels=[(p, 1)])
        b.nop(r, 0)
        recv = [b.mkop(r, 1, "wait", channels=[p]),
                b.mkop(r, 1, "nop"),
                b.mkop(r, 1, "copy", src=[L("s", 0, 2)], dst=[L("o", 2 * p, 2)]),
                b.mkop(r, 1, "nop")]
        b.pipeline(r, 1, unit, 2, recv)
        b.op(r, 1, "signal", channels=[(p, 1)])
        if tbg:
            for m, tb in enumerate((2, 3)):
                b.op(r, tb, "copy", src=[L("i", 0, 2)], dst=[L("o", 2 * r, 2)],
                     tbg_info={"tb_id": m, "tbg_size": 2})
        else:
            b.op(r, 2, "copy", src=[L("i", 0, 2)], dst=[L("o", 2 * r, 2)])
    return b.build()


def port_allgather(flush: bool = True) -> Plan:
    """2-rank allgather through port channels: handshake, put-with-signal, wait, flush."""
    b = PlanBuilder("port_allgather", "allgather", 2, 1, 2)
    for r in range(2):
        p = 1 - r
        b.op(r, 0, "copy", src=[L("i", 0, 1)], dst=[L("o", r, 1)])
        b.nop(r, 0)
        b.op(r, 0, "signal", channels=[p], ctype="port")
        b.op(r, 0, "wait", channels=[p], ctype="port")
        b.nop(r, 0)
        b.op(r, 0, "pws", src=[L("i", 0, 1)], dst=[R(p, "o", r, 1)], channels=[p], ctype="port")
        b.op(r, 0, "wait", channels=[p], ctype="port")
        if flush:
            b.op(r, 0, "flush", channels=[p], ctype="port")
        b.nop(r, 0)
    return b.build()


def rppkt_allgather() -> Plan:
    """3-rank LL allgather relayed around a ring with copy/read-put/unpack packet ops."""
    n = 3
    b = PlanBuilder("rppkt_allgather", "allgather", n, 1, n, 2 * n, protocol="LL",
                    use_double_scratch_buffer=True)
    for r in range(n):
        nxt = (r + 1) % n
        b.op(r, 0, "copy", src=[L("i", 0, 1)], dst=[L("o", r, 1)])
        # own chunk as packets into the next rank's slot r
        b.op(r, 0, "ppkt", src=[L("i", 0, 1)], dst=[R(nxt, "s", r, 1)])
        # forward the previous rank's chunk (arrived in my slot prev) to the next rank
        prev = (r - 1) % n
        b.op(r, 1, "rppkt", src=[L("s", prev, 1)], dst=[R(nxt, "s", n + prev, 1)])
        b.op(r, 1, "upkt", src=[L("s", prev, 1)], dst=[L("o", prev, 1)])
        pp = (r - 2) % n
        b.op(r, 2, "upkt", src=[L("s", n + pp, 1)], dst=[L("o", pp, 1)])
    return b.build()


def switch_allreduce(final: str = "strong") -> Plan:
    """2-rank in-place switch allreduce (glres over the outputs); ``final`` is how the ranks
    publish the multimem stores at the end: ``strong`` signal/wait, ``relaxed`` rlxsignal/rlxwait,
    or ``none`` (no final synchronisation at all)."""
    name = "switch_allreduce" if final == "strong" else f"switch_allreduce_{final}"
    b = PlanBuilder(name, "allreduce", 2, 2, 2, inplace=True)
    for r in range(2):
        p = 1 - r
        sw = b.switch(r, "o", [0, 1])
        b.nop(r, 0)
        b.op(r, 0, "rlxsignal", channels=[p])
        b.op(r, 0, "rlxwait", channels=[p])
        b.nop(r, 0)
        b.op(r, 0, "glres", src=[S(sw, r, 1)], dst=[S(sw, r, 1)], reduce_op="sum")
        b.nop(r, 0)
        if final != "none":
            b.op(r, 0, "rlxsignal" if final == "relaxed" else "signal", channels=[p])
            b.op(r, 0, "rlxwait" if final == "relaxed" else "wait", channels=[p])
            b.nop(r, 0)
    return b.build()


def wait_cycle(broken: bool = True):
    """2-rank allgather where each rank waits for the other before signalling (broken) or
    signals first (correct)."""
    b = PlanBuilder("wait_cycle", "allgather", 2, 1, 2)
    for r in range(2):
        p = 1 - r
        b.op(r, 0, "copy", src=[L("i", 0, 1)], dst=[L("o", r, 1)])
        b.nop(r, 0)
        if broken:
            b.op(r, 0, "wait", channels=[p])
            b.op(r, 0, "signal", channels=[p])
        else:
            b.op(r, 0, "rlxsignal", channels=[p])
            b.op(r, 0, "rlxwait", channels=[p])
        b.nop(r, 0)
        b.op(r, 0, "put", src=[L("i", 0, 1)], dst=[R(p, "o", r, 1)])
        b.nop(r, 0)
        b.op(r, 0, "signal", channels=[p])
        b.op(r, 0, "wait", channels=[p])
        b.nop(r, 0)
    return b.build()


def library_plans(names: list[str], n: int) -> list[Plan]:
    """The library algorithms ``names`` built for ``n`` ranks, one instance, their first variant's
    parameters, in every in-place mode they support (the plans a simulated Communicator picks from)."""
    from mscclang import algorithms

    out = []
    for name in names:
        info = algorithms.ALGORITHMS[name]
        params = dict(info.variants[0].params) if info.variants else {}
        for ip in info.inplace_modes:
            out.append(info.build(n, instances=1, inplace=ip, **params))
    return out
