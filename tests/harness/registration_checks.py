"""GPU worker commands for registered ordinary tensors and the staging cap
(``tests/gpu/test_registration_gpu.py``; :mod:`mscclang.runtime.workers` runs them on every rank).

* :func:`eager_reuse`: ordinary tensors (torch's allocator) called again and again with fresh
  data: exact results, zero-copy from the first call where the tuning picks a zero-copy plan, and
  no store exchange after the first call;
* :func:`graph_ordinary`: CUDA graphs captured inside ``comm.graph_capture()`` on ordinary tensors
  (static ones allocated before the capture and outputs allocated inside it), and on tensors
  registered by ``prepare`` captured by a plain ``torch.cuda.graph``: replays exact;
* :func:`timing`: registered ordinary tensors against symmetric ones, eager and in graphs;
* :func:`allocator_report`: what the process's allocator hands out (expandable segments or not);
* :func:`memory_cap`, :func:`memory_report`, :func:`free_after_large`: the staging cap, what the
  communicator holds after every collective and size, and GPU memory after a large call.

Every result is checked bit for bit at 2 ranks (order-free sums), within the any-order bound at
more (as :mod:`tests.harness.comm_checks` does). Commands return dicts with ``checked`` and
``failures`` (strings naming the case) plus what the test asserts on.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any, Optional

from mscclang.bench.worker import capture_graph, gen_input
from mscclang.plan.dtypes import dtype_info, torch_dtype
from tests.harness.comm_checks import _compare, _expectation
from tests.harness.data import rank_input
from tests.harness.trust_checks import _fresh_comm, _safe_close

SIZES = (1 << 10, 1 << 16, 1 << 20, 16 << 20, 256 << 20)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"


def _count_exchanges(comm: Any) -> list[int]:
    """Count the store exchanges of ``comm``'s runtime communicator (barriers included)."""
    rc = comm.backend.executor.comm
    count = [0]
    orig = rc.exchange

    def counting(data: bytes, tag: str, timeout_s: Optional[float] = None) -> list[bytes]:
        count[0] += 1
        return orig(data, tag, timeout_s)

    rc.exchange = counting
    return count


