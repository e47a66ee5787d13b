"""``Communicator.trace()`` on the CPU: the calls inside the block run through the engine's traced
launch (here a stand-in on the simulator's back end that returns a trace as the GPU would), the
fallback's calls are listed as untraced, leaving the block puts the ranks on one time base over
the store, and without traced kernels the call says what to use instead."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from mscclang.comm.sim_ranks import run_ranks
from mscclang.errors import RuntimeUnavailable
from mscclang.runtime.trace import RankTrace


def _traced_engine(comm, store, t0_ns):
    """Make ``comm``'s simulator back end trace: it runs the call, then reports one 2 us event
    per op of the plan starting at ``t0_ns`` (+10 us per call), as a traced kernel would."""
    b = comm.backend
    calls = []

    def trace(plan, call, packet_type=None, copies=None):
        b.launch.run_call(plan, call, packet_type, copies)
        ops = [(tb.id, i, op) for tb in plan.gpus[b.rank].threadblocks for i, op in enumerate(tb.ops)]
        ev = [{"name": op.name.value, "ph": "X", "pid": b.rank, "tid": tid, "ts": 2.0 * k, "dur": 2.0,
               "args": {"op": op.name.value, "index": i}} for k, (tid, i, op) in enumerate(ops)]
        calls.append(plan.name)
        return RankTrace(b.rank, t0_ns + 10_000 * (len(calls) - 1), ev, [])

    b.launch.traces = True
    b.launch.trace = trace
    b.store = store
    return calls


def _allreduce_plan():
    from pathlib import Path

    from mscclang.plan.io import load_plan

    return load_plan(Path(__file__).resolve().parents[1] / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json")


def test_calls_inside_the_block_are_traced_on_one_time_base(tmp_path):
    store = dist.HashStore()

    def fn(comm):
        calls = _traced_engine(comm, store, 1_000_000 + 3_000 * comm.rank)
        x = torch.arange(256, dtype=torch.float32) + comm.rank
        comm.all_reduce(x.clone())   # outside: not traced
        with comm.trace() as tr:
            y = comm.all_reduce(x.clone())
            z = comm.all_reduce(x[:64].clone())
            g = comm.all_gather(x.clone())   # no allgather plan here: the fallback, untraced
        comm.all_reduce(x.clone())   # after: not traced
        tr.save(tmp_path / f"rank{comm.rank}.json")
        return tr, calls, y, g

    res, _, _ = run_ranks(2, fn, engine="sim", plans=[_allreduce_plan()])
    expect = (torch.arange(256, dtype=torch.float32) * 2 + 1)
    for r, (tr, calls, y, g) in enumerate(res):
        assert torch.equal(y, expect) and g.numel() == 512
        assert len(calls) == 2 and [c.collective for c in tr.calls] == ["allreduce", "allreduce"]
        assert [c.nbytes for c in tr.calls] == [1024, 256]
        assert tr.skipped == ["allgather (torch.distributed fallback)"]
        assert tr.base_ns == 1_000_000 and tr.problems == []
        ev = tr.events
        assert {e["args"]["call"] for e in ev} == {0, 1} and {e["pid"] for e in ev} == {r}
        first = min(e["ts"] for e in ev if e["args"]["call"] == 0)
        assert first == pytest.approx(3.0 * r)            # rank 1 started 3 us after rank 0
        second = min(e["ts"] for e in ev if e["args"]["call"] == 1)
        assert second == pytest.approx(3.0 * r + 10.0)
        saved = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert len([e for e in saved["traceEvents"] if e["ph"] == "X"]) == len(ev)


def test_without_traced_kernels_it_says_what_to_use():
    def fn(comm):
        with pytest.raises(RuntimeUnavailable, match="needs the GPU runtime.*mscclang predict"):
            comm.trace()
        return True

    assert run_ranks(2, fn, engine="sim", plans=[_allreduce_plan()])[0] == [True, True]


def test_trace_blocks_do_not_nest():
    from mscclang.errors import MscclangError

    def fn(comm):
        _traced_engine(comm, None, 0)
        with comm.trace():
            with pytest.raises(MscclangError, match="do not nest"):
                with comm.trace():
                    pass
        return True

    run_ranks(2, fn, engine="sim", plans=[_allreduce_plan()])
