"""Diagnose a hang in GPU worker commands: run a list of steps; when one outlasts the limit,
dump nvidia-smi and the workers' Python stacks (faulthandler, SIGABRT; the pool is then gone).
Usage: python3 tests/gpu/shared_diag.py [limit_s] [pipeline]"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

os.environ["PYTHONFAULTHANDLER"] = "1"


def main() -> None:
    from mscclang.plan.io import plan_to_json
    from mscclang.runtime.workers import WorkerPool
    from tests.harness import port_plans as pp
    from mscclang.plan import samples as sp

    limit = float(sys.argv[1]) if len(sys.argv) > 1 else 40.0
    which = sys.argv[2] if len(sys.argv) > 2 else "basic"
    t0 = time.time()
    pool = WorkerPool(timeout_s=3.0, env={"PYTHONFAULTHANDLER": "1", "MSCCLANG_ASYNC_ERROR": "log"})
    print(f"pool up in {time.time() - t0:.1f} s", flush=True)
    C, P = "tests.harness.runtime_checks", "tests.harness.port_checks"
    if which == "pipeline":
        j = plan_to_json(pp.sendrecv_pipelined(unit=1 << 16))
        steps = [("pipeline graph 64K", f"{P}:graph_replays", (j, 1 << 16, "int32", 2)),
                 ("pipeline graph 256K", f"{P}:graph_replays", (j, 1 << 18, "int32", 2))]
    else:
        name = sorted(sp.SAMPLES)[0]
        steps = [(name, f"{C}:run_plan_check", (plan_to_json(sp.SAMPLES[name](2)), 1024, "float16")),
                 ("oneshot", f"{C}:run_plan_check", (plan_to_json(sp.allreduce_oneshot_ll(2)), 1024, "float16"))]
    for label, target, args in steps:
        def dump(label: str = label) -> None:
            print(f"---- {label}: no answer in {limit:.0f} s; worker stacks follow", flush=True)
            print(subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv"],
                                 capture_output=True, text=True).stdout, flush=True)
            for p in pool._procs:
                os.kill(p.pid, signal.SIGABRT)

        timer = threading.Timer(limit, dump)
        timer.start()
        t = time.time()
        try:
            r = pool.run(target, *args, reset_on_error=False)
            print(f"{label}: {r} ({time.time() - t:.2f}s)"[:1500], flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{label}: FAILED after {time.time() - t:.1f}s: {e}"[:5000], flush=True)
            timer.cancel()
            break
        timer.cancel()
    pool.close()


if __name__ == "__main__":
    main()
