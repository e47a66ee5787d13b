"""Two-step LL allreduce in the MSCCL++ DSL style (in place, double scratch): reduce-scatter by
packets (each rank sends block p of its input to rank p's scratch), each rank reduces its own
block and sends the result to every peer as packets (fused into ``respkt``), then every rank
unpacks the peers' reduced blocks. Run: ``python allreduce_ll_twostep.py --num_gpus 8``."""

import argparse

from mscclang import *


def allreduce_example(name, gpu_size, num_threads_per_block, min_message_size, max_message_size, instances):
    chunksperloop = gpu_size
    collective = AllReduce(gpu_size, chunksperloop, True)
    with CollectiveProgram(
        name,
        collective,
        gpu_size,
        instances=instances,
        protocol="LL",
        instr_fusion=True,
        num_threads_per_block=num_threads_per_block,
        use_double_scratch_buffer=True,
        min_message_size=min_message_size,
        max_message_size=max_message_size,
    ):
        scratch_buffer = [Buffer(gpu, 2 * (gpu_size - 1) * gpu_size) for gpu in range(gpu_size)]
        channels = {}
        for gpu in range(gpu_size):
            for peer in range(gpu_size):
                if peer != gpu:
                    channels[(peer, gpu)] = MemoryChannel(peer, gpu)

        # step 1: block `peer` of my input goes to rank `peer`'s scratch
        for gpu in range(gpu_size):
            input_buffer = Rank(gpu).get_input_buffer()
            for peer in range(gpu_size):
                if peer != gpu:
                    scratch_index = (gpu if gpu < peer else gpu - 1) * gpu_size
                    input_index = peer * gpu_size
                    tb = peer if peer < gpu else peer - 1
                    channels[(peer, gpu)].put_packets(
                        scratch_buffer[peer][scratch_index:scratch_index + gpu_size],
                        input_buffer[input_index:input_index + gpu_size], tb)

        # step 2: reduce my block chunk by chunk, send each result to every peer
        for gpu in range(gpu_size):
            rank = Rank(gpu)
            input_buffer = rank.get_input_buffer()
            for index in range(gpu_size):
                chunks = []
                for peer in range(gpu_size):
                    if peer != gpu:
                        scratch_index = (peer if peer < gpu else peer - 1) * gpu_size + index
                        chunks.append(scratch_buffer[gpu][scratch_index:scratch_index + 1])
                input_index = gpu * gpu_size + index
                rank.reduce(input_buffer[input_index:input_index + 1], chunks, index, packet=True)
                for peer in range(gpu_size):
                    if peer != gpu:
                        scratch_index = gpu_size * (gpu_size - 1) + (gpu if gpu < peer else gpu - 1) * gpu_size + index
                        channels[(peer, gpu)].put_packets(
                            scratch_buffer[peer][scratch_index:scratch_index + 1],
                            input_buffer[input_index:input_index + 1], index)

        # step 3: unpack the peers' reduced blocks
        for gpu in range(gpu_size):
            rank = Rank(gpu)
            input_buffer = rank.get_input_buffer()
            for peer in range(gpu_size):
                if peer != gpu:
                    input_index = peer * gpu_size
                    scratch_index = gpu_size * (gpu_size - 1) + (peer if peer < gpu else peer - 1) * gpu_size
                    rank.unpack_packets(input_buffer[input_index:input_index + gpu_size],
                                        scratch_buffer[gpu][scratch_index:scratch_index + gpu_size], peer)

        print(JSON())


parser = argparse.ArgumentParser()
parser.add_argument("--name", type=str, default="allreduce_ll_twostep", help="name of the program")
parser.add_argument("--num_gpus", type=int, default=2, help="number of gpus")
parser.add_argument("--instances", type=int, default=1, help="number of instances")
parser.add_argument("--num_threads_per_block", type=int, default=1024, help="number of threads per block")
parser.add_argument("--min_message_size", type=int, default=0, help="minimum message size")
parser.add_argument("--max_message_size", type=int, default=2**64 - 1, help="maximum message size")
args = parser.parse_args()

allreduce_example(args.name, args.num_gpus, args.num_threads_per_block, args.min_message_size,
                  args.max_message_size, args.instances)
