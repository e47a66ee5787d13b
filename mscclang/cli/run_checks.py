"""The commands ``mscclang run`` sends to its GPU workers (see :mod:`mscclang.runtime.workers`):
one checked launch of a plan against a reference (:func:`run_plan_check`) and its timing, eager
(:func:`time_eager`) or in a CUDA graph (:func:`time_graph`).

Every rank generates every rank's input from the same seed on its GPU, so each rank computes the
collective's expected output itself (:func:`expectation`). How the output is checked:

* ``exact``: bit for bit against a torch reference where the result does not depend on the order
  the plan reduces in: copies (allgather), int32 sums (wrap-around addition is associative),
  min/max, and any 2-rank reduction (one binary step, commutative);
* ``simulator``: bit for bit against :func:`mscclang.sim.run` (the definition of the plan's
  reduction order) up to ``sim_max_bytes``;
* ``bound``: floating-point sums over 3 or more ranks above that size: every output element
  must lie within the error bound of recursive summation in ANY order (each of the ``n - 1``
  steps adds in fp32 and rounds to the element type): ``|out - sum| <= gamma * sum|x| +
  (n - 1) * tiny`` with ``gamma = k u / (1 - k u)``, ``k = n - 1`` and ``u`` the unit roundoff
  of one step (see :data:`UNIT_ROUNDOFF`). The exact sum and the bound are computed in float64
  on the device. The plan's own order is not derived for these sizes; a missing, doubled or
  wrong contribution moves an element by about one input (~1), far more than the bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from mscclang.plan.collectives import collective as collective_row
from mscclang.plan.dtypes import SIM_DTYPES, torch_dtype, torch_dtype_info
from mscclang.plan.io import load_plan
from mscclang.plan.models import Plan
from mscclang.plan.reference import COLLECTIVES as REFERENCE_COLLECTIVES, output_blocks, output_elems, reference_output

def bits(t: Any) -> Any:
    import torch

    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


_PLANS: dict[str, Plan] = {}


def worker_plan(w: Any, plan_json: str) -> Plan:
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


#: unit roundoff of one reduction step (fp32 addition, then rounding to the element type)
UNIT_ROUNDOFF = {"float16": 2.0 ** -11 + 2.0 ** -23, "bfloat16": 2.0 ** -8 + 2.0 ** -23, "float32": 2.0 ** -24}
#: spacing of the subnormals (absolute rounding error bound of one step near zero, doubled)
_TINY = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133, "float32": 2.0 ** -149}


def _dtype_name(dt: Any) -> str:
    info = torch_dtype_info(dt)
    if info is None:
        raise ValueError(f"unknown dtype {dt}; known: {', '.join(SIM_DTYPES)}")
    return info.name


def order_free(collective: str, dtype: Any, reduce_op: str, nranks: int) -> bool:
    """Whether the collective's result is the same bits in every reduction order (so a torch
    reference in rank order is exact): copies, int32, min/max, or at most 2 contributions."""
    import torch

    return (not collective_row(collective).reduces or dtype == torch.int32
            or reduce_op in ("min", "max") or nranks <= 2)


def sum_bound(inputs: list) -> tuple[Any, Any]:
    """(exact sum, error bound) in float64 for a floating-point sum of ``inputs`` (same dtype and
    shape) in any order and association, every step rounded to the element type."""
    import torch

    k = len(inputs) - 1
    name = _dtype_name(inputs[0].dtype)
    u = UNIT_ROUNDOFF[name]
    gamma = k * u / (1.0 - k * u)
    total = torch.zeros(inputs[0].shape, dtype=torch.float64, device=inputs[0].device)
    mag = torch.zeros_like(total)
    for x in inputs:
        xd = x.double()
        total.add_(xd)
        mag.add_(xd.abs())
    return total, mag.mul_(gamma).add_(k * _TINY[name])


@dataclass
class Expected:
    """What an output must be: ``exact`` (compare bits) or ``approx`` +/- ``bound`` (float64).
    ``how`` says which ('exact', 'simulator' or 'bound')."""

    how: str
    exact: Any = None
    approx: Any = None
    bound: Any = None
    #: the output is a floating-point sum: a zero result is +0 for either sign of the inputs
    summed: bool = False

    def negated(self) -> "Expected":
        """The expectation for negated inputs (rounding to nearest is symmetric; an exact zero
        from a sum stays +0)."""
        if self.exact is not None:
            neg = -self.exact
            if self.summed and neg.dtype.is_floating_point:
                neg = torch_where_zero_positive(neg)
            return Expected(self.how, exact=neg, summed=self.summed)
        return Expected(self.how, approx=-self.approx, bound=self.bound, summed=self.summed)

    def wrong(self, out: Any) -> Any:
        """Boolean tensor: the elements of ``out`` that are not as expected (NaN is wrong)."""
        if self.exact is not None:
            if out.numel() != self.exact.numel():
                raise ValueError(f"output has {out.numel()} elements, expected {self.exact.numel()}")
            return bits(out) != bits(self.exact)
        return ~((out.double() - self.approx).abs() <= self.bound)

    def count_bad(self, out: Any) -> int:
        """Number of wrong elements of ``out``."""
        return int(self.wrong(out).sum().item())

    def first_bad(self, out: Any) -> Optional[tuple]:
        """(index, got, want) of the first wrong element, or None."""
        bad = self.wrong(out)
        if not bool(bad.any()):
            return None
        i = int(bad.nonzero()[0].item())
        want = self.exact[i] if self.exact is not None else self.approx[i]
        return (i, float(out[i].float().item()), float(want.double().item()))


def torch_where_zero_positive(t: Any) -> Any:
    """``t`` with every zero (+0 or -0) as +0."""
    return t.masked_fill(t == 0, 0)


def expectation(plan: Plan, inputs: list, reduce_op: str, rank: int, packet_type: Optional[str] = None,
                sim_max_bytes: int = 0, out_numel: Optional[int] = None) -> Expected:
    """The expected output of ``rank`` for torch ``inputs`` (one per rank): the definition
    (:func:`reference`) when the reduction order cannot matter (:func:`order_free`), else the
    simulator's output when the output is at most ``sim_max_bytes`` (the plan's own order, bit
    exact), else the sum's error bound (:func:`sum_bound`) over the elements each output element
    reduces."""
    coll = plan.collective
    summed = collective_row(coll).reduces and reduce_op == "sum" and len(inputs) > 1
    if order_free(coll, inputs[0].dtype, reduce_op, len(inputs)):
        return Expected("exact", exact=reference(plan, inputs, reduce_op, rank), summed=summed)
    n_out = output_elems(coll, len(inputs), inputs[0].numel()) if out_numel is None else out_numel
    if n_out * inputs[0].element_size() <= sim_max_bytes:
        got = sim_output(plan, inputs, reduce_op, packet_type, rank, n_out * inputs[0].element_size())
        if got is not None:
            return Expected("simulator", exact=got, summed=summed)
    (block,) = output_blocks(coll, len(inputs), rank, inputs[0].numel(), plan.root)  # one reduced block
    approx, bound = sum_bound([inputs[s][block.in_start:block.in_start + block.length] for s in block.sources])
    return Expected("bound", approx=approx, bound=bound, summed=summed)


def reference(plan: Plan, inputs: list, reduce_op: str, rank: int) -> Any:
    """Output of ``rank`` on torch ``inputs`` (one per rank) by the collective's definition
    (:func:`mscclang.plan.reference.reference_output`: reductions in rank order, floating point
    through float32 each step), as a tensor on the inputs' device: the exact expected output
    whenever :func:`order_free` holds."""
    want = reference_output(plan.collective, [to_numpy(x) for x in inputs], rank, reduce_op, plan.root)
    return from_numpy(want, inputs[0])


def worker_device(w: Any) -> Any:
    """The worker's torch device: ``w.device`` when it has one (CPU test harness), else its
    communicator's GPU (rank r's GPU is r // ranks per GPU, ``settings.ranks_per_gpu``)."""
    import torch

    dev = getattr(w, "device", None)
    if dev is not None:
        return dev
    return torch.device("cuda", int(w.comm.device))


