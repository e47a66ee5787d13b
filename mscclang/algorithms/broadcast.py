"""Broadcast programs of the library (``Broadcast(ranks, 1, root)``: every rank's output is the
root's input).

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import (Channels, announce_ready, await_ready, check_common, input_of,
                                        library_program, mesh, output_of, peers, signal_all, wait_all)
from mscclang.dsl import Broadcast, Buffer, CollectiveProgram, Rank, SyncType
from mscclang.errors import DSLError
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_broadcast_ll", "build_broadcast_simple"]


def _program(algo: str, ranks: int, instances: int, inplace: bool, protocol: str, num_threads_per_block: int,
             name: Optional[str], min_message_size: int, max_message_size: int, root: int,
             double_scratch: bool = False) -> CollectiveProgram:
    """The broadcast program: checks ``root`` too and names the plan after it by default."""
    check_common(algo, ranks, instances)
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < ranks:
        raise DSLError(f"{algo}: root {root!r} is not a rank of {ranks}")
    return library_program(algo, Broadcast, ranks, instances, inplace, protocol, num_threads_per_block,
                           name if name else f"{algo}.r{ranks}.i{instances}.root{root}", min_message_size,
                           max_message_size, double_scratch=double_scratch, root=root)


def _star(num_ranks: int, root: int) -> Channels:
    """Channels root -> every other rank, then every other rank -> root."""
    others = peers(root, num_ranks)
    return mesh(num_ranks, [(root, p) for p in others] + [(p, root) for p in others])


def build_broadcast_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                       inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                       max_message_size: int = MAX_MESSAGE_SIZE, root: int = 0) -> Plan:
    """LL broadcast: every other rank tells the root that its launch started (relaxed signal);
    after those words the root packs its input into every peer's scratch (one multi-destination
    ``ppkt``) and copies it into its output (out of place); every other rank unpacks the
    packets into its output. Double scratch; one thread block per instance.

    The ready words are needed because nothing else flows back to the root: without them the
    root could run two launches ahead and overwrite packets of the double-buffered scratch that
    a slow peer has not read yet."""
    prog = _program("broadcast_ll", ranks, instances, inplace, "LL", num_threads_per_block, name,
                    min_message_size, max_message_size, root, double_scratch=True)
    n = ranks
    with prog:
        scratch = [Buffer(r, 1) for r in range(n)]
        others = peers(root, n)
        ch = _star(n, root)
        for r in range(n):
            inp, out = input_of(r), output_of(r, inplace)
            if r == root:
                await_ready(ch, r, others, 0)
                for p in others:
                    ch[(root, p)].put_packets(scratch[p][0], inp[0], tb=0)
                if not inplace:
                    Rank(r).copy(out[0], inp[0], tb=0)
            else:
                announce_ready(ch, r, [root], 0)
                Rank(r).unpack_packets(out[0], scratch[r][0], tb=0)
    return prog.to_plan()


def build_broadcast_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                           inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                           max_message_size: int = MAX_MESSAGE_SIZE, root: int = 0) -> Plan:
    """Broadcast through the root's scratch (any buffers): the root copies its input into its
    scratch and signals every peer; each peer waits, reads the root's scratch into its output
    (``get``) and signals the root, which waits for all of them before it finishes (so its
    scratch is not reused while a peer still reads it). One thread block per instance."""
    prog = _program("broadcast_simple", ranks, instances, inplace, "Simple", num_threads_per_block, name,
                    min_message_size, max_message_size, root)
    n = ranks
    with prog:
        scratch = [Buffer(r, 1) for r in range(n)]
        others = peers(root, n)
        ch = _star(n, root)
        for r in range(n):
            rank, inp, out = Rank(r), input_of(r), output_of(r, inplace)
            if r == root:
                rank.copy(scratch[r][0], inp[0], tb=0)
                signal_all(ch, r, others, 0, data_sync=SyncType.before)
                if not inplace:
                    rank.copy(out[0], inp[0], tb=0)
                wait_all(ch, r, others, 0, data_sync=SyncType.after)
            else:
                ch[(r, root)].wait(0, data_sync=SyncType.after)
                ch[(r, root)].get(out[0], scratch[root][0], tb=0)
                ch[(r, root)].signal(0, data_sync=SyncType.before)
    return prog.to_plan()
