"""Every reducing algorithm of the library sums in the canonical order (docs/semantics.md, "Batch
invariance"): every reduced element is the ranks' sources in rank order, left to right, rounded
to the dtype after each addition (fp8: one reduction op over all sources in the accumulation
dtype, rounded once), so its bits do not depend on the plan, the grid or the message size.

Run on the CPU simulator with order-sensitive data (:func:`tests.harness.data.spread`) and
compared element by element, bit for bit, with :func:`mscclang.plan.reference.reference_outputs`
(the rank-order fold). The fast tests build every reducing algorithm at 3, 4 and 8 ranks (the
pipelined ones with small slices, so that a small message already spans several slices with a
partial last one); the slow sweep takes every world size from 2 to 8, the shipped grids and
slice sizes. The library's plans promise it (``batch_invariant``), the hierarchical ones with
partial sums per node disclaim it."""

from __future__ import annotations

import json
from typing import Any, Optional

import ml_dtypes
import numpy as np
import pytest
import torch

from mscclang.algorithms import ALGORITHMS
from mscclang.errors import DSLError
from mscclang.plan.collectives import TABLE
from mscclang.plan.dtypes import ACCUM_DTYPES
from mscclang.plan.reference import fp8_sum_arrays, output_blocks, reference_outputs
from mscclang.sim import run as sim_run
from mscclang.sim.epilogue import EpilogueParams
from mscclang.sim.fused import run_fused
from tests.harness.data import spread

