"""examples/graph_allreduce.py (the issue's user-API measurement) on the CPU: its arguments, the
table on made-up figures, its result files, the clean skip without GPUs, the check data (exact at
2, 4 and 8 ranks whatever the summation order), the public Communicator calls it makes (on the
CPU simulator), and its whole per-rank flow over a 2-process gloo group with a stand-in graph."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "graph_allreduce.py"
K, M = 1 << 10, 1 << 20


def _load() -> ModuleType:
    name = "graph_allreduce_example"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod   # dataclasses resolve their module while the file runs
    spec.loader.exec_module(mod)
    return mod


ga = _load()


# ------------------------------------------------------------------------------ arguments

def test_arguments_defaults_quick_and_lists():
    a = ga.parse_args([])
    assert a.sizes == [K, 64 * K, 256 * K, M, 4 * M, 16 * M, 64 * M] == sorted(ga.GOALS_US)
    assert (a.calls, a.replays, a.kinds, a.align, a.nproc) == (50, 5, list(ga.KINDS), "device", None)
    assert ga.parse_args(["--quick"]).sizes == [K, M, 64 * M]
    assert ga.parse_args(["--quick", "--sizes", "4K"]).sizes == [4 * K]   # explicit sizes win
    assert ga.parse_args(["--sizes", "64K,1K", "4M", "1KiB"]).sizes == [K, 64 * K, 4 * M]
    assert ga.parse_args(["--kinds", "nccl,symmetric"]).kinds == ["symmetric", "nccl"]   # table order
    a = ga.parse_args(["--nproc", "2", "--json", "o.json", "--calls", "10", "--replays", "3", "--align", "host"])
    assert (a.nproc, a.json, a.calls, a.replays, a.align) == (2, "o.json", 10, 3, "host")


@pytest.mark.parametrize("argv", [["--sizes", "3"], ["--sizes", "1X"], ["--sizes", "0"], ["--kinds", "mpi"],
                                  ["--kinds", ","], ["--calls", "0"], ["--replays", "0"], ["--nproc", "1"],
                                  ["--align", "gpu"], ["--timeout", "0"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        ga.parse_args(argv)
    assert e.value.code == ga.EXIT_USAGE
    assert "error:" in capsys.readouterr().err


def test_nvlink_multicast_stays_off():
    env: dict = {}
    ga.nvlink_multicast_guard(env)
    assert env["NCCL_NVLS_ENABLE"] == "0"
    ga.nvlink_multicast_guard({"NCCL_NVLS_ENABLE": "0", "MSCCLANG_ENABLE_NVLS": "0"})
    for bad in ({"NCCL_NVLS_ENABLE": "1"}, {"MSCCLANG_ENABLE_NVLS": "1"}):
        with pytest.raises(ga.UsageError, match="NVLS"):
            ga.nvlink_multicast_guard(dict(bad))


def test_main_refuses_nvlink_multicast_and_bad_files(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert ga.main(["--quick"]) == ga.EXIT_USAGE
    assert "NVLink multicast" in capsys.readouterr().err
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    monkeypatch.setenv("MSCCLANG_ENABLE_NVLS", "1")
    assert ga.main(["--quick"]) == ga.EXIT_USAGE
    monkeypatch.delenv("MSCCLANG_ENABLE_NVLS")
    (tmp_path / "bad.json").write_text("{")
    assert ga.main(["--bench-json", str(tmp_path / "bad.json")]) == ga.EXIT_USAGE
    assert ga.main(["--from-json", str(tmp_path / "bad.json")]) == ga.EXIT_USAGE
    assert "cannot read" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the table

def _fake_results() -> list:
    R = ga.CellResult
    out = []
    figures = {K: (1.90, 3.10, 9.80, 5.90), 64 * K: (2.95, 4.00, 10.2, 7.40), M: (6.50, 9.00, 19.5, 11.1),
               3 * M: (12.0, 15.0, 30.0, 20.0), 64 * M: (200.0, 230.0, 247.0, 216.0)}
    for size, us in figures.items():
        for kind, t in zip(ga.KINDS, us):
            r = R(size, kind, us=t, us_ranks=[t, t - 0.01], replays_us=[t] * 5, graph_check="exact",
                  eager_err_exact=0.0039, eager_err_nccl=0.0, eager_bit_exact_nccl=True,
                  plan="allreduce_oneshot_ll.r2.i1.inplace (direct)" if kind in ga.MSCCLANG_KINDS else None)
            out.append(r)
    by = {(r.size, r.kind): r for r in out}
    by[(M, "ordinary")].plan = "nccl"                       # the library handed it to NCCL
    sym = by[(64 * M, "symm")]
    sym.us, sym.skipped = None, "torch 2.4 has no SymmetricMemory two-shot allreduce"
    bad = by[(3 * M, "ordinary")]
    bad.us, bad.error = None, "eager check: rank 1: AssertionError: 3 of 1572864 elements | wrong"
    by[(64 * K, "symmetric")].eager_bit_exact_nccl = False
    by[(64 * K, "symmetric")].eager_err_nccl = 0.0078
    return out


def test_table_on_fake_numbers():
    meta = {"device": "NVIDIA H200", "world_size": 2, "torch": "2.11.0", "nccl": "2.28.9", "calls": 50,
            "replays": 5, "nccl_nvls_enable": "0", "align": "device"}
    text = ga.format_table(_fake_results(), meta, bench={K: 1.88, 64 * K: 2.95})
    lines = text.splitlines()
    assert lines[0].startswith("Allreduce, bfloat16, in place, CUDA graph of 50 calls, median of 5 replays")
    assert "NVIDIA H200, 2 ranks, torch 2.11.0, NCCL 2.28.9" in lines[0] and "NCCL_NVLS_ENABLE=0" in lines[0]
    head = next(x for x in lines if x.startswith("| size |"))
    assert head.split(" | ")[1:] == ["mscclang, symmetric tensor (comm.empty)", "mscclang, ordinary tensor", "NCCL",
                                     "torch symm two-shot", "ordinary / symmetric", "symmetric / NCCL",
                                     "bench: mscclang", "goal", "symmetric vs goal", "ordinary vs goal |"]
    first = lines.index(head) + 2
    timing = lines[first:lines.index("", first)]
    row = {x.split(" | ")[0][2:]: x for x in timing}
    assert list(row) == ["1K", "64K", "1M", "3M", "64M"]
    assert row["1K"] == "| 1K | 1.90 | 3.10 | 9.80 | 5.90 | 1.63 | 0.19 | 1.88 | <= 2 | met | MISSED |"
    assert row["64K"] == "| 64K | 2.95 | 4.00 | 10.20 | 7.40 | 1.36 | 0.29 | 2.95 | <= 2.7 | MISSED | MISSED |"
    assert row["1M"].endswith("| <= 7 | met | MISSED (handed to NCCL) |")
    assert row["3M"] == "| 3M | 12.00 | FAILED | 30.00 | 20.00 | - | 0.40 | - | - | - | - |"   # no goal at 3M
    assert row["64M"] == "| 64M | 200.00 | 230.00 | 247.00 | n/a | 1.15 | 0.81 | - | <= 195 | MISSED | MISSED |"
    assert "Goals met (symmetric tensor): 2 of 4." in text
    checks = [x for x in lines if x.startswith("| ") and x.count(" | ") == 6]
    assert checks[0] == "| size | kind | plan | eager: max err vs exact | eager: vs NCCL | graph replay | problem |"
    assert "| 64K | symmetric | allreduce_oneshot_ll.r2.i1.inplace (direct) | 0.0039 | max err 0.0078 | exact |  |" in text
    assert "| 1K | nccl | - | 0.0039 | bit-identical | exact |  |" in text
    assert "| 64M | symm | - | 0.0039 | bit-identical | exact | skipped: torch 2.4 has no SymmetricMemory" in text
    assert "3 of 1572864 elements / wrong |" in text      # a '|' in a message never breaks the table
    # without the ordinary kind: no ordinary ratio, '-' for its verdicts
    only = [r for r in _fake_results() if r.kind in ("symmetric", "nccl")]
    t2 = ga.format_table(only)
    assert "ordinary / symmetric" not in t2 and "| 1K | 1.90 | 9.80 | 0.19 | <= 2 | met | - |" in t2


def test_goal_verdicts_and_exit_codes():
    R = ga.CellResult
    assert ga.goal_verdict(R(K, "symmetric", us=2.0), 2.0) == "met"
    assert ga.goal_verdict(R(K, "symmetric", us=2.01), 2.0) == "MISSED"
    assert ga.goal_verdict(R(K, "symmetric", us=1.0, plan="nccl"), 2.0) == "MISSED (handed to NCCL)"
    assert ga.goal_verdict(R(K, "symmetric", error="x"), 2.0) == "not measured"
    assert ga.goal_verdict(R(3 * K, "symmetric", us=1.0), None) == "-"
    ok, skipped = R(K, "nccl", us=9.0), R(K, "symm", skipped="no two-shot")
    assert ga.exit_code([ok, skipped]) == ga.EXIT_OK
    assert ga.exit_code([ok, R(K, "ordinary", error="check")]) == ga.EXIT_FAILED
    assert ga.exit_code([skipped]) == ga.EXIT_FAILED and ga.exit_code([]) == ga.EXIT_FAILED


def test_json_round_trip_and_from_json(tmp_path, capsys):
    res = _fake_results()
    meta = {"world_size": 2, "calls": 50, "replays": 5}
    p = tmp_path / "out.json"
    ga.save_json(str(p), res, meta)
    back, meta2 = ga.load_json(str(p))
    assert [r.to_dict() for r in back] == [r.to_dict() for r in res] and meta2 == meta
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"format": "mscclang.bench/1", "meta": {}, "results": [
        {"coll": "all_reduce", "impl": "mscclang", "mode": "graph", "bytes": K, "us": 1.88, "ok": True},
        {"coll": "all_reduce", "impl": "nccl", "mode": "graph", "bytes": K, "us": 17.0, "ok": True},
        {"coll": "all_reduce", "impl": "mscclang", "mode": "eager", "bytes": K, "us": 18.9, "ok": True},
        {"coll": "all_gather", "impl": "mscclang", "mode": "graph", "bytes": K, "us": 2.3, "ok": True}]}))
    assert ga.load_bench(str(bench)) == {K: 1.88}
    # the fake results hold a failed cell: status 1, and the table is printed all the same
    assert ga.main(["--from-json", str(p), "--bench-json", str(bench)]) == ga.EXIT_FAILED
    out = capsys.readouterr().out
    assert "| 1K | 1.90 | 3.10 | 9.80 | 5.90 | 1.63 | 0.19 | 1.88 | <= 2 | met | MISSED |" in out
    (tmp_path / "other.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(ga.UsageError, match="not a graph_allreduce result"):
        ga.load_json(str(tmp_path / "other.json"))


# ------------------------------------------------------------------------------ no GPUs

def test_skips_cleanly_without_gpus(monkeypatch, capsys):
    monkeypatch.setattr(ga, "gpu_count", lambda: 0)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert ga.main(["--quick"]) == ga.EXIT_SKIPPED == 0
    err = capsys.readouterr().err
    assert "skipped: needs at least 2 CUDA GPUs" in err and "Nothing was measured" in err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert ga.under_torchrun()
    assert ga.main([]) == 0
    assert "skipped: needs at least 2 CUDA GPUs" in capsys.readouterr().err


def test_more_processes_than_gpus_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(ga, "gpu_count", lambda: 2)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert ga.main(["--nproc", "4"]) == ga.EXIT_USAGE
    assert "--nproc 4: only 2 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("torchrun", [False, True], ids=["plain", "torchrun-env"])
def test_script_skips_cleanly_as_a_process(torchrun):
    """The script itself, as a user runs it, on a machine (or with CUDA hidden) without GPUs."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NCCL_NVLS_ENABLE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if torchrun:
        env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "graph_allreduce: skipped: needs at least 2 CUDA GPUs" in p.stderr and "Traceback" not in p.stderr


