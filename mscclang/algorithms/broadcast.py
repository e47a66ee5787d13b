"""Broadcast programs of the library (``Broadcast(ranks, 1, root)``: every rank's output is the
root's input).

Memory-ordering rules as in :mod:`mscclang.algorithms.allreduce`.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import check_common, make_program, mesh, peers, signal_all, wait_all
from mscclang.dsl import Broadcast, Buffer, Rank, SyncType
from mscclang.errors import DSLError
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_broadcast_ll", "build_broadcast_simple"]


def _check_root(algo: str, ranks: int, root: int) -> None:
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < ranks:
        raise DSLError(f"{algo}: root {root!r} is not a rank of {ranks}")


def _name(algo: str, ranks: int, instances: int, root: int, name: Optional[str]) -> str:
    return name if name else f"{algo}.r{ranks}.i{instances}.root{root}"


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
    algo = "broadcast_ll"
    check_common(algo, ranks, instances)
    _check_root(algo, ranks, root)
    n = ranks
    prog = make_program(_name(algo, n, instances, root, name), Broadcast(n, 1, root=root, inplace=inplace), n,
                        instances, "LL", num_threads_per_block, min_message_size, max_message_size,
                        double_scratch=True)
    with prog:
        scratch = [Buffer(r, 1) for r in range(n)]
        others = peers(root, n)
        ch = mesh(n, [(root, p) for p in others] + [(p, root) for p in others])
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            if r == root:
                wait_all(ch, r, others, 0, relaxed=True, data_sync=SyncType.after)
                for p in others:
                    ch[(root, p)].put_packets(scratch[p][0:1], inp[0:1], tb=0)
                if not inplace:
                    rank.copy(out[0:1], inp[0:1], tb=0)
            else:
                ch[(r, root)].signal(0, data_sync=SyncType.none, relaxed=True)
                rank.unpack_packets(out[0:1], scratch[r][0:1], tb=0)
    return prog.to_plan()


def build_broadcast_simple(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                           inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                           max_message_size: int = MAX_MESSAGE_SIZE, root: int = 0) -> Plan:
    """Broadcast through the root's scratch (any buffers): the root copies its input into its
    scratch and signals every peer; each peer waits, reads the root's scratch into its output
    (``get``) and signals the root, which waits for all of them before it finishes (so its
    scratch is not reused while a peer still reads it). One thread block per instance."""
    algo = "broadcast_simple"
    check_common(algo, ranks, instances)
    _check_root(algo, ranks, root)
    n = ranks
    prog = make_program(_name(algo, n, instances, root, name), Broadcast(n, 1, root=root, inplace=inplace), n,
                        instances, "Simple", num_threads_per_block, min_message_size, max_message_size)
    with prog:
        scratch = [Buffer(r, 1) for r in range(n)]
        others = peers(root, n)
        ch = mesh(n, [(root, p) for p in others] + [(p, root) for p in others])
        for r in range(n):
            rank = Rank(r)
            inp = rank.get_input_buffer()
            out = inp if inplace else rank.get_output_buffer()
            if r == root:
                rank.copy(scratch[r][0:1], inp[0:1], tb=0)
                signal_all(ch, r, others, 0, data_sync=SyncType.before)
                if not inplace:
                    rank.copy(out[0:1], inp[0:1], tb=0)
                wait_all(ch, r, others, 0, data_sync=SyncType.after)
            else:
                ch[(r, root)].wait(0, data_sync=SyncType.after)
                ch[(r, root)].get(out[0:1], scratch[root][0:1], tb=0)
                ch[(r, root)].signal(0, data_sync=SyncType.before)
    return prog.to_plan()
