"""Port channels on the CPU: packing (device records, trigger and slot numbering, pipelines,
finals), the proxy's per-launch stream operations (copy engine and engine), load-time refusals."""

from __future__ import annotations

import pytest

from mscclang.errors import PlanError
from mscclang.plan.models import BufferKind, OpName
from mscclang.runtime import device_plan as dp
from mscclang.runtime import packing
from mscclang.runtime.ports import DOP_PORT_FINAL, DOP_PORT_FLUSH, DOP_PORT_TRIGGER, PORT_FLUSH, PORT_SIGNAL
from mscclang.runtime.proxy import Incoming, Resolved, launch_ops
from mscclang.runtime.spec_source import parse_region
from mscclang.runtime.topology import Topology
from mscclang.sim import verify
from tests.harness import port_plans as pp
from tests.harness.recording_driver import RecordingDriver


@pytest.mark.parametrize("build", [pp.allgather_pwsf, pp.allgather_put_flush_signal, pp.allgather_port_only])
@pytest.mark.parametrize("n", [2, 4])
def test_port_samples_verify_and_pack(build, n):
    plan = build(n)
    assert verify(plan).status == "OK"
    dp.check_runnable(plan)
    for r in range(n):
        pk = packing.pack_blocks(plan, r, 4096, 4096 * n)
        chans = pk.port.channels
        assert [c.peer for c in chans] == [q for q in range(n) if q != r] or build is pp.allgather_port_only
        for c in chans:
            ts = [t.t for t in c.triggers]
            assert ts == list(range(1, len(ts) + 1))
            puts = [t for t in c.triggers if t.copies]
            assert len(puts) == 1 and puts[0].copies[0].length == 4096
            assert puts[0].copies[0].src == BufferKind.input and puts[0].copies[0].dst_off == 4096 * r
        recs = [x for b in pk.blocks for x in parse_region(b.region)]
        finals = [x for x in recs if x.kind == DOP_PORT_FINAL]
        assert len(finals) == len(chans)
        assert {x.aux0 for x in finals} == {len(c.triggers) for c in chans}


def test_trigger_records_carry_signal_and_flush_flags():
    plan = pp.allgather_pwsf(2)
    pk = packing.pack_blocks(plan, 0, 1024, 2048)
    recs = [x for b in pk.blocks for x in parse_region(b.region)]
    trig = [x for x in recs if x.kind == DOP_PORT_TRIGGER]
    assert len(trig) == 1 and trig[0].flags == PORT_SIGNAL | PORT_FLUSH and trig[0].aux0 == 1
    n_mem = len(plan.gpus[0].peers(dp.ChannelType.memory))
    assert trig[0].ids == [n_mem]   # the port channel's entry follows the memory channels
    waits = [x for x in recs if x.kind == dp.DOP_WAIT and x.ids == [n_mem]]
    assert waits, "the port wait uses the port channel's entry"
    plan = pp.allgather_put_flush_signal(2)
    recs = [x for b in packing.pack_blocks(plan, 0, 1024, 2048).blocks for x in parse_region(b.region)]
    kinds = [(x.kind, x.flags, x.aux0) for x in recs if x.kind in (DOP_PORT_TRIGGER, DOP_PORT_FLUSH)]
    assert kinds == [(DOP_PORT_TRIGGER, 0, 1), (DOP_PORT_FLUSH, 0, 1), (DOP_PORT_TRIGGER, PORT_SIGNAL, 2)]


