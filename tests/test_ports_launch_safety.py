"""Launch safety of port-channel plans, on the CPU (found on a GPU, session 6: the pipelined
sample hung its worker pool at 256 KiB after passing at 64 KiB):

* making or growing a plan's context is collective, so every rank must take the same decision:
  the rank with no scratch (a sender) used to keep its context while the receiver grew its own,
  leaving one rank in a store barrier and the other copying past the peer's old scratch
  (``cuMemcpyDtoDAsync`` failed with CUDA_ERROR_INVALID_VALUE; inside the allocation it would
  have been silent corruption);
* every proxy copy is checked against both buffers before anything is enqueued;
* a launch that fails after the proxy enqueued its waits releases them (``cuStreamWaitValue32``
  has no timeout: the next synchronize, e.g. the collective reset, hung forever).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mscclang.errors import PlanError
from mscclang.plan.models import BufferKind, ChannelType
from mscclang.runtime import packing
from mscclang.runtime import proxy as px
from mscclang.runtime.contexts import ContextPool
from mscclang.runtime.executor import Executor, LoadedPlan
from mscclang.runtime.topology import Topology
from tests.harness import port_plans as pp
from tests.harness.recording_driver import RecordingDriver

KiB = 1 << 10


def _stub_contexts(rank, monkeypatch, barriers):
    comm = SimpleNamespace(rank=rank, barrier=lambda tag="barrier", timeout_s=None: barriers.append(tag))
    pool = ContextPool(comm, None, None, 0, lambda: False)
    made = []

    def make(lp, size):
        made.append(size)
        return SimpleNamespace(scratch_bytes=max(size, 256))

    pool._make = make
    monkeypatch.setattr("mscclang.runtime.contexts.cu.driver",
                        lambda: SimpleNamespace(cuCtxSynchronize=lambda: (0,)))
    return pool, made


@pytest.mark.parametrize("build", [lambda: pp.sendrecv_pipelined(unit=64 * KiB), pp.sendrecv_memory_scratch],
                         ids=["port pipeline", "memory channel"])
def test_context_growth_is_decided_alike_on_every_rank(monkeypatch, build):
    from mscclang.sim import verify

    plan = build()
    assert verify(plan).status == "NO POSTCONDITION"   # a test collective: races and deadlocks checked
    # rank 0 only sends (no scratch), rank 1 receives into scratch
    own = [packing.pack_blocks(plan, r, 256 * KiB, 256 * KiB).scratch_bytes for r in range(2)]
    assert own[0] < own[1]
    assert packing.group_scratch_bytes(plan, 256 * KiB, 256 * KiB) == max(own)
    seqs, sizes = [], []
    for r in range(2):
        barriers: list = []
        pool, made = _stub_contexts(r, monkeypatch, barriers)
        lp = LoadedPlan(plan, False, "ll16", "sum", plan.num_threads_per_block, 1)
        for nbytes in (64 * KiB, 256 * KiB, 64 * KiB, 1024 * KiB):
            pool.ensure(lp, nbytes, nbytes)
        seqs.append(barriers)
        sizes.append(made)
    assert seqs[0] == seqs[1], seqs
    assert seqs[0].count("grow context") == 2
    assert sizes[0] == sizes[1]        # every rank's scratch is the group's: peers map equal sizes


def _launch(plan, rank, nbytes, scratch_bytes):
    pk = packing.pack_blocks(plan, rank, nbytes, nbytes)
    g = plan.gpus[rank]
    pl = px.PortLaunch(pk.port, 0x1000, [0x900000 * (j + 1) for j in range(len(g.remote_buffers))],
                       [rb.type for rb in g.remote_buffers], 0x30000, [0x77000] * len(pk.port.channels),
                       [None] * len(pk.port.channels), bounds=(nbytes, nbytes, scratch_bytes), abort_word=0x5000)
    return pk, pl


def test_a_copy_past_the_peers_scratch_is_refused_before_anything_is_enqueued():
    plan = pp.sendrecv_pipelined(unit=64 * KiB)
    # the peer's scratch as it was for a 64 KiB call, used for a 256 KiB one
    _pk, pl = _launch(plan, 0, 256 * KiB, packing.group_scratch_bytes(plan, 64 * KiB, 64 * KiB))
    with pytest.raises(PlanError, match=r"rank 0 thread block 0 op \d+ \(pws\).*iteration 1.*remote buffer 0 of "
                                        r"65536 B: past its end"):
        pl.ops(0x10000, 0x20000, 0, 0)
    # with the group's scratch at this size every copy fits
    _pk, pl = _launch(plan, 0, 256 * KiB, packing.group_scratch_bytes(plan, 256 * KiB, 256 * KiB))
    assert sum(o.kind == "copy" for s in pl.ops(0x10000, 0x20000, 0, 0) for o in s) == 8


def test_a_copy_past_this_ranks_source_is_refused():
    plan = pp.allgather_pwsf(2)
    pk = packing.pack_blocks(plan, 0, 4 * KiB, 8 * KiB)
    r = px.Resolved(0x10000, 0x20000, 0x30000, [0x90000], sizes=(1 * KiB, 8 * KiB, 0), remote_bytes=[8 * KiB])
    with pytest.raises(PlanError, match=r"from offset 0 of this rank's input buffer of 1024 B: past its end"):
        px.launch_ops(pk.port, 0x1000, r, [0x77000], [None], [])


@pytest.mark.parametrize("build,n", [(pp.allgather_pwsf, 2), (pp.allgather_put_flush_signal, 4),
                                     (pp.allgather_port_only, 2), (lambda n: pp.sendrecv_pipelined(), 2)])
def test_sample_port_plans_fit_their_buffers_at_every_size(build, n):
    plan = build(n)
    checked = 0
    for nbytes in (4 * KiB, 64 * KiB + 96 * n, 1 << 20, 3 << 20):
        out_b = nbytes * n if plan.collective == "allgather" else nbytes
        scratch = packing.group_scratch_bytes(plan, nbytes, out_b)
        for r in range(n):
            pk = packing.pack_blocks(plan, r, nbytes, out_b)
            if pk.port is None:
                continue
            g = plan.gpus[r]
            pl = px.PortLaunch(pk.port, 0x1000, [0x900000] * len(g.remote_buffers),
                               [rb.type for rb in g.remote_buffers], 0x30000, [0x77000] * len(pk.port.channels),
                               [None] * len(pk.port.channels), bounds=(nbytes, out_b, scratch))
            pl.ops(0x10000, 0x20000, 0, 0)
            checked += 1
    assert checked > 0, f"{plan.name}: no rank has port ops, so nothing was checked"


def test_shipped_port_plans_fit_their_buffers(shipped_plans):
    """Every port plan in plans/ at two sizes: no proxy copy leaves its buffers (same-node peers:
    copy-engine copies; the engine's receives checked on the receiving rank)."""
    checked = 0
    for stem, plan, gpn in pp.shipped_port_plans(shipped_plans):
        topo = Topology(plan.world_size, gpn)
        for nbytes in (1 << 16, (1 << 20) * plan.world_size):
            out_b = nbytes * plan.world_size if plan.collective == "allgather" else nbytes
            scratch = packing.group_scratch_bytes(plan, nbytes, out_b)
            packs = [packing.pack_blocks(plan, r, nbytes, out_b) for r in range(plan.world_size)]
            for r, pk in enumerate(packs):
                g = plan.gpus[r]
                if pk.port is None:
                    continue
                remote = [0x900000 if topo.same_node(r, rb.rank) else None for rb in g.remote_buffers]
                comms = [None if topo.same_node(r, c.peer) else object() for c in plan.channel_ordinals(r, ChannelType.port)]
                res = px.Resolved(0x10000, 0x20000, 0x30000, remote, (nbytes, out_b, scratch),
                                  [nbytes if rb.type == BufferKind.input else out_b if rb.type == BufferKind.output
                                   else scratch for rb in g.remote_buffers])
                inbound = [0x77000 if c is None else None for c in comms]
                try:
                    px.launch_ops(pk.port, 0x1000, res, inbound, comms, [])
                except PlanError as e:  # pragma: no cover - the message says which plan
                    raise AssertionError(f"{stem} rank {r} at {nbytes} B: {e}") from e
                checked += 1
    assert checked > 0, "no shipped plan has a rank with port ops: nothing was checked"


def test_shipped_counted_port_plans_fit_their_slots(shipped_plans):
    """Every port plan with segments in plans/ at two slot sizes: each proxy copy (a whole scratch
    slot) stays inside the counted launch's scratch, on every rank."""
    from mscclang.runtime.counted import CountedLaunch, counted_scratch_bytes, pack_counted

    checked = 0
    for stem, plan, gpn in pp.shipped_port_plans(shipped_plans, counted=True):
        for row, cap in ((16, 3), (4096, 64)):
            launch = CountedLaunch(0, row, cap, 5, 7)
            scratch = counted_scratch_bytes(plan, launch)
            for r in range(plan.world_size):
                pk = pack_counted(plan, r, launch)
                remote = [0x900000] * len(plan.gpus[r].remote_buffers)
                res = px.Resolved(0x10000, 0x20000, 0x30000, remote, (5 * row, 7 * row, scratch),
                                  [scratch] * len(remote))
                try:
                    px.launch_ops(pk.port, 0x1000, res, [0x77000] * len(pk.port.channels), [None] * len(pk.port.channels), [])
                except PlanError as e:  # pragma: no cover - the message says which plan
                    raise AssertionError(f"{stem} rank {r} at rows of {row} B, capacity {cap}: {e}") from e
                checked += 1
    assert checked >= 3 * 2 * 2, "the copy-engine all-to-all-v plans were not all checked"


def _port_executor(monkeypatch, rank, stream, drv):
    """An Executor shell with a prepared port proxy on the recording driver ``drv``."""
    monkeypatch.setattr(px.cu, "driver", lambda: drv)
    monkeypatch.setattr("mscclang.runtime.cuda.driver", lambda: drv)
    p = px.PortProxy()
    p.prepare(1)
    ex = object.__new__(Executor)
    ex.comm = SimpleNamespace(rank=rank)
    ex._proxy = p
    ex.timeout_ns = int(1e9)
    ex.launcher = SimpleNamespace(order=lambda s: None, stream_capturing=lambda s: False, launch=None)
    drv.calls.clear()
    return ex


def test_a_failed_enqueue_releases_every_wait_and_sets_the_abort_word(monkeypatch):
    from mscclang.errors import RuntimeUnavailable

    plan = pp.sendrecv_pipelined(unit=64 * KiB)
    pk, pl = _launch(plan, 0, 256 * KiB, packing.group_scratch_bytes(plan, 256 * KiB, 256 * KiB))
    drv = RecordingDriver(fail="cuMemcpyDtoDAsync")
    ex = _port_executor(monkeypatch, 0, 555, drv)
    ex.launcher.launch = lambda *a, **k: pytest.fail("the kernel must not be launched after a failed enqueue")
    with pytest.raises(RuntimeUnavailable, match="cuMemcpyDtoDAsync"):
        ex._launch_port(None, pl, 0x10000, 0x20000, 0, 0, 555)
    waits = [c for c in drv.calls if c[0] == "cuStreamWaitValue32"]
    assert waits, "the failure must come after a wait was enqueued for this test to mean anything"
    writes = [c for c in drv.calls if c[0] == "cuStreamWriteValue32" and c[1] == 555]
    final = max(t.t for t in pk.port.channels[0].triggers)
    assert (555, 0x1000 + pk.port.block_offset(0), final, 0) in [c[1:] for c in writes]
    assert (555, 0x5000, 1, 0) in [c[1:] for c in writes]
    assert not any(c[0] == "cuStreamWaitEvent" and c[1] == 555 for c in drv.calls)   # no join after a failure


def test_a_failed_kernel_launch_releases_the_enqueued_waits(monkeypatch):
    plan = pp.sendrecv_pipelined(unit=64 * KiB)
    pk, pl = _launch(plan, 1, 64 * KiB, packing.group_scratch_bytes(plan, 64 * KiB, 64 * KiB))
    drv = RecordingDriver()
    ex = _port_executor(monkeypatch, 1, 7, drv)

    def boom(*a, **k):
        raise RuntimeError("launch failed")

    ex.launcher.launch = boom
    with pytest.raises(RuntimeError, match="launch failed"):
        ex._launch_port(None, pl, 0x10000, 0x20000, 0, 0, 7)
    final = max(t.t for t in pk.port.channels[0].triggers)
    assert ("cuStreamWriteValue32", 7, 0x1000 + pk.port.block_offset(0), final, 0) in drv.calls
    # in a capture nothing is released: the graph is never instantiated
    drv.calls.clear()
    ex.launcher.stream_capturing = lambda s: True
    with pytest.raises(RuntimeError, match="launch failed"):
        ex._launch_port(None, pl, 0x10000, 0x20000, 0, 0, 7)
    assert not any(c[0] == "cuStreamWriteValue32" and c[1] == 7 for c in drv.calls)


def test_a_side_stream_that_never_finishes_ends_in_collective_timeout_not_a_hang():
    """reset() and synchronize() wait for the proxy's side streams with a bound (their waits have
    no timeout of their own): a wait nobody releases raises CollectiveTimeout naming the cause."""
    from mscclang.errors import CollectiveTimeout
    from mscclang.runtime.abort import Waits

    proxy = SimpleNamespace(enqueued=12, side_streams=lambda: ["side0"])
    abort = SimpleNamespace(aborted=False)
    launcher = SimpleNamespace(current_stream=lambda: "torch", last_stream="last")
    waits = Waits(1, lambda: int(1e9), abort, launcher, lambda: proxy, lambda: SimpleNamespace(comms={}))
    seen = []

    def drained(streams, limit_s, stop=None):
        seen.append((streams, limit_s))
        return False

    waits.drainer = SimpleNamespace(drained=drained)
    with pytest.raises(CollectiveTimeout, match=r"rank 1: reset: the port-channel proxy's stream operations did "
                                                r"not finish within 7 s"):
        waits.ports("reset")
    assert seen == [(["side0", "torch", "last"], 7.0)] and abort.aborted
    waits.drainer.drained = lambda streams, limit_s, stop=None: True
    waits.ports("synchronize")        # drained: returns
    proxy.enqueued = 0
    waits.drainer.drained = lambda *a, **k: pytest.fail("no port plan ran: nothing to wait for")
    waits.ports("synchronize")


def test_reset_ends_a_stuck_engine_transfer_by_aborting_the_engine():
    """In reset(), a side stream stuck in an engine receive (a dead peer) is ended by aborting the
    engine's communicators (the reset reconnects them), not declared unrecoverable."""
    from mscclang.runtime.abort import Waits

    aborted = []
    engine = SimpleNamespace(comms={"k": object()}, close=lambda abort=False: aborted.append(abort))
    proxy = SimpleNamespace(enqueued=3, side_streams=lambda: ["recv"])
    abort = SimpleNamespace(aborted=False)
    launcher = SimpleNamespace(current_stream=lambda: "torch", last_stream=None)
    waits = Waits(0, lambda: int(1e9), abort, launcher, lambda: proxy, lambda: engine)
    answers = iter([False, True])      # stuck until the engine is aborted
    waits.drainer = SimpleNamespace(drained=lambda streams, limit_s, stop=None: next(answers))
    waits.ports("reset")
    assert aborted == [True] and abort.aborted