# ------------------------------------------------------------------------------ check data

def _allreduce_bf16_partials(xs: list, order: list[int]) -> Any:
    """Sum ``xs`` in ``order``, rounding every partial sum to bf16 (the least exact way a
    reduction can go: ring reduce-scatter passes bf16 partial sums between ranks)."""
    acc = xs[order[0]].float()
    for i in order[1:]:
        acc = (acc + xs[i].float()).to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_graph_check_is_exact_in_any_summation_order(world):
    calls, numel = 50, 4096
    xs = [ga.graph_input(numel, r, world, calls, "cpu") for r in range(world)]
    g = torch.Generator().manual_seed(world)
    # every rank's buffer after each in-place call: the sum of all ranks' buffers, each rank
    # summing in its own order with bf16 partial sums
    for _ in range(calls):
        outs = [_allreduce_bf16_partials(xs, torch.randperm(world, generator=g).tolist()) for _ in range(world)]
        xs = outs
    want = ga.graph_expected(numel, world, calls, "cpu")
    for x in xs:
        assert ga.check_graph_result(x, want, world, calls) == "exact"
    assert float(want.abs().max()) > 2.0 ** 40 and bool(torch.isfinite(want).all())
    wrong = xs[0].clone()
    wrong[17] = -wrong[17] if float(wrong[17]) else 1.0
    with pytest.raises(AssertionError, match="first at 17"):
        ga.check_graph_result(wrong, want, world, calls)


