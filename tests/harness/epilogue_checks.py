"""GPU-test commands for the worker pool (:mod:`mscclang.runtime.workers`) running fused
``allreduce_add_rms_norm`` plans through ``Executor.execute(residual=, weight=, epilogue=)``:
the residual and the output are compared bit for bit with the simulator's definition
(:func:`mscclang.sim.epilogue.fused_reference`), eagerly and in CUDA-graph replays."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mscclang.cli.run_checks import worker_device, worker_plan
from tests.harness.data import spread

def _np_dtype(name: str) -> Any:
    import ml_dtypes

    return np.dtype(np.float16) if name == "float16" else np.dtype(getattr(ml_dtypes, name))


def _to_torch(a: np.ndarray, dtype: Any, dev: Any) -> Any:
    import torch

    view = {1: np.uint8, 2: np.int16, 4: np.int32}[a.dtype.itemsize]
    tv = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return torch.from_numpy(np.ascontiguousarray(a).view(view).copy()).to(dev).view(tv).view(dtype)


def _bits(t: Any) -> bytes:
    import torch

    tv = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(tv).cpu().numpy().tobytes()


def _first_diff(a: bytes, b: bytes, esize: int) -> Optional[int]:
    for i in range(0, min(len(a), len(b)), esize):
        if a[i:i + esize] != b[i:i + esize]:
            return i // esize
    return None


#: the inputs and the expected results of the latest parameters, by shape: every plan of a test
#: runs the same cases, so each is made once per worker (cleared when the parameters change)
_CASES: dict = {}


def _case(world: int, rank: int, t: int, h: int, a: Any, wdt: str, fp8: Optional[str], seed: int) -> tuple:
    """(this rank's input, the replicated residual, weight, scale, expected residual, expected
    output) of one shape; the inputs and the residual :func:`~tests.harness.data.spread` data."""
    import torch

    from mscclang.comm.sim_backend import torch_to_numpy
    from mscclang.sim.epilogue import EpilogueParams, fused_reference

    params = (world, rank, str(a), wdt, fp8, seed)
    if _CASES.get("params") != params:
        _CASES.clear()
        _CASES["params"] = params
    got = _CASES.get((t, h))
    if got is None:
        n = t * h
        g = torch.Generator().manual_seed(seed + 1000 * t + h)
        xs = [torch_to_numpy(spread(n, getattr(torch, a.name), g)) for _ in range(world)]
        # one residual, replicated on every rank as tensor parallelism has it (the two-shot
        # gathers each rank's updated residual rows, so it needs that)
        res = torch_to_numpy(spread(n, getattr(torch, a.name), g))
        rng = np.random.default_rng(seed + 1000 * t + h)
        wnp = (rng.standard_normal(h) + 1).astype(np.float32 if wdt == "float32" else a)
        scale = 0.05 if fp8 else None
        qd = _np_dtype("float8_e4m3fn" if fp8 == "float8_e4m3fn" else "float8_e5m2") if fp8 else None
        sp = EpilogueParams(h, wnp, 1e-6, scale, qd)
        want_res, want_out = fused_reference(xs, res, sp, fp8 is not None)
        got = _CASES[(t, h)] = (xs[rank], res, wnp, scale, want_res, want_out)
    return got


def fused_check(w: Any, plan_json: str, tokens: list, hiddens: list, act: str = "bfloat16", wdt: str = "float32",
                fp8: Optional[str] = None, graph: bool = False, seed: int = 3) -> dict:
    """For every (tokens, H) the plan takes (its message-size range; its rmsnorms on whole rows at
    that size: the two-shot's rows must split evenly over the ranks, and with FP8 its output chunks
    fall on rows too): random inputs of every rank
    (the same on every process), the residual (replicated) and the weight; one eager launch
    (``graph``: then one captured launch, replayed twice on the same residual) through the
    executor; the residual and the output against the simulator's definition, bit for bit.
    Returns the failures and the shapes run."""
    import torch

    from mscclang.runtime.epilogue import Epilogue
    from mscclang.runtime.packing import pack_blocks

    plan = worker_plan(w, plan_json)
    ex = w.executor
    why = ex.runnable(plan)
    if why is not None:
        return {"rank": w.rank, "refused": why, "bad": []}
    dev = worker_device(w)
    a = _np_dtype(act)
    tdt = getattr(torch, act)
    quant = fp8 is not None
    bad = []
    ran = []
    for t in tokens:
        for h in hiddens:
            n = t * h
            esz = a.itemsize
            if not plan.min_message_size <= n * esz <= plan.max_message_size:
                continue
            norms = pack_blocks(plan, w.rank, n * esz, n * (1 if quant else esz), row_bytes=h * esz).norms
            orow = h * (1 if quant else esz)
            if any(o % (h * esz) or ln % (h * esz) or got != (o // (h * esz) * orow, (o + ln) // (h * esz) * orow)
                   for _, spans, got in norms for o, ln in spans[:1]):
                continue
            ran.append((t, h))
            xr, resnp, wnp, scale, want_res, want_out = _case(plan.world_size, w.rank, t, h, a, wdt, fp8, seed)
            x = _to_torch(xr, tdt, dev)
            res0 = _to_torch(resnp, tdt, dev)
            res = res0.clone()
            wt = _to_torch(wnp, getattr(torch, wdt), dev)
            if quant:
                out = torch.empty(n, dtype=getattr(torch, fp8), device=dev)
            else:
                out = x if plan.inplace else torch.empty(n, dtype=tdt, device=dev)
            xin = x.clone() if plan.inplace else x
            epi = Epilogue(h, 1e-6, scale, getattr(torch, fp8) if quant else None)

            def call() -> None:
                if plan.inplace:
                    out.copy_(xin)
                ex.execute(plan, out if plan.inplace else x, out, residual=res, weight=wt, epilogue=epi)

            ex.prepare(plan, out if plan.inplace else x, out, epilogue=epi)
            w.comm.barrier()
            call()
            ex.synchronize()
            runs = [(_bits(res), _bits(out))]
            if graph:
                g = torch.cuda.CUDAGraph()
                res.copy_(res0)
                torch.cuda.synchronize()
                w.comm.barrier()
                with torch.cuda.graph(g):
                    call()
                for _ in range(2):
                    res.copy_(res0)
                    g.replay()
                    torch.cuda.synchronize()
                    runs.append((_bits(res), _bits(out)))
                w.comm.barrier()
            for k, (rb, ob) in enumerate(runs):
                for what, got, want in (("residual", rb, want_res), ("output", ob, want_out)):
                    if got != want.tobytes():
                        bad.append({"tokens": t, "hidden": h, "run": k, "what": what,
                                    "first": _first_diff(got, want.tobytes(), want.dtype.itemsize)})
            res.copy_(res0)
    return {"rank": w.rank, "bad": bad, "kernel": ex.last_kernel, "ran": ran}
