"""``mscclang run``'s sizes and flags (issue 34, items 4, 5 and 17): a size is the plan's
message size, as ``verify`` reads it (one help text), refused on either path when it is not whole
elements per rank; without GPUs every flag with a simulator meaning reaches the simulator, the
others are named, and the summary lists what ran."""

from __future__ import annotations

import re

import pytest

from mscclang.cli.args import MESSAGE_SIZE

from tests.harness.cli import cli_inproc
from tests.harness.shipped import PLANS_DIR

AR2 = PLANS_DIR / "allreduce_oneshot_ll.r2.i1.inplace.json"
RS2 = PLANS_DIR / "reducescatter_simple.r2.i16.json"
AG4 = PLANS_DIR / "allgather_ll.r4.i1.json"


@pytest.fixture
def no_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


class FakePool:
    """Stands in for the GPU workers: records every command, answers as a correct run would."""

    calls: list[tuple] = []

    def __init__(self, world_size: int, **kw) -> None:
        self.world_size = world_size

    def __enter__(self) -> "FakePool":
        return self

    def __exit__(self, *a) -> None:
        pass

    def run(self, target: str, *args):
        FakePool.calls.append((target.split(":")[1], *args))
        return [{"bad": 0, "ref_mode": "exact", "sim_bad": 0, "us_per_call": 1.0, "us_per_launch": 1.0}] * self.world_size


@pytest.fixture
def gpus(monkeypatch):
    from mscclang.runtime import workers

    FakePool.calls = []
    monkeypatch.setattr(workers, "worker_capacity", lambda: 8)
    monkeypatch.setattr(workers, "WorkerPool", FakePool)
    return FakePool


@pytest.mark.parametrize("plan,size,dtype,words", [
    (RS2, "6", "fp32", "each rank's input of a reducescatter over 2 ranks would be 6 bytes, not a whole number of float32"),
    (RS2, "6", "fp16", "each rank's output (1/2 of the message) of a reducescatter over 2 ranks would be 3 bytes"),
    (AR2, "6", "fp32", "each rank's input of an allreduce over 2 ranks would be 6 bytes, not a whole number of float32"),
    (AG4, "4K,1001", "fp16", "each rank's input (1/4 of the message) of an allgather over 4 ranks would be 250.25 bytes"),
])
@pytest.mark.parametrize("where", ["no_gpus", "gpus"])
def test_run_refuses_a_size_of_split_elements_on_either_path(plan, size, dtype, words, where, request, capsys):
    request.getfixturevalue(where)
    res = cli_inproc(capsys, "run", str(plan), "--sizes", size, "--dtype", dtype)
    assert res.returncode == 1 and res.stdout == "", res.stdout
    assert res.stderr.startswith("mscclang run: error: message size ") and words in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1
    assert where == "no_gpus" or FakePool.calls == []


def test_run_on_gpus_takes_the_allgather_size_as_verify_does(gpus, capsys):
    # 4K of an allgather over 4 ranks: 1K of input per rank, 4K of output (verify's meaning)
    res = cli_inproc(capsys, "run", str(AG4), "--sizes", "4K", "--iters", "10")
    assert res.returncode == 0, res.stderr
    assert {c[0]: c[2] for c in gpus.calls} == {"run_plan_check": 1024, "time_eager": 1024}
    assert re.search(r"^\s+4096 ", res.stdout, re.M), res.stdout


def test_run_and_verify_help_say_the_same_of_a_size(capsys):
    flat = " ".join(MESSAGE_SIZE.split())
    for cmd in ("run", "verify"):
        text = " ".join(cli_inproc(capsys, cmd, "--help").stdout.split())
        assert f"message sizes ({flat})" in text, (cmd, text)


def test_run_without_gpus_passes_the_simulator_flags(no_gpus, capsys):
    res = cli_inproc(capsys, "run", str(AR2), "--sizes", "1K", "--dtype", "fp32", "--reduce-op", "max",
                     "--packet-type", "ll8")
    assert res.returncode == 0, res.stderr
    ran = res.stdout.splitlines()[1]
    assert "sizes 1K; dtypes float32; reduce ops max; packets LL8;" in ran, ran
    assert "not applied" not in res.stderr


def test_run_without_gpus_names_the_flags_it_does_not_apply(no_gpus, capsys):
    res = cli_inproc(capsys, "run", str(RS2), "--sizes", "1K", "--graph", "--iters", "5", "--timeout", "3")
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "not applied on the simulator" in ln]
    assert lines == ["mscclang run: --graph, --iters, --timeout: not applied on the simulator (GPU launches "
                     "only: their timing and the bound of their waits)"], res.stderr
    # the summary describes what ran: float16 (run's default), every reduce op, no packets (Simple)
    ran = res.stdout.splitlines()[1]
    assert "dtypes float16; reduce ops sum, min, max; 3 schedules" in ran and "packets" not in ran, ran
    quiet = cli_inproc(capsys, "run", str(RS2), "--sizes", "1K")
    assert quiet.returncode == 0 and "not applied" not in quiet.stderr


def test_run_s_default_sizes_stay_inside_the_plan_s_range(no_gpus, capsys):
    """The default sizes (1K and 1M) are clipped to the plan's message range: a plan whose
    smallest message is 1 MiB runs at 1 MiB only (the GPU runtime refuses 1 KiB there)."""
    plan = PLANS_DIR / "allreduce_rsag_pipelined.r4.i8.json"
    res = cli_inproc(capsys, "run", str(plan))
    assert res.returncode == 0, res.stderr
    assert "sizes 1M;" in res.stdout.splitlines()[1], res.stdout
