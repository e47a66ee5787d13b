"""Commands for the GPU test workers (:mod:`mscclang.runtime.workers`): the communicator on the
worker's executor, every collective against a reference computed on each rank from every rank's
(regenerated) input (:func:`tests.harness.data.rank_input`: sums that show the order), eager
and under CUDA-graph replay. Used by ``tests/gpu/test_comm_gpu.py``.

Reductions are checked bit for bit where the order cannot matter (2 ranks, int32, min/max) and,
for floating-point sums over 3 or more ranks, within the error bound of summation in any order
(:func:`mscclang.cli.run_checks.sum_bound`): the communicator may pick any plan, so its order is
not known here.

Each command returns ``{"rank", "checked", "failures": [...], "plans": [...]}``; a failure names
the collective, dtype, element count, buffer kind, in-place mode and the first wrong element.
"""

from __future__ import annotations

import traceback
from typing import Any, Optional

from mscclang.bench.worker import capture_graph
from mscclang.cli.run_checks import Expected, sum_bound
from mscclang.plan.dtypes import torch_dtype
from tests.harness.data import rank_input, spread

DTYPES = ("float16", "bfloat16", "float32", "int32")


def _sync(comm: Any) -> None:
    import torch

    if getattr(comm.device, "type", "cpu") == "cuda":
        torch.cuda.synchronize()
    comm.synchronize()


def attempt(comm: Any, case: Any, *args: Any, limit: int = 3) -> Optional[str]:
    """``case(comm, *args)`` (a checked call: None or what was wrong); an exception becomes its
    type, message and the last ``limit`` frames, after waiting for whatever the GPU still runs."""
    try:
        return case(comm, *args)
    except Exception as e:  # noqa: BLE001 - reported to the test
        err = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=limit)}"
        try:
            _sync(comm)
        except Exception:  # noqa: BLE001
            pass
        return err


def communicator(w: Any, fallback: bool = False) -> Any:
    """The worker's communicator over its executor (made once per worker and fallback mode);
    its torch.distributed fallback builds a group of its own from the worker's store."""
    import torch

    from mscclang.comm import Communicator, RuntimeBackend

    key = f"mscclang.comm/{fallback}"
    comm = w.state.get(key)
    if comm is None:
        backend = RuntimeBackend(executor=w.executor, rank=w.rank, world_size=w.world_size,
                                 device=torch.device("cuda", int(w.comm.device)),
                                 store=getattr(w.comm, "store", None))
        comm = Communicator(backend=backend, fallback=fallback)
        w.state[key] = comm
    return comm


def _reduce(xs: list, op: str, dtype: Any) -> Any:
    import torch

    f = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}[op]
    if dtype == torch.int32:
        acc = xs[0].clone()
        for x in xs[1:]:
            acc = f(acc, x)
        return acc
    acc = xs[0].float()
    for x in xs[1:]:
        acc = f(acc, x.float()).to(dtype).float()
    return acc.to(dtype)


def _expected(coll: str, rank: int, n: int, xs: list, op: str, root: int) -> Any:
    import torch

    k = xs[0].numel() // n
    if coll == "all_reduce":
        return _reduce(xs, op, xs[0].dtype)
    if coll == "all_gather":
        return torch.cat(xs)
    if coll == "reduce_scatter":
        return _reduce([x[rank * k:(rank + 1) * k] for x in xs], op, xs[0].dtype)
    if coll == "all_to_all":
        return torch.cat([x[rank * k:(rank + 1) * k] for x in xs])
    if coll == "broadcast":
        return xs[root].clone()
    if coll == "send_recv":
        return xs[(rank - 1) % n].clone()
    raise ValueError(coll)


def _expectation(coll: str, rank: int, n: int, xs: list, op: str, root: int) -> Expected:
    """What ``rank``'s output must be: exact where the reduction order cannot matter, else the
    exact sum (float64) within the any-order error bound."""
    import torch

    reduces = coll in ("all_reduce", "reduce_scatter")
    if not reduces or op != "sum" or n <= 2 or xs[0].dtype == torch.int32:
        return Expected("exact", exact=_expected(coll, rank, n, xs, op, root))
    if coll == "reduce_scatter":
        k = xs[0].numel() // n
        xs = [x[rank * k:(rank + 1) * k] for x in xs]
    approx, bound = sum_bound(xs)
    return Expected("bound", approx=approx, bound=bound)


