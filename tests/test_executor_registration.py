"""The executor's side of registration and of the staging cap, without a GPU: a fake driver
module (device memory as bytearrays), fake communicators over the registration fakes. Checks the
launch entry a registered call gets (keyed by the registration, the right deltas, pinned inside a
capture), that released registrations and staging take their entries and device plans with them,
the cap (kept, grown, released, temporary, kept by prepare, pinned by a capture), and capture
sessions: the arena slot holds an aborting plan until the session's end writes the real device plan
with the peers' addresses."""

from __future__ import annotations

import ctypes
import types
from pathlib import Path

import pytest
import torch

from mscclang.errors import NotPrepared
from mscclang.plan.call import sized_call
from mscclang.plan.dtypes import dtype_info
from mscclang.plan.io import load_plan
from mscclang.runtime import cuda as real_cu
from mscclang.runtime import executor as exmod
from mscclang.runtime.bootstrap import SymAlloc
from mscclang.runtime.device_plan import SYNC_ABORT_OFF, sync_layout
from mscclang.runtime.packing import pack_blocks
from mscclang.runtime.executor import Executor, LoadedPlan
from mscclang.runtime.state import Context, DevPlanKey, EntryKey, LaunchEntry, Operands, SpecKey
from mscclang.runtime.registration import ARENA_STRIDE
from mscclang.runtime.structs import PLAN_HEADER, REMOTE_BUF
from mscclang.comm.sim_ranks import stub_plan
from tests.harness.registration_fakes import FakeCluster, RankErrors

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


class FakeCu:
    """Device memory as bytearrays at made-up addresses; the calls the executor makes."""

    check = staticmethod(real_cu.check)
    ptr = staticmethod(real_cu.ptr)

    def __init__(self) -> None:
        self.mem: dict[int, bytearray] = {}
        self.next = 0x10_0000_0000
        self.freed: list[int] = []
        self.syncs = 0

    def driver(self):
        def sync():
            self.syncs += 1
            return 0
        return types.SimpleNamespace(cuCtxSynchronize=sync,
                                     cuOccupancyMaxActiveBlocksPerMultiprocessor=lambda f, nt, smem: (0, 1),
                                     cuFuncSetAttribute=lambda *a: 0,
                                     CUfunction_attribute=types.SimpleNamespace(
                                         CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8))

    def mem_alloc(self, n: int) -> int:
        p = self.next
        self.next += (max(int(n), 1) + MiB - 1) // MiB * MiB
        self.mem[p] = bytearray(max(int(n), 1))
        return p

    def mem_free(self, p: int) -> None:
        del self.mem[p]
        self.freed.append(p)

    def _at(self, p: int) -> tuple[bytearray, int]:
        for b, m in self.mem.items():
            if b <= p < b + len(m):
                return m, p - b
        raise KeyError(f"{p:#x} is not allocated")

    def htod(self, p: int, data: bytes, stream: int = 0) -> None:
        m, o = self._at(p)
        m[o:o + len(data)] = data

    def memset_d32(self, p: int, value: int, count: int, stream: int = 0) -> None:
        m, o = self._at(p)
        m[o:o + 4 * count] = int(value).to_bytes(4, "little") * count

    def memset_d8(self, p: int, value: int, n: int, stream: int = 0) -> None:
        m, o = self._at(p)
        m[o:o + n] = bytes([value]) * n

    def read(self, p: int, n: int) -> bytes:
        m, o = self._at(p)
        return bytes(m[o:o + n])

    def dtoh(self, p: int, n: int, stream: int = 0) -> bytes:
        return self.read(p, n)


class FakeRtComm:
    """The runtime communicator's surface the executor uses (symmetric allocations, barriers)."""

    def __init__(self, cluster: FakeCluster, rank: int, fcu: FakeCu) -> None:
        self.rank, self.world_size, self.device, self.call = rank, cluster.n, 0, ""
        self.registry = cluster.registry(rank)
        self.cu = fcu
        self._sym: list[SymAlloc] = []
        self._count = 0
        self.barriers: list[str] = []
        self.released: list[SymAlloc] = []

    def symmetric_of(self, p: int):
        for sa in self._sym:
            if 0 <= p - sa.base < sa.size:
                return sa
        return None

    def _sym_alloc(self, nbytes: int, internal: bool = False, label: str = "") -> SymAlloc:
        p = self.cu.mem_alloc(nbytes)
        sa = SymAlloc(self._count, p, nbytes, 1000 + self._count,
                      {q: p + (q - self.rank) * (1 << 44) for q in range(self.world_size)}, internal, label)
        self._count += 1
        self._sym.append(sa)
        return sa

    def barrier(self, tag: str = "barrier") -> None:
        self.barriers.append(tag)

    def _sym_release(self, allocs) -> None:
        for sa in allocs:
            self._sym.remove(sa)
            self.cu.mem_free(sa.base)
            self.released.append(sa)


