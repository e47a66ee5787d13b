"""Single-buffered two-step LL allreduce, the shape of MSCCL++'s ``allreduce_naivy`` test program
(in place, ``use_double_scratch_buffer=False``): every rank sends block ``p`` of its input to rank
``p``'s scratch as packets, reduces its own block from the peers' packets, sends the result back
as packets into a second scratch area, and unpacks the peers' results.

The scratch is reused by every launch with no double buffering, and that is correct: a rank's
next launch writes a peer's scratch slot only after the peer read it, because the peer sent its
reduced block (which this rank unpacked before its launch ended) after reading that slot, and the
second area likewise. Run: ``python allreduce_ll_naive_single.py --num_gpus 4``."""

import argparse

from mscclang import *


def naive_single_allreduce(name, n, num_threads_per_block, min_message_size, max_message_size):
    with CollectiveProgram(
        name,
        AllReduce(n, 1, True),
        n,
        protocol="LL",
        num_threads_per_block=num_threads_per_block,
        use_double_scratch_buffer=False,
        min_message_size=min_message_size,
        max_message_size=max_message_size,
    ):
        # slots 0..n-1: the peers' blocks of step 1; slots n..2n-1: their reduced blocks
        scratch = [Buffer(r, 2 * n) for r in range(n)]
        chan = {(dst, src): MemoryChannel(dst, src) for src in range(n) for dst in range(n) if dst != src}

        for me in range(n):
            data = Rank(me).get_input_buffer()
            for peer in range(n):
                if peer != me:
                    chan[(peer, me)].put_packets(scratch[peer][me:me + 1], data[peer:peer + 1], 0)

        for me in range(n):
            rank = Rank(me)
            data = rank.get_input_buffer()
            rank.reduce(data[me:me + 1], [scratch[me][p:p + 1] for p in range(n) if p != me], 0,
                        packet=True)
            for peer in range(n):
                if peer != me:
                    chan[(peer, me)].put_packets(scratch[peer][n + me:n + me + 1], data[me:me + 1], 0)

        for me in range(n):
            rank = Rank(me)
            data = rank.get_input_buffer()
            for peer in range(n):
                if peer != me:
                    rank.unpack_packets(data[peer:peer + 1], scratch[me][n + peer:n + peer + 1], 0)

        print(JSON())


parser = argparse.ArgumentParser()
parser.add_argument("--name", type=str, default="allreduce_ll_naive_single", help="name of the program")
parser.add_argument("--num_gpus", type=int, default=2, help="number of gpus")
parser.add_argument("--instances", type=int, default=1, help="ignored: one instance")
parser.add_argument("--num_threads_per_block", type=int, default=1024, help="number of threads per block")
parser.add_argument("--min_message_size", type=int, default=0, help="minimum message size")
parser.add_argument("--max_message_size", type=int, default=2**64 - 1, help="maximum message size")
args = parser.parse_args()

naive_single_allreduce(args.name, args.num_gpus, args.num_threads_per_block, args.min_message_size,
                       args.max_message_size)
