"""``mscclang run`` without (enough) GPUs: any world size verifies on the simulator and the exit
status says whether the plan is correct."""

from __future__ import annotations

from pathlib import Path

import pytest

from mscclang.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("name,odd", [("allreduce_twostep_ll.r8.i1.json", "3000"), ("allgather_ll.r8.i2.json", "3008"),
                                      ("allreduce_oneshot_ll.r4.i1.inplace.json", "3000")])
def test_run_verifies_n_rank_plans_on_the_simulator(name, odd, capsys):
    # odd: whole fp16 elements on every rank (an allgather's 3008 bytes are 188 per rank)
    path = ROOT / "plans" / name
    if not path.is_file():
        pytest.skip(f"no {path}")
    assert main(["run", str(path), "--size", "4K", "--size", odd]) == 0
    cap = capsys.readouterr()
    ranks = name.split(".r")[1].split(".")[0]
    assert f"the plan needs {ranks}" in cap.err
    assert "OK" in cap.out


def test_run_fails_on_a_broken_plan(capsys):
    path = ROOT / "tests" / "plans_broken" / "missing_wait.json"
    if not path.is_file():
        pytest.skip(f"no {path}")
    assert main(["run", str(path), "--size", "1K"]) == 1
    assert "OK" not in capsys.readouterr().out.split("\n")[0]


def test_run_counts_ranks_sharing_a_gpu(monkeypatch, capsys):
    """On one GPU with MSCCLANG_RANKS_PER_GPU=2, ``mscclang run`` of a 2-rank plan said "0 GPU(s)
    visible ... verifying on the simulator instead" (it counted GPUs, not the ranks they hold),
    so ``run --trace`` never ran on the shared GPU: it must start its worker pool."""
    import torch

    from mscclang.runtime import workers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("MSCCLANG_RANKS_PER_GPU", "2")
    assert workers.worker_capacity() == 2

    class Started(Exception):
        pass

    def pool(**kw):
        raise Started(kw)

    monkeypatch.setattr(workers, "WorkerPool", pool)
    with pytest.raises(Started):
        main(["run", str(ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.inplace.json"), "--size", "1K"])
    assert "verifying on the simulator" not in capsys.readouterr().err
