"""Author a fused allreduce + residual add + RMSNorm plan in the DSL, verify it on the simulator,
and run it through a Communicator.

The CPU part runs two ranks as threads on the simulator back end (no GPU needed). On a GPU the
same ``Communicator.all_reduce_add_rms_norm`` call runs the plan through the runtime's epilogue
entry (the GPU suite runs that); this script only says it skips it.

    PYTHONPATH=. python3 examples/fused_rmsnorm.py
"""

from __future__ import annotations

import sys

import torch

from mscclang import AllReduceAddRMSNorm, Buffer, CollectiveProgram, MemoryChannel, Rank
from mscclang.comm.catalog import Catalog, PlanVariant
from mscclang.comm.sim_ranks import run_ranks
from mscclang.plan.models import Plan
from mscclang.sim.fused import verify_fused


def fused_oneshot(n: int = 2) -> Plan:
    """Every rank reduces every chunk from its peer's LL packets into scratch, adds it to the
    residual, and block 0 normalises all rows after a barrier."""
    with CollectiveProgram("my_fused_oneshot.r2", AllReduceAddRMSNorm(n, 1, True), n, protocol="LL",
                           use_double_scratch_buffer=True) as prog:
        packets = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            Buffer(r, n)            # packet slots take twice their bytes: keep the sums apart
        sums = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            rank, peer = Rank(r), 1 - r
            inp, res = rank.get_input_buffer(), rank.get_residual_buffer()
            ch = MemoryChannel(peer, r)
            for c in range(n):
                ch.put_packets(packets[peer][c], inp[c], tb=c)
                rank.reduce(inp[c], [packets[r][c]], tb=c, dst_chunk=sums[r][c], packet=True)
                rank.add_residual(res[c], sums[r][c], tb=c)
            rank.barrier(list(range(n)))
            rank.rms_norm(inp[0:n], res[0:n], tb=0)     # in place: the norm goes to x
    return prog.to_plan()


def main() -> int:
    plan = fused_oneshot()
    report = verify_fused(plan)
    print(f"{plan.name}: {plan.format}, verify {report.status} in {report.runs} runs")
    if not report.ok:
        return 1
    tokens, hidden = 5, 64
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(2)]
    residual = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    weight = torch.rand(hidden, generator=g) + 0.5

    def call(comm):
        x, r = xs[comm.rank].clone(), residual.clone()
        comm.all_reduce_add_rms_norm(x, r, weight, 1e-6)     # r += allreduce(x); x = norm(r)
        return x, r
    got, world, _ = run_ranks(2, call, engine="sim", catalog=Catalog([PlanVariant.from_plan(plan)]))
    ref = ((xs[0].double() + xs[1].double()) + residual.double())
    ok = world.launches == [plan.name] and torch.equal(got[0][0], got[1][0]) and \
        (got[0][1].double() - ref).abs().max().item() < 0.05
    print(f"Communicator ran {world.launches[0]}; residual max error {(got[0][1].double() - ref).abs().max().item():.3g}")
    if not torch.cuda.is_available():
        print("GPU part skipped: no CUDA GPU")
    else:
        print("GPU part skipped: the GPU suite runs the fused call on two ranks")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
