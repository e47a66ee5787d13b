"""Commands for the GPU test workers: fp8 collectives through the communicator, compared bit for
bit with the simulator (docs/semantics.md, "FP8 reductions") running the plan the communicator
chose on every rank's (regenerated) input, eager and under CUDA-graph replay, on the interpreter
and on the specialised kernel. Used by ``tests/gpu/test_fp8_gpu.py``.

Each command returns ``{"rank", "checked", "failures": [...], "plans": [...], "kernels": [...]}``.
"""

from __future__ import annotations

from typing import Any, Optional

from tests.harness.comm_checks import _buffers, _sync, attempt, communicator
from tests.harness.data import rank_input

#: torch dtype name -> largest finite value
FP8 = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def fp8_input(seed: int, rank: int, numel: int, dtype: Any, device: Any, big: bool) -> Any:
    """Rank ``rank``'s input (any process can regenerate every rank's):
    :func:`~tests.harness.data.rank_input` data (sums that show the order, below saturation);
    ``big``: every third element at 0.9 x the largest finite value, so that sums overflow and
    saturate."""
    x = rank_input(seed, rank, numel, dtype, device)
    if not big:
        return x
    y = x.float()
    y[::3] = FP8[str(dtype).split(".")[-1]] * 0.9
    return y.to(dtype)


def _sim_expected(plan: Any, coll: str, xs: list, rank: int, accum: Optional[str]) -> Any:
    """This rank's output by the simulator running ``plan`` on every rank's input."""
    import numpy as np
    import torch

    from mscclang.comm.sim_backend import numpy_to_torch, torch_to_numpy
    from mscclang.sim import run

    ins = [torch_to_numpy(x) for x in xs]
    n = len(xs)
    out_elems = {"all_gather": n * ins[0].size, "reduce_scatter": ins[0].size // n}.get(coll, ins[0].size)
    outs = run(plan, ins, output_bytes=out_elems * ins[0].itemsize, accum=accum)
    return numpy_to_torch(np.ascontiguousarray(outs[rank]), xs[0].cpu())


def _call(comm: Any, coll: str, x: Any, out: Any, inplace: bool, accum: Any) -> Any:
    r, n = comm.rank, comm.world_size
    if coll == "all_reduce":
        return comm.all_reduce(x, accum_dtype=accum) if inplace else comm.all_reduce(x, out=out, accum_dtype=accum)
    if coll == "reduce_scatter":
        k = x.numel() // n
        if inplace:
            comm.reduce_scatter(x, out=x[r * k:(r + 1) * k], accum_dtype=accum)
            return x[r * k:(r + 1) * k]
        return comm.reduce_scatter(x, out=out, accum_dtype=accum)
    if coll == "all_gather":
        comm.all_gather(x, out=out)
        return out
    return comm.all_to_all(x) if inplace else comm.all_to_all(x, out=out)


def _diff(got: Any, want: Any) -> Optional[str]:
    import torch

    g, w = got.reshape(-1).cpu().view(torch.uint8), want.reshape(-1).view(torch.uint8)
    if g.numel() != w.numel():
        return f"{g.numel()} elements, want {w.numel()}"
    bad = (g != w).nonzero()
    if bad.numel() == 0:
        return None
    i = int(bad[0])
    return (f"{bad.numel()} of {g.numel()} bytes differ from the simulator; first at {i}: got "
            f"{float(got.reshape(-1)[i].float())} (0x{int(g[i]):02x}), want {float(want.reshape(-1)[i].float())} "
            f"(0x{int(w[i]):02x})")


def _one(comm: Any, coll: str, numel: int, dt: Any, accum: Any, sym: bool, ip: bool, graph: bool,
         big: bool, seed: int) -> Optional[str]:
    import torch

    n, r, dev = comm.world_size, comm.rank, comm.device
    x, out = _buffers(comm, coll, numel, dt, sym, ip, dev)
    per_rank = x.numel()
    acc = None if accum is None else str(accum).split(".")[-1]
    reps = [seed] if not graph else [seed, seed * 7 + 1, seed * 7 + 2]
    g = got = None
    for i, s in enumerate(reps):
        xs = [fp8_input(s, q, per_rank, dt, dev, big) for q in range(n)]
        if out is not None:
            out.view(torch.uint8).fill_(0x7F)
        x.copy_(xs[r])
        if not graph:
            got = _call(comm, coll, x, out, ip, accum)
        elif i == 0:   # first-time setup eagerly, then capture and replay on fresh data
            _call(comm, coll, x, out, ip, accum)
            _sync(comm)
            x.copy_(xs[r])
            g, got = _capture(lambda: _call(comm, coll, x, out, ip, accum))
            g.replay()
        else:
            g.replay()
        _sync(comm)
        plan = comm.last.plan if comm.last is not None else None
        if plan is None:
            return "ran on torch.distributed, not on a plan"
        want = _sim_expected(plan, coll, [t.cpu() for t in xs], r, acc if coll in ("all_reduce", "reduce_scatter")
                             else None)
        err = _diff(got, want)
        if err:
            return f"{'replay ' + str(i) + ': ' if graph else ''}{err} (plan {plan.name})"
    return None


def _capture(body: Any) -> tuple[Any, Any]:
    from mscclang.bench.worker import capture_graph

    return capture_graph(body)


def check_fp8(w: Any, coll: str, dtypes=("float8_e4m3fn", "float8_e5m2"), accums=(None, "float16"),
              numels=(), symmetric=(False, True), inplace=(False, True), graph: bool = False,
              big: bool = True, specialize: str = "never", seed: int = 23) -> dict:
    """Every dtype x accumulation dtype x element count x buffer kind x in-place mode of ``coll``
    (``accums`` only for reductions), on the interpreter (``specialize='never'``) or the
    specialised kernel (``'always'``), eager or graph-replayed, against the simulator."""
    import torch

    comm = communicator(w)
    w.executor.set_specialize(specialize)
    failures: list[str] = []
    plans: set[str] = set()
    kernels: set[str] = set()
    checked = 0
    reduces = coll in ("all_reduce", "reduce_scatter")
    try:
        for dname in dtypes:
            dt = getattr(torch, dname)
            for accum in (accums if reduces else (None,)):
                for numel in numels:
                    for sym in symmetric:
                        for ip in inplace:
                            seed += 1
                            where = (f"{coll} {dname} accum={accum} numel={numel} {'symmetric' if sym else 'plain'} "
                                     f"{'in-place' if ip else 'out-of-place'}{' graph' if graph else ''} "
                                     f"specialize={specialize}")
                            err = attempt(comm, _one, coll, numel, dt, accum, sym, ip, graph, big, seed, limit=4)
                            checked += 1
                            if comm.last is not None:
                                plans.add(comm.last.label())
                            kernels.add(str(w.executor.last_kernel))
                            if err:
                                failures.append(f"rank {w.rank}: {where}: {err}")
    finally:
        w.executor.set_specialize("auto")
    return {"rank": w.rank, "checked": checked, "failures": failures, "plans": sorted(plans),
            "kernels": sorted(kernels)}
