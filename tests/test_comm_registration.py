"""The collective API with registered ordinary tensors and the staging cap, on the CPU (one
thread per rank over the reference engine, the GPU runtime's Registry underneath). The world
checks that every rank runs the same plan on the same registration and that every peer address a
rank would use is exactly where that peer's tensor lives."""

from __future__ import annotations

import logging

import pytest
import torch

from mscclang.comm.tuning import tuning_from_dict
from mscclang.comm.sim_ranks import run_ranks, stub_plan

N = 2



@pytest.fixture(autouse=True)
def _designed_defaults(monkeypatch):
    """These tests cover the designed behaviour (auto registration, 128 MiB staging cap), which
    the release keeps off until GPU tests have run on it."""
    monkeypatch.setenv("MSCCLANG_REGISTER", "auto")
    monkeypatch.setenv("MSCCLANG_STAGING_CAP_BYTES", str(128 << 20))

def _tuning(*cands, coll="allreduce"):
    return tuning_from_dict({"format": "mscclang.tuning/1", "rules": [
        {"collective": coll, "world_size": N, "max_bytes": None, "candidates": [{"plan": c} for c in cands]}]})


PLANS = [stub_plan("allreduce", N, name="zc", symmetric=True, inplace=True),
         stub_plan("allreduce", N, name="scratch", inplace=True)]
TUNING = _tuning("zc", "scratch")


def _x(r, n=256, seed=0):
    g = torch.Generator().manual_seed(seed * 10 + r)
    return torch.randint(-50, 50, (n,), generator=g).float()


def test_explicitly_registered_tensors_run_the_zero_copy_plan_directly():
    def body(comm):
        x = _x(comm.rank)
        comm.all_reduce(x)
        before = comm.last.label()
        assert comm.register(x) == [True]
        y = _x(comm.rank, seed=1)
        x.copy_(y)
        comm.all_reduce(x)
        return before, comm.last.label(), x.clone()

    results, world, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="explicit")
    want = _x(0, seed=1) + _x(1, seed=1)
    for before, after, got in results:
        assert before == "scratch (direct)" and after == "zc (direct)"
        assert torch.equal(got, want)
    assert world.launches == ["scratch", "zc"]


def test_auto_registers_at_the_first_call_and_repeated_calls_need_no_exchange():
    def body(comm):
        x = _x(comm.rank)
        labels = []
        for i in range(5):
            x.copy_(_x(comm.rank, seed=i))
            comm.all_reduce(x)
            labels.append(comm.last.label())
        return labels, x.clone()

    results, world, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="auto")
    for labels, got in results:
        assert labels == ["zc (direct)"] * 5
        assert torch.equal(got, _x(0, seed=4) + _x(1, seed=4))
    # one registration (its exchange and its mapping agreement) per rank, none per call after it
    assert len([t for r, t in world.exchanges if r == 0]) == 2
    assert world.launches == ["zc"] * 5


def test_fresh_tensors_register_on_a_doubling_schedule_and_never_match_a_reused_address():
    """A new tensor at an address a dead registered one had is not registered: it is staged or
    run on the any-buffer plan, alike on every rank, and registered again only at calls 1, 2, 4, 8."""
    calls = 9

    def body(comm):
        labels, classes, outs = [], [], []
        for i in range(calls):
            x = _x(comm.rank, seed=i)            # a new storage every call (the old one is freed)
            classes.append(comm.backend.registry.classify(x))
            comm.all_reduce(x)
            labels.append(comm.last.label())
            outs.append(x.clone())
            del x
        return labels, classes, outs

    results, world, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="auto")
    for labels, classes, outs in results:
        assert classes == [None] * calls   # a reused address never inherits a registration
        registered_at = {0, 1, 3, 7}
        assert labels == ["zc (direct)" if i in registered_at else "scratch (direct)" for i in range(calls)]
        for i, o in enumerate(outs):
            assert torch.equal(o, _x(0, seed=i) + _x(1, seed=i))
    assert len([t for r, t in world.exchanges if r == 0]) == 2 * 4


def test_tensors_a_rank_cannot_export_are_staged_on_every_rank_logged_once(caplog):
    def body(comm):
        labels = []
        x = _x(comm.rank)
        for i in range(3):
            comm.all_reduce(x)
            labels.append(comm.last.label())
        return labels, comm.register(x), x

    with caplog.at_level(logging.WARNING):
        results, world, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="auto",
                                      unexportable=lambda rank, ptr: rank == 1)
    for labels, ok, x in results:
        assert labels == ["scratch (direct)"] * 3 and ok == [False]
    assert torch.equal(results[0][2], results[1][2])
    assert sum("cannot be registered" in m for m in caplog.messages) == 1
    assert set(world.launches) == {"scratch"}


def test_prepare_registers_the_tensors_of_the_call_it_prepares():
    def body(comm):
        x = _x(comm.rank)
        cp = comm.prepare("all_reduce", x)
        comm.all_reduce(x)
        return cp.label(), comm.last.label(), comm.backend.launch.prepared

    results, world, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="explicit")
    for prepared, ran, names in results:
        assert prepared == ran == "zc (direct)" and names == ["zc"]


