"""The GPU test commands (tests.harness.comm_checks) run on the CPU through the thread harness,
so their reference and comparison logic is tested here; on GPUs they run on the executor."""

import types

import pytest
import torch

from tests.harness import comm_checks as gpu_checks
from mscclang.comm.sim_ranks import run_ranks, stub_plan

N = 2
PLANS = [stub_plan("allreduce", N, name="ar", inplace=True), stub_plan("allgather", N, name="ag"),
         stub_plan("reducescatter", N, name="rs"), stub_plan("alltoall", N, name="a2a"),
         stub_plan("broadcast", N, name="bc", inplace=True, root=0),
         stub_plan("sendrecv", N, name="sr")]


def run(coll, **kw):
    def body(comm):
        w = types.SimpleNamespace(rank=comm.rank, world_size=comm.world_size,
                                  state={"mscclang.comm/False": comm})
        return gpu_checks.check_collective(w, coll, **kw)

    return run_ranks(N, body, plans=PLANS, fallback=False)[0]


@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                  "broadcast", "send_recv"])
def test_commands_pass_on_correct_engine(coll):
    res = run(coll, numels=[N * 7, N * 513], ops=("sum", "max"))
    for r in res:
        assert r["failures"] == [] and r["checked"] >= 8
        assert r["plans"] and "nccl" not in r["plans"]


def test_commands_report_wrong_results(monkeypatch):
    # an engine that drops the peer's contribution must be caught
    import mscclang.comm.sim_backend as sb

    real = sb.reference_outputs

    def wrong(plan, inputs, out_elems, op):
        outs = real(plan, inputs, out_elems, op)
        return [o.copy() * 0 + 1 if o.dtype.kind != "f" else o + 1 for o in outs]

    monkeypatch.setattr(sb, "reference_outputs", wrong)
    res = run("all_reduce", dtypes=("float16", "int32"), numels=[N * 5])
    for r in res:
        assert len(r["failures"]) == r["checked"] == 2 * 2 * 2
        assert "wrong" in r["failures"][0]


def test_expected_values():
    xs = [torch.tensor([1, 5, 3, 8], dtype=torch.int32), torch.tensor([4, 2, 6, 7], dtype=torch.int32)]
    assert gpu_checks._expected("all_reduce", 0, 2, xs, "max", 0).tolist() == [4, 5, 6, 8]
    assert gpu_checks._expected("reduce_scatter", 1, 2, xs, "sum", 0).tolist() == [9, 15]
    assert gpu_checks._expected("all_to_all", 1, 2, xs, "sum", 0).tolist() == [3, 8, 6, 7]
    assert gpu_checks._expected("send_recv", 0, 2, xs, "sum", 0).tolist() == [4, 2, 6, 7]