def test_pipeline_numbering_matches_the_kernel():
    plan = pp.sendrecv_pipelined(unit=1 << 16)
    pk = packing.pack_blocks(plan, 0, 1 << 18, 1 << 18)
    (ch,) = pk.port.channels
    assert [(t.t, t.slot) for t in ch.triggers] == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert [t.copies[0].src_off for t in ch.triggers] == [0, 1 << 16, 2 << 16, 3 << 16]
    assert all(t.copies[0].length == 1 << 16 for t in ch.triggers)
    recs = [x for b in pk.blocks for x in parse_region(b.region)]
    pipe = [x for x in recs if x.kind == dp.DOP_PIPELINE][0]
    inner = [x for x in pipe.inner if x.kind == DOP_PORT_TRIGGER][0]
    # the kernel computes t = aux0 + it * (total & 0xffffffff), slot = aux1 + it * (total >> 32)
    for it, trig in enumerate(ch.triggers):
        assert inner.aux0 + it * (inner.total & 0xFFFFFFFF) == trig.t
        assert inner.aux1 + it * (inner.total >> 32) == trig.slot
    flush = [x for x in recs if x.kind == DOP_PORT_FLUSH][0]
    assert flush.aux0 == 4
    # rank 1 only signals (acknowledgements): 1 ready + 4 acks
    (ch1,) = packing.pack_blocks(plan, 1, 1 << 18, 1 << 18).port.channels
    assert [t.t for t in ch1.triggers] == [1, 2, 3, 4, 5] and all(not t.copies for t in ch1.triggers)


def test_launch_ops_copy_engine_order():
    plan = pp.allgather_pwsf(2)
    pk = packing.pack_blocks(plan, 0, 1024, 2048)
    area = 0x1000
    r = Resolved(input=0x10000, output=0x20000, scratch=0x30000, remote=[0x90000])
    (ops,) = launch_ops(pk.port, area, r, [0x77000], [None], [])
    assert [o.kind for o in ops] == ["wait", "copy", "copy", "done"]
    assert ops[0].a == area and ops[0].n == 1
    assert (ops[1].a, ops[1].b, ops[1].n) == (0x90000 + 0, 0x10000, 1024)
    assert (ops[2].a, ops[2].b, ops[2].n) == (0x77000, area + 8, 8)     # slot 0 -> peer inbound
    assert (ops[3].a, ops[3].n) == (area + 4, 1)


def test_launch_ops_engine_sends_and_receives_in_trigger_order():
    plan = pp.allgather_port_only(2)
    pk0 = packing.pack_blocks(plan, 0, 1024, 2048)
    pk1 = packing.pack_blocks(plan, 1, 1024, 2048)
    r = Resolved(input=0x10000, output=0x20000, scratch=0x30000, remote=[None])
    inc = Incoming(pk1.port.channels[0], inbound=0x5000, dst_kinds=[rb.type for rb in plan.gpus[1].remote_buffers],
                   comm="c10")
    send, recv = launch_ops(pk0.port, 0x1000, r, [None], ["c01"], [inc])
    assert [o.kind for o in send] == ["wait", "send", "done", "wait", "send", "send", "done"]
    assert all(o.comm == "c01" for o in send if o.kind == "send")
    # rank 1's triggers: ready signal, then pwsf of its chunk into rank 0's output block 1
    assert [(o.kind, o.a, o.n) for o in recv] == [("recv", 0x5000, 8), ("recv", 0x20000 + 1024, 1024),
                                                  ("recv", 0x5000, 8)]


def test_refusals():
    plan = pp.allgather_pwsf(2)
    plan.use_double_scratch_buffer = True
    dp.check_runnable(plan)   # no scratch through the port: fine
    plan = pp.sendrecv_pipelined()
    plan.use_double_scratch_buffer = True
    with pytest.raises(PlanError, match="use_double_scratch_buffer"):
        dp.check_runnable(plan)
    plan = pp.allgather_pwsf(2)
    tb = plan.gpus[0].threadblocks[0]
    op = next(o for o in tb.ops if o.name == OpName.pwsf)
    op.channel_ids = [5]
    with pytest.raises(PlanError, match=r"gpus\[0\]\.threadblocks\[0\]\.ops\[\d+\]\.channel_ids\[0\]: channel id 5"):
        dp.check_runnable(plan)


def test_memory_channels_between_nodes_are_refused_port_channels_carried():
    dp.check_runnable(pp.allgather_port_only(2), topology=Topology(2, 1))
    with pytest.raises(PlanError, match="different nodes"):
        dp.check_runnable(pp.allgather_pwsf(2), topology=Topology(2, 1))
    assert dp.mapped_peers(pp.allgather_port_only(2), 0, Topology(2, 1)) == []


