"""The batch-invariant mode of the collective API, on the CPU: how it is turned on (the setting,
the Communicator's keyword, the torch backend's group option), the selector listing only plans
that keep the contract (tuning picks without the promise and torch.distributed refused), the one
line a call no such plan serves raises, and the plans generated from the algorithm library for
3 to 8 ranks, run on the simulator with no fallback."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mscclang.comm import invariant
from mscclang.comm.catalog import Catalog
from mscclang.comm.communicator import Communicator
from mscclang.comm.errors import BatchInvariantError
from mscclang.comm.selector import Selector
from mscclang.comm.sim_backend import SimLaunch, torch_to_numpy
from mscclang.comm.sim_ranks import catalog_of, run_ranks, stub_plan
from mscclang.comm.tuning import TuningTable, tuning_from_dict
from mscclang.errors import InvalidCall
from mscclang.plan.call import message_call
from mscclang.plan.reference import reference_outputs
from tests.harness.data import spread

ENV = "MSCCLANG_BATCH_INVARIANT"


@pytest.fixture(autouse=True)
def fresh_generation(monkeypatch):
    """Each test generates the library's plans anew (the process-wide cache starts empty) and
    reads the mode from its own environment."""
    monkeypatch.setattr(invariant, "_GENERATED", {})
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def promised(monkeypatch):
    """The library's plans built in this test promise batch invariance (the flag the algorithm
    library sets on its canonical plans; the proof still runs)."""
    from mscclang.algorithms.registry import AlgorithmInfo

    build = AlgorithmInfo.build

    def promising(self, *a, **kw):
        plan = build(self, *a, **kw)
        return plan if plan.batch_invariant is not None else plan.model_copy(update={"batch_invariant": True})

    monkeypatch.setattr(AlgorithmInfo, "build", promising)


def _stub(coll: str, n: int, name: str, promise, **kw):
    return stub_plan(coll, n, name=name, **kw).model_copy(update={"batch_invariant": promise})


def _table(coll: str, *plans: str) -> TuningTable:
    return tuning_from_dict({"format": "mscclang.tuning/1", "rules": [
        {"collective": coll, "world_size": None, "dtypes": ["*"], "max_bytes": None,
         "candidates": [{"plan": p} for p in plans]}]})


# ---------------------------------------------------------------- turning it on
def test_the_setting_and_the_keyword_turn_it_on(monkeypatch):
    def comm(**kw):
        return Communicator(store=dist.HashStore(), rank=0, world_size=2, device="cpu", fallback=False,
                            plans=Catalog(), tuning=TuningTable(), **kw)

    assert comm().batch_invariant is False
    assert comm(batch_invariant=True).batch_invariant is True
    monkeypatch.setenv(ENV, "1")
    assert comm().batch_invariant is True
    assert comm(batch_invariant=False).batch_invariant is False   # the keyword wins over the setting
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(InvalidCall, match=f"{ENV}='sometimes'"):
        comm()


def test_the_torch_backends_group_option_turns_it_on(tmp_path):
    import mscclang.distributed as md

    dist.init_process_group("mscclang", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            pg_options=md.BackendOptions(batch_invariant=True))
    try:
        assert dist.group.WORLD.communicator.batch_invariant is True
        assert dist.new_group(backend="mscclang").communicator.batch_invariant is False
        with pytest.raises(BatchInvariantError, match="all_reduce of 16 bytes \\(float32\\) on 1 ranks"):
            dist.all_reduce(torch.ones(4))   # no GPU runtime here: refused, never the gloo fallback
    finally:
        dist.destroy_process_group()
    with pytest.raises(InvalidCall, match="BackendOptions, got dict"):
        md.create_process_group(SimpleNamespace(store=None, group_rank=0, group_size=1, timeout=None),
                                {"batch_invariant": True})


# ---------------------------------------------------------------- the selector
def test_the_selector_lists_only_plans_that_keep_the_contract(caplog):
    plans = [_stub("allreduce", 4, "ar_kept", True), _stub("allreduce", 4, "ar_unsaid", None),
             _stub("allreduce", 4, "ar_denied", False), _stub("allgather", 4, "ag_unsaid", None),
             _stub("allgather", 4, "ag_denied", False)]
    cat = catalog_of(plans)
    table = _table("allreduce", "ar_unsaid", "nccl")

    def labels(sel, coll):
        return [c.variant.key if c.variants else "nccl"
                for c in sel.choices(message_call(coll, 4, 4096, "float32"))]

    assert labels(Selector(table, cat), "allreduce") == ["ar_unsaid", "nccl"]
    with caplog.at_level(logging.WARNING, "mscclang.comm"):
        assert labels(Selector(table, cat, batch_invariant=True), "allreduce") == ["ar_kept"]
    refused = [r.getMessage() for r in caplog.records if "refuses" in r.getMessage()]
    assert len(refused) == 2 and "ar_unsaid" in refused[0] and "torch.distributed" in refused[1]
    # a plan that reduces nothing may leave the promise unsaid, never deny it
    assert labels(Selector(TuningTable(), cat, batch_invariant=True), "allgather") == ["ag_unsaid"]
    assert sorted(labels(Selector(TuningTable(), cat), "allgather")) == ["ag_denied", "ag_unsaid"]


def test_the_index_may_say_the_promise(tmp_path):
    """An index entry's ``batch_invariant`` is read as it is (the plan file is not loaded for it);
    anything but true or false is refused naming the entry."""
    import json

    from mscclang.comm.errors import TuningError
    from mscclang.comm.selector import keeps

    entry = {"file": "absent.json", "algorithm": "ar", "collective": "allreduce", "ranks": 2, "buffer_mode": "any"}
    for promise, want in ((True, True), (False, False)):
        (tmp_path / "index.json").write_text(json.dumps({"plans": [dict(entry, batch_invariant=promise)]}))
        assert [keeps(v) for v in Catalog.from_dir(tmp_path)] == [want]
    (tmp_path / "index.json").write_text(json.dumps({"plans": [dict(entry, batch_invariant="yes")]}))
    with pytest.raises(TuningError, match=r"\[0\]: batch_invariant must be true or false, got 'yes'"):
        Catalog.from_dir(tmp_path)


def test_a_tuning_pick_without_the_promise_never_runs():
    plans = [_stub("allreduce", 2, "ar_kept", True), _stub("allreduce", 2, "ar_fast", None)]

    def body(comm):
        comm.all_reduce(torch.ones(64))
        return comm.last.label()

    for mode, want in ((False, "ar_fast"), (True, "ar_kept")):
        got, _, fb = run_ranks(2, body, plans=plans, tuning=_table("allreduce", "ar_fast"), batch_invariant=mode)
        assert [g.split()[0] for g in got] == [want, want] and fb.calls == []
    # a rule naming only torch.distributed: outside the mode it runs, in it the kept plan does
    _, _, fb = run_ranks(2, body, plans=plans[:1], tuning=_table("allreduce", "nccl"))
    assert fb.calls == ["allreduce"] * 2
    got, _, fb = run_ranks(2, body, plans=plans[:1], tuning=_table("allreduce", "nccl"), batch_invariant=True)
    assert got[0].startswith("ar_kept") and fb.calls == []


# ---------------------------------------------------------------- the refusal
def test_a_call_no_kept_plan_serves_raises_one_line_not_the_fallback(monkeypatch):
    monkeypatch.setattr(invariant, "_library_variants", lambda coll, n, dropped: [])   # the library generates nothing
    plans = [_stub("allreduce", 2, "ar_unsaid", None)]

    def body(comm):
        comm.all_reduce(torch.ones(1000, dtype=torch.bfloat16))
        return comm.last.label()

    got, _, fb = run_ranks(2, body, plans=plans)
    assert got[0].startswith("ar_unsaid") and fb.calls == []   # outside the mode: as before
    _, _, fb = run_ranks(2, body, plans=plans, tuning=_table("allreduce", "nccl"))
    assert fb.calls == ["allreduce"] * 2
    for tuning in (None, _table("allreduce", "nccl")):
        with pytest.raises(BatchInvariantError) as e:
            run_ranks(2, body, plans=plans, tuning=tuning, batch_invariant=True)
    with pytest.raises(BatchInvariantError) as e:
        run_ranks(2, body, plans=plans, batch_invariant=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert "all_reduce of 2000 bytes (bfloat16) on 2 ranks" in msg and "ar_unsaid: it does not promise" in msg


def test_a_plan_that_cannot_run_here_is_named_in_the_refusal(monkeypatch):
    monkeypatch.setattr(SimLaunch, "runnable", lambda self, plan: "its memory channels cross nodes")
    plans = [_stub("reducescatter", 2, "rs_kept", True)]

    def body(comm):
        comm.reduce_scatter(torch.ones(64))

    with pytest.raises(BatchInvariantError, match="reduce_scatter of 256 bytes \\(float32\\) on 2 ranks .*"
                                                  "rs_kept cannot run here: its memory channels cross nodes"):
        run_ranks(2, body, plans=plans, batch_invariant=True)


def test_the_torch_backend_refuses_a_reduction_for_its_inner_group():
    from mscclang.distributed import MscclangProcessGroup

    def body(comm):
        pg = MscclangProcessGroup(None, comm.rank, comm.world_size, device="cpu", communicator=comm)
        with pytest.raises(BatchInvariantError, match="reduce of 64 bytes \\(float64\\) on 2 ranks .*inner gloo"):
            pg.reduce([torch.ones(8, dtype=torch.float64)], dist.ReduceOptions())
        return True

    assert run_ranks(2, body, plans=[_stub("allreduce", 2, "ar_kept", True)], batch_invariant=True)[0] == [True, True]


# ---------------------------------------------------------------- generated plans, 3 to 8 ranks
#: elements per rank count: LL plans, and Simple plans above 256 KiB of fp32
PER_RANK = (2, 1050, 22_000)


#: the collectives and dtypes the generated plans run in
CALLS = tuple((c, d) for c in ("allreduce", "reducescatter") for d in (torch.float32, torch.bfloat16))


@functools.lru_cache(maxsize=None)
def _run_generated(n: int, coll: str, dtype: torch.dtype):
    """Every rank's outputs (numpy) and the plans that ran at ``n`` times :data:`PER_RANK`
    elements, the inputs by size, and the fallback's calls, in the mode with no catalog (every
    plan generated, the library's plans promising it: see ``promised``). Kept for the module's
    two tests below, which read the same runs."""
    sizes = [n * k for k in PER_RANK]
    inputs = {k: [spread(k, dtype, 100 * n + q) for q in range(n)] for k in sizes}

    def body(comm):
        outs, ran = [], []
        for k in sizes:
            x = inputs[k][comm.rank].clone()
            y = comm.all_reduce(x) if coll == "allreduce" else comm.reduce_scatter(x)
            outs.append(torch_to_numpy(y))
            ran.append(comm.last.variant.key)
        return outs, ran

    got, _, fb = run_ranks(n, body, catalog=Catalog(), engine="sim", batch_invariant=True)
    return got, inputs, fb.calls


@pytest.mark.parametrize("n", range(3, 9))
def test_generated_plans_serve_every_world_size_with_no_fallback(promised, n):
    for coll, dtype in CALLS:
        got, inputs, calls = _run_generated(n, coll, dtype)
        assert calls == []
        for i in range(len(PER_RANK)):
            assert all(f".r{n}." in ran[i] for _, ran in got)
            if coll == "allreduce":   # every rank the same bits
                assert all(outs[i].tobytes() == got[0][0][i].tobytes() for outs, _ in got)


@pytest.mark.parametrize("n", range(3, 9))
def test_generated_plans_give_the_rank_order_fold(promised, n):
    for coll, dtype in CALLS:
        got, inputs, _ = _run_generated(n, coll, dtype)
        for i, k in enumerate(inputs):
            want = reference_outputs(coll, [torch_to_numpy(x) for x in inputs[k]], "sum")
            assert [outs[i].tobytes() for outs, _ in got] == [np.asarray(w).tobytes() for w in want], (coll, k)


def test_a_generated_plan_its_proof_refuses_never_runs(promised, monkeypatch):
    prove = invariant.prove_promise
    monkeypatch.setattr(invariant, "prove_promise",
                        lambda plan: "planted" if plan.name.startswith("allreduce_oneshot_ll") else prove(plan))

    def body(comm):
        comm.all_reduce(torch.ones(30))
        return comm.last.variant.key

    got, _, fb = run_ranks(3, body, catalog=Catalog(), engine="sim", batch_invariant=True)
    assert fb.calls == [] and got == ["allreduce_twostep_ll.r3.i1.inplace"] * 3   # the one-shot comes first otherwise
    monkeypatch.setattr(invariant, "prove_promise", lambda plan: "planted")
    monkeypatch.setattr(invariant, "_GENERATED", {})
    with pytest.raises(BatchInvariantError, match="all_reduce of 120 bytes \\(float32\\) on 3 ranks .*: "
                                                  "allreduce_oneshot_ll.r3.i1 is refused: planted, and \\d+ more$"):
        run_ranks(3, body, catalog=Catalog(), engine="sim", batch_invariant=True)


# ---------------------------------------------------------------- the fused call
def test_the_fused_call_runs_a_generated_plan_or_raises(monkeypatch):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 16, generator=g).to(torch.float16) for _ in range(3)]
    res, w = torch.randn(4, 16, generator=g).to(torch.float16), torch.rand(16, generator=g).to(torch.float16)

    def body(comm):
        x, r = xs[comm.rank].clone(), res.clone()
        comm.all_reduce_add_rms_norm(x, r, w, 1e-5)
        return comm.last_fused, x, r

    monkeypatch.setattr(invariant, "_GENERATED", {})
    got, _, fb = run_ranks(3, body, catalog=Catalog(), engine="sim", batch_invariant=True)
    assert fb.calls == [] and all(name.startswith("allreduce_add_rms_norm_oneshot_ll.r3.") for name, _, _ in got)
    assert all(torch.equal(x, got[0][1]) and torch.equal(r, got[0][2]) for _, x, r in got)


def test_the_mode_proves_the_order_not_only_the_flag():
    """A generated plan that promises batch invariance but sums around a ring is refused by the
    mode's proof (the rank-consistency proof alone passes it: every rank gets the ring's bits)."""
    from pathlib import Path

    from mscclang.cli.compile_cmd import compile_file

    ring = compile_file(Path(__file__).parent / "programs" / "allreduce_ring.py", ["--num_gpus", "4"])
    ring = ring.model_copy(update={"batch_invariant": True})
    why = invariant.prove_promise(ring)
    assert why is not None and "not the canonical expression" in why, why
    from mscclang.algorithms.allreduce import build_rsag_simple

    assert invariant.prove_promise(build_rsag_simple(4)) is None
