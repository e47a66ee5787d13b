"""``mscclang bench --host`` on the CPU: the rank's rows run for real through the Communicator
on the simulator's back end (two ranks as threads, the shipped plans; ``dist.all_reduce``
through mscclang's process group over the same Communicator), each checked before it is timed;
the timed loop never waits for the device; the targets' verdicts, the table and the JSON; the
command line's options and refusals; and the parent side in shared mode (two ranks on one
faked GPU) down to the rendered files."""

from __future__ import annotations

import json

import pytest
import torch

from mscclang.bench import host
from mscclang.bench.host import (HOST_FORMAT, JSONL, LABELS, HostRecord, HostWorker, floor_group_class,
                                 host_config, host_rows, host_us_per_call, markdown, render)
from mscclang.bench.results import read_jsonl
from mscclang.bench.targets import check_first_call_targets, check_host_targets, torch_launch_us
from mscclang.comm.catalog import Catalog, default_plans_dir
from mscclang.comm.sim_ranks import run_ranks
from mscclang.comm.tuning import load_tuning
from mscclang.units import format_size
from tests.harness.cli import cli_inproc, user_error


def _plans() -> Catalog:
    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    return Catalog.from_dir(folder)


def _worker(comm, cfg, out):
    """A host worker on the CPU: the thread harness's ranks need no gloo group to agree (every
    rank computes the same), so agreement and every rank's figure are this rank's own; the
    ``dist`` rows' group is a mscclang process group over this rank's Communicator."""
    from mscclang.distributed import MscclangProcessGroup

    w = object.__new__(HostWorker)
    w.rank, w.world, w.cfg = comm.rank, comm.world_size, cfg
    w.device, w.dtype, w.esz, w.seed = torch.device("cpu"), torch.bfloat16, 2, 3
    w.comm, w.out_dir = comm, out
    w.barrier = lambda: None
    w.agree = lambda ok: ok
    w.in_time = lambda: True
    w.setup = lambda: None
    w.each_rank = lambda v: [v]
    pool = max(cfg.sizes)
    w.sym = (comm.empty(pool, dtype=torch.uint8), comm.empty(pool, dtype=torch.uint8))
    w.group = MscclangProcessGroup(None, comm.rank, comm.world_size, device="cpu", communicator=comm)
    w.floor_group = floor_group_class()(comm.rank, comm.world_size)
    return w


def test_every_row_runs_on_the_simulator(tmp_path):
    cfg = host_config("bfloat16", str(tmp_path), calls=3, repeats=2, elements=(512, 2048), hidden=64)
    cfg.warmup = 1

    def body(comm):
        w = _worker(comm, cfg, tmp_path)
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
        bad = w.measure_row("ordinary", 512)
        w.make_cell = real
        w.group, w.group_error = None, "RuntimeError: no backend"
        skipped = w.measure_row("dist", 512)
        return bad, skipped

    results, _, fb = run_ranks(2, body, catalog=_plans(), tuning=load_tuning(), engine="sim", refuse_unaligned=16)
    assert fb.calls == []   # every call ran a plan, none fell back
    recs = read_jsonl(tmp_path / JSONL, HostRecord.from_dict)
    assert [(r.call, r.elements) for r in recs] == host_rows(cfg) == [
        ("add", 512), ("copy", 512), ("symmetric", 512), ("symmetric", 2048), ("ordinary", 512),
        ("ordinary", 2048), ("fused", 16 * 64), ("dist", 512), ("dist", 2048), ("floor", 512)]
    for r in recs:
        assert r.ok and r.error is None and r.us > 0 and r.rank_us == [r.us], r
        assert r.bytes == 2 * r.elements
        if r.call not in ("add", "copy", "floor"):
            assert r.plan and "nccl" not in r.plan and ".r2." in r.plan, r
    for bad, skipped in results:
        assert not bad.ok and bad.us is None and bad.error.startswith("check failed: ") and "wrong" in bad.error
        assert not skipped.ok and skipped.error == "skipped: no mscclang process group here (RuntimeError: no backend)"

    paths = render(recs, {"world_size": 2, "ranks_per_gpu": 2, "config": cfg.to_dict()}, tmp_path / "o",
                   json_path=tmp_path / "elsewhere.json")
    doc = json.loads((tmp_path / "elsewhere.json").read_text())
    assert paths["json"] == tmp_path / "elsewhere.json" and not (tmp_path / "o" / "host.json").exists()
    assert doc["format"] == HOST_FORMAT and [HostRecord.from_dict(d) for d in doc["results"]] == recs
    md = paths["md"].read_text()
    assert "ranks per GPU 2" in md and "queuing 3 calls" in md and "the median of 2 loops" in md
    for r in recs:
        assert f"| {r.label} | {format_size(r.elements)} | {r.us:.2f} | " in md, r
    verdicts = check_host_targets(recs)
    # 2 symmetric, 2 ordinary, 1 fused, 2 dist and the 3 growth verdicts, every one judged
    assert len(verdicts) == 10 and all(v.ok is not None for v in verdicts)
    assert f"{sum(v.ok for v in verdicts)} of 10 measured targets met." in md


