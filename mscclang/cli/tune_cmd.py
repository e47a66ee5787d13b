"""``mscclang tune``: measure the candidate plans (shipped variants and extra ones compiled and
simulator-verified now) per collective and size on this machine's GPUs, with a progress bar, and
write a tuning file for the selector.

Without ``--dry-run`` it checks for GPUs before compiling anything. A failed or interrupted run
removes what it created (the tuning file, its ``.plans/`` and ``.work/`` folders); the tuning file
is written through a temporary file, so it is never left half written."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional

from mscclang.cli.args import (GPU_DTYPES, add_output_option, add_progress_flag, add_sizes_option, dtype_arg,
                               int_range_arg, positive_float_arg, writable_dir)
from mscclang.comm.errors import CommError

DEFAULT_COLLS = ("allreduce", "allgather", "reducescatter", "alltoall")
#: most ranks ``--ranks`` / ``--nprocs`` take
MAX_RANKS = 1024


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="measure candidate plans and write a tuning file",
        description="Measure every candidate plan (algorithm x instances x threads: the shipped "
                    "variants plus extra ones compiled and verified in the simulator now) and "
                    "NCCL, per collective and size, as CUDA graphs on all GPUs; write a tuning "
                    "file (use it with MSCCLANG_TUNING=FILE or Communicator(tuning=FILE)).")
    add_output_option(p, default="mscclang_tuning.json", metavar="FILE",
                      help="tuning file to write (extra plans go to FILE's stem + '.plans/')")
    p.add_argument("--collectives", default=",".join(DEFAULT_COLLS), help="comma list")
    add_sizes_option(p, "input bytes", "1K:1G")
    p.add_argument("--instances", default="1,2,4,8,16",
                   help="instances of the extra variants to compile (default 1,2,4,8,16)")
    p.add_argument("--threads", default="",
                   help="threads per block of the extra variants (default: each algorithm's own)")
    p.add_argument("--no-extra", action="store_true", help="measure only the shipped variants")
    p.add_argument("--dtype", default="bfloat16", type=dtype_arg(GPU_DTYPES),
                   help=f"dtype to measure with: {', '.join(GPU_DTYPES)} or an alias; default bfloat16")
    p.add_argument("--quick", action="store_true", help="5 sizes, 3 timed blocks, no extra variants")
    p.add_argument("--time-limit", type=positive_float_arg(), default=480.0, metavar="S",
                   help="no new measurement after S seconds (default 480)")
    p.add_argument("--nprocs", type=int_range_arg(2, MAX_RANKS), default=None, help="GPUs to use (default: all)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPUs needed: compile and verify the extra variants, list the candidates")
    p.add_argument("--predict", action="store_true",
                   help="with --dry-run: rank the candidates of each size by the cost model (writes nothing)")
    p.add_argument("--topology", default="nvlink", help="with --predict: nvlink, NxM or a JSON file")
    p.add_argument("--ranks", type=int_range_arg(2, MAX_RANKS), default=None,
                   help=f"world size for --dry-run, 2..{MAX_RANKS} (default: visible GPUs, else 2)")
    add_progress_flag(p)
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CommError(f"--{what} takes a comma list of integers, got {text!r}") from None


def _check_gpus(nprocs: Optional[int]) -> None:
    """Refuse to start (before compiling anything) unless at least two GPUs can be measured."""
    from mscclang.bench.runner import gpu_count
    from mscclang.errors import RuntimeUnavailable

    have = gpu_count()
    n = have if nprocs is None else nprocs
    if have < 2 or n < 2 or n > have:
        want = "at least 2" if nprocs is None or nprocs < 2 else str(nprocs)
        raise RuntimeUnavailable(f"mscclang tune needs {want} CUDA GPUs to measure; this machine has {have}. "
                                 "Use --dry-run to compile and verify the candidates without GPUs.")


class _Created:
    """Paths this run creates; :meth:`remove` deletes them again (a failed run leaves nothing)."""

    def __init__(self, *paths: Path) -> None:
        self.paths = [p for p in paths if not p.exists()]

    def remove(self) -> None:
        for p in self.paths:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder: an interrupted
    write leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run(args: argparse.Namespace) -> int:
    from mscclang.plan.collectives import plan_collective

    colls = []
    for c in args.collectives.split(","):
        if c.strip():
            pc = plan_collective(c)
            if pc not in colls:
                colls.append(pc)
    if not colls:
        raise CommError("no collective given")
    instances = _ints(args.instances, "instances")
    threads = _ints(args.threads, "threads") if args.threads else []
    for t in threads:
        if not 32 <= t <= 1024 or t % 32:
            raise CommError(f"--threads: {t} is not a multiple of 32 in 32..1024")
    out = Path(args.out)
    if not args.dry_run:
        _check_gpus(args.nprocs)
        writable_dir(str(out.absolute().parent), "--out")
    plans_dir = out.parent / (out.stem + ".plans")
    work_dir = out.parent / (out.stem + ".work")
    created = _Created(out, plans_dir, work_dir)
    try:
        return _tune(args, colls, instances, threads, out, plans_dir, work_dir)
    except BaseException:
        created.remove()
        raise


def _tune(args: argparse.Namespace, colls: list[str], instances: list[int], threads: list[int],
          out: Path, plans_dir: Path, work_dir: Path) -> int:
    from mscclang.bench.runner import gpu_count, run_tune_measure
    from mscclang.bench.sizes import DEFAULT_SIZES, QUICK_SIZES
    from mscclang.bench.worker import BenchConfig
    from mscclang.cli.progress import Progress, progress_wanted
    from mscclang.comm.catalog import Catalog
    from mscclang.comm.tune import CandidateKey, build_table, candidates, compile_extra
    from mscclang.comm.tuning import tuning_to_json

    sizes = args.sizes or list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    dtype = args.dtype
    have = gpu_count()
    n = args.ranks or args.nprocs or (have if have >= 2 else 2)
    catalog = Catalog.from_dir()
    if not len(catalog):
        raise CommError("no shipped plans found (plans/index.json); set MSCCLANG_PLANS_DIR")
    added = []
    if not (args.no_extra or args.quick):
        def with_bar(jobs: Iterable) -> Iterator:
            # a job (algorithm, instances, ...) costs about its instances (its plan's ops): the ETA's work
            jobs = list(jobs)
            with Progress(len(jobs), "compile + verify extra variants", unit="plan",
                          enabled=args.progress, work=sum(inst for _, inst, *_ in jobs)) as bar:
                for job in jobs:
                    yield job
                    _, inst, *_ = job
                    bar.update(work=inst)

        res = compile_extra(catalog, colls, n, instances, threads, None if args.dry_run else plans_dir,
                            progress=with_bar)
        added = res.added
        for key, why in res.rejected:
            print(f"mscclang tune: rejected {key}: {why}", file=sys.stderr)
    if args.dry_run:
        for coll in colls:
            keys = candidates(catalog, coll, n)
            print(f"{coll} ({n} ranks): {len(keys)} candidates + nccl")
            for k in keys:
                print(f"  {k.label()}")
        print(f"{len(added)} extra variants compiled and verified")
        if args.predict:
            from mscclang.comm.tune import rank_by_prediction

            for coll in colls:
                for size in sizes:
                    ranked = rank_by_prediction(catalog, coll, n, size, args.topology)
                    best = ", ".join(f"{p.label} {'in place' if p.inplace else 'out of place'} {p.us:.1f} us"
                                     for p in ranked[:3]) or "no candidate"
                    print(f"predicted {coll} {size} B: {best}")
            print("(predictions rank what to measure; no tuning file is written from them)")
        return 0
    cfg = BenchConfig(colls=colls, sizes=sizes, impls=["mscclang", "nccl"], modes=["graph"],
                      dtype=dtype, out_dir=str(work_dir),
                      blocks=3 if args.quick else 5, iters_scale=0.5 if args.quick else 1.0,
                      extra={"plans_dir": str(plans_dir) if added else None,
                             "progress": progress_wanted(args.progress)})
    recs, meta, problems = run_tune_measure(cfg, args.time_limit, args.nprocs)
    measured: dict = {}
    for r in recs:
        if not r.get("ok") or r.get("us") is None:
            continue
        c = r["candidate"]
        key = CandidateKey(c["algorithm"], c.get("instances"), c.get("threads"))
        measured.setdefault(r["coll"], {}).setdefault(r["bytes"], {})[key] = float(r["us"])
    if not measured:
        for p in problems:
            print(f"mscclang tune: {p}", file=sys.stderr)
        raise CommError("nothing was measured; no tuning file written")
    machine = f"{meta.get('world_size', n)}x {meta.get('device', 'GPU')}"
    table = build_table(measured, meta.get("world_size", n), machine=machine,
                        source=f"mscclang tune ({dtype}, CUDA graph, {len(recs)} measurements)",
                        plans_dir=plans_dir.name if added else None)
    _write_atomic(out, tuning_to_json(table))
    failed = [r for r in recs if not r.get("ok") and not str(r.get("error", "")).startswith("skipped")]
    for r in failed[:20]:
        c = r["candidate"]
        print(f"mscclang tune: {r['coll']} {r['bytes']} {c['algorithm']} i{c.get('instances')}: "
              f"{r.get('error')}", file=sys.stderr)
    for p in problems:
        print(f"mscclang tune: warning: {p}", file=sys.stderr)
    print(f"wrote {out} ({len(table.rules)} rules from {len(recs)} measurements, "
          f"{len(failed)} failed)")
    return 0
