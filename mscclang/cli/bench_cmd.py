"""``mscclang bench``: collectives x sizes x {mscclang, NCCL, torch SymmetricMemory two-shot},
eager and CUDA graph, one process per GPU; writes JSON, a markdown table and a PNG plot."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mscclang.bench.results import IMPLS, ORDINARY
from mscclang.bench.sizes import FIRST_CALL_SIZES
from mscclang.cli.args import (GPU_DTYPES, add_output_option, add_sizes_option, dtype_arg, int_range_arg,
                               positive_float_arg, writable_dir)
from mscclang.comm.errors import CommError

ALL_COLLS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "all_reduce_add_rms_norm")
DEFAULT_COLLS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MODES = ("graph", "eager")


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    from mscclang.comm.names import plan_collective
    from mscclang.plan.collectives import PLAN_TO_API

    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if what == "collective" and part not in allowed:
            part = PLAN_TO_API.get(plan_collective(part), part)
        if part not in allowed:
            raise CommError(f"unknown {what} {part!r}; choose from {', '.join(allowed)}")
        if part not in out:
            out.append(part)
    if not out:
        raise CommError(f"no {what} given")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="benchmark collectives against NCCL and torch SymmetricMemory",
        description="Benchmark mscclang's collectives against NCCL (torch.distributed) and torch "
                    "SymmetricMemory's two-shot allreduce, eager and as CUDA graphs, one process "
                    "per GPU. Each result is checked before it is timed. Writes DIR/bench.json, "
                    "DIR/bench.md (table) and DIR/bench.png (plot).")
    add_output_option(p, default="bench_out", metavar="DIR", help="output folder (default bench_out)")
    p.add_argument("--quick", action="store_true",
                   help="5 sizes (1K, 64K, 1M, 16M, 256M); everything else as in the full run "
                        "(same calls per CUDA graph, timed blocks, warm-up, prepare, tuning), so "
                        "its figures are the full run's at those sizes")
    add_sizes_option(p, "input bytes", "1K:1G")
    p.add_argument("--collectives", default=None,
                   help=f"comma list of {', '.join(ALL_COLLS)} (default: the first four; with "
                        "--first-calls: all_reduce)")
    p.add_argument("--hidden", type=int_range_arg(8, 65536), default=8192, metavar="H",
                   help="all_reduce_add_rms_norm: elements per row (default 8192); its sizes are the bytes "
                        "of x, whole rows (default 1 to 512 tokens); its columns are the fused call, "
                        "mscclang's allreduce + torch's norm, NCCL + torch's norm and FlashInfer's "
                        "allreduce_fusion (when installed)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="comma list of mscclang (symmetric tensors from comm.empty), ordinary "
                        "(mscclang on torch.empty tensors, captured inside comm.graph_capture()), "
                        "nccl, symm (default: all)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of graph, eager")
    p.add_argument("--dtype", default="bfloat16", type=dtype_arg(GPU_DTYPES),
                   help=f"{', '.join(GPU_DTYPES)} or an alias (fp16, bf16, fp32, i32); default bfloat16")
    p.add_argument("--time-limit", type=positive_float_arg(), default=400.0, metavar="S",
                   help="no new measurement starts after S seconds (default 400); workers are "
                        "stopped 60 s later, so a run ends within 8 minutes")
    p.add_argument("--nprocs", type=int_range_arg(2, 1024), default=None, help="processes (GPUs) to use (default: all)")
    p.add_argument("--tuning", help="tuning file for mscclang (default: $MSCCLANG_TUNING or the shipped one)")
    p.add_argument("--algos", default="", metavar="NAMES",
                   help="comma list of library algorithms or plan variants (e.g. a copy-engine "
                        "allgather) to time as extra columns 'mscclang:NAME', each forced for its "
                        "collective whatever the tuning chooses")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="run the GPUs as nodes of N (MSCCLANG_GPUS_PER_NODE=N; NCCL's P2P and SHM "
                        "transports off, so NCCL uses its network transport too): e.g. 1 makes two "
                        "GPUs two one-GPU nodes whose port channels go through the engine")
    p.add_argument("--first-calls", action="store_true",
                   help="instead of the sweep: for each size (never seen before by the communicator; "
                        "default " + ", ".join(str(x) for x in FIRST_CALL_SIZES) + " bytes, or "
                        "--sizes) and collective (default all_reduce), time the first eager call "
                        "and then the second one of that size (host wall time around the call and "
                        "the device sync, fresh ordinary tensors and random data, results checked); "
                        "writes DIR/first_calls.json and DIR/first_calls.md")
    p.add_argument("--from-json", metavar="FILE",
                   help="do not measure: render FILE (a bench.json, or a baseline list) into --out")
    p.set_defaults(func=run)


def bench_config(args: argparse.Namespace) -> Any:
    """The bench's configuration. ``--quick`` runs fewer sizes and nothing else differs: the same
    calls per CUDA graph and timed blocks, so its figures are the library's real speed (half the
    calls per graph spread the ranks' start skew over fewer calls, which read as +1 us at 1K)."""
    from mscclang.bench.sizes import DEFAULT_SIZES, QUICK_SIZES
    from mscclang.bench.worker import BenchConfig

    first = getattr(args, "first_calls", False)
    colls = args.collectives or ("all_reduce" if first else ",".join(DEFAULT_COLLS))
    if first:
        return BenchConfig(colls=_list(colls, ALL_COLLS, "collective"),
                           sizes=list(args.sizes or FIRST_CALL_SIZES), impls=[ORDINARY], modes=["eager"],
                           dtype=args.dtype, out_dir=args.out, tuning=args.tuning)
    sizes = args.sizes or list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    impls = _list(args.impls, IMPLS, "implementation")
    for a in (x.strip() for x in (getattr(args, "algos", "") or "").split(",")):
        if a and f"mscclang:{a}" not in impls:
            impls.append(f"mscclang:{a}")
    chosen = _list(colls, ALL_COLLS, "collective")
    extra: dict = {}
    if "all_reduce_add_rms_norm" in chosen:   # its sizes are whole rows of x (mscclang.bench.fused)
        extra["hidden"] = getattr(args, "hidden", 8192)
        if args.sizes:
            extra["fused_sizes"] = list(args.sizes)
    gpn = getattr(args, "gpus_per_node", None)
    if gpn is not None:
        if gpn < 1:
            raise CommError(f"--gpus-per-node must be at least 1, got {gpn}")
        extra["gpus_per_node"] = gpn
    return BenchConfig(
        colls=chosen,
        sizes=sizes,
        impls=impls,
        modes=_list(args.modes, MODES, "mode"),
        dtype=args.dtype,
        out_dir=args.out,
        tuning=args.tuning,
        extra=extra,
    )


