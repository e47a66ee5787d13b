"""The parent side of ``mscclang bench``: spawn one worker per GPU, watch the time limit, collect
the streamed records and render JSON, markdown and PNG (also after a crash or a timeout: what was
measured is kept)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

from mscclang.bench.report import render
from mscclang.bench.results import BenchResult, merge, read_jsonl
from mscclang.bench.worker import BenchConfig, worker_entry
from mscclang.config import Settings, nccl_env, settings
from mscclang.errors import RuntimeUnavailable

#: seconds the parent waits past the workers' deadline before killing them
GRACE_S = 60.0


def gpu_count() -> int:
    """Visible CUDA GPUs (0 when torch has no CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _need_gpus(nprocs: Optional[int], what: str, shared: bool = False) -> int:
    """The ranks to start: ``nprocs``, or one per GPU; with ``shared`` (modes whose figures hold
    on ranks sharing a GPU) ``MSCCLANG_RANKS_PER_GPU`` per GPU (two ranks on one GPU, say).
    :class:`RuntimeUnavailable` naming what is missing, and for the other modes (their peers
    are NCCL's) when ranks would share a GPU."""
    from mscclang.runtime.workers import nccl_refusal

    share = settings.ranks_per_gpu
    if share > 1 and not shared:
        raise RuntimeUnavailable(f"mscclang {what} {nccl_refusal(share)}; of the bench only --host and "
                                 "--first-calls run on ranks sharing a GPU")
    have = gpu_count()
    n = have * share if nprocs is None else nprocs
    if have * share < 2 or n < 2 or n > have * share:
        ranks = f" ({have * share} ranks at MSCCLANG_RANKS_PER_GPU={share})" if share > 1 else ""
        raise RuntimeUnavailable(
            f"mscclang {what} needs at least 2 CUDA GPUs (one process per GPU)"
            + (", or one GPU with MSCCLANG_RANKS_PER_GPU=2" if shared else "")
            + f"{'' if nprocs is None else f' for {n} processes'}; this machine has {have}{ranks}."
            + ("" if shared else " Render an earlier run with --from-json FILE." if what == "bench" else
               " Use --dry-run to compile and verify the candidates without GPUs."))
    return n


def spawn_workers(entry, n: int, cfg: BenchConfig, time_limit_s: float) -> list[str]:
    """Run ``entry(rank, n, cfg, port)`` on ``n`` processes; stop them GRACE_S after the time
    limit or when one fails. Returns the problems seen."""
    import torch.multiprocessing as mp

    gpn = (cfg.extra or {}).get("gpus_per_node")
    # inherited by the workers: never NVLink multicast; one host's GPUs as nodes of gpn: mscclang's
    # topology, and NCCL on its network transport
    os.environ.update(nccl_env(network_only=gpn is not None and gpn < n))
    if gpn is not None:
        os.environ[Settings.gpus_per_node.name] = str(gpn)
    cfg.deadline = time.time() + time_limit_s
    problems: list[str] = []
    ctx = mp.start_processes(entry, args=(n, cfg, _free_port()), nprocs=n, join=False,
                             start_method="spawn")
    hard = cfg.deadline + GRACE_S
    try:
        while True:
            try:
                if ctx.join(timeout=2):
                    break
            except Exception as e:  # a worker exited with an error: stop the others
                text = str(e).strip()
                problems.append(f"worker failed: {text.splitlines()[0] if text else type(e).__name__}")
                _kill(ctx)
                break
            if time.time() > hard:
                problems.append(f"workers still running {GRACE_S:.0f} s after the time limit: stopped them")
                _kill(ctx)
                break
    except KeyboardInterrupt:  # Ctrl-C: the workers ignore it; stop them before leaving
        _kill(ctx)
        raise
    return problems


def _run_workers(entry, n: int, cfg: BenchConfig, time_limit_s: float, out: Path,
                 results: str) -> tuple[dict, list[str]]:
    """Run ``n`` workers of ``entry`` writing ``results`` and ``meta.json`` under ``out`` (stale
    ones removed first); the meta (with the elapsed time and the problems) and the problems."""
    for stale in (results, "meta.json"):
        (out / stale).unlink(missing_ok=True)
    start = time.time()
    problems = spawn_workers(entry, n, cfg, time_limit_s)
    meta: dict = {}
    if (out / "meta.json").is_file():
        try:
            meta = json.loads((out / "meta.json").read_text())
        except json.JSONDecodeError:
            problems.append("meta.json unreadable")
    meta["elapsed_s"] = round(time.time() - start, 1)
    if problems:
        meta["problems"] = problems
    return meta, problems


def run_bench(cfg: BenchConfig, time_limit_s: float, nprocs: Optional[int] = None,
              log: Optional[TextIO] = None) -> tuple[BenchResult, dict[str, Path], list[str]]:
    """Run the benchmark; return the result, the written files and problems (worker crashes,
    the time limit). Raises :class:`RuntimeUnavailable` without at least two GPUs."""
    n = _need_gpus(nprocs, "bench")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta, problems = _run_workers(worker_entry, n, cfg, time_limit_s, out, "results.jsonl")
    res = BenchResult(meta, merge(read_jsonl(out / "results.jsonl")))
    skipped = sum(1 for r in res.records if (r.error or "").startswith("skipped: time limit"))
    if skipped:
        problems.append(f"{skipped} cells skipped at the time limit ({time_limit_s:.0f} s)")
    paths = render(res, out)
    print(f"mscclang bench: {len(res.records)} records in {meta['elapsed_s']} s -> "
          f"{paths['json']}, {paths['md']}, {paths['png']}", file=log or sys.stderr)
    return res, paths, problems


def run_first_calls(cfg: BenchConfig, time_limit_s: float, nprocs: Optional[int] = None,
                    json_path: Optional[str] = None,
                    log: Optional[TextIO] = None) -> tuple[list, dict, dict[str, Path], list[str]]:
    """Run the first-call measurement (:mod:`mscclang.bench.first_call`; ranks may share a GPU);
    return the records, the meta, the written files (the JSON at ``json_path`` when given) and
    problems. Raises :class:`RuntimeUnavailable` without two ranks' GPUs."""
    from mscclang.bench.first_call import JSONL, first_call_entry, read_records, render as render_first

    n = _need_gpus(nprocs, "bench", shared=True)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta, problems = _run_workers(first_call_entry, n, cfg, time_limit_s, out, JSONL)
    recs = read_records(out / JSONL)
    paths = render_first(recs, meta, out, json_path)
    print(f"mscclang bench --first-calls: {len(recs)} records in {meta['elapsed_s']} s -> "
          f"{paths['json']}, {paths['md']}", file=log or sys.stderr)
    return recs, meta, paths, problems


def run_host(cfg: BenchConfig, time_limit_s: float, nprocs: Optional[int] = None, json_path: Optional[str] = None,
             log: Optional[TextIO] = None) -> tuple[list, dict, dict[str, Path], list[str]]:
    """Run the host-time measurement (:mod:`mscclang.bench.host`; ranks may share a GPU); return
    the records, the meta, the written files and problems. :class:`RuntimeUnavailable` without
    two ranks' GPUs."""
    from mscclang.bench.host import JSONL, HostRecord, host_entry, render as render_host

    n = _need_gpus(nprocs, "bench", shared=True)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta, problems = _run_workers(host_entry, n, cfg, time_limit_s, out, JSONL)
    recs = read_jsonl(out / JSONL, HostRecord.from_dict)
    paths = render_host(recs, meta, out, json_path)
    print(f"mscclang bench --host: {len(recs)} rows in {meta['elapsed_s']} s -> {paths['json']}, {paths['md']}",
          file=log or sys.stderr)
    return recs, meta, paths, problems


def run_tune_measure(cfg: BenchConfig, time_limit_s: float, nprocs: Optional[int] = None) -> tuple[list[dict], dict, list[str]]:
    """Measure tuning candidates on every GPU; returns the records, the meta and problems."""
    from mscclang.bench.tune_worker import tune_entry

    n = _need_gpus(nprocs, "tune")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("tune.jsonl", "meta.json"):
        (out / stale).unlink(missing_ok=True)
    problems = spawn_workers(tune_entry, n, cfg, time_limit_s)
    recs = []
    p = out / "tune.jsonl"
    if p.is_file():
        for line in p.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    meta = {}
    if (out / "meta.json").is_file():
        try:
            meta = json.loads((out / "meta.json").read_text())
        except json.JSONDecodeError:
            pass
    meta["world_size"] = n
    return recs, meta, problems


def _kill(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(timeout=10)