def test_graph_check_bounds():
    assert ga.pattern_params(2, 50) == (4, 0) and ga.pattern_params(8, 50)[1] < 0
    with pytest.raises(ga.UsageError, match="at most"):
        ga.pattern_params(8, 200)
    # other world sizes: within a relative bound
    world, calls = 3, 20
    xs = [ga.graph_input(256, r, world, calls, "cpu") for r in range(world)]
    for _ in range(calls):
        xs = [_allreduce_bf16_partials(xs, list(range(world)))] * world
    assert ga.check_graph_result(xs[0], ga.graph_expected(256, world, calls, "cpu"), world, calls).startswith("within")


def test_eager_check_against_exact_and_nccl():
    world, n = 2, 1000
    xs = [ga.random_input(3, 1, r, n, "cpu") for r in range(world)]
    assert torch.equal(xs[0], ga.random_input(3, 1, 0, n, "cpu")) and not torch.equal(xs[0], xs[1])
    exact = sum(x.double() for x in xs)
    absum = sum(x.double().abs() for x in xs)
    nccl = (xs[0].float() + xs[1].float()).to(torch.bfloat16)
    e_exact, e_nccl, bit = ga.check_eager_result(nccl.clone(), exact, absum, nccl, world)
    assert e_nccl == 0.0 and bit and 0 < e_exact <= float((2 * world * ga.BF16_U * absum).max())
    off_by_ulp = nccl.clone()
    off_by_ulp.view(torch.int16)[5] += 1
    _, e2, bit2 = ga.check_eager_result(off_by_ulp, exact, absum, nccl, world)
    assert not bit2 and e2 > 0
    wrong = nccl.clone()
    wrong[7] += 4.0
    with pytest.raises(AssertionError, match="first at 7"):
        ga.check_eager_result(wrong, exact, absum, nccl, world)
    wrong[7] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        ga.check_eager_result(wrong, exact, absum, nccl, world)


