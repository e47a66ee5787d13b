"""The GPU worker commands of tests.harness.runtime_checks (run_plan_check, back_to_back) at 4 and 8 ranks
on the CPU: one thread per rank, every launch run for all ranks by the simulator
(mscclang.comm.sim_backend.SimWorld) behind a stand-in for the GPU executor. The commands'
references, size arithmetic and result fields are the ones the GPU tests use."""

from __future__ import annotations

from types import SimpleNamespace

import threading
import types
from typing import Any, Callable, Optional

import pytest
import torch

from mscclang.comm.catalog import SYMMETRIC, infer_buffer_mode
from mscclang.comm.sim_backend import SimWorld
from mscclang.plan.io import plan_to_json
from tests.harness import runtime_checks as checks
from mscclang.plan import samples as sp


class SimExecutor:
    """The executor calls the checks make, run by one rank's SimBackend; ``corrupt`` (rank ->
    function of the output) makes a rank's result wrong."""

    def __init__(self, backend: Any, corrupt: Optional[Callable[[Any], None]] = None) -> None:
        self.backend = backend
        self.corrupt = corrupt
        self.last_kernel = "sim"
        self.policy = "auto"
        self.staging: dict = {}
        self.kernels = SimpleNamespace(wait_builds=lambda timeout_s: True)   # no background builds here

    def set_specialize(self, mode: str) -> None:
        self.policy = mode

    def execute(self, plan, inp, out, packet_type=None, reduce_op="sum", accum_dtype=None) -> None:
        b = self.backend
        if infer_buffer_mode(plan) == SYMMETRIC and not (b.memory.is_symmetric(inp) and b.memory.is_symmetric(out)):
            # like the GPU executor: zero-copy plans on plain tensors run through staging buffers
            key = (plan.name, inp.numel(), out.numel(), inp.dtype)
            if key not in self.staging:
                so = b.memory.empty(out.numel(), out.dtype)
                self.staging[key] = (None if plan.inplace else b.memory.empty(inp.numel(), inp.dtype), so)
            si, so = self.staging[key]
            if plan.inplace:   # the input lies in the output: stage the output, input at its offset
                so.copy_(out)
                k = (inp.data_ptr() - out.data_ptr()) // inp.element_size()
                si = so[k:k + inp.numel()]
            else:
                si.copy_(inp)
            self._run(plan, si, so, packet_type, reduce_op, accum_dtype)
            out.copy_(so)
        else:
            self._run(plan, inp, out, packet_type, reduce_op, accum_dtype)
        if self.corrupt is not None:
            self.corrupt(out)
        self.last_kernel = {"always": "spec", "never": "interpreter"}.get(self.policy, "sim")

    def _run(self, plan, inp, out, packet_type, reduce_op, accum_dtype) -> None:
        """The back end's run of a checked call (the collective API's way down)."""
        from mscclang.plan.call import make_call

        b = self.backend
        call = make_call(plan.collective, b.rank, plan.world_size, b.device, inp, out, reduce_op, accum_dtype)
        b.launch.run_call(plan, call, packet_type)

    def prepare(self, *args, **kw) -> None:
        pass

    def execute_traced(self, plan, inp, out, packet_type=None, reduce_op="sum"):
        """:meth:`execute`, and the trace a kernel writing 1 us per device record would give."""
        from mscclang.runtime.packing import pack_blocks
        from mscclang.runtime.trace import decode, record_ops, trace_words

        self.execute(plan, inp, out, packet_type=packet_type, reduce_op=reduce_op)
        r = self.backend.rank
        nb = inp.numel() * inp.element_size()
        packed = pack_blocks(plan, r, nb, out.numel() * out.element_size())
        lay = trace_words([b.n_records for b in packed.blocks])
        words = [0] * lay.words
        words[0] = lay.stride
        for b, blk in enumerate(packed.blocks):
            for i, _ in enumerate(record_ops(blk.region)):
                words[1 + b * lay.stride + 2 * i] = 10_000 + 1000 * i
                words[2 + b * lay.stride + 2 * i] = 10_900 + 1000 * i
        return decode(plan, r, [b.region for b in packed.blocks], words)

    def synchronize(self) -> None:
        pass

    def check(self) -> None:
        pass


