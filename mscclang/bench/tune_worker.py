"""``mscclang tune``, the GPU half: one process per GPU times every candidate (and NCCL) per
collective and size as a CUDA graph, after checking its result, and rank 0 streams
``{"coll", "bytes", "candidate", "us", "ok", "error"}`` lines into ``<work>/tune.jsonl``.

Checking, timing, agreement and the process set-up are the bench worker's
(:mod:`mscclang.bench.worker`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from mscclang.bench.cells import Cell
from mscclang.bench.worker import BenchConfig, BenchWorker, error_text, iters_for, median, run_rank
from mscclang.plan.collectives import PLAN_TO_API


class TuneWorker(BenchWorker):
    """Measures candidates instead of a fixed set of implementations."""

    def emit_tune(self, rec: dict) -> None:
        self.append_line("tune.jsonl", rec)

    def check_candidate(self, coll: str, nbytes: int, key: Any) -> tuple[bool, str, Optional[Cell], Optional[str]]:
        """Force candidate ``key`` (or NCCL), build its cell and check one call. Returns
        (ok, error, cell, plan label)."""
        from mscclang.comm.tuning import Candidate, Rule, TuningTable

        def force() -> None:
            self.comm.use_tuning(TuningTable(rules=[Rule(
                collective=coll, world_size=self.world, candidates=[Candidate(
                    plan=key.algorithm, instances=key.instances, threads=key.threads)])]))

        if key.is_nccl:
            ok, err, cell = self.check_call(PLAN_TO_API[coll], "nccl", nbytes)
            return ok, err, cell, None
        ok, err, cell = self.check_call(PLAN_TO_API[coll], "mscclang", nbytes, prepare=force)
        plan = None
        if ok and cell is not None:
            last = self.comm.last
            if last is None or last.variant is None or last.variant.algorithm != key.algorithm:
                ok, err = False, f"not selected (ran {cell.plan or '?'})"
            else:
                plan = cell.plan
        return ok, err, cell, plan

    def tune_cell(self, coll: str, nbytes: int, key: Any) -> dict[str, Any]:
        """The ``tune.jsonl`` record of one candidate at one size (checked, then timed as a CUDA
        graph when every rank's check passed)."""
        rec: dict[str, Any] = {"coll": coll, "bytes": nbytes, "candidate": {
            "algorithm": key.algorithm, "instances": key.instances, "threads": key.threads}}
        if not self.in_time():
            rec.update(ok=False, error="skipped: time limit")
            return rec
        ok, err, cell, plan = self.check_candidate(coll, nbytes, key)
        us = None
        if plan:
            rec["plan"] = plan
        if self.agree(ok):
            try:
                us = median(self.measure(cell, "graph", iters_for(nbytes, self.cfg.iters_scale)))
                ok = True
            except Exception as e:  # noqa: BLE001
                ok, err = False, f"graph: {error_text(e)}"
            ok = self.agree(ok)
        else:
            ok = False
            if not key.is_nccl:
                self._after_failure("mscclang")
        rec.update(ok=ok, us=round(us, 3) if ok and us is not None else None, error=None if ok else err)
        return rec

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
        if self.rank == 0 and self.cfg.extra.get("progress", True):
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(work), desc="mscclang tune", unit="cell", dynamic_ncols=True)
            except ImportError:  # pragma: no cover - tqdm is a dependency of the plot extra
                bar = None
        for coll, nbytes, key in work:
            if bar is not None:
                bar.set_postfix_str(f"{coll} {nbytes} {key.label()}"[:60])
            self.emit_tune(self.tune_cell(coll, nbytes, key))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()


def tune_entry(rank: int, world: int, cfg: BenchConfig, port: int) -> None:
    """``torch.multiprocessing`` entry point of one tuning rank."""
    run_rank(TuneWorker, rank, world, cfg, port)
