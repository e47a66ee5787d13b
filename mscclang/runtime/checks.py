"""Commands run on GPU workers (see :mod:`mscclang.runtime.launch`): correctness checks against a
reference, back-to-back and CUDA-graph runs, timing, and the timeout/reset check.

Every rank generates every rank's input from the same seed on its GPU, so each rank computes the
collective's expected output itself (reductions rank by rank, 16-bit floats through fp32 each
step, exactly the executor's and the simulator's order for 2 ranks).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from mscclang.errors import CollectiveTimeout
from mscclang.plan.io import load_plan
from mscclang.plan.models import Plan

_TORCH_DTYPES = ("float16", "bfloat16", "float32", "int32")


def _dtype(name: str) -> Any:
    import torch

    return {"float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
            "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
            "f32": torch.float32, "float": torch.float32, "int32": torch.int32, "i32": torch.int32}[name]


def _bits(t: Any) -> Any:
    import torch

    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


_PLANS: dict[str, Plan] = {}


def _plan(w: Any, plan_json: str) -> Plan:
    """Plans are cached per worker by their JSON text, so the executor's caches stay warm."""
    p = _PLANS.get(plan_json)
    if p is None:
        p = load_plan(plan_json)
        _PLANS[plan_json] = p
    return p


def make_input(rank: int, nelem: int, dtype: Any, seed: int, device: Any) -> Any:
    """Deterministic random input of ``rank`` (same on every process)."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed * 1000003 + rank)
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, (nelem,), generator=g, device=device, dtype=torch.int32)
    return torch.randn(nelem, generator=g, device=device, dtype=torch.float32).to(dtype)


def reference(plan: Plan, inputs: list, reduce_op: str, rank: int) -> Any:
    """Expected output of ``rank`` on torch inputs."""
    import torch

    coll = plan.collective
    if coll == "allgather":
        return torch.cat(inputs)
    if coll != "allreduce":
        raise ValueError(f"no reference for collective {coll!r}")
    order = [rank] + [q for q in range(len(inputs)) if q != rank]
    acc = inputs[order[0]]
    for q in order[1:]:
        x = inputs[q]
        if acc.dtype == torch.int32:
            a, b = acc, x
        else:
            a, b = acc.float(), x.float()
        r = a + b if reduce_op == "sum" else (torch.minimum(a, b) if reduce_op == "min" else torch.maximum(a, b))
        acc = r.to(inputs[0].dtype)
    return acc


def _sizes(plan: Plan, nbytes: int, esize: int, world: int) -> tuple[int, int]:
    """(input elements, output elements) for a message of ``nbytes`` (input bytes; allgather: per
    rank)."""
    n_in = max(nbytes // esize, 1)
    if plan.collective == "allgather":
        return n_in, n_in * world
    return n_in, n_in


def check_plan(w: Any, plan_json: str, nbytes: int, dtype: str = "float16", packet_type: Optional[str] = None,
               reduce_op: str = "sum", seed: int = 0, inplace: bool = False, symmetric: bool = False,
               sim_max_bytes: int = 1 << 16) -> dict:
    """Run the plan once on random data and compare it bit for bit with the reference and, up to
    ``sim_max_bytes``, with the simulator's output."""
    import torch

    plan = _plan(w, plan_json)
    dt = _dtype(dtype)
    dev = torch.device(f"cuda:{w.rank}")
    esize = torch.empty((), dtype=dt).element_size()
    n_in, n_out = _sizes(plan, nbytes, esize, w.world_size)
    inputs = [make_input(q, n_in, dt, seed, dev) for q in range(w.world_size)]
    if symmetric:
        out = w.comm.alloc(n_out, dt)
        inp = w.comm.alloc(n_in, dt)
        inp.copy_(inputs[w.rank])
    else:
        out = torch.empty(n_out, dtype=dt, device=dev)
        inp = inputs[w.rank].clone()
    _bits(out).fill_(0x7F7F if esize == 2 else 0x7F7F7F7F)  # poison
    if inplace and plan.collective == "allreduce":
        out.copy_(inp)
        inp = out
    w.executor.execute(plan, inp, out, packet_type=packet_type, reduce_op=reduce_op)
    w.executor.synchronize()
    sim_bad = None
    if nbytes <= sim_max_bytes and not inplace:
        sim_bad = _compare_with_sim(plan, inputs, out, reduce_op, packet_type, w.rank)
    ref = reference(plan, inputs, reduce_op, w.rank)
    bad = int((_bits(out) != _bits(ref)).sum().item())
    first = None
    if bad:
        idx = (_bits(out) != _bits(ref)).nonzero()[0].item()
        first = (idx, float(out[idx].float().item()), float(ref[idx].float().item()))
    return {"rank": w.rank, "bad": bad + (sim_bad or 0), "ref_bad": bad, "sim_bad": sim_bad, "n": n_out,
            "first_bad": first, "kernel": w.executor.last_kernel, "spec": _spec_status(w, plan)}


