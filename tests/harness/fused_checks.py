"""Commands for the GPU test workers: ``Communicator.all_reduce_add_rms_norm`` on the GPU
against the simulator running the same plan on the same data (bit for bit), and against torch's
reference (``residual + allreduce(x)`` within the any-order summation bound of
:func:`mscclang.cli.run_checks.sum_bound`, then RMSNorm in fp32 and the cast within 4 ulps);
eager and under CUDA-graph replay on fresh data; inputs from :func:`tests.harness.data.spread`.
Used by ``tests/gpu/test_fused_gpu.py``.

Each command returns ``{"rank", "checked", "failures": [...], "plans": [...]}``.
"""

from __future__ import annotations

import traceback
from typing import Any, Optional

import numpy as np

from mscclang.cli.run_checks import sum_bound
from tests.harness.comm_checks import _sync, communicator
from tests.harness.data import spread

#: (tokens, hidden) shapes: one-shot sizes and two-shot sizes (rows split evenly over 2/4/8)
SHAPES = ((1, 8192), (7, 4104), (64, 8192), (256, 8192))


def _data(seed: int, n: int, tokens: int, hidden: int, dt: Any, wdt: Any) -> tuple[list, Any, Any]:
    """Every rank's input and the residual (:func:`~tests.harness.data.spread` data), the weight."""
    import torch

    g = torch.Generator().manual_seed(seed)
    xs = [spread((tokens, hidden), dt, g) for _ in range(n)]
    res = spread((tokens, hidden), dt, g)
    w = (torch.rand(hidden, generator=g) + 0.5).to(wdt)
    return xs, res, w


def _sim_expected(comm: Any, xs: list, res: Any, w: Any, eps: float, scale: Optional[float], out: Any,
                  rank: int) -> tuple[Optional[str], Any, Any]:
    """(plan name, residual, output) the simulator gives this rank for the plan the call picks."""
    from mscclang.comm.fused_norm import check_call
    from mscclang.comm.selector import FusedShape, select_fused
    from mscclang.comm.sim_backend import torch_to_numpy
    from mscclang.plan.dtypes import torch_dtype_info
    from mscclang.sim.epilogue import EpilogueParams
    from mscclang.sim.fused import run_fused

    call = check_call(xs[rank].clone(), res.clone(), w, eps, out, scale)
    v = select_fused(comm.catalog, comm.world_size, FusedShape.of(call))
    if v is None:
        return None, None, None
    plan = v.load()
    q = torch_dtype_info(out.dtype).numpy if scale is not None else None
    run = run_fused(plan, [torch_to_numpy(x) for x in xs], [torch_to_numpy(res)] * len(xs),
                    EpilogueParams(w.numel(), torch_to_numpy(w), eps, scale=scale, fp8=q))
    return plan.name, run.residuals[rank], run.outputs[rank]


def _compare(name: str, got: Any, want: np.ndarray) -> Optional[str]:
    a = got.detach().cpu().reshape(-1).contiguous()
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}
    gb = a.view(torch_int(a.element_size())).numpy().view(unsigned[a.element_size()])
    wb = np.ascontiguousarray(want).view(unsigned[want.dtype.itemsize]).reshape(-1)
    if gb.shape != wb.shape:
        return f"{name}: {gb.shape[0]} elements, the simulator's {wb.shape[0]}"
    bad = np.nonzero(gb != wb)[0]
    if bad.size:
        i = int(bad[0])
        return f"{name}: {bad.size} elements differ from the simulator's, first {i}"
    return None


def torch_int(size: int) -> Any:
    """The torch integer type of ``size`` bytes (to read a tensor's bits)."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]


def _torch_norm(r: Any, w: Any, eps: float) -> Any:
    """torch's RMSNorm of the residual ``r``: in fp32, then the cast."""
    import torch

    v = r.float()
    return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(r.dtype)