class FakeT:
    """A 'CUDA tensor' at a made-up address, backed by a CPU storage (for the weak reference)."""

    def __init__(self, ptr: int, nbytes: int, dtype=torch.float16) -> None:
        self._p, self._n, self.dtype = ptr, nbytes, dtype
        self._back = torch.empty(max(nbytes // 2, 1), dtype=torch.float16)
        self.is_cuda, self.device = True, "cuda:0"

    def data_ptr(self) -> int:
        return self._p

    def numel(self) -> int:
        return self._n // self.element_size()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def get_device(self) -> int:
        return 0

    def is_contiguous(self) -> bool:
        return True

    def untyped_storage(self):
        return self._back.untyped_storage()



@pytest.fixture(autouse=True)
def _designed_defaults(monkeypatch):
    """These tests cover the designed behaviour (auto registration, 128 MiB staging cap), which
    the release keeps off until GPU tests have run on it."""
    monkeypatch.setenv("MSCCLANG_REGISTER", "auto")
    monkeypatch.setenv("MSCCLANG_STAGING_CAP_BYTES", str(128 << 20))

@pytest.fixture
def fcu(monkeypatch):
    f = FakeCu()
    from mscclang.runtime import capture, contexts, entries, kernels, trace

    for mod in (exmod, capture, contexts, entries, kernels, trace):
        monkeypatch.setattr(mod, "cu", f)
    return f


def _executor(comm: FakeRtComm, capturing: list) -> Executor:
    from mscclang.runtime.topology import Topology

    ex = object.__new__(Executor)
    ex._capturing = lambda: capturing[0]
    launcher = types.SimpleNamespace(capturing_now=lambda: capturing[0], current_stream=lambda: 0,
                                     last_stream=None)
    ex._assemble(comm, "sm_90", 132, int(1e9), "never", launcher, types.SimpleNamespace(dev=0xE0_0000),
                 topology=Topology(comm.world_size, comm.world_size))
    return ex


def _lp(plan) -> LoadedPlan:
    from mscclang.runtime.device_plan import is_zero_copy

    return LoadedPlan(plan, is_zero_copy(plan), "ll16", "sum", plan.num_threads_per_block,
                      len(plan.gpus[0].threadblocks))


def _resolve(ex: Executor, lp: LoadedPlan, in_ptr: int, out_ptr: int, in_bytes: int, out_bytes: int,
             prepare: bool = False):
    """Entries.resolve of a float16 sum call of these buffers and sizes, LL16, on stream 0."""
    call = sized_call(lp.plan.collective, ex.comm.rank, ex.comm.world_size, dtype_info("float16"), in_bytes,
                      out_bytes, "sum", None, in_ptr, out_ptr)
    return ex.entries.resolve(lp, call, "ll16", 0, prepare=prepare)


def _setup(n: int, fcu: FakeCu, **kw):
    cl = FakeCluster(n, **kw)
    comms = [FakeRtComm(cl, r, fcu) for r in range(n)]
    cap = [False]
    exs = [_executor(c, cap) for c in comms]
    return cl, comms, exs, cap


# ------------------------------------------------------------------------------------------


def test_registered_call_gets_an_entry_keyed_by_its_registration_and_is_pinned_when_captured(fcu):
    cl, comms, exs, cap = _setup(2, fcu)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    ts = [FakeT(al[r].base + 4096 * (r + 1), MiB) for r in range(2)]
    assert cl.run(lambda r: exs[r].capture.register([ts[r]])) == [[True], [True]]
    ex = exs[0]
    lp = _lp(stub_plan("allreduce", 2, name="zc", symmetric=True, inplace=True))
    seen = []
    ex.entries._build = lambda lp_, dt, a, b, pkt, op, si, so, force, stream, row=0: seen.append((si, so)) or \
        LaunchEntry("E", 0, 0, 0, 0, 0)
    p = ts[0].data_ptr()
    ent, st = _resolve(ex, lp, p, p, MiB, MiB)
    reg = cl.registry(0).lookup(p, MiB)
    assert st == Operands("sym", 0, 0) and seen == [(reg, reg)]
    assert EntryKey(MiB, MiB, "f16", "ll16", "sum", "sym", ("reg", 0), ("reg", 0)) in lp.fast
    assert not reg.pinned
    # a view from the start of the registered tensor reuses it; a tensor elsewhere is staged
    ent2, st2 = _resolve(ex, lp, p, p, 4096, 4096)
    assert st2 == Operands("sym", 0, 0) and seen[-1] == (reg, reg)
    cap[0] = True
    _resolve(ex, lp, p, p, MiB, MiB)
    assert reg.pinned    # a captured graph uses it: kept until close
    assert ex.capture.zero_copy_ok(ts[0], ts[0]) and ex.capture.classify(ts[0]) == ("reg", 0)
    assert ex.capture.classify(FakeT(al[0].base + 32 * MiB, 64)) is None


def test_released_registrations_take_their_entries_and_device_plans_with_them(fcu):
    cl, comms, exs, cap = _setup(2, fcu)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    ts = [FakeT(al[r].base, MiB) for r in range(2)]
    cl.run(lambda r: exs[r].capture.register([ts[r]]))
    ex = exs[0]
    lp = _lp(stub_plan("allreduce", 2, name="zc", symmetric=True, inplace=True))
    blob = fcu.mem_alloc(4096)
    other = fcu.mem_alloc(4096)
    ctx = types.SimpleNamespace(plans={DevPlanKey(MiB, MiB, ("reg", 0), ("reg", 0)):
                                       types.SimpleNamespace(blob=blob, port_area=0),
                                       DevPlanKey(MiB, MiB, 3, 3): types.SimpleNamespace(blob=other, port_area=0)})
    lp.ctx, lp.retired = ctx, []
    k_reg = EntryKey(MiB, MiB, "f16", "ll16", "sum", "sym", ("reg", 0), ("reg", 0))
    k_sym = EntryKey(MiB, MiB, "f16", "ll16", "sum", "sym", 3, 3)
    lp.fast = {k_reg: "a", k_sym: "b"}
    ex._loaded = {1: lp}
    assert cl.run(lambda r: exs[r].capture.deregister([ts[r]])) == [1, 1]
    assert list(lp.fast) == [k_sym] and list(ctx.plans) == [DevPlanKey(MiB, MiB, 3, 3)]
    assert fcu.freed == [blob]


def test_staging_is_capped_grown_released_temporary_and_kept(fcu):
    cl, comms, exs, cap = _setup(1, fcu)
    ex, comm = exs[0], comms[0]
    ex.staging.cap = 4096
    lp = _lp(stub_plan("allreduce", 1, name="zc1", symmetric=True))
    lp.ctx = types.SimpleNamespace(plans={})
    si, so = ex.staging.get(lp, 1000, 1000)
    assert (si.size, so.size) == (1024, 1024) and si is not so
    si2, so2 = ex.staging.get(lp, 3000, 3000)           # grows (to the cap): the 1 KiB ones are released
    assert (si2.size, so2.size) == (4096, 4096)
    assert comm.released == [si, so] and comm.barriers == ["staging", "staging", "release outgrown staging"]
    t_in, t_out = ex.staging.get(lp, 10000, 10000)      # above the cap: temporary
    assert t_in.temp and t_out.temp and ex.staging.plan_staging(lp) == (si2, so2)
    ex.staging.release([t_in, t_out], "staging above the cap")
    assert comm.released[-2:] == [t_in, t_out]
    k_in, k_out = ex.staging.get(lp, 10000, 10000, keep=True)   # prepare keeps it: found again
    assert k_in.pinned and ex.staging.get(lp, 10000, 10000) == (k_in, k_out)
    ex.staging.release([k_in, k_out])              # pinned: never released before close
    assert k_in in comm._sym
    cap[0] = True
    with pytest.raises(NotPrepared, match="above the staging cap"):
        ex.staging.get(lp, 20000, 20000)
    lp2 = _lp(stub_plan("allreduce", 1, name="zc2", symmetric=True))
    lp2.ctx = types.SimpleNamespace(plans={})
    with pytest.raises(NotPrepared, match="inside CUDA graph capture"):
        ex.staging.get(lp2, 3000, 3000)                 # no staging yet: cannot allocate in a capture


def test_staging_a_capture_used_is_kept_when_outgrown(fcu):
    cl, comms, exs, cap = _setup(1, fcu)
    ex, comm = exs[0], comms[0]
    ex.staging.cap = 1 << 30
    lp = _lp(stub_plan("allreduce", 2, name="zc1", symmetric=True))
    lp.ctx = types.SimpleNamespace(plans={})
    ex.entries._build = lambda *a, **k: LaunchEntry("E", 0, 0, 0, 0, 0)
    ex.capture.registered = lambda *a: None
    a, b = FakeT(0x5000_0000, 2048), FakeT(0x6000_0000, 2048)
    cap[0] = False
    _resolve(ex, lp, a.data_ptr(), b.data_ptr(), 2048, 2048)
    si, so = ex.staging.plan_staging(lp)
    cap[0] = True
    _resolve(ex, lp, a.data_ptr(), b.data_ptr(), 2048, 2048)
    assert si.pinned and so.pinned
    cap[0] = False
    _resolve(ex, lp, a.data_ptr(), b.data_ptr(), 8192, 8192)
    assert comm.released == [] and si in comm._sym


def _real_plan():
    return load_plan(ROOT / "plans" / "allreduce_rsag_zero_copy.r2.i16.inplace.json")


def _ready(ex: Executor, lp: LoadedPlan, fcu: FakeCu, nbytes: int) -> None:
    """What an earlier (eager or prepared) call of these sizes leaves: the kernel loaded and a
    context (its launch entries may be gone since: the tensors it ran on died)."""
    from mscclang.runtime.build import block_variant

    r = ex.comm.rank
    q = 1 - r
    plan = lp.plan
    sync = sync_layout(plan, r)
    lp.ctx = Context(sync, fcu.mem_alloc(sync.size), fcu.mem_alloc(MiB), MiB,
                      {q: 0xAB_0000_0000 + q}, {q: 0xAC_0000_0000 + q})
    ex.kernels._funcs[("f16", "ll16", "sum", block_variant(lp.nthreads), False)] = 77


def test_capture_session_slot_aborts_until_registration_then_holds_the_peers_addresses(fcu):
    cl, comms, exs, cap = _setup(2, fcu)
    plan = _real_plan()
    nbytes = 2 * MiB
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    ptrs = [al[r].base + (r + 1) * 8192 for r in range(2)]
    lps = [_lp(plan) for _ in range(2)]
    for r in range(2):
        _ready(exs[r], lps[r], fcu, nbytes)
    slots = [None, None]

    def body(r):
        ex = exs[r]
        assert ex.capture.begin_capture(arena_bytes=64 << 10)
        cap_r = [True]
        ex._capturing = lambda: cap_r[0]
        ent, st = _resolve(ex, lps[r], ptrs[r], ptrs[r], nbytes, nbytes)
        assert st == Operands("sym", 0, 0) and ent.func == 77 and ent.handle == 77 and ent.spec is None
        assert ent.n_blocks == len(plan.gpus[r].threadblocks) and ent.nthreads == plan.num_threads_per_block
        slots[r] = ent.blob
        head = PLAN_HEADER.unpack(fcu.read(ent.blob, PLAN_HEADER.size))
        # until the session ends the slot is a plan whose abort word is already set
        assert fcu.read(head["abort_word"], 4) == (1).to_bytes(4, "little")
        assert head["error_record"] == ex.abort.dev and head["n_remote"] == 0
        cap_r[0] = False
        return ex.capture.end_capture()

    assert cl.run(body) == [1, 1]
    for r in range(2):
        q = 1 - r
        blob = fcu.read(slots[r], ARENA_STRIDE)
        head = PLAN_HEADER.unpack(blob)
        assert head["n_blocks"] == len(plan.gpus[r].threadblocks) and head["sync_base"] == lps[r].ctx.sync_base
        bases = [REMOTE_BUF.unpack(blob, head["remote_table"] + i * REMOTE_BUF.size)["base"]
                 for i in range(head["n_remote"])]
        assert bases and all(cl.ipcs[r].resolve(b) == (q, al[q].buffer_id, ptrs[q]) for b in bases)
        assert head["abort_word"] == lps[r].ctx.sync_base + SYNC_ABORT_OFF   # the context's, no longer set
        assert cl.registry(r).memory()["graph_registrations"] == 1


def test_capture_sessions_that_disagree_leave_every_slot_aborting(fcu):
    cl, comms, exs, cap = _setup(2, fcu)
    plan = _real_plan()
    nbytes = 2 * MiB
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    lps = [_lp(plan) for _ in range(2)]
    for r in range(2):
        _ready(exs[r], lps[r], fcu, nbytes)
    slots: dict[int, list] = {0: [], 1: []}

    def body(r):
        ex = exs[r]
        ex.capture.begin_capture(arena_bytes=64 << 10)
        ex._capturing = lambda: True
        for k in range(2 if r == 0 else 1):
            p = al[r].base + k * 4 * MiB
            slots[r].append(_resolve(ex, lps[r], p, p, nbytes, nbytes)[0].blob)
        ex._capturing = lambda: False
        return ex.capture.end_capture()

    with pytest.raises(RankErrors):
        cl.run(body)
    for r in range(2):
        for s in slots[r]:
            head = PLAN_HEADER.unpack(fcu.read(s, PLAN_HEADER.size))
            assert head["n_blocks"] == 0 and fcu.read(head["abort_word"], 4) == (1).to_bytes(4, "little")


def test_deferred_call_needs_the_sizes_run_before_and_room_in_the_arena(fcu):
    cl, comms, exs, cap = _setup(1, fcu)
    plan = stub_plan("allreduce", 2, name="zc1", symmetric=True, inplace=True)
    a = cl.devices[0].alloc(64 * MiB)
    ex = exs[0]
    lp = _lp(plan)
    ex.capture.begin_capture(arena_bytes=ARENA_STRIDE)
    cap[0] = True
    with pytest.raises(NotPrepared, match="was not prepared"):
        _resolve(ex, lp, a.base, a.base, 4096, 4096)
    sync = sync_layout(plan, 0)
    lp.ctx = Context(sync, fcu.mem_alloc(sync.size), fcu.mem_alloc(4096), 4096, {1: 0xAB00}, {1: 0xAC00})
    with pytest.raises(NotPrepared, match="was not prepared"):   # a context, but no kernel yet
        _resolve(ex, lp, a.base, a.base, 4096, 4096)
    from mscclang.runtime.build import block_variant

    ex.kernels._funcs[("f16", "ll16", "sum", block_variant(lp.nthreads), False)] = 5
    _resolve(ex, lp, a.base, a.base, 4096, 4096)   # the one slot
    with pytest.raises(NotPrepared, match="arena"):
        _resolve(ex, lp, a.base + MiB, a.base + MiB, 4096, 4096)
    assert pack_blocks(plan, 0, 4096, 4096).scratch_bytes <= 4096


def test_executor_register_refuses_inside_a_capture_and_reports_symmetric_tensors(fcu):
    cl, comms, exs, cap = _setup(1, fcu)
    ex, comm = exs[0], comms[0]
    sa = comm._sym_alloc(4096)
    assert ex.capture.register([FakeT(sa.base, 4096)]) == [True]
    cap[0] = True
    with pytest.raises(NotPrepared, match="inside CUDA graph capture"):
        ex.capture.register([FakeT(0x1234_0000, 64)])


# ------------------------------------------------------------------------------------------
# the call path: new sizes, bounded entries (found from outside: a new message size stalled the
# call for up to 1.26 s, a stream of distinct sizes did not finish, memory grew with every size)


def _any_buffer_plan():
    return load_plan(ROOT / "plans" / "allreduce_oneshot_ll.r2.i16.json")


def _ready_any(ex: Executor, lp: LoadedPlan, fcu: FakeCu, scratch: int) -> None:
    """What a first call leaves: the interpreter loaded and a context of ``scratch`` bytes."""
    from mscclang.runtime.build import block_variant

    r, q = ex.comm.rank, 1 - ex.comm.rank
    sync = sync_layout(lp.plan, r)
    lp.ctx = Context(sync, fcu.mem_alloc(sync.size), fcu.mem_alloc(scratch), scratch,
                     {q: 0xAB_0000_0000 + q}, {q: 0xAC_0000_0000 + q})
    ex.kernels._funcs[("f16", "ll16", "sum", block_variant(lp.nthreads), False)] = 77


class _Builds:
    """Records what the entries ask of the kernel cache's specialised builds."""

    def __init__(self, ex: Executor, monkeypatch) -> None:
        import concurrent.futures

        self.later: list = []
        self.futures: list = []
        self.now = 0

        def later(make_src):
            self.later.append(make_src)
            f = concurrent.futures.Future()
            self.futures.append(f)
            return f

        def now(src):
            self.now += 1
            raise AssertionError("built on the calling thread")

        monkeypatch.setattr(ex.kernels, "specialise_later", later)
        monkeypatch.setattr(ex.kernels, "specialised_now", now)


def test_a_new_message_size_is_host_work_only(fcu, monkeypatch):
    """Once the plan's context is large enough, a call of a new size makes no store exchange, no
    device synchronisation and no kernel build on the calling thread: it runs the interpreter; a
    size called again gets its specialised kernel built in the background and switches once that
    is done."""
    cl, comms, exs, cap = _setup(2, fcu)
    ex, comm = exs[0], comms[0]
    lp = ex.load(_any_buffer_plan())
    assert not lp.zero_copy
    _ready_any(ex, lp, fcu, 64 * MiB)
    ex.specialize = "auto"
    builds = _Builds(ex, monkeypatch)
    syncs = fcu.syncs
    sizes = [49164, 49164 + 16, 100_000, 200_000 + 48]
    for n in sizes:
        ent, opr = _resolve(ex, lp, 0x7000_0000, 0x7800_0000, n, n)
        assert opr == Operands() and ent.spec is None and ent.pending is not None
    assert comm.barriers == [] and fcu.syncs == syncs and builds.now == 0
    assert builds.later == []                       # a size called once builds nothing
    for n in sizes:                                 # the second call starts its build, in the background
        ent, _ = _resolve(ex, lp, 0x7000_0000, 0x7800_0000, n, n)
        assert ent.spec is None and ent.pending is not None   # still building: the interpreter runs
    assert len(builds.later) == len(sizes) and builds.now == 0
    # the build of the first size finishes: its next call switches to the specialised kernel
    sentinel = types.SimpleNamespace(name="k0")
    monkeypatch.setattr(ex.kernels, "finish", lambda fut: sentinel)
    monkeypatch.setattr(ex.entries, "_spec_launch", lambda sp, dp, ctx: ("launch", sp))
    n = sizes[0]
    builds.futures[0].set_result(("src", b"cubin", "nvrtc"))
    ent, _ = _resolve(ex, lp, 0x7000_0000, 0x7800_0000, n, n)
    assert ent.spec == ("launch", sentinel) and ent.pending is None
    assert comm.barriers == [] and fcu.syncs == syncs


def test_hot_sizes_are_built_in_the_background_only_once_called_again(fcu, monkeypatch):
    """Above MSCCLANG_SPEC_FIRST_BYTES a size gets its kernel once called MSCCLANG_SPEC_HOT_CALLS
    times, so a stream of one-off sizes builds nothing."""
    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 256 * MiB)
    ex.specialize = "auto"
    monkeypatch.setenv("MSCCLANG_SPEC_HOT_CALLS", "3")
    builds = _Builds(ex, monkeypatch)
    for n in (300_000, 300_064, 700_000):   # one-off sizes
        _resolve(ex, lp, 0x7000_0000, 0x7800_0000, n, n)
    assert builds.later == []
    n = 500_000
    for k in range(3):
        _resolve(ex, lp, 0x7000_0000, 0x7800_0000, n, n)
        assert len(builds.later) == (1 if k == 2 else 0)


def test_launch_entries_are_bounded_and_prepared_ones_are_kept(fcu, monkeypatch):
    """Beyond the cap the least recently used entries (with their device plans) are evicted, after
    the device finished its work; an entry that prepare made (a captured graph may replay it) stays."""
    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 256 * MiB)
    ex.entries.cap = 16
    first = 4096
    _resolve(ex, lp, 0x7000_0000, 0x7800_0000, first, first, prepare=True)
    kept_blob = lp.fast[EntryKey(first, first, "f16", "ll16", "sum")].blob
    syncs = fcu.syncs
    sizes = [8192 + 256 * i for i in range(200)]
    for n in sizes:
        _resolve(ex, lp, 0x7000_0000, 0x7800_0000, n, n)
        assert len(lp.fast) <= 16
    assert EntryKey(first, first, "f16", "ll16", "sum") in lp.fast and kept_blob in fcu.mem
    assert len(lp.ctx.plans) == len(lp.fast)          # evicted entries took their device plans along
    assert ex.entries.evicted == 201 - len(lp.fast) and ex.memory()["evicted_entries"] == ex.entries.evicted
    assert 0 < fcu.syncs - syncs <= ex.entries.evicted // 4 + 1   # one device sync per batch of evictions
    # the most recent sizes are the ones kept
    assert EntryKey(sizes[-1], sizes[-1], "f16", "ll16", "sum") in lp.fast