def _spec_status(w: Any, plan: Plan) -> str:
    """The executor's specialised-kernel status lines for ``plan`` (for failure messages)."""
    st = getattr(w.executor, "spec_status", None)
    return "; ".join(f"{k}: {v}" for k, v in st(plan).items()) if st else ""


def set_env(w: Any, name: str, value: Optional[str]) -> bool:
    """Set (or, with None, remove) an environment variable in the worker (e.g. the specialised
    kernels' MSCCLANG_SPEC_FLAGS / MSCCLANG_SPEC_THREADS, read when a kernel is generated)."""
    import os

    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    return True


def set_specialize(w: Any, mode: str) -> str:
    """Switch the worker executor's kernel policy ('auto', 'always', 'never')."""
    w.executor.set_specialize(mode)
    return w.executor.specialize


def alternate_kernels(w: Any, plan_json: str, nbytes: int, iters: int = 64, dtype: str = "float16",
                      packet_type: Optional[str] = None, seed: int = 5) -> dict:
    """Launches that alternate between the specialised kernel and the interpreter on one context
    (same flags, scratch halves and counters), the input's sign flipped before each; every output
    checked. Ends in the 'auto' policy."""
    import torch

    plan = _plan(w, plan_json)
    dt = _dtype(dtype)
    dev = torch.device(f"cuda:{w.rank}")
    esize = torch.empty((), dtype=dt).element_size()
    n_in, n_out = _sizes(plan, nbytes, esize, w.world_size)
    inputs = [make_input(q, n_in, dt, seed, dev) for q in range(w.world_size)]
    ref = reference(plan, inputs, "sum", w.rank)
    inp = inputs[w.rank].clone()
    out = torch.empty(n_out, dtype=dt, device=dev)
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    ex = w.executor
    kinds = []
    try:
        for i in range(iters):
            ex.set_specialize("always" if i % 2 == 0 else "never")
            inp.neg_()
            ex.execute(plan, inp, out, packet_type=packet_type)
            kinds.append(ex.last_kernel)
            bad.add_((_bits(out) != _bits(ref if i % 2 else -ref)).sum())
        ex.synchronize()
    finally:
        ex.set_specialize("auto")
    return {"rank": w.rank, "bad": int(bad.item()), "kernels": sorted(set(kinds)), "launches": iters,
            "spec": _spec_status(w, plan)}


def to_numpy(t: Any) -> Any:
    """A torch tensor as numpy, bfloat16 through ml_dtypes."""
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().cpu().numpy()


def _compare_with_sim(plan: Plan, inputs: list, out: Any, reduce_op: str, packet_type: Optional[str],
                      rank: int) -> Optional[int]:
    """Wrong elements of ``out`` against the simulator's output of ``rank`` (None without one)."""
    try:
        from mscclang.sim import run as sim_run
    except ImportError:
        return None
    import numpy as np

    outs = sim_run(plan, [to_numpy(x) for x in inputs], reduce_op=reduce_op, packet_type=packet_type or "LL16",
                   output_bytes=out.numel() * out.element_size())
    got = to_numpy(out)
    a = got.view(np.int16 if got.itemsize == 2 else np.int32)
    b = np.ascontiguousarray(outs[rank]).view(a.dtype)
    return int((a != b).sum())


