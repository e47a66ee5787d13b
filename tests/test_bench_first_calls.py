"""``mscclang bench --first-calls`` on the CPU: the worker's first and second call of new sizes
through the Communicator on ordinary tensors, run by the CPU simulator on the shipped plans (each
result checked, a wrong one reported as a failure), the streamed records, the table and JSON, the
default sizes and the command line."""

from __future__ import annotations

import json

import pytest
import torch

from mscclang.bench.first_call import (FIRST_CALL_FORMAT, JSONL, FirstCallRecord, FirstCallWorker, markdown,
                                       read_records, render)
from mscclang.bench.sizes import FIRST_CALL_SIZES, log_spaced
from mscclang.bench.worker import BenchConfig
from mscclang.comm.catalog import Catalog, default_plans_dir
from mscclang.comm.errors import CommError
from mscclang.comm.tuning import load_tuning
from mscclang.comm.sim_ranks import run_ranks


def _worker(comm, cfg):
    """A first-call worker on the CPU: the thread harness's ranks need no gloo group to agree
    (every rank computes the same), so agreement and the slowest time are this rank's own."""
    w = object.__new__(FirstCallWorker)
    w.rank, w.world, w.cfg = comm.rank, comm.world_size, cfg
    w.device = torch.device("cpu")
    w.dtype = torch.bfloat16
    w.esz = 2
    w.seed = 3
    w.comm = comm
    w.barrier = lambda: None
    w.agree = lambda ok: ok
    w.slowest = lambda ms: ms
    w.in_time = lambda: True
    w.setup = lambda: None
    return w


def _plans():
    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    return Catalog.from_dir(folder)


def test_first_and_second_calls_on_the_simulator(tmp_path):
    sizes = [4100, 12300]
    cfg = BenchConfig(colls=["all_reduce", "reduce_scatter"], sizes=sizes, impls=["ordinary"],
                      modes=["eager"], out_dir=str(tmp_path))

    def body(comm):
        w = _worker(comm, cfg)
        w.out_dir = tmp_path
        assert comm.memory()["total_bytes"] == 0 and comm.last is None   # nothing seen before
        w.run()
        # a wrong result is a failure, never a time
        real = w.make_cell

        def corrupting(coll, impl, nbytes, prepare=True):
            cell = real(coll, impl, nbytes, prepare=prepare)
            op = cell.op

            def wrong():
                op()
                cell.out.reshape(-1)[1] += 4.0

            cell.op = wrong
            return cell

        w.make_cell = corrupting
        bad = w.measure_size("all_reduce", 8200)
        odd = w.measure_size("all_reduce", 4098)   # 2049 elements: not 2 ranks' blocks
        return bad, odd

    results, _, fb = run_ranks(2, body, catalog=_plans(), tuning=load_tuning(), engine="sim", refuse_unaligned=16)
    assert fb.calls == []
    recs = read_records(tmp_path / JSONL)
    assert [(r.coll, r.bytes) for r in recs] == [("all_reduce", 4100), ("all_reduce", 12300),
                                                ("reduce_scatter", 4100), ("reduce_scatter", 12300)]
    for r in recs:
        assert r.ok and r.error is None, r
        assert r.first_ms > 0 and r.second_ms > 0 and r.ratio == pytest.approx(r.first_ms / r.second_ms)
        assert r.plan_first and not r.plan_first.startswith("nccl") and r.plan_second
    for bad, odd in results:
        assert not bad.ok and bad.first_ms is None and bad.error.startswith("first call: ")
        assert "wrong" in bad.error
        assert not odd.ok and odd.error.startswith("skipped: 4098 bytes do not split")


def test_table_json_and_records():
    recs = [FirstCallRecord("all_reduce", 49164, "bfloat16", first_ms=12.5, second_ms=0.05, ok=True,
                            plan_first="a (staged)", plan_second="a (direct)"),
            FirstCallRecord("all_reduce", 278596, "bfloat16", error="second call: 3 of 9 elements wrong",
                            plan_first="b (direct)"),
            FirstCallRecord("all_gather", 475252, "bfloat16", error="skipped: time limit")]
    md = markdown(recs, {"device": "NVIDIA H200", "world_size": 2, "dtype": "bfloat16"})
    assert "2x NVIDIA H200" in md
    assert "| collective | bytes | first call ms | second call ms | ratio | plan (second call) |" in md
    assert "| all_reduce | 49164 | 12.500 | 0.050 | 250.0 | a (direct) |" in md
    assert "| all_reduce | 278596 | FAIL | FAIL | - | b (direct) |" in md
    assert "| all_gather | 475252 | skip | skip | - | - |" in md
    assert "- all_reduce 278596 B: second call: 3 of 9 elements wrong" in md
    assert recs[1].ratio is None
    assert FirstCallRecord.from_dict(recs[0].to_dict()) == recs[0]
    with pytest.raises(CommError, match="lacks bytes"):
        FirstCallRecord.from_dict({"coll": "all_reduce"})


