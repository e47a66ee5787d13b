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
from typing import Optional

from mscclang.bench.report import render
from mscclang.bench.results import BenchResult, merge, read_jsonl
from mscclang.bench.worker import BenchConfig, worker_entry
from mscclang.errors import RuntimeUnavailable

#: seconds the parent waits past the workers' deadline before killing them
GRACE_S = 90.0


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


def run_bench(cfg: BenchConfig, time_limit_s: float, nprocs: Optional[int] = None,
              log=sys.stderr) -> tuple[BenchResult, dict[str, Path], list[str]]:
    """Run the benchmark; return the result, the written files and problems (worker crashes,
    the time limit). Raises :class:`RuntimeUnavailable` without at least two GPUs."""
    n = gpu_count() if nprocs is None else nprocs
    have = gpu_count()
    if have < 2 or n < 2 or n > have:
        raise RuntimeUnavailable(
            f"mscclang bench needs at least 2 CUDA GPUs (one process per GPU); this machine has "
            f"{have}. Render an earlier run with --from-json FILE.")
    import torch.multiprocessing as mp

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (inherited by the workers)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("results.jsonl", "meta.json"):
        (out / stale).unlink(missing_ok=True)
    start = time.time()
    cfg.deadline = start + time_limit_s
    problems: list[str] = []
    ctx = mp.start_processes(worker_entry, args=(n, cfg, _free_port()), nprocs=n, join=False,
                             start_method="spawn")
    hard = cfg.deadline + GRACE_S
    while True:
        try:
            if ctx.join(timeout=2):
                break
        except Exception as e:  # a worker exited with an error: stop the others
            problems.append(f"worker failed: {str(e).strip().splitlines()[0] if str(e).strip() else e}")
            _kill(ctx)
            break
        if time.time() > hard:
            problems.append(f"workers still running {GRACE_S:.0f} s after the time limit: stopped them")
            _kill(ctx)
            break
    meta = {}
    if (out / "meta.json").is_file():
        try:
            meta = json.loads((out / "meta.json").read_text())
        except json.JSONDecodeError:
            problems.append("meta.json unreadable")
    meta["elapsed_s"] = round(time.time() - start, 1)
    if problems:
        meta["problems"] = problems
    res = BenchResult(meta, merge(read_jsonl(out / "results.jsonl")))
    skipped = sum(1 for r in res.records if (r.error or "").startswith("skipped: time limit"))
    if skipped:
        problems.append(f"{skipped} cells skipped at the time limit ({time_limit_s:.0f} s)")
    paths = render(res, out)
    print(f"mscclang bench: {len(res.records)} records in {meta['elapsed_s']} s -> "
          f"{paths['json']}, {paths['md']}, {paths['png']}", file=log)
    return res, paths, problems


def _kill(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(timeout=10)