def on_ranks(n: int, fn: Callable[[Any], dict], corrupt: Optional[dict] = None) -> list[dict]:
    world = SimWorld(n, engine="sim", timeout=60.0)
    results: list[Any] = [None] * n
    errors: list[Optional[BaseException]] = [None] * n

    def body(r: int) -> None:
        b = world.backend(r)
        w = types.SimpleNamespace(rank=r, world_size=n, device=torch.device("cpu"), state={},
                                  executor=SimExecutor(b, (corrupt or {}).get(r)),
                                  comm=types.SimpleNamespace(alloc=b.memory.empty, barrier=lambda: None))
        try:
            results[r] = fn(w)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e
            world._barrier.abort()

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for e in errors:
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise e
    return results


@pytest.mark.parametrize("name", ["allreduce_oneshot_ll.r4.i1.inplace", "allreduce_rsag_zero_copy.r4.i16.inplace",
                                  "allreduce_rsag_simple.r4.i16.inplace", "allgather_simple_inplace"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_run_plan_check_runs_inplace_plans_in_place(name, symmetric):
    """In-place plans (the library's, and one made in place by the DSL) run on the in-place
    layout: the check used to hand them separate buffers, which the GPU executor ran wrong."""
    from pathlib import Path

    from mscclang.algorithms.allgather import build_allgather_simple
    from mscclang.plan.io import load_plan

    n = 4
    if name == "allgather_simple_inplace":
        plan = build_allgather_simple(n, 1, inplace=True)
    else:
        plan = load_plan(Path(__file__).resolve().parents[1] / "plans" / f"{name}.json")
    assert plan.inplace
    j = plan_to_json(plan)
    res = on_ranks(n, lambda w: checks.run_plan_check(w, j, 4096, "float16", symmetric=symmetric))
    for r in res:
        assert r["bad"] == 0 and r["sim_bad"] == 0, (name, r)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("name", ["allreduce_oneshot_ll", "allreduce_twostep_ll", "allreduce_read_simple",
                                  "allgather_simple"])
def test_run_plan_check_passes_on_a_correct_engine(n, name):
    plan = sp.SAMPLES[name](n)
    j = plan_to_json(plan)
    # zero-copy plans: symmetric buffers (plain ones go through the stand-in's staging)
    sym = infer_buffer_mode(plan) == SYMMETRIC and n == 4
    # 3000 B: simulator bits and the reference; 192 KiB: above sim_max_bytes, the bound alone
    for nbytes, dtype in ((3000, "float16"), (192 << 10, "bfloat16"), (4096, "int32")):
        res = on_ranks(n, lambda w: checks.run_plan_check(w, j, nbytes, dtype, symmetric=sym))
        assert [r["rank"] for r in res] == list(range(n))
        for r in res:
            assert r["bad"] == 0, (name, nbytes, r)
            small = nbytes <= 1 << 16
            assert (r["sim_bad"] is not None) == small
            reduces = name.startswith("allreduce") and dtype != "int32"
            assert r["ref_mode"] == ("bound" if reduces else "exact")


@pytest.mark.parametrize("n", [4, 8])
def test_run_plan_check_reports_a_wrong_rank(n):
    j = plan_to_json(sp.allreduce_oneshot_ll(n))

    def bump(out):
        out[5:9] += 1

    for nbytes in (2048, 256 << 10):
        res = on_ranks(n, lambda w: checks.run_plan_check(w, j, nbytes, "float16"), corrupt={n - 1: bump})
        for r in res:
            if r["rank"] == n - 1:
                assert r["ref_bad"] == 4 and r["first_bad"][0] == 5
                assert r["sim_bad"] == (4 if nbytes <= 1 << 16 else None)
            else:
                assert r["bad"] == 0


@pytest.mark.parametrize("n", [4, 8])
def test_back_to_back_at_n_ranks(n):
    for name, nbytes in (("allreduce_oneshot_ll", 1024), ("allreduce_scratch_simple", 96 << 10),
                         ("allgather_simple", 4096)):
        j = plan_to_json(sp.SAMPLES[name](n))
        res = on_ranks(n, lambda w: checks.back_to_back(w, j, nbytes, 4, "bfloat16"))
        for r in res:
            assert r["bad"] == 0 and r["launches"] == 4, (name, r)
        if name.startswith("allreduce"):
            assert res[0]["ref_mode"] == ("simulator" if nbytes <= 1 << 16 else "bound")
    # a rank that drops the sign flip is caught on every other launch
    flip = {1: lambda out: out.neg_()}
    res = on_ranks(n, lambda w: checks.back_to_back(w, plan_to_json(sp.allreduce_oneshot_ll(n)), 1024, 4),
                   corrupt=flip)
    assert res[1]["bad"] > 0 and all(r["bad"] == 0 for r in res if r["rank"] != 1)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_sample_plans_take_n(n):
    for name, make in sp.SAMPLES.items():
        plan = make(n)
        assert plan.world_size == n and len(plan.gpus) == n, name
    assert sp.missing_signal(n).world_size == n


@pytest.mark.parametrize("n", [4, 8])
def test_kernel_switching_commands_at_n_ranks(n):
    """alternate_kernels / mixed_kernels / hot_promotion (the GPU tests' sign-flipping repeat
    commands): right outputs pass with the policy each launch asked for, a rank that drops a
    sign flip is caught."""
    j = plan_to_json(sp.allreduce_oneshot_ll(n))
    res = on_ranks(n, lambda w: checks.alternate_kernels(w, j, 1024, 4))
    assert all(r["bad"] == 0 and r["kernels"] == ["interpreter", "spec"] for r in res), res
    res = on_ranks(n, lambda w: checks.mixed_kernels(w, j, 3000, 4))
    for r in res:
        assert r["bad"] == 0 and r["kernels"] == ["spec" if r["rank"] % 2 == 0 else "interpreter"], r
    res = on_ranks(n, lambda w: checks.hot_promotion(w, j, 96 << 10, 6))   # the wait after the hot call
    assert all(r["bad"] == 0 and r["built"] and r["kernels"] == ["sim"] * 6 for r in res), res
    flip = {2: lambda out: out.neg_()}
    res = on_ranks(n, lambda w: checks.mixed_kernels(w, j, 1024, 4), corrupt=flip)
    assert res[2]["bad"] > 0 and all(r["bad"] == 0 for r in res if r["rank"] != 2)


class _SimPool:
    """The worker pool ``mscclang run`` drives, over :func:`on_ranks` (one thread per rank)."""

    def __init__(self, n: int, corrupt: Optional[dict] = None) -> None:
        self.world_size = n
        self.corrupt = corrupt

    def run(self, command: str, *args: Any) -> list:
        import importlib

        mod, name = command.split(":")
        fn = getattr(importlib.import_module(mod), name)
        return on_ranks(self.world_size, lambda w: fn(w, *args), self.corrupt)


@pytest.mark.parametrize("name", ["allreduce_oneshot_ll.r2.i1.inplace", "allgather_port.r2.i1"])
def test_run_trace_writes_one_chrome_trace_checked_against_the_plan(name, tmp_path, capsys):
    """``mscclang run --trace``: a traced launch per size on every rank, its result checked, its
    events on one time base in one Chrome trace (a process per rank and size), the op order per
    block checked against the plan, and the cost of tracing printed."""
    import argparse
    import json
    from pathlib import Path

    from mscclang.cli.run_cmd import _trace
    from mscclang.plan.collectives import collective
    from mscclang.plan.io import load_plan

    plan = load_plan(Path(__file__).resolve().parents[1] / "plans" / f"{name}.json")
    out = tmp_path / "t.json"
    args = argparse.Namespace(trace=str(out), dtype="float16", packet_type=None, plan=name)
    sizes = [4096, 1 << 16]
    inputs = [collective(plan.collective).call_bytes(2, s)[0] for s in sizes]   # the workers take input bytes
    failed = _trace(_SimPool(2), plan, plan_to_json(plan), sizes, inputs, args, "sum")
    printed = capsys.readouterr().out
    assert not failed, printed
    assert printed.count("results exact, op order as planned") == 2
    tr = json.loads(out.read_text())
    ops = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    n_ops = sum(len(tb.ops) for g in plan.gpus for tb in g.threadblocks)
    assert len(ops) == 2 * n_ops and {e["pid"] for e in ops} == {0, 1, 2, 3}
    names = {m["pid"]: m["args"]["name"] for m in tr["traceEvents"] if m["ph"] == "M"}
    assert names[3] == "rank 1 @ 64 KiB"
    # a wrong result is reported, and the command fails
    failed = _trace(_SimPool(2, {1: lambda o: o.view(-1)[:1].add_(1)}), plan, plan_to_json(plan), [4096], inputs[:1], args,
                    "sum")
    assert failed and "BAD" in capsys.readouterr().out
