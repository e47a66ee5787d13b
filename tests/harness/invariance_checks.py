"""Commands for the GPU test workers: batch invariance (docs/semantics.md, "Batch invariance").

Each rank runs a Communicator in the batch-invariant mode (``Communicator(...,
batch_invariant=True)``) on the worker's executor, regenerates every rank's seeded
:func:`~tests.harness.data.spread` input (sums that show the order; the same seed gives the same
data in any process on the same device type), computes the canonical result of its own output
with :mod:`mscclang.reference` on the CPU, and counts the elements whose bits differ: the test
wants 0 everywhere.

* :func:`check_collectives`: ``all_reduce`` (in place) and ``reduce_scatter`` (out of place) at
  element counts from 1 to 64M, about x4 apart (every plan the selector picks), on ordinary
  tensors (eager), in a CUDA graph (captured after the eager call, replayed on reset input and
  poisoned output) and on symmetric tensors (carved from one symmetric arena).
* :func:`check_fused_rows`: ``all_reduce_add_rms_norm`` with row 0 of every input and of the
  residual fixed, at every T x H: row 0 of the output and of the new residual (and the last row)
  against the reference, and row 0 against the first T's bits.

Each command returns ``{"rank", "differing": {case: count}, "plans": {case: plan}, "failures"}``;
a failure is an exception (its traceback) or a call that ran on torch.distributed.
"""

from __future__ import annotations

import traceback
from typing import Any, Optional

from tests.harness.comm_checks import _sync
from tests.harness.data import spread
from tests.harness.trust_checks import Arena

#: element counts: 1 to 64M, about x4 apart, odd ones among them (chunk tails)
COUNTS = (1, 7, 1000, 4099, 65537, 262147, 1048573, 4194304, 16777219, 67108864)
#: dtype cases: "dtype" or "dtype/accumulation dtype" (fp8)
DTYPE_CASES = ("bfloat16", "float16", "float32", "float8_e4m3fn/float32", "float8_e4m3fn/float16")
MODES = ("ordinary", "graph", "symmetric")
FUSED_TOKENS = (1, 7, 64, 129, 512, 2048, 4096)
FUSED_HIDDEN = (1024, 4096, 8192)
EPS, FP8_SCALE = 1e-6, 0.05


def invariant_communicator(w: Any) -> Any:
    """The worker's batch-invariant communicator over its executor (made once per worker; no
    fallback: the mode never falls back). A Communicator without the ``batch_invariant`` argument
    raises TypeError here, and the test fails."""
    import torch

    from mscclang.comm import Communicator, RuntimeBackend

    key = "mscclang.comm/batch_invariant"
    comm = w.state.get(key)
    if comm is None:
        backend = RuntimeBackend(executor=w.executor, rank=w.rank, world_size=w.world_size,
                                 device=torch.device("cuda", int(w.comm.device)), store=getattr(w.comm, "store", None))
        comm = Communicator(backend=backend, fallback=False, batch_invariant=True)
        if comm.batch_invariant is not True:
            raise AssertionError(f"Communicator(batch_invariant=True).batch_invariant is {comm.batch_invariant!r}")
        w.state[key] = comm
    return comm


def _dtype(case: str) -> tuple[Any, Optional[Any]]:
    import torch

    name, _, accum = case.partition("/")
    return getattr(torch, name), (getattr(torch, accum) if accum else None)


def _differing(got: Any, want: Any) -> int:
    """Elements of ``got`` whose bits differ from ``want`` (CPU tensors of one dtype and size);
    a size mismatch counts every element."""
    import torch

    got, want = got.detach().reshape(-1).cpu(), want.detach().reshape(-1).cpu()
    if got.numel() != want.numel() or got.dtype != want.dtype:
        return max(got.numel(), want.numel())
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    return int((got.view(as_int) != want.view(as_int)).sum())


