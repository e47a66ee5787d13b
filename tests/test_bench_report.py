"""Bench output on the CPU: size parsing, records, markdown table (time, busbw, ratio to each
peer), target verdicts and the PNG plot, from a fixture result; the CLI without GPUs."""

import json
import pytest

from mscclang.bench.report import markdown, plot, render
from mscclang.bench.results import BenchResult, Record, load_result, merge, read_jsonl
from mscclang.bench.sizes import DEFAULT_SIZES, format_size, parse_size, parse_sizes
from mscclang.bench.targets import check_targets
from mscclang.comm.errors import CommError
from mscclang.plan.collectives import collective

K, M = 1 << 10, 1 << 20


def test_parse_sizes():
    assert parse_size("4K") == 4096 and parse_size("1GiB") == 1 << 30 and parse_size("12") == 12
    assert parse_sizes("1K:1G") == list(DEFAULT_SIZES)
    assert len(DEFAULT_SIZES) == 11 and DEFAULT_SIZES[0] == K and DEFAULT_SIZES[-1] == 1 << 30
    assert parse_sizes("64K,1K,1K:4K:2") == [1024, 2048, 4096, 65536]
    for bad in ("", "1X", "4K:1K", "1K:4K:1", "0"):
        with pytest.raises(CommError):
            parse_sizes(bad)
    assert [format_size(x) for x in (1024, 1536, 3 << 20, 1 << 30)] == ["1K", "1536", "3M", "1G"]


def test_busbw_factors():
    assert collective("all_reduce").busbw(2) == 1.0 and collective("allreduce").busbw(8) == 1.75
    assert collective("all_gather").busbw(4) == 0.75 and collective("broadcast").busbw(8) == 1.0
    assert collective("all_reduce_add_rms_norm").busbw(8) == 1.75   # the fused call moves an all-reduce's bytes


def fixture() -> BenchResult:
    """mscclang 2x faster than NCCL on allreduce at 1K, a failure at 4K, allgather above 64M."""
    recs = []

    def add(coll, impl, nbytes, us, mode="graph", **kw):
        bw = nbytes / us / 1e3 * collective(coll).busbw(2)
        recs.append(Record(coll, impl, mode, nbytes, "bfloat16", us=us, busbw=round(bw, 2), ok=True, **kw))

    add("all_reduce", "mscclang", K, 2.0, plan="allreduce_oneshot_ll.r2.i1 (direct)")
    add("all_reduce", "nccl", K, 9.6)
    add("all_reduce", "symm", K, 6.0)
    recs.append(Record("all_reduce", "mscclang", "graph", 4 * K, "bfloat16", ok=False,
                       error="check failed: 3 of 2048 elements wrong"))
    add("all_reduce", "nccl", 4 * K, 10.0)
    add("all_reduce", "mscclang", 64 * M, 200.0)
    add("all_reduce", "nccl", 64 * M, 250.0)
    add("all_reduce", "symm", 64 * M, 210.0)
    add("all_reduce", "mscclang", K, 5.0, mode="eager")
    add("all_reduce", "nccl", K, 12.0, mode="eager")
    add("all_gather", "mscclang", 256 * M, 1000.0)
    add("all_gather", "nccl", 256 * M, 1050.0)
    add("all_gather", "mscclang", 64 * K, 5.0)
    add("all_gather", "nccl", 64 * K, 10.0)
    return BenchResult({"device": "NVIDIA H200", "world_size": 2, "dtype": "bfloat16"}, recs)


