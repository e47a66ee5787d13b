"""Shapes of a collective's buffers as blocks, and the padding that makes each block a multiple
of a granule (the tail handling of the communicator).

A collective's buffers are ``blocks x block_elems`` (docs/semantics.md, "Bytes"; ``mscclang.plan.layout``): the
allgather input is one block and its output ``n`` blocks; reduce-scatter the reverse; all-to-all
``n`` blocks on both sides; allreduce and broadcast one block. When a runtime needs every block
to be a multiple of ``granule`` bytes, the communicator stages the call through buffers whose
blocks are padded to ``padded_block_elems`` elements: the input is copied block by block into the
padded buffer, the plan runs on the padded size, and the first ``block_elems`` elements of each
output block are copied back. Pad elements are never read back, so their content does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass

from mscclang.comm.errors import CommError
from mscclang.comm.names import plan_collective


@dataclass(frozen=True)
class BlockShape:
    """``in_blocks`` x ``block_elems`` input elements, ``out_blocks`` x ``block_elems`` output."""

    in_blocks: int
    out_blocks: int
    block_elems: int

    @property
    def in_elems(self) -> int:
        return self.in_blocks * self.block_elems

    @property
    def out_elems(self) -> int:
        return self.out_blocks * self.block_elems

    def padded(self, block_elems: int) -> "BlockShape":
        return BlockShape(self.in_blocks, self.out_blocks, block_elems)


def block_shape(collective: str, world_size: int, in_elems: int, out_elems: int) -> BlockShape:
    """Block structure of a call; raises :class:`CommError` when the element counts do not fit
    the collective (e.g. an all-to-all input not divisible by the world size)."""
    coll = plan_collective(collective)
    n = world_size
    if coll == "allgather":
        if out_elems != n * in_elems:
            raise CommError(f"all_gather needs an output of {n} x {in_elems} = {n * in_elems} "
                            f"elements, got {out_elems}")
        return BlockShape(1, n, in_elems)
    if coll == "reducescatter":
        if in_elems != n * out_elems:
            raise CommError(f"reduce_scatter needs an input of {n} x {out_elems} = {n * out_elems} "
                            f"elements, got {in_elems}")
        return BlockShape(n, 1, out_elems)
    if coll == "alltoall":
        if in_elems != out_elems:
            raise CommError(f"all_to_all needs equal input and output element counts, got "
                            f"{in_elems} and {out_elems}")
        if in_elems % n:
            raise CommError(f"all_to_all needs an element count divisible by the world size {n}, "
                            f"got {in_elems}")
        return BlockShape(n, n, in_elems // n)
    if in_elems != out_elems:
        raise CommError(f"{coll} needs equal input and output element counts, got {in_elems} "
                        f"and {out_elems}")
    return BlockShape(1, 1, in_elems)


def padded_block_elems(block_elems: int, elem_size: int, granule: int) -> int:
    """Smallest element count >= ``block_elems`` whose byte size is a multiple of ``granule``
    (and at least one element, so an empty block stays empty only when ``block_elems`` is 0)."""
    if granule <= 0 or elem_size <= 0:
        raise CommError(f"granule and element size must be positive, got {granule} and {elem_size}")
    if block_elems == 0:
        return 0
    nbytes = block_elems * elem_size
    padded_bytes = -(-nbytes // granule) * granule
    # granule may not be a multiple of elem_size (e.g. 2-byte granule, 4-byte elements)
    return -(-padded_bytes // elem_size)


def needs_padding(shape: BlockShape, elem_size: int, granule: int) -> bool:
    """Whether a block's byte size is not a multiple of the granule."""
    return shape.block_elems > 0 and (shape.block_elems * elem_size) % granule != 0


def message_bytes(collective: str, in_bytes: int, out_bytes: int) -> int:
    """The size a plan's range and the tuning thresholds are compared with: allgather's output,
    every other collective's input."""
    return out_bytes if plan_collective(collective) == "allgather" else in_bytes
