"""The compiler's work grows with the ops it compiles, and its progress follows the work.

Counted, not timed: the conflict tests that fusion and the hazard pass make per recorded op do
not grow with the ranks (they were quadratic in the length of a fused op or of a sync-free
stretch of a block: cubic in the ranks for all-pairs programs), and the progress reports move
through every pass, rank by rank, towards one total."""

from __future__ import annotations

import importlib

import pytest

from mscclang.compiler import lower
from mscclang.compiler.budget import reporting
from tests.harness.compiles import ROOT, capture_compiles, example_program, run_script

IR = importlib.import_module("mscclang.compiler.ir")
#: modules that test accesses for conflicts (those that imported ``conflicts`` themselves too)
CHECKERS = [IR] + [importlib.import_module(f"mscclang.compiler.{m}") for m in ("fuse", "hazards")]


def recorded(name: str, ranks: int):
    """The recorded program of the all-pairs example or of a test program at ``ranks`` ranks."""
    if name == "allpairs":
        return example_program("allreduce_8rank")(ranks).ir
    with capture_compiles() as seen:
        run_script(ROOT / "tests" / "programs" / f"{name}.py", "--num_gpus", str(ranks))
    return seen[-1].ir


def conflict_tests_per_op(monkeypatch: pytest.MonkeyPatch, ir) -> float:
    """Conflict tests lowering ``ir`` makes, per recorded op."""
    count = 0
    real = IR.conflicts

    def counting(a, b):
        nonlocal count
        count += 1
        return real(a, b)

    for mod in CHECKERS:
        monkeypatch.setattr(mod, "conflicts", counting, raising=False)
    lower(ir)
    return count / sum(len(tb) for r in ir.ranks for tb in r.tbs)


@pytest.mark.parametrize("name", ["allpairs", "allreduce_ll_naive_single", "allreduce_ll_twostep",
                                  "allreduce_ll_oneshot", "allreduce_ring"])
def test_conflict_tests_per_op_do_not_grow_with_the_ranks(monkeypatch, name):
    # before: all-pairs 0.37 -> 0.87 per op from 8 to 16 ranks, naive LL 16 -> 34, LL one-shot
    # 9.8 -> 20, LL two-step 5.3 -> 6.0 (a fused op's accesses, or a stretch's, all compared)
    small, large = (conflict_tests_per_op(monkeypatch, recorded(name, n)) for n in (8, 16))
    assert large <= small + 0.25, (small, large)


def test_progress_moves_through_every_pass_rank_by_rank():
    reports: list[tuple[int, int | None, str]] = []
    ranks = 16
    with reporting(lambda done, total, note: reports.append((done, total, note))):
        example_program("allreduce_8rank")(ranks, 2).to_plan()
    compiling = [r for r in reports if r[1] is not None]
    assert len({total for _, total, _ in compiling}) == 1  # one total, known from the start
    done = [d for d, _, _ in compiling]
    assert done == sorted(done) and 0 < done[0]  # the recording counts as done
    notes = [note for _, _, note in compiling]
    for step in ("validate", "fuse", "syncs", "hazards", "replicate", "emit"):
        # the count moves as each rank is done, not only between passes
        assert len({d for d, _, note in compiling if note == step}) >= ranks, step
    assert "cycle check" in notes and notes[-1] == "serialising the plan"
    assert done[-1] < compiling[-1][1]  # writing the plan out is left to the caller
