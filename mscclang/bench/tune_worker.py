"""``mscclang tune``, the GPU half: one process per GPU times every candidate (and NCCL) per
collective and size as a CUDA graph, after checking its result, and rank 0 streams
``{"coll", "bytes", "candidate", "us", "ok", "error"}`` lines into ``<work>/tune.jsonl``."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from mscclang.bench.worker import BenchConfig, BenchWorker, iters_for
from mscclang.comm.names import PLAN_TO_API


class TuneWorker(BenchWorker):
    """Measures candidates instead of a fixed set of implementations."""

    def emit_tune(self, rec: dict) -> None:
        if self.rank == 0:
            with open(self.out_dir / "tune.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")

    def check_candidate(self, coll: str, nbytes: int, key: Any) -> tuple[bool, str, Any, Optional[str]]:
        """Force candidate ``key`` (or NCCL), build its cell and check one call. Returns
        (ok, error, cell, plan label)."""
        from mscclang.comm.tuning import Candidate, Rule, TuningTable

        api = PLAN_TO_API[coll]
        cell, plan = None, None
        try:
            if key.is_nccl:
                cell = self.make_cell(api, "nccl", nbytes)
            else:
                self.comm.use_tuning(TuningTable(rules=[Rule(
                    collective=coll, world_size=self.world, candidates=[Candidate(
                        plan=key.algorithm, instances=key.instances, threads=key.threads)])]))
                cell = self.make_cell(api, "mscclang", nbytes)
            ok, err = self.check(api, cell)
            if ok and not key.is_nccl:
                last = self.comm.last
                if last is None or last.variant is None or last.variant.algorithm != key.algorithm:
                    ok, err = False, f"not selected (ran {last.label() if last else '?'})"
                else:
                    plan = last.label()
        except Exception as e:  # noqa: BLE001
            ok, err = False, f"{type(e).__name__}: {str(e)[:300]}"
            if os.environ.get("MSCCLANG_BENCH_DEBUG"):
                traceback.print_exc()
        return ok, err, cell, plan

    def run(self) -> None:
        from mscclang.comm.catalog import Catalog
        from mscclang.comm.tune import NCCL_KEY, candidates

        self.setup()
        if self.comm is None:
            raise RuntimeError(f"no mscclang communicator: {self.comm_error}")
        extra = self.cfg.extra.get("plans_dir")
        if extra and Path(extra).is_dir():
            for v in Catalog.from_dir(extra):
                self.comm.catalog.add(v)
        n = self.world
        work = []
        for coll in self.cfg.colls:  # plan names
            keys = candidates(self.comm.catalog, coll, n)
            for nbytes in self.cfg.sizes:
                fits = [k for k in keys
                        if any(v.fits(nbytes) for v in self.comm.catalog.find_all(
                            k.algorithm, coll, n, k.instances, k.threads))]
                work += [(coll, nbytes, k) for k in fits] + [(coll, nbytes, NCCL_KEY)]
        bar = None
        if self.rank == 0:
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(work), desc="mscclang tune", unit="cell", dynamic_ncols=True)
            except ImportError:  # pragma: no cover - tqdm is a dependency of the plot extra
                bar = None
        for coll, nbytes, key in work:
            rec: dict[str, Any] = {"coll": coll, "bytes": nbytes, "candidate": {
                "algorithm": key.algorithm, "instances": key.instances, "threads": key.threads}}
            if bar is not None:
                bar.set_postfix_str(f"{coll} {nbytes} {key.label()}"[:60])
            if not self.agree(time.time() < self.cfg.deadline):
                rec.update(ok=False, error="skipped: time limit")
                self.emit_tune(rec)
                if bar is not None:
                    bar.update(1)
                continue
            ok, err, cell, plan = self.check_candidate(coll, nbytes, key)
            us = None
            if plan:
                rec["plan"] = plan
            if self.agree(ok):
                try:
                    times = self.time_graph(cell, iters_for(nbytes, self.cfg.iters_scale))
                    times.sort()
                    us = times[len(times) // 2]
                    ok = True
                except Exception as e:  # noqa: BLE001
                    ok, err = False, f"graph: {type(e).__name__}: {str(e)[:300]}"
                ok = self.agree(ok)
            else:
                ok = False
                if not key.is_nccl:
                    self._after_failure("mscclang")
            rec.update(ok=ok, us=round(us, 3) if ok and us is not None else None, error=None if ok else err)
            self.emit_tune(rec)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()


def tune_entry(rank: int, world: int, cfg: BenchConfig, port: int) -> None:
    """``torch.multiprocessing`` entry point of one tuning rank."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    code = 0
    try:
        w = TuneWorker(rank, world, cfg)
        w.run()
        w.barrier()
        torch.cuda.synchronize()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    os._exit(code)
