"""GPU-test commands for the worker pool (:mod:`mscclang.runtime.workers`): the checked launch of
``mscclang run`` (:func:`run_plan_check`) on order-sensitive inputs (:mod:`tests.harness.data`),
the timing commands of :mod:`mscclang.cli.run_checks` (re-exported here so a test names one
module), back-to-back and CUDA-graph runs with the input's sign flipped before each launch,
kernel-policy switches, the timeout/reset check and the kernel warm-up."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from mscclang.cli import run_checks
from mscclang.cli.run_checks import (  # noqa: F401 - time_eager, time_graph: pool commands
    expectation, inplace_input, spec_status, time_eager, time_graph, worker_device, worker_plan,
)
from mscclang.errors import CollectiveTimeout
from mscclang.plan.models import Plan
from tests.harness.data import rank_input


def order_sensitive_input(rank: int, numel: int, dtype: Any, seed: int, device: Any) -> Any:
    """:func:`~tests.harness.data.rank_input` in the argument order of
    :func:`mscclang.cli.run_checks.make_input`: the checks' inputs (sums that show the order)."""
    return rank_input(seed, rank, numel, dtype, device)


def check_case(w: Any, *args: Any) -> tuple:
    """:func:`mscclang.cli.run_checks.check_case` on :func:`order_sensitive_input` data."""
    return run_checks.check_case(w, *args, make=order_sensitive_input)


def call_tensors(w: Any, *args: Any) -> tuple:
    """:func:`mscclang.cli.run_checks.call_tensors` on :func:`order_sensitive_input` data."""
    return run_checks.call_tensors(w, *args, make=order_sensitive_input)


def run_plan_check(w: Any, *args: Any, **kwargs: Any) -> dict:
    """:func:`mscclang.cli.run_checks.run_plan_check` (one checked launch, compared bit for bit
    with the reference and the simulator) on :func:`order_sensitive_input` data."""
    return run_checks.run_plan_check(w, *args, make=order_sensitive_input, **kwargs)


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

    plan, dt, dev, esize, n_in, n_out, inputs = check_case(w, plan_json, nbytes, dtype, seed)
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
                    packet_type: Optional[str], policy: Optional[Callable[[int], str]] = None,
                    start: int = 0) -> list[str]:
    """``iters`` launches of ``plan`` (numbered from ``start``: the launches made before on these
    tensors), the input's sign flipped before each and every output checked into ``bad``;
    ``policy(i)`` (if given) sets the kernel policy of launch ``i``. Returns the kernel of each
    launch."""
    kinds = []
    for i in range(start, start + iters):
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
            "ref_mode": exp.how, "spec": spec_status(w, plan)}


def hot_promotion(w: Any, plan_json: str, nbytes: int, iters: int = 6, dtype: str = "float16",
                  packet_type: Optional[str] = None, seed: int = 9, sim_max_bytes: int = 1 << 16) -> dict:
    """The 'auto' policy on one size it specialises only when hot: the same call ``iters`` times
    (input sign flipped before each, every output checked), waiting after the
    ``MSCCLANG_SPEC_HOT_CALLS``-th call for the background build it started; returns the kernel
    of each call, so the test can see the interpreter run until then and the specialised kernel
    from then on."""
    plan, dt, esize, n_in, n_out, inp, out, bad, exp, neg = _sign_flip_setup(
        w, plan_json, nbytes, dtype, packet_type, seed, sim_max_bytes)
    from mscclang.config import settings

    w.executor.set_specialize("auto")
    # builds that earlier commands started must not fill the queue this size's build joins
    w.executor.kernels.wait_builds(120.0)
    hot = settings.spec_hot_calls
    kinds = _sign_flip_runs(w.executor, plan, inp, out, bad, exp, neg, min(hot, iters), packet_type)
    built = w.executor.kernels.wait_builds(120.0)   # the build started at the hot call, off this thread
    if iters > hot:
        kinds += _sign_flip_runs(w.executor, plan, inp, out, bad, exp, neg, iters - hot, packet_type, start=hot)
    return {"rank": w.rank, "bad": int(bad.item()), "kernels": kinds, "ref_mode": exp.how,
            "spec": spec_status(w, plan), "built": built}


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
            "spec": spec_status(w, plan)}


def back_to_back(w: Any, plan_json: str, nbytes: int, iters: int, dtype: str = "float16",
                 packet_type: Optional[str] = None, graph: bool = False, seed: int = 1,
                 sim_max_bytes: int = 1 << 16) -> dict:
    """``iters`` launches (eager, or CUDA-graph replays) with the input's sign flipped before
    each, every output compared on the GPU with the expected one (sum or allgather only)."""
    import torch

    dev = worker_device(w)
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
            "ref_mode": ref.how, "spec": spec_status(w, plan)}


def timeout_and_reset(w: Any, bad_json: str, good_json: str, timeout_s: float = 1.0) -> dict:
    """Run a plan with a missing signal (expect CollectiveTimeout within the bound on every rank),
    reset, then run a correct plan correctly in the same processes."""
    import torch

    ex = w.executor
    old = ex.timeout_ns
    ex.timeout_ns = int(timeout_s * 1e9)
    bad = worker_plan(w, bad_json)
    dev = worker_device(w)
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
