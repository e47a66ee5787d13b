"""Quick GPU smoke + measurements in one process tree (for the device machine):
python tests/gpu/smoke.py [--perf]. Prints one line per check."""

from __future__ import annotations

import json
import sys
import time
import traceback

from mscclang.plan.io import plan_to_json
from mscclang.runtime import sample_plans as sp
from mscclang.runtime.launch import WorkerPool

C = "mscclang.runtime.checks"


def stage_plan(n: int, stage: str, nthreads: int = 128) -> str:
    """The 1-block one-shot LL plan cut down for timing (not a correct collective): ``nop`` (launch,
    prologue, epilogue), ``cpkt`` (pack the input into local scratch), ``ppkt`` (pack it into the
    peer's scratch, no wait), ``full`` (the whole plan)."""
    d = json.loads(plan_to_json(sp.allreduce_oneshot_ll(n, nblocks=1, nthreads=nthreads)))
    for g in d["gpus"]:
        ops = g["threadblocks"][0]["ops"]
        if stage == "nop":
            ops[:] = [{"name": "nop"}]
        elif stage == "cpkt":
            ops[:] = [{"name": "cpkt", "src_buff": [{"type": "i", "index": 0, "size": n}],
                       "dst_buff": [{"type": "s", "index": 0, "size": n}]}]
        elif stage == "ppkt":
            ops[:] = [o for o in ops if o["name"] == "ppkt"]
    return json.dumps(d)


def main() -> int:
    perf = "--perf" in sys.argv
    t0 = time.time()
    out = {}
    with WorkerPool(timeout_s=5.0) as pool:
        n = pool.world_size
        print(f"pool up with {n} ranks in {time.time() - t0:.1f}s", flush=True)

        def step(label, target, *args):
            t = time.time()
            try:
                r = pool.run(target, *args)
                print(f"{label}: {r} ({time.time() - t:.2f}s)", flush=True)
                out[label] = r
            except Exception as e:  # noqa: BLE001
                print(f"{label}: FAILED {e}"[:3000], flush=True)
                out[label] = str(e)[:3000]

        for name in ([] if "--perf-only" in sys.argv else sp.SAMPLES):
            j = plan_to_json(sp.SAMPLES[name](n))
            step(f"{name} 1KiB", f"{C}:check_plan", j, 1024, "float16")
            step(f"{name} 3000B", f"{C}:check_plan", j, 3000, "float16")
        j1 = plan_to_json(sp.allreduce_oneshot_ll(n))
        if "--perf-only" in sys.argv:
            perf = True
        else:
          step("oneshot LL8", f"{C}:check_plan", j1, 4096, "float16", "LL8")
          step("oneshot bf16 max", f"{C}:check_plan", j1, 4096, "bfloat16", None, "max")
          step("oneshot graph", f"{C}:back_to_back", j1, 1024, 200, "float16", None, True)
          step("oneshot eager b2b", f"{C}:back_to_back", j1, 1024, 2000)
          step("allgather graph", f"{C}:back_to_back", plan_to_json(sp.allgather_simple(n)), 4096, 200, "float16",
             None, True)
          step("timeout", f"{C}:timeout_and_reset", plan_to_json(sp.missing_signal(n)), j1, 1.0)
        if perf:
            step("eager us 1KiB oneshot", f"{C}:time_eager", j1, 1024, 3000)
            step("eager us 1KiB oneshot cooperative", f"{C}:time_eager", j1, 1024, 3000, "float16", None, True)
            j128 = plan_to_json(sp.allreduce_oneshot_ll(n, nblocks=1, nthreads=128))
            step("graph us 1KiB oneshot 1x128 cooperative", f"{C}:time_graph", j128, 1024, 100, 20, "float16",
                 None, True)
            step("graph us 1KiB oneshot 1x128 LL8", f"{C}:time_graph", j128, 1024, 100, 20, "float16", "LL8")
            for nb in (1, 2):
                for nt in (64, 128, 256, 512):
                    jj = plan_to_json(sp.allreduce_oneshot_ll(n, nblocks=nb, nthreads=nt))
                    step(f"graph us 1KiB oneshot {nb}x{nt}", f"{C}:time_graph", jj, 1024)
        if "--stages" in sys.argv:
            # where the 1 KiB one-shot time goes: the same plan cut down to a prefix of its work
            for stage in ("nop", "cpkt", "ppkt", "full"):
                jj = stage_plan(n, stage)
                step(f"stage graph us 1KiB 1x128 {stage}", f"{C}:time_graph", jj, 1024)
        if "--scaling" in sys.argv:
            # bandwidth over blocks: zero-copy put allgather (64 MiB per rank, symmetric buffers)
            # and one-shot LL allreduce (1 MiB)
            for nb in (1, 2, 4, 8, 16, 32):
                jj = plan_to_json(sp.allgather_put(n, nblocks=nb))
                step(f"put allgather 64MiB {nb}x1024", f"{C}:time_graph", jj, 64 << 20, 10, 5, "float16", None,
                     False, True)
            for nb in (1, 2, 4, 8, 16, 32):
                jj = plan_to_json(sp.allreduce_oneshot_ll(n, nblocks=nb, nthreads=512))
                step(f"oneshot LL 1MiB {nb}x512", f"{C}:time_graph", jj, 1 << 20, 20, 10)
    with open(sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else "/dev/null", "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
