"""GPU tests of batch invariance (``pytest -m gpu tests/gpu``; 2, 4 or 8 ranks sharing one GPU with
``MSCCLANG_RANKS_PER_GPU``): a Communicator in the batch-invariant mode gives every element the
canonical result of ``mscclang.reference`` bit for bit (docs/semantics.md, "Batch invariance"):
``all_reduce`` and ``reduce_scatter`` from 1 to 64M elements (every plan the selector picks) in
bf16, fp16, fp32 and fp8 e4m3 accumulating in fp32 and in fp16, on ordinary tensors, in CUDA
graphs and on symmetric tensors, with 0 differing elements and never torch.distributed; and the
fused ``all_reduce_add_rms_norm``: row 0 of the output and of the residual the same bits at every
T in {1, 7, 64, 129, 512, 2048, 4096} and H in {1024, 4096, 8192}. Reuses the session's worker
pool (tests/gpu/conftest.py); every rank computes the reference of its own output on the CPU
(tests/harness/invariance_checks.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

H = "tests.harness.invariance_checks"
#: the dtype cases of tests/harness/invariance_checks.py (dtype or dtype/accumulation dtype)
DTYPE_CASES = ("bfloat16", "float16", "float32", "float8_e4m3fn/float32", "float8_e4m3fn/float16")


def _no_difference(results: list) -> set:
    """Asserts no rank failed and no element differs anywhere (listing the cases that differ,
    with the rank and the count); returns the plans that ran."""
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:20])
    assert results and all(r["differing"] for r in results), "a rank checked nothing"
    bad = [f"rank {r['rank']}: {case}: {k} differing element(s)" for r in results
           for case, k in r["differing"].items() if k]
    plans = {str(p) for r in results for p in r["plans"].values()}
    print(f"\n{len(plans)} plans: {sorted(plans)}")
    assert not bad, f"{len(bad)} results differ from mscclang.reference:\n" + "\n".join(bad[:40])
    return plans


@pytest.mark.parametrize("dtype", DTYPE_CASES)
def test_every_element_of_all_reduce_and_reduce_scatter_is_the_canonical_result(pool, dtype: str) -> None:
    _no_difference(pool.run(f"{H}:check_collectives", dtype))


@pytest.mark.parametrize("dtype,quant", [("bfloat16", False), ("float16", False), ("bfloat16", True)])
def test_fused_row_0_has_the_same_bits_at_every_token_count(pool, dtype: str, quant: bool) -> None:
    _no_difference(pool.run(f"{H}:check_fused_rows", dtype, quant))


@pytest.mark.parametrize("ranks", [3, 5, 6, 7])
def test_avg_divides_as_the_reference_defines_it(ranks: int) -> None:
    """The torch backend's avg is the sum, then ``div_`` by the rank count: on a CUDA tensor torch
    multiplies by the fp32 reciprocal, which mscclang.reference's avg reproduces (for 3, 5, 6
    and 7 ranks it differs from the quotient torch computes on the CPU). One GPU, no pool."""
    import torch

    from mscclang.comm.sim_backend import torch_to_numpy
    from mscclang.plan.reference import average
    from tests.harness.data import spread

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        s = spread(1 << 20, dt, 7, device="cuda")
        got = torch_to_numpy(s.clone().div_(ranks).cpu())   # what the backend's avg does after the sum
        want = average(torch_to_numpy(s.cpu()), ranks)
        differ = int((got.view(f"u{dt.itemsize}") != want.view(f"u{dt.itemsize}")).sum())
        assert differ == 0, f"{dt}: {differ} elements of the CUDA division differ from mscclang.reference's avg"
