"""Batch invariance (docs/semantics.md, "Batch invariance"; docs/verify.md, ``batch-variant``):
the verifier proves that every reduced output element is exactly the canonical expression (the
ranks' sources in rank order, left to right; one op in fp8), fails a plan that promises it and
breaks it (naming the chunk, the canonical expression, the plan's and the ops with their lines),
and reports whether it holds for a plan that does not promise it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from mscclang.plan.io import load_plan, plan_from_dict, plan_to_dict
from mscclang.plan.models import Plan
from mscclang.sim import verify
from mscclang.sim.verify import prove_batch_invariant
from tests.harness.cli import ROOT, cli_inproc

PLANS = ROOT / "plans"


def promising(plan: Plan, promise: Optional[bool], own_first: bool = False) -> Plan:
    """``plan`` promising ``promise`` (None: saying nothing); ``own_first``: every reduction adds
    the rank's own source first (no ``src0_position``)."""
    d = plan_to_dict(plan)
    d.pop("batch_invariant", None)
    if promise is not None:
        d["batch_invariant"] = promise
    if own_first:
        for g in d["gpus"]:
            for tb in g["threadblocks"]:
                for op in tb["ops"]:
                    op.pop("src0_position", None)
    return plan_from_dict(d)


def one_reducer(n: int, owner: int, reduce_at: Callable[[Any, Any, Any, dict], None], promise: Optional[bool],
                fusion: bool = True) -> Plan:
    """An ``n``-rank all-reduce (``n`` chunks): every rank puts its input into rank ``owner``'s
    scratch (slot = the sender's rank), ``owner`` sums by ``reduce_at(rank, input, output, got)``
    (``got[q]``: rank ``q``'s input there) and puts its output into every other rank's."""
    from mscclang.algorithms.common import data_handshake, mesh, peers, ready_handshake
    from mscclang.dsl import AllReduce, Buffer, CollectiveProgram, Rank

    with CollectiveProgram(f"one_reducer{n}", AllReduce(n, 1, False), n, instr_fusion=fusion,
                           batch_invariant=promise) as prog:
        scratch = Buffer(owner, n * n)
        ch = mesh(n)
        others = peers(owner, n)
        ready_handshake(ch, owner, others, others, 0)
        for r in others:
            ready_handshake(ch, r, [owner], [owner], 0)
            ch[(r, owner)].put(scratch[r * n:(r + 1) * n], Rank(r).get_input_buffer()[0:n], tb=0)
            data_handshake(ch, r, [owner], [], 0)
        data_handshake(ch, owner, [], others, 0)
        rank = Rank(owner)
        out = rank.get_output_buffer()[0:n]
        reduce_at(rank, rank.get_input_buffer()[0:n], out, {q: scratch[q * n:(q + 1) * n] for q in others})
        for r in others:
            ch[(owner, r)].put(Rank(r).get_output_buffer()[0:n], out, tb=0)
        data_handshake(ch, owner, others, others, 0)
        for r in others:
            data_handshake(ch, r, [owner], [owner], 0)
    return prog.to_plan()


def _variant(rep) -> list:
    return [p for p in rep.problems if p.kind == "batch-variant"]


def test_a_ring_allreduce_that_promises_it_fails_naming_chunk_canonical_and_ops() -> None:
    from mscclang.cli.compile_cmd import compile_file

    ring = compile_file(ROOT / "tests" / "programs" / "allreduce_ring.py", ["--num_gpus", "4"])
    rep = verify(promising(ring, True), schedules=1, dtypes=("float32",))
    assert rep.failed and rep.batch_invariant is False
    found = _variant(rep)
    assert found and all(p.severity == "error" for p in found)
    msg = found[0].message
    # chunk 2 of rank 0's output: the ring sums it as ((x3 + x0) + x1) + x2, one op a hop
    assert "rank 0 output chunk 2" in msg or "rank 0 output chunk 0" in msg
    c = found[0].details["chunk"]
    assert found[0].details["canonical"] == " + ".join(f"x{r}[{c}]" for r in range(4))
    assert found[0].details["plan"] != found[0].details["canonical"]
    assert f"canonical:   {found[0].details['canonical']}\n" in msg and f"the plan:    {found[0].details['plan']} " in msg
    assert " re" in msg and "allreduce_ring.py:" in msg   # the ops and their program lines


