"""The relaxed variant of signal_wait_fuse.py (MSCCL++'s relaxed signal/wait fusion unit test,
rewritten): the same four channels per direction, with ``rlxsignal``/``rlxwait``.

Run: ``python relaxed_signal_wait_fuse.py``.
"""

import argparse

from mscclang import *


def relaxed_fused_signal_wait_program(num_threads_per_block, min_message_size, max_message_size):
    ranks = 2
    with CollectiveProgram("relaxed_signal_wait_fuse", TestCollective(ranks, 0, 0), ranks, protocol="Simple",
                           num_threads_per_block=num_threads_per_block, min_message_size=min_message_size,
                           max_message_size=max_message_size):
        for me in range(ranks):
            for peer in range(ranks):
                if peer != me:
                    first = MemoryChannel(peer, me)
                    first.signal(tb=0, relaxed=True)
                    second = MemoryChannel(peer, me)
                    second.signal(tb=0, relaxed=True)
                    third = MemoryChannel(peer, me)
                    third.wait(tb=0, relaxed=True)
                    fourth = MemoryChannel(peer, me)
                    fourth.wait(tb=0, relaxed=True)
        print(JSON())


parser = argparse.ArgumentParser()
parser.add_argument("--num_threads_per_block", type=int, default=1024)
parser.add_argument("--min_message_size", type=int, default=0)
parser.add_argument("--max_message_size", type=int, default=2**64 - 1)
args = parser.parse_args()
relaxed_fused_signal_wait_program(args.num_threads_per_block, args.min_message_size, args.max_message_size)