def test_the_collective_apis_staging_is_symmetric_to_the_plans_that_run_on_it(fcu, monkeypatch):
    """Found on a GPU: the collective API's padded staging came from the runtime's pool marked
    internal, so a zero-copy plan staged it a second time (another copy and another collective
    allocation at every growth). It is symmetric to the plans; a plan's own staging is internal."""
    monkeypatch.setenv("MSCCLANG_STAGING_MIN_BYTES", "0")   # growth from the first size on
    cl, comms, exs, cap = _setup(1, fcu)
    ex = exs[0]
    sa, replaced = ex.staging.buffer("io", 1000)
    assert not sa.internal and sa.label == "staging" and not replaced
    assert ex.capture.classify(FakeT(sa.base, 1000)) == ("sym", sa.index)
    assert ex.capture.zero_copy_ok(FakeT(sa.base, 1000), FakeT(sa.base, 1000))
    bigger, replaced = ex.staging.buffer("io", 5000)
    assert bigger.size >= 5000 and replaced and comms[0].released == [sa]
    lp = _lp(stub_plan("allreduce", 1, name="zc1", symmetric=True))
    si, so = ex.staging.get(lp, 1000, 1000)
    assert si.internal and so.internal


def test_the_collective_apis_staging_starts_at_the_floor_so_new_sizes_below_it_allocate_nothing(fcu, monkeypatch):
    """Measured on one GPU: a stream of growing sizes (1.5x apart) allocated staging, a collective
    step with a store exchange, at every other new size. The collective API's staging now starts at
    MSCCLANG_STAGING_MIN_BYTES (at most the cap): every size below it reuses the first buffer;
    above it, growth is in powers of two. A plan's own staging has no floor."""
    monkeypatch.setenv("MSCCLANG_STAGING_MIN_BYTES", "1M")
    cl, comms, exs, cap = _setup(1, fcu)
    ex = exs[0]
    first, _ = ex.staging.buffer("io", 1000)
    assert first.size == MiB
    for n in (1500, 2250, 100_000, MiB):
        got, replaced = ex.staging.buffer("io", n)
        assert got is first and not replaced
    grown, replaced = ex.staging.buffer("io", MiB + 1)
    assert grown.size == 2 * MiB and replaced and comms[0].released == [first]
    lp = _lp(stub_plan("allreduce", 1, name="zc1", symmetric=True))
    si, so = ex.staging.get(lp, 1000, 1000)
    assert (si.size, so.size) == (1024, 1024)
    # the floor never exceeds the cap
    monkeypatch.setenv("MSCCLANG_STAGING_CAP_BYTES", "64K")
    cl, comms, exs, cap = _setup(1, fcu)
    assert exs[0].staging.floor == 64 << 10
    assert exs[0].staging.buffer("io", 1000)[0].size == 64 << 10