def test_pairwise_partial_sums_that_promise_it_fail() -> None:
    def pairs(rank: Any, inp: Any, out: Any, got: dict) -> None:
        rank.reduce(inp, [got[1]], tb=0, dst_chunk=out)     # x0 + x1
        rank.reduce(got[2], [got[3]], tb=0)                 # x2 + x3
        rank.reduce(out, [got[2]], tb=0)                    # (x0 + x1) + (x2 + x3)

    rep = verify(one_reducer(4, 0, pairs, True, fusion=False), schedules=1, dtypes=("float32",))
    found = _variant(rep)
    assert rep.failed and found
    d = found[0].details
    assert d["canonical"] == "x0[0] + x1[0] + x2[0] + x3[0]"
    assert d["plan"] == "(x0[0] + x1[0]) + (x2[0] + x3[0])"
    assert "test_batch_invariant_verify.py:" in found[0].message


def test_own_input_first_then_the_rest_in_rank_order_passes() -> None:
    """Rank 1 sums (x1 + x0) + x2: the first two commute, so it is x0 + x1 + x2."""
    def own_first(rank: Any, inp: Any, out: Any, got: dict) -> None:
        rank.reduce(inp, [got[0]], tb=0, dst_chunk=out)
        rank.reduce(out, [got[2]], tb=0)

    plan = one_reducer(3, 1, own_first, True)
    rep = verify(plan, schedules=2)
    assert rep.passed(strict=True) and rep.batch_invariant is True and not _variant(rep)
    assert any(n.startswith("batch invariant (promised; checked at sizes") and n.endswith(": yes")
               for n in rep.notes)
    # the same sum with rank 2's input second is not canonical
    def swapped(rank: Any, inp: Any, out: Any, got: dict) -> None:
        rank.reduce(inp, [got[2]], tb=0, dst_chunk=out)
        rank.reduce(out, [got[0]], tb=0)

    assert verify(one_reducer(3, 1, swapped, True), schedules=1, dtypes=("float32",)).failed


def test_fp8_counts_the_op_boundaries() -> None:
    """(x0 + x1) then + x2 in two ops: the canonical in fp32 (every addition rounds), not in fp8
    (one rounding per op: the canonical is one op over every source)."""
    def two_ops(rank: Any, inp: Any, out: Any, got: dict) -> None:
        rank.reduce(inp, [got[1]], tb=0, dst_chunk=out)
        rank.reduce(out, [got[2]], tb=0)

    plan = one_reducer(3, 0, two_ops, True, fusion=False)
    assert verify(plan, schedules=1, dtypes=("float32",)).passed(strict=True)
    rep = verify(plan, schedules=1, dtypes=("float8_e4m3",))
    found = _variant(rep)
    assert rep.failed and found and found[0].details["form"] == "strict"
    assert "fp8" in found[0].message and found[0].details["plan"] == "(x0[0] + x1[0]) + x2[0]"
    proof = prove_batch_invariant(plan)   # every dtype: fp8 included
    assert not proof.holds and proof.problems[0].details["form"] == "strict"
    assert prove_batch_invariant(plan, dtypes=["float16", "bfloat16"]).holds
    # fused into one op, the same program is canonical in fp8 too
    assert prove_batch_invariant(one_reducer(3, 0, two_ops, True, fusion=True)).holds


@pytest.mark.parametrize("name", sorted(p.name for p in PLANS.glob("allreduce_oneshot_ll.*.json")))
def test_the_shipped_oneshot_allreduces_are_canonical(name: str) -> None:
    proof = prove_batch_invariant(load_plan(PLANS / name))
    assert proof.holds and proof.sizes, proof.problems[:1]


