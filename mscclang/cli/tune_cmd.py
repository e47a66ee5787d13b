"""``mscclang tune``: measure the candidate plans (shipped variants and extra ones compiled and
simulator-verified now) per collective and size on this machine's GPUs, with a progress bar, and
write a tuning file for the selector."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mscclang.comm.errors import CommError

DEFAULT_COLLS = ("allreduce", "allgather", "reducescatter", "alltoall")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="measure candidate plans and write a tuning file",
        description="Measure every candidate plan (algorithm x instances x threads: the shipped "
                    "variants plus extra ones compiled and verified in the simulator now) and "
                    "NCCL, per collective and size, as CUDA graphs on all GPUs; write a tuning "
                    "file (use it with MSCCLANG_TUNING=FILE or Communicator(tuning=FILE)).")
    p.add_argument("--out", default="mscclang_tuning.json", metavar="FILE",
                   help="tuning file to write (extra plans go to FILE's stem + '.plans/')")
    p.add_argument("--collectives", default=",".join(DEFAULT_COLLS), help="comma list")
    p.add_argument("--sizes", help="sizes, e.g. 1K:1G (default) or 1K,64K,1M")
    p.add_argument("--instances", default="1,2,4,8,16",
                   help="instances of the extra variants to compile (default 1,2,4,8,16)")
    p.add_argument("--threads", default="",
                   help="threads per block of the extra variants (default: each algorithm's own)")
    p.add_argument("--no-extra", action="store_true", help="measure only the shipped variants")
    p.add_argument("--dtype", default="bfloat16", help="dtype to measure with (default bfloat16)")
    p.add_argument("--quick", action="store_true", help="5 sizes, 3 timed blocks, no extra variants")
    p.add_argument("--time-limit", type=float, default=480.0, metavar="S",
                   help="no new measurement after S seconds (default 480)")
    p.add_argument("--nprocs", type=int, default=None, help="GPUs to use (default: all)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPUs needed: compile and verify the extra variants, list the candidates")
    p.add_argument("--ranks", type=int, default=None,
                   help="world size for --dry-run (default: visible GPUs, else 2)")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CommError(f"--{what} takes a comma list of integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from mscclang.bench.runner import gpu_count, run_tune_measure
    from mscclang.bench.sizes import DEFAULT_SIZES, QUICK_SIZES, parse_sizes
    from mscclang.bench.worker import BenchConfig
    from mscclang.comm.catalog import Catalog
    from mscclang.comm.names import dtype_name, plan_collective
    from mscclang.comm.tune import CandidateKey, build_table, candidates, compile_extra
    from mscclang.comm.tuning import save_tuning

    colls = []
    for c in args.collectives.split(","):
        if c.strip():
            pc = plan_collective(c)
            if pc not in colls:
                colls.append(pc)
    if not colls:
        raise CommError("no collective given")
    sizes = parse_sizes(args.sizes) if args.sizes else list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    instances = _ints(args.instances, "instances")
    threads = _ints(args.threads, "threads") if args.threads else []
    for t in threads:
        if not 32 <= t <= 1024 or t % 32:
            raise CommError(f"--threads: {t} is not a multiple of 32 in 32..1024")
    dtype = dtype_name(args.dtype)
    out = Path(args.out)
    plans_dir = out.parent / (out.stem + ".plans")
    have = gpu_count()
    n = args.ranks or args.nprocs or (have if have >= 2 else 2)
    catalog = Catalog.from_dir()
    if not len(catalog):
        raise CommError("no shipped plans found (plans/index.json); set MSCCLANG_PLANS_DIR")
    added = []
    if not (args.no_extra or args.quick):
        res = compile_extra(catalog, colls, n, instances, threads, None if args.dry_run else plans_dir,
                            progress=lambda jobs: tqdm(jobs, desc="compile + verify extra variants",
                                                       unit="plan", file=sys.stderr))
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
        return 0
    if have < 2:
        from mscclang.errors import RuntimeUnavailable

        raise RuntimeUnavailable(f"mscclang tune needs at least 2 CUDA GPUs to measure; this machine "
                                 f"has {have}. Use --dry-run to compile and verify the candidates.")
    cfg = BenchConfig(colls=colls, sizes=sizes, impls=["mscclang", "nccl"], modes=["graph"],
                      dtype=dtype, out_dir=str(out.parent / (out.stem + ".work")),
                      blocks=3 if args.quick else 5, iters_scale=0.5 if args.quick else 1.0,
                      extra={"plans_dir": str(plans_dir) if added else None})
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
    save_tuning(table, out)
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