class FakeNB:
    """nccl4py's calls the engine makes at connect and abort, recorded (no GPU)."""

    def __init__(self, rank):
        self.rank, self.inits, self.aborted, self.n = rank, [], [], 0

    def get_unique_id(self):
        self.n += 1
        return f"id-{self.rank}-{self.n}".encode().ljust(128, b"\0")

    def comm_init_rank_scalable(self, nranks, me, n_ids, ids, cfg):
        self.inits.append((me, bytes(ids)))
        return f"comm{self.rank}.{len(self.inits)}"

    def comm_abort(self, c):
        self.aborted.append(c)

    def group_start(self):
        pass

    def group_end(self):
        pass


def test_engine_connect_pairs_ranks_and_ids(monkeypatch):
    """Each channel's communicator: the sender is NCCL rank 0, the receiver rank 1, both with
    the id the sender made; ranks not on the channel create nothing."""
    from mscclang.runtime import engine as eng

    monkeypatch.setattr(eng.Engine, "_warm_up", lambda self, keys: None)

    keys = [eng.Key(0, 0, 1, 0), eng.Key(0, 1, 0, 0), eng.Key(0, 2, 0, 0)]
    fakes = {r: FakeNB(r) for r in range(3)}
    engines = {r: eng.Engine(r) for r in range(3)}
    for r in range(3):
        engines[r]._nb = fakes[r]
    blobs = {}

    # a two-phase exchange: every rank's blob first (collective), then the inits
    import threading
    barrier = threading.Barrier(3)

    def exchange(r):
        def f(data, tag):
            blobs[r] = data
            barrier.wait()
            return [blobs[q] for q in range(3)]
        return f

    ts = [threading.Thread(target=engines[r].connect, args=(keys, exchange(r))) for r in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert [m for m, _ in fakes[0].inits] == [0, 1, 1]   # sender of (0->1); receiver of (1->0), (2->0)
    assert [m for m, _ in fakes[1].inits] == [1, 0]
    assert [m for m, _ in fakes[2].inits] == [0]
    assert fakes[0].inits[0][1] == fakes[1].inits[0][1]           # channel 0->1: rank 0's id
    assert fakes[0].inits[1][1] == fakes[1].inits[1][1]           # channel 1->0: rank 1's id
    assert fakes[0].inits[2][1] == fakes[2].inits[0][1]
    assert set(engines[1].comms) == {eng.Key(0, 0, 1, 0), eng.Key(0, 1, 0, 0)}


def _shipped_port_plans():
    return pp.shipped_port_plans()


def test_every_shipped_port_plan_packs_and_scripts_its_proxy():
    """Every port-channel plan in plans/ is accepted on its node layout, packs on every rank at
    two sizes, and its proxy script is consistent: triggers numbered 1..n per channel, the
    kernel's final counts equal to them, every copy inside its buffers, and each engine
    channel's receiver posting exactly the sender's transfers."""
    plans = _shipped_port_plans()
    assert len(plans) >= 20, [p[0] for p in plans]
    for stem, plan, gpn in plans:
        topo = Topology(plan.world_size, gpn)
        dp.check_runnable(plan, topology=topo)
        for nbytes in (1 << 16, (1 << 20) * plan.world_size):
            out_b = nbytes * plan.world_size if plan.collective == "allgather" else nbytes
            packs = [packing.pack_blocks(plan, r, nbytes, out_b) for r in range(plan.world_size)]
            for r, pk in enumerate(packs):
                if pk.port is None:
                    continue
                finals = {x.ids[0]: x.aux0 for b in pk.blocks for x in parse_region(b.region)
                          if x.kind == DOP_PORT_FINAL}
                n_mem = len(plan.gpus[r].peers(dp.ChannelType.memory))
                for k, ch in enumerate(pk.port.channels):
                    assert [t.t for t in ch.triggers] == list(range(1, len(ch.triggers) + 1)), (stem, r, k)
                    assert finals.get(n_mem + k, 0) == len(ch.triggers), (stem, r, k)
                    for t in ch.triggers:
                        for c in t.copies:
                            src_size = {BufferKind.input: nbytes, BufferKind.output: out_b}.get(c.src)
                            if src_size is not None:
                                assert c.src_off + c.length <= src_size, (stem, r, k, c)
                    # the engine's receiver mirrors the sender (same script, computed there)
                    if not topo.same_node(r, ch.peer):
                        peer_pk = packs[ch.peer]
                        assert peer_pk is not None
                        sends = [(c.length) for t in ch.triggers for c in t.copies] + \
                                [8 for t in ch.triggers if t.slot is not None]
                        assert all(n > 0 for n in sends)


def test_proxy_issues_its_stream_operations_in_order(monkeypatch):
    """PortProxy.before/after through a recording driver: the port area is zeroed and the fork
    recorded on the caller's stream first; each side stream waits for the fork, then runs its
    channel's operations in order (wait, copies, done); the joins come after the kernel."""
    from mscclang.runtime import proxy as px

    drv = RecordingDriver()
    calls = drv.calls
    monkeypatch.setattr(px.cu, "driver", lambda: drv)
    plan = pp.allgather_pwsf(2)
    pk = packing.pack_blocks(plan, 0, 1024, 2048)
    pl = px.PortLaunch(pk.port, 0x1000, [0x90000], [BufferKind.output], 0x30000, [0x77000], [None])
    p = px.PortProxy()
    p.prepare(1)
    calls.clear()
    n = p.before(pl, 555, 0x10000, 0x20000, 0, 64)
    assert n == 1
    names = [c[0] for c in calls]
    assert names[:3] == ["cuMemsetD32Async", "cuEventRecord", "cuStreamWaitEvent"]
    assert calls[0][1:] == (0x1000, 0, pk.port.area_bytes // 4, 555)
    assert names[3:] == ["cuStreamWaitValue32", "cuMemcpyDtoDAsync", "cuMemcpyDtoDAsync", "cuStreamWriteValue32"]
    side = calls[2][1]
    assert all(c[1] == side for c in calls[3:5] if c[0] == "cuStreamWaitValue32")
    assert calls[4][1:4] == (0x90000 + 64, 0x10000, 1024)     # output delta applied to the peer's base
    calls.clear()
    p.after(555, n)
    assert [c[0] for c in calls] == ["cuEventRecord", "cuStreamWaitEvent"] and calls[1][1] == 555


def test_unpaired_port_channel_still_gets_counters():
    """Rank 0 has a port channel to rank 1, rank 1 none back: both ranks still lay out an inbound
    counter for the pair (set-up does not fail; a wait on it would time out, as verify says)."""
    from mscclang.plan.models import ChannelDesc, ChannelType
    from mscclang.runtime.ports import port_inbound_slots
    from mscclang.plan import samples as sp

    plan = sp.allgather_simple(2)
    plan.gpus[0].channels.append(ChannelDesc(channel_type=ChannelType.port, connected_to=[1]))
    assert port_inbound_slots(plan, 0) == {(1, 0): 0}
    assert port_inbound_slots(plan, 1) == {(0, 0): 0}
    assert dp.sync_layout(plan, 0).n_port_inbound == 1


def test_port_packing_of_mutated_plans_raises_only_plan_errors():
    """Random damage to port plans (channel ids, remote buffer ids, chunk ranges, op names,
    dropped channel lists, thread-block groups) meets a PlanError naming what is wrong, never
    another exception, at load or when packing."""
    import random

    from mscclang.errors import MscclangError
    from mscclang.plan.models import OpName, TbgInfo

    rng = random.Random(7)
    bases = [pp.allgather_pwsf(2), pp.allgather_put_flush_signal(4), pp.sendrecv_pipelined(), pp.allreduce_port_2()]
    for i in range(300):
        plan = rng.choice(bases).model_copy(deep=True)
        g = plan.gpus[rng.randrange(plan.world_size)]
        tb = rng.choice(g.threadblocks)
        ops = [o for o in tb.ops] + [x for o in tb.ops if o.ops for x in o.ops]
        op = rng.choice(ops)
        kind = rng.randrange(6)
        if kind == 0:
            op.channel_ids = [rng.randrange(6) for _ in range(rng.randrange(4))]
        elif kind == 1:
            for b in op.dst_buff + op.src_buff:
                if b.buffer_id is not None:
                    b.buffer_id = rng.randrange(5)
        elif kind == 2:
            for b in op.dst_buff + op.src_buff:
                b.index = rng.randrange(8)
        elif kind == 3:
            op.name = rng.choice([OpName.pws, OpName.pwsf, OpName.put, OpName.flush, OpName.signal, OpName.wait,
                                  OpName.ppkt, OpName.get])
        elif kind == 4:
            tb.channels = []
        else:
            op.tbg_info = TbgInfo(tb_id=0, tbg_size=2)
        try:
            dp.check_runnable(plan)
            for r in range(plan.world_size):
                out_b = 4096 * plan.world_size if plan.collective == "allgather" else 4096
                packing.pack_blocks(plan, r, 4096, out_b)
        except MscclangError:
            pass


def test_engine_reconnect_after_abort_is_agreed_by_every_rank(monkeypatch):
    """Regression (2x H200, two one-GPU nodes, session 5): only rank 0 called; it gave up and
    aborted its engine communicators; at reset it reconnected alone while rank 1, which never
    aborted, went on to the next barrier: both waited for ever. Now every rank learns that one
    lost its communicators, aborts its own end and reconnects."""
    import threading

    from mscclang.runtime import engine as eng

    monkeypatch.setattr(eng.Engine, "_warm_up", lambda self, keys: None)
    keys = [eng.Key(3, 0, 1, 0), eng.Key(3, 1, 0, 0)]
    engines = {r: eng.Engine(r) for r in range(2)}
    for r in range(2):
        engines[r]._nb = FakeNB(r)
    boards: dict = {}
    barrier = threading.Barrier(2)

    def exchange(r):
        def f(data, tag):
            boards.setdefault(tag, {})[r] = data
            barrier.wait()
            got = [boards[tag][q] for q in range(2)]
            barrier.wait()
            return got
        return f

    def run_all(fn):
        out = {}
        ts = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(r))) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        assert not any(t.is_alive() for t in ts), "a rank hung"
        return out

    run_all(lambda r: engines[r].connect(keys, exchange(r)))
    first = {r: dict(engines[r].comms) for r in range(2)}
    assert not any(run_all(lambda r: engines[r].resync(keys, exchange(r))).values())   # nothing lost
    engines[0].close(abort=True)          # rank 0 gave up on its peer
    assert run_all(lambda r: engines[r].resync(keys, exchange(r))) == {0: True, 1: True}
    assert sorted(engines[1]._nb.aborted) == sorted(first[1].values())   # the peer dropped its end
    for r in range(2):
        assert set(engines[r].comms) == set(keys)
        assert all(engines[r].comms[k] != first[r][k] for k in keys)     # new communicators
    # both ends of each new pair were made from the same unique id
    assert {i for _, i in engines[0]._nb.inits[-2:]} == {i for _, i in engines[1]._nb.inits[-2:]}


