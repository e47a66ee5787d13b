"""The definition of every collective's result: which input elements each output element of a
rank comes from (:func:`output_blocks`) and, for numpy inputs, the reference output itself
(:func:`reference_output`). This is the one place the checks of ``mscclang run``, the CPU
simulator backend of the communicator and the benchmark's check take the expected result from.

Definitions, for ``n`` ranks with per-rank inputs ``x[0] .. x[n-1]`` (``k`` elements a block):

* ``allreduce``: every rank's output is ``reduce(x[0], x[1], ..., x[n-1])``;
* ``allgather``: every rank's output is ``x[0] ++ x[1] ++ ... ++ x[n-1]`` (input ``k``, output ``n k``);
* ``reducescatter``: rank ``r``'s output is ``reduce`` of block ``r`` of every input (input ``n k``,
  output ``k``);
* ``alltoall``: block ``p`` of rank ``r``'s output is block ``r`` of ``x[p]`` (input = output = ``n k``);
* ``broadcast``: every rank's output is ``x[root]``;
* ``sendrecv``: rank ``r``'s output is ``x[(r - 1) mod n]`` (each rank sends to the next).

``reduce`` is ``sum``, ``min`` or ``max``, applied in rank order 0, 1, ..., n-1 (left to right,
``((x0 OP x1) OP x2) ...``): float16 and bfloat16 compute every step in float32 and round back to
the element type, float32 computes in float32, integer sums wrap around (two's complement), min
and max are exact; fp8 sums convert every source to the accumulation dtype (float32 or float16),
add in rank order in it and round once to fp8 (:func:`fp8_sum_arrays`). This is the *canonical
result* of docs/semantics.md ("Batch invariance"): a plan that promises batch invariance computes
these bits at every size; ``mscclang.reference`` gives them for torch tensors. A plan without the
promise may sum in another order, and a check of it compares within an error bound where the order
matters (floating-point sums of 3 or more ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from mscclang.plan.collectives import TABLE
from mscclang.plan.dtypes import ACCUM_DTYPES, numpy_dtype_info
from mscclang.plan.models import REDUCE_OP_NAMES

#: the collectives defined here (plan spelling)
COLLECTIVES: tuple[str, ...] = tuple(c.name for c in TABLE.values() if c.api and not c.fused and not c.counted)


@dataclass(frozen=True)
class OutputBlock:
    """``output[out_start : out_start + length]`` of one rank is the reduction (in the order of
    ``sources``) of ``inputs[s][in_start : in_start + length]`` for every ``s`` in ``sources``;
    with one source it is a copy."""

    out_start: int
    length: int
    sources: tuple[int, ...]
    in_start: int

    @property
    def reduced(self) -> bool:
        """Whether the block combines several ranks' elements (a reduction, not a copy)."""
        return len(self.sources) > 1


def _check(collective: str, world_size: int) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"no reference for collective {collective!r}; defined: {', '.join(COLLECTIVES)}")
    if world_size < 1:
        raise ValueError(f"world size {world_size}: need at least 1 rank")


def output_elems(collective: str, world_size: int, in_elems: int) -> int:
    """The output element count of one rank for an input of ``in_elems`` elements; ValueError
    when ``in_elems`` does not fit the collective (reducescatter and alltoall inputs must be a
    multiple of the world size)."""
    _check(collective, world_size)
    row = TABLE[collective]
    bi, bo = row.blocks(world_size)
    if in_elems % bi:
        raise ValueError(f"{collective} needs an input element count divisible by the world size {world_size}, "
                         f"got {in_elems}")
    return row.output_elems(world_size, in_elems)


def output_blocks(collective: str, world_size: int, rank: int, in_elems: int,
                  root: Optional[int] = None) -> list[OutputBlock]:
    """Where every output element of ``rank`` comes from, as blocks in output order (see the
    module's definitions). ``root`` is broadcast's source rank (default 0); sendrecv's sender is
    the previous rank. ValueError for an unknown collective, a rank or root outside
    ``0 .. world_size - 1`` or an input size that does not fit the collective."""
    output_elems(collective, world_size, in_elems)
    n = world_size
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} outside 0..{n - 1}")
    row = TABLE[collective]
    src = 0 if root is None else root
    if row.rooted and not 0 <= src < n:
        raise ValueError(f"{collective} root {src} outside 0..{n - 1}")
    bi, bo = row.blocks(n)
    k = in_elems // bi
    return [OutputBlock(p * k, k, row.source_ranks(n, p, src, (rank - 1) % n), row.source_block(rank) * k)
            for p in range(bo)]


def fp8_sum_arrays(views: Sequence[np.ndarray], dt: np.dtype, accum: str) -> np.ndarray:
    """The fp8 sum of one reduction op (docs/semantics.md, "FP8 reductions"): ``views`` (arrays
    of ``dt``, at least two): each converted (exactly) to ``accum`` (``float32`` or ``float16``),
    added in order in ``accum`` (each addition rounded to it, to nearest even; float16 may
    overflow to infinity), the result rounded once to ``dt``: to nearest even, values beyond the
    largest finite one (infinities too) to it with their sign, NaN to NaN (ml_dtypes' own casts
    do not saturate, so the value is clamped first)."""
    if accum not in ACCUM_DTYPES:
        raise ValueError(f"unknown accumulation dtype {accum!r} ({', '.join(ACCUM_DTYPES)})")
    adt, m = np.dtype(accum), numpy_dtype_info(dt).max_finite  # type: ignore[union-attr]
    with np.errstate(over="ignore", invalid="ignore"):
        acc = views[0].astype(adt)
        for v in views[1:]:
            acc = (acc + v.astype(adt)).astype(adt)
        return np.clip(acc, -m, m).astype(dt)