def back_to_back(w: Any, plan_json: str, nbytes: int, iters: int, dtype: str = "float16",
                 packet_type: Optional[str] = None, graph: bool = False, seed: int = 1) -> dict:
    """``iters`` launches (eager, or CUDA-graph replays) with the input's sign flipped before
    each, every output compared on the GPU with the expected one (sum or allgather only)."""
    import torch

    plan = _plan(w, plan_json)
    dt = _dtype(dtype)
    dev = torch.device(f"cuda:{w.rank}")
    esize = torch.empty((), dtype=dt).element_size()
    n_in, n_out = _sizes(plan, nbytes, esize, w.world_size)
    inputs = [make_input(q, n_in, dt, seed, dev) for q in range(w.world_size)]
    ref = reference(plan, inputs, "sum", w.rank)
    neg_ref = -ref
    inp = inputs[w.rank].clone()
    out = torch.empty(n_out, dtype=dt, device=dev)
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    ex = w.executor
    ex.prepare(plan, n_in * esize, n_out * esize, dt, packet_type)

    def step(expect: Any) -> None:
        inp.neg_()
        ex.execute(plan, inp, out, packet_type=packet_type)
        bad.add_((_bits(out) != _bits(expect)).sum())

    w.comm.barrier()
    if not graph:
        for i in range(iters // 2):
            step(neg_ref)
            step(ref)
        launches = iters // 2 * 2
    else:
        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(neg_ref)  # warm-up outside capture
            step(ref)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        w.comm.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(neg_ref)
            step(ref)
        torch.cuda.synchronize()
        w.comm.barrier()
        for i in range(iters // 2):
            g.replay()
        launches = 2 + iters // 2 * 2
    ex.synchronize()
    return {"rank": w.rank, "bad": int(bad.item()), "launches": launches, "kernel": ex.last_kernel,
            "spec": _spec_status(w, plan)}


def time_eager(w: Any, plan_json: str, nbytes: int, iters: int = 2000, dtype: str = "float16",
               packet_type: Optional[str] = None, cooperative: bool = False) -> dict:
    """Back-to-back wall time per eager call from Python (us)."""
    import torch

    w.executor.cooperative = cooperative
    plan = _plan(w, plan_json)
    dt = _dtype(dtype)
    dev = torch.device(f"cuda:{w.rank}")
    esize = torch.empty((), dtype=dt).element_size()
    n_in, n_out = _sizes(plan, nbytes, esize, w.world_size)
    inp = make_input(w.rank, n_in, dt, 3, dev)
    out = torch.empty(n_out, dtype=dt, device=dev)
    ex = w.executor
    for _ in range(50):
        ex.execute(plan, inp, out, packet_type=packet_type)
    ex.synchronize()
    w.comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        ex.execute(plan, inp, out, packet_type=packet_type)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    ex.check()
    return {"rank": w.rank, "us_per_call": (t1 - t0) / iters * 1e6, "kernel": ex.last_kernel}


def time_graph(w: Any, plan_json: str, nbytes: int, per_graph: int = 100, replays: int = 20,
               dtype: str = "float16", packet_type: Optional[str] = None, cooperative: bool = False,
               symmetric: bool = False) -> dict:
    """CUDA-graph time per launch (us): ``per_graph`` launches captured, replayed ``replays``
    times, timed with CUDA events (median of replays). ``symmetric``: buffers from the
    communicator (zero-copy plans then skip the staging copies). Also reports GB/s of input
    bytes per launch (``algbw_gbs``)."""
    import torch

    w.executor.cooperative = cooperative
    plan = _plan(w, plan_json)
    dt = _dtype(dtype)
    dev = torch.device(f"cuda:{w.rank}")
    esize = torch.empty((), dtype=dt).element_size()
    n_in, n_out = _sizes(plan, nbytes, esize, w.world_size)
    if symmetric:
        inp = w.comm.alloc(n_in, dt)
        inp.copy_(make_input(w.rank, n_in, dt, 4, dev))
        out = w.comm.alloc(n_out, dt)
    else:
        inp = make_input(w.rank, n_in, dt, 4, dev)
        out = torch.empty(n_out, dtype=dt, device=dev)
    ex = w.executor
    ex.prepare(plan, n_in * esize, n_out * esize, dt, packet_type)
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(5):
            ex.execute(plan, inp, out, packet_type=packet_type)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            ex.execute(plan, inp, out, packet_type=packet_type)
    torch.cuda.synchronize()
    w.comm.barrier()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        w.comm.barrier()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_graph)
    ex.check()
    times.sort()
    med = times[len(times) // 2]
    return {"rank": w.rank, "us_per_launch": round(med, 3), "min_us": round(times[0], 3),
            "algbw_gbs": round(n_in * esize / (med * 1e3), 2), "kernel": ex.last_kernel}


def timeout_and_reset(w: Any, bad_json: str, good_json: str, timeout_s: float = 1.0) -> dict:
    """Run a plan with a missing signal (expect CollectiveTimeout within the bound on every rank),
    reset, then run a correct plan correctly in the same processes."""
    import torch

    ex = w.executor
    old = ex.timeout_ns
    ex.timeout_ns = int(timeout_s * 1e9)
    bad = _plan(w, bad_json)
    dev = torch.device(f"cuda:{w.rank}")
    n = 1024
    inp = torch.ones(n, dtype=torch.float16, device=dev)
    out = torch.empty_like(inp)
    w.comm.barrier()
    t0 = time.perf_counter()
    raised = ""
    try:
        ex.execute(bad, inp, out)
        ex.synchronize()
    except CollectiveTimeout as e:
        raised = str(e)
    elapsed = time.perf_counter() - t0
    again = ""
    try:
        ex.execute(bad, inp, out)
    except CollectiveTimeout as e:
        again = str(e)
    kernel = ex.last_kernel
    ex.timeout_ns = old
    ex.reset()
    res = check_plan(w, good_json, 4096, "float16", seed=7)
    return {"rank": w.rank, "raised": raised, "raised_again": bool(again), "elapsed_s": elapsed,
            "after_reset_bad": res["bad"], "kernel": kernel, "after_reset_kernel": res["kernel"]}


def reset(w: Any) -> bool:
    """Collective reset of the worker's executor (after a failure on some rank)."""
    w.executor.reset()
    return True