def test_a_shipped_oneshot_allreduce_keeps_the_promise_and_loses_it_summing_its_own_first() -> None:
    plan = load_plan(PLANS / "allreduce_oneshot_ll.r4.i1.json")
    assert verify(promising(plan, True), schedules=2).passed(strict=True)
    rep = verify(promising(plan, True, own_first=True), schedules=2, dtypes=("float16",))
    found = _variant(rep)
    assert rep.failed and found[0].details["canonical"].startswith("x0[")
    assert "allreduce.py:" in found[0].message


@pytest.mark.parametrize("name", sorted(p.name for p in PLANS.glob("allreduce_add_rms_norm_*.json")))
def test_the_shipped_fused_plans_are_canonical(name: str) -> None:
    """Row t's residual is x0 + ... + x{n-1} + res and its output the norm of it, whatever the row
    count (cases of 1 to 5n rows), the plan (one-shot, two-shot) or the rank."""
    proof = prove_batch_invariant(load_plan(PLANS / name))
    assert proof.holds and len(proof.sizes) >= 3, proof.problems[:1]


@pytest.mark.parametrize("name", ["allreduce_add_rms_norm_oneshot_ll.r4.i1.json",
                                  "allreduce_add_rms_norm_oneshot_ll.r4.i1.quantTrue.json"])
def test_a_fused_plan_summing_its_own_input_first_breaks_it(name: str) -> None:
    plan = promising(load_plan(PLANS / name), True, own_first=True)
    rep = verify(plan, schedules=1, dtypes=("float32",))
    found = _variant(rep)
    assert rep.failed and found
    d = found[0].details
    assert d["buffer"] in ("residual", "output")
    c = d["chunk"] if d["buffer"] == "residual" else None
    if c is not None:
        assert d["canonical"] == " + ".join(f"x{r}[{c}]" for r in range(4)) + f" + res[{c}]"
    else:
        assert d["canonical"].startswith("norm(x0[")
    assert "fused.py:" in found[0].message


def test_without_a_promise_the_report_says_whether_it_holds() -> None:
    from mscclang.cli.compile_cmd import compile_file

    ring = compile_file(ROOT / "tests" / "programs" / "allreduce_ring.py", ["--num_gpus", "3"])
    rep = verify(promising(ring, None), schedules=1, dtypes=("float32",))
    assert rep.ok and rep.batch_invariant is False and not _variant(rep)
    note = next(n for n in rep.notes if n.startswith("batch invariant"))
    assert "(not promised; checked at sizes" in note and ": no: rank 0 output chunk" in note and "canonical x0[" in note
    rep = verify(promising(ring, False), schedules=1, dtypes=("float32",))
    assert rep.ok and not _variant(rep)
    assert any(n.startswith("batch invariant (not promised (batch_invariant: false)") for n in rep.notes)
    rep = verify(promising(load_plan(PLANS / "allreduce_oneshot_ll.r4.i1.json"), None), schedules=1)
    assert rep.batch_invariant is True and any(n.startswith("batch invariant (not promised") and n.endswith("yes")
                                               for n in rep.notes)
    # not a reduction: nothing to say
    rep = verify(load_plan(PLANS / "allgather_ll.r4.i1.json"), schedules=1)
    assert rep.batch_invariant is None and not any("batch invariant" in n for n in rep.notes)


