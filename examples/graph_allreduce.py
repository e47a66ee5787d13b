#!/usr/bin/env python3
"""An allreduce through mscclang's public API, captured in a CUDA graph, checked against NCCL.

    torchrun --nproc-per-node 2 examples/graph_allreduce.py [--numel 262144] [--replays 5]

Every rank allocates an ordinary bf16 tensor, prepares the call, captures one in-place
``comm.all_reduce`` in a CUDA graph inside ``comm.graph_capture()``, and replays the graph on fresh
inputs, each result compared bit for bit with ``torch.distributed.all_reduce`` (NCCL) of the same
input (small integers: every summation order is exact). Without CUDA the ranks run on gloo and the
same eager calls are checked (no graph): every call then falls back to torch.distributed, gloo
is compared with gloo, and the script says "(fallback: no mscclang plan ran)" (``comm.plan_calls``
counts the calls that ran on a plan). Timing of this call: ``mscclang bench --impls ordinary``.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

import mscclang

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--numel", type=int, default=256 * 1024, help="bf16 elements per rank")
ap.add_argument("--replays", type=int, default=5, help="graph replays, each on a fresh input")
args = ap.parse_args()
if "RANK" not in os.environ:
    ap.error("run this under torchrun: torchrun --nproc-per-node 2 examples/graph_allreduce.py")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NCCL without NVLink multicast
cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
rank = dist.get_rank()
comm = mscclang.Communicator.from_torch()
x = torch.empty(args.numel, dtype=torch.bfloat16, device=device)   # an ordinary tensor
comm.prepare("all_reduce", x)          # selection, registration, kernel: before any capture
step = lambda: comm.all_reduce(x)      # noqa: E731
if cuda:
    graph = torch.cuda.CUDAGraph()
    with comm.graph_capture():         # entered before the capture starts, left after it ends
        with torch.cuda.graph(graph):
            comm.all_reduce(x)
    step = graph.replay
bad = 0
for i in range(args.replays):
    g = torch.Generator(device=device).manual_seed(1000 * i + rank)
    inp = torch.randint(-8, 9, (args.numel,), generator=g, device=device).to(torch.bfloat16)
    x.copy_(inp)
    step()
    ref = inp.clone()
    dist.all_reduce(ref)               # NCCL (gloo on the CPU)
    bad += int((x != ref).sum())
how = "CUDA-graph replays" if cuda else "eager calls (no CUDA: gloo, no graph)"
ref = "NCCL" if cuda else "gloo"
# comm.plan_calls: the calls that ran on a mscclang plan (none: every call fell back to torch.distributed)
note = "" if comm.plan_calls else " (fallback: no mscclang plan ran)"
print(f"graph_allreduce: rank {rank}: {args.replays} {how} of {args.numel} bf16 elements: "
      f"{f'match {ref}' if bad == 0 else f'{bad} elements differ from {ref}'}{note}", flush=True)
comm.close()
dist.destroy_process_group()
sys.exit(1 if bad else 0)
