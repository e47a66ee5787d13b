"""Every rank gets the same bits (docs/semantics.md, "Rank consistency"): the verifier proves it
symbolically (reduction trees) and numerically (the ranks' output bytes), a plan's ``consistent``
promise sets the severity, reductions take a place for their own source (``src0_position``), and
every library plan keeps its promise."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mscclang.algorithms.allreduce import build_oneshot_ll, build_twostep_ll
from mscclang.algorithms.fused import build_fused_oneshot_ll, build_fused_twoshot_ll
from mscclang.errors import DSLError, PlanError
from mscclang.plan.io import plan_from_dict, plan_to_dict
from mscclang.plan.models import Plan
from mscclang.sim import run, verify
from mscclang.sim.verify import prove_consistent


def own_first(plan: Plan, consistent=None) -> Plan:
    """``plan`` with every reduction adding the rank's own source first (the one-shot plans
    before rank-order sums: each rank added its own input first), promising ``consistent`` and
    saying nothing of batch invariance."""
    d = plan_to_dict(plan)
    for g in d["gpus"]:
        for tb in g["threadblocks"]:
            for op in tb["ops"]:
                op.pop("src0_position", None)
    d.pop("consistent", None)
    d.pop("batch_invariant", None)   # own input first breaks it too: tests/test_batch_invariant_verify.py
    if consistent is not None:
        d["consistent"] = consistent
    return plan_from_dict(d)


def _inconsistent(rep) -> list:
    return [p for p in rep.problems if p.kind == "inconsistent"]


@pytest.mark.parametrize("n", [3, 4, 8])
def test_own_first_oneshot_is_flagged_inconsistent_naming_chunk_ranks_orders_and_ops(n: int) -> None:
    """The regression: the one-shot plans as they were (own input first) give ranks 2.. other
    bits than rank 0 (rank 1's sum is rank 0's: the first addition commutes)."""
    old = own_first(build_oneshot_ll(n))
    rep = verify(old, schedules=2, dtypes=("float16",))
    found = _inconsistent(rep)
    assert found and rep.ok and rep.warnings   # unsaid promise: a warning (--strict fails it)
    assert not rep.passed(strict=True)
    sym = [p for p in found if p.details["how"] == "symbolic"]
    assert {p.details["ranks"] for p in sym} == {(0, r) for r in range(2, n)}
    first = sym[0]
    assert "output chunk 0" in first.message and "rank 0 and rank 2" in first.message
    assert first.details["orders"][0] == " + ".join(f"x{r}[0]" for r in range(n))
    assert first.details["orders"][1].startswith("x2[0] + x0[0] + x1[0]")
    assert "repkt" in first.message and "allreduce.py:" in first.message   # the op and its DSL line
    assert len(first.details["chunks"]) == n   # one problem per cause, every chunk listed


def test_the_promise_sets_the_severity() -> None:
    plan = build_oneshot_ll(4)
    promised = verify(own_first(plan, consistent=True), schedules=2, dtypes=("bfloat16",))
    assert promised.failed and all(p.severity == "error" for p in _inconsistent(promised))
    disclaimed = verify(own_first(plan, consistent=False), schedules=2, dtypes=("bfloat16",))
    assert disclaimed.passed(strict=True) and not _inconsistent(disclaimed)
    assert any("does not promise rank-consistent" in n for n in disclaimed.notes)


def test_the_numeric_check_alone_finds_it() -> None:
    rep = verify(own_first(build_oneshot_ll(4)), schedules=1, dtypes=("float32",), symbolic=False)
    found = _inconsistent(rep)
    assert found and all(p.details["how"] == "numeric" for p in found)
    assert "hold different bytes" in found[0].message


def test_two_ranks_and_integers_and_min_max_are_consistent_in_any_order() -> None:
    assert not prove_consistent(own_first(build_oneshot_ll(2)))
    rep = verify(own_first(build_oneshot_ll(4)), schedules=3, dtypes=("int32",), symbolic=False)
    assert not _inconsistent(rep)
    rep = verify(own_first(build_oneshot_ll(4)), schedules=3, dtypes=("float16",), reduce_ops=("max",),
                 symbolic=False)
    assert not _inconsistent(rep)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_rank_order_oneshot_gives_every_rank_the_same_bits(n: int) -> None:
    plan = build_oneshot_ll(n, instances=2)
    assert plan.consistent is True
    rng = np.random.default_rng(n)
    for dt in (np.float16, np.float32):
        xs = [rng.standard_normal(1000).astype(dt) for _ in range(n)]
        outs = run(plan, xs)
        want = xs[0].astype(dt)
        for x in xs[1:]:
            want = (want.astype(np.float32) + x.astype(np.float32)).astype(dt)   # rank order, per step
        for r in range(n):
            assert outs[r].tobytes() == want.tobytes(), r
    rep = verify(plan, schedules=4)
    assert rep.ok and not rep.warnings


def _mesh_allreduce(name: str, n: int, special: int, reduce_special: Any) -> Plan:
    """An ``n``-rank all-reduce over a full mesh of memory channels: every rank puts its input
    into every peer's scratch, then sums element ``k`` of the inputs in rank order in one op,
    except rank ``special``, which calls ``reduce_special(rank, inp_k, out_k, got)`` (``got``:
    the peers' element ``k`` in rank order) to sum it another way."""
    from mscclang.algorithms.common import data_handshake, mesh, peers, ready_handshake
    from mscclang.dsl import AllReduce, Buffer, CollectiveProgram, Rank

    with CollectiveProgram(name, AllReduce(n, 1, False), n, instr_fusion=False) as prog:
        scratch = [Buffer(r, n * n) for r in range(n)]
        ch = mesh(n)
        for r in range(n):
            rank, inp, out, ps = Rank(r), Rank(r).get_input_buffer(), Rank(r).get_output_buffer(), peers(r, n)
            ready_handshake(ch, r, ps, ps, 0)
            for p in ps:
                ch[(r, p)].put(scratch[p][r * n:(r + 1) * n], inp[0:n], tb=0)
            data_handshake(ch, r, ps, ps, 0)
            for k in range(n):
                got = [scratch[r][q * n + k:q * n + k + 1] for q in ps]
                if r == special:
                    reduce_special(rank, inp[k:k + 1], out[k:k + 1], got)
                else:
                    rank.reduce(inp[k:k + 1], got, tb=0, dst_chunk=out[k:k + 1], src_position=r)
            data_handshake(ch, r, ps, ps, 0)
    return prog.to_plan()


def _split_sums(n: int = 3) -> Plan:
    """Every rank sums the ranks' inputs in rank order, but rank 1 in two ops (x0 + x1, then +
    x2): the same bits wherever every addition rounds (fp16, bf16, fp32), not in fp8, which
    rounds once per op."""
    def two_ops(rank: Any, inp: Any, out: Any, got: list) -> None:
        rank.reduce(inp, got[:1], tb=0, dst_chunk=out, src_position=1)
        rank.reduce(out, got[1:], tb=0)

    return _mesh_allreduce("split", n, 1, two_ops)


def test_op_boundaries_count_for_fp8_only() -> None:
    probs = prove_consistent(_split_sums())
    assert probs and all(p.details["fp8_only"] for p in probs)
    assert {p.details["ranks"] for p in probs} == {(0, 1)}
    assert "fp8" in probs[0].message and "rounds once per op" in probs[0].message
    assert "(x0[0] + x1[0]) + x2[0]" in probs[0].details["orders"][1]
    rep = verify(_split_sums(), schedules=2, dtypes=("float16", "float32"))
    assert not [p for p in _inconsistent(rep) if p.details["how"] == "numeric"]   # no bits differ there
    rep8 = verify(_split_sums(), schedules=4, dtypes=("float8_e4m3",), symbolic=False)
    assert _inconsistent(rep8)


def test_fused_oneshot_own_first_is_flagged_and_rank_order_is_not() -> None:
    probs = prove_consistent(own_first(build_fused_oneshot_ll(4)))
    assert probs and {p.details["ranks"] for p in probs} == {(0, 2), (0, 3)}
    assert "residual chunk" in probs[0].message and "res[" in probs[0].message
    for build in (build_fused_oneshot_ll, build_fused_twoshot_ll):
        for n in (2, 4, 8):
            assert not prove_consistent(build(n)), (build.__name__, n)


def test_every_shipped_plan_promises_and_keeps_rank_consistency(shipped_plans) -> None:
    from mscclang.plan.io import load_plan

    broken = []
    for f in shipped_plans:
        plan = load_plan(f)
        assert plan.consistent is True, f.name
        if prove_consistent(plan):
            broken.append(f.name)
    assert broken == []


def test_generate_plans_fails_on_an_inconsistent_library_plan(monkeypatch) -> None:
    from mscclang.algorithms import generate

    files = generate.generate_files(only=["allreduce_oneshot_ll"])
    assert generate.inconsistent_plans(files) == []
    name = next(k for k in files if ".r4.i1.json" in k)
    files[name] = generate.render_plan(own_first(plan_from_dict(__import__("json").loads(files[name])), True))
    lines = generate.inconsistent_plans(files)
    assert len(lines) == 1 and lines[0].startswith(name)


# ---------------------------------------------------------------- the plan field and the DSL


def test_src0_position_sets_the_reduction_order() -> None:
    plan = build_twostep_ll(4)
    ops = [op for tb in plan.gpus[2].threadblocks for op in tb.ops if op.src0_position]
    # rank 2 sums its own chunk with the packets of ranks 0, 1 and 3: own at place 2
    assert ops and all(op.src0_position == 2 and op.reduction_order() == [1, 2, 0, 3] for op in ops)
    assert [op.reduction_order() for tb in plan.gpus[0].threadblocks for op in tb.ops
            if op.name.value == "respkt"][0] == [0, 1, 2, 3]


@pytest.mark.parametrize("mutate, what", [
    (lambda op: op.update(src0_position=9), "below the number of sources"),
    (lambda op: op.update(name="copy", src0_position=1), "only reductions"),
])
def test_a_bad_src0_position_is_refused_with_its_path(mutate, what) -> None:
    d = plan_to_dict(build_oneshot_ll(4))
    for tb in d["gpus"][3]["threadblocks"]:
        for op in tb["ops"]:
            if op["name"] == "repkt":
                mutate(op)
                break
        break
    with pytest.raises(PlanError, match=what) as e:
        plan_from_dict(d)
    assert "gpus[3].threadblocks[0].ops" in str(e.value)


def test_mscclpp_export_refuses_a_reordered_reduction() -> None:
    from mscclang.plan.mscclpp import to_mscclpp

    with pytest.raises(PlanError, match="src0_position"):
        to_mscclpp(build_oneshot_ll(4))
    to_mscclpp(own_first(build_oneshot_ll(4)))   # the listed order exports


@pytest.mark.parametrize("pos", [-1, 4, 1.0, True, "1"])
def test_the_dsl_refuses_a_bad_src_position(pos) -> None:
    from mscclang.dsl import AllReduce, Buffer, CollectiveProgram, Rank

    with CollectiveProgram("p", AllReduce(2, 1, False), 2):
        s = Buffer(0, 3)
        with pytest.raises(DSLError, match="src_position must be an int from 0 to 3"):
            Rank(0).reduce(Rank(0).get_input_buffer()[0:1], [s[0:1], s[1:2], s[2:3]], tb=0, src_position=pos)


def test_fusion_keeps_the_written_order() -> None:
    """A chain ``dst = a + x``, ``dst = dst + y`` fuses into one op in its order; a second op
    whose own source is not first must not be fused (its order is not a continuation)."""
    from mscclang.dsl import AllReduce, Buffer, CollectiveProgram, Rank

    def build(second_pos: int) -> Plan:
        with CollectiveProgram("p", AllReduce(2, 1, False), 2) as prog:
            s = Buffer(0, 2)
            i, o = Rank(0).get_input_buffer(), Rank(0).get_output_buffer()
            Rank(0).reduce(i[0:1], [s[0:1]], tb=0, dst_chunk=o[0:1], src_position=1)
            Rank(0).reduce(o[0:1], [s[1:2]], tb=0, src_position=second_pos)
        return prog.to_plan()

    fused = [op for op in build(0).gpus[0].threadblocks[0].ops if op.name.value == "re"]
    assert len(fused) == 1 and fused[0].src0_position == 1 and len(fused[0].src_buff) == 3
    kept = [op for op in build(1).gpus[0].threadblocks[0].ops if op.name.value == "re"]
    assert len(kept) == 2 and [op.src0_position for op in kept] == [1, 1]


def _rank0_pairs(n: int = 4) -> Plan:
    """Rank 0 sums ``(x0 + x1) + (x2 + x3)`` (three ops), ranks 1.. left to right in one op: ranks
    1.. compute the same tree, which rank 0 does not."""
    def pairs(rank: Any, inp: Any, out: Any, got: list) -> None:
        rank.reduce(inp, got[:1], tb=0, dst_chunk=out)
        rank.reduce(got[1], got[2:], tb=0)
        rank.reduce(out, got[1:2], tb=0)

    return _mesh_allreduce("pairs", n, 0, pairs)


def test_each_rank_s_order_comes_with_its_own_ops_and_lines() -> None:
    """Ranks 1.. compute one tree (interned once, by whichever rank got there first); each
    rank's finding names that rank's own op and program line."""
    rep = verify(_rank0_pairs(), schedules=1, dtypes=("float32",), sizes=(256,))
    sym = [p for p in _inconsistent(rep) if p.details["how"] == "symbolic"]
    assert {p.details["ranks"] for p in sym} == {(0, 1), (0, 2), (0, 3)}
    for p in sym:
        ra, rb = p.details["ranks"]
        assert p.details["orders"][0] == "(x0[0] + x1[0]) + (x2[0] + x3[0])"
        assert p.details["orders"][1] == "x0[0] + x1[0] + x2[0] + x3[0]"
        ops_a, ops_b = p.details["ops"]
        assert ops_a and all(o.startswith(f"rank {ra} ") for o in ops_a), ops_a
        assert ops_b and all(o.startswith(f"rank {rb} ") for o in ops_b), ops_b
        assert {r for r, _, _ in p.details["src"]} == {ra, rb}, p.details["src"]
        assert f"rank {rb} computes x0[0] + x1[0] + x2[0] + x3[0] [rank {rb} tb 0 op" in p.message, p.message
