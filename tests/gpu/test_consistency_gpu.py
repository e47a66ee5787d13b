"""GPU tests of rank consistency (``pytest -m gpu tests/gpu``; 2, 4 or 8 ranks sharing one GPU
with ``MSCCLANG_RANKS_PER_GPU``): after ``all_reduce`` (every plan the selector picks, fp16, bf16,
fp32 and both fp8 types) and after the fused ``all_reduce_add_rms_norm`` (T x H over one-shot and
two-shot sizes, odd row counts included, FP8 output too), every rank's output bytes equal rank
0's, and the results lie within the documented bound of a float64 reference. Reuses the
session's worker pool (tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

H = "tests.harness.consistency_checks"


def _same_bits(results: list) -> tuple[dict, set]:
    """Per case, the ranks whose bytes differ from rank 0's; and the plans that ran."""
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:20])
    ref = results[0]["digests"]
    assert ref and all(set(r["digests"]) == set(ref) for r in results)
    differ = {case: [r["rank"] for r in results[1:] if r["digests"][case] != d] for case, d in ref.items()}
    plans = {p for r in results for p in r["plans"].values()}
    return {c: rs for c, rs in differ.items() if rs}, plans


def test_all_reduce_gives_every_rank_the_same_bits(pool):
    bad, plans = _same_bits(pool.run(f"{H}:check_allreduce"))
    print(f"\n{len(plans)} plans: {sorted(str(p) for p in plans)}")
    assert bad == {}, f"{len(bad)} cases with differing ranks: {dict(list(bad.items())[:10])}"


def test_fused_call_gives_every_rank_the_same_bits_and_runs_fused(pool):
    results = pool.run(f"{H}:check_fused")
    bad, plans = _same_bits(results)
    print(f"\nplans: {sorted(str(p) for p in plans)}")
    fell_back = sorted({c for r in results for c, p in r["plans"].items() if p is None})
    assert bad == {}, f"{len(bad)} cases with differing ranks: {dict(list(bad.items())[:10])}"
    assert fell_back == [], f"fell back: {fell_back[:10]}"
