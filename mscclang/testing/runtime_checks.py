"""Commands run on GPU workers (see :mod:`mscclang.runtime.launch`): correctness checks against a
reference, back-to-back and CUDA-graph runs, timing, and the timeout/reset check.

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
from typing import Any, Callable, Optional

from mscclang.errors import CollectiveTimeout
from mscclang.plan.dtypes import SIM_DTYPES, torch_dtype, torch_dtype_info
from mscclang.plan.io import load_plan
from mscclang.plan.models import Plan

_TORCH_DTYPES = ("float16", "bfloat16", "float32", "int32")


def _dtype(name: str) -> Any:
    return torch_dtype(name)


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

    return (collective not in ("allreduce", "reducescatter") or dtype == torch.int32
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
            return _bits(out) != _bits(self.exact)
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
    """The expected output of ``rank`` for torch ``inputs`` (one per rank): exact in rank order
    when the order cannot matter (:func:`order_free`), else the simulator's output when the
    output is at most ``sim_max_bytes`` (the plan's own order, bit exact), else the sum's error
    bound (:func:`sum_bound`)."""
    coll = plan.collective
    summed = coll == "allreduce" and reduce_op == "sum" and len(inputs) > 1
    if order_free(coll, inputs[0].dtype, reduce_op, len(inputs)):
        return Expected("exact", exact=reference(plan, inputs, reduce_op, rank), summed=summed)
    if coll != "allreduce":
        raise ValueError(f"no reference for collective {coll!r}")
    n_out = inputs[0].numel() if out_numel is None else out_numel
    if n_out * inputs[0].element_size() <= sim_max_bytes:
        got = sim_output(plan, inputs, reduce_op, packet_type, rank, n_out * inputs[0].element_size())
        if got is not None:
            return Expected("simulator", exact=got, summed=summed)
    approx, bound = sum_bound(inputs)
    return Expected("bound", approx=approx, bound=bound, summed=summed)


def reference(plan: Plan, inputs: list, reduce_op: str, rank: int) -> Any:
    """Output of ``rank`` on torch inputs, reduced in the order rank, rank+1, ... (16-bit floats
    through fp32 each step): the exact expected output whenever :func:`order_free` holds."""
    import torch

    coll = plan.collective
    if coll == "allgather":
        return torch.cat(inputs)
    if coll != "allreduce":
        raise ValueError(f"no reference for collective {coll!r}")
    order = [(rank + i) % len(inputs) for i in range(len(inputs))]
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


def _device(w: Any) -> Any:
    """The worker's torch device: ``w.device`` when it has one (CPU test harness), else its
    communicator's GPU (rank r's GPU is r // ranks per GPU, see :func:`~mscclang.runtime.launch.ranks_per_gpu`)."""
    import torch

    dev = getattr(w, "device", None)
    if dev is not None:
        return dev
    return torch.device("cuda", int(w.comm.device))


def _sizes(plan: Plan, nbytes: int, esize: int, world: int) -> tuple[int, int]:
    """(input elements, output elements) for a message of ``nbytes`` (input bytes; allgather: per
    rank)."""
    n_in = max(nbytes // esize, 1)
    if plan.collective == "allgather":
        return n_in, n_in * world
    return n_in, n_in


def _case(w: Any, plan_json: str, nbytes: int, dtype: str, seed: int) -> tuple:
    """What a check command starts from: (plan, torch dtype, device, element size, input and
    output element counts, every rank's input)."""
    import torch

    plan = _plan(w, plan_json)
    dt = _dtype(dtype)
    dev = _device(w)
    esize = torch.empty((), dtype=dt).element_size()
    n_in, n_out = _sizes(plan, nbytes, esize, w.world_size)
    return plan, dt, dev, esize, n_in, n_out, [make_input(q, n_in, dt, seed, dev) for q in range(w.world_size)]


def inplace_input(plan: Plan, out: Any, inp: Any, rank: int) -> Any:
    """The in-place layout of a call: ``inp``'s data copied to where the plan reads it inside
    ``out`` (allgather: this rank's block; the other collectives here: the whole output), and
    that view returned as the input."""
    if plan.collective == "allgather":
        k = inp.numel()
        view = out[rank * k:(rank + 1) * k]
    elif plan.collective in ("allreduce", "alltoall", "sendrecv", "broadcast"):
        view = out[:inp.numel()]
    else:
        raise ValueError(f"no in-place layout for a {plan.collective} check (allreduce and allgather only)")
    view.copy_(inp)
    return view


def call_tensors(w: Any, plan_json: str, nbytes: int, dtype: str, seed: int, symmetric: bool) -> tuple:
    """:func:`_case` plus this rank's input (a copy of its random input) and output tensors, in
    symmetric memory (``comm.alloc``) or ordinary torch tensors."""
    import torch

    plan, dt, dev, esize, n_in, n_out, inputs = _case(w, plan_json, nbytes, dtype, seed)
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
               sim_max_bytes: int = 1 << 16) -> dict:
    """Run the plan once on random data and compare it bit for bit with the reference and, up to
    ``sim_max_bytes``, with the simulator's output. An in-place plan (or ``inplace``) runs on the
    in-place layout (:func:`inplace_input`)."""
    plan, dt, dev, esize, n_in, n_out, inputs, inp, out = call_tensors(w, plan_json, nbytes, dtype, seed, symmetric)
    _bits(out).fill_(0x7F7F if esize == 2 else 0x7F7F7F7F)  # poison
    if inplace or plan.inplace:
        inp = inplace_input(plan, out, inp, w.rank)
    w.executor.execute(plan, inp, out, packet_type=packet_type, reduce_op=reduce_op)
    w.executor.synchronize()
    sim_bad = None
    if nbytes <= sim_max_bytes:
        sim_bad = _compare_with_sim(plan, inputs, out, reduce_op, packet_type, w.rank)
    exp = expectation(plan, inputs, reduce_op, w.rank, packet_type)
    bad = exp.count_bad(out)
    first = exp.first_bad(out) if bad else None
    return {"rank": w.rank, "bad": bad + (sim_bad or 0), "ref_bad": bad, "sim_bad": sim_bad, "n": n_out,
            "ref_mode": exp.how, "first_bad": first, "kernel": w.executor.last_kernel,
            "spec": _spec_status(w, plan)}


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


def _sign_flip_setup(w: Any, plan_json: str, nbytes: int, dtype: str, packet_type: Optional[str],
                     seed: int, sim_max_bytes: int) -> tuple:
    """Common set-up of the sign-flipping repeat checks: (plan, dtype, element size, input and
    output element counts, this rank's input copy, output, bad-element counter, expected output
    and its negation)."""
    import torch

    plan, dt, dev, esize, n_in, n_out, inputs = _case(w, plan_json, nbytes, dtype, seed)
    exp = expectation(plan, inputs, "sum", w.rank, packet_type, sim_max_bytes, n_out)
    inp = inputs[w.rank].clone()
    out = torch.empty(n_out, dtype=dt, device=dev)
    if plan.inplace:
        inp = _Flipping(inplace_input(plan, out, inp, w.rank))
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    return plan, dt, esize, n_in, n_out, inp, out, bad, exp, exp.negated()


class _Flipping:
    """The input of an in-place plan for the sign-flipping checks: the launch overwrites the
    input's place with the output, so each flip rewrites it from a kept copy."""

    def __init__(self, view: Any) -> None:
        self.view = view
        self.base = view.clone()

    def neg_(self) -> None:
        self.base.neg_()
        self.view.copy_(self.base)


def _arg(t: Any) -> Any:
    """The tensor a check passes to the executor (the view of a :class:`_Flipping`)."""
    return t.view if isinstance(t, _Flipping) else t


def _sign_flip_runs(ex: Any, plan: Plan, inp: Any, out: Any, bad: Any, exp: Any, neg: Any, iters: int,
                    packet_type: Optional[str], policy: Optional[Callable[[int], str]] = None) -> list[str]:
    """``iters`` launches of ``plan``, the input's sign flipped before each and every output
    checked into ``bad``; ``policy(i)`` (if given) sets the kernel policy of launch ``i``. Returns
    the kernel of each launch."""
    kinds = []
    for i in range(iters):
        if policy is not None:
            ex.set_specialize(policy(i))
        inp.neg_()
        ex.execute(plan, _arg(inp), out, packet_type=packet_type)
        kinds.append(ex.last_kernel)
        bad.add_((neg if i % 2 == 0 else exp).wrong(out).sum())
    ex.synchronize()
    return kinds


def alternate_kernels(w: Any, plan_json: str, nbytes: int, iters: int = 64, dtype: str = "float16",
                      packet_type: Optional[str] = None, seed: int = 5, sim_max_bytes: int = 1 << 16) -> dict:
    """Launches that alternate between the specialised kernel and the interpreter on one context
    (same flags, scratch halves and counters), the input's sign flipped before each; every output
    checked. Ends in the 'auto' policy."""
    plan, dt, esize, n_in, n_out, inp, out, bad, exp, neg = _sign_flip_setup(
        w, plan_json, nbytes, dtype, packet_type, seed, sim_max_bytes)
    try:
        kinds = _sign_flip_runs(w.executor, plan, inp, out, bad, exp, neg, iters, packet_type,
                                lambda i: "always" if i % 2 == 0 else "never")
    finally:
        w.executor.set_specialize("auto")
    return {"rank": w.rank, "bad": int(bad.item()), "kernels": sorted(set(kinds)), "launches": iters,
            "ref_mode": exp.how, "spec": _spec_status(w, plan)}


def hot_promotion(w: Any, plan_json: str, nbytes: int, iters: int = 6, dtype: str = "float16",
                  packet_type: Optional[str] = None, seed: int = 9, sim_max_bytes: int = 1 << 16) -> dict:
    """The 'auto' policy on one size it specialises only when hot: the same call ``iters`` times
    (input sign flipped before each, every output checked); returns the kernel of each call, so
    the test can see the interpreter run until ``MSCCLANG_SPEC_HOT_CALLS`` and the specialised
    kernel from then on."""
    plan, dt, esize, n_in, n_out, inp, out, bad, exp, neg = _sign_flip_setup(
        w, plan_json, nbytes, dtype, packet_type, seed, sim_max_bytes)
    w.executor.set_specialize("auto")
    kinds = _sign_flip_runs(w.executor, plan, inp, out, bad, exp, neg, iters, packet_type)
    return {"rank": w.rank, "bad": int(bad.item()), "kernels": kinds, "ref_mode": exp.how,
            "spec": _spec_status(w, plan)}


def mixed_kernels(w: Any, plan_json: str, nbytes: int, iters: int = 16, dtype: str = "float16",
                  packet_type: Optional[str] = None, seed: int = 11, sim_max_bytes: int = 1 << 16) -> dict:
    """Even ranks run the specialised kernel, odd ranks the interpreter, in the same launches
    (what happens when one rank's build fails): both kernels speak the same protocol, so every
    output must stay right. Ends in the 'auto' policy."""
    plan, dt, esize, n_in, n_out, inp, out, bad, exp, neg = _sign_flip_setup(
        w, plan_json, nbytes, dtype, packet_type, seed, sim_max_bytes)
    mine = "always" if w.rank % 2 == 0 else "never"
    try:
        kinds = _sign_flip_runs(w.executor, plan, inp, out, bad, exp, neg, iters, packet_type, lambda i: mine)
    finally:
        w.executor.set_specialize("auto")
    return {"rank": w.rank, "bad": int(bad.item()), "kernels": sorted(set(kinds)), "ref_mode": exp.how,
            "spec": _spec_status(w, plan)}


def to_numpy(t: Any) -> Any:
    """A torch tensor as numpy, bfloat16 through ml_dtypes."""
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().cpu().numpy()


def sim_output(plan: Plan, inputs: list, reduce_op: str, packet_type: Optional[str], rank: int,
               output_bytes: int) -> Any:
    """The simulator's output of ``rank`` for torch ``inputs`` as a tensor like ``inputs[0]`` (on
    its device), or None without :mod:`mscclang.sim`."""
    try:
        from mscclang.sim import run as sim_run
    except ImportError:
        return None
    import numpy as np
    import torch

    outs = sim_run(plan, [to_numpy(x) for x in inputs], reduce_op=reduce_op, packet_type=packet_type or "LL16",
                   output_bytes=output_bytes)
    a = np.ascontiguousarray(outs[rank])
    like = inputs[0]
    if like.dtype == torch.bfloat16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.copy())
    return t.to(like.device)


