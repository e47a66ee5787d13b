"""GPU worker commands for the library's trust at its boundaries (``tests/gpu/test_trust_gpu.py``
and the reliability figures of ``notes/reliability.md``): the serving pattern of many CUDA graphs
on shared plans, prepare-then-capture over collectives x sizes x dtypes x layouts x buffer kinds,
bad arguments at every entry point, ranks that disagree on a call, concurrency, and the soak.

Every result is checked bit for bit: at 2 ranks every reference here is exact (a two-operand sum
is order-free, and so are min, max, copies and int32), i.e. equal to NCCL's; at more ranks float
sums are checked within the any-order bound, as :mod:`tests.harness.comm_checks` does.
Each command returns a dict with ``checked`` and ``failures`` (strings naming the case).
"""

from __future__ import annotations

import json
import math
import random
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from mscclang.bench.worker import capture_graph, gen_input
from mscclang.plan.collectives import API_TO_PLAN
from mscclang.plan.dtypes import dtype_info, torch_dtype
from tests.harness.comm_checks import _buffers, _call, _compare, _expectation, _sync

#: the API names of the collectives the checks run
COLLECTIVES = tuple(API_TO_PLAN)


def _fresh_comm(w: Any, name: str, fallback: bool = False, timeout_s: Optional[float] = None,
                specialize: Optional[str] = None) -> Any:
    """A communicator with an executor of its own (no state shared with other commands)."""
    import torch

    from mscclang.comm import Communicator, RuntimeBackend

    opts: dict = {"name": name, "specialize": specialize}
    if timeout_s is not None:
        opts["timeout_s"] = timeout_s
    be = RuntimeBackend(store=w.comm.store, rank=w.rank, world_size=w.world_size,
                        device=torch.device("cuda", int(w.comm.device)), **opts)
    return Communicator(backend=be, fallback=fallback)


class Arena:
    """One symmetric allocation carved into the tensors of one call at a time (the same offsets
    on every rank, so the pieces are symmetric too), instead of a new symmetric allocation per
    case (those are kept until the communicator closes)."""

    def __init__(self, comm: Any, nbytes: int) -> None:
        import torch

        self.buf = comm.empty(nbytes, dtype=torch.uint8)
        self.off = 0

    def reset(self) -> None:
        self.off = 0

    def take(self, numel: int, dtype: Any) -> Any:
        import torch

        esz = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * esz
        if self.off + nbytes > self.buf.numel():
            raise ValueError(f"arena of {self.buf.numel()} B cannot hold {nbytes} B more at {self.off}")
        t = self.buf[self.off:self.off + nbytes].view(dtype)
        self.off = (self.off + nbytes + 255) // 256 * 256
        return t


def _layout(comm: Any, coll: str, numel: int, dtype: Any, sym: Any, inplace: bool) -> tuple[Any, Optional[Any]]:
    """(input, output-or-None) for a call of ``numel`` message elements (allgather: output);
    ``sym``: an :class:`Arena` to carve symmetric tensors from, True for new symmetric
    allocations, or False for ordinary torch tensors."""
    if isinstance(sym, Arena):
        sym.reset()
        return _buffers(comm, coll, numel, dtype, True, inplace, comm.device, alloc=lambda m: sym.take(m, dtype))
    return _buffers(comm, coll, numel, dtype, bool(sym), inplace, comm.device)


