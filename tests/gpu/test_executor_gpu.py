"""GPU tests of the executor (``pytest -m gpu``): every op kind in small hand-built plans, both
packet types, four dtypes, sizes from 1 KiB to 256 MiB (odd ones too), back-to-back and CUDA-graph
launches, and the timeout/abort/reset protocol, at any world size (every visible GPU, or
MSCCLANG_TEST_WORLD). Outputs are compared bit for bit with the simulator up to 64 KiB (the
definition of the plan's reduction order) and with a torch reference: bit for bit where the order
cannot matter (copies, int32, min/max, 2 ranks), else within the error bound of a floating-point
sum in any order (``mscclang.cli.run_checks``, ``ref_mode`` 'bound').

Every test runs twice: with the interpreter kernel (policy 'never') and with the plan-specialised
kernels (policy 'always', asserting that the specialised kernel really ran)."""

from __future__ import annotations

import pytest

from mscclang.plan.io import plan_to_json
from mscclang.plan import samples as sp

pytestmark = pytest.mark.gpu

C = "tests.harness.runtime_checks"


def _json(pool, name):
    return plan_to_json(sp.SAMPLES[name](pool.world_size))


@pytest.fixture(params=["interpreter", "spec"])
def kernel(pool, request):
    """The kernel policy of the test: every worker's executor switched before, 'auto' after."""
    pool.run(f"{C}:set_specialize", "never" if request.param == "interpreter" else "always")
    yield request.param
    pool.run(f"{C}:set_specialize", "auto")


def _ok(results, kernel=None):
    for r in results:
        assert r["bad"] == 0, (f"rank {r['rank']}: {r['bad']} wrong elements ({r.get('ref_mode')}, simulator: "
                               f"{r.get('sim_bad')}), first {r.get('first_bad')}")
        if kernel is not None:
            assert r["kernel"] == kernel, f"rank {r['rank']} ran the {r['kernel']} kernel, not {kernel}: {r['spec']}"


LL_PLANS = ["allreduce_oneshot_ll", "allreduce_oneshot_ll_4b", "allreduce_twostep_ll", "allreduce_copyfwd_ll",
            "allreduce_copyfwd_ll_fused"]
SIMPLE_PLANS = ["allreduce_scratch_simple", "allreduce_read_simple", "allreduce_read_simple_fused",
                "allgather_simple", "allgather_pipeline", "allgather_put_4b"]


@pytest.mark.parametrize("name", LL_PLANS)
@pytest.mark.parametrize("packet", ["LL16", "LL8"])
def test_packet_plans(pool, name, packet, kernel):
    j = _json(pool, name)
    for nbytes in (1024, 4096 + 96, 65536):
        _ok(pool.run(f"{C}:run_plan_check", j, nbytes, "float16", packet), kernel)


@pytest.mark.parametrize("name", SIMPLE_PLANS)
def test_simple_plans(pool, name, kernel):
    j = _json(pool, name)
    for nbytes in (1024, 3000, 1 << 20):
        _ok(pool.run(f"{C}:run_plan_check", j, nbytes, "float16"), kernel)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int32"])
@pytest.mark.parametrize("op", ["sum", "min", "max"])
def test_dtypes_and_reduce_ops(pool, dtype, op, kernel):
    for name in ("allreduce_oneshot_ll", "allreduce_scratch_simple"):
        _ok(pool.run(f"{C}:run_plan_check", _json(pool, name), 8192 + 64, dtype, None, op), kernel)