def _compare_with_sim(plan: Plan, inputs: list, out: Any, reduce_op: str, packet_type: Optional[str],
                      rank: int) -> Optional[int]:
    """Wrong elements of ``out`` against the simulator's output of ``rank`` (None without one)."""
    want = sim_output(plan, inputs, reduce_op, packet_type, rank, out.numel() * out.element_size())
    if want is None:
        return None
    return Expected("simulator", exact=want).count_bad(out)


def back_to_back(w: Any, plan_json: str, nbytes: int, iters: int, dtype: str = "float16",
                 packet_type: Optional[str] = None, graph: bool = False, seed: int = 1,
                 sim_max_bytes: int = 1 << 16) -> dict:
    """``iters`` launches (eager, or CUDA-graph replays) with the input's sign flipped before
    each, every output compared on the GPU with the expected one (sum or allgather only)."""
    import torch

    dev = _device(w)
    plan, dt, esize, n_in, n_out, inp, out, bad, ref, neg_ref = _sign_flip_setup(
        w, plan_json, nbytes, dtype, packet_type, seed, sim_max_bytes)
    ex = w.executor
    ex.prepare(plan, _arg(inp), out, packet_type=packet_type)

    def step(expect: Any) -> None:
        inp.neg_()
        ex.execute(plan, _arg(inp), out, packet_type=packet_type)
        bad.add_(expect.wrong(out).sum())

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
            "ref_mode": ref.how, "spec": _spec_status(w, plan)}