def test_the_timed_loop_never_waits_for_the_device():
    events: list[str] = []
    times = host_us_per_call(lambda: events.append("call"), 4, 3, lambda: events.append("sync"),
                             lambda: events.append("barrier"))
    assert len(times) == 3 and all(t > 0 for t in times)
    assert events == (["sync", "barrier"] + ["call"] * 4 + ["sync"]) * 3


def _rec(call, elements, us, ok=True, error=None):
    return HostRecord(call, elements, 2 * elements, "bfloat16", us=us, rank_us=[us] if us else [], ok=ok,
                      error=error)


def test_host_verdicts_against_the_torch_launch():
    K, M = 1024, 1 << 20
    recs = [_rec("add", K, 9.0), _rec("copy", K, 11.0),            # a torch launch: 10 us
            _rec("symmetric", K, 15.0), _rec("symmetric", M, 16.6),  # 1.5 launches: met; 1M: 1.107x: missed
            _rec("ordinary", K, 30.5), _rec("ordinary", M, 30.0),    # just over 3 launches; flat
            _rec("fused", 65536, 20.0),                             # 2 launches: met
            _rec("dist", K, 36.0), _rec("dist", M, None, ok=False, error="check failed: x"),
            _rec("floor", K, 9.15)]                                 # torch's own part of a dist call
    assert torch_launch_us(recs) == pytest.approx(10.0)
    got = {(v.coll, v.bytes): v for v in check_host_targets(recs)}
    sym = LABELS["symmetric"]
    assert got[(f"{sym}, 1K elements", 2 * K)].ok is True
    assert got[(f"{sym}, 1M elements", 2 * M)].ok is False
    assert got[(f"{LABELS['ordinary']}, 1K elements", 2 * K)].ok is False
    assert got[(f"{LABELS['ordinary']}, 1M elements", 2 * M)].ok is True
    assert got[(f"{LABELS['fused']}, 64K elements", 2 * 65536)].ok is True
    d = got[(f"{LABELS['dist']}, 1K elements", 2 * K)]
    assert d.ok is True and "(36.6 us)" in d.goal   # 1.2 x the ordinary call's 30.5
    # no Python backend can do better than the Communicator's call plus torch's own part
    assert d.value == "36.0 us = 1.18x; torch's own part 9.2 us: 1.30x at the least"
    assert got[(f"{LABELS['dist']}, 1M elements", 2 * M)].ok is None   # not measured
    assert got[(f"{sym}: 1M against 1K elements", 2 * M)].ok is False
    assert got[(f"{LABELS['ordinary']}: 1M against 1K elements", 2 * M)].ok is True
    assert got[(f"{LABELS['dist']}: 1M against 1K elements", 2 * M)].ok is None
    md = markdown(recs)
    assert f"| {sym} | 1K | 15.00 | 1.50 | - |" in md
    assert f"| {LABELS['floor']} | 1K | 9.15 | 0.92 | - |" in md
    assert f"| {LABELS['dist']} | 1M | FAIL | - | - |" in md and f"- {LABELS['dist']}, 1M: check failed: x" in md
    assert "5 of 8 measured targets met." in md
    assert "| call | size | goal | measured | verdict |" in md and "| MISSED |" in md
    # without both torch rows there is no unit: the launch-relative rows are not measured
    assert torch_launch_us(recs[1:]) is None
    assert all(v.ok is None for v in check_host_targets(recs[1:]) if "torch launches" in v.goal)
    skipped = markdown([_rec("dist", K, None, ok=False, error="skipped: no group")])
    assert f"| {LABELS['dist']} | 1K | skip | - | - |" in skipped