def test_a_bound_call_launches_without_resolving_again_until_an_entry_changes(fcu, monkeypatch):
    """The collective API's memo holds what the runtime resolved (Executor.execute's Bound): a memo hit
    launches it with no check, no classification and no entry lookup; any entry dropped or
    replaced since makes it stale (launch_bound says so and nothing is launched)."""
    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    launched = []
    ex.launcher.stream_capturing = lambda s: False
    ex.launcher.launch = lambda ent, a, b, da, db, s, t, epi=None: launched.append((ent.blob, a, b))
    ex.abort = types.SimpleNamespace(dev=0xE0_0000, aborted=False, state=lambda: 0, word=ctypes.c_uint32(0),
                                     user_thread=None)
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 64 * MiB)
    a, b = FakeT(0x7000_0000, 4096), FakeT(0x7800_0000, 4096)
    bound = ex.execute(lp.plan, a, b)
    assert bound is not None and bound.call.in_ptr == a.data_ptr() and bound.call.op == "sum"
    resolves = []
    real = ex.entries.resolve
    monkeypatch.setattr(ex.entries, "resolve", lambda *x, **k: resolves.append(1) or real(*x, **k))
    monkeypatch.setattr(ex, "call", lambda *x, **k: pytest.fail("a bound launch checks nothing again"))
    for _ in range(3):
        assert ex.launch_bound(bound)
    assert resolves == [] and len(launched) == 4 and len({x for x in launched}) == 1
    ex.entries.clear(lp)                       # e.g. the kernel policy changed: entries rebuilt
    assert not ex.launch_bound(bound) and len(launched) == 4


