"""The communicator on the CPU: one thread per rank over the reference engine (the collective's
definition) or the simulator, with stub plans. Checks results of every collective, dtype and odd
element counts, in place and out of place, the choice of direct / copy-in / staged paths, the
symmetric-buffer rule, padding to a granule, and the torch.distributed fallback."""

import logging

import pytest
import torch

from mscclang.comm import Communicator, CommError
from mscclang.comm.sim_ranks import run_ranks, stub_plan
from mscclang.comm.tuning import tuning_from_dict

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int32]


def rand(seed, numel, dtype):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int32)
    return torch.randn(numel, generator=g).to(dtype)


def ref_reduce(xs, op="sum"):
    f = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}[op]
    dt = xs[0].dtype
    wide = torch.float32 if dt.is_floating_point else dt
    acc = xs[0].to(wide)
    for x in xs[1:]:
        acc = f(acc, x.to(wide)).to(dt).to(wide)
    return acc.to(dt)


ALL_PLANS = lambda n: [
    stub_plan("allreduce", n, name="ar_oop"), stub_plan("allreduce", n, name="ar_ip", inplace=True),
    stub_plan("allgather", n, name="ag_oop"), stub_plan("allgather", n, name="ag_ip", inplace=True),
    stub_plan("reducescatter", n, name="rs_oop"),
    stub_plan("reducescatter", n, name="rs_ip", inplace=True),
    stub_plan("alltoall", n, name="a2a_oop"), stub_plan("broadcast", n, name="bc", inplace=True, root=0),
    stub_plan("sendrecv", n, name="sr_oop"),
]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 7, 64, 1001])
def test_every_collective_matches_definition(n, dtype, numel):
    def body(comm):
        r = comm.rank
        xs = [rand(100 * p + numel, numel * n, dtype) for p in range(n)]
        res = {}
        # allreduce, out of place and in place
        res["ar"] = comm.all_reduce(xs[r].clone(), out=torch.empty_like(xs[r]))
        t = xs[r].clone()
        comm.all_reduce(t)
        res["ar_ip"] = t
        res["ar_max"] = comm.all_reduce(xs[r].clone(), op="max")
        # allgather: out of place and in place (input = my block of the output)
        small = [x[:numel] for x in xs]
        res["ag"] = comm.all_gather(small[r].clone())
        buf = torch.empty(n * numel, dtype=dtype)
        buf[r * numel:(r + 1) * numel] = small[r]
        comm.all_gather(buf[r * numel:(r + 1) * numel], out=buf)
        res["ag_ip"] = buf
        # reduce-scatter: out of place and in place (output = my block of the input)
        res["rs"] = comm.reduce_scatter(xs[r].clone())
        t = xs[r].clone()
        comm.reduce_scatter(t, out=t[r * numel:(r + 1) * numel])
        res["rs_ip"] = t[r * numel:(r + 1) * numel].clone()
        res["a2a"] = comm.all_to_all(xs[r].clone(), out=torch.empty_like(xs[r]))
        t = xs[r].clone()
        comm.all_to_all(t)
        res["a2a_ip"] = t
        t = xs[r].clone()
        comm.broadcast(t, root=0)
        res["bc"] = t
        res["sr"] = comm.send_recv(xs[r].clone(), out=torch.empty_like(xs[r]))
        return res, xs

    results, world, fb = run_ranks(n, body, plans=ALL_PLANS(n))
    assert fb.calls == []  # every call ran on a plan
    xs = results[0][1]
    full = ref_reduce(xs)
    for r, (res, _) in enumerate(results):
        assert torch.equal(res["ar"], full)
        assert torch.equal(res["ar_ip"], full)
        assert torch.equal(res["ar_max"], ref_reduce(xs, "max"))
        gathered = torch.cat([x[:numel] for x in xs])
        assert torch.equal(res["ag"], gathered)
        assert torch.equal(res["ag_ip"], gathered)
        mine = slice(r * numel, (r + 1) * numel)
        assert torch.equal(res["rs"], ref_reduce([x[mine] for x in xs]))
        assert torch.equal(res["rs_ip"], ref_reduce([x[mine] for x in xs]))
        a2a = torch.cat([xs[p][mine] for p in range(n)])
        assert torch.equal(res["a2a"], a2a)
        assert torch.equal(res["a2a_ip"], a2a)
        assert torch.equal(res["bc"], xs[0])
        assert torch.equal(res["sr"], xs[(r - 1) % n])


