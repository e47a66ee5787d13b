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

from mscclang.comm.errors import CommError
from mscclang.plan.collectives import BlockShape

__all__ = ["padded_block_elems", "needs_padding"]


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
