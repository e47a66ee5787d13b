"""All-pairs allreduce (Simple protocol), written in the MSCCL++ DSL style.

Every rank r sends chunk p of its input into a scratch slot of rank p, reduces chunk r of all
ranks into its output, then writes that result into chunk r of every peer's output. A relaxed
signal/wait pair first makes sure each peer has started the launch before its buffers are
written; plain signal/wait pairs publish the data.

Run it directly (prints the plan) or through the CLI:

    python examples/allreduce_8rank.py --num_gpus 8
    mscclang compile examples/allreduce_8rank.py -o allreduce_8rank.json -- --num_gpus 8
    mscclang compile examples/allreduce_8rank.py --ranks 4 --instances 2   # calls program()
"""

import argparse

from mscclang.dsl import (
    AllReduce,
    Buffer,
    CollectiveProgram,
    JSON,
    MemoryChannel,
    Rank,
    SyncType,
)


def program(ranks: int, instances: int = 1, protocol: str = "Simple", name: str = "allreduce_allpairs",
            num_threads_per_block: int = 1024, min_message_size: int = 0,
            max_message_size: int = 2**64 - 1) -> CollectiveProgram:
    """Build the all-pairs allreduce over ``ranks`` ranks (one chunk per rank)."""
    if protocol != "Simple":
        raise ValueError(f"this example implements the Simple protocol only, not {protocol}")
    n = ranks
    prog = CollectiveProgram(name, AllReduce(n, 1, False), n, instances=instances, protocol=protocol,
                             num_threads_per_block=num_threads_per_block,
                             min_message_size=min_message_size, max_message_size=max_message_size)
    with prog:
        scratch = [Buffer(r, n) for r in range(n)]  # slot p of rank r: rank p's copy of chunk r
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            peers = [p for p in range(n) if p != r]
            chans = {p: MemoryChannel(p, r) for p in peers}
            # ready handshake: the peer has started this launch, its buffers may be written
            for p in peers:
                chans[p].signal(tb=0, relaxed=True)
            for p in peers:
                chans[p].wait(tb=0, relaxed=True, data_sync=SyncType.after)
            # scatter: my chunk p goes into slot r of rank p's scratch
            for p in peers:
                chans[p].put(scratch[p][r:r + 1], inp[p:p + 1], tb=0)
            for p in peers:
                chans[p].signal(tb=0, data_sync=SyncType.before)
            for p in peers:
                chans[p].wait(tb=0, data_sync=SyncType.after)
            # reduce chunk r of every rank
            rank.reduce(inp[r:r + 1], [scratch[r][p:p + 1] for p in peers], tb=0, dst_chunk=out[r:r + 1])
            # gather: the result goes into chunk r of every peer's output
            for p in peers:
                chans[p].put(Rank(p).get_output_buffer()[r:r + 1], out[r:r + 1], tb=0)
            for p in peers:
                chans[p].signal(tb=0, data_sync=SyncType.before)
            for p in peers:
                chans[p].wait(tb=0, data_sync=SyncType.after)
    return prog


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", type=str, default="allreduce_allpairs", help="name of the program")
    parser.add_argument("--num_gpus", type=int, default=8, help="number of gpus")
    parser.add_argument("--instances", type=int, default=1, help="number of instances")
    parser.add_argument("--num_threads_per_block", type=int, default=1024, help="threads per block")
    parser.add_argument("--min_message_size", type=int, default=0, help="minimum message size")
    parser.add_argument("--max_message_size", type=int, default=2**64 - 1, help="maximum message size")
    args = parser.parse_args()
    with program(args.num_gpus, args.instances, "Simple", args.name, args.num_threads_per_block,
                 args.min_message_size, args.max_message_size):
        print(JSON())