def test_a_bound_launch_makes_its_entry_the_most_recent_every_time(fcu):
    """Entries.touch knows the latest bound call it touched by identity (no key hashed again);
    any resolve in between changes the order, so the next bound launch moves its entry again:
    past the cap the least recently used entry goes, never the bound call's."""
    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    ex.launcher.stream_capturing = lambda s: False
    ex.launcher.launch = lambda *a, **k: None
    ex.abort = types.SimpleNamespace(dev=0xE0_0000, aborted=False, state=lambda: 0, word=ctypes.c_uint32(0),
                                     user_thread=None)
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 64 * MiB)
    ex.entries.cap = 3
    a, b = FakeT(0x7000_0000, 4096), FakeT(0x7800_0000, 4096)
    bound = ex.execute(lp.plan, a, b)
    assert ex.launch_bound(bound) and ex.launch_bound(bound)   # the second: the latest, by identity
    for n in (8192, 16384):                                    # two newer entries: the bound one is oldest
        _resolve(ex, lp, 0x7000_0000, 0x7800_0000, n, n)
    assert ex.launch_bound(bound)                              # the most recent again
    _resolve(ex, lp, 0x7000_0000, 0x7800_0000, 32768, 32768)   # past the cap: one entry evicted
    assert bound.key in lp.fast and EntryKey(8192, 8192, "f16", "ll16", "sum") not in lp.fast
    assert ex.entries.evicted == 1