def test_paths_direct_copy_in_staged_and_padding():
    n = 2

    def body(comm):
        r = comm.rank
        labels = []
        x = rand(r, 8, torch.float16)
        comm.all_reduce(x.clone(), out=torch.empty_like(x))  # out of place on in-place plan: copy_in
        labels.append(comm.last.mode)
        comm.all_reduce(x.clone())  # in place on in-place plan: direct
        labels.append(comm.last.mode)
        y = rand(r, 7, torch.float16)  # 14 bytes: padded to the 16-byte granule
        got = comm.all_reduce(y.clone())
        labels.append(comm.last.mode)
        return labels, got, y

    results, world, _ = run_ranks(n, body, plans=[stub_plan("allreduce", n, name="ar", inplace=True)],
                                  granule=16)
    for labels, got, _ in results:
        assert labels == ["copy_in", "direct", "staged"]
        assert torch.equal(got, ref_reduce([results[0][2], results[1][2]]))


def test_symmetric_plan_runs_direct_on_comm_empty_and_staged_otherwise():
    n = 2
    plans = [stub_plan("allgather", n, name="ag_zc", symmetric=True)]

    def body(comm):
        r = comm.rank
        modes = []
        inp = comm.empty(5, dtype=torch.float32)
        inp.copy_(torch.arange(5, dtype=torch.float32) + 10 * r)
        out = comm.empty(10, dtype=torch.float32)
        comm.all_gather(inp, out=out)
        modes.append(comm.last.mode)
        assert comm.is_symmetric(out)
        plain = torch.arange(5, dtype=torch.float32) + 10 * r
        res = comm.all_gather(plain)
        modes.append(comm.last.mode)
        return modes, out.clone(), res

    results, _, _ = run_ranks(n, body, plans=plans)
    want = torch.cat([torch.arange(5.0), torch.arange(5.0) + 10])
    for modes, a, b in results:
        assert modes == ["direct", "staged"]
        assert torch.equal(a, want) and torch.equal(b, want)


def test_any_mode_plan_preferred_over_staging_a_zero_copy_plan():
    n = 2
    plans = [stub_plan("allreduce", n, name="zc", symmetric=True, inplace=True),
             stub_plan("allreduce", n, name="scratch", inplace=True)]
    tuning = tuning_from_dict({"format": "mscclang.tuning/1", "rules": [
        {"collective": "allreduce", "world_size": 2, "max_bytes": None,
         "candidates": [{"plan": "zc"}, {"plan": "scratch"}]}]})

    def body(comm):
        x = torch.ones(16)
        comm.all_reduce(x)  # plain tensor: the zero-copy plan is not direct -> 'scratch' direct
        first = comm.last.label()
        s = comm.empty(16, dtype=torch.float32)
        s.fill_(1)
        comm.all_reduce(s)
        return first, comm.last.label(), x, s

    results, world, _ = run_ranks(n, body, plans=plans, tuning=tuning)
    for first, second, x, s in results:
        assert first.startswith("scratch") and "(direct)" in first
        assert second.startswith("zc") and "(direct)" in second
        assert torch.equal(x, torch.full((16,), 2.0)) and torch.equal(s, torch.full((16,), 2.0))
    assert world.launches == ["scratch", "zc"]


def test_fallback_when_no_plan_logged_once(caplog):
    n = 2

    def body(comm):
        outs = []
        for numel in (4, 8, 16):
            x = torch.full((numel,), float(comm.rank + 1))
            outs.append(comm.all_reduce(x))
        # broadcast from a root no plan serves
        t = torch.full((3,), float(comm.rank))
        comm.broadcast(t, root=1)
        outs.append(t)
        return outs

    with caplog.at_level(logging.WARNING, logger="mscclang.comm"):
        results, _, fb = run_ranks(n, body, plans=[stub_plan("broadcast", n, name="bc0", root=0,
                                                             inplace=True)])
    for outs in results:
        for o in outs[:3]:
            assert torch.equal(o, torch.full_like(o, 3.0))
        assert torch.equal(outs[3], torch.full((3,), 1.0))
    assert fb.calls.count("allreduce") == 2 * 3 and fb.calls.count("broadcast") == 2
    msgs = [r.getMessage() for r in caplog.records if "allreduce" in r.getMessage()]
    assert len(msgs) == 2  # once per rank, not once per call
    assert "falls back to torch.distributed" in msgs[0]