#: the library's reducing algorithms, the fused ones apart (they are checked on their residual)
REDUCING = sorted(n for n, i in ALGORITHMS.items() if TABLE[i.collective].reduces and not TABLE[i.collective].fused)
FUSED = sorted(n for n, i in ALGORITHMS.items() if TABLE[i.collective].fused)
#: builder keywords of the fast tests: slices of 64 bytes and two pipeline steps, so that small
#: messages already run several slices (and two reducing blocks); the size floors of the
#: large-message plans lifted
FAST_KW: dict[str, dict[str, Any]] = {
    "allreduce_rsag_pipelined": {"unit": 64, "min_message_size": 0},
    "allreduce_port_pipelined": {"steps": 2, "reduce_blocks": 2, "min_message_size": 0},
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = ((torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn), (torch.float8_e5m2, ml_dtypes.float8_e5m2))


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy (bfloat16 and fp8 through ml_dtypes, by their bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    for tdt, ndt in FP8:
        if t.dtype == tdt:
            return t.view(torch.uint8).numpy().view(ndt)
    return t.numpy()


def _inputs(n: int, numel: int, dtype: torch.dtype, seed: int) -> list[np.ndarray]:
    return [_numpy(spread(numel, dtype, seed * 1009 + q)) for q in range(n)]


def _canonical(collective: str, xs: list[np.ndarray], accum: Optional[str]) -> list[np.ndarray]:
    """Every rank's canonical output: the rank-order fold (fp8: one sum over all sources in
    ``accum``, rounded once)."""
    if accum is None or accum == ACCUM_DTYPES[0]:
        return reference_outputs(collective, xs)
    n, size = len(xs), xs[0].size
    outs = []
    for r in range(n):
        blocks = output_blocks(collective, n, r, size)
        out = np.empty(sum(b.length for b in blocks), dtype=xs[0].dtype)
        for b in blocks:
            out[b.out_start:b.out_start + b.length] = fp8_sum_arrays(
                [xs[s][b.in_start:b.in_start + b.length] for s in b.sources], xs[0].dtype, accum)
        outs.append(out)
    return outs


def _differences(got: list[np.ndarray], want: list[np.ndarray]) -> list[str]:
    """``rank r: k of m elements differ (first at i)`` for every rank whose bits differ."""
    bad = []
    for r, (g, w) in enumerate(zip(got, want)):
        isz = w.dtype.itemsize
        neq = g.view(np.uint8).reshape(-1, isz) != w.view(np.uint8).reshape(-1, isz)
        rows = neq.any(axis=1)
        if g.shape != w.shape or rows.any():
            bad.append(f"rank {r}: {int(rows.sum())} of {w.size} elements differ (first at {int(np.argmax(rows))})")
    return bad


def _check(plan: Any, numel: int, dtype: torch.dtype, seed: int, accum: Optional[str] = None) -> list[str]:
    """The differences between the plan's simulated outputs and the canonical ones."""
    xs = _inputs(plan.world_size, numel, dtype, seed)
    got = sim_run(plan, xs, accum=accum)
    return _differences(got, _canonical(plan.collective, xs, accum))


def _sizes(n: int, instances: int) -> list[int]:
    """Input element counts: one element per chunk, uneven chunks, and (the pipelined plans'
    64-byte slices) several slices with a partial last one."""
    grid = n * instances
    return [grid, grid * 37 + n, grid * 96 + 5 * n]


def _build(name: str, n: int, instances: int = 1, inplace: bool = False, **kw: Any) -> Any:
    return ALGORITHMS[name].build(n, instances=instances, inplace=inplace, **{**FAST_KW.get(name, {}), **kw})


# -- the promise ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_library_promises_batch_invariance_of_what_it_reduces(name):
    info = ALGORITHMS[name]
    v = info.variants[0]
    plan = info.build(v.ranks, instances=v.instances, **v.kwargs())
    if not TABLE[info.collective].reduces:
        assert plan.batch_invariant is None, name        # nothing reduced: nothing to promise
    elif name == "allreduce_hierarchical":
        # per-node partial sums, (x0 + x1) + (x2 + x3); one GPU per node is one sum in rank order
        assert plan.batch_invariant is (dict(v.params)["gpus_per_node"] == 1)
    else:
        assert plan.batch_invariant is True, name


def test_the_shipped_plans_keep_the_promise(shipped_plans):
    for path in shipped_plans:
        doc = json.loads(path.read_text())   # the promise as written (test_algorithms checks the plans)
        promise = doc.get("batch_invariant")
        if not TABLE[doc["collective"]].reduces:
            assert promise is None, path.name
        elif path.name.startswith("allreduce_hierarchical."):
            assert promise is (".gpus_per_node1." in path.name), path.name
        else:
            assert promise is True, path.name


# -- the numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", (3, 4, 8))
@pytest.mark.parametrize("name", REDUCING)
def test_every_reduced_element_is_the_rank_order_fold(name, n):
    """In and out of place, one and two instances, every size of :func:`_sizes` (each in one
    of the 16/32-bit dtypes, by turns), fp8 with both accumulation dtypes."""
    info = ALGORITHMS[name]
    kw = {"gpus_per_node": 1} if name == "allreduce_hierarchical" else {}
    bad = []
    for k, inplace in ((1, info.inplace_modes[-1]), (2, info.inplace_modes[0])):
        plan = _build(name, n, k, inplace, **kw)
        for i, numel in enumerate(_sizes(n, k)):
            dt = DTYPES[(i + k) % len(DTYPES)]
            bad += [f"{plan.name} {numel} x {dt}: {d}" for d in _check(plan, numel, dt, numel)]
        for (tdt, _), accum in zip(FP8, ACCUM_DTYPES):
            numel = _sizes(n, k)[-1]
            bad += [f"{plan.name} {numel} x {tdt} ({accum}): {d}" for d in _check(plan, numel, tdt, n, accum)]
    assert not bad, "\n".join(bad[:10])


def test_hierarchical_partial_sums_are_not_canonical():
    """The disclaimer is not idle: 2 nodes of 2 GPUs sum (x0 + x1) + (x2 + x3)."""
    plan = ALGORITHMS["allreduce_hierarchical"].build(4, gpus_per_node=2)
    assert plan.batch_invariant is False
    assert _check(plan, 4 * 64, torch.float32, 1)


def _fused_check(plan: Any, rows: int, hidden: int, dtype: torch.dtype, seed: int) -> list[str]:
    """The fused plan's residuals against residual + the rank-order fold (outputs: their norm,
    which the simulator's own postcondition holds)."""
    n = plan.world_size
    xs = _inputs(n, rows * hidden, dtype, seed)
    res = _inputs(1, rows * hidden, dtype, seed + 1)[0]
    w = np.ones(hidden, dtype=np.float32)
    run = run_fused(plan, xs, [res] * n, EpilogueParams(hidden=hidden, weight=w))
    assert not run.problems, run.problems[:3]
    total = reference_outputs("allreduce", xs)[0]
    want = reference_outputs("allreduce", [total, res])[0]   # radd: the sum, then the residual
    return _differences(run.residuals, [want] * n)


@pytest.mark.parametrize("n", (3, 4, 8))
@pytest.mark.parametrize("name", FUSED)
def test_fused_residuals_hold_the_rank_order_fold(name, n):
    plan = ALGORITHMS[name].build(n)
    bad = []
    for i, rows in enumerate((1, 7, 2 * n + 1, 4 * n)):   # a row, fewer rows than ranks, more
        dt = DTYPES[i % len(DTYPES)]
        bad += [f"{plan.name} {rows} rows x {dt}: {d}" for d in _fused_check(plan, rows, 64, dt, rows)]
    assert not bad, "\n".join(bad[:10])


# -- the sweep --------------------------------------------------------------------------------------


def _shipped_grids(name: str) -> list[tuple[int, Any]]:
    """(instances, params) of the algorithm's shipped variants, each once."""
    seen: dict[tuple[int, Any], None] = {}
    for v in ALGORITHMS[name].variants:
        seen.setdefault((v.instances, v.params), None)
    return list(seen)


@pytest.mark.slow
@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("name", REDUCING + FUSED)
def test_sweep_every_world_size_grid_and_slice(name, n):
    """Every world size 2..8, the shipped grids (instances, pipeline steps) at the shipped slice
    size: one element per chunk and uneven chunks (a dtype by turns, fp8 with both accumulation
    dtypes); the pipelined plans also several slices of the shipped unit with a partial last one."""
    bad = []
    for i, (k, params) in enumerate(_shipped_grids(name)):
        kw = {key: v for key, v in params if key != "quant"}
        if kw.get("gpus_per_node", 1) != 1:
            continue   # per-node partial sums (test_hierarchical_partial_sums_are_not_canonical)
        try:
            plan = ALGORITHMS[name].build(n, instances=k, min_message_size=0, **kw)
        except DSLError as e:
            if "port requests" in str(e):
                continue   # a grid this world size does not take (the port request budget)
            raise
        if name in FUSED:
            for j, rows in enumerate((1, n * k + 3, 64)):
                dt = DTYPES[(i + j) % len(DTYPES)]
                bad += [f"{plan.name} {rows} rows {dt}: {d}" for d in _fused_check(plan, rows, 256, dt, rows)]
            continue
        grid = n * k
        for j, numel in enumerate((grid, grid * 129 + n)):
            dt = DTYPES[(i + j) % len(DTYPES)]
            bad += [f"{plan.name} {numel} {dt}: {d}" for d in _check(plan, numel, dt, numel)]
        for (tdt, _), accum in zip(FP8, ACCUM_DTYPES):
            bad += [f"{plan.name} {grid * 33} {tdt} ({accum}): {d}" for d in _check(plan, grid * 33, tdt, n, accum)]
        if name in FAST_KW and i == 0:   # 2.5 slices of the shipped unit per chunk (or pipeline step)
            numel = grid * 5 * 64 * 1024 // 2 + 3 * n
            bad += [f"{plan.name} {numel} float16: {d}" for d in _check(plan, numel, torch.float16, 7)]
    assert not bad, "\n".join(bad[:10])


# -- the DSL call that places the local source anywhere ---------------------------------------------


def _zero_copy_reducescatter(n: int, reduce) -> Any:
    """A zero-copy reduce-scatter whose reduction ``reduce(ch, r, peers)`` records."""
    from mscclang.dsl import CollectiveProgram, MemoryChannel, Rank, ReduceScatter, SyncType

    with CollectiveProgram("rs", ReduceScatter(n, 1, False), n, consistent=True) as prog:
        ch = {(r, p): MemoryChannel(p, r) for r in range(n) for p in range(n) if p != r}
        for r in range(n):
            peers = [p for p in range(n) if p != r]
            for p in peers:
                ch[(r, p)].signal(tb=0, data_sync=SyncType.none, relaxed=True)
            for p in peers:
                ch[(r, p)].wait(tb=0, data_sync=SyncType.after, relaxed=True)
            reduce(ch, r, peers, Rank)
            for p in peers:
                ch[(r, p)].signal(tb=0, data_sync=SyncType.before)
            for p in peers:
                ch[(r, p)].wait(tb=0, data_sync=SyncType.after)
    return prog.to_plan()


def test_read_reduce_is_the_fused_chain_with_the_local_source_anywhere():
    from mscclang.dsl import read_reduce

    def chain(ch, r, peers, Rank):
        acc = Rank(r).get_input_buffer()[r:r + 1]
        for p in peers:
            ch[(r, p)].reduce(acc, [Rank(p).get_input_buffer()[r:r + 1]], tb=0,
                              local_dst_chunk=Rank(r).get_output_buffer()[0:1])
            acc = Rank(r).get_output_buffer()[0:1]

    def one_op(pos):
        def reduce(ch, r, peers, Rank):
            read_reduce([ch[(r, p)] for p in peers], Rank(r).get_input_buffer()[r:r + 1],
                        [Rank(p).get_input_buffer()[r:r + 1] for p in peers], tb=0,
                        local_dst_chunk=Rank(r).get_output_buffer()[0:1], src_position=pos(r))
        return reduce

    def ops(plan):
        return [[(o.name, o.src_buff, o.dst_buff, o.channel_ids, o.src0_position) for tb in g.threadblocks
                 for o in tb.ops] for g in plan.gpus]

    assert ops(_zero_copy_reducescatter(4, chain)) == ops(_zero_copy_reducescatter(4, one_op(lambda r: 0)))
    plan = _zero_copy_reducescatter(4, one_op(lambda r: r))
    assert [[o.src0_position for tb in g.threadblocks for o in tb.ops if o.name.value == "rre"]
            for g in plan.gpus] == [[None], [1], [2], [3]]
    assert not _check(plan, 4 * 37, torch.float32, 3)                  # the rank-order fold
    assert _check(_zero_copy_reducescatter(4, chain), 4 * 37, torch.float32, 3)   # own first: not


@pytest.mark.parametrize("case, needle", [
    ("no channels", "channels must be a non-empty list of MemoryChannels"),
    ("port channel", "channels must be a non-empty list of MemoryChannels"),
    ("one chunk short", "needs one remote chunk per channel and channels of one rank: 3 channels, 2 remote"),
    ("two ranks' channels", "channels of one rank"),
    ("chunk of another peer", "read_reduce(rank 0): remote source 0 rank 1 input[0:1] must belong to rank 2"),
    ("position past the end", "src_position must be an int from 0 to 3"),
])
def test_read_reduce_refuses_bad_arguments(case, needle):
    from mscclang.dsl import CollectiveProgram, MemoryChannel, PortChannel, Rank, ReduceScatter, read_reduce
    from mscclang.errors import DSLError

    with CollectiveProgram("rs", ReduceScatter(4, 1, False), 4):
        ch = [MemoryChannel(p, 0) for p in (1, 2, 3)]
        own, chunks = Rank(0).get_input_buffer()[0:1], [Rank(p).get_input_buffer()[0:1] for p in (1, 2, 3)]
        args = {"no channels": ([], own, chunks),
                "port channel": ([PortChannel(1, 0)], own, chunks[:1]),
                "one chunk short": (ch, own, chunks[:2]),
                "two ranks' channels": ([ch[0], MemoryChannel(0, 1)], own, chunks[:2]),
                "chunk of another peer": (ch[1:], own, chunks[:2]),
                "position past the end": (ch, own, chunks)}[case]
        with pytest.raises(DSLError) as e:
            read_reduce(*args, tb=0, src_position=4 if case == "position past the end" else 0)
    assert needle in str(e.value), str(e.value)