def test_registered_and_captured_calls_are_never_bound(fcu):
    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    ts = [FakeT(al[r].base, MiB) for r in range(2)]
    cl.run(lambda r: exs[r].capture.register([ts[r]]))
    ex.launcher.stream_capturing = lambda s: cap[0]
    ex.launcher.launch = lambda *a, **k: None
    ex.abort = types.SimpleNamespace(dev=0xE0_0000, aborted=False, state=lambda: 0, word=ctypes.c_uint32(0),
                                     user_thread=None)
    plan = stub_plan("allreduce", 2, name="zc", symmetric=True, inplace=True)
    _ready(ex, ex.load(plan), fcu, MiB)
    assert ex.execute(plan, ts[0], ts[0]) is None   # a registration's uses are counted per call
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 64 * MiB)
    a, b = FakeT(0x7000_0000, 4096), FakeT(0x7800_0000, 4096)
    assert ex.execute(lp.plan, a, b) is not None   # eager, on ordinary tensors: bound
    cap[0] = True
    assert ex.execute(lp.plan, a, b) is None       # inside a capture: resolved at every launch


def test_a_failed_background_build_never_fails_a_call(fcu, monkeypatch):
    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 64 * MiB)
    ex.specialize = "auto"
    builds = _Builds(ex, monkeypatch)
    n = 8192
    for _ in range(2):   # the second call starts the build
        _resolve(ex, lp, 0x7000_0000, 0x7800_0000, n, n)
    builds.futures[0].set_exception(RuntimeError("the build thread died"))
    ent, _ = _resolve(ex, lp, 0x7000_0000, 0x7800_0000, n, n)
    assert ent.spec is None and ent.pending is None        # the interpreter runs it from now on
    assert "RuntimeError: the build thread died" in ex.spec_status(lp.plan)[SpecKey(n, n, "f16", "ll16", "sum")]


