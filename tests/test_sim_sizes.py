"""A message size is whole elements of the dtype on every rank, and, where the collective splits
the message over the ranks, in each rank's share (issue 34, item 4): one rule
(:func:`mscclang.sim.runner.message_to_bytes`), refused with the size, the dtype and the rank count
wherever a size can be given: ``mscclang.sim.run``, ``mscclang.sim.verify``, ``verify --sizes``
(``run --sizes``: tests/test_cli_run_sim.py)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mscclang.errors import VerificationError
from mscclang.plan.dtypes import SIM_DTYPES
from mscclang.plan.io import load_plan
from mscclang.sim import default_sizes, run, verify
from mscclang.sim.dtypes import parse_dtype
from mscclang.sim.planbuilder import PlanBuilder
from mscclang.sim.runner import message_to_bytes, message_unit

from tests.harness.cli import cli_inproc
from tests.harness.shipped import PLANS_DIR, one_per_algorithm

RS2 = PLANS_DIR / "reducescatter_simple.r2.i16.json"
AR2 = PLANS_DIR / "allreduce_oneshot_ll.r2.i1.inplace.json"


def _expected(collective: str, n: int, size: int) -> list[Fraction]:
    """Every buffer and share of one rank for a message of ``size`` bytes, by the collectives'
    definitions (docs/semantics.md), written out independently of the code under test."""
    s = Fraction(size)
    return {"allgather": [s / n, s], "reducescatter": [s, s / n], "alltoall": [s, s, s / n]}.get(collective, [s, s])


@pytest.mark.parametrize("collective", ["allgather", "reducescatter", "alltoall", "allreduce", "broadcast",
                                        "sendrecv"])
@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("dtype", ["uint8", "float16", "float32"])
def test_a_size_is_accepted_exactly_when_every_buffer_and_share_is_whole_elements(collective, n, dtype):
    plan = PlanBuilder("p", collective, n, n, n).build()
    k = parse_dtype(dtype).itemsize
    unit = message_unit(plan, dtype)
    for size in range(1, 3 * n * k + 1):
        parts = _expected(collective, n, size)
        whole = all(x.denominator == 1 and x.numerator % k == 0 for x in parts)
        assert (size % unit == 0) == whole, (size, unit)
        if whole:
            assert message_to_bytes(plan, size, dtype) == (int(parts[0]), int(parts[1]))
            continue
        with pytest.raises(VerificationError) as e:
            message_to_bytes(plan, size, dtype)
        msg = str(e.value)
        assert f"message size {size} bytes" in msg and dtype in msg and f"over {n} ranks" in msg, msg
        assert f"use a multiple of {unit} bytes" in msg, msg


def test_a_custom_plans_output_follows_its_chunk_ratio():
    plan = PlanBuilder("p", "custom", 2, 4, 2).build()   # the output is half the input
    assert message_to_bytes(plan, 8, "float16") == (8, 4)
    with pytest.raises(VerificationError, match="output .* would be 3 bytes"):
        message_to_bytes(plan, 6, "float16")


def test_sim_run_refuses_inputs_whose_share_is_not_whole_elements():
    # the case: 3 fp16 elements per rank of a 2-rank reduce-scatter (1.5 elements out)
    with pytest.raises(VerificationError, match=r"message size 6 bytes.*reducescatter over 2 ranks.*float16"):
        run(load_plan(RS2), [np.ones(3, np.float16)] * 2)
    outs = run(load_plan(RS2), [np.ones(4, np.float16)] * 2)
    assert [o.tolist() for o in outs] == [[2.0, 2.0], [2.0, 2.0]]
    with pytest.raises(VerificationError, match="output_bytes must be a whole number of float16"):
        run(load_plan(AR2), [np.ones(4, np.float16)] * 2, output_bytes=7)


def test_verify_refuses_a_size_of_split_elements_before_any_run():
    calls = []
    with pytest.raises(VerificationError, match=r"message size 6 bytes.*over 2 ranks.*float16"):
        verify(load_plan(RS2), sizes=[6], dtypes=["fp16"], progress=lambda d, t: calls.append(d))
    assert calls == []
    # every dtype given (or the default list) must fit: float32 does not divide 6 bytes
    with pytest.raises(VerificationError, match=r"message size 6 bytes.*allreduce over 2 ranks.*float32"):
        verify(load_plan(AR2), sizes=[6])
    assert verify(load_plan(AR2), sizes=[6], dtypes=["fp16", "bf16"], schedules=2).ok


def test_verify_cli_refuses_the_size_in_one_line(capsys):
    res = cli_inproc(capsys, "verify", str(RS2), "--sizes", "6", "--dtype", "fp16")
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.startswith("mscclang verify: error: message size 6 bytes: each rank's output (1/2 of the "
                                 "message) of a reducescatter over 2 ranks would be 3 bytes, not a whole number of "
                                 "float16 elements"), res.stderr
    assert res.stderr.count("\n") == 1


@pytest.mark.parametrize("path", one_per_algorithm(), ids=lambda p: p.name.split(".")[0])
def test_default_sizes_are_whole_elements_of_every_dtype(path):
    plan = load_plan(path)
    for size in default_sizes(plan):
        for dtype in SIM_DTYPES:
            message_to_bytes(plan, size, dtype)