def _compare(got: Any, want: Any, exact: bool = True) -> Optional[str]:
    """None when ``got`` is as expected (``want``: a tensor compared bit for bit, or an
    :class:`~mscclang.cli.run_checks.Expected`), else a description of the first wrong element."""
    exp = want if isinstance(want, Expected) else Expected("exact", exact=want.reshape(-1))
    g = got.reshape(-1)
    n_want = (exp.exact if exp.exact is not None else exp.approx).numel()
    if g.numel() != n_want:
        return f"{g.numel()} elements, want {n_want}"
    nbad = exp.count_bad(g)
    if not nbad:
        return None
    i, have, should = exp.first_bad(g)
    return f"{nbad} of {g.numel()} wrong ({exp.how}); first at {i}: got {have}, want {should}"


def _call(comm: Any, coll: str, x: Any, out: Optional[Any], inplace: bool, op: str, root: int) -> Any:
    """Run one call; returns the tensor holding this rank's result."""
    r, n = comm.rank, comm.world_size
    if coll == "all_reduce":
        return comm.all_reduce(x, op=op) if inplace else comm.all_reduce(x, op=op, out=out)
    if coll == "all_gather":
        if inplace:  # x is this rank's block of out
            comm.all_gather(x, out=out)
            return out
        return comm.all_gather(x, out=out)
    if coll == "reduce_scatter":
        k = x.numel() // n
        if inplace:
            comm.reduce_scatter(x, op=op, out=x[r * k:(r + 1) * k])
            return x[r * k:(r + 1) * k]
        return comm.reduce_scatter(x, op=op, out=out)
    if coll == "all_to_all":
        return comm.all_to_all(x) if inplace else comm.all_to_all(x, out=out)
    if coll == "broadcast":
        return comm.broadcast(x, root=root)
    if coll == "send_recv":
        return comm.send_recv(x) if inplace else comm.send_recv(x, out=out)
    raise ValueError(coll)