class _Case:
    """One call shape, its tensors, and its fresh-data check."""

    def __init__(self, comm: Any, coll: str, numel: int, dname: str, op: str, sym: bool, inplace: bool,
                 seed: int) -> None:
        self.comm, self.coll, self.numel, self.dname, self.op = comm, coll, numel, dname, op
        self.sym, self.inplace, self.seed = sym, inplace, seed
        self.dt = torch_dtype(dname)
        self.x, self.out = _layout(comm, coll, numel, self.dt, sym, inplace)
        self.result: Any = None

    def label(self) -> str:
        return (f"{self.coll} {self.dname} numel={self.numel} op={self.op} "
                f"{'symmetric' if self.sym is not False else 'plain'} "
                f"{'in-place' if self.inplace else 'out-of-place'}")

    def prepare(self) -> None:
        c = self.coll
        kw: dict = {}
        if c in ("all_reduce", "reduce_scatter"):
            kw["op"] = self.op
        out = self.out
        if c == "reduce_scatter" and self.inplace:
            k = self.x.numel() // self.comm.world_size
            out = self.x[self.comm.rank * k:(self.comm.rank + 1) * k]
        self.comm.prepare(c, self.x, out=out, **kw)

    def call(self) -> Any:
        self.result = _call(self.comm, self.coll, self.x, self.out, self.inplace, self.op, 0)
        return self.result

    def check(self, seed: int, run: Optional[Callable[[], Any]] = None) -> Optional[str]:
        """Fresh inputs for ``seed``, one call (or ``run()``, e.g. a graph replay), then the
        result compared: None when exact, else what is wrong."""
        want = self.load(seed)
        (run or self.call)()
        _sync(self.comm)
        return _compare(self.result, want)

    def load(self, seed: int) -> Any:
        """Fresh inputs for ``seed`` (this rank's into the tensor); returns the expectation."""
        n, r = self.comm.world_size, self.comm.rank
        xs = [gen_input(seed, q, self.x.numel(), self.dt, self.comm.device) for q in range(n)]
        self.x.copy_(xs[r])
        return _expectation(self.coll, r, n, xs, self.op, 0)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"


def serving_graphs(w: Any, hidden: int = 8192, batches=(1, 2, 4, 8, 16), rounds: int = 200,
                   eager_every: int = 3, sym: bool = False, seed: int = 100, prepare_first: bool = False) -> dict:
    """A serving engine's pattern: one CUDA graph per batch size, each capturing one in-place
    all_reduce of ``batch x hidden`` bf16 after its ``prepare``, prepared and captured in batch
    order (with ``prepare_first``: every batch prepared before the first capture); then ``rounds``
    rounds that replay the graphs grouped (each 3 times in a row) or interleaved (a random order),
    with eager calls of random batch sizes on fresh tensors mixed in every ``eager_every``
    replays; every replay and call checked bit for bit."""
    comm = _fresh_comm(w, f"serving{seed}")
    rng = random.Random(seed)
    cases, graphs = [], []
    failures: list[str] = []
    checked = 0
    try:
        if prepare_first:   # every batch prepared before any capture (a later prepare grows a context)
            cases = [_Case(comm, "all_reduce", b * hidden, "bfloat16", "sum", sym, True, seed + b) for b in batches]
            for c in cases:
                c.prepare()
        for k, b in enumerate(batches):   # in batch order: (prepare,) capture
            if not prepare_first:
                c = _Case(comm, "all_reduce", b * hidden, "bfloat16", "sum", sym, True, seed + b)
                c.prepare()
                cases.append(c)
            g, _ = capture_graph(cases[k].call)
            graphs.append(g)
        plans = sorted({comm.last.label()} if comm.last else set())
        step = 0
        for rnd in range(rounds):
            order = list(range(len(cases)))
            grouped = rnd % 2 == 0
            if not grouped:
                rng.shuffle(order)
            seq = [i for i in order for _ in range(3)] if grouped else order * 3
            if not grouped:
                rng.shuffle(seq)
            for i in seq:
                step += 1
                c = cases[i]
                bad = c.check(seed * 100003 + step, graphs[i].replay)
                checked += 1
                if bad:
                    failures.append(f"rank {w.rank}: round {rnd} ({'grouped' if grouped else 'interleaved'}) "
                                    f"replay of batch {batches[i]} graph: {bad}")
                if step % eager_every == 0:
                    b = rng.choice(batches)
                    e = _Case(comm, "all_reduce", b * hidden, "bfloat16", "sum", False, True,
                              seed + 7 * step)
                    bad = e.check(seed * 7 + step)
                    checked += 1
                    if comm.last is not None:
                        plans.append(comm.last.label())
                    if bad:
                        failures.append(f"rank {w.rank}: eager batch {b} after step {step}: {bad}")
                if len(failures) > 20:
                    break
        return {"rank": w.rank, "checked": checked, "failures": failures, "plans": sorted(set(plans))}
    except Exception as e:  # noqa: BLE001
        failures.append(f"rank {w.rank}: {_err(e)}")
        return {"rank": w.rank, "checked": checked, "failures": failures, "plans": []}
    finally:
        del graphs
        _safe_close(comm)


