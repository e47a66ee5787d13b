"""``mscclang bench``: collectives x sizes x {mscclang, NCCL, torch SymmetricMemory two-shot},
eager and CUDA graph, one process per GPU; writes JSON, a markdown table and a PNG plot.
``--first-calls`` and ``--host`` measure a new size's first call and the host's time per call
instead (ranks may share a GPU there)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mscclang.bench.fused import DEFAULT_HIDDEN
from mscclang.bench.host import DEFAULT_CALLS, DEFAULT_REPEATS, MAX_CALLS
from mscclang.bench.results import IMPLS, ORDINARY
from mscclang.bench.sizes import FIRST_CALL_SIZES
from mscclang.cli.args import (GPU_DTYPES, add_output_option, add_sizes_option, dtype_arg, int_range_arg,
                               positive_float_arg, writable_dir)
from mscclang.comm.errors import CommError
from mscclang.comm.tuning import load_tuning

ALL_COLLS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "all_reduce_add_rms_norm",
             "all_to_all_v", "all_to_all_v_skewed", "moe", "moe_skewed")
DEFAULT_COLLS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MODES = ("graph", "eager")


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    from mscclang.plan.collectives import plan_collective
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
    p.add_argument("--hidden", type=int_range_arg(8, 65536), default=None, metavar="H",
                   help="all_reduce_add_rms_norm: elements per row (default 8192); its sizes are the bytes "
                        "of x, whole rows (default 1 to 512 tokens); its columns are the fused call, "
                        "mscclang's allreduce + torch's norm, NCCL + torch's norm and FlashInfer's "
                        "allreduce_fusion (when installed). all_to_all_v, all_to_all_v_skewed (uniform and "
                        "skewed routing): elements per row (default 7168); sizes are the bytes each rank "
                        "sends (default 1 to 4096 rows per peer); columns mscclang's all_to_all_v and NCCL's "
                        "all_to_all_single with splits. moe, moe_skewed (dispatch -> expert -> combine, uniform "
                        "and skewed top-8 routing over 32 experts a rank): elements per row (default 7168); "
                        "sizes are one rank's tokens (default 1 to 4096); columns mscclang's moe_dispatch/"
                        "moe_combine, torch's all_to_all_single layer and DeepEP (when installed); timed "
                        "fresh, as 128 chained pairs (p50, p99) and as a CUDA graph")
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
    p.add_argument("--warm-up", action="store_true",
                   help="--first-calls: call Communicator.warm_up for the collectives and sizes first "
                        "(timed), so the table shows what calls cost after the documented warm-up")
    p.add_argument("--host", action="store_true",
                   help="instead of the sweep: host microseconds per queued call of the Communicator's and "
                        "torch.distributed's all_reduce and of the fused call, beside a torch launch, with the "
                        "host-time targets (README: Host time per call); ranks may share a GPU; writes "
                        "DIR/host.json and DIR/host.md")
    p.add_argument("--calls", type=int_range_arg(1, MAX_CALLS), default=None, metavar="N",
                   help=f"--host: calls queued per timed loop (default {DEFAULT_CALLS})")
    p.add_argument("--repeats", type=int_range_arg(1, 100), default=None, metavar="R",
                   help=f"--host: timed loops per row, the median reported (default {DEFAULT_REPEATS})")
    p.add_argument("--json", metavar="PATH",
                   help="--host, --first-calls: write the JSON document to PATH instead of DIR")
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
                           dtype=args.dtype, out_dir=args.out, tuning=args.tuning,
                           extra={"warm_up": bool(getattr(args, "warm_up", False))})
    sizes = args.sizes or list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    impls = _list(args.impls, IMPLS, "implementation")
    for a in (x.strip() for x in (getattr(args, "algos", "") or "").split(",")):
        if a and f"mscclang:{a}" not in impls:
            impls.append(f"mscclang:{a}")
    chosen = _list(colls, ALL_COLLS, "collective")
    extra: dict = {}
    if "all_reduce_add_rms_norm" in chosen:   # its sizes are whole rows of x (mscclang.bench.fused)
        extra["hidden"] = getattr(args, "hidden", None) or DEFAULT_HIDDEN
        if args.sizes:
            extra["fused_sizes"] = list(args.sizes)
    if {"all_to_all_v", "all_to_all_v_skewed"} & set(chosen):   # rows of --hidden (mscclang.bench.alltoallv)
        extra["hidden"] = getattr(args, "hidden", None) or 7168
        if args.sizes:
            extra["a2av_sizes"] = list(args.sizes)
    if {"moe", "moe_skewed"} & set(chosen):   # tokens of --hidden (mscclang.bench.moe)
        extra["hidden"] = getattr(args, "hidden", None) or 7168
        if args.sizes:
            extra["moe_sizes"] = list(args.sizes)
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


def read_bench_result(path: str, where: str = "--from-json ") -> Any:
    """The :class:`mscclang.bench.results.BenchResult` of file ``path``; CommError naming
    ``where`` + ``path`` when the file is not a ``mscclang bench`` result (OSError when it
    cannot be read)."""
    import json

    from mscclang.bench.results import load_result
    from mscclang.cli.show_cmd import refuse_other_files

    try:
        data = json.loads(Path(path).read_text())
        refuse_other_files(where + path, data, "a `mscclang bench` result", want="mscclang.bench/")
        return load_result(data)
    except (ValueError, KeyError, TypeError, AttributeError, CommError) as e:
        raise CommError(f"{where}{path}: not a `mscclang bench` result ({e})") from None


def run(args: argparse.Namespace) -> int:
    from mscclang.bench.report import markdown, render

    writable_dir(args.out, "--out")
    _check_mode_options(args)
    load_tuning(args.tuning)   # a bad --tuning or MSCCLANG_TUNING: refused here, not in each worker
    if args.json:
        writable_dir(str(Path(args.json).absolute().parent), "--json")
    if args.from_json:
        res = read_bench_result(args.from_json)
        paths = render(res, args.out)
        print(markdown(res))
        print(f"wrote {paths['json']}, {paths['md']}, {paths['png']}", file=sys.stderr)
        return 0
    from mscclang.bench.runner import run_bench

    if args.host:
        return _run_host(args)
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


#: the options of one mode or a few ("": the sweep) -> the modes that take them
_MODE_OPTIONS = {"--quick": ("",), "--impls": ("",), "--modes": ("",), "--algos": ("",), "--gpus-per-node": ("",),
                 "--hidden": ("",), "--sizes": ("", "--first-calls"), "--collectives": ("", "--first-calls"),
                 "--calls": ("--host",), "--repeats": ("--host",), "--json": ("--host", "--first-calls"),
                 "--warm-up": ("--first-calls",)}


def _check_mode_options(args: argparse.Namespace) -> None:
    """:class:`CommError` naming the options the chosen mode (one of ``--host``,
    ``--first-calls``, ``--from-json`` or none: the sweep) does not take, and which modes take
    them (:data:`_MODE_OPTIONS`; ``--from-json`` renders a file and reads none of them)."""
    modes = [o for o, on in (("--host", args.host), ("--first-calls", args.first_calls),
                             ("--from-json", bool(args.from_json))) if on]
    if len(modes) > 1:
        raise CommError(f"{' and '.join(modes)} are different modes: choose one")
    mode = modes[0] if modes else ""
    if mode == "--from-json":
        return
    given = {"--quick": args.quick, "--impls": args.impls != ",".join(IMPLS),
             "--modes": args.modes != ",".join(MODES), "--algos": bool(args.algos),
             "--gpus-per-node": args.gpus_per_node is not None,
             "--hidden": args.hidden is not None, "--sizes": args.sizes is not None,
             "--collectives": args.collectives is not None, "--calls": args.calls is not None,
             "--repeats": args.repeats is not None, "--json": args.json is not None,
             "--warm-up": bool(getattr(args, "warm_up", False))}
    bad = [f"{o} (an option of {' and '.join(m or 'the sweep' for m in _MODE_OPTIONS[o])})"
           for o, on in given.items() if on and mode not in _MODE_OPTIONS[o]]
    if bad:
        raise CommError(f"{mode or 'the sweep'} takes no {', '.join(bad)}")


def _report(recs: list, paths: dict, problems: list[str], what: str) -> int:
    """Print a mode's table and its problems; 0 only when every row was checked correct and
    measured (a skipped row is no failure, a missed target neither)."""
    print(paths["md"].read_text())
    for p in problems:
        print(f"mscclang bench: warning: {p}", file=sys.stderr)
    failed = [r for r in recs if not r.ok and r.error and not r.error.startswith("skipped")]
    if failed:
        print(f"mscclang bench: {len(failed)} {what} failed their check or run (see the table)", file=sys.stderr)
    return 1 if failed or problems or not any(r.ok for r in recs) else 0


def _run_first_calls(cfg: Any, args: argparse.Namespace) -> int:
    """``--first-calls``: print the table; 0 only when every size was checked correct and timed."""
    from mscclang.bench.runner import run_first_calls

    recs, _, paths, problems = run_first_calls(cfg, args.time_limit, args.nprocs, args.json)
    return _report(recs, paths, problems, "sizes")


def _run_host(args: argparse.Namespace) -> int:
    """``--host``: print the table; 0 only when every row that ran was checked correct and timed."""
    from mscclang.bench.host import host_config
    from mscclang.bench.runner import run_host

    cfg = host_config(args.dtype, args.out, args.tuning, calls=args.calls or DEFAULT_CALLS,
                      repeats=args.repeats or DEFAULT_REPEATS)
    recs, _, paths, problems = run_host(cfg, args.time_limit, args.nprocs, args.json)
    return _report(recs, paths, problems, "rows")
