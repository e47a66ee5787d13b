"""The torch.distributed fallback of communicators built from a store (no initialised default
group): it builds a group of its own over the store (gloo here; NCCL on GPUs) at the first
fallback call, in every rank alike. Ranks are threads sharing one HashStore, which works because
the fallback's group is not torch.distributed's (process-wide) default group."""

import threading
import types

import pytest
import torch
import torch.distributed as dist

from mscclang.comm import Communicator
from tests.harness import comm_checks as gpu_checks
from mscclang.comm.fallback import TorchFallback
from mscclang.comm.sim_backend import SimWorld
from mscclang.comm.sim_ranks import catalog_of, stub_plan
from mscclang.comm.tuning import TuningTable

N = 2
TIMEOUT = 20.0


def threads(n, fn):
    """``fn(rank)`` on ``n`` threads; results in rank order, the first error re-raised."""
    res, errs = [None] * n, [None] * n

    def body(r):
        try:
            res[r] = fn(r)
        except BaseException as e:  # re-raised below
            errs[r] = e

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(TIMEOUT + 10)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    for e in errs:
        if e is not None:
            raise e
    return res


def data(r, numel, dtype=torch.float32):
    return (torch.arange(numel, dtype=torch.float32) * (r + 1) + 10 * r).to(dtype)


def test_store_built_communicator_runs_every_collective_through_its_own_gloo_group():
    was_initialised = dist.is_initialized()
    store = dist.HashStore()
    k = 5

    def body(r):
        comm = Communicator(store=store, rank=r, world_size=N, device="cpu",
                            fallback=TorchFallback(store=store, rank=r, world_size=N,
                                                   device=torch.device("cpu"), timeout_s=TIMEOUT))
        try:
            assert comm.backend is None  # no GPU runtime: everything falls back
            got = {}
            got["ar"] = comm.all_reduce(data(r, N * k))
            got["ar_max"] = comm.all_reduce(data(r, N * k), op="max", out=torch.empty(N * k))
            got["ag"] = comm.all_gather(data(r, k))
            buf = torch.zeros(N * k)
            buf[r * k:(r + 1) * k] = data(r, k)
            comm.all_gather(buf[r * k:(r + 1) * k], out=buf)
            got["ag_ip"] = buf
            got["rs"] = comm.reduce_scatter(data(r, N * k, torch.int32), op="min")
            t = data(r, N * k)
            comm.reduce_scatter(t, out=t[r * k:(r + 1) * k])
            got["rs_ip"] = t[r * k:(r + 1) * k].clone()
            got["a2a"] = comm.all_to_all(data(r, N * k))
            got["a2a_oop"] = comm.all_to_all(data(r, N * k), out=torch.empty(N * k))
            got["bc"] = comm.broadcast(data(r, k), root=1)
            got["sr"] = comm.send_recv(data(r, k))
            got["mode"] = comm.last.mode
            return got
        finally:
            comm.close()

    res = threads(N, body)
    xs = [data(q, N * k) for q in range(N)]
    for r, got in enumerate(res):
        assert got["mode"] == "nccl"
        assert torch.equal(got["ar"], xs[0] + xs[1])
        assert torch.equal(got["ar_max"], torch.maximum(xs[0], xs[1]))
        want_ag = torch.cat([data(q, k) for q in range(N)])
        assert torch.equal(got["ag"], want_ag) and torch.equal(got["ag_ip"], want_ag)
        xi = [data(q, N * k, torch.int32) for q in range(N)]
        assert torch.equal(got["rs"], torch.minimum(xi[0], xi[1])[r * k:(r + 1) * k])
        assert torch.equal(got["rs_ip"], (xs[0] + xs[1])[r * k:(r + 1) * k])
        want_a2a = torch.cat([x[r * k:(r + 1) * k] for x in xs])
        assert torch.equal(got["a2a"], want_a2a) and torch.equal(got["a2a_oop"], want_a2a)
        assert torch.equal(got["bc"], data(1, k))
        assert torch.equal(got["sr"], data((r - 1) % N, k))
    # the fallback's group is its own: torch.distributed's default group is left alone
    assert dist.is_initialized() == was_initialised


def test_point_to_point_send_recv_through_the_store_group():
    store = dist.HashStore()

    def body(r):
        fb = TorchFallback(store=store, rank=r, world_size=N, device=torch.device("cpu"),
                           timeout_s=TIMEOUT)
        comm = Communicator(store=store, rank=r, world_size=N, device="cpu", fallback=fb)
        if r == 0:
            comm.send(torch.arange(4.0) + 7, dst=1)
            return None
        return comm.recv(torch.zeros(4), src=0)

    assert torch.equal(threads(N, body)[1], torch.arange(4.0) + 7)