def test_fallback_disabled_raises():
    with pytest.raises(CommError, match="fallback is disabled"):
        run_ranks(2, lambda c: c.all_reduce(torch.ones(4)), plans=[], fallback=False, timeout=5)


def test_tuned_nccl_choice_goes_to_fallback():
    n = 2
    tuning = tuning_from_dict({"format": "mscclang.tuning/1", "rules": [
        {"collective": "allreduce", "max_bytes": 64, "candidates": [{"plan": "ar"}]},
        {"collective": "allreduce", "max_bytes": None, "candidates": [{"plan": "nccl"}, {"plan": "ar"}]}]})

    def body(comm):
        comm.all_reduce(torch.ones(16))  # 64 bytes -> plan
        a = comm.last.mode
        comm.all_reduce(torch.ones(17))  # 68 bytes -> nccl
        return a, comm.last.mode

    results, world, fb = run_ranks(n, body, plans=[stub_plan("allreduce", n, name="ar", inplace=True)],
                                   tuning=tuning)
    assert results == [("direct", "nccl")] * 2
    assert fb.calls == ["allreduce"] * 2


def test_size_range_of_plan_respected():
    n = 2
    plans = [stub_plan("allreduce", n, name="small", inplace=True, protocol="LL", max_bytes=1024),
             stub_plan("allreduce", n, name="large", inplace=True, min_bytes=1025)]

    def body(comm):
        comm.all_reduce(torch.ones(256))  # 1024 bytes
        a = comm.last.variant.key
        comm.all_reduce(torch.ones(257))
        return a, comm.last.variant.key

    results, _, _ = run_ranks(n, body, plans=plans)
    assert results == [("small", "large")] * 2


@pytest.mark.parametrize("call,msg", [
    (lambda c: c.all_gather(torch.ones(3), out=torch.empty(5)), "output of 2 x 3"),
    (lambda c: c.all_reduce(torch.ones(4), out=torch.empty(4, dtype=torch.float16)), "dtype"),
    (lambda c: c.all_reduce(torch.ones(4, dtype=torch.float64)), "which mscclang does not run"),
    (lambda c: c.all_reduce(torch.ones(4, 4).t()), "contiguous"),
    (lambda c: c.all_reduce(torch.ones(4), op="prod"), "unsupported reduce op"),
    (lambda c: c.broadcast(torch.ones(4), root=5), "root 5"),
    (lambda c: c.reduce_scatter(torch.ones(5)), "divisible"),
    (lambda c: c.send(torch.ones(4), dst=c.rank), "not another rank"),
])
def test_misuse_raises_comm_error(call, msg):
    def body(comm):
        try:
            call(comm)
        except CommError as e:
            return str(e)
        return None

    results, _, _ = run_ranks(2, body, plans=ALL_PLANS(2), timeout=5)
    for m in results:
        assert m is not None and msg in m


def test_overlapping_non_inplace_layout_rejected():
    def body(comm):
        buf = torch.zeros(9)
        with pytest.raises(CommError, match="in-place layout"):
            comm.all_gather(buf[1:5], out=buf[:8])  # neither rank's block of the output
        with pytest.raises(CommError, match="overlap"):
            comm.all_reduce(buf[:8], out=buf[1:9])
        return True

    assert run_ranks(2, body, plans=ALL_PLANS(2), timeout=5)[0] == [True, True]


def test_zero_elements_is_a_no_op():
    results, world, fb = run_ranks(2, lambda c: c.all_reduce(torch.ones(0)).numel(), plans=ALL_PLANS(2))
    assert results == [0, 0] and world.launches == [] and fb.calls == []


def test_prepare_allocates_staging_without_launching():
    def body(comm):
        x = torch.ones(7, dtype=torch.float16)
        cp = comm.prepare("all_reduce", x)
        return cp.mode, comm.backend.launch.prepared

    results, world, _ = run_ranks(2, body, plans=[stub_plan("allreduce", 2, name="ar", inplace=True)],
                                  granule=16)
    assert results == [("staged", ["ar"])] * 2 and world.launches == []


def test_constructor_needs_initialised_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - another test initialised it
        pytest.skip("torch.distributed already initialised")
    with pytest.raises(CommError, match="not initialised"):
        Communicator()
    with pytest.raises(CommError, match="rank and world_size"):
        Communicator(store=object())