def _poison(t: Optional[Any]) -> None:
    """Fill an output with a pattern no call leaves (an element it skipped shows)."""
    import torch

    if t is not None:
        t.view(-1).view(torch.uint8).fill_(0x7F)


def _call(comm: Any, coll: str, x: Any, out: Optional[Any], accum: Any) -> Any:
    if coll == "all_reduce":
        return comm.all_reduce(x, accum_dtype=accum)
    return comm.reduce_scatter(x, out=out, accum_dtype=accum)


def _ran(comm: Any) -> str:
    """The plan the last call ran; AssertionError when it ran on torch.distributed."""
    cp = comm.last
    if cp is None or cp.plan is None:
        raise AssertionError(f"ran on torch.distributed ({cp.label() if cp is not None else 'no call recorded'}), "
                             "not on a plan")
    return cp.label()


def _run_mode(comm: Any, coll: str, mode: str, mine: Any, arena: Any, accum: Any) -> tuple[Any, str]:
    """(this rank's output on the CPU, the plan) of one call on ``mine`` (this rank's input) in
    ``mode``."""
    import torch

    from mscclang.bench.worker import capture_graph

    n, numel = comm.world_size, mine.numel()
    if mode == "symmetric":
        arena.reset()
        x = arena.take(numel, mine.dtype)
        out = arena.take(numel // n, mine.dtype) if coll == "reduce_scatter" else None
    else:
        x = torch.empty_like(mine)
        out = torch.empty(numel // n, dtype=mine.dtype, device=mine.device) if coll == "reduce_scatter" else None
    x.copy_(mine)
    _poison(out)
    got = _call(comm, coll, x, out, accum)
    _sync(comm)
    plan = _ran(comm)
    if mode == "graph":
        g, got = capture_graph(lambda: _call(comm, coll, x, out, accum))
        x.copy_(mine)
        _poison(out)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        comm.synchronize()
        plan = _ran(comm)
        host = got.cpu()
        del g
        return host, plan
    return got.cpu(), plan


def _arena(w: Any, comm: Any) -> Any:
    """One symmetric arena per worker, for the largest call (fp32 input and reduce_scatter output)."""
    key = "invariance/arena"
    if key not in w.state:
        w.state[key] = Arena(comm, max(COUNTS) * 4 * 2 + 4096)
    return w.state[key]


def check_collectives(w: Any, dtype: str, counts: tuple = COUNTS, modes: tuple = MODES,
                      colls: tuple = ("all_reduce", "reduce_scatter"), seed: int = 41) -> dict:
    """``all_reduce`` and ``reduce_scatter`` of one dtype case at every count and in every mode,
    each rank's output against :mod:`mscclang.reference` (differing elements per case). Both run
    on the same inputs, so one reference serves both: ``reduce_scatter`` takes the first ``n k``
    elements (``k = count // n``; none below ``n``) and its rank ``r``'s canonical output is
    elements ``r k .. r k + k - 1`` of the canonical ``all_reduce`` (docs/semantics.md; the CPU
    tests hold ``reference.reduce_scatter`` to it)."""
    import torch

    from mscclang import reference

    comm = invariant_communicator(w)
    dt, accum = _dtype(dtype)
    n, rank, dev = comm.world_size, comm.rank, comm.device
    arena = _arena(w, comm) if "symmetric" in modes else None
    res: dict = {"rank": rank, "differing": {}, "plans": {}, "failures": []}
    for count in counts:
        seed += 1
        k = count // n
        try:
            xs = [spread(count, dt, seed * 1009 + q, device=dev).cpu() for q in range(n)]
            want = reference.all_reduce(xs, accum_dtype=accum)
            mine = xs[rank].to(dev)
            del xs
        except Exception:  # noqa: BLE001 - reported to the test
            res["failures"].append(f"rank {rank}: {dtype} {count}: {traceback.format_exc(limit=4)}")
            continue
        for coll in colls:
            if coll == "reduce_scatter" and k == 0:
                continue
            case = f"{coll} {dtype} {count if coll == 'all_reduce' else n * k}"
            x, w_ = (mine, want) if coll == "all_reduce" else (mine[:n * k], want[rank * k:(rank + 1) * k])
            for mode in modes:
                try:
                    got, plan = _run_mode(comm, coll, mode, x, arena, accum)
                    res["plans"][f"{case} {mode}"] = plan
                    res["differing"][f"{case} {mode}"] = _differing(got, w_)
                except Exception:  # noqa: BLE001 - reported to the test
                    res["failures"].append(f"rank {rank}: {case} {mode}: {traceback.format_exc(limit=4)}")
                    try:
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001
                        pass
        del mine, want
    return res


def check_fused_rows(w: Any, dtype: str = "bfloat16", quant: bool = False, tokens: tuple = FUSED_TOKENS,
                     hiddens: tuple = FUSED_HIDDEN, seed: int = 61) -> dict:
    """The fused call at every T x H (in place; with ``quant`` the norm into an FP8 tensor), row 0
    of every rank's input and of the residual the same at every T: row 0 and row T-1 of the
    output and of the new residual against :mod:`mscclang.reference`, and row 0 against the
    first T's bits."""
    import torch

    from mscclang import reference

    comm = invariant_communicator(w)
    dt = getattr(torch, dtype)
    n, rank, dev = comm.world_size, comm.rank, comm.device
    res: dict = {"rank": rank, "differing": {}, "plans": {}, "failures": []}
    scale = FP8_SCALE if quant else None
    for h in hiddens:
        seed += 1
        wt = torch.rand(h, generator=torch.Generator(device=dev).manual_seed(seed), device=dev) + 0.5
        row0 = [spread((1, h), dt, seed * 1009 + q, device=dev) for q in range(n)]
        res0 = spread((1, h), dt, seed * 1009 + n, device=dev)
        first: Optional[tuple] = None
        try:
            want0 = reference.all_reduce_add_rms_norm(row0, res0, wt, EPS, fp8_scale=scale)
        except Exception:  # noqa: BLE001 - reported to the test
            res["failures"].append(f"rank {rank}: fused reference H={h}: {traceback.format_exc(limit=4)}")
            continue
        for t in tokens:
            case = f"fused {dtype}{' fp8' if quant else ''} T={t} H={h}"
            try:
                rest = [spread((t - 1, h), dt, (seed * 131 + t) * 1009 + q, device=dev) for q in range(n)]
                res_rest = spread((t - 1, h), dt, (seed * 131 + t) * 1009 + n, device=dev)
                x = torch.cat([row0[rank], rest[rank]])
                resid = torch.cat([res0, res_rest])
                dst = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=dev) if quant else None
                y = comm.all_reduce_add_rms_norm(x, resid, wt, EPS, out=dst, fp8_scale=scale)
                _sync(comm)
                res["plans"][case] = comm.last_fused
                res["differing"][f"{case} row 0 output"] = _differing(y[:1], want0[0])
                res["differing"][f"{case} row 0 residual"] = _differing(resid[:1], want0[1])
                if first is None:
                    first = (y[:1].cpu(), resid[:1].cpu())
                res["differing"][f"{case} row 0 output vs T={tokens[0]}"] = _differing(y[:1], first[0])
                res["differing"][f"{case} row 0 residual vs T={tokens[0]}"] = _differing(resid[:1], first[1])
                if t > 1:
                    last = reference.all_reduce_add_rms_norm([r[-1:] for r in rest], res_rest[-1:], wt, EPS,
                                                             fp8_scale=scale)
                    res["differing"][f"{case} row {t - 1} output"] = _differing(y[-1:], last[0])
                    res["differing"][f"{case} row {t - 1} residual"] = _differing(resid[-1:], last[1])
                del rest, res_rest, x, resid, dst, y
            except Exception:  # noqa: BLE001 - reported to the test
                res["failures"].append(f"rank {rank}: {case}: {traceback.format_exc(limit=4)}")
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001
                    pass
    return res
