"""The library of collective algorithms, written as DSL programs.

``ALGORITHMS`` maps each algorithm's name to its :class:`AlgorithmInfo` (collective, protocol,
buffer mode, suggested size range, supported in-place modes, shipped variants and the builder).
Build a plan with ``ALGORITHMS[name].build(ranks, instances=..., num_threads_per_block=...,
inplace=..., **kw)`` or :func:`build`. ``mscclang generate-plans`` writes the
shipped variants to ``plans/`` with the index ``plans/index.json``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from mscclang.algorithms.allgather import build_allgather_ll, build_allgather_simple, build_allgather_zero_copy
from mscclang.algorithms.allreduce import (
    build_oneshot_ll,
    build_rsag_pipelined,
    build_rsag_simple,
    build_rsag_zero_copy,
    build_twostep_ll,
)
from mscclang.algorithms.alltoall import build_alltoall_ll, build_alltoall_simple, build_alltoall_zero_copy
from mscclang.algorithms.alltoallv import build_alltoallv_ll, build_alltoallv_port, build_alltoallv_simple, build_alltoallv_zero_copy
from mscclang.algorithms.broadcast import build_broadcast_ll, build_broadcast_simple
from mscclang.algorithms.fused import build_fused_oneshot_ll, build_fused_twoshot_ll
from mscclang.algorithms.hierarchical import build_allgather_hierarchical, build_allreduce_hierarchical
from mscclang.algorithms.port import build_allgather_port, build_allreduce_port_pipelined, build_alltoall_port
from mscclang.algorithms.reducescatter import (
    build_reducescatter_ll,
    build_reducescatter_simple,
    build_reducescatter_zero_copy,
)
from mscclang.algorithms.registry import MiB, AlgorithmInfo, Variant
from mscclang.algorithms.sendrecv import build_sendrecv_ll, build_sendrecv_simple, build_sendrecv_zero_copy
from mscclang.errors import DSLError
from mscclang.plan.collectives import FUSED_NORM
from mscclang.plan.models import MAX_MESSAGE_SIZE, Plan

__all__ = ["ALGORITHMS", "AlgorithmInfo", "Variant", "build"]

SHIPPED_RANKS = (2, 4, 8)
BOTH = (False, True)


def _variants(instances: Union[tuple[int, ...], dict[int, tuple[int, ...]]],
              inplace: tuple[bool, ...] = (False,),
              params: tuple[tuple[str, Any], ...] = ()) -> tuple[Variant, ...]:
    """Variants for every shipped rank count: ``instances`` is a tuple of instance counts, or a
    dict from rank count to such a tuple (to keep the number of thread blocks sensible)."""
    def ks(n: int) -> tuple[int, ...]:
        return instances[n] if isinstance(instances, dict) else instances
    return tuple(Variant(n, k, None, ip, params)
                 for n in SHIPPED_RANKS for k in ks(n) for ip in inplace)


def _every_root(instances: Union[tuple[int, ...], dict[int, tuple[int, ...]]],
                inplace: tuple[bool, ...]) -> tuple[Variant, ...]:
    """:func:`_variants` for every root of every shipped rank count (a rooted collective: a call
    from any root runs a plan, never the fallback)."""
    return tuple(Variant(v.ranks, v.instances, None, v.inplace, (("root", r),))
                 for v in _variants(instances, inplace) for r in range(v.ranks))


def _info(name: str, collective: str, protocol: str, buffer_mode: str, inplace_modes: tuple[bool, ...],
          size_range: tuple[int, int], builder, description: str, default_threads: int,
          variants: tuple[Variant, ...], min_ranks: int = 2, port_channels: bool = False) -> AlgorithmInfo:
    return AlgorithmInfo(name=name, collective=collective, protocol=protocol, buffer_mode=buffer_mode,
                         inplace_modes=inplace_modes, min_message_size=size_range[0],
                         max_message_size=size_range[1], builder=builder, description=description,
                         default_threads=default_threads, variants=variants, min_ranks=min_ranks,
                         port_channels=port_channels)


def _port_variants(ranks: tuple[int, ...], inplace: tuple[bool, ...],
                   params: tuple[tuple[tuple[str, Any], ...], ...]) -> tuple[Variant, ...]:
    """One instance of every (ranks, params, inplace) of a port-channel algorithm: the copy
    engines need no more thread blocks, and every instance adds port requests."""
    return tuple(Variant(n, 1, None, ip, ps) for n in ranks for ps in params for ip in inplace)


#: pipeline steps of the shipped copy-engine allreduce variants (``steps`` x 2 x (ranks - 1)
#: port puts per rank stay under MAX_PORT_REQUESTS at 8 ranks)
PORT_STEPS = (4, 8)
#: finer pipelines where the request budget allows (16 x 2 x (ranks - 1) <= MAX_PORT_REQUESTS up
#: to 4 ranks): the pipeline's fill and drain shrink with the step (at 2 ranks, 4 steps took
#: 801.6 us for 256 MiB against a copy-engine floor near 695 us)
PORT_STEPS_FINE = ((2, 4), (16,))
#: node layouts of the shipped hierarchical variants: (ranks, GPUs per node), i.e. 2x1 (two GPUs
#: run as one-GPU nodes, MSCCLANG_GPUS_PER_NODE=1), 2x2, 2x4, 4x2
HIER_LAYOUTS = ((2, 1), (4, 2), (8, 4), (8, 2))
#: instances of the shipped hierarchical variants (one thread block each; 4 for bandwidth)
HIER_INSTANCES = (1, 4)


def _hier_variants() -> tuple[Variant, ...]:
    return tuple(Variant(n, k, None, ip, (("gpus_per_node", g),))
                 for n, g in HIER_LAYOUTS for k in HIER_INSTANCES for ip in BOTH)


#: grid sizes (thread blocks per rank) the bandwidth variants aim at, by rank count
#: (notes/perf.md, 2x H200: plain zero-copy puts move ~23 GB/s per block, so >= 16 blocks pass
#: 220 GB/s and 32 reach ~265 GB/s per direction; LL plans scale linearly to 16 blocks and still
#: gain at 32). With 4 or 8 ranks every block already writes to several peers and 16 blocks
#: (~370 GB/s of remote stores) come near a GPU's NVLink bandwidth, so only 16 ship there (the
#: plans grow with ranks squared; the tuner can build others). Every plan's blocks must be
#: co-resident (at most ~132 on an H200); the shipped grids stay at or below 64 blocks.
SIMPLE_BLOCKS: dict[int, tuple[int, ...]] = {2: (16, 32), 4: (16,), 8: (16,)}
LL_BLOCKS: dict[int, tuple[int, ...]] = {2: (16, 32), 4: (16,), 8: (16,)}
#: the allreduce LL plans also get a 64-block grid at 2 ranks: at 256 KiB their time still fell
#: with every doubling of blocks measured (one-shot 16 -> 32 blocks: 5.46 -> 4.53 us; two-step
#: 16 -> 32: 5.08 -> 4.14 us, notes/tune_2xh200), and the issue's 256 KiB goal is 3.6 us
LL_BLOCKS_ALLREDUCE: dict[int, tuple[int, ...]] = {2: (16, 32, 64), 4: (16,), 8: (16,)}
#: the zero-copy allreduce also gets a 64-block grid at 2 ranks (the most any plan ships: every
#: block must be co-resident on GPUs of fewer SMs than an H200's 132): from 1 MiB to 64 MiB its
#: time still fell from 16 to 32 blocks at every size measured (eager: 14.96 -> 14.30 us at
#: 1 MiB, 25.05 -> 23.56 at 4 MiB; notes/tune_2xh200), as if bound by the SMs issuing NVLink loads
SIMPLE_BLOCKS_ZERO_COPY_ALLREDUCE: dict[int, tuple[int, ...]] = {2: (16, 32, 64), 4: (16,), 8: (16,)}


def _by_blocks(blocks_per_instance: Callable[[int], int],
               base: Union[tuple[int, ...], dict[int, tuple[int, ...]]] = (),
               targets: dict[int, tuple[int, ...]] = SIMPLE_BLOCKS) -> dict[int, tuple[int, ...]]:
    """Instance counts per shipped rank count ``n``: ``base`` (a tuple, or a dict by rank count)
    plus, for every target grid size of ``targets[n]``, the most instances whose blocks fit in
    it (``target // blocks_per_instance(n)``, at least 1).

    More blocks come from instances rather than thread block groups: a group's op is still
    recorded once on every member block, so it saves no ops, and the Simple plans would need a
    cross-block barrier around every handshake, where instances run their own channels and
    never wait for each other."""
    out: dict[int, tuple[int, ...]] = {}
    for n in SHIPPED_RANKS:
        per = blocks_per_instance(n)
        ks = set(base[n] if isinstance(base, dict) else base)
        ks.update(max(1, t // per) for t in targets[n])
        out[n] = tuple(sorted(ks))
    return out


def _one(n: int) -> int:
    return 1


def _two(n: int) -> int:
    return 2


def _per_rank(n: int) -> int:
    return n


def _per_peer(n: int) -> int:
    return n - 1


_ALL = (0, MAX_MESSAGE_SIZE)
#: latency variants of the LL plans with one block per peer: 1 and 4 instances at 2 ranks, one
#: instance with more ranks (the bandwidth variants come from :data:`LL_BLOCKS`)
_LL_SMALL = {2: (1, 4), 4: (1,), 8: (1,)}

ALGORITHMS: dict[str, AlgorithmInfo] = {info.name: info for info in (
    _info("allreduce_oneshot_ll", "allreduce", "LL", "any", BOTH, (0, 1 * MiB), build_oneshot_ll,
          "each rank packs its whole input into every peer's scratch, then reduces locally",
          512, _variants(_by_blocks(_per_rank, {2: (1, 4), 4: (1, 2), 8: (1,)}, LL_BLOCKS_ALLREDUCE), BOTH)),
    _info("allreduce_twostep_ll", "allreduce", "LL", "any", BOTH, (0, 4 * MiB), build_twostep_ll,
          "packet reduce-scatter, then packet all-gather of the reduced chunks",
          512, _variants(_by_blocks(_per_peer, {2: (2, 8), 4: (1,), 8: (1,)}, LL_BLOCKS_ALLREDUCE), BOTH)),
    _info("allreduce_rsag_simple", "allreduce", "Simple", "any", BOTH, _ALL, build_rsag_simple,
          "copy to scratch, read-reduce own chunk from peers' scratch, write back, copy out",
          1024, _variants(_by_blocks(_one), BOTH)),
    _info("allreduce_rsag_zero_copy", "allreduce", "Simple", "symmetric", BOTH, _ALL, build_rsag_zero_copy,
          "read-reduce own chunk from peers' inputs, write it into every peer's output",
          1024, _variants(_by_blocks(_one, (), SIMPLE_BLOCKS_ZERO_COPY_ALLREDUCE), BOTH)),
    _info("allreduce_rsag_pipelined", "allreduce", "Simple", "any", BOTH, (1 * MiB, MAX_MESSAGE_SIZE),
          build_rsag_pipelined,
          "rsag through scratch in unit-sized slices, reduce and copy-out blocks overlapping",
          1024, _variants(_by_blocks(_two), BOTH)),
    # plan/2: allreduce + residual add + RMSNorm (+ FP8 output), for all_reduce_add_rms_norm
    _info("allreduce_add_rms_norm_oneshot_ll", FUSED_NORM, "LL", "any", BOTH, (0, 1 * MiB),
          build_fused_oneshot_ll, "every rank reduces every row from peers' packets, adds the "
          "residual and normalises all rows", 512,
          _variants((1,), BOTH) + _variants((1,), (False,), (("quant", True),))),
    _info("allreduce_add_rms_norm_twoshot_ll", FUSED_NORM, "LL", "any", BOTH, _ALL,
          build_fused_twoshot_ll, "packet reduce-scatter by rows, residual add and norm of the own "
          "rows, packet all-gather of the normed and of the residual rows", 1024,
          _variants((1,), BOTH) + _variants((1,), (False,), (("quant", True),))),
    _info("allgather_ll", "allgather", "LL", "any", BOTH, (0, 1 * MiB), build_allgather_ll,
          "packets into every peer's scratch, unpacked by the peer", 512,
          _variants(_by_blocks(_per_peer, _LL_SMALL, LL_BLOCKS))),
    _info("allgather_simple", "allgather", "Simple", "any", BOTH, _ALL, build_allgather_simple,
          "copy to own scratch, peers read it after a data signal", 1024, _variants(_by_blocks(_one))),
    _info("allgather_zero_copy", "allgather", "Simple", "symmetric", BOTH, _ALL, build_allgather_zero_copy,
          "direct puts into every peer's output after a ready handshake", 1024, _variants(_by_blocks(_one))),
    _info("reducescatter_ll", "reducescatter", "LL", "any", BOTH, (0, 1 * MiB), build_reducescatter_ll,
          "packets of each peer's chunk into its scratch, local packet reduce", 512,
          _variants(_by_blocks(_per_peer, _LL_SMALL, LL_BLOCKS))),
    _info("reducescatter_simple", "reducescatter", "Simple", "any", BOTH, _ALL, build_reducescatter_simple,
          "copy to scratch, read-reduce own chunk from peers' scratch", 1024, _variants(_by_blocks(_one))),
    _info("reducescatter_zero_copy", "reducescatter", "Simple", "symmetric", BOTH, _ALL,
          build_reducescatter_zero_copy, "read-reduce own chunk from peers' inputs", 1024,
          _variants(_by_blocks(_one))),
    _info("alltoall_ll", "alltoall", "LL", "any", BOTH, (0, 1 * MiB), build_alltoall_ll,
          "packets of each peer's chunk into its scratch, unpacked by the peer", 512,
          _variants(_by_blocks(_per_peer, _LL_SMALL, LL_BLOCKS))),
    _info("alltoall_simple", "alltoall", "Simple", "any", BOTH, _ALL, build_alltoall_simple,
          "copy to own scratch, peers read their chunk after a data signal", 1024, _variants(_by_blocks(_one))),
    _info("alltoall_zero_copy", "alltoall", "Simple", "symmetric", (False,), _ALL, build_alltoall_zero_copy,
          "direct puts of each peer's chunk into its output after a ready handshake", 1024,
          _variants(_by_blocks(_one))),
    _info("alltoallv_ll", "alltoallv", "LL", "any", (False,), (0, 1 * MiB), build_alltoallv_ll,
          "ready handshake, packets of each peer's rows into its scratch slot, unpacked by the peer", 512,
          _variants((1,))),
    _info("alltoallv_simple", "alltoallv", "Simple", "any", (False,), _ALL, build_alltoallv_simple,
          "rows for each peer staged in own scratch, read by the peer after a data signal", 1024,
          _variants((1,))),
    _info("alltoallv_zero_copy", "alltoallv", "Simple", "symmetric", (False,), _ALL, build_alltoallv_zero_copy,
          "direct puts of each peer's rows into its output after a ready handshake", 1024, _variants((1,))),
    _info("broadcast_ll", "broadcast", "LL", "any", BOTH, (0, 1 * MiB), build_broadcast_ll,
          "root packs its input into every peer's scratch", 512,
          _every_root(_by_blocks(_one, (1, 4), LL_BLOCKS), BOTH)),
    _info("broadcast_simple", "broadcast", "Simple", "any", BOTH, _ALL, build_broadcast_simple,
          "root copies into its scratch, peers read it after a data signal", 1024,
          _every_root(_by_blocks(_one), BOTH)),
    _info("sendrecv_ll", "sendrecv", "LL", "any", BOTH, (0, 1 * MiB), build_sendrecv_ll,
          "packets into the next rank's scratch", 512, _variants(_by_blocks(_one, (1, 4), LL_BLOCKS))),
    _info("sendrecv_simple", "sendrecv", "Simple", "any", BOTH, _ALL, build_sendrecv_simple,
          "put into the next rank's scratch after its ready word, copied out after a data signal",
          1024, _variants(_by_blocks(_one))),
    _info("sendrecv_zero_copy", "sendrecv", "Simple", "symmetric", (False,), _ALL, build_sendrecv_zero_copy,
          "put straight into the next rank's output after its ready word", 1024, _variants(_by_blocks(_one))),
    # port channels (copy engine within a node, NCCL point-to-point between nodes): never chosen
    # by default; the tuner ranks them by measurement, a tuning rule can name them
    _info("allreduce_port_pipelined", "allreduce", "Simple", "symmetric", BOTH, (1 * MiB, MAX_MESSAGE_SIZE),
          build_allreduce_port_pipelined,
          "copy-engine reduce-scatter into peers' scratch, SM reduction, copy-engine all-gather, "
          "pipelined in steps", 1024,
          _port_variants(SHIPPED_RANKS, BOTH, tuple((("steps", k),) for k in PORT_STEPS))
          + _port_variants(PORT_STEPS_FINE[0], BOTH, tuple((("steps", k),) for k in PORT_STEPS_FINE[1])),
          port_channels=True),
    _info("allgather_port", "allgather", "Simple", "symmetric", BOTH, (1 * MiB, MAX_MESSAGE_SIZE),
          build_allgather_port, "copy-engine puts into every peer's output", 1024,
          _port_variants(SHIPPED_RANKS, BOTH, ((),)), port_channels=True),
    _info("alltoall_port", "alltoall", "Simple", "symmetric", (False,), (1 * MiB, MAX_MESSAGE_SIZE),
          build_alltoall_port, "copy-engine puts of each peer's chunk into its output", 1024,
          _port_variants(SHIPPED_RANKS, (False,), ((),)), port_channels=True),
    _info("alltoallv_port", "alltoallv", "Simple", "any", (False,), _ALL, build_alltoallv_port,
          "rows staged in send slots, copy-engine puts of whole slots into the peers' receive slots", 1024,
          _port_variants(SHIPPED_RANKS, (False,), ((),)), port_channels=True),
    _info("allreduce_hierarchical", "allreduce", "Simple", "symmetric", BOTH, _ALL, build_allreduce_hierarchical,
          "intra-node reduce-scatter (memory), inter-node allreduce of the shard (port), intra-node "
          "all-gather (memory); gpus_per_node is a parameter", 1024, _hier_variants(), port_channels=True),
    _info("allgather_hierarchical", "allgather", "Simple", "symmetric", BOTH, _ALL, build_allgather_hierarchical,
          "inter-node puts of the input (port), then intra-node puts of the node's gathered chunks "
          "(memory); gpus_per_node is a parameter", 1024, _hier_variants(), port_channels=True),
)}


def build(name: str, ranks: int, instances: int = 1, num_threads_per_block: Optional[int] = None,
          inplace: Optional[bool] = None, **kw: Any) -> Plan:
    """Build the plan of library algorithm ``name`` (see :attr:`AlgorithmInfo.build`)."""
    info = ALGORITHMS.get(name)
    if info is None:
        raise DSLError(f"unknown algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}")
    return info.build(ranks, instances=instances, num_threads_per_block=num_threads_per_block,
                      inplace=inplace, **kw)