def test_the_floor_group_does_nothing_and_is_one_class():
    assert floor_group_class() is floor_group_class()
    t = torch.ones(4)
    g = floor_group_class()(0, 1)
    assert g.allreduce([t]).wait() is True and torch.equal(t, torch.ones(4)) and g.getBackendName() == "floor"


def test_first_call_verdicts():
    from mscclang.bench.first_call import FirstCallRecord, markdown as first_markdown

    recs = [FirstCallRecord("all_reduce", 49164, "bfloat16", first_ms=60.0, second_ms=4.9, ok=True, new_plan=True),
            FirstCallRecord("all_reduce", 278596, "bfloat16", first_ms=5.8, second_ms=4.9, ok=True, new_plan=False),
            FirstCallRecord("all_reduce", 475252, "bfloat16", first_ms=6.6, second_ms=4.9, ok=True, new_plan=False),
            FirstCallRecord("all_reduce", 704240, "bfloat16", first_ms=9.0, second_ms=4.9, ok=True),   # older record
            FirstCallRecord("all_reduce", 1043560, "bfloat16", error="first call: boom", new_plan=True)]
    verdicts = check_first_call_targets(recs)
    assert [(v.coll, v.bytes, v.ok) for v in verdicts] == [
        ("all_reduce: a plan's first call", 49164, False), ("all_reduce: a new size of a loaded plan", 278596, True),
        ("all_reduce: a new size of a loaded plan", 475252, False)]
    md = first_markdown(recs)
    assert "| all_reduce | 49164 | 60.000 | 4.900 | 12.2 | - |" in md   # the table is as before
    assert "1 of 3 measured targets met." in md and "<= 20 ms" in md and "<= 1.2 x the repeated call (5.88 ms)" in md
    assert FirstCallRecord.from_dict(recs[1].to_dict()) == recs[1]


def test_host_config_bounds():
    from mscclang.comm.errors import CommError

    cfg = host_config()
    assert cfg.extra == {"calls": 200, "elements": [1024, 65536, 1 << 20], "hidden": 4096}
    assert cfg.blocks == 5 and cfg.sizes == [2 << 20] and cfg.impls == ["mscclang", "ordinary"]
    assert [c for c, _ in host_rows(cfg)].count("dist") == 3 and ("fused", 16 * 4096) in host_rows(cfg)
    for bad in ({"calls": 0}, {"calls": host.MAX_CALLS + 1}, {"repeats": 0}, {"elements": ()}, {"hidden": 0}):
        with pytest.raises(CommError, match="out of range"):
            host_config(**bad)


# ------------------------------------------------------------------------------ command line
def test_the_command_line_parses_the_host_options():
    from mscclang.cli.main import build_parser

    a = build_parser().parse_args(["bench", "--host", "--calls", "50", "--repeats", "3", "--json", "h.json"])
    assert (a.host, a.calls, a.repeats, a.json) == (True, 50, 3, "h.json")
    a = build_parser().parse_args(["bench", "--host"])
    assert (a.calls, a.repeats, a.json) == (None, None, None)


@pytest.mark.parametrize("args, needle", [
    (["--host", "--first-calls"], "--host and --first-calls are different modes"),
    (["--host", "--from-json", "x.json"], "--host and --from-json are different modes"),
    (["--host", "--sizes", "1K"], "--host takes no --sizes (an option of the sweep and --first-calls)"),
    (["--host", "--collectives", "all_gather"], "--host takes no --collectives"),
    (["--host", "--quick", "--impls", "nccl"], "--host takes no --quick (an option of the sweep), --impls"),
    (["--host", "--hidden", "64"], "--host takes no --hidden"),
    (["--first-calls", "--calls", "5"], "--first-calls takes no --calls (an option of --host)"),
    (["--first-calls", "--modes", "graph"], "--first-calls takes no --modes"),
    (["--repeats", "2"], "the sweep takes no --repeats (an option of --host)"),
    (["--json", "x.json"], "the sweep takes no --json (an option of --host and --first-calls)"),
    (["--host", "--calls", "0"], "argument --calls: 0 is out of range: use 1..250"),
    (["--host", "--calls", "251"], "argument --calls: 251 is out of range"),
    (["--host", "--repeats", "x"], "argument --repeats"),
])
def test_bad_combinations_are_refused_in_one_line(tmp_path, capsys, args, needle):
    res = cli_inproc(capsys, "bench", *args, "--out", str(tmp_path / "o"))
    user_error(res, needle)
    assert ([ln for ln in res.stderr.splitlines() if ln.startswith("mscclang bench: error:")]
            == [ln for ln in res.stderr.splitlines() if "error" in ln]), res.stderr
    assert not (tmp_path / "o").exists()