def _buffers(comm: Any, coll: str, numel: int, dtype: Any, symmetric: bool, inplace: bool,
             device: Any, alloc: Optional[Any] = None) -> tuple[Any, Optional[Any]]:
    """(input, output) for a call of ``numel`` message elements (allgather: output elements);
    ``alloc(numel)`` makes each tensor (default: ``comm.empty`` when ``symmetric``, else torch)."""
    import torch

    n, r = comm.world_size, comm.rank
    if alloc is None:
        alloc = (lambda m: comm.empty(m, dtype=dtype)) if symmetric else (
            lambda m: torch.empty(m, dtype=dtype, device=device))
    if coll == "all_gather":
        out = alloc(numel)
        k = numel // n
        return (out[r * k:(r + 1) * k], out) if inplace else (alloc(k), out)
    if coll == "reduce_scatter":
        return alloc(numel), (None if inplace else alloc(numel // n))
    x = alloc(numel)
    return x, (None if inplace or coll == "broadcast" else alloc(numel))


def check_collective(w: Any, coll: str, dtypes=DTYPES, numels=(), ops=("sum",),
                     symmetric=(False, True), inplace=(False, True), graph: bool = False,
                     seed: int = 11, root: int = 0) -> dict:
    """Every combination of dtype x element count x reduce op x buffer kind x in-place mode,
    eager (or captured once and replayed on fresh data with ``graph``)."""
    comm = communicator(w)
    n, r = w.world_size, w.rank
    dev = comm.device
    failures: list[str] = []
    plans: set[str] = set()
    checked = 0
    reduces = coll in ("all_reduce", "reduce_scatter")
    for dname in dtypes:
        dt = torch_dtype(dname)
        for numel in numels:
            for op in (ops if reduces else ("sum",)):
                for sym in symmetric:
                    for ip in inplace:
                        if coll == "broadcast" and not ip:
                            continue
                        where = (f"{coll} {dname} numel={numel} op={op} "
                                 f"{'symmetric' if sym else 'plain'} {'in-place' if ip else 'out-of-place'}"
                                 f"{' graph' if graph else ''}")
                        seed += 1
                        err = attempt(comm, _one, coll, numel, dt, op, sym, ip, graph, seed, root, dev, n, r)
                        checked += 1
                        if comm.last is not None:
                            plans.add(comm.last.label())
                        if err:
                            failures.append(f"rank {r}: {where}: {err}")
    return {"rank": r, "checked": checked, "failures": failures, "plans": sorted(plans)}


def _one(comm: Any, coll: str, numel: int, dt: Any, op: str, sym: bool, ip: bool, graph: bool,
         seed: int, root: int, dev: Any, n: int, r: int) -> Optional[str]:
    import torch

    x, out = _buffers(comm, coll, numel, dt, sym, ip, dev)
    per_rank = x.numel()
    xs = [rank_input(seed, q, per_rank, dt, dev) for q in range(n)]
    want = _expectation(coll, r, n, xs, op, root)
    if out is not None:
        (out.view(torch.int16) if out.element_size() == 2 else out.view(torch.int32)).fill_(0x7F7F)
    if not graph:
        x.copy_(xs[r])
        got = _call(comm, coll, x, out, ip, op, root)
        _sync(comm)
        return _compare(got, want)
    # graph: one eager call does the first-time setup, then capture and replay on new data
    x.copy_(xs[r])
    _call(comm, coll, x, out, ip, op, root)
    g, got = capture_graph(lambda: _call(comm, coll, x, out, ip, op, root))
    for rep in range(3):
        xs = [rank_input(seed * 7 + rep, q, per_rank, dt, dev) for q in range(n)]
        want = _expectation(coll, r, n, xs, op, root)
        x.copy_(xs[r])
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        comm.synchronize()
        err = _compare(got, want)
        if err:
            return f"replay {rep}: {err}"
    return None


def check_fallback_logged_once(w: Any) -> dict:
    """A broadcast from a root no plan serves runs through torch.distributed (a group created
    lazily from the store of the worker's runtime) and is logged once."""
    import logging

    import torch

    comm = communicator(w, fallback=True)
    records: list[str] = []

    class _H(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            records.append(rec.getMessage())

    h = _H()
    logging.getLogger("mscclang.comm").addHandler(h)
    try:
        root = w.world_size - 1
        bad = 0
        for i in range(3):
            x = rank_input(i, w.rank, 1000 + i, torch.float32, comm.device)
            comm.broadcast(x, root=root)
            _sync(comm)
            bad += int((x != rank_input(i, root, 1000 + i, torch.float32, comm.device)).sum())
        mode = comm.last.mode if comm.last else None
    finally:
        logging.getLogger("mscclang.comm").removeHandler(h)
    return {"rank": w.rank, "bad": bad, "mode": mode,
            "logged": [m for m in records if "falls back" in m]}


def check_warm_up(w: Any, max_bytes: int = 4 << 20) -> dict:
    """``Communicator.warm_up`` on the GPU runtime, then all_reduce and all_gather at sizes the
    warm-up never ran: the plans those calls run (every one warmed), what they returned (every
    rank's bytes, gathered by the caller) and the warm-up's records."""
    import random

    import torch

    comm = communicator(w)
    warmed = comm.warm_up(["all_reduce", "all_gather"], dtype=torch.bfloat16, max_bytes=max_bytes)
    rng = random.Random(11)
    n = w.world_size
    later, digests = [], []
    for _ in range(6):
        k = rng.randrange(1, max_bytes // 2 // n)
        x = spread(k * n, torch.bfloat16, k + w.rank).to(comm.device)
        comm.all_reduce(x)
        later.append(("allreduce", comm.last.plan.name if comm.last.plan is not None else None))
        y = comm.all_gather(x[:k])
        later.append(("allgather", comm.last.plan.name if comm.last.plan is not None else None))
        _sync(comm)
        digests.append((x.view(torch.int16).cpu().tolist()[:64], int(x.view(torch.int16).sum()),
                        int(y.view(torch.int16).sum())))
    return {"warmed": [(c.collective, c.nbytes, c.buffers, c.plan, c.mode) for c in warmed],
            "later": later, "digests": digests}
