"""GPU checks of port-channel plans (run in WorkerPool workers by tests/gpu/test_ports_gpu.py and
the notes' measurements): eager calls and CUDA-graph replays compared bit for bit with the
simulator's result, a peer that never calls, and the put+signal round trip.

Every command takes the worker ``w`` (its ``executor``, ``comm``, ``rank``, ``world_size``)."""

from __future__ import annotations

import time
from typing import Any

from mscclang.bench.worker import capture_graph
from mscclang.errors import CollectiveTimeout
from mscclang.plan.io import load_plan
from mscclang.cli.run_checks import compare_with_sim, expectation, inplace_input
from tests.harness.data import rank_input
from tests.harness.runtime_checks import call_tensors


def _tensors(w: Any, plan_json: str, nbytes: int, dtype: str, seed: int, symmetric: bool) -> tuple:
    plan, dt, dev, _esize, n_in, n_out, inputs, inp, out = call_tensors(w, plan_json, nbytes, dtype, seed, symmetric)
    return plan, dt, dev, n_in, n_out, inputs, inp, out


def _median_ms(w: Any, fn: Any, reps: int, tag: str) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs, the ranks meeting before each."""
    import torch

    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        w.comm.barrier(tag)
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    ts.sort()
    return ts[len(ts) // 2]


def graph_replays(w: Any, plan_json: str, nbytes: int, dtype: str = "int32", replays: int = 8,
                  symmetric: bool = True, sim_max_bytes: int = 1 << 16) -> dict:
    """Capture one call of the plan in a CUDA graph after an eager call, then replay it with fresh
    inputs each time (written into the captured input tensor), checking every replay bit for bit
    (int32: exact) and, up to ``sim_max_bytes``, against the simulator."""
    import torch

    plan, dt, dev, n_in, n_out, inputs, inp, out = _tensors(w, plan_json, nbytes, dtype, 0, symmetric)
    if plan.inplace:   # the input is the plan's own block of the output
        inp = inplace_input(plan, out, inp, w.rank)
    ex = w.executor
    ex.execute(plan, inp, out)
    ex.synchronize()
    test = plan.collective == "test"   # no reference: every check is against the simulator

    def wrong(ins: list) -> int:
        if test:
            return compare_with_sim(plan, ins, out, "sum", None, w.rank) or 0
        return expectation(plan, ins, "sum", w.rank).count_bad(out)

    bad = wrong(inputs)
    g, _ = capture_graph(lambda: ex.execute(plan, inp, out))
    sim_bad = 0
    for k in range(replays):
        fresh = [rank_input(100 + k, q, n_in, dt, dev) for q in range(w.world_size)]
        out.zero_()
        inp.copy_(fresh[w.rank])   # after the zeroing: an in-place input lies inside the output
        torch.cuda.synchronize()
        g.replay()
        ex.synchronize()
        bad += wrong(fresh)
        if k == 0 and nbytes <= sim_max_bytes and not test:
            sim_bad = compare_with_sim(plan, fresh, out, "sum", None, w.rank) or 0
    del g
    return {"rank": w.rank, "bad": bad + sim_bad, "sim_bad": sim_bad, "replays": replays,
            "kernel": ex.last_kernel, "enqueued": ex._proxy.enqueued}


def peer_never_calls(w: Any, plan_json: str, nbytes: int = 4096, symmetric: bool = True) -> dict:
    """Only rank 0 calls: it must raise CollectiveTimeout within the executor's timeout (its side
    streams released, so synchronize returns); then every rank resets and a full call is exact."""
    plan, dt, dev, n_in, n_out, inputs, inp, out = _tensors(w, plan_json, nbytes, "int32", 0, symmetric)
    ex = w.executor
    ex.execute(plan, inp, out)   # set-up (collective) first, so only the launch is missing
    ex.synchronize()
    w.comm.barrier("port hang set up")
    err = ""
    t0 = time.monotonic()
    if w.rank == 0:
        try:
            ex.execute(plan, inp, out)
            ex.synchronize()
        except CollectiveTimeout as e:
            err = str(e)
    took = time.monotonic() - t0
    w.comm.barrier("port hang checked")
    ex.reset()
    ex.execute(plan, inp, out)
    ex.synchronize()
    bad = expectation(plan, inputs, "sum", w.rank).count_bad(out)
    return {"rank": w.rank, "error": err, "seconds": took, "bad_after_reset": bad}


def round_trip(w: Any, plan_json: str, iters: int = 200, reps: int = 5) -> dict:
    """Median microseconds of one launch of a ping-pong plan, ``iters`` launches captured in one
    CUDA graph (inputs of 1 element), after a checked eager call."""
    plan, dt, dev, n_in, n_out, inputs, inp, out = _tensors(w, plan_json, 4, "int32", 0, True)
    ex = w.executor
    ex.execute(plan, inp, out)
    ex.synchronize()
    bad = expectation(plan, inputs, "sum", w.rank).count_bad(out)
    g, _ = capture_graph(lambda: [ex.execute(plan, inp, out) for _ in range(iters)])
    us = _median_ms(w, g.replay, reps, "round trip") * 1000.0 / iters
    ex.synchronize()
    return {"rank": w.rank, "bad": bad, "us": us}


def load(plan_json: str):
    return load_plan(plan_json)


def runnable_reason(w: Any, plan_json: str) -> str:
    """Why this worker's executor refuses the plan ('' when it runs it)."""
    return w.executor.runnable(load_plan(plan_json)) or ""


