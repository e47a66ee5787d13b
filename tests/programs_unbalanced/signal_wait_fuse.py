"""An MSCCL++ DSL unit test of op emission (signal/wait fusion), rewritten: on two ranks each rank
makes four memory channels to its peer, signals on the first two and waits on the last two, all
on thread block 0, so the compiler fuses the two signals into one ``signal`` op over two channels
and the two waits into one ``wait`` op. Balanced per rank pair (two signals, two waits each way),
which is all MSCCL++'s DSL checks, but not per channel: the waited channels are never signalled,
so the plan hangs. mscclang compiles it with a warning (``strict=True`` or
``mscclang compile --strict`` refuses it) and ``mscclang verify`` reports the deadlock.

Run: ``python signal_wait_fuse.py [--strict]``; relaxed_signal_wait_fuse.py is the relaxed variant.
"""

import argparse

from mscclang import *


def fused_signal_wait_program(num_threads_per_block, min_message_size, max_message_size, strict=False):
    ranks = 2
    with CollectiveProgram("signal_wait_fuse", TestCollective(ranks, 0, 0), ranks, protocol="Simple",
                           num_threads_per_block=num_threads_per_block, min_message_size=min_message_size,
                           max_message_size=max_message_size, strict=strict) as prog:
        for me in range(ranks):
            for peer in range(ranks):
                if peer == me:
                    continue
                # a new channel per constructor call: channels 0 and 1 signal, 2 and 3 wait
                for _ in range(2):
                    MemoryChannel(peer, me).signal(tb=0)
                for _ in range(2):
                    MemoryChannel(peer, me).wait(tb=0)
        print(JSON())
    return prog


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_threads_per_block", type=int, default=1024)
    parser.add_argument("--min_message_size", type=int, default=0)
    parser.add_argument("--max_message_size", type=int, default=2**64 - 1)
    parser.add_argument("--strict", action="store_true", help="make the imbalance an error")
    args = parser.parse_args()
    fused_signal_wait_program(args.num_threads_per_block, args.min_message_size, args.max_message_size,
                              strict=args.strict)