def time_eager(w: Any, plan_json: str, nbytes: int, iters: int = 2000, dtype: str = "float16",
               packet_type: Optional[str] = None, cooperative: bool = False) -> dict:
    """Back-to-back wall time per eager call from Python (us)."""
    import torch

    w.executor.cooperative = cooperative
    plan = _plan(w, plan_json)
    dt = _dtype(dtype)
    dev = _device(w)
    esize = torch.empty((), dtype=dt).element_size()
    n_in, n_out = _sizes(plan, nbytes, esize, w.world_size)
    inp = make_input(w.rank, n_in, dt, 3, dev)
    out = torch.empty(n_out, dtype=dt, device=dev)
    if plan.inplace:
        inp = inplace_input(plan, out, inp, w.rank)
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
    dev = _device(w)
    esize = torch.empty((), dtype=dt).element_size()
    n_in, n_out = _sizes(plan, nbytes, esize, w.world_size)
    if symmetric:
        inp = w.comm.alloc(n_in, dt)
        inp.copy_(make_input(w.rank, n_in, dt, 4, dev))
        out = w.comm.alloc(n_out, dt)
    else:
        inp = make_input(w.rank, n_in, dt, 4, dev)
        out = torch.empty(n_out, dtype=dt, device=dev)
    if plan.inplace:
        inp = inplace_input(plan, out, inp, w.rank)
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
    dev = _device(w)
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
    res = run_plan_check(w, good_json, 4096, "float16", seed=7)
    return {"rank": w.rank, "raised": raised, "raised_again": bool(again), "elapsed_s": elapsed,
            "after_reset_bad": res["bad"], "kernel": kernel, "after_reset_kernel": res["kernel"]}


def reset(w: Any) -> bool:
    """Collective reset of the worker's executor (after a failure on some rank)."""
    w.executor.reset()
    return True


def warm_kernels(w: Any) -> dict:
    """Load the interpreter module of every dtype now (prebuilt cubins, the disk cache, or an
    NVRTC build of tens of seconds each), so that no later command's time limit pays for a build.
    Returns the seconds taken per dtype."""
    import time

    from mscclang.runtime.build import DTYPES

    took = {}
    for dt in DTYPES:
        t = time.monotonic()
        w.executor.kernels.interpreter(dt, "ll16", "sum")
        took[dt] = round(time.monotonic() - t, 2)
    return {"rank": w.rank, "seconds": took}
