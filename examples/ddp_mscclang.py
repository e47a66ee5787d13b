"""Train a small MLP with DistributedDataParallel on the ``mscclang`` torch.distributed backend.

Run under torchrun (one process per GPU; on a machine without CUDA it runs on the CPU)::

    torchrun --nproc-per-node 2 examples/ddp_mscclang.py

The only mscclang lines are ``import mscclang.distributed`` and ``backend="mscclang"``. The script
trains 50 steps on deterministic data with ``backend="mscclang"``, then repeats the same training
in the same processes on NCCL (CUDA) or gloo (CPU) and checks the parameters are bit-identical. It
says how many calls ran on mscclang plans, or "(fallback: no mscclang plan ran)" when none did (on
a CPU every call falls back to torch.distributed: then it compares gloo with gloo).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mscclang.distributed  # noqa: F401 - registers the "mscclang" backend

STEPS = 50


def train(group: object, device: torch.device) -> list:
    """50 DDP steps of a small MLP over ``group``; the final parameters."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=gen).to(device)
        y = torch.randn(16, 4, generator=gen).to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone().cpu() for p in model.parameters()]


def main() -> int:
    if "RANK" not in os.environ:
        print("run this under torchrun: torchrun --nproc-per-node 2 examples/ddp_mscclang.py", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        # one GPU per rank; with fewer GPUs (MSCCLANG_RANKS_PER_GPU=2) ranks share them, and NCCL,
        # which refuses two ranks on one GPU, gives way to gloo for the reference
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        reference = "nccl" if int(os.environ.get("MSCCLANG_RANKS_PER_GPU", "1") or 1) < 2 else "gloo"
    else:
        device = torch.device("cpu")
        reference = "gloo"
    dist.init_process_group("mscclang")   # the one-line switch: everything else is ordinary torch code
    try:
        ours = train(dist.group.WORLD, device)
        # the Communicator behind the backend counts the calls that ran on a mscclang plan; with
        # none (no GPU runtime, as on a CPU) every call went to torch.distributed
        ran = dist.group.WORLD.communicator.plan_calls
        theirs = train(dist.new_group(backend=reference), device)
    finally:
        dist.destroy_process_group()
    rank = int(os.environ["RANK"])
    same = all(torch.equal(a, b) for a, b in zip(ours, theirs))
    if not same:
        worst = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
        print(f"ddp_mscclang: rank {rank}: parameters differ from {reference} (max |diff| {worst})")
        return 1
    note = f" ({ran} calls on mscclang plans)" if ran else " (fallback: no mscclang plan ran)"
    print(f"ddp_mscclang: rank {rank}: {STEPS} steps on mscclang and on {reference}: parameters bit-identical{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