def _sizes(plan: Plan, nbytes: int, esize: int, world: int) -> tuple[int, int]:
    """(input elements, output elements) for a message of ``nbytes`` (input bytes; allgather: per
    rank); a reducescatter or alltoall input is rounded down to a multiple of the world size."""
    n_in = max(nbytes // esize, 1)
    bi = collective_row(plan.collective).blocks(world)[0]
    n_in = max(n_in // bi, 1) * bi
    if plan.collective not in REFERENCE_COLLECTIVES:   # a test or custom collective: equal sizes
        return n_in, n_in
    return n_in, output_elems(plan.collective, world, n_in)


def check_case(w: Any, plan_json: str, nbytes: int, dtype: str, seed: int, make: Any = make_input) -> tuple:
    """What a check command starts from: (plan, torch dtype, device, element size, input and
    output element counts, every rank's input: ``make(rank, numel, dtype, seed, device)``,
    :func:`make_input` by default)."""
    import torch

    plan = worker_plan(w, plan_json)
    dt = torch_dtype(dtype)
    dev = worker_device(w)
    esize = torch.empty((), dtype=dt).element_size()
    n_in, n_out = _sizes(plan, nbytes, esize, w.world_size)
    return plan, dt, dev, esize, n_in, n_out, [make(q, n_in, dt, seed, dev) for q in range(w.world_size)]


def inplace_input(plan: Plan, out: Any, inp: Any, rank: int) -> Any:
    """The in-place layout of a call: ``inp``'s data copied to where the plan reads it inside
    ``out`` (allgather: this rank's block; the other collectives here: the whole output), and
    that view returned as the input."""
    where = collective_row(plan.collective).inplace
    if where == "input_in_output":
        k = inp.numel()
        view = out[rank * k:(rank + 1) * k]
    elif where == "same":
        view = out[:inp.numel()]
    else:
        raise ValueError(f"no in-place layout for a {plan.collective} check (allreduce and allgather only)")
    view.copy_(inp)
    return view


def call_tensors(w: Any, plan_json: str, nbytes: int, dtype: str, seed: int, symmetric: bool,
                 make: Any = make_input) -> tuple:
    """:func:`check_case` plus this rank's input (a copy of its random input) and output tensors, in
    symmetric memory (``comm.alloc``) or ordinary torch tensors."""
    import torch

    plan, dt, dev, esize, n_in, n_out, inputs = check_case(w, plan_json, nbytes, dtype, seed, make)
    if symmetric:
        out = w.comm.alloc(n_out, dt)
        inp = w.comm.alloc(n_in, dt)
        inp.copy_(inputs[w.rank])
    else:
        out = torch.empty(n_out, dtype=dt, device=dev)
        inp = inputs[w.rank].clone()
    return plan, dt, dev, esize, n_in, n_out, inputs, inp, out


def run_plan_check(w: Any, plan_json: str, nbytes: int, dtype: str = "float16", packet_type: Optional[str] = None,
               reduce_op: str = "sum", seed: int = 0, inplace: bool = False, symmetric: bool = False,
               sim_max_bytes: int = 1 << 16, make: Any = make_input) -> dict:
    """Run the plan once on random data (``make``: :func:`check_case`) and compare it bit for bit
    with the reference and, up to ``sim_max_bytes``, with the simulator's output. An in-place plan
    (or ``inplace``) runs on the in-place layout (:func:`inplace_input`)."""
    plan, dt, dev, esize, n_in, n_out, inputs, inp, out = call_tensors(w, plan_json, nbytes, dtype, seed, symmetric,
                                                                       make)
    bits(out).fill_(0x7F7F if esize == 2 else 0x7F7F7F7F)  # poison
    if inplace or plan.inplace:
        inp = inplace_input(plan, out, inp, w.rank)
    w.executor.execute(plan, inp, out, packet_type=packet_type, reduce_op=reduce_op)
    w.executor.synchronize()
    sim_bad = None
    if nbytes <= sim_max_bytes:
        sim_bad = compare_with_sim(plan, inputs, out, reduce_op, packet_type, w.rank)
    exp = expectation(plan, inputs, reduce_op, w.rank, packet_type)
    bad = exp.count_bad(out)
    first = exp.first_bad(out) if bad else None
    return {"rank": w.rank, "bad": bad + (sim_bad or 0), "ref_bad": bad, "sim_bad": sim_bad, "n": n_out,
            "ref_mode": exp.how, "first_bad": first, "kernel": w.executor.last_kernel,
            "spec": spec_status(w, plan)}


def spec_status(w: Any, plan: Plan) -> str:
    """The executor's specialised-kernel status lines for ``plan`` (for failure messages)."""
    st = getattr(w.executor, "spec_status", None)
    return "; ".join(f"{k}: {v}" for k, v in st(plan).items()) if st else ""


def to_numpy(t: Any) -> Any:
    """A torch tensor as numpy, bfloat16 through ml_dtypes."""
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().cpu().numpy()


def from_numpy(a: Any, like: Any) -> Any:
    """A numpy array as a torch tensor of ``like``'s dtype and device (bfloat16 by its bits)."""
    import numpy as np
    import torch

    a = np.ascontiguousarray(a)
    if like.dtype == torch.bfloat16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.copy())
    return t.to(like.device)


def sim_output(plan: Plan, inputs: list, reduce_op: str, packet_type: Optional[str], rank: int,
               output_bytes: int) -> Any:
    """The simulator's output of ``rank`` for torch ``inputs`` as a tensor like ``inputs[0]`` (on
    its device), or None without :mod:`mscclang.sim`."""
    try:
        from mscclang.sim import run as sim_run
    except ImportError:
        return None
    outs = sim_run(plan, [to_numpy(x) for x in inputs], reduce_op=reduce_op, packet_type=packet_type or "LL16",
                   output_bytes=output_bytes)
    return from_numpy(outs[rank], inputs[0])


def compare_with_sim(plan: Plan, inputs: list, out: Any, reduce_op: str, packet_type: Optional[str],
                      rank: int) -> Optional[int]:
    """Wrong elements of ``out`` against the simulator's output of ``rank`` (None without one)."""
    want = sim_output(plan, inputs, reduce_op, packet_type, rank, out.numel() * out.element_size())
    if want is None:
        return None
    return Expected("simulator", exact=want).count_bad(out)


def _timing_tensors(w: Any, plan_json: str, nbytes: int, dtype: str, cooperative: bool, symmetric: bool,
                    seed: int) -> tuple:
    """What a timing command runs on: the plan and its input and output tensors (from the
    communicator when ``symmetric``; the in-place layout for an in-place plan)."""
    import torch

    w.executor.cooperative = cooperative
    plan = worker_plan(w, plan_json)
    dt = torch_dtype(dtype)
    dev = worker_device(w)
    n_in, n_out = _sizes(plan, nbytes, torch.empty((), dtype=dt).element_size(), w.world_size)
    if symmetric:
        inp = w.comm.alloc(n_in, dt)
        inp.copy_(make_input(w.rank, n_in, dt, seed, dev))
        out = w.comm.alloc(n_out, dt)
    else:
        inp = make_input(w.rank, n_in, dt, seed, dev)
        out = torch.empty(n_out, dtype=dt, device=dev)
    if plan.inplace:
        inp = inplace_input(plan, out, inp, w.rank)
    return plan, inp, out


def time_eager(w: Any, plan_json: str, nbytes: int, iters: int = 2000, dtype: str = "float16",
               packet_type: Optional[str] = None, cooperative: bool = False) -> dict:
    """Back-to-back wall time per eager call from Python (us)."""
    import torch

    plan, inp, out = _timing_tensors(w, plan_json, nbytes, dtype, cooperative, False, 3)
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

    plan, inp, out = _timing_tensors(w, plan_json, nbytes, dtype, cooperative, symmetric, 4)
    dev = worker_device(w)
    ex = w.executor
    ex.prepare(plan, inp, out, packet_type=packet_type)
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
    from mscclang.bench.worker import timed_blocks

    times = timed_blocks(g.replay, per_graph, replays, w.comm.barrier)
    ex.check()
    times.sort()
    med = times[len(times) // 2]
    return {"rank": w.rank, "us_per_launch": round(med, 3), "min_us": round(times[0], 3),
            "algbw_gbs": round(inp.numel() * inp.element_size() / (med * 1e3), 2), "kernel": ex.last_kernel}




def trace_plan(w: Any, plan_json: str, nbytes: int, dtype: str = "float16", packet_type: Optional[str] = None,
               reduce_op: str = "sum", seed: int = 5, reps: int = 20) -> dict:
    """One traced launch of the plan on random data (after an untraced one, so that set-up is
    not traced), its output checked like :func:`run_plan_check`'s; then the cost of tracing:
    the median wall time of ``reps`` traced calls (with the trace buffer's allocation and read
    back) against ``reps`` untraced calls each waited for (``reps`` 0: not timed). This rank's trace events, their
    global-timer start and the launch's departures from the plan's op order come back."""
    plan, dt, dev, esize, n_in, n_out, inputs, inp, out = call_tensors(w, plan_json, nbytes, dtype, seed, False)
    if plan.inplace:
        inp = inplace_input(plan, out, inp, w.rank)
    ex = w.executor
    ex.execute(plan, inp, out, packet_type=packet_type, reduce_op=reduce_op)
    ex.synchronize()
    if plan.inplace:   # the untraced call overwrote the input: lay it out again
        inp = inplace_input(plan, out, inputs[w.rank].clone(), w.rank)
    else:
        bits(out).fill_(0x7F7F if esize == 2 else 0x7F7F7F7F)  # poison
    w.comm.barrier()
    rt = ex.execute_traced(plan, inp, out, packet_type=packet_type, reduce_op=reduce_op)
    exp = expectation(plan, inputs, reduce_op, w.rank, packet_type)
    bad = exp.count_bad(out)

    def median_us(call: Any) -> float:
        ts = []
        for _ in range(reps):
            w.comm.barrier()
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2] * 1e6

    def untraced() -> None:
        ex.execute(plan, inp, out, packet_type=packet_type, reduce_op=reduce_op)
        ex.synchronize()

    traced_us = plain_us = None
    if reps > 0:   # reps 0: the trace and its check only
        traced_us = round(median_us(lambda: ex.execute_traced(plan, inp, out, packet_type=packet_type,
                                                              reduce_op=reduce_op)), 2)
        plain_us = round(median_us(untraced), 2)
    ex.check()
    return {"rank": w.rank, "t0_ns": rt.t0_ns, "events": rt.events, "problems": rt.problems, "bad": bad,
            "ref_mode": exp.how, "traced_us": traced_us, "untraced_us": plain_us}
