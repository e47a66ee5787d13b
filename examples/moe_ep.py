"""A small mixture-of-experts layer with expert parallelism over mscclang.

Run it with a launcher, one process per GPU (or per CPU rank with gloo, where every exchange goes
through torch.distributed's fallback):

    torchrun --nproc-per-node 8 examples/moe_ep.py [--tokens 16] [--hidden 256] [--experts 32]

Each rank holds ``experts / world`` experts (a SiLU feed-forward of one matrix each). A step
routes this rank's tokens (top-k of a router's logits, softmax weights), sends each token to its
experts' ranks (``Communicator.moe_dispatch``), runs the local experts on their rows, and brings
the results back summed with the router's weights (``Communicator.moe_combine``). On GPUs the
decode step is captured once in a CUDA graph and replayed with new tokens, so new routing, every
step; each step is checked against a one-process reference that runs every expert locally.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def expert_weights(experts: int, hidden: int) -> torch.Tensor:
    """Every expert's matrix, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(experts, hidden, hidden, generator=g) / hidden ** 0.5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16, help="tokens per rank and step")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32, help="experts in all (a multiple of the world size)")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10, help="decode steps (graph replays on GPUs)")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        print("run me with a launcher: torchrun --nproc-per-node N examples/moe_ep.py", file=sys.stderr)
        return 2

    import mscclang.distributed  # noqa: F401  (registers the "mscclang" backend)
    from mscclang import Communicator

    cuda = torch.cuda.is_available()
    backend = "gloo"
    if cuda:
        # one GPU per rank; with fewer GPUs (MSCCLANG_RANKS_PER_GPU=2 or more) ranks share them,
        # and NCCL, which refuses two ranks on one GPU, gives way to gloo for the process group
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        backend = "nccl" if int(os.environ.get("MSCCLANG_RANKS_PER_GPU", "1") or 1) < 2 else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    comm = Communicator.from_torch()
    E, H, T, k = args.experts, args.hidden, args.tokens, args.topk
    L = E // world
    W = expert_weights(E, H).to(dev)
    router = (torch.randn(H, E, generator=torch.Generator().manual_seed(99)) / H ** 0.5).to(dev)
    capacity = world * T * k                      # every token of every rank could pick one expert

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x @ router
        w, idx = torch.topk(logits, k, dim=-1)
        return idx, torch.softmax(w, dim=-1)

    def layer(x: torch.Tensor) -> torch.Tensor:
        idx, w = route(x)
        rows, _, handle = comm.moe_dispatch(x, idx, E, capacity=capacity, check=False)
        local = W[rank * L:(rank + 1) * L]                            # [L, H, H]
        y = torch.nn.functional.silu(torch.bmm(rows, local))          # the local experts on their rows
        return comm.moe_combine(y, w, handle)

    def reference(x: torch.Tensor) -> torch.Tensor:
        idx, w = route(x)
        acc = torch.zeros_like(x)
        for j in range(k):
            e = idx[:, j]
            acc += w[:, j:j + 1] * torch.nn.functional.silu(torch.bmm(x.unsqueeze(1), W[e]).squeeze(1))
        return acc

    def tokens(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step * 1000 + rank)
        return torch.randn(T, H, generator=g).to(dev)

    x = tokens(0)
    y = layer(x)                                  # eager: sets the plans up
    worst = float((y - reference(x)).abs().max())
    if cuda:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            y = layer(x)
    for step in range(1, args.steps + 1):
        x.copy_(tokens(step))                     # new tokens: new routing
        if cuda:
            graph.replay()
        else:
            y = layer(x)
        worst = max(worst, float((y - reference(x)).abs().max()))
    ok = worst < 1e-3
    print(f"rank {rank}: {args.steps + 1} steps of an EP layer ({E} experts, top-{k}, {T} tokens x {H}) "
          f"{'in a CUDA graph' if cuda else 'eager'}: largest difference from the one-process reference "
          f"{worst:.2e}: {'ok' if ok else 'WRONG'}"
          + ("" if comm.last_all_to_all_v else " (fallback: the exchanges ran on torch.distributed)"))
    comm.close()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