def test_a_traced_launch_runs_the_trace_kernel_with_its_buffer_and_decodes_it(fcu, monkeypatch):
    """Executor.execute_traced: the entry's kernel swapped for the interpreter's _trace variant,
    the trace buffer (stride first) handed to the launch, read back and decoded to one event per
    plan op; the untraced launch before and after runs the untraced kernel with no buffer."""
    from mscclang.runtime.trace import record_ops

    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    ex.launcher.stream_capturing = lambda s: False
    ex.launcher.trace_ptr = 0
    ex.abort = types.SimpleNamespace(dev=0xE0_0000, aborted=False, state=lambda: 0, word=ctypes.c_uint32(0),
                                     user_thread=None)
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 64 * MiB)
    real = ex.kernels.interpreter
    monkeypatch.setattr(ex.kernels, "interpreter",
                        lambda dt, pkt, op, nt=1024, traced=False, epi=False: 99 if traced else real(dt, pkt, op, nt))
    monkeypatch.setattr(exmod.cu, "ptr", lambda f: int(f))
    launched = []

    def launch(ent, a, b, da, db, s, t, epi=None):
        tp = ex.launcher.trace_ptr
        launched.append((ent.func, tp))
        if tp:   # what the kernel writes: {start, end} per block and record
            stride = int.from_bytes(fcu.read(tp, 8), "little")
            dp = next(iter(lp.ctx.plans.values()))
            for bi, blk in enumerate(dp.packed.blocks):
                for i, _ in enumerate(record_ops(blk.region)):
                    at = tp + 8 * (1 + bi * stride + 2 * i)
                    fcu.htod(at, (1000 + 100 * i).to_bytes(8, "little") + (1050 + 100 * i).to_bytes(8, "little"))

    ex.launcher.launch = launch
    a, b = FakeT(0x7000_0000, 4096), FakeT(0x7800_0000, 4096)
    ex.execute(lp.plan, a, b)
    rt = ex.execute_traced(lp.plan, a, b)
    events = rt.events
    ex.execute(lp.plan, a, b)
    assert [f for f, _ in launched] == [77, 99, 77] and launched[0][1] == 0 == launched[2][1] and launched[1][1]
    n_ops = sum(len(tb.ops) for tb in lp.plan.gpus[0].threadblocks)
    assert len(events) == n_ops and {e["pid"] for e in events} == {0}
    assert min(e["ts"] for e in events) == 0.0 and all(e["dur"] > 0 for e in events)
    assert ex.launcher.trace_ptr == 0 and launched[1][1] in fcu.freed   # the buffer was freed