def _safe_close(comm: Any) -> None:
    try:
        import torch

        torch.cuda.synchronize()
        comm.close()
    except Exception:  # noqa: BLE001
        pass


def prepare_capture(w: Any, colls=COLLECTIVES, sizes=(1024,), dtypes=("bfloat16",), inplace=(False, True),
                    symmetric=(False, True), ops=("sum",), replays: int = 2, seed: int = 300,
                    name: str = "capture", specialize: Optional[str] = None) -> dict:
    """For every collective x message size (bytes) x dtype x layout x buffer kind: prepare the
    call, capture it (the first call of its shape happens inside the capture), replay on fresh
    data and check. A capture that fails is a failure: every call prepare accepts must capture.
    ``specialize``: the executor's kernel policy (prepare builds the plan-specialised kernel for
    every new size under 'auto'; 'never' keeps a long matrix to the interpreter's one build)."""
    import torch

    comm = _fresh_comm(w, f"{name}{seed}", specialize=specialize)
    failures: list[str] = []
    checked = 0
    plans: set[str] = set()
    n = w.world_size
    arena = Arena(comm, 2 * max(sizes) + 4096) if True in symmetric else None
    try:
        for coll in colls:
            for nbytes in sizes:
                for dname in dtypes:
                    esz = dtype_info(dname).itemsize
                    numel = max(nbytes // esz // n, 1) * n
                    for op in (ops if coll in ("all_reduce", "reduce_scatter") else ("sum",)):
                        for sym in symmetric:
                            for ip in inplace:
                                if coll == "broadcast" and not ip:
                                    continue
                                seed += 1
                                c = _Case(comm, coll, numel, dname, op, arena if sym else False, ip, seed)
                                try:
                                    c.prepare()
                                    g, _ = capture_graph(c.call)
                                    if comm.last is not None:
                                        plans.add(comm.last.label())
                                    for rep in range(replays):
                                        bad = c.check(seed * 31 + rep, g.replay)
                                        checked += 1
                                        if bad:
                                            failures.append(f"rank {w.rank}: {c.label()} replay {rep}: {bad}")
                                            break
                                    del g
                                except Exception as e:  # noqa: BLE001
                                    failures.append(f"rank {w.rank}: {c.label()}: {_err(e)}")
                                    try:
                                        torch.cuda.synchronize()
                                    except Exception:  # noqa: BLE001
                                        pass
                                c.x = c.out = c.result = None
        return {"rank": w.rank, "checked": checked, "failures": failures, "plans": sorted(plans)}
    finally:
        _safe_close(comm)


def bad_inputs(w: Any) -> dict:
    """Every public entry point given a CPU tensor, a tensor of another GPU (when there is one)
    and the other bad inputs users try: each must raise a clear error before reaching the GPU,
    and the communicator (and a bare executor) must stay usable and exact afterwards."""
    import torch

    from mscclang.errors import MscclangError
    from mscclang.plan.samples import allreduce_oneshot_ll

    comm = _fresh_comm(w, "badinputs", fallback=True)
    n, r = w.world_size, w.rank
    dev = comm.device
    cpu = torch.ones(1024)
    other = None
    if torch.cuda.device_count() > 1:
        other = torch.ones(1024, device=f"cuda:{(r + 1) % torch.cuda.device_count()}")
    good = torch.ones(1024, device=dev)
    cases: list[tuple[str, Callable[[], Any]]] = []
    for what, t in (("cpu", cpu), ("other gpu", other)):
        if t is None:
            continue
        cases += [
            (f"all_reduce {what}", lambda t=t: comm.all_reduce(t)),
            (f"all_reduce out {what}", lambda t=t: comm.all_reduce(good, out=t)),
            (f"all_gather {what}", lambda t=t: comm.all_gather(t)),
            (f"reduce_scatter {what}", lambda t=t: comm.reduce_scatter(t)),
            (f"all_to_all {what}", lambda t=t: comm.all_to_all(t)),
            (f"broadcast {what}", lambda t=t: comm.broadcast(t, root=0)),
            (f"send_recv {what}", lambda t=t: comm.send_recv(t)),
            (f"send {what}", lambda t=t: comm.send(t, (r + 1) % n)),
            (f"recv {what}", lambda t=t: comm.recv(t, (r + 1) % n)),
            (f"prepare {what}", lambda t=t: comm.prepare("all_reduce", t)),
        ]
    ex = w.executor
    plan = allreduce_oneshot_ll(n)
    cases += [
        ("Executor.execute cpu", lambda: ex.execute(plan, cpu, cpu.clone())),
        ("Executor.execute cpu out", lambda: ex.execute(plan, good, cpu)),
        ("Executor.prepare cpu", lambda: ex.prepare(plan, cpu, cpu.clone())),
        ("Executor.execute non-contiguous", lambda: ex.execute(
            plan, torch.ones(2048, device=dev)[::2], torch.ones(1024, device=dev))),
        ("Executor.execute float64", lambda: ex.execute(
            plan, torch.ones(1024, device=dev, dtype=torch.float64), torch.ones(1024, device=dev, dtype=torch.float64))),
        ("Executor.execute size mismatch", lambda: ex.execute(plan, good, torch.ones(1000, device=dev))),
        ("Executor.execute out-of-place plan on one tensor", lambda: ex.execute(plan, good, good)),
        ("non-contiguous", lambda: comm.all_reduce(torch.ones(2048, device=dev)[::2])),
        ("op prod", lambda: comm.all_reduce(good, op="prod")),
        ("float64", lambda: comm.all_reduce(torch.ones(1024, device=dev, dtype=torch.float64))),
        ("indivisible reduce_scatter", lambda: comm.reduce_scatter(torch.ones(n * 100 + 1, device=dev))),
        ("wrong all_gather output", lambda: comm.all_gather(good, out=torch.empty(1000, device=dev))),
        ("bad root", lambda: comm.broadcast(good, root=n)),
    ]
    if other is not None:
        cases.append(("Executor.execute other gpu", lambda: ex.execute(plan, other, other.clone())))
    failures: list[str] = []
    raised: dict[str, str] = {}
    for label, fn in cases:
        try:
            fn()
            torch.cuda.synchronize()
            failures.append(f"rank {r}: {label}: no error")
        except MscclangError as e:
            raised[label] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - any other exception is a failure too
            failures.append(f"rank {r}: {label}: {type(e).__name__} (not a mscclang error): {e}")
    # still usable and exact, through the communicator and the bare executor
    checked = 0
    for numel in (1024, 4097, 1 << 20):
        c = _Case(comm, "all_reduce", numel, "bfloat16", "sum", False, True, 900 + numel)
        try:
            bad = c.check(77 + numel)
        except Exception as e:  # noqa: BLE001
            bad = _err(e)
        checked += 1
        if bad:
            failures.append(f"rank {r}: all_reduce of {numel} after the bad calls: {bad}")
    xs = [gen_input(5, q, 1024, torch.float16, dev) for q in range(n)]
    out = torch.empty(1024, dtype=torch.float16, device=dev)
    try:
        ex.execute(plan, xs[r], out)
        ex.synchronize()
        want = _expectation("all_reduce", r, n, xs, "sum", 0)
        bad = _compare(out, want)
    except Exception as e:  # noqa: BLE001
        bad = _err(e)
    checked += 1
    if bad:
        failures.append(f"rank {r}: executor after the bad calls: {bad}")
    _safe_close(comm)
    return {"rank": r, "checked": checked, "failures": failures, "raised": raised}


def disagree(w: Any, numels=(1024, 1 << 20)) -> dict:
    """Rank 0 calls all_reduce on ``numels[0]`` elements, every other rank on ``numels[1]``:
    every rank must raise CallMismatch (naming what each rank called) or CollectiveTimeout,
    within the timeout; then, agreeing again, the same communicator works."""
    import torch

    comm = _fresh_comm(w, "disagree", timeout_s=5.0)
    comm.backend.executor.comm.store_timeout_s = 20.0
    numel = numels[0] if w.rank == 0 else numels[1]
    x = torch.ones(numel, device=comm.device, dtype=torch.bfloat16)
    t0 = time.monotonic()
    raised = ""
    try:
        comm.all_reduce(x)
        _sync(comm)
    except Exception as e:  # noqa: BLE001
        raised = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    after = None
    try:
        comm.reset()
        c = _Case(comm, "all_reduce", 4096, "bfloat16", "sum", False, True, 5)
        after = c.check(5) or "ok"
    except Exception as e:  # noqa: BLE001
        after = _err(e)
    _safe_close(comm)
    return {"rank": w.rank, "raised": raised, "elapsed_s": elapsed, "after": after}


def concurrency(w: Any, iters: int = 50) -> dict:
    """Two communicators (separate executors and store namespaces) in one process, collectives
    on two streams, and mscclang calls interleaved with NCCL's: all exact, no deadlock."""
    import torch

    a = _fresh_comm(w, "concA", fallback=True)
    b = _fresh_comm(w, "concB")
    n, r = w.world_size, w.rank
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    failures: list[str] = []
    checked = 0
    try:
        for it in range(iters):
            cases = [_Case(a, "all_reduce", 4096 + it, "bfloat16", "sum", False, True, it),
                     _Case(b, "all_gather", n * (3000 + it), "float32", "sum", False, False, it),
                     _Case(a, "all_reduce", (1 << 18) + it, "float16", "sum", False, True, 7 * it),
                     _Case(b, "all_reduce", 1 << 20, "bfloat16", "max", False, True, 11 * it)]
            wants = [c.load(1000 * it + i) for i, c in enumerate(cases)]
            torch.cuda.synchronize()
            with torch.cuda.stream(s1):
                cases[0].call()
                cases[1].call()
            with torch.cuda.stream(s2):
                cases[2].call()
                cases[3].call()
            # NCCL on the default stream, interleaved with the mscclang calls above
            y = gen_input(99 + it, r, 5000, torch.float32, a.device)
            ys = [gen_input(99 + it, q, 5000, torch.float32, a.device) for q in range(n)]
            a._fallback.all_reduce(y, y, "sum")
            torch.cuda.synchronize()
            _sync(a)
            _sync(b)
            for c, want in zip(cases, wants):
                bad = _compare(c.result, want)
                checked += 1
                if bad:
                    failures.append(f"rank {r}: iteration {it} {c.label()}: {bad}")
            bad = _compare(y, _expectation("all_reduce", r, n, ys, "sum", 0))
            checked += 1
            if bad:
                failures.append(f"rank {r}: iteration {it} NCCL all_reduce: {bad}")
    except Exception as e:  # noqa: BLE001
        failures.append(f"rank {r}: {_err(e)}")
    finally:
        _safe_close(a)
        _safe_close(b)
    return {"rank": r, "checked": checked, "failures": failures}


def _log_uniform_numel(rng: random.Random, esz: int, n: int, max_bytes: int) -> int:
    """An element count, log-uniform from 1 element to ``max_bytes``, odd counts included."""
    hi = max(1, max_bytes // esz)
    v = int(math.exp(rng.uniform(0.0, math.log(hi))))
    return max(1, min(v, hi))


def soak(w: Any, calls: int = 100000, graph_replays: int = 10000, graphs: int = 40, max_bytes: int = 64 << 20,
         seed: int = 2026, time_limit_s: float = 240.0, size_pool: int = 0, reserve_s: float = 120.0) -> dict:
    """Random collectives, sizes (1 element .. ``max_bytes``, log-uniform, odd counts), dtypes and
    reduce ops: ``calls`` eager calls, then ``graphs`` captured calls replayed ``graph_replays``
    times in all, every result compared bit for bit (2 ranks) with the reference. Stops at
    ``time_limit_s`` (the eager calls ``reserve_s`` before it, leaving that for the captures and
    replays; every 100 calls the ranks agree to go on) and reports how many it did. ``size_pool`` > 0: each (collective, element
    size) draws its counts from that many random counts fixed at its first draw (an
    application's finite set of shapes: the calls then measure steady state, not only the
    first-time set-up of a new size every call); 0: a fresh count every call."""

    comm = _fresh_comm(w, f"soak{seed}", fallback=True)
    rng = random.Random(seed)   # the same on every rank: the ranks make the same calls
    n, r = w.world_size, w.rank
    failures: list[str] = []
    done_eager = done_graph = 0
    t0 = time.monotonic()
    pool: dict[tuple, _Case] = {}
    size_counts: dict[tuple, list[int]] = {}
    shapes: set = set()   # distinct (collective, bytes) drawn
    arenas = [Arena(comm, 2 * max_bytes + 4096) for _ in range(2)]

    def draw() -> _Case:
        coll = rng.choice(COLLECTIVES)
        dname = rng.choice(("float16", "bfloat16", "float32", "int32"))
        op = rng.choice(("sum", "min", "max")) if coll in ("all_reduce", "reduce_scatter") else "sum"
        blocks = n if coll in ("all_gather", "reduce_scatter", "all_to_all") else 1
        if size_pool > 0:
            counts = size_counts.get((coll, dtype_info(dname).itemsize))
            if counts is None:
                counts = size_counts[(coll, dtype_info(dname).itemsize)] = [
                    _log_uniform_numel(rng, dtype_info(dname).itemsize, n, max_bytes // blocks) for _ in range(size_pool)]
            numel = counts[rng.randrange(size_pool)] * blocks
        else:
            numel = _log_uniform_numel(rng, dtype_info(dname).itemsize, n, max_bytes // blocks) * blocks
        shapes.add((coll, numel * dtype_info(dname).itemsize))
        sym = rng.random() < 0.25
        ip = rng.random() < 0.5 or coll == "broadcast"
        key = (coll, dname, numel, sym, ip)
        c = pool.get(key)   # reuse tensors of a shape seen before (as applications do)
        if c is None or rng.random() < 0.3:
            if len(pool) > 64:
                pool.pop(next(iter(pool)))
            c = _Case(comm, coll, numel, dname, op, arenas[rng.randrange(2)] if sym else False, ip, 0)
            pool[key] = c
        c.op = op
        return c

    store = w.comm.store
    votes = [0]

    def all_go(stop: bool) -> bool:
        """Whether every rank goes on: the ranks make the same calls, so when one stops (its
        time is up, too many failures) all must stop at the same call, or the rank still
        calling waits for a peer that has moved on (a hang of the harness, not the library)."""
        k = votes[0]
        votes[0] += 1
        store.set(f"soak{seed}/vote{k}/{r}", "0" if stop else "1")
        return all(store.get(f"soak{seed}/vote{k}/{q}") == b"1" for q in range(n))

    eager_until = max(time_limit_s * 0.5, time_limit_s - reserve_s)
    try:
        for i in range(calls):
            if i % 100 == 0 and not all_go(time.monotonic() - t0 > eager_until or len(failures) > 20):
                break
            c = draw()
            bad = c.check(seed + i)
            done_eager += 1
            if bad:
                failures.append(f"rank {r}: eager call {i}: {c.label()}: {bad}")
        captured = []
        for k in range(graphs):
            if not all_go(bool(captured) and time.monotonic() - t0 > time_limit_s - reserve_s * 0.4):
                break
            c = draw()
            c.prepare()
            g, _ = capture_graph(c.call)
            captured.append((g, c))
            pool.pop((c.coll, c.dname, c.numel, c.sym, c.inplace), None)  # its tensors are the graph's
        for j in range(graph_replays):
            if j % 100 == 0 and not all_go(time.monotonic() - t0 > time_limit_s or len(failures) > 40):
                break
            g, c = captured[rng.randrange(len(captured))]
            bad = c.check(seed * 3 + j, g.replay)
            done_graph += 1
            if bad:
                failures.append(f"rank {r}: graph replay {j}: {c.label()}: {bad}")
        del captured
    except Exception as e:  # noqa: BLE001
        failures.append(f"rank {r}: {_err(e)}")
    finally:
        _safe_close(comm)
    return {"rank": r, "eager": done_eager, "graph": done_graph, "failures": failures,
            "elapsed_s": time.monotonic() - t0, "distinct_sizes": len(shapes), "size_pool": size_pool}


def layout_refusals(w: Any) -> dict:
    """The executor refuses buffers that are not the plan's layout (an in-place plan given
    separate buffers, an out-of-place plan given overlapping ones, an in-place allgather whose
    input is not this rank's block), with InvalidCall, and runs the right layout exactly."""
    import torch

    from mscclang.algorithms.allgather import build_allgather_simple
    from mscclang.errors import InvalidCall
    from mscclang.plan.samples import allreduce_oneshot_ll

    n, r = w.world_size, w.rank
    dev = torch.device("cuda", r)
    ex = w.executor
    failures: list[str] = []
    oop = allreduce_oneshot_ll(n)
    ip = oop.model_copy(update={"inplace": True, "name": oop.name + "_ip"})
    ag = build_allgather_simple(n, 1, inplace=True)
    a = torch.ones(1024, device=dev, dtype=torch.float16)
    b = torch.ones(1024, device=dev, dtype=torch.float16)
    big = torch.ones(1024 * n, device=dev, dtype=torch.float16)
    cases = [("in-place plan, separate buffers", lambda: ex.execute(ip, a, b)),
             ("out-of-place plan, one buffer", lambda: ex.execute(oop, a, a)),
             ("out-of-place plan, overlapping", lambda: ex.execute(oop, big[:1024], big[512:1536])),
             ("in-place allgather, wrong block", lambda: ex.execute(ag, big[((r + 1) % n) * 1024:][:1024], big)),
             ("in-place allgather, separate input", lambda: ex.execute(ag, a, big))]
    for label, fn in cases:
        try:
            fn()
            ex.synchronize()
            failures.append(f"rank {r}: {label}: accepted")
        except InvalidCall:
            pass
        except Exception as e:  # noqa: BLE001
            failures.append(f"rank {r}: {label}: {type(e).__name__}: {e}")
    xs = [gen_input(3, q, 1024, torch.float16, dev) for q in range(n)]
    big.copy_(torch.zeros_like(big))
    view = big[r * 1024:(r + 1) * 1024]
    view.copy_(xs[r])
    ex.execute(ag, view, big)
    ex.synchronize()
    bad = _compare(big, torch.cat(xs))
    if bad:
        failures.append(f"rank {r}: in-place allgather: {bad}")
    return {"rank": r, "checked": 1, "failures": failures}


def library_inplace_mscclpp(folder: Path) -> list[Path]:
    """Three in-place library plans written into ``folder`` as MSCCL++ 0.9 JSON (``to_mscclpp``,
    what ``mscclang export-mscclpp`` writes), for ``mscclang import-mscclpp`` and ``run``: the
    two-step LL allreduce (rank 1 adds its own chunk at place 1, exported local first), the
    read-reduce allreduce (rsag through scratch) and a simple allgather, all at 2 ranks."""
    from mscclang.algorithms.allgather import build_allgather_simple
    from mscclang.plan import load_plan, to_mscclpp
    from tests.harness.shipped import PLANS_DIR

    plans = [load_plan(PLANS_DIR / "allreduce_twostep_ll.r2.i2.inplace.json"),
             load_plan(PLANS_DIR / "allreduce_rsag_simple.r2.i16.inplace.json"),
             build_allgather_simple(2, 1, inplace=True)]
    out = []
    for p in plans:
        f = folder / f"{p.name}.mscclpp.json"
        f.write_text(json.dumps(to_mscclpp(p)))
        out.append(f)
    return out