def check_fused_norm(w: Any, graph: bool = False, dtypes: tuple = ("bfloat16", "float16"),
                     fp8: tuple = (False, True), seed: int = 5) -> dict:
    """Every shape x dtype x FP8 mode, in place (no FP8) and out of place: GPU == simulator bit
    for bit, and within the bounds of torch's reference (FP8 outputs: the simulator only)."""
    comm = communicator(w)
    return check_with(comm, comm.device, graph, dtypes, fp8, seed)


def check_with(comm: Any, dev: Any, graph: bool = False, dtypes: tuple = ("bfloat16", "float16"),
               fp8: tuple = (False, True), seed: int = 5, shapes: tuple = SHAPES) -> dict:
    """:func:`check_fused_norm` on any communicator (the simulator's too) and device."""
    import torch

    n, rank = comm.world_size, comm.rank
    failures: list[str] = []
    plans: set[str] = set()
    checked = 0
    eps = 1e-6
    for dname in dtypes:
        dt = getattr(torch, dname)
        for tokens, hidden in shapes:
            for quant in fp8:
                for inplace in ((False,) if quant else (True, False)):
                    seed += 1
                    where = f"{dname} {tokens}x{hidden} {'fp8' if quant else ''} {'in place' if inplace else 'out'}" \
                            f"{' graph' if graph else ''}"
                    try:
                        err = _one(comm, seed, n, rank, tokens, hidden, dt, quant, inplace, graph, eps, dev, plans)
                    except Exception:  # noqa: BLE001 - reported as a failure of this case
                        err = traceback.format_exc(limit=4)
                    checked += 1
                    if err:
                        failures.append(f"{where}: {err}")
    return {"rank": rank, "checked": checked, "failures": failures, "plans": sorted(plans)}


def _one(comm: Any, seed: int, n: int, rank: int, tokens: int, hidden: int, dt: Any, quant: bool,
         inplace: bool, graph: bool, eps: float, dev: Any, plans: set) -> Optional[str]:
    import torch

    scale = 0.05 if quant else None
    xs, res, wt = _data(seed, n, tokens, hidden, dt, torch.float32)
    x = xs[rank].to(dev).clone()   # copies also on the CPU: the call writes x and r
    r = res.to(dev).clone()
    wd = wt.to(dev)
    out = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=dev) if quant else \
        (None if inplace else torch.empty(tokens, hidden, dtype=dt, device=dev))
    cpu_out = None if out is None else torch.empty(tokens, hidden, dtype=out.dtype)
    name, want_r, want_o = _sim_expected(comm, xs, res, wt, eps, scale, cpu_out, rank)
    if name is None:
        return "no fused plan for this shape"

    def call() -> Any:
        return comm.all_reduce_add_rms_norm(x, r, wd, eps, out=out, fp8_scale=scale)
    if graph:
        comm.prepare_all_reduce_add_rms_norm(x, r, wd, eps, out=out, fp8_scale=scale)
        from mscclang.bench.worker import capture_graph

        g, got = capture_graph(call)
        x.copy_(xs[rank])
        r.copy_(res)
        torch.cuda.synchronize()
        g.replay()
    else:
        got = call()
    _sync(comm)
    if comm.last_fused != name and not graph:
        return f"ran {comm.last_fused or 'the fallback'}, not {name}"
    plans.add(name)
    err = _compare("residual", r, want_r) or _compare("output", got, want_o)
    if err or quant:
        return err
    # torch: residual + allreduce(x) within the error bound of its sum in any order (2 ulps of the
    # magnitudes summed, the rule before, is exceeded by spread data at 8 ranks); the norm of the
    # residual within 4 ulps
    exact, bound = sum_bound(xs + [res])
    if bool(((r.cpu().double() - exact).abs() > bound).any()):
        return "residual: outside the any-order summation bound of residual + allreduce(x)"
    ulp = 2.0 ** (-7 if dt == torch.bfloat16 else -10)
    ref_y = _torch_norm(r, wd, eps)
    far = (got.float() - ref_y.float()).abs() > 4 * ulp * ref_y.float().abs() + 1e-6
    if bool(far.any()):
        return f"output: {int(far.sum())} elements further than 4 ulps from torch's RMSNorm of the residual"
    return None