def test_register_off_keeps_the_old_behaviour():
    def body(comm):
        x = _x(comm.rank)
        ok = comm.register(x)
        comm.prepare("all_reduce", x)
        comm.all_reduce(x)
        return ok, comm.last.label()

    results, world, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="off")
    assert results == [([False], "scratch (direct)")] * N
    assert world.exchanges == []


def test_out_of_place_and_in_place_allgather_on_registered_tensors():
    plans = [stub_plan("allgather", N, name="ag_zc", symmetric=True),
             stub_plan("allgather", N, name="ag_zc_ip", symmetric=True, inplace=True)]
    tuning = _tuning("ag_zc", "ag_zc_ip", coll="allgather")

    def body(comm):
        r = comm.rank
        inp = torch.arange(8.0) + 100 * r
        out = torch.zeros(8 * N)
        comm.all_gather(inp, out=out)              # registers both (auto), then runs zero-copy
        oop = comm.last.label()
        buf = torch.zeros(8 * N)
        buf[8 * r:8 * (r + 1)] = torch.arange(8.0) + 100 * r
        comm.all_gather(buf[8 * r:8 * (r + 1)], out=buf)   # registers buf; the input lies inside it
        return oop, comm.last.label(), out, buf

    results, world, _ = run_ranks(N, body, plans=plans, tuning=tuning, register="auto")
    want = torch.cat([torch.arange(8.0) + 100 * q for q in range(N)])
    for oop, ip, out, buf in results:
        assert oop == "ag_zc (direct)" and ip == "ag_zc_ip (direct)"
        assert torch.equal(out, want) and torch.equal(buf, want)


def test_deregister_returns_the_call_to_the_any_buffer_plan():
    def body(comm):
        x = _x(comm.rank)
        comm.register(x)
        comm.all_reduce(x)
        a = comm.last.label()
        assert comm.deregister(x) == 1
        comm.all_reduce(x)
        return a, comm.last.label()

    results, _, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="explicit")
    assert results == [("zc (direct)", "scratch (direct)")] * N


def test_register_checks_its_arguments():
    from mscclang.comm import CommError

    def body(comm):
        with pytest.raises(CommError, match="contiguous"):
            comm.register(torch.zeros(8, 2).t())
        with pytest.raises(CommError, match="torch tensor"):
            comm.register([1, 2])
        return comm.register()

    results, _, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="explicit")
    assert results == [[]] * N


# ------------------------------------------------------------------------------------------
# the staging cap

ZC_ONLY = [stub_plan("allreduce", N, name="zc", symmetric=True, inplace=True)]


def test_staging_above_the_cap_is_released_after_each_call():
    cap = 1024

    def body(comm):
        be = comm.backend
        outs = []
        held = []
        for i in range(3):
            x = _x(comm.rank, n=1024, seed=i)    # 4 KiB: above the cap
            comm.all_reduce(x)
            outs.append(x)
            held.append(be.memory.comm.memory()["staging"])
        small = _x(comm.rank, n=64)               # 256 B: under the cap, kept
        comm.all_reduce(small)
        return held, outs, be.memory.comm.released, be.memory.comm.memory()["staging"], comm.last.label(), comm.memory()

    results, world, _ = run_ranks(N, body, plans=ZC_ONLY, tuning=_tuning("zc"), register="off", staging_cap=cap)
    for held, outs, released, after, label, mem in results:
        assert held == [0, 0, 0]
        assert released == [4096, 4096, 4096]
        assert after == 256 and label == "zc (staged)"
        assert mem["staging_cap"] == cap and mem["staging"] == 256
        for i, o in enumerate(outs):
            assert torch.equal(o, _x(0, n=1024, seed=i) + _x(1, n=1024, seed=i))
    releases = [t for r, t in world.exchanges if r == 0]
    assert releases == ["release 1 staging buffer(s)"] * 3


def test_outgrown_staging_is_released_and_prepare_keeps_staging_above_the_cap():
    def body(comm):
        be = comm.backend
        comm.all_reduce(_x(comm.rank, n=64))      # 256 B staging
        comm.all_reduce(_x(comm.rank, n=200))     # grows to 1 KiB: the 256 B buffer is released
        grown = list(be.memory.comm.released)
        x = _x(comm.rank, n=1024)
        comm.prepare("all_reduce", x)             # 4 KiB, above the cap: prepare keeps it
        comm.all_reduce(x)
        comm.all_reduce(x)
        return grown, list(be.memory.comm.released), be.memory.comm.memory()["staging"], x

    results, _, _ = run_ranks(N, body, plans=ZC_ONLY, tuning=_tuning("zc"), register="off", staging_cap=2048)
    for grown, released, held, x in results:
        assert grown == [256] and released == [256]
        assert held == 1024 + 4096
    assert torch.equal(results[0][3], results[1][3])