def test_a_bound_call_enqueues_its_copies_around_the_kernel_at_every_launch(fcu):
    """The collective API's staging and copy-in: run_call takes the call's Copies (by position
    too: the engine part's order) and enqueues the copies before and after the kernel on the
    launch's stream; the Bound it returns does the same at every launch_bound, with the copy
    functions built once per Copies."""
    from mscclang.plan.call import Copies, Copy

    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    events, built = [], []

    def copier(c):
        built.append(c)
        return lambda s: events.append(("copy", c.dst, c.src, s))

    fcu.copier = copier
    ex.launcher.stream_capturing = lambda s: False
    ex.launcher.current_stream = lambda: 7
    ex.launcher.launch = lambda ent, a, b, da, db, s, t, epi=None: events.append(("kernel", a, b, s))
    ex.abort = types.SimpleNamespace(dev=0xE0_0000, aborted=False, state=lambda: 0, word=ctypes.c_uint32(0),
                                     user_thread=None)
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 64 * MiB)
    a, b = 0x7000_0000, 0x7800_0000
    call = sized_call(lp.plan.collective, 0, 2, dtype_info("float16"), 4096, 4096, "sum", None, a, b)
    copies = Copies((Copy(a, 0x9000_0000, 4096),), (Copy(0x9800_0000, b, 2048, 2, 2048, 2048),))
    bound = ex.run_call(lp, call, "ll16", copies)
    want = [("copy", a, 0x9000_0000, 7), ("kernel", a, b, 7), ("copy", 0x9800_0000, b, 7)]
    assert bound is not None and events == want
    for _ in range(2):
        assert ex.launch_bound(bound)
    assert events == want * 3
    ex.run_call(lp, call, "ll16", copies=copies)   # unbound again: the copy functions are kept
    assert len(built) == 2 and events == want * 4


def test_a_size_whose_kernel_is_building_is_bound_and_its_calls_still_count(fcu, monkeypatch):
    """The 'auto' policy: a bound call of a size whose specialised kernel is wanted launches the
    interpreter's entry and counts the call, so the background build starts at the second call as
    it would through a resolution; once it is built the binding gives itself up (nothing
    launched) and the next run_call binds the specialised entry."""
    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    launched = []
    ex.launcher.stream_capturing = lambda s: False
    ex.launcher.launch = lambda ent, a, b, da, db, s, t, epi=None: launched.append(ent.spec)
    ex.abort = types.SimpleNamespace(dev=0xE0_0000, aborted=False, state=lambda: 0, word=ctypes.c_uint32(0),
                                     user_thread=None)
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 64 * MiB)
    ex.specialize = "auto"
    builds = _Builds(ex, monkeypatch)
    n = 49164
    call = sized_call(lp.plan.collective, 0, 2, dtype_info("float16"), n, n, "sum", None, 0x7000_0000, 0x7800_0000)
    bound = ex.run_call(lp, call, "ll16")
    assert bound is not None and bound.entry.pending is not None and builds.later == []
    assert ex.launch_bound(bound) and len(builds.later) == 1     # the second call starts the build
    assert ex.launch_bound(bound) and launched == [None, None, None]   # still building: the interpreter
    sentinel = types.SimpleNamespace(name="k0")
    monkeypatch.setattr(ex.kernels, "finish", lambda fut: sentinel)
    monkeypatch.setattr(ex.entries, "_spec_launch", lambda sp, dp, ctx: ("launch", sp))
    builds.futures[0].set_result(("src", b"cubin", "nvrtc"))
    assert not ex.launch_bound(bound) and len(launched) == 3    # built: resolve again
    again = ex.run_call(lp, call, "ll16")
    assert again is not None and again.entry.spec == ("launch", sentinel) and again.entry.pending is None
    assert ex.launch_bound(again) and launched[-2:] == [("launch", sentinel)] * 2


def test_a_bound_call_whose_kernel_is_building_asks_torch_nothing(fcu, monkeypatch):
    """launch_bound has just asked the driver whether the stream captures; counting a bound call
    towards its specialised kernel does not ask torch again (a Python round trip of about 2 us
    per call on a GPU host, while the kernel builds)."""
    cl, comms, exs, cap = _setup(2, fcu)
    ex = exs[0]
    ex.launcher.stream_capturing = lambda s: False
    ex.launcher.launch = lambda ent, a, b, da, db, s, t, epi=None: None
    ex.abort = types.SimpleNamespace(dev=0xE0_0000, aborted=False, state=lambda: 0, word=ctypes.c_uint32(0),
                                     user_thread=None)
    lp = ex.load(_any_buffer_plan())
    _ready_any(ex, lp, fcu, 64 * MiB)
    ex.specialize = "auto"
    _Builds(ex, monkeypatch)
    n = 49164
    call = sized_call(lp.plan.collective, 0, 2, dtype_info("float16"), n, n, "sum", None, 0x7000_0000, 0x7800_0000)
    bound = ex.run_call(lp, call, "ll16")
    assert bound is not None and bound.entry.pending is not None
    asked = []
    monkeypatch.setattr(ex, "_capturing", lambda: asked.append(1) or False)
    for _ in range(3):
        assert ex.launch_bound(bound)
    assert bound.entry.pending is not None and asked == []
