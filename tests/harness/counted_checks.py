"""GPU-test commands for plans with segments (data-dependent counts), run on every rank of the
worker pool: the library's all-to-all-v plans through ``Executor.execute_counted`` with random
count matrices against a numpy reference, CUDA-graph replays with new counts written into the
count matrix between replays, and counts a check refuses (CountsError on every rank, then a
reset and a correct run). Every rank draws the same matrices and inputs from the same seed."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mscclang.cli.run_checks import worker_device, worker_plan
from mscclang.errors import CollectiveTimeout, CountsError
from mscclang.plan.models import BufferKind
from mscclang.runtime.counted import CountedLaunch, matrix


def _counts(rng: np.random.Generator, n: int, max_rows: int) -> list[list[int]]:
    """A skewed matrix: most entries small, some zero, a few at ``max_rows``."""
    m = rng.choice([0, 1, 2, max_rows // 2, max_rows], size=(n, n), p=[0.2, 0.3, 0.2, 0.2, 0.1])
    return [[int(v) for v in row] for row in m]


def _inputs(seed: int, n: int, rows: int, words: int) -> list[np.ndarray]:
    """Every rank's input, ``rows`` rows of ``words`` int32 (the same on every rank's host)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-2**31, 2**31 - 1, size=(rows, words), dtype=np.int32) for _ in range(n)]


def _expected(counts: list[list[int]], inputs: list[np.ndarray], r: int) -> np.ndarray:
    """Rank ``r``'s output rows: for each rank ``p`` in order, the rows ``p`` sent to ``r``."""
    parts = [inputs[p][sum(counts[p][:r]):sum(counts[p][:r + 1])] for p in range(len(counts))]
    return np.concatenate(parts)


class _Call:
    """One rank's tensors of a counted plan: the count matrix (device, fixed address), input and
    output (symmetric for zero-copy plans) of ``n * max_rows`` rows each."""

    def __init__(self, w: Any, plan_json: str, row_bytes: int, max_rows: int) -> None:
        import torch

        self.w, self.plan = w, worker_plan(w, plan_json)
        self.n = n = len(self.plan.gpus)
        self.dev = worker_device(w)
        self.row_bytes, self.max_rows, self.rows = row_bytes, max_rows, n * max_rows
        self.words = row_bytes // 4
        self.m = torch.full((n, 2 * n + 2), -1, dtype=torch.int32, device=self.dev)
        numel = self.rows * self.words
        zero_copy = any(rb.type != BufferKind.scratch for g in self.plan.gpus for rb in g.remote_buffers)
        if zero_copy:
            self.inp = w.comm.alloc(numel, dtype=torch.int32)
            self.out = w.comm.alloc(numel, dtype=torch.int32)
        else:
            self.inp = torch.zeros(numel, dtype=torch.int32, device=self.dev)
            self.out = torch.zeros(numel, dtype=torch.int32, device=self.dev)
        self.launch = CountedLaunch(self.m.data_ptr(), row_bytes, max_rows, self.rows, self.rows)

    def write(self, counts: list[list[int]], inputs: list[np.ndarray], expect: Any = None) -> None:
        """The count matrix, this rank's input and a zeroed output, finished before it returns (a
        zero-copy peer writes into the output once every rank met)."""
        import torch

        full = [self.rows] * self.n
        self.m.copy_(torch.tensor(matrix(counts, full, full, expect), dtype=torch.int32))
        self.inp.view(self.rows, self.words).copy_(torch.from_numpy(inputs[self.w.rank]))
        self.out.fill_(0)
        torch.cuda.synchronize()

    def run(self) -> None:
        self.w.executor.execute_counted(self.plan, self.inp, self.out, self.launch)

    def bad(self, counts: list[list[int]], inputs: list[np.ndarray]) -> int:
        """Wrong int32 words of this rank's received rows (and any word written past them)."""
        want = _expected(counts, inputs, self.w.rank)
        got = self.out.view(self.rows, self.words).cpu().numpy()
        k = len(want)
        return int((got[:k] != want).sum()) + int((got[k:] != 0).sum())


def alltoallv_random(w: Any, plan_json: str, row_bytes: int = 48, max_rows: int = 16, cases: int = 20,
                     seed: int = 0) -> dict:
    """``cases`` random count matrices, each launched once and checked."""
    c = _Call(w, plan_json, row_bytes, max_rows)
    rng = np.random.default_rng(seed)
    bad = 0
    for k in range(cases):
        counts = _counts(rng, c.n, max_rows)
        inputs = _inputs(seed * 1000 + k, c.n, c.rows, c.words)
        c.write(counts, inputs)
        w.comm.barrier()
        c.run()
        w.executor.synchronize()
        bad += c.bad(counts, inputs)
    return {"rank": w.rank, "bad": bad, "kernel": w.executor.last_kernel}


