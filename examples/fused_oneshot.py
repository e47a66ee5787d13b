"""A fused allreduce + residual add + RMSNorm in the DSL (plan/2, in place: the norm goes to x):
every rank packs its input into each peer's scratch as LL packets, reduces every chunk into a
scratch slot, adds it to its residual, and block 0 normalises all rows after a barrier.

    mscclang compile examples/fused_oneshot.py -o fused.json -- --num_gpus 2
"""

import argparse

from mscclang import *

ap = argparse.ArgumentParser()
ap.add_argument("--num_gpus", type=int, default=2)
ap.add_argument("--instances", type=int, default=1)
args = ap.parse_args()
n = args.num_gpus

# instances: each instance's copy of the chunks lies in one piece (ReplicationPolicy.none), so
# each instance's norm covers one contiguous share of the chunks; chunk_unit "row" cuts the
# chunks at whole rows, so that share is whole rows at any row count
with CollectiveProgram(f"my_fused_oneshot.r{n}", AllReduceAddRMSNorm(n, 1, True), n, instances=args.instances,
                       replication_policy=ReplicationPolicy.none, protocol="LL", use_double_scratch_buffer=True,
                       chunk_unit="row"):
    packets = [Buffer(r, (n - 1) * n) for r in range(n)]
    for r in range(n):
        Buffer(r, (n - 1) * n)      # packet slots take twice their bytes: keep the sums apart
    sums = [Buffer(r, n) for r in range(n)]
    slot = lambda src, dst, c: (src if src < dst else src - 1) * n + c  # where src's chunk c lands on dst
    for r in range(n):
        rank = Rank(r)
        inp, res = rank.get_input_buffer(), rank.get_residual_buffer()
        peers = [p for p in range(n) if p != r]
        for c in range(n):
            for p in peers:
                MemoryChannel(p, r).put_packets(packets[p][slot(r, p, c)], inp[c], tb=c)
            rank.reduce(inp[c], [packets[r][slot(p, r, c)] for p in peers], tb=c, dst_chunk=sums[r][c], packet=True)
            rank.add_residual(res[c], sums[r][c], tb=c)
        rank.barrier(list(range(n)))
        rank.rms_norm(inp[0:n], res[0:n], tb=0)     # in place: the norm goes to x
    print(JSON())