def test_fallback_without_group_or_store_says_so():
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("torch.distributed already initialised")
    fb = TorchFallback(rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(Exception, match="initialised process group or a store"):
        fb.all_reduce(torch.ones(2), torch.ones(2), "sum")


def test_gpu_check_fallback_logged_once_runs_on_the_backends_store():
    """What tests/gpu runs in the worker pool (``check_fallback_logged_once``), on the CPU: the
    communicator gets its back end injected (no store argument); the back end's store is where
    the fallback's group comes from. Broadcast from root 1 has no plan: torch.distributed runs
    it, logged once per rank."""
    store = dist.HashStore()
    world = SimWorld(N, engine="reference", timeout=TIMEOUT)
    plans = [stub_plan("broadcast", N, name="bc0", inplace=True, root=0)]

    def body(r):
        be = world.backend(r)
        be.store = store
        comm = Communicator(backend=be, plans=catalog_of(plans), tuning=TuningTable())
        w = types.SimpleNamespace(rank=r, world_size=N, state={"mscclang.comm/True": comm})
        out = gpu_checks.check_fallback_logged_once(w)
        out["plan_calls_before"] = comm.plan_calls   # every call so far fell back
        # a root the plan serves still runs on the plan
        x = torch.full((8,), float(r))
        comm.broadcast(x, root=0)
        out["plan_mode"], out["plan_calls"] = comm.last.mode, comm.plan_calls
        out["x"] = x
        return out

    for r, res in enumerate(threads(N, body)):
        assert res["bad"] == 0 and res["mode"] == "nccl"
        mine = [m for m in res["logged"] if f"rank {r}:" in m]  # threads share the logger
        assert len(mine) == 1 and "broadcast" in mine[0], res["logged"]
        assert res["plan_mode"] == "direct" and torch.equal(res["x"], torch.zeros(8))
        assert (res["plan_calls_before"], res["plan_calls"]) == (0, 1)
    assert world.launches == ["bc0"]


def test_default_group_made_when_a_private_group_cannot_be(monkeypatch):
    """A torch whose back-end classes cannot be built directly: the fallback initialises
    torch.distributed's default group from the store instead (one process, gloo)."""
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("torch.distributed already initialised")

    def broken(self, d):
        raise TypeError("no such constructor")

    monkeypatch.setattr(TorchFallback, "_make_backend", broken)
    fb = TorchFallback(store=dist.HashStore(), rank=0, world_size=1, device=torch.device("cpu"),
                       timeout_s=TIMEOUT)
    try:
        x = torch.arange(3.0)
        out = torch.empty(3)
        fb.all_reduce(x, out, "sum")
        assert torch.equal(out, x) and dist.is_initialized() and fb.own_backend is None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_host_staged_gloo_takes_cuda_tensors_through_host_copies(monkeypatch):
    """Seen on one GPU with two ranks sharing it: the fallback's gloo group was handed CUDA
    tensors for a send, and gloo aborted the process ("writev: Bad address"). When ranks share a
    GPU the fallback (and the backend's inner group) is gloo through host copies."""
    import torch

    from mscclang.comm.fallback import HostStaged, torch_backend_for

    class Dev:   # a stand-in for a CUDA tensor (no GPU here)
        is_cuda = True

        def __init__(self, t):
            self.t = t

        def detach(self):
            return self

        def cpu(self):
            return self.t.clone()

        def copy_(self, h):
            self.t.copy_(h)

    class Work:
        waited = False

        def wait(self):
            Work.waited = True

    seen = []

    class PG:
        def recv(self, tensors, src, tag):
            seen.append([type(t) for t in tensors])
            tensors[0].fill_(7)
            return Work()

    d = Dev(torch.zeros(4))
    w = HostStaged(PG()).recv([d], 1, 0)
    assert seen == [[torch.Tensor]] and not Work.waited   # issued, not waited for (a send never blocks)
    assert torch.equal(d.t, torch.zeros(4))
    assert w.wait() is True
    assert Work.waited and torch.equal(d.t, torch.full((4,), 7.0))
    w.wait()   # a second wait copies nothing again
    monkeypatch.setenv("MSCCLANG_RANKS_PER_GPU", "2")
    assert torch_backend_for("cuda") == "gloo"
    monkeypatch.setenv("MSCCLANG_RANKS_PER_GPU", "1")
    assert torch_backend_for("cuda") == "nccl" and torch_backend_for("cpu") == "gloo"


def test_host_staged_gives_gloo_contiguous_copies_and_writes_back_only_the_outputs():
    """gloo reads a non-contiguous CPU tensor as if it were dense (all_reduce, broadcast, reduce,
    list reduce_scatter, all_to_all_single, scatter: wrong results, no error; found by
    tests/test_distributed_fuzz.py), so every gloo group gets contiguous copies; only the call's
    first argument (torch's process groups take the outputs first) is copied back, so an input
    lying in an output never overwrites the result."""
    from mscclang.comm.fallback import HostStaged

    seen = []

    class PG:
        def reduce_scatter(self, outputs, input_lists, opts):
            seen.append([t.is_contiguous() for t in outputs + input_lists[0]])
            outputs[0].fill_(5)
            input_lists[0][0].fill_(9)   # an input the call must not hand back
            return types.SimpleNamespace(wait=lambda: True)

    wide = torch.zeros(8)
    out, inp = wide[::2], torch.arange(8.0)[::2]
    w = HostStaged(PG()).reduce_scatter([out], [[inp, inp]], None)
    assert seen == [[True, True, True]]
    w.wait()
    assert torch.equal(out, torch.full((4,), 5.0)) and torch.equal(wide[1::2], torch.zeros(4))
    assert torch.equal(inp, torch.arange(8.0)[::2])
    dense = torch.zeros(4)
    assert not isinstance(HostStaged(PG()).reduce_scatter([dense], [[dense, dense]], None), torch.distributed.Work)