def run(args: argparse.Namespace) -> int:
    from mscclang.bench.report import markdown, render
    from mscclang.bench.results import load_result

    writable_dir(args.out, "--out")
    if args.from_json:
        res = load_result(args.from_json)
        paths = render(res, args.out)
        print(markdown(res))
        print(f"wrote {paths['json']}, {paths['md']}, {paths['png']}", file=sys.stderr)
        return 0
    from mscclang.bench.runner import run_bench

    cfg = bench_config(args)
    if args.first_calls:
        return _run_first_calls(cfg, args)
    res, paths, problems = run_bench(cfg, args.time_limit, args.nprocs)
    print(paths["md"].read_text())
    for p in problems:
        print(f"mscclang bench: warning: {p}", file=sys.stderr)
    failed = [r for r in res.records if not r.ok and r.error and not r.error.startswith("skipped")]
    if failed:
        print(f"mscclang bench: {len(failed)} cells failed their check or run (see the table)",
              file=sys.stderr)
    # 0 only when every cell that ran was checked correct and timed
    return 1 if failed or problems or not any(r.measured for r in res.records) else 0


def _run_first_calls(cfg: Any, args: argparse.Namespace) -> int:
    """``--first-calls``: print the table; 0 only when every size was checked correct and timed."""
    from mscclang.bench.runner import run_first_calls

    recs, _, paths, problems = run_first_calls(cfg, args.time_limit, args.nprocs)
    print(paths["md"].read_text())
    for p in problems:
        print(f"mscclang bench: warning: {p}", file=sys.stderr)
    failed = [r for r in recs if not r.ok and r.error and not r.error.startswith("skipped")]
    if failed:
        print(f"mscclang bench: {len(failed)} sizes failed their check or run (see the table)", file=sys.stderr)
    return 1 if failed or problems or not any(r.ok for r in recs) else 0