# ------------------------------------------------------------------------------ the public API, simulated

@pytest.mark.parametrize("world", [2, 4])
def test_mscclang_calls_of_the_script_on_the_simulator(world):
    """What the script does with a Communicator (comm.empty, comm.is_symmetric, comm.prepare,
    comm.all_reduce in place, comm.last) on the shipped plans, run by the CPU simulator
    (bit-exact with the GPU kernel): the eager check passes (bit-identical to the reference sum at
    2 ranks) and 50 in-place calls on the graph check's inputs give exactly the expected values."""
    from mscclang.comm.catalog import Catalog, default_plans_dir
    from mscclang.comm.tuning import load_tuning
    from mscclang.comm.sim_ranks import run_ranks

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    calls, nbytes = 50, 4 * K
    numel = nbytes // 2
    xs = [ga.random_input(1, 0, r, numel, "cpu") for r in range(world)]
    ref = xs[0].float()
    for x in xs[1:]:
        ref = (ref + x.float()).to(torch.bfloat16).float()
    data = {"x": None, "exact": sum(x.double() for x in xs), "absum": sum(x.double().abs() for x in xs),
            "nccl": ref.to(torch.bfloat16), "expected": ga.graph_expected(numel, world, calls, "cpu")}

    def body(comm: Any) -> list:
        m = object.__new__(ga.Measurement)
        m.args = ga.parse_args(["--calls", str(calls)])
        m.rank, m.world, m.device, m.comm = comm.rank, comm.world_size, torch.device("cpu"), comm
        m.barrier = lambda: None
        out = []
        for kind in ga.MSCCLANG_KINDS:
            cell = m.make_cell(kind, numel)
            assert comm.is_symmetric(cell.x) == (kind == "symmetric")
            res = ga.CellResult(nbytes, kind)
            m.eager_check(cell, dict(data, x=xs[comm.rank]), res)
            cell.x.copy_(ga.graph_input(numel, comm.rank, world, calls, "cpu"))
            for _ in range(calls):        # what one replay of the captured graph runs
                cell.op()
            res.graph_check = ga.check_graph_result(cell.x, data["expected"], world, calls)
            out.append(res)
        return out

    results, _, fb = run_ranks(world, body, catalog=Catalog.from_dir(folder), tuning=load_tuning(),
                               engine="sim", refuse_unaligned=16)
    assert fb.calls == []   # nothing was handed to the torch.distributed fallback
    for per_rank in results:
        for res in per_rank:
            assert res.plan and not res.plan.startswith("nccl") and res.graph_check == "exact", res
            assert res.eager_err_exact is not None and res.eager_bit_exact_nccl is (True if world == 2 else res.eager_bit_exact_nccl)