def _numel(coll: str, nbytes: int, esz: int, n: int) -> int:
    """Message elements (allgather: output) for about ``nbytes``, divisible by ``n``."""
    return max(nbytes // esz // n, 1) * n


def _tensors(coll: str, numel: int, dt: Any, dev: Any, n: int, r: int) -> tuple[Any, Any]:
    """Ordinary (input, output) of a call; all_reduce and all_to_all run in place (output None)."""
    import torch

    if coll == "all_gather":
        return torch.empty(numel // n, dtype=dt, device=dev), torch.empty(numel, dtype=dt, device=dev)
    if coll == "reduce_scatter":
        return torch.empty(numel, dtype=dt, device=dev), torch.empty(numel // n, dtype=dt, device=dev)
    return torch.empty(numel, dtype=dt, device=dev), None


def _run(comm: Any, coll: str, x: Any, out: Optional[Any]) -> Any:
    if coll == "all_reduce":
        return comm.all_reduce(x)
    if coll == "all_to_all":
        return comm.all_to_all(x)
    if coll == "all_gather":
        return comm.all_gather(x, out=out)
    if coll == "reduce_scatter":
        return comm.reduce_scatter(x, out=out)
    raise ValueError(coll)


def _load(comm: Any, coll: str, x: Any, seed: int) -> Any:
    """Fresh inputs for ``seed`` (:func:`~tests.harness.data.rank_input`, this rank's into ``x``);
    the expectation of this rank's output."""
    n, r = comm.world_size, comm.rank
    xs = [rank_input(seed, q, x.numel(), x.dtype, x.device) for q in range(n)]
    x.copy_(xs[r])
    return _expectation(coll, r, n, xs, "sum", 0)


def _zero_copy(comm: Any) -> bool:
    cp = comm.last
    return bool(cp is not None and cp.mode == "direct" and cp.variant is not None and cp.variant.symmetric)


def _free_quiet(w: Any) -> int:
    """The device's free memory, measured with every rank at the same point (store barriers on
    both sides): ranks that share a GPU (``MSCCLANG_RANKS_PER_GPU``) then see each other's memory
    at a quiescent point too."""
    import torch

    torch.cuda.synchronize()
    w.comm.barrier("free-memory-before")
    free = int(torch.cuda.mem_get_info()[0])
    w.comm.barrier("free-memory-after")
    return free


def eager_reuse(w: Any, colls=("all_reduce", "all_gather", "reduce_scatter", "all_to_all"), sizes=SIZES,
                dtype: str = "bfloat16", calls: int = 4, seed: int = 500) -> dict:
    """Per collective x size: one pair of ordinary tensors called ``calls`` times with fresh data;
    per call the plan label, whether it ran zero-copy and the store exchanges it made."""
    import torch

    comm = _fresh_comm(w, f"reuse{seed}")
    ex_count = _count_exchanges(comm)
    dt = torch_dtype(dtype)
    n, r = w.world_size, w.rank
    failures: list[str] = []
    cases: dict[str, dict] = {}
    checked = 0
    try:
        for coll in colls:
            for nbytes in sizes:
                numel = _numel(coll, nbytes, dtype_info(dtype).itemsize, n)
                x, out = _tensors(coll, numel, dt, comm.device, n, r)
                rec = {"labels": [], "zero_copy": [], "exchanges": [], "registrations": 0}
                cases[f"{coll} {nbytes}"] = rec
                for i in range(calls):
                    try:
                        want = _load(comm, coll, x, seed + 17 * i + nbytes % 1009)
                        before = ex_count[0]
                        got = _run(comm, coll, x, out)
                        comm.synchronize()
                        rec["exchanges"].append(ex_count[0] - before)
                        rec["labels"].append(comm.last.label() if comm.last else "?")
                        rec["zero_copy"].append(_zero_copy(comm))
                        bad = _compare(got, want)
                    except Exception as e:  # noqa: BLE001
                        bad = _err(e)
                    checked += 1
                    if bad:
                        failures.append(f"rank {r}: {coll} {nbytes} B call {i}: {bad}")
                # while the case's tensors live: a registration belongs to a storage and is
                # released here once its storage dies
                rec["registrations"] = comm.memory().get("registrations", 0)
                del x, out
        mem = comm.memory()
        return {"rank": r, "checked": checked, "failures": failures, "cases": cases, "memory": mem}
    finally:
        torch.cuda.synchronize()
        _safe_close(comm)


def graph_ordinary(w: Any, colls=("all_reduce", "all_gather", "reduce_scatter", "all_to_all"), sizes=SIZES,
                   dtype: str = "bfloat16", replays: int = 3, seed: int = 900, session: bool = True) -> dict:
    """Per collective x size: warm the size up eagerly on other tensors, then capture the call on
    ordinary tensors: with ``session``, inside ``comm.graph_capture()`` on a static input
    allocated after the warm-up (never called eagerly) with the output allocated inside the capture;
    without, after ``comm.prepare`` on the static tensors, in a plain ``torch.cuda.graph``. Replays
    on fresh data, checked; reports the labels captured and the registrations made."""
    import torch

    comm = _fresh_comm(w, f"graphord{seed}{int(session)}")
    dt = torch_dtype(dtype)
    n, r = w.world_size, w.rank
    failures: list[str] = []
    labels: dict[str, str] = {}
    checked = 0
    graphs = []
    cap = comm.backend.memory.cap
    try:
        for coll in colls:
            for nbytes in sizes:
                numel = _numel(coll, nbytes, dtype_info(dtype).itemsize, n)
                what = f"{coll} {nbytes} B {'session' if session else 'prepared'}"
                if session and coll == "all_to_all" and cap is not None and numel * dtype_info(dtype).itemsize > cap:
                    # in-place all_to_all is always staged (no in-place all_to_all plan), and staging
                    # above the cap exists only for the call: a capture of it must be prepared
                    labels[what] = "not captured: staged above the staging cap, needs prepare"
                    continue
                try:
                    wx, wout = _tensors(coll, numel, dt, comm.device, n, r)
                    _load(comm, coll, wx, seed)
                    _run(comm, coll, wx, wout)               # warm-up: kernel, context, plan entry
                    comm.synchronize()
                    del wx, wout
                    x, _ = _tensors(coll, numel, dt, comm.device, n, r)
                    box: dict = {}

                    def body() -> Any:
                        out = None
                        if coll == "all_gather":
                            out = torch.empty(numel, dtype=dt, device=comm.device)      # graph pool
                        elif coll == "reduce_scatter":
                            out = torch.empty(numel // n, dtype=dt, device=comm.device)
                        box["got"] = _run(comm, coll, x, out)
                        return box["got"]

                    if session:
                        with comm.graph_capture():
                            g, _ = capture_graph(body)
                    else:
                        xo = None
                        if coll in ("all_gather", "reduce_scatter"):
                            raise ValueError("prepare-then-capture is checked on in-place collectives")
                        comm.prepare(coll, x, out=xo)
                        g, _ = capture_graph(body)
                    graphs.append(g)
                    labels[what] = comm.last.label() if comm.last else "?"
                    for rep in range(replays):
                        want = _load(comm, coll, x, seed * 7 + rep + nbytes % 997)
                        torch.cuda.synchronize()
                        g.replay()
                        comm.synchronize()
                        bad = _compare(box["got"], want)
                        checked += 1
                        if bad:
                            failures.append(f"rank {r}: {what} replay {rep}: {bad}")
                            break
                except Exception as e:  # noqa: BLE001
                    failures.append(f"rank {r}: {what}: {_err(e)}")
                    try:
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001
                        pass
        mem = comm.memory()
        return {"rank": r, "checked": checked, "failures": failures, "labels": labels, "memory": mem}
    finally:
        torch.cuda.synchronize()
        del graphs
        _safe_close(comm)


def _time_calls(fn: Any, iters: int) -> float:
    """Microseconds per call of ``fn`` (eager), median of 3 runs of ``iters`` calls."""
    from mscclang.bench.worker import timed_blocks

    def calls() -> None:
        for _ in range(iters):
            fn()

    return sorted(timed_blocks(calls, iters, 3, lambda: None))[1]


def _time_graph(comm: Any, body: Any, per_graph: int, replays: int, session: bool) -> float:
    """Microseconds per call of ``body`` captured ``per_graph`` times in one graph."""

    def many() -> None:
        for _ in range(per_graph):
            body()

    if session:
        with comm.graph_capture():
            g, _ = capture_graph(many)
    else:
        g, _ = capture_graph(many)
    g.replay()
    comm.synchronize()
    us = _time_calls(g.replay, replays) / per_graph
    del g
    return us


def timing(w: Any, sizes=(1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20,
                          1 << 30), dtype: str = "bfloat16", seed: int = 1300) -> dict:
    """all_reduce in place per size: microseconds per call on a symmetric tensor and on an
    ordinary one (registered by its first call), eager and in a CUDA graph (the ordinary tensor
    captured in a ``graph_capture`` session, unregistered: deferred registration), and the labels."""
    import torch

    comm = _fresh_comm(w, f"timing{seed}")
    dt = torch_dtype(dtype)
    n, r = w.world_size, w.rank
    rows = []
    failures: list[str] = []
    try:
        for nbytes in sizes:
            numel = _numel("all_reduce", nbytes, dtype_info(dtype).itemsize, n)
            big = nbytes >= 64 << 20
            iters = 5 if big else 50
            per_graph, replays = (2, 3) if big else (20, 10)
            row: dict = {"bytes": nbytes}
            try:
                s = comm.empty(numel, dtype=dt)
                s.copy_(gen_input(seed, r, numel, dt, comm.device))
                x = torch.empty(numel, dtype=dt, device=comm.device)
                x.copy_(s)
                for t, key in ((s, "sym"), (x, "ordinary")):
                    comm.prepare("all_reduce", t)
                    comm.all_reduce(t)
                    row[f"{key}_label"] = comm.last.label() if comm.last else "?"
                    row[f"{key}_eager_us"] = _time_calls(lambda t=t: comm.all_reduce(t), iters)
                    row[f"{key}_graph_us"] = _time_graph(comm, lambda t=t: comm.all_reduce(t), per_graph, replays,
                                                         session=False)
                y = torch.empty(numel, dtype=dt, device=comm.device)   # never called eagerly: deferred
                y.copy_(s)
                row["deferred_graph_us"] = _time_graph(comm, lambda y=y: comm.all_reduce(y), per_graph, replays,
                                                       session=True)
                row["deferred_label"] = comm.last.label() if comm.last else "?"
                del s, x, y
            except Exception as e:  # noqa: BLE001
                failures.append(f"rank {r}: {nbytes} B: {_err(e)}")
                torch.cuda.synchronize()
            rows.append(row)
        return {"rank": r, "checked": len(rows), "failures": failures, "rows": rows}
    finally:
        torch.cuda.synchronize()
        _safe_close(comm)


def allocator_report(w: Any, nbytes: int = 8 << 20) -> dict:
    """What this process's torch allocator hands out: the alloc settings and whether an ordinary
    tensor's allocation can be exported through legacy CUDA IPC."""
    import torch

    from mscclang.runtime import cuda as cu

    x = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{int(w.comm.device)}")
    capable = cu.ipc_capable(x.data_ptr())
    return {"rank": w.rank, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "ipc_capable": capable}


class _Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, rec: logging.LogRecord) -> None:
        self.messages.append(rec.getMessage())


def with_logs(w: Any, command: str, *args: Any, **kwargs: Any) -> dict:
    """Run another command of this module and add the log lines of ``mscclang.*`` it produced."""
    h = _Logs()
    lg = logging.getLogger("mscclang")
    lg.addHandler(h)
    old = lg.level
    lg.setLevel(logging.INFO)
    try:
        res = globals()[command](w, *args, **kwargs)
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    res["logs"] = h.messages
    return res


def _env(updates: dict) -> dict:
    old = {k: os.environ.get(k) for k in updates}
    for k, v in updates.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    return old


def memory_cap(w: Any, cap: int = 8 << 20, nbytes: int = 64 << 20, dtype: str = "bfloat16",
               seed: int = 1700) -> dict:
    """Staging above the cap is released after its call: a zero-copy-only tuning on ordinary,
    unregistered tensors (``MSCCLANG_REGISTER=off``) stages every call; ``nbytes`` above ``cap``.
    Reports the staging held after each call and the device's free memory before and after, for
    the collective API and for a bare executor (its own staging)."""
    import torch

    old = _env({"MSCCLANG_STAGING_CAP_BYTES": cap, "MSCCLANG_REGISTER": "off"})
    comm = None
    failures: list[str] = []
    checked = 0
    out: dict = {"rank": w.rank}
    try:
        comm = _fresh_comm(w, f"cap{seed}")
        n = w.world_size
        comm.use_tuning({"format": "mscclang.tuning/1", "rules": [
            {"collective": "allreduce", "candidates": [{"plan": "allreduce_rsag_zero_copy", "instances": 16}]}]})
        dt = torch_dtype(dtype)
        numel = _numel("all_reduce", nbytes, dtype_info(dtype).itemsize, n)
        held, labels = [], []
        for i in range(3):
            x = torch.empty(numel, dtype=dt, device=comm.device)
            want = _load(comm, "all_reduce", x, seed + i)
            comm.all_reduce(x)
            comm.synchronize()
            labels.append(comm.last.label() if comm.last else "?")
            held.append(comm.memory().get("staging", 0))
            bad = _compare(x, want)
            checked += 1
            if bad:
                failures.append(f"rank {w.rank}: call {i}: {bad}")
            del x
            if i == 0:
                torch.cuda.empty_cache()
                out["free_after_first"] = _free_quiet(w)
        torch.cuda.empty_cache()
        out["free_after_last"] = _free_quiet(w)
        out.update(labels=labels, staging_held=held, memory=comm.memory())
        # a bare executor: the plan on ordinary tensors stages through the executor's own staging
        ex = comm.backend.executor
        plan = next(v for v in comm.catalog if v.key == f"allreduce_rsag_zero_copy.r{n}.i16.inplace").load()
        x = torch.empty(numel, dtype=dt, device=comm.device)
        want = _load(comm, "all_reduce", x, seed + 9)
        ex.execute(plan, x, x)
        ex.synchronize()
        bad = _compare(x, want)
        checked += 1
        if bad:
            failures.append(f"rank {w.rank}: executor: {bad}")
        out["executor_staging_held"] = ex.comm.memory().get("staging", 0)
    except Exception as e:  # noqa: BLE001
        failures.append(f"rank {w.rank}: {_err(e)}")
    finally:
        torch.cuda.synchronize()
        if comm is not None:
            _safe_close(comm)
        _env(old)
    out.update(checked=checked, failures=failures, cap=cap)
    return out


def memory_report(w: Any, colls=("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"),
                  sizes=(1 << 10, 1 << 16, 1 << 20, 16 << 20, 256 << 20, 1 << 30), dtype: str = "bfloat16",
                  seed: int = 2100) -> dict:
    """Every collective at every size once on fresh ordinary tensors (the default policy), then
    what the communicator holds (``comm.memory()``), torch's reserved memory and the device's free
    memory; checked results."""
    import torch

    comm = _fresh_comm(w, f"memrep{seed}")
    n, r = w.world_size, w.rank
    dt = torch_dtype(dtype)
    failures: list[str] = []
    checked = 0
    free0 = _free_quiet(w)
    try:
        for coll in colls:
            for nbytes in sizes:
                numel = _numel(coll, nbytes, dtype_info(dtype).itemsize, n)
                try:
                    if coll == "broadcast":
                        x = torch.empty(numel, dtype=dt, device=comm.device)
                        xs = [rank_input(seed, q, numel, dt, comm.device) for q in range(n)]
                        x.copy_(xs[r])
                        comm.broadcast(x, root=0)
                        comm.synchronize()
                        bad = _compare(x, xs[0])
                        del xs
                    else:
                        x, out = _tensors(coll, numel, dt, comm.device, n, r)
                        want = _load(comm, coll, x, seed + nbytes % 991)
                        got = _run(comm, coll, x, out)
                        comm.synchronize()
                        bad = _compare(got, want)
                        del out, got, want
                    del x
                except Exception as e:  # noqa: BLE001
                    bad = _err(e)
                checked += 1
                if bad:
                    failures.append(f"rank {r}: {coll} {nbytes} B: {bad}")
                torch.cuda.empty_cache()
        comm.synchronize()
        torch.cuda.empty_cache()
        return {"rank": r, "checked": checked, "failures": failures, "memory": comm.memory(),
                "torch_reserved": torch.cuda.memory_reserved(), "free_before": free0,
                "free_after": _free_quiet(w)}
    finally:
        torch.cuda.synchronize()
        _safe_close(comm)


def free_after_large(w: Any, nbytes: int = 1 << 30, dtype: str = "bfloat16", seed: int = 2500) -> dict:
    """The issue's case: one all_reduce of ``nbytes`` on an ordinary tensor. After a first such
    call (one-time set-up: kernels, context, device plans), the device's free memory is measured;
    a second call on a new tensor, the tensor freed, ``empty_cache`` and ``comm.synchronize()``
    (which releases the registrations whose tensors died, so the peers' mappings no longer keep the
    memory), then the ranks meet and the free memory is measured again."""
    import torch

    comm = _fresh_comm(w, f"large{seed}")
    n = w.world_size
    dt = torch_dtype(dtype)
    numel = _numel("all_reduce", nbytes, dtype_info(dtype).itemsize, n)
    failures: list[str] = []
    checked = 0
    rc = comm.backend.executor.comm
    try:
        frees = []
        labels = []
        for i in range(2):
            x = torch.empty(numel, dtype=dt, device=comm.device)
            want = _load(comm, "all_reduce", x, seed + i)
            comm.all_reduce(x)
            comm.synchronize()
            labels.append(comm.last.label() if comm.last else "?")
            bad = _compare(x, want)
            checked += 1
            if bad:
                failures.append(f"rank {w.rank}: call {i}: {bad}")
            del x, want
            torch.cuda.empty_cache()
            comm.synchronize()
            rc.barrier("freed")        # every rank released its mappings of the others' tensors
            frees.append(_free_quiet(w))
        return {"rank": w.rank, "checked": checked, "failures": failures, "free": frees, "labels": labels,
                "memory": comm.memory()}
    finally:
        torch.cuda.synchronize()
        _safe_close(comm)