def test_cpu_communicator_from_store_falls_back_to_gloo(tmp_path):
    """No GPU: a store-built communicator has no runtime and runs everything through
    torch.distributed (here gloo, one process)."""
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("torch.distributed already initialised")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    comm = Communicator(store=store, rank=0, world_size=1, device="cpu")
    try:
        assert comm.backend is None
        x = torch.arange(4.0)
        comm.all_reduce(x)
        assert torch.equal(x, torch.arange(4.0)) and comm.last.mode == "nccl"
        assert "no GPU runtime" in comm.last.reason
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_sizes_the_runtime_cannot_run_are_padded_up_front():
    """The runtime is asked before the call (LaunchPart.fits), never taught by a refusal."""
    n = 2

    def body(comm):
        r = comm.rank
        outs, modes = [], []
        for _ in range(2):
            x = torch.arange(7, dtype=torch.float16) + 100 * r
            outs.append(comm.all_gather(x))
            modes.append(comm.last.mode)
        return outs, modes

    results, world, fb = run_ranks(n, body, plans=[stub_plan("allgather", n, name="ag", protocol="LL")],
                                   refuse_unaligned=16)
    want = torch.cat([torch.arange(7, dtype=torch.float16), torch.arange(7, dtype=torch.float16) + 100])
    for outs, modes in results:
        assert modes == ["staged", "staged"]
        assert all(torch.equal(o, want) for o in outs)
    assert world.refusals == 0  # asked up front: the runtime never had to refuse
    assert fb.calls == []


def test_a_memo_hit_and_a_fresh_plan_choose_alike():
    """Found from outside: one rank reused a tensor's address (a memo hit) while the other got a
    fresh tensor (planned again), and the ranks launched different plans, because the memo held a
    plan learnt from the runtime's refusal. Whatever the memo holds, planning again gives the same
    plan."""
    from mscclang.comm.catalog import Catalog, default_plans_dir
    from mscclang.comm.tuning import load_tuning

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")

    def body(comm):
        keep = torch.ones(6150, dtype=torch.bfloat16)
        labels = []
        for k in range(3):
            x = keep if comm.rank == 0 else torch.ones(6150 + 0 * k, dtype=torch.bfloat16).clone()
            comm.reduce_scatter(x)
            labels.append(comm.last.label())
        return labels

    results, world, fb = run_ranks(n := 2, body, catalog=Catalog.from_dir(folder), tuning=load_tuning(),
                                   engine="sim", refuse_unaligned=16)
    assert results[0] == results[1] and len(set(results[0])) == 1, results
    assert world.refusals == 0 and fb.calls == [] and n == 2


def _rules(coll, *cands):
    return tuning_from_dict({"format": "mscclang.tuning/1", "rules": [
        {"collective": coll, "candidates": [{"plan": c} for c in cands]}]})


def test_staged_plan_listed_before_nccl_wins_over_the_fallback():
    """Regression (GPU run 1): blocks not a multiple of the granule made every listed plan need
    staging, and the rule's trailing "nccl" was taken instead; with the fallback disabled the
    call failed. A plan listed before "nccl" runs (staged)."""
    n = 2
    plans = [stub_plan("allgather", n, name="ag_zc", symmetric=True), stub_plan("allgather", n, name="ag")]

    def body(comm):
        x = torch.arange(7, dtype=torch.float16) + 10 * comm.rank  # 14-byte blocks, granule 16
        out = comm.all_gather(x)
        return comm.last.label(), out

    for fallback in (True, False):
        results, world, fb = run_ranks(n, body, plans=plans, granule=16, fallback=fallback,
                                       tuning=_rules("allgather", "ag_zc", "ag", "nccl"))
        want = torch.cat([torch.arange(7, dtype=torch.float16) + 10 * q for q in range(n)])
        for label, out in results:
            assert label == "ag_zc (staged)" and torch.equal(out, want)
        assert fb.calls == [] and world.launches == ["ag_zc"]


def test_nccl_choice_skipped_when_the_fallback_is_disabled():
    n = 2

    def body(comm):
        comm.all_reduce(torch.ones(16))
        return comm.last.label()

    results, world, _ = run_ranks(n, body, plans=[stub_plan("allreduce", n, name="ar", inplace=True)],
                                  tuning=_rules("allreduce", "nccl", "ar"), fallback=False)
    assert results == ["ar (direct)"] * n and world.launches == ["ar"]


