"""Simple-protocol allgather written in the MSCCL++ DSL style: each rank tells every peer it is
ready (relaxed signal/wait), puts its input into the peer's output, then publishes it (signal) and
waits for every peer's data. Run: ``python allgather_simple.py --num_gpus 8``."""

import argparse

from mscclang import *


def allgather_example(name, num_gpus, num_threads_per_block, min_message_size, max_message_size, instances):
    chunk_factor = 1
    collective = AllGather(num_gpus, chunk_factor, True)
    with CollectiveProgram(
        name,
        collective,
        num_gpus,
        instances=instances,
        protocol="Simple",
        num_threads_per_block=num_threads_per_block,
        min_message_size=min_message_size,
        max_message_size=max_message_size,
    ):
        channels = {}
        for gpu in range(num_gpus):
            for peer in range(num_gpus):
                if peer != gpu:
                    channels[(peer, gpu)] = MemoryChannel(peer, gpu)

        for gpu in range(num_gpus):
            src_rank = Rank(gpu)
            out = src_rank.get_output_buffer()
            for peer in range(num_gpus):
                if peer == gpu:
                    continue
                tb = peer if peer < gpu else peer - 1
                ch = channels[(peer, gpu)]
                dst_out = Rank(peer).get_output_buffer()
                ch.signal(tb, data_sync=SyncType.none, relaxed=True)
                ch.wait(tb, data_sync=SyncType.after, relaxed=True)
                ch.put(dst_out[gpu * chunk_factor:(gpu + 1) * chunk_factor],
                       out[gpu * chunk_factor:(gpu + 1) * chunk_factor], tb)
                ch.signal(tb, data_sync=SyncType.before)
                ch.wait(tb, data_sync=SyncType.after)

        print(JSON())


parser = argparse.ArgumentParser()
parser.add_argument("--name", type=str, default="allgather_simple", help="name of the program")
parser.add_argument("--num_gpus", type=int, default=2, help="number of gpus")
parser.add_argument("--instances", type=int, default=1, help="number of instances")
parser.add_argument("--num_threads_per_block", type=int, default=1024, help="number of threads per block")
parser.add_argument("--min_message_size", type=int, default=0, help="minimum message size")
parser.add_argument("--max_message_size", type=int, default=2**64 - 1, help="maximum message size")
args = parser.parse_args()

allgather_example(args.name, args.num_gpus, args.num_threads_per_block, args.min_message_size,
                  args.max_message_size, args.instances)