def alltoallv_graph(w: Any, plan_json: str, row_bytes: int = 48, max_rows: int = 16, replays: int = 100,
                    seed: int = 1) -> dict:
    """One launch captured in a CUDA graph (after an eager launch sets it up), replayed
    ``replays`` times with a new count matrix and new inputs written before each replay."""
    import torch

    c = _Call(w, plan_json, row_bytes, max_rows)
    rng = np.random.default_rng(seed)
    counts = _counts(rng, c.n, max_rows)
    inputs = _inputs(seed, c.n, c.rows, c.words)
    c.write(counts, inputs)
    c.run()
    w.executor.synchronize()
    g, _ = _captured(c.dev, c.run)   # no host synchronisation inside the captured launch
    torch.cuda.synchronize()
    bad = 0
    for k in range(replays):
        counts = _counts(rng, c.n, max_rows)
        inputs = _inputs(seed * 1000 + k, c.n, c.rows, c.words)
        c.write(counts, inputs)
        w.comm.barrier()
        g.replay()
        torch.cuda.synchronize()
        w.executor.check()
        bad += c.bad(counts, inputs)
    return {"rank": w.rank, "bad": bad, "replays": replays}


def alltoallv_bad_counts(w: Any, plan_json: str, how: str, row_bytes: int = 48, max_rows: int = 16,
                         timeout_s: float = 2.0) -> dict:
    """Counts a check refuses (``how``: 'capacity' one entry over the slot capacity, 'rows' one
    entry over the buffers' rows, 'negative' one entry below zero, 'expect' a rank expecting other rows than sent):
    the launch raises CountsError (never a timeout, never a hang); then a reset and a good run."""
    ex = w.executor
    old = ex.timeout_ns
    ex.timeout_ns = int(timeout_s * 1e9)
    c = _Call(w, plan_json, row_bytes, max_rows)
    n = c.n
    counts = [[1] * n for _ in range(n)]
    expect = None
    if how == "capacity":
        counts[n - 1][0] = max_rows + 1
    elif how == "rows":
        counts[n - 1][0] = c.rows + 1
    elif how == "negative":
        counts[0][n - 1] = -3
    else:
        expect = [[-1] * n for _ in range(n)]
        expect[0][n - 1] = counts[n - 1][0] + 1
    inputs = _inputs(3, n, c.rows, c.words)
    c.write(counts, inputs, expect)
    w.comm.barrier()
    t0 = time.perf_counter()
    raised, kind = "", ""
    try:
        c.run()
        ex.synchronize()
        ex.check()
    except (CountsError, CollectiveTimeout) as e:
        raised, kind = str(e), type(e).__name__
    elapsed = time.perf_counter() - t0
    untouched = int((c.out != 0).sum().item())
    ex.timeout_ns = old
    ex.reset()
    good = [[2] * n for _ in range(n)]
    c.write(good, inputs)
    w.comm.barrier()
    c.run()
    ex.synchronize()
    return {"rank": w.rank, "raised": raised, "kind": kind, "elapsed_s": elapsed, "written": untouched,
            "after_reset_bad": c.bad(good, inputs)}


def _captured(dev: Any, body: Any) -> tuple[Any, Any]:
    """``body()`` captured in a CUDA graph on a side stream with ``torch.cuda.set_sync_debug_mode
    ("error")`` (a host synchronisation inside it raises); the graph and what ``body`` returned."""
    import torch

    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(g, stream=s):
            got = body()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return g, got


