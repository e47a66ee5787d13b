"""Commands for the GPU test workers: every rank gets the same bits (docs/semantics.md, "Rank
consistency"). Each rank runs ``all_reduce`` (at sizes that reach every plan the selector picks,
in every floating-point dtype, fp8 included) and the fused ``all_reduce_add_rms_norm`` on its own
seeded :func:`~tests.harness.data.spread` data (whose sums show the order), checks its result
against a float64 reference within the documented bound, and returns a digest of its output bytes
per case: the test compares every rank's digests with rank 0's. Used by ``tests/gpu/test_consistency_gpu.py``.

Each command returns ``{"rank", "digests": {case: sha256}, "plans": {case: plan}, "failures"}``.
"""

from __future__ import annotations

import hashlib
import traceback
from typing import Any

from tests.harness.comm_checks import _sync, communicator
from tests.harness.data import spread

#: all_reduce element counts: the one-shot, the two-step, the zero-copy and pipelined plans
#: (the selector's picks from 2 B to several MiB), odd counts included
ALLREDUCE_COUNTS = (1, 1000, 4096, 65537, 262147, 1048573, 4194304)
ALLREDUCE_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
FUSED_TOKENS = (1, 7, 8, 64, 129, 257, 512)
FUSED_HIDDEN = (1024, 4096, 8192)


def _digest(t: Any) -> str:
    import torch

    b = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(b).hexdigest()


def _inputs(seed: int, ranks: Any, shape: Any, dt: Any, dev: Any) -> dict:
    """The inputs of ``ranks`` (rank -> tensor on ``dev``): :func:`~tests.harness.data.spread`
    data, rank ``r``'s from its own seed, so a rank makes only the inputs it needs (its own; rank
    0 every rank's, for the bound) on the GPU (fp8: below saturation)."""
    return {r: spread(shape, dt, seed * 1009 + r, device=dev) for r in ranks}


def _within_bound(got: Any, xs: list, u: float, n_ops: int) -> bool:
    """``got`` within ``n_ops * u * sum |x|`` of the float64 sum (on ``got``'s device). Rank 0
    alone checks it: the test compares every rank's bytes with rank 0's."""
    exact = sum(x.float().double() for x in xs)
    mag = sum(x.float().double().abs() for x in xs)
    return bool(((got.float().double() - exact).abs() <= n_ops * u * mag + 1e-30).all())


def check_allreduce(w: Any, counts: tuple = ALLREDUCE_COUNTS, dtypes: tuple = ALLREDUCE_DTYPES,
                    seed: int = 11) -> dict:
    """Every dtype x count, on ordinary tensors and (large counts) on symmetric ones, where the
    zero-copy plans run: the all_reduce's bytes digested (compared across ranks by the test), and
    its values within the bound of a float64 reference."""
    import torch

    comm = communicator(w)
    n, rank, dev = comm.world_size, comm.rank, comm.device
    out: dict = {"rank": rank, "digests": {}, "plans": {}, "failures": []}
    for dname in dtypes:
        dt = getattr(torch, dname)
        for count, sym in [(c, False) for c in counts] + [(c, True) for c in counts if c >= 65536]:
            seed += 1
            case = f"all_reduce {dname} {count}{' symmetric' if sym else ''}"   # symmetric: zero-copy plans
            try:
                xs = _inputs(seed, range(n) if rank == 0 else (rank,), count, dt, dev)
                x = comm.empty(count, dtype=dt) if sym else torch.empty(count, dtype=dt, device=dev)
                x.copy_(xs[rank])
                comm.all_reduce(x)
                _sync(comm)
                out["digests"][case] = _digest(x)
                cp = comm.last
                out["plans"][case] = cp.plan.name if cp is not None and cp.plan is not None else (
                    cp.mode if cp is not None else "?")
                u = {1: 2.0 ** -3, 2: 2.0 ** (-8 if dt == torch.bfloat16 else -11), 4: 2.0 ** -24}[dt.itemsize]
                if rank == 0 and not _within_bound(x, list(xs.values()), u, n + 1):
                    out["failures"].append(f"{case}: outside the bound of the float64 sum")
            except Exception:  # noqa: BLE001 - reported to the test
                out["failures"].append(f"{case}: {traceback.format_exc(limit=4)}")
    return out


def check_fused(w: Any, tokens: tuple = FUSED_TOKENS, hiddens: tuple = FUSED_HIDDEN,
                dtypes: tuple = ("bfloat16", "float16"), seed: int = 23) -> dict:
    """Every T x H x dtype, in place and with FP8 output: the fused call's residual and output
    digested (compared across ranks by the test), the plan it ran (None: the fallback), and the
    residual within ``(n + 1) u sum |.|`` of the float64 residual + sum."""
    import torch

    comm = communicator(w)
    n, rank, dev = comm.world_size, comm.rank, comm.device
    out: dict = {"rank": rank, "digests": {}, "plans": {}, "failures": []}
    for dname in dtypes:
        dt = getattr(torch, dname)
        u = 2.0 ** (-8 if dt == torch.bfloat16 else -11)
        for t in tokens:
            for h in hiddens:
                for quant in (False, True):
                    seed += 1
                    case = f"fused {dname} {t}x{h}{' fp8' if quant else ''}"
                    try:
                        xs = _inputs(seed, range(n) if rank == 0 else (rank,), (t, h), dt, dev)
                        res0 = spread((t, h), dt, seed * 1009 + n, device=dev)
                        wt = torch.rand(h, generator=torch.Generator(device=dev).manual_seed(seed), device=dev) + 0.5
                        x, res = xs[rank].clone(), res0.clone()
                        dst = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=dev) if quant else None
                        y = comm.all_reduce_add_rms_norm(x, res, wt, 1e-6, out=dst, fp8_scale=0.05 if quant else None)
                        _sync(comm)
                        out["plans"][case] = comm.last_fused
                        out["digests"][case] = _digest(res) + _digest(y)
                        if rank == 0 and not _within_bound(res, list(xs.values()) + [res0], u, n + 1):
                            out["failures"].append(f"{case}: residual outside the bound of the float64 sum")
                    except Exception:  # noqa: BLE001 - reported to the test
                        out["failures"].append(f"{case}: {traceback.format_exc(limit=4)}")
    return out