# ------------------------------------------------------------------------------ the per-rank flow

class _FakeGraph:
    """Stands in for a captured CUDA graph: a replay runs the captured call ``calls`` times."""

    def __init__(self, op: Any, calls: int) -> None:
        self.op, self.calls = op, calls

    def replay(self) -> None:
        for _ in range(self.calls):
            self.op()


class _Label:
    def __init__(self, text: str) -> None:
        self.text = text

    def label(self) -> str:
        return self.text


class _FakeComm:
    """The Communicator calls the script makes, over the gloo group; rank 1 corrupts one element
    of ordinary-tensor results at 4K (a wrong kernel)."""

    backend = object()

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self.sym: list = []
        self.prepared: list = []
        self.last = None
        self.resets = 0

    def empty(self, numel: int, dtype: Any) -> Any:
        t = torch.zeros(numel, dtype=dtype)
        self.sym.append(t)
        return t

    def is_symmetric(self, t: Any) -> bool:
        return any(t.data_ptr() == s.data_ptr() for s in self.sym)

    def prepare(self, coll: str, x: Any) -> None:
        self.prepared.append((coll, x.numel()))

    def all_reduce(self, x: Any) -> Any:
        import torch.distributed as dist

        dist.all_reduce(x)
        sym = self.is_symmetric(x)
        if not sym and self.rank == 1 and x.numel() == 2 * K:
            x[5] += 1.0
        self.last = _Label("fake_plan (direct)" if sym else "fake_plan (staged)")
        return x

    def reset(self) -> None:
        self.resets += 1


def _flow_rank(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mod = _load()

    class CpuMeasurement(mod.Measurement):
        def setup(self) -> None:
            self.comm = _FakeComm()

        def capture(self, cell: Any) -> Any:
            return _FakeGraph(cell.op, self.args.calls)

    args = mod.parse_args(["--sizes", "1K,4K", "--kinds", "symmetric,ordinary,nccl,symm",
                           "--json", os.path.join(out_dir, "out.json")])
    m = CpuMeasurement(args, rank, 2, torch.device("cpu"))
    code = m.run()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"code": code, "resets": m.comm.resets, "prepared": m.comm.prepared}, f)
    dist.destroy_process_group()


