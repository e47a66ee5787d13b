"""Compile the fused allreduce + residual add + RMSNorm program written in the DSL
(``examples/fused_oneshot.py``), verify the plan on the simulator, and run it through a
Communicator.

The CPU part runs two ranks as threads on the simulator back end (no GPU needed). On a GPU the
same ``Communicator.all_reduce_add_rms_norm`` call runs the plan through the runtime's epilogue
entry (the GPU suite runs that); this script only says it skips it.

    PYTHONPATH=. python3 examples/fused_rmsnorm.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mscclang.cli.compile_cmd import compile_file
from mscclang.comm.catalog import Catalog, PlanVariant
from mscclang.comm.sim_ranks import run_ranks
from mscclang.sim.fused import verify_fused

PROGRAM = Path(__file__).resolve().parent / "fused_oneshot.py"


def main() -> int:
    plan = compile_file(PROGRAM, ["--num_gpus", "2"])   # the DSL program, compiled
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