def test_catalog_variants_tried_when_no_listed_plan_can_run():
    """The rule's only plan cannot take the padded size (its range ends below it): another
    variant of the catalog runs instead of the fallback."""
    n = 2
    plans = [stub_plan("allgather", n, name="small", max_bytes=60), stub_plan("allgather", n, name="other")]

    def body(comm):
        x = torch.arange(15, dtype=torch.float16)  # output 60 bytes; padded blocks: 64 bytes
        comm.all_gather(x)
        return comm.last.label()

    for fallback in (True, False):
        results, world, fb = run_ranks(n, body, plans=plans, granule=16, fallback=fallback,
                                       tuning=_rules("allgather", "small"))
        assert results == ["other (staged)"] * n and fb.calls == [] and world.launches == ["other"]


def test_the_runtime_is_asked_only_about_the_way_a_call_runs():
    """Found on a GPU: asking the runtime whether every candidate fits packed each candidate's plan
    at the new size (milliseconds of host work per candidate); now only the way the call will run is
    asked about, and the answer's packing is the one the launch reuses."""
    from mscclang.comm.catalog import Catalog, default_plans_dir
    from mscclang.comm.tuning import load_tuning

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")

    def body(comm):
        asked = []
        real = comm.backend.launch.fits
        comm.backend.launch.fits = lambda plan, a, b, pt=None: asked.append(plan.name) or real(plan, a, b, pt)
        out = []
        for numel in (300_000, 700_001, 20_000):
            x = torch.ones(numel, dtype=torch.bfloat16)
            comm.all_reduce(x)
            out.append((comm.last.label(), list(asked)))
            asked.clear()
        return out

    results, world, fb = run_ranks(2, body, catalog=Catalog.from_dir(folder), tuning=load_tuning(), engine="sim")
    for label, asked in results[0]:
        assert 1 <= len(asked) <= 2 and label.split(" ")[0] in asked, (label, asked)
    assert results[0] == results[1]


def test_close_always_returns_and_says_what_it_left(caplog):
    """Found on a GPU: after a peer died, close() raised (a dead peer's mapping could not be
    closed, from a thread with no current context). It logs and returns."""
    from mscclang.comm.sim_backend import SimWorld

    def failing() -> None:
        raise RuntimeError("cuIpcCloseMemHandle failed: CUDA_ERROR_INVALID_CONTEXT")

    from mscclang.comm.sim_ranks import catalog_of
    from mscclang.comm.tuning import TuningTable

    be = SimWorld(1).backend(0)
    be.close = failing
    comm = Communicator(backend=be, plans=catalog_of([]), tuning=TuningTable(), fallback=False)
    with caplog.at_level("WARNING", logger="mscclang.comm"):
        comm.close()
    assert comm.backend is None and "CUDA_ERROR_INVALID_CONTEXT" in caplog.text
    comm.close()   # twice is fine


def test_a_memo_hit_launches_what_the_engine_bound():
    """A memo hit hands the engine's own resolution back (LaunchPart.launch_bound): nothing is
    checked, classified or looked up again below the memo; a stale binding (False) falls back to
    execute, whose new binding the memo keeps."""
    from types import SimpleNamespace

    def body(comm):
        be = comm.backend
        seen = []
        real_execute = be.launch.run_call

        def execute(*a, **k):
            seen.append("execute")
            real_execute(*a, **k)
            return SimpleNamespace(n=len(seen))

        be.launch.run_call = execute
        answers = iter([True, False, True])
        be.launch.launch_bound = lambda bound: seen.append(f"bound {bound.n}") or next(answers)
        x = torch.arange(8, dtype=torch.float32)
        comm.all_reduce(x)        # planned, executed: the binding kept
        comm.all_reduce(x)        # memo hit: the binding
        comm.all_reduce(x)        # the binding is stale: executed, bound again
        comm.all_reduce(x)        # the new binding
        return seen

    results, world, fb = run_ranks(2, body, plans=[stub_plan("allreduce", 2, name="ar", protocol="LL",
                                                             inplace=True)])
    for seen in results:
        assert seen == ["execute", "bound 1", "bound 1", "execute", "bound 4"], seen


