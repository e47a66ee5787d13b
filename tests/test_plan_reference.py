"""The one definition of every collective's result (mscclang.plan.reference)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mscclang.plan.reference import (
    COLLECTIVES, output_blocks, output_elems, reduce_arrays, reference_output, reference_outputs,
)


def _inputs(n: int, k: int, dtype=np.int32) -> list[np.ndarray]:
    return [(np.arange(k) + 100 * p).astype(dtype) for p in range(n)]


def test_allreduce_sum_min_max_in_rank_order():
    xs = _inputs(3, 4)
    assert reference_output("allreduce", xs, 1).tolist() == (xs[0] + xs[1] + xs[2]).tolist()
    assert reference_output("allreduce", xs, 0, "min").tolist() == xs[0].tolist()
    assert reference_output("allreduce", xs, 2, "max").tolist() == xs[2].tolist()


def test_copies_and_block_layouts():
    n, k = 3, 2
    xs = _inputs(n, n * k)
    assert reference_output("allgather", _inputs(n, k), 1).tolist() == np.concatenate(_inputs(n, k)).tolist()
    for r in range(n):
        a2a = reference_output("alltoall", xs, r)
        assert a2a.tolist() == np.concatenate([x[r * k:(r + 1) * k] for x in xs]).tolist()
        rs = reference_output("reducescatter", xs, r)
        assert rs.tolist() == sum(x[r * k:(r + 1) * k] for x in xs).tolist()
        assert reference_output("sendrecv", xs, r).tolist() == xs[(r - 1) % n].tolist()
        assert reference_output("broadcast", xs, r, root=2).tolist() == xs[2].tolist()
    assert [b.sources for b in output_blocks("alltoall", n, 1, n * k)] == [(0,), (1,), (2,)]
    assert output_elems("reducescatter", n, n * k) == k and output_elems("allgather", n, k) == n * k


def test_float_steps_round_to_the_element_type():
    # 1 + 2^-8 + 2^-8 in bfloat16 (8 significant bits): each step rounds back (a tie, to even), so the
    # small terms vanish; added first they make 2^-7, which survives
    one, tiny = np.array([1.0], ml_dtypes.bfloat16), np.array([2.0 ** -8], ml_dtypes.bfloat16)
    assert float(reduce_arrays([one, tiny, tiny])[0]) == 1.0
    assert float(reduce_arrays([tiny, tiny, one])[0]) == 1.0 + 2.0 ** -7


def test_int32_sums_wrap_around():
    big = np.array([2 ** 31 - 1], np.int32)
    assert reference_output("allreduce", [big, np.array([1], np.int32)], 0).tolist() == [-2 ** 31]


@pytest.mark.parametrize("coll", COLLECTIVES)
def test_every_collective_gives_every_rank_an_output(coll):
    outs = reference_outputs(coll, _inputs(4, 8, np.float16))
    assert len(outs) == 4 and all(o.dtype == np.float16 for o in outs)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no reference for collective 'gather'"):
        reference_output("gather", _inputs(2, 2), 0)
    with pytest.raises(ValueError, match="divisible by the world size 3"):
        reference_output("alltoall", _inputs(3, 4), 0)
    with pytest.raises(ValueError, match="broadcast root 5"):
        reference_output("broadcast", _inputs(2, 2), 0, root=5)
    with pytest.raises(ValueError, match="reduce op 'prod'"):
        reference_output("allreduce", _inputs(2, 2), 0, "prod")
    with pytest.raises(ValueError, match="input of rank 1"):
        reference_output("allreduce", [np.zeros(2, np.int32), np.zeros(3, np.int32)], 0)


@pytest.mark.parametrize("coll", ["alltoall", "reducescatter", "broadcast", "sendrecv"])
def test_run_checks_expect_every_collective(coll):
    """``mscclang run``'s check (and the GPU tests through it) has a reference for every
    collective, alltoall included (it once raised "no reference for collective 'alltoall'")."""
    import torch

    from mscclang.cli.run_checks import expectation
    from mscclang.comm.sim_ranks import stub_plan

    n = 3
    plan = stub_plan(coll, n, root=1)
    xs = [torch.arange(6, dtype=torch.int32) + 100 * p for p in range(n)]
    for r in range(n):
        exp = expectation(plan, xs, "sum", r)
        want = reference_output(coll, [x.numpy() for x in xs], r, root=plan.root)
        assert exp.how == "exact" and exp.exact.tolist() == want.tolist()
    f16 = [x.to(torch.float16) for x in xs]
    if coll == "reducescatter":  # a float sum over 3 ranks: the any-order bound over this rank's block
        exp = expectation(plan, f16, "sum", 2)
        assert exp.how == "bound" and exp.approx.tolist() == [312.0, 315.0]