def test_render_writes_json_and_markdown(tmp_path):
    recs = [FirstCallRecord("all_reduce", 49164, "bfloat16", first_ms=1.0, second_ms=0.5, ok=True)]
    paths = render(recs, {"world_size": 2}, tmp_path)
    doc = json.loads(paths["json"].read_text())
    assert doc["format"] == FIRST_CALL_FORMAT and doc["results"] == [recs[0].to_dict()]
    assert "| all_reduce | 49164 | 1.000 | 0.500 | 2.0 | - |" in paths["md"].read_text()
    (tmp_path / "torn.jsonl").write_text(json.dumps(recs[0].to_dict()) + "\n{\"coll\": ")
    assert read_records(tmp_path / "torn.jsonl") == recs


def test_default_sizes():
    assert len(FIRST_CALL_SIZES) == 12 and FIRST_CALL_SIZES[:3] == (49_164, 278_596, 475_252)
    assert FIRST_CALL_SIZES[-1] == 16_371_612 and list(FIRST_CALL_SIZES) == sorted(set(FIRST_CALL_SIZES))
    assert all(s % 4 == 0 and s & (s - 1) for s in FIRST_CALL_SIZES)
    ratios = [b / a for a, b in zip(FIRST_CALL_SIZES[2:], FIRST_CALL_SIZES[3:])]
    assert max(ratios) / min(ratios) < 1.01        # evenly spaced on a log scale
    with pytest.raises(CommError, match="log-spaced"):
        log_spaced(10, 5, 4)


def test_command_line(tmp_path, capsys):
    from mscclang.cli.bench_cmd import bench_config
    from mscclang.cli.main import build_parser, main

    p = build_parser()
    cfg = bench_config(p.parse_args(["bench", "--first-calls", "--out", "x"]))
    assert (cfg.colls, cfg.sizes, cfg.impls, cfg.modes) == (["all_reduce"], list(FIRST_CALL_SIZES), ["ordinary"], ["eager"])
    cfg = bench_config(p.parse_args(["bench", "--first-calls", "--collectives", "all_gather,all_reduce",
                                     "--sizes", "1000,3000", "--out", "x"]))
    assert (cfg.colls, cfg.sizes) == (["all_gather", "all_reduce"], [1000, 3000])
    assert cfg.extra == {"warm_up": False}
    assert bench_config(p.parse_args(["bench", "--first-calls", "--warm-up", "--out", "x"])).extra == {"warm_up": True}
    assert main(["bench", "--warm-up", "--out", str(tmp_path / "w")]) == 1
    assert "--warm-up (an option of --first-calls)" in capsys.readouterr().err
    assert bench_config(p.parse_args(["bench", "--out", "x"])).colls == ["all_reduce", "all_gather",
                                                                         "reduce_scatter", "all_to_all"]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:  # pragma: no cover
        return
    assert main(["bench", "--first-calls", "--out", str(tmp_path / "o")]) == 1
    assert "needs at least 2 CUDA GPUs" in capsys.readouterr().err


def test_warmup_size_is_never_a_measured_one():
    from mscclang.bench.first_call import warmup_bytes

    assert warmup_bytes(list(FIRST_CALL_SIZES)) == 8192
    assert warmup_bytes([8192, 16384, 100]) == 32768


def test_each_size_says_whether_its_plan_was_new(tmp_path):
    """A size whose first call runs a plan no earlier call of the process ran is a plan's first
    call (``new_plan``, judged against 20 ms); a size of a plan that already ran (the warm-up's
    included) is a new size of a loaded plan (judged against 1.2x its repeated call)."""
    cfg = BenchConfig(colls=["all_reduce", "reduce_scatter"], sizes=[4100, 4200], impls=["ordinary"],
                      modes=["eager"], out_dir=str(tmp_path))

    def body(comm):
        w = _worker(comm, cfg)
        w.out_dir = tmp_path
        w.plans_run = set()
        direct = [w.measure_size("all_reduce", 4100), w.measure_size("all_reduce", 4200),
                  w.measure_size("reduce_scatter", 4100)]
        w.run()   # a warm-up call of each collective first: its plan then counts as run
        return direct, w.plans_run

    results, _, fb = run_ranks(2, body, catalog=_plans(), tuning=load_tuning(), engine="sim", refuse_unaligned=16)
    assert fb.calls == []
    plan = lambda r: r.plan_first.split()[0]   # noqa: E731 - a label is "KEY [PACKET TYPE] (MODE)"
    (ar1, ar2, rs1), run = results[0]
    assert ar1.ok and ar1.new_plan is True and rs1.ok and rs1.new_plan is True
    assert ar2.ok and ar2.new_plan is (plan(ar2) != plan(ar1))
    recs = read_records(tmp_path / JSONL)
    assert len(recs) == 4 and all(r.ok and r.new_plan is False for r in recs)   # the warm-ups' one-shot plans
    assert run == {plan(r) for r in (ar1, ar2, rs1, *recs)}
    md = markdown(recs)
    assert "4 measured targets met." in md
    assert md.count("| all_reduce: a new size of a loaded plan | ") == 2
    assert md.count("| reduce_scatter: a new size of a loaded plan | ") == 2
    assert markdown([ar1]).count("| all_reduce: a plan's first call | 4100 | <= 20 ms | ") == 1
