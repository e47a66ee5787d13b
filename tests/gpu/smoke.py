"""Quick GPU smoke + measurements in one process tree (for the device machine):
python tests/gpu/smoke.py [--perf] [--perf-only] [--stages] [--scaling] [--spec] [--json FILE]
(every visible GPU; any world size), or, without a GPU, ``--prebuild DIR [--world N]``.
Prints one line per check. ``--spec``: graph/eager latency of the plan-specialised kernel next to
the interpreter's (1 KiB one-shot shapes, LL16/LL8, stage breakdown) and a summary table last."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from mscclang.plan.io import plan_to_json
from mscclang.plan import samples as sp
from mscclang.runtime.workers import WorkerPool

C = "tests.harness.runtime_checks"


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


def prebuild(out_dir: str, n: int = 2) -> int:
    """Prebuild (here, no GPU) the specialised kernels this script's ``--spec`` run and a graph
    bench of the shipped ``n``-rank allreduce plans (1K-256K, bfloat16) use, into ``out_dir`` (the
    GPU machine finds them through MSCCLANG_CUBIN_DIR even without a usable NVRTC)."""
    from pathlib import Path

    from mscclang.plan.io import load_plan
    from mscclang.runtime.spec_build import prebuild as pb

    out = Path(out_dir)
    jobs = []
    for nb, nt in ((1, 128), (1, 512), (2, 512)):
        jobs.append((sp.allreduce_oneshot_ll(n, nblocks=nb, nthreads=nt), [1024], "f16", ["ll16", "ll8"]))
    for stage in ("nop", "cpkt", "ppkt", "full"):
        jobs.append((load_plan(stage_plan(n, stage)), [1024], "f16", ["ll16"]))
    jobs.append((sp.allreduce_oneshot_ll(n, nblocks=1, nthreads=512), [4096, 16384], "f16", ["ll16"]))
    jobs.append((sp.allreduce_oneshot_ll(n, nblocks=4, nthreads=512), [65536, 262144], "f16", ["ll16"]))
    jobs.append((sp.allreduce_oneshot_ll(n), [1024], "f16", ["ll16"]))
    root = Path(__file__).resolve().parent.parent.parent / "plans"
    sizes = [1 << k for k in range(10, 19, 2)]
    for f in sorted(root.glob(f"allreduce_*_ll.r{n}.i*.json")):
        jobs.append((load_plan(f.read_text()), sizes, "bf16", ["ll16"]))
    count = 0
    for flags in ("early", "end"):
        os.environ["MSCCLANG_SPEC_FLAGS"] = flags
        for plan, szs, dt, pkts in jobs:
            for label, what in pb(plan, [(s, s) for s in szs], [dt], pkts, ["sum"], out):
                count += what.endswith(".cubin")
                if not what.endswith(".cubin"):
                    print(label, what)
    os.environ.pop("MSCCLANG_SPEC_FLAGS")
    print(f"{count} specialised cubins in {out}")
    return 0


def main() -> int:
    if "--prebuild" in sys.argv:
        world = int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else 2
        return prebuild(sys.argv[sys.argv.index("--prebuild") + 1], world)
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

        quick = "--perf-only" in sys.argv or ("--spec" in sys.argv and "--perf" not in sys.argv)
        for name in ([] if quick else sp.SAMPLES):
            j = plan_to_json(sp.SAMPLES[name](n))
            step(f"{name} 1KiB", f"{C}:run_plan_check", j, 1024, "float16")
            step(f"{name} 3000B", f"{C}:run_plan_check", j, 3000, "float16")
        j1 = plan_to_json(sp.allreduce_oneshot_ll(n))
        if "--perf-only" in sys.argv:
            perf = True
        elif not quick:
          step("oneshot LL8", f"{C}:run_plan_check", j1, 4096, "float16", "LL8")
          step("oneshot bf16 max", f"{C}:run_plan_check", j1, 4096, "bfloat16", None, "max")
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
        if "--spec" in sys.argv:
            # CUDA-graph time per launch, 1000 launches per graph (rank skew / 1000), median of 10
            table = []

            def timed(lab, *args):
                step(lab, f"{C}:time_graph", *args)
                table.append(lab)

            lib = (Path(__file__).resolve().parent.parent.parent / "plans"
                   / f"allreduce_oneshot_ll.r{n}.i1.inplace.json").read_text()
            j128 = plan_to_json(sp.allreduce_oneshot_ll(n, nblocks=1, nthreads=128))
            j2 = plan_to_json(sp.allreduce_oneshot_ll(n, nblocks=2, nthreads=512))
            for kern, mode, flags in (("spec", "always", "early"), ("spec-end", "always", "end"),
                                      ("interp", "never", "early")):
                pool.run(f"{C}:set_specialize", mode)
                pool.run(f"{C}:set_env", "MSCCLANG_SPEC_FLAGS", flags)
                full = kern == "spec"
                for rep in ((1, 2) if full else (1,)):
                    timed(f"{kern} 1KiB oneshot 1x128 LL16 #{rep}", j128, 1024, 1000, 10)
                timed(f"{kern} 1KiB oneshot 2x512 LL16", j2, 1024, 1000, 10)
                timed(f"{kern} 1KiB lib oneshot i1 inplace bf16", lib, 1024, 1000, 10, "bfloat16")
                for stage in (("nop", "cpkt", "ppkt", "full") if full else ("nop", "full")):
                    timed(f"{kern} stage 1KiB 1x128 {stage}", stage_plan(n, stage), 1024, 1000, 10)
                if full:
                    timed(f"{kern} 1KiB oneshot 1x128 LL8", j128, 1024, 1000, 10, "float16", "LL8")
                    for size in (4096, 16384, 65536, 262144):
                        nb = 1 if size <= 16384 else 4
                        jj = plan_to_json(sp.allreduce_oneshot_ll(n, nblocks=nb, nthreads=512))
                        timed(f"{kern} {size // 1024}KiB oneshot {nb}x512", jj, size, 200, 10)
                if kern != "spec-end":
                    lab = f"{kern} eager 1KiB oneshot"
                    step(lab, f"{C}:time_eager", j1, 1024, 3000)
                    table.append(lab)
            pool.run(f"{C}:set_specialize", "auto")
            pool.run(f"{C}:set_env", "MSCCLANG_SPEC_FLAGS", None)
            print(f"\n| us per launch (graph) / per call (eager) | rank 0 | rank {n - 1} | kernel |\n|---|---|---|---|")
            for lab in table:
                r = out.get(lab)
                if isinstance(r, list):
                    v = [x.get("us_per_launch", x.get("us_per_call")) for x in r]
                    print(f"| {lab} | {v[0]:.2f} | {v[-1]:.2f} | {r[0].get('kernel', '')} |")
                else:
                    print(f"| {lab} | FAILED | | |")
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
