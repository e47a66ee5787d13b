"""The MSCCL++-style programs in tests/programs/: run as scripts (``--num_gpus`` etc.), their
printed ``JSON()`` must load, pass the plan checks, have the expected shape and match the golden
files in tests/golden/ (regenerate with MSCCLANG_REGEN_GOLDEN=1)."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from mscclang.plan import load_plan
from mscclang.plan.check import validate_plan
from mscclang.plan.models import OpName

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).parent / "programs"
GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("MSCCLANG_REGEN_GOLDEN") == "1"
NAMES = ["allgather_simple", "allreduce_ll_oneshot", "allreduce_ll_twostep"]


def run_program(name: str, *args: str) -> str:
    """Run tests/programs/<name>.py in-process with the given argv; return what it printed."""
    buf = io.StringIO()
    old = sys.argv
    sys.argv = [str(PROGRAMS / f"{name}.py"), *args]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(str(PROGRAMS / f"{name}.py"), run_name="__main__")
    finally:
        sys.argv = old
    return buf.getvalue()


def ops_of(plan, rank, tb):
    return [o.name for o in plan.gpus[rank].threadblocks[tb].ops]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [2, 8])
def test_program_compiles_checks_and_matches_golden(name, n):
    text = run_program(name, "--num_gpus", str(n))
    plan = load_plan(text)
    validate_plan(plan)
    assert plan.num_ranks == n and len(plan.gpus) == n
    assert text == run_program(name, "--num_gpus", str(n))
    path = GOLDEN / f"prog_{name}_{n}.json"
    if REGEN:
        path.write_text(text)
    assert path.exists(), f"missing {path}; run with MSCCLANG_REGEN_GOLDEN=1"
    assert text == path.read_text()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_program_instances(name, k):
    one = load_plan(run_program(name, "--num_gpus", "4"))
    plan = load_plan(run_program(name, "--num_gpus", "4", "--instances", str(k)))
    validate_plan(plan)
    for g1, gk in zip(one.gpus, plan.gpus):
        assert len(gk.threadblocks) == k * len(g1.threadblocks)
        assert (gk.input_chunks, gk.output_chunks, gk.scratch_chunks) == (
            k * g1.input_chunks, k * g1.output_chunks, k * g1.scratch_chunks)
        assert gk.peers(g1.channels[0].channel_type) == [p for p in g1.peers(g1.channels[0].channel_type)
                                                          for _ in range(k)]
        for t, tb in enumerate(g1.threadblocks):
            for i in range(k):
                assert [o.name for o in gk.threadblocks[t * k + i].ops] == [o.name for o in tb.ops]


def test_allgather_shape():
    plan = load_plan(run_program("allgather_simple", "--num_gpus", "8"))
    assert plan.collective == "allgather" and plan.inplace and plan.protocol == "Simple"
    for r in range(8):
        assert len(plan.gpus[r].threadblocks) == 7
        assert [o.value for o in ops_of(plan, r, 0)] == ["rlxsignal", "rlxwait", "nop", "put", "nop", "signal", "wait", "nop"]
        peers = plan.gpus[r].peers(plan.gpus[r].channels[0].channel_type)
        assert sorted(peers) == [p for p in range(8) if p != r]


def test_oneshot_shape():
    n = 8
    plan = load_plan(run_program("allreduce_ll_oneshot", "--num_gpus", str(n)))
    assert plan.protocol == "LL" and plan.use_double_scratch_buffer and plan.reduce_op.value == "sum"
    g = plan.gpus[3]
    first = g.threadblocks[0].ops[0]
    assert first.name == OpName.ppkt and len(first.dst_buff) == n - 1  # fused multi-destination put
    for t in range(n):
        red = [o for o in g.threadblocks[t].ops if o.name == OpName.repkt]
        assert len(red) == 1 and len(red[0].src_buff) == n  # own input + n-1 packet slots
        assert red[0].dst_buff[0].type.value == "o" and red[0].dst_buff[0].index == t


def test_twostep_shape_matches_mscclpp_annotated_example():
    plan = load_plan(run_program("allreduce_ll_twostep", "--num_gpus", "2"))
    assert ops_of(plan, 0, 0) == [OpName.ppkt, OpName.respkt]
    assert ops_of(plan, 0, 1) == [OpName.respkt, OpName.upkt]
    respkt = plan.gpus[0].threadblocks[0].ops[1]
    assert [(b.type.value if b.type else None, b.index) for b in respkt.src_buff] == [("i", 0), ("s", 0)]
    assert respkt.dst_buff[1].buffer_id == 0 and respkt.dst_buff[1].index == 2
    plan8 = load_plan(run_program("allreduce_ll_twostep", "--num_gpus", "8"))
    for t in range(8):
        assert OpName.respkt in ops_of(plan8, 5, t)


def test_program_as_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(PROGRAMS / "allgather_simple.py"), "--num_gpus", "2",
                          "--name", "ag2"], capture_output=True, text=True, env=env, check=True)
    plan = load_plan(res.stdout)
    assert plan.name == "ag2"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n, k", [(2, 1), (4, 1), (4, 2)])
def test_program_verifies_in_simulator(name, n, k):
    """Integration with mscclang.sim: no deadlock, no race, correct outputs (numeric and symbolic)."""
    sim = pytest.importorskip("mscclang.sim")
    plan = load_plan(run_program(name, "--num_gpus", str(n), "--instances", str(k)))
    report = sim.verify(plan, schedules=4)
    assert report.ok, str(report)