def ce_bandwidth(w: Any, nbytes: int = 256 << 20, peer_access: bool = False) -> dict:
    """GB/s of one cuMemcpyDtoDAsync of ``nbytes`` from this rank's memory into the peer's
    IPC-mapped symmetric buffer (every rank at once), on a side stream; with ``peer_access`` the
    peer device's primary context is enabled for peer access first."""
    import torch

    from mscclang.runtime import cuda as cu

    drv = cu.driver()
    q = (w.rank + 1) % w.world_size
    note = ""
    if peer_access:
        ok, ctx = drv.cuDevicePrimaryCtxRetain(q)
        err, = drv.cuCtxEnablePeerAccess(ctx, 0)
        note = f"enable peer access: {err}"
    src = w.comm.alloc(nbytes // 4, torch.int32)
    dst = w.comm.alloc(nbytes // 4, torch.int32)
    got = w.comm.symmetric_of(dst.data_ptr())
    peer = got.peer_bases[q] + dst.data_ptr() - got.base
    s = cu.check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    cs = torch.cuda.ExternalStream(cu.ptr(s))

    def copy() -> None:
        with torch.cuda.stream(cs):
            cu.check(drv.cuMemcpyDtoDAsync(peer, src.data_ptr(), nbytes, s), "cuMemcpyDtoDAsync")
        torch.cuda.current_stream().wait_stream(cs)

    t = _median_ms(w, copy, 4, "ce bw")
    drv.cuStreamDestroy(s)
    return {"rank": w.rank, "GBps": nbytes / t / 1e6, "ms": t, "note": note}


def ce_allgather_time(w: Any, total: int = 256 << 20, inplace: bool = False) -> dict:
    """Milliseconds of one copy-engine allgather (test_port_allgather_pwsf) eagerly and as a
    one-call CUDA graph replay, median of 3 each (where the proxy's time goes)."""
    import torch

    from tests.harness import port_plans as pp

    plan = pp.allgather_pwsf(w.world_size, inplace=inplace)
    n_in = total // w.world_size // 4
    o = w.comm.alloc(total // 4, torch.int32)
    i = o[w.rank * n_in:(w.rank + 1) * n_in] if inplace else w.comm.alloc(n_in, torch.int32)
    ex = w.executor
    ex.execute(plan, i, o)
    ex.synchronize()

    eager = _median_ms(w, lambda: ex.execute(plan, i, o), 3, "ce ag")
    g, _ = capture_graph(lambda: ex.execute(plan, i, o))
    graph = _median_ms(w, g.replay, 3, "ce ag")
    return {"rank": w.rank, "eager_ms": eager, "graph_ms": graph, "bytes": total, "inplace": inplace}


def traced(w: Any, out_dir: str, after_s: float, target: str, *args: Any) -> Any:
    """Run ``target`` (module:function) with a stack dump of every thread written to
    ``out_dir/stack.<rank>.txt`` if it is still running after ``after_s`` seconds (diagnosis)."""
    import faulthandler
    import importlib
    import os

    f = open(os.path.join(out_dir, f"stack.{w.rank}.txt"), "w")
    faulthandler.dump_traceback_later(after_s, repeat=False, file=f)
    try:
        mod, fn = target.split(":")
        return getattr(importlib.import_module(mod), fn)(w, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()
        f.close()
