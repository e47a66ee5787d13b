"""Ring allreduce (Simple protocol), one thread block per rank: a long, narrow plan.

Reduce-scatter around the ring (n - 1 steps: put the partial sum into the next rank's scratch,
signal; the next rank waits and adds its own input), then allgather around the ring (n - 1
steps: put the finished chunk into the next rank's output, signal). A relaxed handshake at the
start makes sure the next rank has started the launch before its buffers are written. With 8
ranks every rank runs 75 ops: the test case for pictures of long plans (mscclang.viz).

    python tests/programs/allreduce_ring.py --num_gpus 8          # prints the plan
    mscclang compile tests/programs/allreduce_ring.py --ranks 8   # calls program()"""

import argparse

from mscclang.dsl import JSON, AllReduce, Buffer, CollectiveProgram, MemoryChannel, Rank, SyncType


def program(ranks: int = 8, instances: int = 1, protocol: str = "Simple") -> CollectiveProgram:
    """Build the ring allreduce over ``ranks`` ranks (one chunk per rank)."""
    n = ranks
    prog = CollectiveProgram("allreduce_ring", AllReduce(n, 1, False), n, instances=instances,
                             protocol=protocol)
    with prog:
        scratch = [Buffer(r, n) for r in range(n)]
        to_next: dict[int, MemoryChannel] = {}
        to_prev: dict[int, MemoryChannel] = {}
        for r in range(n):
            # channels pair by their order per peer (docs/semantics.md): with 2 ranks both lead to
            # the same peer, so rank 1 makes its channel to the previous rank first
            if n == 2 and r == 1:
                to_prev[r] = MemoryChannel((r - 1) % n, r)
            to_next[r] = MemoryChannel((r + 1) % n, r)
            if r not in to_prev:
                to_prev[r] = MemoryChannel((r - 1) % n, r)
        for r in range(n):
            to_prev[r].signal(tb=0, relaxed=True)
        for r in range(n):
            to_next[r].wait(tb=0, relaxed=True, data_sync=SyncType.after)
        # reduce-scatter: at step s rank r sends chunk (r - s) and receives chunk (r - 1 - s)
        for s in range(n - 1):
            for r in range(n):
                c = (r - s) % n
                src = Rank(r).get_input_buffer() if s == 0 else Rank(r).get_output_buffer()
                nxt = (r + 1) % n
                to_next[r].put(scratch[nxt][c:c + 1], src[c:c + 1], tb=0)
                to_next[r].signal(tb=0, data_sync=SyncType.before)
            for r in range(n):
                c = (r - 1 - s) % n
                to_prev[r].wait(tb=0, data_sync=SyncType.after)
                rank = Rank(r)
                rank.reduce(rank.get_input_buffer()[c:c + 1], [scratch[r][c:c + 1]], tb=0,
                            dst_chunk=rank.get_output_buffer()[c:c + 1])
        # allgather: at step s rank r forwards the finished chunk (r + 1 - s)
        for s in range(n - 1):
            for r in range(n):
                c = (r + 1 - s) % n
                nxt = (r + 1) % n
                to_next[r].put(Rank(nxt).get_output_buffer()[c:c + 1], Rank(r).get_output_buffer()[c:c + 1], tb=0)
                to_next[r].signal(tb=0, data_sync=SyncType.before)
            for r in range(n):
                to_prev[r].wait(tb=0, data_sync=SyncType.after)
    return prog


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_gpus", type=int, default=8, help="number of gpus")
    parser.add_argument("--instances", type=int, default=1, help="number of instances")
    args = parser.parse_args()
    with program(args.num_gpus, args.instances):
        print(JSON())