def test_markdown_table_has_times_bandwidth_and_ratios():
    md = markdown(fixture())
    assert "2x NVIDIA H200" in md
    assert "## all_reduce (graph)" in md and "## all_reduce (eager)" in md
    assert "| size | mscclang us | busbw | plan | NCCL us | busbw | torch symm two-shot us | busbw | xNCCL | xsymm |" in md
    row1k = next(line for line in md.splitlines() if line.startswith("| 1K |") and "oneshot" in line)
    cells = [c.strip() for c in row1k.strip("|").split("|")]
    assert cells[1] == "2.00" and cells[4] == "9.60" and cells[6] == "6.00"
    assert cells[-2] == "4.80" and cells[-1] == "3.00"  # 9.6/2 and 6/2
    row4k = next(line for line in md.splitlines() if line.startswith("| 4K |"))
    assert "FAIL" in row4k
    assert "check failed: 3 of 2048 elements wrong" in md


def test_targets():
    verdicts = {(v.coll, v.bytes): v for v in check_targets(fixture())}
    assert verdicts[("all_reduce", K)].ok is True            # 2.0 <= 2.4
    assert verdicts[("all_reduce", 4 * K)].ok is None        # failed: not measured
    assert verdicts[("all_reduce", 64 * M)].ok is True       # 200 <= min(250, 210)
    assert verdicts[("all_gather", 64 * K)].ok is True       # 5 <= 0.8 * 10
    assert verdicts[("all_gather", 256 * M)].ok is False     # 1.05x bandwidth < 1.1x
    md = markdown(fixture())
    assert "3 of 4 measured targets met." in md


def test_plot_and_render(tmp_path):
    paths = render(fixture(), tmp_path)
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    again = load_result(paths["json"])
    assert len(again.records) == len(fixture().records)
    assert again.find("all_reduce", "mscclang", "graph", K).plan.startswith("allreduce_oneshot_ll")
    assert paths["md"].read_text().startswith("# mscclang bench")


def test_baseline_lists_load(tmp_path):
    base = [{"coll": "all_reduce", "bytes": 1024, "us": 9.67, "busbw": 0.1, "graph": True},
            {"coll": "all_reduce", "impl": "two_shot", "bytes": 1024, "us": 6.2, "busbw": 0.2,
             "graph": True, "ok": True}]
    p = tmp_path / "b.json"
    p.write_text(json.dumps(base))
    res = load_result(p)
    assert [(r.impl, r.mode, r.ok) for r in res.records] == [("nccl", "graph", True), ("symm", "graph", True)]
    plot(res, tmp_path / "b.png")


def test_jsonl_stream_and_merge(tmp_path):
    p = tmp_path / "results.jsonl"
    a = Record("all_reduce", "nccl", "graph", 1024, "float16", us=1.0, ok=True)
    b = Record("all_reduce", "nccl", "graph", 1024, "float16", us=2.0, ok=True)
    p.write_text(json.dumps(a.to_dict()) + "\n" + json.dumps(b.to_dict()) + "\n{\"coll\": \"all_")
    recs = read_jsonl(p)
    assert len(recs) == 2 and [r.us for r in merge(recs)] == [2.0]