# ------------------------------------------------------------------ side streams and work queues

def test_port_streams_count_what_the_proxy_creates():
    """``port_streams`` (the rule the load-time check uses) equals the side streams the proxy runs
    for every shipped port plan on its node layout: one per packed channel of the rank, plus one
    per engine channel of a rank on another node that points at it (the receives)."""
    for stem, plan, gpn in pp.shipped_port_plans():
        topo = Topology(plan.world_size, gpn)
        nbytes = 1 << 16
        out_b = nbytes * plan.world_size if plan.collective == "allgather" else nbytes
        packs = [packing.pack_blocks(plan, r, nbytes, out_b) for r in range(plan.world_size)]
        for r in range(plan.world_size):
            own = len(packs[r].port.channels) if packs[r].port is not None else 0
            incoming = sum(1 for q, pk in enumerate(packs) if not topo.same_node(q, r) and pk.port is not None
                           for ch in pk.port.channels if ch.peer == r)
            assert dp.port_streams(plan, r, topo) == own + incoming, (stem, r)


def test_more_side_streams_than_work_queues_is_refused_not_a_hang():
    """Seen on one H200 with eight ranks sharing it: allgather_hierarchical.r8.i4.gpus_per_node2
    (12 port side streams per rank) hung past every timeout under CUDA's default 8 hardware work
    queues (a side stream's trigger wait blocked the copies queued behind it on the same queue),
    and ran exact with CUDA_DEVICE_MAX_CONNECTIONS=32. Such a plan is now refused at load, naming
    the rank, the count and the variable; the library then falls back to a plan that fits."""
    from mscclang.plan.io import load_plan
    from tests.harness.shipped import PLANS_DIR

    plan = load_plan(PLANS_DIR / "allgather_hierarchical.r8.i4.gpus_per_node2.inplace.json")
    with pytest.raises(PlanError, match=r"rank 0 needs 12 side streams .*CUDA_DEVICE_MAX_CONNECTIONS=8 gives "
                                        r"this process 8 hardware work queue\(s\), 7 beside") as e:
        dp.check_runnable(plan, work_queues=8)
    assert e.value.path == "gpus[0].channels"
    dp.check_runnable(plan, work_queues=32)
    dp.check_runnable(plan, work_queues=64)      # CUDA gives at most 32; 12 fit anyway
    dp.check_runnable(plan)                      # no limit given: the simulator's and the CLI's checks
    # Megatron-LM runs with CUDA_DEVICE_MAX_CONNECTIONS=1: no port plan fits, memory-channel plans do
    with pytest.raises(PlanError, match="rank 0 needs 1 side streams"):
        dp.check_runnable(pp.allgather_port_only(2), work_queues=1)
    dp.check_runnable(load_plan(PLANS_DIR / "allreduce_oneshot_ll.r8.i1.json"), work_queues=1)


