"""GPU tests of plans with segments (data-dependent counts, ``pytest -m gpu``): the library's four
all-to-all-v plans (LL packets into scratch slots, Simple through scratch with ``get``, zero-copy
``put`` into the peers' outputs, copy-engine puts of whole scratch slots over port channels) through ``Executor.execute_counted`` at every world size the pool
has, with random count matrices against a numpy reference; 100 CUDA-graph replays, each with a new
count matrix written into the same device matrix; and counts the kernel's check refuses
(over a scratch slot's capacity, over the buffers' rows, negative, an expectation the sender does not meet): CountsError on every rank
before any data moves, never a timeout or a hang, then a reset and a correct run."""

from __future__ import annotations

import pytest

from mscclang.algorithms.alltoallv import (build_alltoallv_ll, build_alltoallv_port, build_alltoallv_simple,
                                          build_alltoallv_zero_copy)
from mscclang.plan.io import plan_to_json

pytestmark = pytest.mark.gpu

C = "tests.harness.counted_checks"
BUILDERS = {"ll": build_alltoallv_ll, "simple": build_alltoallv_simple, "zero_copy": build_alltoallv_zero_copy,
            "port": build_alltoallv_port}


def _json(pool, name: str) -> str:
    return plan_to_json(BUILDERS[name](pool.world_size))


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("row_bytes", [8, 48, 4096])
def test_random_counts_match_numpy(pool, name, row_bytes):
    for r in pool.run(f"{C}:alltoallv_random", _json(pool, name), row_bytes, 16, 20, 5):
        assert r["bad"] == 0, f"rank {r['rank']}: {r['bad']} wrong words"
        assert r["kernel"] == "interpreter"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_graph_replays_read_new_counts(pool, name):
    for r in pool.run(f"{C}:alltoallv_graph", _json(pool, name), 48, 16, 100, 2):
        assert r["bad"] == 0, f"rank {r['rank']}: {r['bad']} wrong words over {r['replays']} replays"


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("how,text", [
    ("capacity", r"count \[\d+\]\[0\] = 17 rows passes the capacity of 16 rows"),
    ("rows", r"rank \d+: its input segments hold \d+ rows .the counts it sends., more than its input's \d+ rows"),
    ("negative", r"count \[0\]\[\d+\] is -3"),
    ("expect", r"rank 0 expects 2 rows from rank \d+, rank \d+ sends 1"),
])
def test_bad_counts_raise_counts_error_on_every_rank(pool, name, how, text):
    import re

    if how == "capacity" and name == "zero_copy":
        pytest.skip("the zero-copy plan has no scratch slots (its bound is the peers' output rows)")
    for r in pool.run(f"{C}:alltoallv_bad_counts", _json(pool, name), how, reset_on_error=False):
        assert r["kind"] == "CountsError", f"rank {r['rank']}: {r['kind'] or 'nothing'} raised: {r['raised']}"
        assert re.search(text, r["raised"]), r["raised"]
        assert r["elapsed_s"] < 10 and r["written"] == 0
        assert r["after_reset_bad"] == 0


def test_communicator_all_to_all_v_in_a_cuda_graph(pool):
    """The public API on ordinary tensors: eager (with and without ``out``), then captured with
    ``torch.cuda.set_sync_debug_mode("error")`` and replayed 100 times with new counts."""
    for r in pool.run(f"{C}:communicator_alltoallv", 100):
        assert r["bad"] == 0, f"rank {r['rank']}: {r['bad']} of {r['replays']} replays wrong"
        assert r["plan"] is not None and r["plan"].startswith("alltoallv_"), r


def test_moe_dispatch_and_combine_in_a_cuda_graph(pool):
    """The MoE layer's exchanges captured with ``torch.cuda.set_sync_debug_mode("error")``,
    replayed 100 times with new tokens and routing: expert rows, counts and combined tokens exact."""
    for r in pool.run(f"{C}:communicator_moe", 100):
        assert r["bad"] == 0, f"rank {r['rank']}: {r['bad']} of {r['replays']} replays wrong"


def test_moe_token_bits_do_not_depend_on_the_batch(pool):
    """Token 0's combined bits within batches of 1, 5, 33 and 512 tokens, eager (expert-major) and
    in a CUDA graph (rank-major): the same in each."""
    for r in pool.run(f"{C}:moe_batch_invariance"):
        assert r["differ"] == [], f"rank {r['rank']}: token 0 differs at (T, layout) {r['differ']}"


def test_a_traced_all_to_all_v_shows_its_segments_rows(pool):
    """``comm.trace()`` around ``all_to_all_v``: both launches traced (the count exchange's
    all-gather, then the plan; none skipped), exact, and the plan's segment ops' events carry the
    rows of the count entries they moved."""
    for r in pool.run(f"{C}:communicator_alltoallv_traced"):
        assert r["exact"] and r["calls"] == ["allgather", "alltoallv"], r
        assert r["skipped"] == [] and r["problems"] == [], r
        assert r["segment_events"] > 0 and r["rows_ok"], r


def test_moe_routings_fp8_and_bad_input_eager(pool):
    """The simulator tests' routings (an expert with no token, one expert with every token, T = 1,
    capacity up to every token) and the FP8 payload, eager on ordinary tensors, exact against the
    one-process reference on every rank; each bad input refused on every rank in one line."""
    got = pool.run(f"{C}:moe_cases")
    for r in got:
        assert r["bad"] == [], f"rank {r['rank']}: {r['bad']}"
        assert all(r["refused"]), f"rank {r['rank']} ran a bad call: {r['refused']}"
    first = got[0]["refused"]
    assert "outside -1" in first[0] and "more than its capacity of 2" in first[1], first
    assert "experts per token is more than" in first[2] and "topk_idx must be [T, k]" in first[3], first


def test_fp8_rows_quantize_to_the_same_bytes_on_the_gpu_and_the_cpu():
    """``quantize_rows`` on a CUDA tensor gives the CPU's bytes, scales included, for rows whose
    maxima make ``max / 448`` differ from ``max * (1/448)`` (CUDA's division by a Python number)."""
    import torch

    from mscclang.comm.moe import quantize_rows

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 4096)[:, None]
    x[7] = 0
    cpu, gpu = quantize_rows(x), quantize_rows(x.cuda()).cpu()
    differ = (cpu != gpu).any(dim=1).nonzero().flatten().tolist()
    assert differ == [], f"{len(differ)} of 4096 rows differ, first {differ[:5]}"