def test_the_cli_prints_the_verdict(capsys, tmp_path: Path) -> None:
    plan = load_plan(PLANS / "allreduce_oneshot_ll.r4.i1.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(plan_to_dict(promising(plan, True, own_first=True))))
    res = cli_inproc(capsys, "verify", str(bad), "--schedules", "1", "--dtype", "fp16")
    assert res.returncode == 1
    assert "batch-variant: rank 2 output chunk 0 " in res.stdout and "canonical:   x0[0] + x1[0] + x2[0] + x3[0]" in res.stdout
    assert "the plan:    x" in res.stdout and "computed by: rank " in res.stdout
    good = tmp_path / "good.json"
    good.write_text(json.dumps(plan_to_dict(promising(plan, None))))
    res = cli_inproc(capsys, "verify", str(good), "--schedules", "1")
    assert res.returncode == 0 and "note: batch invariant (not promised; checked at sizes" in res.stdout


def test_generation_proves_every_promise() -> None:
    from mscclang.algorithms import generate
    from mscclang.algorithms.generate import render_plan
    from mscclang.algorithms.index import INDEX_FILE

    files = generate.generate_files(only=["allreduce_oneshot_ll"])
    names = [k for k in files if k != INDEX_FILE and ".r4.i1" in k]
    for k in names:
        files[k] = render_plan(promising(plan_from_dict(json.loads(files[k])), True))
    assert generate.broken_invariance_promises(files) == []
    bad = names[0]
    files[bad] = render_plan(promising(plan_from_dict(json.loads(files[bad])), True, own_first=True))
    lines = generate.broken_invariance_promises(files)
    assert len(lines) == 1 and lines[0].startswith(bad) and "canonical:   x0[" in lines[0]


def test_generate_plans_refuses_a_broken_promise(monkeypatch, tmp_path, capsys) -> None:
    """`mscclang generate-plans` proves every promise before it writes: a plan that promises
    batch invariance and sums around a ring (every rank gets the same bits, so the consistency
    proof passes it) stops it, naming the plan."""
    from mscclang.algorithms import generate
    from mscclang.algorithms.generate import render_plan
    from mscclang.cli.compile_cmd import compile_file
    from mscclang.cli.main import main

    made = generate.generate_files
    ring = compile_file(ROOT / "tests" / "programs" / "allreduce_ring.py", ["--num_gpus", "4"])

    def with_ring(only=None):
        files = made(["allreduce_oneshot_ll"])
        files["allreduce_ring.r4.json"] = render_plan(promising(ring, True))
        return files

    monkeypatch.setattr(generate, "generate_files", with_ring)
    assert main(["generate-plans", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "promise batch invariance and break it" in err and "allreduce_ring.r4.json" in err, err
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.slow
def test_every_shipped_plan_that_promises_it_keeps_it(shipped_plans) -> None:
    broken = []
    for f in shipped_plans:
        plan = load_plan(f)
        if plan.batch_invariant:
            proof = prove_batch_invariant(plan)
            if not proof.holds:
                broken.append(f"{f.name}: {proof.problems[0].message if proof.problems else 'no size proven'}")
    assert broken == []


def test_a_fused_row_has_the_same_bits_at_every_row_count_plan_and_rank() -> None:
    """What the symbolic proof says, run: row 0 (fixed inputs, residual and weight; values whose
    sums depend on the order) gets the same output and residual bits whether it is alone or
    among 6 or 12 other rows, from the one-shot or the two-shot plan, on every rank."""
    import numpy as np
    import torch

    from mscclang.sim.epilogue import EpilogueParams
    from mscclang.sim.fused import run_fused
    from tests.harness.data import spread

    def data(count: int, seed: int) -> np.ndarray:
        return spread(count, torch.float16, seed).numpy()

    n, h = 4, 64
    params = EpilogueParams(h, np.linspace(0.5, 1.5, h, dtype=np.float32), 1e-5)
    seen = set()
    for algo in ("oneshot", "twoshot"):
        plan = load_plan(PLANS / f"allreduce_add_rms_norm_{algo}_ll.r{n}.i1.json")
        for rows in (1, 7, 13):
            xs = [np.concatenate([data(h, r), data((rows - 1) * h, 100 + rows * n + r)]) for r in range(n)]
            res = np.concatenate([data(h, 99), data((rows - 1) * h, 98 - rows)])
            got = run_fused(plan, xs, [res] * n, params)
            seen |= {(got.outputs[r][:h].tobytes(), got.residuals[r][:h].tobytes()) for r in range(n)}
    assert len(seen) == 1