@pytest.mark.parametrize("n", [2, 4])
def test_broadcast_from_any_root_runs_a_shipped_plan(n):
    """Found from outside: broadcast(x, root=1) on 2 ranks always fell back to torch.distributed
    ("no plan for broadcast ..."): only root-0 plans shipped. Every root has plans now."""
    from mscclang.comm.catalog import Catalog, default_plans_dir
    from mscclang.comm.tuning import load_tuning

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")

    def body(comm):
        seen = []
        for root in range(n):
            for numel in (5, 3000, 70_001):
                t = torch.full((numel,), float(comm.rank + 1))
                comm.broadcast(t, root=root)
                assert torch.equal(t, torch.full((numel,), float(root + 1))), (root, numel)
                seen.append((root, comm.last.mode, comm.last.label()))
        return seen

    results, world, fb = run_ranks(n, body, catalog=Catalog.from_dir(folder), tuning=load_tuning(), engine="sim")
    assert fb.calls == []
    for seen in results:
        assert all(mode != "nccl" and f"root{root}" in label for root, mode, label in seen), seen


def test_a_staged_or_copy_in_memo_hit_reuses_its_call_on_the_plans_buffers(monkeypatch):
    """The call on the staging buffers (or the input's place in the output) is made at the first
    run and reused by every memo hit: the same buffers each time, so nothing is rebuilt."""
    from mscclang.plan.call import Call

    made = []
    real = Call.on
    monkeypatch.setattr(Call, "on", lambda self, a, b, inplace: (made.append(1), real(self, a, b, inplace))[1])
    n = 2

    def body(comm):
        r = comm.rank
        x, out = rand(r, 8, torch.float16), torch.empty(8, dtype=torch.float16)
        y = rand(r, 7, torch.float16)                          # 14 bytes: staged, padded to the granule
        z = torch.empty_like(y)
        got = []
        for _ in range(3):
            comm.all_reduce(x, out=out)                         # copy_in
            m1 = comm.last.mode
            z.copy_(y)
            got.append((m1, out.clone(), comm.all_reduce(z).clone(), comm.last.mode))
        return got, x, y

    results, _, _ = run_ranks(n, body, plans=[stub_plan("allreduce", n, name="ar", inplace=True)], granule=16)
    for got, _, _ in results:
        for m1, o, s, m2 in got:
            assert (m1, m2) == ("copy_in", "staged")
            assert torch.equal(o, ref_reduce([results[0][1], results[1][1]]))
            assert torch.equal(s, ref_reduce([results[0][2], results[1][2]]))
    assert len(made) == 2 * n                                   # one per path and rank, not one per call


def test_a_memo_hit_launches_the_bound_call_with_its_copies(monkeypatch):
    """Every memo hit of a call the engine bound (direct, copy_in and staged alike, an ordinary
    tensor's call included while the automatic registration is off) launches the binding: the
    engine resolves each call once, and the copies around the kernel run at every launch."""
    from mscclang.comm.sim_backend import SimLaunch

    runs, bound = [], []
    real_run, real_bound = SimLaunch.run_call, SimLaunch.launch_bound
    monkeypatch.setattr(SimLaunch, "run_call", lambda self, *a, **k: (runs.append(1), real_run(self, *a, **k))[1])
    monkeypatch.setattr(SimLaunch, "launch_bound", lambda self, b: (bound.append(1), real_bound(self, b))[1])
    n, calls = 2, 4

    def body(comm):
        r = comm.rank
        x, out = rand(r, 8, torch.float16), torch.empty(8, dtype=torch.float16)
        y = rand(r, 7, torch.float16)                          # 14 bytes: staged, padded to the granule
        z, w = torch.empty_like(y), rand(r, 16, torch.float16)
        v = torch.empty_like(w)
        got = []
        for i in range(calls):
            x.add_(i)   # new values at every call: the copies run at every launch
            comm.all_reduce(x, out=out)                         # copy_in
            m1 = comm.last.mode
            z.copy_(y + i)
            s = comm.all_reduce(z).clone()
            m2 = comm.last.mode
            v.copy_(w + i)
            got.append((m1, m2, x.clone(), y + i, out.clone(), s, v.clone(), comm.all_reduce(v).clone(), comm.last.mode))
        return got

    results, _, _ = run_ranks(n, body, plans=[stub_plan("allreduce", n, name="ar", inplace=True)], granule=16)
    for i in range(calls):
        rows = [res[i] for res in results]
        assert {(r[0], r[1], r[8]) for r in rows} == {("copy_in", "staged", "direct")}
        for k, (src, dst) in enumerate([(2, 4), (3, 5), (6, 7)]):
            want = ref_reduce([r[src] for r in rows])
            assert all(torch.equal(r[dst], want) for r in rows), (i, k)
    assert len(runs) == 3 * n                                  # one resolution per path and rank
    assert len(bound) == 3 * n * (calls - 1)                   # every later call launches the binding