def test_the_shipped_plans_that_need_more_work_queues_than_cudas_default():
    """The whole class: at CUDA's default 8 queues exactly the plans with more than 7 side streams
    on some rank are refused, on their own node layout (engine channels cost a send and a receive
    stream: the hierarchical plans with 4 instances) and on one node (copy engine only: just the
    8-rank ones across nodes of 2, 12 streams, the plan that hung on the GPU); with the 32 that
    mscclang's own workers ask for, every shipped port plan runs."""
    for one_node in (False, True):
        refused = set()
        for stem, plan, gpn in pp.shipped_port_plans():
            topo = Topology(plan.world_size, plan.world_size if one_node else gpn)
            dp.check_runnable(plan, topology=topo, work_queues=32)
            most = max(dp.port_streams(plan, r, topo) for r in range(plan.world_size))
            try:
                dp.check_runnable(plan, topology=topo, work_queues=8)
            except PlanError:
                refused.add(stem)
                assert most > 7, stem
            else:
                assert most <= 7, stem
        want = ".r8.i4.gpus_per_node2" if one_node else ".i4.gpus_per_node"
        assert refused and all("_hierarchical" in s and want in s for s in refused), sorted(refused)


def test_the_executor_checks_the_work_queues_of_this_process(monkeypatch):
    """Executor._accept passes this process's work queues (``CUDA_DEVICE_MAX_CONNECTIONS``; CUDA's
    default 8 when unset or not a positive integer; at most 32) to the check, so a refused plan
    never reaches a launch."""
    import types

    from mscclang.plan.io import load_plan
    from mscclang.runtime.executor import Executor
    from tests.harness.shipped import PLANS_DIR

    plan = load_plan(PLANS_DIR / "allgather_hierarchical.r8.i4.gpus_per_node2.inplace.json")
    me = types.SimpleNamespace(comm=types.SimpleNamespace(rank=3, world_size=8), topology=Topology(8, 8),
                               _sm_count=132)
    for unset_or_bad in (None, "", "lots", "0", "-4"):
        if unset_or_bad is None:
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", unset_or_bad)
        assert dp.process_work_queues() == 8
        with pytest.raises(PlanError, match="CUDA_DEVICE_MAX_CONNECTIONS=8"):
            Executor._accept(me, plan)
    for asked, got in (("32", 32), ("48", 32), (" 16 ", 16)):
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", asked)
        assert dp.process_work_queues() == got
        assert Executor._accept(me, plan) == len(plan.gpus[3].threadblocks)