def test_json_must_be_writable(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    user_error(cli_inproc(capsys, "bench", "--host", "--json", str(tmp_path / "file" / "h.json"),
                          "--out", str(tmp_path / "o")), "--json")


def test_without_gpus_both_modes_refuse(tmp_path, capsys, monkeypatch):
    import mscclang.bench.runner as runner

    monkeypatch.setattr(runner, "gpu_count", lambda: 0)
    monkeypatch.delenv("MSCCLANG_RANKS_PER_GPU", raising=False)
    for mode in ("--host", "--first-calls"):
        user_error(cli_inproc(capsys, "bench", mode, "--out", str(tmp_path / "o")),
                   "needs at least 2 CUDA GPUs (one process per GPU), or one GPU with MSCCLANG_RANKS_PER_GPU=2")


def _fake_workers(monkeypatch, rows: dict):
    """Replace the worker spawn: record the ranks asked for, write the records ``rows`` gives
    for the results file the mode streams, as rank 0 would; returns the list of ranks asked."""
    import mscclang.bench.runner as runner

    asked: list[int] = []

    def run_workers(entry, n, cfg, time_limit_s, out, results):
        asked.append(n)
        (out / results).write_text("".join(json.dumps(r) + "\n" for r in rows[results]))
        return {"world_size": n, "elapsed_s": 0.1, "ranks_per_gpu": 2}, []

    monkeypatch.setattr(runner, "_run_workers", run_workers)
    return asked


def test_shared_mode_on_one_gpu_runs_both_modes(tmp_path, capsys, monkeypatch):
    """One GPU and MSCCLANG_RANKS_PER_GPU=2: ``--first-calls`` (which refused there: "needs at
    least 2 CUDA GPUs") and ``--host`` start two ranks and render what they streamed; without
    the setting both refuse, and the sweep refuses ranks sharing a GPU (its peers are NCCL's)."""
    import mscclang.bench.runner as runner

    monkeypatch.setattr(runner, "gpu_count", lambda: 1)
    first = [{"coll": "all_reduce", "bytes": 49164, "dtype": "bfloat16", "first_ms": 12.0, "second_ms": 4.0,
              "ok": True, "plan_first": "p (staged)", "plan_second": "p (staged)", "new_plan": True}]
    hosts = [_rec(c, n, 10.0).to_dict() for c, n in host_rows(host_config())]
    asked = _fake_workers(monkeypatch, {"first_calls.jsonl": first, JSONL: hosts})
    monkeypatch.setenv("MSCCLANG_RANKS_PER_GPU", "1")
    for mode in ("--host", "--first-calls"):
        user_error(cli_inproc(capsys, "bench", mode, "--out", str(tmp_path / "o")), "this machine has 1.")
    assert asked == []
    monkeypatch.setenv("MSCCLANG_RANKS_PER_GPU", "2")
    res = cli_inproc(capsys, "bench", "--first-calls", "--out", str(tmp_path / "f"))
    assert res.returncode == 0, res.stderr
    assert "| all_reduce | 49164 | 12.000 | 4.000 | 3.0 | p (staged) |" in res.stdout
    assert "| all_reduce: a plan's first call | 49164 | <= 20 ms | 12.00 ms | met |" in res.stdout
    res = cli_inproc(capsys, "bench", "--host", "--json", str(tmp_path / "h.json"), "--out", str(tmp_path / "h"))
    assert res.returncode == 0, res.stderr
    for label in LABELS.values():
        assert f"| {label} |" in res.stdout, label
    assert "## Targets (host time)" in res.stdout and "ranks per GPU 2" in res.stdout
    assert json.loads((tmp_path / "h.json").read_text())["format"] == HOST_FORMAT
    assert (tmp_path / "h" / "host.md").is_file() and not (tmp_path / "h" / "host.json").exists()
    assert asked == [2, 2]
    res = cli_inproc(capsys, "bench", "--host", "--nprocs", "3", "--out", str(tmp_path / "h"))
    user_error(res, "for 3 processes; this machine has 1 (2 ranks at MSCCLANG_RANKS_PER_GPU=2)")
    user_error(cli_inproc(capsys, "bench", "--out", str(tmp_path / "s")),
               "mscclang bench needs one GPU per rank for NCCL (MSCCLANG_RANKS_PER_GPU=2: ranks share a GPU)")
    assert asked == [2, 2]


def test_a_failed_row_fails_the_run(tmp_path, capsys, monkeypatch):
    import mscclang.bench.runner as runner

    monkeypatch.setattr(runner, "gpu_count", lambda: 2)
    monkeypatch.delenv("MSCCLANG_RANKS_PER_GPU", raising=False)
    rows = [_rec(c, n, 10.0).to_dict() for c, n in host_rows(host_config())]
    rows[3] = _rec("symmetric", 65536, None, ok=False, error="check failed: 3 of 9 elements wrong").to_dict()
    rows[-1] = _rec("dist", 1 << 20, None, ok=False, error="skipped: time limit").to_dict()
    _fake_workers(monkeypatch, {JSONL: rows})
    res = cli_inproc(capsys, "bench", "--host", "--out", str(tmp_path / "h"))
    assert res.returncode == 1 and "mscclang bench: 1 rows failed their check or run" in res.stderr


@pytest.mark.parametrize("share, visible, want", [(2, 1, [(0, "gloo"), (0, "gloo")]),
                                                  (1, 2, [(0, "nccl"), (1, "nccl")]),
                                                  (2, 2, [(0, "gloo"), (0, "gloo"), (1, "gloo"), (1, "gloo")])])
def test_rank_binding(monkeypatch, share, visible, want):
    from mscclang.bench.worker import rank_binding

    monkeypatch.setenv("MSCCLANG_RANKS_PER_GPU", str(share))
    assert [rank_binding(r, visible) for r in range(len(want))] == want


def _torch_rank(rank: int, init_file: str, q) -> None:
    """One rank of a real two-process torch.distributed run on the CPU (gloo default group, as
    ranks sharing a GPU have it): the host worker's own mscclang process group and its agreement
    over gloo, every row measured through them (the CPU Communicator runs its calls on its
    torch.distributed fallback)."""
    import os
    import time
    import traceback

    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.FileStore(init_file, 2), rank=rank, world_size=2)
        cfg = host_config("bfloat16", ".", calls=2, repeats=2, elements=(256, 1024), hidden=64)
        cfg.warmup, cfg.deadline = 1, time.time() + 120
        w = object.__new__(HostWorker)
        w.rank, w.world, w.cfg = rank, 2, cfg
        w.device, w.dtype, w.esz, w.seed = torch.device("cpu"), torch.bfloat16, 2, 5
        w.ctrl = dist.new_group(backend="gloo")
        w.comm = w.make_comm()
        assert w.group is not None and w.comm is w.group.communicator and w.group_error is None
        w.sym = (w.comm.empty(max(cfg.sizes), dtype=torch.uint8), w.comm.empty(max(cfg.sizes), dtype=torch.uint8))
        recs = [w.measure_row(c, n) for c, n in host_rows(cfg)]
        q.put((rank, [r.to_dict() for r in recs]))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, traceback.format_exc()))


def test_the_rows_through_torch_distributed(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_torch_rank, args=(r, str(tmp_path / "store"), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            r, res = q.get(timeout=240)
            got[r] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(5)
    for r in (0, 1):
        assert isinstance(got[r], list), got[r]
        recs = [HostRecord.from_dict(d) for d in got[r]]
        assert [(x.call, x.elements) for x in recs] == [(c, n) for c, n in host_rows(
            host_config(calls=2, repeats=2, elements=(256, 1024), hidden=64))]
        for x in recs:
            assert x.ok and len(x.rank_us) == 2 and x.us == max(x.rank_us) > 0, x
    assert got[0] == got[1]   # every rank reports the same figures (gathered over gloo)
