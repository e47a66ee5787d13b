"""Fused allreduce + residual add + RMSNorm programs of the library (plan/2,
``allreduce_add_rms_norm``; docs/semantics.md, "Epilogue ops").

Both use LL packets into peers' double-buffered scratch (no signals), reduce each chunk into a
plain scratch slot placed after the packet slots' doubled bytes, add it to the residual (``radd``) and normalise the residual rows (``rmsnorm``,
FP8 output with ``quant``).

* one-shot: thread block ``c`` of every rank reduces chunk ``c`` of every rank's input (every rank
  reduces every row), adds it to its residual chunk; after a barrier, block 0 normalises all
  rows (the norm's range is the whole buffer, so any row count works);
* two-shot: rank ``r`` reduces only chunk ``r`` (a reduce-scatter by rows), adds and normalises
  it, then sends the normed rows and the updated residual rows to every peer (two all-gathers),
  so every rank's residual and output are complete. Its chunks are whole rows (``chunk_unit``
  ``"row"``): chunk ``r`` holds ``ceil(T / ranks)`` rows, the last ones fewer or none, so any row
  count T runs.

Both sum the ranks' inputs in rank order on every rank, so every rank holds the same bits.
"""

from __future__ import annotations

from typing import Optional

from mscclang.algorithms.common import input_of, mesh_program, output_of, peers, sender_slot
from mscclang.dsl import AllReduceAddRMSNorm, Buffer, Rank
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["build_fused_oneshot_ll", "build_fused_twoshot_ll"]


def build_fused_oneshot_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 512,
                           inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                           max_message_size: int = MAX_MESSAGE_SIZE, quant: bool = False) -> Plan:
    """One-shot fused allreduce + residual + RMSNorm (see the module docstring); ``quant``: the
    norm writes FP8 (never in place: the FP8 output is not the input)."""
    algo = "allreduce_add_rms_norm_oneshot_ll" + ("_fp8" if quant else "")
    n = ranks
    with mesh_program(algo, AllReduceAddRMSNorm, ranks, instances, inplace, "LL", num_threads_per_block,
                      name, min_message_size, max_message_size, double_scratch=True) as (prog, ch):
        scratch = [Buffer(r, (n - 1) * n) for r in range(n)]
        for r in range(n):  # packet slots take twice their plain bytes: keep the sums clear of them
            Buffer(r, (n - 1) * n)
        sums = [Buffer(r, n) for r in range(n)]
        for r in range(n):
            rank, inp, out, res, ps = Rank(r), input_of(r), output_of(r, inplace), Rank(r).get_residual_buffer(), peers(r, n)
            for c in range(n):
                for p in ps:
                    ch[(r, p)].put_packets(scratch[p][sender_slot(r, p) * n + c], inp[c], tb=c)
                got = [scratch[r][sender_slot(q, r) * n + c] for q in ps]   # the peers in rank order
                rank.reduce(inp[c], got, tb=c, dst_chunk=sums[r][c], packet=True, src_position=r)
                rank.add_residual(res[c], sums[r][c], tb=c)
            rank.barrier(list(range(n)))
            rank.rms_norm(out[0:n], res[0:n], tb=0, quantize=quant)
    return prog.to_plan()


def build_fused_twoshot_ll(ranks: int, instances: int = 1, num_threads_per_block: int = 1024,
                           inplace: bool = False, name: Optional[str] = None, min_message_size: int = 0,
                           max_message_size: int = MAX_MESSAGE_SIZE, quant: bool = False) -> Plan:
    """Two-shot fused allreduce + residual + RMSNorm (see the module docstring)."""
    algo = "allreduce_add_rms_norm_twoshot_ll" + ("_fp8" if quant else "")
    n = ranks
    with mesh_program(algo, AllReduceAddRMSNorm, ranks, instances, inplace, "LL", num_threads_per_block,
                      name, min_message_size, max_message_size, double_scratch=True, chunk_unit="row",
                      replicated_residual=True) as (prog, ch):
        # per rank: the peers' input chunks, the sum, the peers' normed rows, their residual rows
        parts = [Buffer(r, n - 1) for r in range(n)]
        normed = [Buffer(r, n - 1) for r in range(n)]
        resid = [Buffer(r, n - 1) for r in range(n)]
        for r in range(n):  # packet slots take twice their plain bytes: keep the sum clear of them
            Buffer(r, 3 * (n - 1))
        total = [Buffer(r, 1) for r in range(n)]
        for r in range(n):
            rank, inp, out, res, ps = Rank(r), input_of(r), output_of(r, inplace), Rank(r).get_residual_buffer(), peers(r, n)
            for p in ps:
                ch[(r, p)].put_packets(parts[p][sender_slot(r, p)], inp[p], tb=0)
            rank.reduce(inp[r], [parts[r][sender_slot(q, r)] for q in ps], tb=0, dst_chunk=total[r][0], packet=True,
                        src_position=r)   # rank order, as the one-shot
            rank.add_residual(res[r], total[r][0], tb=0)
            rank.rms_norm(out[r], res[r], tb=0, quantize=quant)
            for p in ps:
                ch[(r, p)].put_packets(normed[p][sender_slot(r, p)], out[r], tb=0)
                ch[(r, p)].put_packets(resid[p][sender_slot(r, p)], res[r], tb=0)
            for q in ps:
                rank.unpack_packets(out[q], normed[r][sender_slot(q, r)], tb=0)
                rank.unpack_packets(res[q], resid[r][sender_slot(q, r)], tb=0)
    return prog.to_plan()
