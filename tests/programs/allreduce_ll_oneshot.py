"""One-shot LL allreduce in the MSCCL++ DSL style (double scratch): every rank packs its whole
input into every peer's scratch, then each thread block reduces one chunk from the packets of all
peers into the output. Run: ``python allreduce_ll_oneshot.py --num_gpus 8``."""

import argparse

from mscclang import *


def allreduce_example(name, num_gpus, num_threads_per_block, min_message_size, max_message_size, instances):
    n = num_gpus
    collective = AllReduce(n, 1, False)
    with CollectiveProgram(
        name,
        collective,
        n,
        instances=instances,
        protocol="LL",
        num_threads_per_block=num_threads_per_block,
        use_double_scratch_buffer=True,
        min_message_size=min_message_size,
        max_message_size=max_message_size,
    ):
        # scratch slot of peer p on rank r: (p's position among r's peers) * n .. + n
        scratch = [Buffer(r, (n - 1) * n) for r in range(n)]
        channels = {}
        for gpu in range(n):
            for peer in range(n):
                if peer != gpu:
                    channels[(peer, gpu)] = MemoryChannel(peer, gpu)

        def slot(owner, sender):
            return (sender if sender < owner else sender - 1) * n

        for gpu in range(n):
            rank = Rank(gpu)
            inp = rank.get_input_buffer()
            for peer in range(n):
                if peer != gpu:
                    s = slot(peer, gpu)
                    channels[(peer, gpu)].put_packets(scratch[peer][s:s + n], inp[0:n], tb=0)

        for gpu in range(n):
            rank = Rank(gpu)
            inp = rank.get_input_buffer()
            out = rank.get_output_buffer()
            for index in range(n):
                others = []
                for peer in range(n):
                    if peer != gpu:
                        s = slot(gpu, peer) + index
                        others.append(scratch[gpu][s:s + 1])
                rank.reduce(inp[index:index + 1], others, tb=index, dst_chunk=out[index:index + 1], packet=True)

        print(JSON())


parser = argparse.ArgumentParser()
parser.add_argument("--name", type=str, default="allreduce_ll_oneshot", help="name of the program")
parser.add_argument("--num_gpus", type=int, default=2, help="number of gpus")
parser.add_argument("--instances", type=int, default=1, help="number of instances")
parser.add_argument("--num_threads_per_block", type=int, default=1024, help="number of threads per block")
parser.add_argument("--min_message_size", type=int, default=0, help="minimum message size")
parser.add_argument("--max_message_size", type=int, default=2**64 - 1, help="maximum message size")
args = parser.parse_args()

allreduce_example(args.name, args.num_gpus, args.num_threads_per_block, args.min_message_size,
                  args.max_message_size, args.instances)