def test_memory_report_counts_registrations():
    def body(comm):
        x = _x(comm.rank)
        comm.register(x)
        return comm.memory()

    results, _, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="explicit")
    for mem in results:
        assert mem["registrations"] == 1 and mem["peer_mappings"] == 1
        assert "peer_mapped_bytes" in mem and mem["total_bytes"] == mem["staging"]


def test_the_world_catches_a_wrong_peer_address():
    """The check the tests above rely on is live: a registration whose peer address is off by
    one element is refused before anything is computed."""
    from mscclang.comm import CommError

    def body(comm):
        x = _x(comm.rank)
        comm.register(x)
        if comm.rank == 0:
            reg = comm.backend.registry.registry.lookup(x.data_ptr(), x.numel() * 4)
            reg.peer_bases[1] += 4
        comm.all_reduce(x)

    with pytest.raises(CommError, match="would reach rank 1's registered input"):
        run_ranks(N, body, plans=PLANS, tuning=TUNING, register="explicit")


def test_ranks_passing_tensors_that_do_not_correspond_fail_loudly():
    """Outside the SPMD contract (rank 0 passes its registered tensor, rank 1 a new one) the
    ranks choose different plans: an error, not a wrong result."""
    from mscclang.comm import CommError

    def body(comm):
        x = _x(comm.rank)
        comm.register(x)
        comm.all_reduce(x if comm.rank == 0 else _x(comm.rank))

    with pytest.raises(CommError, match="different plans"):
        run_ranks(N, body, plans=PLANS, tuning=TUNING, register="explicit")


def test_staging_of_a_prepared_call_survives_a_larger_call_and_its_memo_entry_too():
    """prepare(small); a larger staged call grows the staging: the prepared call's buffer (which
    a capture of it would use) is kept, and the call still runs on it."""
    def body(comm):
        be = comm.backend
        small = _x(comm.rank, n=64)
        cp = comm.prepare("all_reduce", small)
        buf = cp.inp.data_ptr()
        comm.all_reduce(_x(comm.rank, n=200))     # grows the staging
        small.copy_(_x(comm.rank, n=64, seed=3))
        comm.all_reduce(small)
        return list(be.memory.comm.released), comm.last.inp.data_ptr() == buf, small

    results, _, _ = run_ranks(N, body, plans=ZC_ONLY, tuning=_tuning("zc"), register="off", staging_cap=2048)
    for released, same, small in results:
        assert released == [] and same
        assert torch.equal(small, _x(0, n=64, seed=3) + _x(1, n=64, seed=3))


def test_reused_tensors_of_one_signature_all_get_registered():
    """One buffer per 'layer', all of one signature: after the second pass shows reuse, every
    buffer is registered, so the third pass runs zero-copy throughout (the doubling schedule alone
    would leave most of them on the any-buffer plan)."""
    layers = 6

    def body(comm):
        bufs = [_x(comm.rank, seed=k) for k in range(layers)]
        passes = []
        for _ in range(3):
            labels = []
            for b in bufs:
                comm.all_reduce(b)
                labels.append(comm.last.label())
            passes.append(labels)
        return passes

    results, world, _ = run_ranks(N, body, plans=PLANS, tuning=TUNING, register="auto")
    for passes in results:
        assert passes[0] == ["zc (direct)", "zc (direct)", "scratch (direct)", "zc (direct)",
                             "scratch (direct)", "scratch (direct)"]
        assert passes[2] == ["zc (direct)"] * layers
    assert results[0] == results[1]


def test_staging_allocated_before_an_auto_registration_is_released():
    """Regression (found reading the 2x H200 registration failure, session 5): the first call of
    a signature planned a staged run (above the cap: a temporary staging buffer, allocated at
    once), then registered its tensors and ran zero-copy; the staged plan stayed in the memo with
    its temporary buffer, never released (a leak of the call's size, per signature). It is
    released as soon as the registration makes the staged plan moot."""
    cap = 1024

    def body(comm):
        be = comm.backend
        x = _x(comm.rank, n=1024)   # 4 KiB: above the cap
        comm.all_reduce(x)
        first = comm.last.label()
        held = be.memory.comm.memory()["staging"]
        y = _x(comm.rank, n=1024, seed=1)
        x.copy_(y)
        comm.all_reduce(x)
        z = _x(comm.rank, n=2048)   # prepare registers too
        cp = comm.prepare("all_reduce", z)
        return (first, held, list(be.memory.comm.released), comm.last.label(), comm.memory(), x.clone(), cp.label(),
                be.memory.comm.memory()["staging"])

    results, world, _ = run_ranks(N, body, plans=ZC_ONLY, tuning=_tuning("zc"), register="auto", staging_cap=cap)
    want = _x(0, n=1024, seed=1) + _x(1, n=1024, seed=1)
    for first, held, released, second, mem, got, prepared, after in results:
        assert first == "zc (direct)" and second == "zc (direct)"
        assert held == 0 and released[:1] == [4096], (held, released)
        assert mem["staging"] == 0
        assert torch.equal(got, want)
        assert prepared == "zc (direct)" and after == 0 and released == [4096, 8192], (released, after)
