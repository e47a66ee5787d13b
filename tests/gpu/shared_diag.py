"""Diagnose a hang of two ranks sharing one GPU: run one plan, on a hang dump the workers' Python
stacks (faulthandler, SIGABRT) and nvidia-smi. Usage: python3 tests/gpu/shared_diag.py [limit_s]"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

os.environ["PYTHONFAULTHANDLER"] = "1"
from mscclang.plan.io import plan_to_json  # noqa: E402
from mscclang.runtime.launch import WorkerPool  # noqa: E402
from mscclang.testing import sample_plans as sp  # noqa: E402

def main() -> None:
    limit = float(sys.argv[1]) if len(sys.argv) > 1 else 40.0
    t0 = time.time()
    pool = WorkerPool(timeout_s=5.0, env={"PYTHONFAULTHANDLER": "1", "MSCCLANG_ASYNC_ERROR": "log"})
    print(f"pool up in {time.time() - t0:.1f} s", flush=True)


    def dump() -> None:
        print("---- hang: nvidia-smi and worker stacks", flush=True)
        print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout, flush=True)
        for p in pool._procs:
            os.kill(p.pid, signal.SIGABRT)


    timer = threading.Timer(limit, dump)
    timer.start()
    name = sorted(sp.SAMPLES)[0]
    for label, j, nb in [(name, plan_to_json(sp.SAMPLES[name](2)), 1024),
                         ("oneshot", plan_to_json(sp.allreduce_oneshot_ll(2)), 1024)]:
        t = time.time()
        try:
            r = pool.run("mscclang.testing.runtime_checks:run_plan_check", j, nb, "float16", reset_on_error=False)
            print(f"{label}: {r} ({time.time() - t:.2f}s)", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{label}: FAILED after {time.time() - t:.1f}s: {e}"[:4000], flush=True)
    timer.cancel()
    pool.close()


if __name__ == "__main__":
    main()
