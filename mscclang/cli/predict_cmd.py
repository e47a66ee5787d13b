"""``mscclang predict``: the cost model's timeline of a plan, with no GPU
(:mod:`mscclang.sim.cost`).

* ``mscclang predict plan.json --size 1M [--topology nvlink|NxM|topo.json] [--trace out.json] [--ops]``:
  the predicted total per size, the slowest thread block's ops with ``--ops``, and a Chrome
  trace (one process per rank, one thread per thread block) with ``--trace``.
* ``mscclang predict --error BENCH.json [BENCH.json ...]``: the model's error against the
  CUDA-graph figures of ``mscclang bench`` files (median and worst, per collective and size range).
* ``mscclang predict --calibrate BENCH.json ... [-o FILE]``: refit the model's rates to those
  files (default: print them; ``-o`` writes a calibration file like the shipped
  ``mscclang/sim/h200_calibration.json``).

Sizes are the message size: allgather's output, every other collective's input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from mscclang.errors import MscclangError


def add_parser(sub: "argparse._SubParsersAction") -> None:
    from mscclang.cli.args import sizes_arg

    p = sub.add_parser("predict", help="predicted per-op timeline of a plan (cost model, no GPU)")
    p.add_argument("plan", nargs="?", help="plan JSON (or an MSCCL++ plan)")
    p.add_argument("--size", "--sizes", dest="sizes", type=sizes_arg(), action="append",
                   help="message size(s): 1M, 4K,64M (default 1M)")
    p.add_argument("--topology", default="nvlink", help="nvlink (one node), NxM (N nodes of M GPUs) or a JSON file")
    p.add_argument("--trace", metavar="FILE", help="write the predicted timeline as Chrome trace-event JSON")
    p.add_argument("--ops", action="store_true", help="print the ops of the slowest thread block")
    p.add_argument("--error", nargs="+", metavar="BENCH", help="error of the model against bench JSON files")
    p.add_argument("--calibrate", nargs="+", metavar="BENCH", help="refit the model to bench JSON files")
    p.add_argument("-o", "--out", metavar="FILE", help="with --calibrate: write the calibration here")
    p.set_defaults(func=run)


def _plans_dir() -> Path:
    from mscclang.comm.catalog import default_plans_dir

    d = default_plans_dir()
    if d is None or not Path(d).is_dir():
        raise FileNotFoundError("the shipped plans are not installed (MSCCLANG_PLANS_DIR)")
    return Path(d)


def _bench_rows(f: str) -> list:
    """The rows :func:`mscclang.sim.cost.bench_rows` reads from ``f``; MscclangError naming ``f``
    when it is not a ``mscclang bench`` result or holds no CUDA-graph figure of an mscclang plan."""
    from mscclang.cli.bench_cmd import read_bench_result
    from mscclang.sim import cost

    read_bench_result(f, "")
    rows = cost.bench_rows(Path(f))
    if not rows:
        raise MscclangError(f"{f}: no CUDA-graph figure of an mscclang plan in it (a `mscclang bench` run "
                            "with --impls mscclang and --modes graph has them)")
    return rows


def run(args: argparse.Namespace) -> int:
    """Run the command (a MscclangError or OSError is reported by :mod:`mscclang.cli.main`: one
    ``mscclang predict: error: ...`` line, exit status 1)."""
    from mscclang.sim import cost

    if args.calibrate:
        rows = [r for f in args.calibrate for r in _bench_rows(f)]
        model = cost.fit(rows, _plans_dir())
        text = json.dumps({"fitted_to": [str(f) for f in args.calibrate], "model": cost.model_dict(model)}, indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n")
            print(f"wrote {args.out}")
        else:
            print(text)
        return 0
    if args.error:
        for f in args.error:
            errs = cost.errors(_bench_rows(f), _plans_dir(), cost.calibrated())
            if not errs:
                raise MscclangError(f"{f}: none of its plans is in the plans folder {_plans_dir()}")
            print(f"{f}: {len(errs)} figures")
            print(f"  {'collective':15s} {'sizes':10s} {'rows':>4s} {'median |err|':>12s} {'worst':>7s}  worst at")
            for t in cost.error_table(errs):
                print(f"  {t['collective']:15s} {t['sizes']:10s} {t['rows']:4d} {t['median_abs_error']:12.1%} "
                      f"{t['worst_error']:+7.1%}  {t['worst_at']}")
        return 0
    if not args.plan:
        raise MscclangError("give a plan, --error BENCH.json or --calibrate BENCH.json")
    from mscclang.cli.show_cmd import read_plan_any, refuse_other_files
    from mscclang.plan.collectives import collective

    plan = read_plan_any(args.plan)[0]
    if Path(args.topology).is_file():
        with contextlib.suppress(ValueError):   # not JSON: load_topology says so
            refuse_other_files(f"topology {args.topology}", json.loads(Path(args.topology).read_text()), "a topology", "")
    topo = cost.load_topology(args.topology, plan.world_size)
    sizes = [s for group in (args.sizes or [[1 << 20]]) for s in group]
    traces = []
    for nbytes in sizes:
        inb, outb = collective(plan.collective).call_bytes(plan.world_size, nbytes)
        pred = cost.predict(plan, inb, outb, topo)
        launch = topo.model.launch_us
        print(f"{plan.name}: {nbytes} B on {topo.nodes} x {topo.gpus_per_node} GPUs: predicted {pred.total_us:.2f} us "
              f"(the {launch:.2f} us launch, then {pred.total_us - launch:.2f} us from the first op's start to the "
              "last op's end: the time `mscclang show --trace` draws)")
        if args.ops:
            last = max(pred.ops, key=lambda o: o.end_us)
            for o in [o for o in pred.ops if o.rank == last.rank and o.tb == last.tb]:
                where = f" ({o.src})" if o.src else ""
                peer = f" peer {o.peer}" if o.peer is not None else ""
                print(f"  rank {o.rank} tb {o.tb} op {o.index:3d} {o.name:10s} {o.start_us:9.2f} -> {o.end_us:9.2f} us"
                      f"{peer} {o.nbytes} B waited {o.waited_us:.2f}{where}")
        traces.append(pred.chrome_trace())
    if args.trace:
        out = traces[0] if len(traces) == 1 else {"traceEvents": [e for t in traces for e in t["traceEvents"]]}
        Path(args.trace).write_text(json.dumps(out))
        print(f"wrote {args.trace}")
    return 0