def test_bad_result_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{")
    with pytest.raises(CommError, match="not valid JSON"):
        load_result(p)
    with pytest.raises(CommError, match="'results'"):
        load_result({"meta": {}})
    with pytest.raises(CommError, match="lacks"):
        load_result({"results": [{"coll": "all_reduce"}]})


def test_cli_without_gpus_explains(tmp_path, capsys):
    import torch

    from mscclang.cli.main import main

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:  # pragma: no cover
        pytest.skip("this machine has GPUs")
    assert main(["bench", "--out", str(tmp_path / "o"), "--quick"]) == 1
    err = capsys.readouterr().err
    assert "needs at least 2 CUDA GPUs" in err and "--from-json" in err


def test_cli_renders_json_and_rejects_bad_options(tmp_path, capsys):
    from mscclang.cli.main import main

    src = tmp_path / "in.json"
    src.write_text(json.dumps(fixture().to_dict()))
    assert main(["bench", "--from-json", str(src), "--out", str(tmp_path / "o")]) == 0
    assert "| 1K | 2.00 |" in capsys.readouterr().out
    assert (tmp_path / "o" / "bench.png").is_file() and (tmp_path / "o" / "bench.md").is_file()
    for args, msg in ((["--collectives", "all_foo"], "unknown collective"),
                      (["--impls", "mpi"], "unknown implementation"),
                      (["--sizes", "1X"], "bad size"),
                      (["--dtype", "float64"], "float64")):
        try:
            rc = main(["bench", *args, "--out", str(tmp_path / "p")])
        except SystemExit as e:   # argparse's usage errors (exit status 1, like other mistakes)
            rc = e.code
        assert rc == 1
        assert msg in capsys.readouterr().err


def test_targets_never_count_an_nccl_fallback_as_met():
    """Where a tuning rule made the library run NCCL, equal bandwidth is not our kernel's: the
    verdict says so and counts as missed; other world sizes get the 2-GPU targets as reference."""
    res = fixture()
    bw = 256 * M / 480.0 / 1e3 * collective("all_to_all").busbw(2)
    res.records.append(Record("all_to_all", "mscclang", "graph", 256 * M, "bfloat16", us=480.0,
                              busbw=round(bw, 2), ok=True, plan="nccl"))
    res.records.append(Record("all_to_all", "nccl", "graph", 256 * M, "bfloat16", us=480.0,
                              busbw=round(bw, 2), ok=True))
    v = {(x.coll, x.bytes): x for x in check_targets(res)}[("all_to_all", 256 * M)]
    assert v.fallback and v.ok is False and "fell back to NCCL" in v.row()
    md = markdown(res)
    assert "3 of 5 measured targets met." in md and "## Targets (CUDA graph)" in md
    res.meta["world_size"] = 4
    assert "for reference only: this run used 4 GPUs" in markdown(res)


QUICK_OPTION_SETS = ([], ["--collectives", "all_reduce"], ["--impls", "mscclang,nccl", "--modes", "graph"],
                     ["--dtype", "fp16", "--tuning", "t.json", "--time-limit", "50", "--nprocs", "2"])


@pytest.mark.parametrize("extra", QUICK_OPTION_SETS, ids=lambda a: " ".join(a) or "defaults")
def test_quick_bench_config_differs_only_in_sizes(extra):
    """``bench --quick`` reported allreduce 1K at 3.02 us against the full bench's 1.88 us: half the
    calls per graph and fewer timed blocks. Quick must measure the same way, at fewer sizes: the
    whole configuration handed to the workers (every field, defaults included) is the full run's
    but for ``sizes``; with explicit ``--sizes`` ``--quick`` changes nothing at all."""
    from mscclang.bench.sizes import DEFAULT_SIZES, QUICK_SIZES
    from mscclang.cli.bench_cmd import bench_config
    from mscclang.cli.main import build_parser

    p = build_parser()
    quick = bench_config(p.parse_args(["bench", "--quick", "--out", "x", *extra]))
    full = bench_config(p.parse_args(["bench", "--out", "x", *extra]))
    assert quick.sizes == list(QUICK_SIZES) and full.sizes == list(DEFAULT_SIZES)
    q, f = quick.to_dict(), full.to_dict()
    assert set(q) == set(f) and "sizes" in q
    assert {k for k in q if q[k] != f[k]} == {"sizes"}
    same = [p.parse_args(["bench", *flag, "--sizes", "1K,64K", "--out", "x", *extra]) for flag in (["--quick"], [])]
    assert bench_config(same[0]).to_dict() == bench_config(same[1]).to_dict()


def test_quick_bench_cli_hands_the_runner_the_full_runs_arguments(tmp_path, monkeypatch, capsys):
    """End to end through ``mscclang bench``: what the command hands the runner (configuration,
    time limit, process count) differs between --quick and a full run only in the size list."""
    import mscclang.bench.runner as runner
    from mscclang.bench.sizes import DEFAULT_SIZES, QUICK_SIZES
    from mscclang.cli.main import main

    seen = []

    def fake_run_bench(cfg, time_limit_s, nprocs=None, **kw):
        seen.append((cfg.to_dict(), time_limit_s, nprocs, kw))
        md = tmp_path / "bench.md"
        md.write_text("table\n")
        rec = Record("all_reduce", "mscclang", "graph", K, "bfloat16", us=2.0, busbw=0.5, ok=True)
        return BenchResult({}, [rec]), {"md": md}, []

    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    assert main(["bench", "--quick", "--out", str(tmp_path / "o")]) == 0
    assert main(["bench", "--out", str(tmp_path / "o")]) == 0
    capsys.readouterr()
    (q, qt, qn, qkw), (f, ft, fn, fkw) = seen
    assert q.pop("sizes") == list(QUICK_SIZES) and f.pop("sizes") == list(DEFAULT_SIZES)
    assert (q, qt, qn, qkw) == (f, ft, fn, fkw)


def test_bench_algos_and_node_layout_options():
    """``--algos`` adds forced-algorithm columns ``mscclang:NAME``; ``--gpus-per-node`` goes to
    the workers (the runner sets MSCCLANG_GPUS_PER_NODE and NCCL's network transport)."""
    from mscclang.cli.bench_cmd import bench_config
    from mscclang.cli.main import build_parser

    p = build_parser()
    cfg = bench_config(p.parse_args(["bench", "--out", "x", "--algos", "allgather_ce,allgather_ce",
                                     "--gpus-per-node", "1"]))
    assert cfg.impls[-1] == "mscclang:allgather_ce" and cfg.impls.count("mscclang:allgather_ce") == 1
    assert cfg.extra == {"gpus_per_node": 1}
    with pytest.raises(CommError, match="gpus-per-node"):
        bench_config(p.parse_args(["bench", "--out", "x", "--gpus-per-node", "0"]))


def test_markdown_forced_algorithm_columns():
    res = fixture()
    res.records.append(Record("all_gather", "mscclang:allgather_ce", "graph", 256 * M, "bfloat16", us=700.0,
                              busbw=1.0, ok=True, plan="allgather_ce.r2 (direct)"))
    md = markdown(res)
    head = next(line for line in md.splitlines() if line.startswith("| size |") and "allgather_ce us" in line)
    assert head.endswith("| allgather_ce us | busbw | plan | xNCCL |")
    row = next(line for line in md.splitlines() if line.startswith("| 256M |") and "allgather_ce.r2" in line)
    assert row.strip().endswith("| 1.50 |")   # NCCL 1050 us / 700 us


def test_worker_forces_and_restores_the_tuning():
    from mscclang.bench.worker import BenchWorker

    class FakeComm:
        def __init__(self):
            self.tuning = "original"
            self.used = []

        def use_tuning(self, t):
            self.used.append(t)
            self.tuning = t

    w = object.__new__(BenchWorker)
    w.comm = FakeComm()
    w._force_algo("all_gather", "allgather_ce")
    rule = w.comm.used[-1]["rules"][0]
    assert rule == {"collective": "allgather", "candidates": [{"plan": "allgather_ce"}]}
    w._force_algo("all_gather", None)
    assert w.comm.used[-1] == "original"
    n = len(w.comm.used)
    w._force_algo("all_reduce", None)   # nothing forced: nothing to restore
    assert len(w.comm.used) == n


def test_algos_column_runs_only_for_its_collective():
    """Regression (2x H200 bench, session 5): ``--algos allgather_port,allreduce_port_pipelined``
    filled the all_reduce table's allgather_port column with a time: the forced tuning named no
    allreduce plan, so the library's fallback ran and was reported as the algorithm. A forced
    column now exists only for the collective its algorithm serves, and the cell names the plan
    that ran."""
    from mscclang.bench.worker import BenchWorker
    from mscclang.comm.catalog import Catalog

    class FakeComm:
        catalog = Catalog.from_dir(None)

    w = object.__new__(BenchWorker)
    w.comm = FakeComm()
    w.world = 2
    emitted = []
    w.emit = emitted.append
    assert w._algo_serves("allgather_port", "all_gather")
    assert not w._algo_serves("allgather_port", "all_reduce")
    assert w._algo_serves("allreduce_port_pipelined", "all_reduce")
    assert not w._algo_serves("allreduce_port_pipelined", "all_to_all")
    w.run_cell("all_reduce", "mscclang:allgather_port", 1 << 20)   # returns before any set-up
    assert emitted == []


def test_a_time_of_the_interpreter_kernel_is_marked_in_the_table(tmp_path):
    """The bench records which kernel its timed calls ran; a mscclang time of the interpreter (the
    specialisation policy had not promoted the size when the graph was captured) is marked, and
    the mark survives the JSON round trip."""
    res = fixture()
    for r in res.records:
        if r.impl == "mscclang" and r.bytes == 64 * M and r.coll == "all_reduce":
            r.plan = "allreduce_rsag_zero_copy.r2.i32.inplace (direct)"
            r.extra = {"kernel": "interpreter"}
        elif r.impl == "mscclang" and r.ok:
            r.extra = {"kernel": "spec"}
    md = markdown(res)
    row = next(line for line in md.splitlines() if line.startswith("| 64M |") and "rsag" in line)
    assert "allreduce_rsag_zero_copy.r2.i32.inplace (direct) [interpreter]" in row
    assert "[interpreter]" not in next(line for line in md.splitlines() if line.startswith("| 1K |"))
    p = tmp_path / "r.json"
    p.write_text(json.dumps(res.to_dict()))
    assert "[interpreter]" in markdown(load_result(p))


def test_ordinary_tensor_column_and_its_own_targets():
    """The ``ordinary`` implementation (mscclang on torch.empty tensors) gets its own columns and
    its time relative to the symmetric tensor's, and is judged against the ordinary-tensor goals
    (one table module: the symmetric goals stay those of ALLREDUCE_US)."""
    from mscclang.bench.targets import ALLREDUCE_US, LATENCY_TARGETS, ORDINARY_ALLREDUCE_US

    assert ALLREDUCE_US[K] == 2.4 and ORDINARY_ALLREDUCE_US[K] == 2.0 and ORDINARY_ALLREDUCE_US[64 * M] == 195.0
    assert [(t.impl, t.us) for t in LATENCY_TARGETS] == [("mscclang", ALLREDUCE_US), ("ordinary", ORDINARY_ALLREDUCE_US)]
    res = fixture()
    res.records.append(Record("all_reduce", "ordinary", "graph", K, "bfloat16", us=3.0, busbw=0.3, ok=True,
                              plan="allreduce_oneshot_ll.r2.i1 (direct)"))
    res.records.append(Record("all_reduce", "ordinary", "graph", 64 * M, "bfloat16", us=190.0, busbw=350.0,
                              ok=True, plan="nccl"))
    md = markdown(res)
    head = next(x for x in md.splitlines() if x.startswith("| size | mscclang us"))
    assert "| plan | ordinary us | busbw | plan | xsym | NCCL us |" in head
    row = next(x for x in md.splitlines() if x.startswith("| 1K |") and "oneshot" in x)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "3.00" and cells[7] == "1.50"     # 3.0 / 2.0
    v = {(x.impl, x.bytes): x for x in check_targets(res)}
    assert v[("ordinary", K)].ok is False and v[("ordinary", K)].goal == "<= 2.0 us"   # 3.0 > 2.0
    assert v[("mscclang", K)].ok is True                                                # 2.0 <= 2.4
    assert v[("ordinary", 64 * M)].fallback and v[("ordinary", 64 * M)].ok is False     # NCCL never counts
    assert "| all_reduce (ordinary tensors) | 1K | <= 2.0 us | 3.00 us | MISSED |" in md
    # without ordinary records, no ordinary verdicts
    assert all(x.impl == "mscclang" for x in check_targets(fixture()))