def communicator_alltoallv(w: Any, replays: int = 100, rows_per_peer: int = 6, width: int = 24,
                           seed: int = 3) -> dict:
    """``Communicator.all_to_all_v`` on ordinary tensors, as a user calls it: eager with and
    without ``out`` against torch, then one call (count exchange and plan) captured in a CUDA
    graph under ``torch.cuda.set_sync_debug_mode("error")`` (no host synchronisation in the
    captured call) and replayed ``replays`` times with new send counts and inputs written into
    the captured tensors: every rank's bytes compared after each replay."""
    import torch

    from tests.harness.comm_checks import communicator

    comm = communicator(w)
    n, r = w.world_size, w.rank
    dev = torch.device("cuda", int(w.comm.device))
    cap = n * rows_per_peer
    gen = np.random.default_rng(seed)

    def draw(k: int) -> tuple[list[list[int]], list[Any]]:
        m = gen.integers(0, rows_per_peer + 1, size=(n, n)).tolist()
        xs = [torch.randn(cap, width, generator=torch.Generator().manual_seed(1000 * k + p)).to(torch.bfloat16)
              for p in range(n)]
        return m, xs

    def want(m: list[list[int]], xs: list[Any]) -> Any:
        return torch.cat([xs[p][sum(m[p][:r]): sum(m[p][: r + 1])] for p in range(n)])

    bad = 0
    m, xs = draw(0)
    x = xs[r].to(dev)
    send = torch.tensor(m[r], dtype=torch.int32, device=dev)
    got, recv = comm.all_to_all_v(x, send)                      # sized on the host
    bad += int(not torch.equal(got.cpu().view(torch.int16), want(m, xs).view(torch.int16)))
    out = torch.zeros(cap, width, dtype=torch.bfloat16, device=dev)
    comm.all_to_all_v(x, send, out=out)                         # sets the plan up before the capture
    g, (_, recv) = _captured(dev, lambda: comm.all_to_all_v(x, send, out=out))
    plan = comm.last_all_to_all_v
    for k in range(1, replays + 1):
        m, xs = draw(k)
        x.copy_(xs[r].to(dev))
        send.copy_(torch.tensor(m[r], dtype=torch.int32))
        torch.cuda.synchronize(dev)
        w.comm.barrier()
        g.replay()
        torch.cuda.synchronize(dev)
        w.executor.check()
        w_ = want(m, xs)
        ok = torch.equal(out[: len(w_)].cpu().view(torch.int16), w_.view(torch.int16))
        ok = ok and recv.cpu().tolist() == [m[p][r] for p in range(n)]
        bad += int(not ok)
    return {"rank": r, "bad": bad, "replays": replays, "plan": plan}