def test_per_rank_flow_over_gloo(tmp_path, capfd):
    """The script's Measurement.run on 2 CPU processes (gloo as both the control group and the
    reference 'NCCL'), with a stand-in graph: every stage runs and agrees across ranks, a wrong
    result on one rank fails that cell on both (with the rank named) and the run goes on, torch
    SymmetricMemory on the CPU fails cleanly, and rank 0 prints the table and writes the JSON."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_flow_rank, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["code"] for r in ranks] == [ga.EXIT_FAILED] * 2          # the corrupted cell
    assert [r["resets"] for r in ranks] == [1, 1]                      # every rank reset the communicator
    assert ranks[0]["prepared"] == [["all_reduce", 512], ["all_reduce", 512], ["all_reduce", 2048],
                                    ["all_reduce", 2048]]
    results, meta = ga.load_json(str(tmp_path / "out.json"))
    by = {(r.size, r.kind): r for r in results}
    assert meta["world_size"] == 2 and meta["calls"] == 50 and meta["nccl_nvls_enable"] is not None
    for size in (K, 4 * K):
        for kind in ("symmetric", "nccl"):
            r = by[(size, kind)]
            assert r.measured and r.graph_check == "exact" and r.eager_bit_exact_nccl, r
            assert len(r.us_ranks) == 2 and r.us == max(r.us_ranks) and len(r.replays_us) == 5
        assert by[(size, "symmetric")].plan == "fake_plan (direct)"
        symm = by[(size, "symm")]   # no symmetric memory on the CPU: one message for both ranks
        assert symm.error.startswith("set-up: ranks 0, 1: RuntimeError") and not symm.measured
    assert by[(K, "ordinary")].measured and by[(K, "ordinary")].plan == "fake_plan (staged)"
    bad = by[(4 * K, "ordinary")]
    assert bad.error.startswith("eager check: rank 1: AssertionError") and "first at 5" in bad.error
    out = capfd.readouterr()
    assert "| 4K |" in out.out and "FAILED" in out.out and "Goals met (symmetric tensor)" in out.out
    assert "graph_allreduce:    1K symmetric" in out.err


# ------------------------------------------------------------------------------ the CUDA-only steps

def test_cuda_steps_against_a_stand_in_torch_cuda(monkeypatch):
    """The steps that only run on a GPU (device sync, CUDA events, graph capture on a side
    stream, timed replays), against a stand-in torch.cuda that records what it is asked."""
    import contextlib

    seen: list = []

    class FakeStream:
        def __init__(self, device: Any = None) -> None:
            self.device = device

        def wait_stream(self, other: Any) -> None:
            seen.append("wait_stream")

    class FakeGraph:
        def __init__(self) -> None:
            self.replays = 0

        def replay(self) -> None:
            self.replays += 1
            seen.append("replay")

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.t = 0.0

        def record(self) -> None:
            seen.append("record")
            self.t = float(seen.count("record"))

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: "FakeEvent") -> float:
            return 0.1   # ms

    @contextlib.contextmanager
    def fake_stream(s: Any) -> Any:
        seen.append("on side stream")
        yield

    @contextlib.contextmanager
    def fake_graph(g: Any, stream: Any = None) -> Any:
        assert isinstance(stream, FakeStream)
        seen.append("capture begin")
        yield
        seen.append("capture end")

    dev = torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: seen.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: FakeStream(d))
    monkeypatch.setattr(torch.cuda, "stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    m = object.__new__(ga.Measurement)
    m.device, m.args = dev, ga.parse_args(["--calls", "7", "--replays", "3", "--align", "host"])
    m.barrier = lambda: seen.append("barrier")
    m._sync()
    assert seen == [("sync", dev)]
    assert isinstance(m._event(), FakeEvent)
    seen.clear()
    cell = ga._Cell(torch.zeros(4, dtype=torch.bfloat16), lambda: seen.append("call"))
    g = m.capture(cell)
    assert isinstance(g, FakeGraph)
    begin, end = seen.index("capture begin"), seen.index("capture end")
    assert seen.count("call") == 7 and begin < seen.index("call") and seen[begin + 1:end] == ["call"] * 7
    assert seen.index("on side stream") < begin and seen[0] == ("sync", dev) and seen[-1] == ("sync", dev)
    seen.clear()
    data = {"pattern": torch.ones(4, dtype=torch.bfloat16)}
    times = m.time_replays(cell, g, data)
    assert times == pytest.approx([0.1 * 1000 / 7] * 3) and g.replays == 3
    assert seen.count("barrier") == 3 and torch.equal(cell.x, data["pattern"])
    # each replay lies between its two events, after the ranks met
    assert seen[:5] == [("sync", dev), "barrier", "record", "replay", "record"]
    rec = [i for i, x in enumerate(seen) if x == "record"]
    rep = [i for i, x in enumerate(seen) if x == "replay"]
    assert all(rec[2 * k] < rep[k] < rec[2 * k + 1] for k in range(3))


def test_spawned_ranks_report_a_failure_and_end(tmp_path):
    """``--nproc`` mode's process handling: ranks that cannot start (no CUDA here) each say why in
    one line, and the parent returns status 1 at once (no hang, no traceback)."""
    driver = tmp_path / "driver.py"
    driver.write_text("import sys\n"
                      f"sys.path.insert(0, {str(SCRIPT.parent)!r})\n"
                      "import graph_allreduce as ga\n"
                      "if __name__ == '__main__':\n"
                      "    sys.exit(ga.spawn(ga.parse_args(['--quick', '--timeout', '100']), 2))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    p = subprocess.run([sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == ga.EXIT_FAILED, p.stderr
    assert "graph_allreduce: rank " in p.stderr and "Traceback" not in p.stderr


def test_mscclang_found_in_the_checkout_when_not_installed():
    """Run from a checkout without installing, the script finds mscclang next to examples/."""
    code = ("import sys, importlib.util\n"
            f"sys.path = [p for p in sys.path if p not in ('', {str(ROOT)!r})]\n"
            f"spec = importlib.util.spec_from_file_location('ga', {str(SCRIPT)!r})\n"
            "ga = importlib.util.module_from_spec(spec); sys.modules['ga'] = ga; spec.loader.exec_module(ga)\n"
            "ga.ensure_mscclang_importable()\n"
            "import mscclang; print(mscclang.__file__)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(ROOT / "mscclang" / "__init__.py")
