#!/usr/bin/env python3
"""vLLM's fused allreduce + residual add + RMSNorm through mscclang's public API, checked
against torch's add + RMSNorm.

    python3 examples/fused_rmsnorm.py [--tokens 5] [--hidden 64]    # starts its own ranks
    torchrun --nproc-per-node 2 examples/fused_rmsnorm.py

Started directly it runs one rank per GPU when there are two or more (NCCL), else two ranks on
the CPU (gloo). Every rank calls ``Communicator.all_reduce_add_rms_norm(x, residual, weight,
eps)`` (``residual += all_reduce(x)``, then ``x = RMSNorm(residual) * weight``) and checks both
results: the residual against ``torch.distributed.all_reduce`` of x plus the residual (exact:
the inputs are small integers, so every summation order gives the same bf16 values), the norm
against ``torch.nn.functional.rms_norm`` of that residual (within one bf16 rounding). On GPUs
the call runs one of the library's fused plans; on a CPU it takes the library's CPU path (its
torch.distributed fallback: the all_reduce on gloo, then the same epilogue in torch) and says
that no fused plan ran. Your own fused plan: ``examples/fused_oneshot.py`` (``mscclang compile
examples/fused_oneshot.py -o build/fused.json -- --num_gpus 2``, then ``mscclang verify``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import mscclang

EPS = 1e-6


def rank_main(rank: int, world: int, init: str, tokens: int, hidden: int) -> None:
    """One rank: the fused call and its checks; exits 1 when a check fails."""
    cuda = torch.cuda.device_count() >= 2
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NCCL without NVLink multicast
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    comm = mscclang.Communicator.from_torch()
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(-4, 5, (tokens, hidden), generator=g).to(torch.bfloat16).to(device)
    g = torch.Generator().manual_seed(7)   # residual and weight alike on every rank
    residual = torch.randint(-4, 5, (tokens, hidden), generator=g).to(torch.bfloat16).to(device)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(device)
    # torch's add + RMSNorm, from the same inputs
    summed = x.clone()
    dist.all_reduce(summed)
    want_residual = summed + residual
    want_norm = torch.nn.functional.rms_norm(want_residual.float(), (hidden,), weight, EPS).to(torch.bfloat16)

    comm.all_reduce_add_rms_norm(x, residual, weight, EPS)   # residual += all_reduce(x); x = norm(residual)

    residual_ok = torch.equal(residual, want_residual)
    err = (x.float() - want_norm.float()).abs()
    norm_ok = bool((err <= 2.0 ** -7 * want_norm.float().abs() + 1e-6).all())   # one bf16 rounding
    how = f"fused plan {comm.last_fused}" if comm.last_fused else "fallback: no fused plan ran"
    print(f"fused_rmsnorm: rank {rank}: {tokens}x{hidden} bf16 on {world} ranks ({device.type}): residual "
          f"{'equals' if residual_ok else 'differs from'} torch's all_reduce + add, norm "
          f"{'within one bf16 rounding of' if norm_ok else 'differs from'} torch's rms_norm "
          f"(max |diff| {float(err.max()):.3g}) ({how})", flush=True)
    comm.close()
    dist.destroy_process_group()
    if not (residual_ok and norm_ok):
        sys.exit(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=5, help="rows of x")
    ap.add_argument("--hidden", type=int, default=64, help="elements per row (a multiple of 8)")
    args = ap.parse_args()
    if "RANK" in os.environ:   # under torchrun
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args.tokens, args.hidden)
        return 0
    world = torch.cuda.device_count() if torch.cuda.device_count() >= 2 else 2
    with tempfile.TemporaryDirectory() as tmp:
        try:
            torch.multiprocessing.spawn(rank_main, args=(world, f"file://{tmp}/init", args.tokens, args.hidden),
                                        nprocs=world)
        except Exception as e:  # noqa: BLE001 - a rank's failed check or error, already printed
            print(f"fused_rmsnorm: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