@pytest.mark.parametrize("nbytes", [1024, 1000, 1 << 14, (1 << 20) + 6, 16 << 20, 256 << 20])
def test_sizes(pool, nbytes, kernel):
    if nbytes <= (1 << 20) + 6:
        _ok(pool.run(f"{C}:run_plan_check", _json(pool, "allreduce_oneshot_ll_4b"), nbytes, "bfloat16"), kernel)
    _ok(pool.run(f"{C}:run_plan_check", _json(pool, "allreduce_read_simple"), nbytes, "float16"), kernel)
    _ok(pool.run(f"{C}:run_plan_check", _json(pool, "allgather_simple"), nbytes // 2 // 16 * 16 or 16, "float32"), kernel)


def test_symmetric_and_inplace(pool, kernel):
    """Symmetric buffers, and in-place plans on the in-place layout (the check hands an in-place
    plan one buffer; the executor refuses separate ones)."""
    from pathlib import Path

    j = _json(pool, "allreduce_read_simple")
    _ok(pool.run(f"{C}:run_plan_check", j, 1 << 16, "float16", None, "sum", 5, False, True), kernel)
    n = pool.world_size
    root = Path(__file__).resolve().parents[2] / "plans"
    for i, name in enumerate((f"allreduce_oneshot_ll.r{n}.i1.inplace", f"allreduce_rsag_zero_copy.r{n}.i16.inplace",
                              f"allreduce_rsag_simple.r{n}.i16.inplace")):
        f = root / f"{name}.json"
        if not f.exists():
            continue
        for sym in (False, True):
            for nbytes in (1 << 12, (1 << 16) + 64):
                _ok(pool.run(f"{C}:run_plan_check", f.read_text(), nbytes, "float16", None, "sum", 6 + i, False, sym))


def test_back_to_back_eager(pool, kernel):
    res = pool.run(f"{C}:back_to_back", _json(pool, "allreduce_oneshot_ll"), 1024, 10000)
    _ok(res, kernel)
    res = pool.run(f"{C}:back_to_back", _json(pool, "allgather_simple"), 4096, 2000)
    _ok(res, kernel)


@pytest.mark.parametrize("packet", ["LL16", "LL8"])
def test_graph_replays(pool, packet, kernel):
    res = pool.run(f"{C}:back_to_back", _json(pool, "allreduce_oneshot_ll"), 1024, 1000, "float16", packet, True)
    _ok(res, kernel)


def test_graph_replays_simple(pool, kernel):
    _ok(pool.run(f"{C}:back_to_back", _json(pool, "allgather_simple"), 1 << 14, 1000, "float16", None, True), kernel)


def test_context_grows_alike_when_ranks_need_different_scratch(pool):
    """Rank 1 alone has scratch: its context grows at the larger size, and so must rank 0's (a
    collective step); each size exact against the simulator, eager then in a graph."""
    if pool.world_size != 2:
        pytest.skip("two-rank plan")
    from tests.harness import port_plans as pp

    j = plan_to_json(pp.sendrecv_memory_scratch())
    for nbytes in (1 << 14, 1 << 16, 1 << 18):
        res = pool.run("tests.harness.port_checks:graph_replays", j, nbytes, "int32", 2)
        assert all(r["bad"] == 0 for r in res), res


def test_timeout_then_reset(pool, kernel):
    bad = plan_to_json(sp.missing_signal(pool.world_size))
    good = _json(pool, "allreduce_oneshot_ll")
    res = pool.run(f"{C}:timeout_and_reset", bad, good, 1.0)
    for r in res:
        assert "gave up" in r["raised"], r
        assert r["raised_again"], r
        assert r["elapsed_s"] < 10.0, r
        assert r["after_reset_bad"] == 0, r
        assert r["kernel"] == kernel and r["after_reset_kernel"] == kernel, r


def test_kernels_take_turns_on_one_context(pool):
    """The specialised kernel and the interpreter alternate launch by launch on one context: same
    flags, scratch halves and counters, so every output stays right."""
    for name, nbytes in (("allreduce_oneshot_ll", 1024), ("allreduce_twostep_ll", 4096 + 96),
                         ("allreduce_scratch_simple", 8192), ("allgather_pipeline", 5000 // 16 * 16)):
        res = pool.run(f"{C}:alternate_kernels", _json(pool, name), nbytes, 64)
        for r in res:
            assert r["bad"] == 0, (name, r)
            assert r["kernels"] == ["interpreter", "spec"], (name, r)


def test_reference_modes(pool):
    """How outputs are checked at this world size: the simulator up to 64 KiB, then exact
    (2 ranks, int32) or the any-order summation bound (float sums over 3+ ranks)."""
    n = pool.world_size
    j = _json(pool, "allreduce_oneshot_ll")
    for nbytes, dtype in ((4096, "float16"), (1 << 20, "bfloat16"), (1 << 20, "int32")):
        res = pool.run(f"{C}:run_plan_check", j, nbytes, dtype)
        _ok(res)
        for r in res:
            assert (r["sim_bad"] is not None) == (nbytes <= 1 << 16), r
            want = "exact" if n == 2 or dtype == "int32" else "bound"
            assert r["ref_mode"] == want, r


def test_auto_policy_specialises_hot_sizes(pool):
    """'auto' above 256 KiB: the interpreter runs the first MSCCLANG_SPEC_HOT_CALLS calls of a size
    (the last of them starts the build off the calling thread), the specialised kernel every call
    once built, all outputs right across the switch."""
    from mscclang.config import settings

    hot = settings.spec_hot_calls
    for name, nbytes in (("allreduce_oneshot_ll", 1 << 20), ("allreduce_read_simple", (1 << 20) + 4096)):
        res = pool.run(f"{C}:hot_promotion", _json(pool, name), nbytes, hot + 3)
        for r in res:
            assert r["bad"] == 0, (name, r)
            # the hot call starts the build in the background and still runs the interpreter
            want = ["interpreter"] * hot + ["spec"] * 3
            assert r["built"] and r["kernels"] == want, (name, r)


def test_kernels_mix_across_ranks(pool):
    """Even ranks run the specialised kernel and odd ranks the interpreter in the same launches
    (one rank's build failing must not break the collective)."""
    for name, nbytes in (("allreduce_oneshot_ll", 1024), ("allreduce_twostep_ll", 4096 + 96),
                         ("allreduce_read_simple", 1 << 16), ("allgather_pipeline", 5000 // 16 * 16)):
        res = pool.run(f"{C}:mixed_kernels", _json(pool, name), nbytes, 16)
        for r in res:
            assert r["bad"] == 0, (name, r)
            assert r["kernels"] == ["spec" if r["rank"] % 2 == 0 else "interpreter"], (name, r)
