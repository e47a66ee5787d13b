"""The reliability figures of ``notes/reliability.md``, measured on the GPUs in one command::

    python3 -m tools.reliability --out DIR [--soak-s 150] [--faults]

* soak: random collectives, sizes (1 element .. 64 MiB, log-uniform, odd counts), dtypes, reduce
  ops, buffer kinds and layouts, eager then CUDA-graph replays, every result compared bit for bit
  (:func:`tests.harness.trust_checks.soak`);
* faults: a peer killed or hung mid-stream, eager and graph, on a size mscclang runs and on one
  it hands to NCCL (:mod:`tools.faults`): the exception, the time to error, close().

Writes ``DIR/reliability.json`` and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--soak-s", type=float, default=150.0, help="time limit of the soak")
    ap.add_argument("--calls", type=int, default=100000)
    ap.add_argument("--replays", type=int, default=10000)
    ap.add_argument("--reserve-s", type=float, default=120.0,
                    help="seconds of the soak kept for the CUDA-graph captures and replays")
    ap.add_argument("--size-pool", type=int, default=0,
                    help="random sizes per (collective, element size) to draw from (0: a new size every call)")
    ap.add_argument("--faults", action="store_true", help="also run the fault experiments")
    ap.add_argument("--fault-timeout", type=float, default=5.0)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    res: dict = {}
    from mscclang.runtime.workers import WorkerPool

    with WorkerPool(timeout_s=10.0) as pool:
        soak = pool.run("tests.harness.trust_checks:soak", calls=a.calls, graph_replays=a.replays,
                        time_limit_s=a.soak_s, size_pool=a.size_pool,
                        reserve_s=a.reserve_s)
    res["soak"] = soak
    path = os.path.join(a.out, "reliability.json")

    def save() -> None:   # after every piece: a run cut short keeps what it measured
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    save()
    for r in soak:
        print(f"soak rank {r['rank']}: {r['eager']} eager, {r['graph']} graph replays, "
              f"{len(r['failures'])} mismatches, {r['elapsed_s']:.0f} s, "
              f"{r.get('distinct_sizes')} distinct (collective, bytes)", flush=True)
    if a.faults:
        from tools.faults import run

        res["faults"] = []
        for mode, size, fault, path_ in (("eager", 4096, "kill", "mscclang"), ("graph", 4096, "kill", "mscclang"),
                                         ("graph", 4096, "hang", "mscclang"), ("eager", 4096, "kill", "nccl"),
                                         ("eager", 8 << 20, "kill", "mscclang"), ("eager", 4096, "hang", "mscclang")):
            try:
                r = run(mode, size, fault, a.fault_timeout, path_)
            except Exception as e:  # noqa: BLE001 - a broken experiment is a result too
                r = {"mode": mode, "size": size, "fault": fault, "path": path_, "error": repr(e)}
            res["faults"].append(r)
            save()
            print(f"fault {path_} {mode} {size} {fault}: {r.get('type')} after {r.get('time_to_error_s')} s",
                  flush=True)
    print("| rank | eager calls | graph replays | mismatches | seconds |")
    print("|---|---|---|---|---|")
    for r in soak:
        print(f"| {r['rank']} | {r['eager']} | {r['graph']} | {len(r['failures'])} | {r['elapsed_s']:.0f} |")
    for r in soak:
        for f in r["failures"][:5]:
            print("  ", f[:300])
    for r in res.get("faults", []):
        print(f"fault {r.get('path')} {r.get('mode')} {r.get('size')} {r.get('fault')}: {r.get('type')} after "
              f"{r.get('time_to_error_s')} s; next call {r.get('next_call')}; close {r.get('close_returned')} "
              f"({r.get('close_s')}); survivor exit {r.get('survivor_exitcode')}; {str(r.get('raised'))[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