def communicator_moe(w: Any, replays: int = 100, tokens: int = 8, hidden: int = 32, k: int = 2,
                     seed: int = 5) -> dict:
    """``moe_dispatch`` then ``moe_combine`` (an identity-times-rank expert) captured in one CUDA
    graph under ``torch.cuda.set_sync_debug_mode("error")`` and replayed ``replays`` times with
    new tokens and routing written into the captured tensors; each replay's expert rows, counts
    and combined tokens compared with a reference computed on this rank from every rank's
    (seeded) tokens and routing."""
    import torch

    from tests.harness.comm_checks import communicator

    comm = communicator(w)
    n, r = w.world_size, w.rank
    E = 2 * n
    L = E // n
    C = n * tokens * k
    dev = torch.device("cuda", int(w.comm.device))

    def draw(step: int, p: int) -> tuple[Any, Any, Any]:
        g = torch.Generator().manual_seed(seed * 10000 + step * 100 + p)
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
        idx[torch.rand(tokens, k, generator=g) < 0.2] = -1
        wt = torch.rand(tokens, k, generator=g)
        return x, idx, wt

    def reference(step: int) -> tuple[Any, list, Any]:
        every = [draw(step, p) for p in range(n)]
        rows, counts = [], []
        for l in range(L):
            e = r * L + l
            mine = [every[p][0][t] for p in range(n) for t in range(tokens) for j in range(k)
                    if int(every[p][1][t, j]) == e]
            counts.append(len(mine))
            rows.append(torch.stack(mine) if mine else torch.zeros(0, hidden, dtype=torch.bfloat16))
        x, idx, wt = every[r]
        acc = torch.zeros(tokens, hidden)
        for j in range(k):
            for t in range(tokens):
                e = int(idx[t, j])
                if e >= 0:
                    acc[t] += wt[t, j] * (x[t].float() * (e // L + 1)).to(torch.bfloat16).float()
        return rows, counts, acc.to(torch.bfloat16)

    x, idx, wt = (t.to(dev) for t in draw(0, r))
    scale = float(r + 1)

    def layer() -> tuple[Any, Any, Any]:
        ex, cnt, h = comm.moe_dispatch(x, idx, E, capacity=C, check=False)
        return ex, cnt, comm.moe_combine((ex.float() * scale).to(ex.dtype), wt, h)

    layer()
    g, (ex, cnt, y) = _captured(dev, layer)
    bad = 0
    for step in range(1, replays + 1):
        for t, v in zip((x, idx, wt), draw(step, r)):
            t.copy_(v.to(dev))
        torch.cuda.synchronize(dev)
        w.comm.barrier()
        g.replay()
        torch.cuda.synchronize(dev)
        w.executor.check()
        rows, counts, want = reference(step)
        ok = cnt.cpu().tolist() == counts
        ok = ok and all(torch.equal(ex[l, :c].cpu().view(torch.int16), rows[l].view(torch.int16))
                        for l, c in enumerate(counts))
        ok = ok and torch.equal(y.cpu().view(torch.int16), want.view(torch.int16))
        bad += int(not ok)
    return {"rank": r, "bad": bad, "replays": replays}


def moe_batch_invariance(w: Any, batches: tuple = (1, 5, 33, 512), hidden: int = 64, k: int = 2, seed: int = 9) -> dict:
    """Token 0 (the same row, experts and weights on every batch) dispatched and combined within
    batches of ``batches`` tokens, eager in the expert-major layout and captured in a CUDA graph
    in the rank-major one: its combined bits on this rank must be the same in every batch and
    layout. Returns the batches whose token 0 differed from the first (``differ``), empty when
    invariant."""
    import torch

    from tests.harness.comm_checks import communicator

    comm = communicator(w)
    n, r = w.world_size, w.rank
    E = 2 * n
    dev = torch.device("cuda", int(w.comm.device))
    first, differ = None, []
    for T in batches:
        g = torch.Generator().manual_seed(seed * 1000 + T * 10 + r)
        x = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        wt = torch.rand(T, k, generator=g)
        g0 = torch.Generator().manual_seed(seed + r)
        x[0] = torch.randn(hidden, generator=g0).to(torch.bfloat16)
        idx[0] = torch.tensor([0, E - 1])
        wt[0] = torch.tensor([0.3, 0.7])
        x, idx, wt = x.to(dev), idx.to(dev), wt.to(dev)
        C = n * T * k
        for layout in ("expert", "rank"):
            def layer() -> Any:
                ex, _, h = comm.moe_dispatch(x, idx, E, capacity=C, check=False, layout=layout)
                return comm.moe_combine((ex.float() * (r + 1)).to(ex.dtype), wt, h)

            if layout == "expert":
                y = layer()
            else:
                layer()
                graph, y = _captured(dev, layer)
                w.comm.barrier()
                graph.replay()
            torch.cuda.synchronize(dev)
            w.executor.check()
            y0 = y[0].cpu().view(torch.int16)
            if first is None:
                first = y0
            elif not torch.equal(first, y0):
                differ.append((T, layout))
    return {"rank": r, "differ": differ}


def communicator_alltoallv_traced(w: Any, rows_per_peer: int = 5, width: int = 16, seed: int = 4) -> dict:
    """``Communicator.all_to_all_v`` inside ``comm.trace()``: the result still exact, and every
    count entry a segment op's event names holds the rows of the call's matrix, its bytes those
    rows' (``rows_ok``); the calls traced, the problems and what was skipped."""
    import torch

    from tests.harness.comm_checks import communicator

    comm = communicator(w)
    n, r = w.world_size, w.rank
    dev = torch.device("cuda", int(w.comm.device))
    m = np.random.default_rng(seed).integers(0, rows_per_peer + 1, size=(n, n)).tolist()
    xs = [torch.randn(n * rows_per_peer, width, generator=torch.Generator().manual_seed(p)).to(torch.bfloat16)
          for p in range(n)]
    x = xs[r].to(dev)
    send = torch.tensor(m[r], dtype=torch.int32, device=dev)
    out = torch.zeros(n * rows_per_peer, width, dtype=torch.bfloat16, device=dev)
    with comm.trace() as tr:
        comm.all_to_all_v(x, send, out=out)
    torch.cuda.synchronize(dev)
    want = torch.cat([xs[p][sum(m[p][:r]): sum(m[p][: r + 1])] for p in range(n)])
    exact = torch.equal(out[: len(want)].cpu().view(torch.int16), want.view(torch.int16))
    seg = [e["args"] for e in tr.events if "rows" in e["args"]]
    named = []   # ((i, j), rows) of every segment an event names
    for a in seg:
        for part in a["segments"].split():
            key, _, v = part.partition("=")
            i, j = (int(t) for t in key.strip("[]").split(","))
            named.append(((i, j), int(v)))
    rows_ok = (bool(named) and all(v == m[i][j] for (i, j), v in named)
               and all(a["bytes"] == a["rows"] * width * 2 for a in seg))
    return {"rank": r, "exact": exact, "calls": [c.collective for c in tr.calls], "segment_events": len(seg),
            "rows_ok": rows_ok,
            "problems": tr.problems, "skipped": tr.skipped}


def moe_cases(w: Any, hidden: int = 64) -> dict:
    """``moe_dispatch`` and ``moe_combine`` eager on ordinary tensors, as a user calls them, for
    the routings of the simulator tests (random with dropped slots, an expert that gets no token,
    one expert that takes every token, T = 1, capacity up to every token of every rank), each
    rank's expert rows, counts and combined tokens compared bit for bit with the one-process
    reference; the FP8 payload's rows and scales; then the bad inputs, each refused on every rank
    in one line, and a correct call after them. Returns the cases that differed (``bad``) and the
    refusals' messages (``refused``)."""
    import torch

    from mscclang.comm.moe import quantize_rows
    from mscclang.errors import InvalidCall
    from tests.harness.comm_checks import communicator
    from tests.harness.moe_ref import expert_fn, ref_combine, ref_dispatch, routing, tokens

    comm = communicator(w)
    n, r = w.world_size, w.rank
    dev = torch.device("cuda", int(w.comm.device))
    bad: list[str] = []
    for kind, T in (("random", 5), ("an expert gets nothing", 3), ("one expert takes all", 4), ("random", 1)):
        E, k = 2 * n, 2
        C = n * T * k
        idxs, toks = routing(kind, n, T, k, E, n + T), tokens(n, T, n, hidden)
        ws = [torch.rand(T, k, generator=torch.Generator().manual_seed(50 + p)) for p in range(n)]
        ex, counts, h = comm.moe_dispatch(toks[r].to(dev), idxs[r].to(dev), E, capacity=C)
        y = comm.moe_combine(expert_fn(ex, r), ws[r].to(dev), h).cpu()
        want, want_counts = ref_dispatch(toks, idxs, E, n, C, r)
        ok = counts.cpu().tolist() == want_counts and all(
            torch.equal(ex[l, :c].cpu().view(torch.int16), want[l, :c].view(torch.int16)) for l, c in enumerate(want_counts))
        if not (ok and torch.equal(y.view(torch.int16), ref_combine(toks, idxs, ws, n, E, r).view(torch.int16))):
            bad.append(f"{kind}, T={T}")
    E, k, T = 2 * n, 2, 4
    C = n * T * k
    idxs = routing("random", n, T, k, E, 11)
    toks = [t.float() * (p + 1) for p, t in enumerate(tokens(n, T, 4, hidden))]
    (q, scale), counts, _ = comm.moe_dispatch(toks[r].to(dev), idxs[r].to(dev), E, capacity=C, fp8=True)
    want, want_counts = ref_dispatch([quantize_rows(t) for t in toks], idxs, E, n, C, r)
    same_counts = counts.cpu().tolist() == want_counts
    if not same_counts:
        bad.append(f"fp8 counts {counts.cpu().tolist()} != {want_counts}")
    for l, c in enumerate(want_counts if same_counts else []):
        if not torch.equal(q[l, :c].cpu().view(torch.uint8), want[l, :c, :hidden]):
            bad.append(f"fp8 payload: expert {l}'s fp8 rows differ")
        if not torch.equal(scale[l, :c].cpu().view(torch.uint8).reshape(c, 4), want[l, :c, hidden:]):
            bad.append(f"fp8 payload: expert {l}'s scales differ")
    refused = []
    x = torch.ones(3, hidden, dtype=torch.bfloat16, device=dev)
    ids = lambda rows: torch.tensor(rows, device=dev)  # noqa: E731
    for args, kw in (((x, ids([[0, 1], [2, 2 * n], [1, 1]]), 2 * n), {"capacity": 8}),     # an id out of range
                     ((x, ids([[0, 1], [0, 1], [0, 1]]), 2 * n), {"capacity": 2}),        # expert 0 over capacity
                     ((x, torch.zeros(3, 2 * n + 1, dtype=torch.int64, device=dev), 2 * n), {"capacity": 8}),
                     ((x, torch.zeros(2, 2, dtype=torch.int64, device=dev), 2 * n), {"capacity": 8})):
        try:
            comm.moe_dispatch(*args, **kw)
            refused.append("")
        except InvalidCall as e:
            refused.append(str(e).splitlines()[0])
    ex, counts, h = comm.moe_dispatch(x, ids([[0, 1]] * 3), 2 * n, capacity=3 * n)   # usable afterwards
    if counts.cpu().tolist()[:1] != ([3 * n] if r == 0 else [0]):
        bad.append("the call after the refusals")
    torch.cuda.synchronize(dev)
    w.executor.check()
    return {"rank": r, "bad": bad, "refused": refused}