def reduce_arrays(arrays: Sequence[np.ndarray], reduce_op: str = "sum", accum: Optional[str] = None) -> np.ndarray:
    """``reduce_op`` of equally shaped numpy arrays in the given order: floating point (bfloat16
    included) in float32 each step, rounded back to the element type; fp8 (sum only) by
    :func:`fp8_sum_arrays` in ``accum`` (float32 when None), one reduction of every array;
    integers in their own type (sums wrap around). ``accum`` with another dtype: ValueError."""
    if reduce_op not in REDUCE_OP_NAMES:
        raise ValueError(f"reduce op {reduce_op!r}: one of {', '.join(REDUCE_OP_NAMES)}")
    if not arrays:
        raise ValueError("nothing to reduce (no arrays)")
    info = numpy_dtype_info(arrays[0].dtype)
    if info is not None and info.accumulates:
        if reduce_op != "sum":
            raise ValueError(f"reduce op {reduce_op!r} is not defined on {info.name} (sum only)")
        return arrays[0].copy() if len(arrays) == 1 else fp8_sum_arrays(arrays, arrays[0].dtype,
                                                                          accum or ACCUM_DTYPES[0])
    if accum is not None:
        raise ValueError(f"an accumulation dtype ({accum}) applies to fp8 only, not to {arrays[0].dtype}")
    f = {"sum": np.add, "min": np.minimum, "max": np.maximum}[reduce_op]
    dt = arrays[0].dtype
    if dt.kind in "iu":
        acc = arrays[0].copy()
        for a in arrays[1:]:
            acc = f(acc, a)
        return acc.astype(dt)
    acc = arrays[0].astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays[1:]:
            acc = f(acc, a.astype(np.float32)).astype(dt).astype(np.float32)  # round every step
    return acc.astype(dt)


def average(summed: np.ndarray, ranks: int) -> np.ndarray:
    """The ``avg`` reduction of ``ranks`` ranks from their ``sum`` (the torch backend's: the sum,
    then a division by the rank count as torch divides a CUDA tensor by a Python number):
    floating point ``round(f32(sum) * f32(1 / ranks))`` (the reciprocal rounded to float32 once;
    for 1, 2, 4 and 8 ranks it is exact and this is the correctly rounded quotient); integers
    divided, truncated toward zero. fp8 has no average (ValueError), nor has a rank count < 1."""
    if ranks < 1:
        raise ValueError(f"an average over {ranks} ranks")
    info = numpy_dtype_info(summed.dtype)
    if info is not None and info.accumulates:
        raise ValueError(f"avg is not defined on {info.name} (sum only)")
    if summed.dtype.kind in "iu":
        q = np.abs(summed.astype(np.int64)) // ranks
        return (np.sign(summed).astype(np.int64) * q).astype(summed.dtype)
    inv = np.float32(1.0) / np.float32(ranks)
    with np.errstate(over="ignore", invalid="ignore"):
        return (summed.astype(np.float32) * inv).astype(summed.dtype)


def reference_output(collective: str, inputs: Sequence[np.ndarray], rank: int, reduce_op: str = "sum",
                     root: Optional[int] = None, accum: Optional[str] = None) -> np.ndarray:
    """Rank ``rank``'s output of ``collective`` for numpy ``inputs`` (one 1-D array per rank, all
    of one dtype and size) by the module's definitions; ``accum``: the accumulation dtype of an
    fp8 reduction (float32 when None)."""
    if not inputs:
        raise ValueError("no inputs (one array per rank)")
    size, dt = inputs[0].size, inputs[0].dtype
    for p, x in enumerate(inputs):
        if x.size != size or x.dtype != dt:
            raise ValueError(f"input of rank {p}: {x.size} x {x.dtype}, rank 0 has {size} x {dt}")
    flat = [np.ascontiguousarray(x).reshape(-1) for x in inputs]
    blocks = output_blocks(collective, len(inputs), rank, size, root)
    out = np.empty(output_elems(collective, len(inputs), size), dtype=dt)
    for b in blocks:
        parts = [flat[s][b.in_start:b.in_start + b.length] for s in b.sources]
        out[b.out_start:b.out_start + b.length] = reduce_arrays(parts, reduce_op, accum) if b.reduced else parts[0]
    return out


def reference_outputs(collective: str, inputs: Sequence[np.ndarray], reduce_op: str = "sum",
                      root: Optional[int] = None, accum: Optional[str] = None) -> list[np.ndarray]:
    """Every rank's output (rank order): :func:`reference_output` of each rank."""
    return [reference_output(collective, inputs, r, reduce_op, root, accum) for r in range(len(inputs))]
