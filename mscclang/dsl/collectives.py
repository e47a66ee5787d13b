"""Collectives of the DSL. Each wraps a :class:`mscclang.plan.collectives.CollectiveSpec`, which
states the collective's chunk counts, its precondition and its postcondition as data."""

from __future__ import annotations

from typing import Optional

from mscclang.errors import DSLError, PlanError
from mscclang.plan.collectives import FUSED_NORM, CollectiveSpec, Expect
from mscclang.plan.models import BufferKind

__all__ = ["AllGather", "AllGatherV", "AllReduce", "AllReduceAddRMSNorm", "AllToAll", "AllToAllV", "Broadcast",
           "Collective", "ReduceScatter", "SendRecv", "TestCollective"]


class Collective:
    """Base class: ``num_ranks`` ranks, ``chunk_factor`` chunks per rank block, ``inplace``.

    In-place collectives keep separate input and output buffers in the program (as MSCCL++ does);
    the plan's ``inplace`` flag tells the runtime that the input aliases the output (at
    ``spec.input_in_output(rank)``).
    """

    name = "custom"

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool,
                 root: Optional[int] = None, input_size: Optional[int] = None,
                 output_size: Optional[int] = None) -> None:
        for what, v in (("num_ranks", num_ranks), ("chunk_factor", chunk_factor)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DSLError(f"{type(self).__name__}: {what} must be a positive int, got {v!r}")
        self.num_ranks = num_ranks
        self.chunk_factor = chunk_factor
        self.inplace = bool(inplace)
        try:
            self.spec = CollectiveSpec(self.name, num_ranks, chunk_factor, self.inplace, root,
                                       input_size, output_size)
        except PlanError as e:
            raise DSLError(f"{type(self).__name__}: {e.message}") from None

    @property
    def input_chunks(self) -> int:
        """Input chunks per rank."""
        return self.spec.input_chunks

    @property
    def output_chunks(self) -> int:
        """Output chunks per rank."""
        return self.spec.output_chunks

    def buffer_sizes(self) -> dict[BufferKind, int]:
        return {BufferKind.input: self.input_chunks, BufferKind.output: self.output_chunks}

    def precondition(self) -> dict[tuple[int, int], tuple[int, int]]:
        """What every input chunk holds: ``(rank, chunk) -> symbol (rank, chunk)``."""
        return {(r, c): (r, c) for r in range(self.num_ranks) for c in range(self.input_chunks)}

    def postcondition(self) -> dict[tuple[int, int], Expect]:
        """What every constrained output chunk must hold: ``(rank, chunk) -> Expect`` (the input
        chunks it must equal, or the set reduced into it)."""
        return self.spec.postcondition()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_ranks}, {self.chunk_factor}, inplace={self.inplace})"


class _PlainCollective(Collective):
    """Base of the collectives whose only parameters are ``num_ranks``, ``chunk_factor`` and
    ``inplace`` (no root, no free chunk counts)."""

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool) -> None:
        super().__init__(num_ranks, chunk_factor, inplace)


class AllGather(_PlainCollective):
    """Every rank ends with all ranks' inputs: input ``f`` chunks, output ``n*f``."""

    name = "allgather"


class AllReduce(_PlainCollective):
    """Every output chunk is the reduction of that chunk over all ranks: ``n*f`` / ``n*f``."""

    name = "allreduce"


class AllReduceAddRMSNorm(_PlainCollective):
    """The fused allreduce + residual add + RMSNorm (``allreduce_add_rms_norm``, a plan/2
    collective): chunks as :class:`AllReduce` (``n*f`` / ``n*f``), plus the residual buffer
    (``Rank.get_residual_buffer()``, the input's chunks). Every rank's residual must end as
    ``residual + allreduce(input)`` and its output as the RMSNorm of those rows; the row length,
    weight and eps are execution parameters (docs/semantics.md, "Epilogue ops")."""

    name = FUSED_NORM

    def buffer_sizes(self) -> dict[BufferKind, int]:
        return {**super().buffer_sizes(), BufferKind.residual: self.input_chunks}


class ReduceScatter(_PlainCollective):
    """Rank ``r`` ends with block ``r`` reduced over all ranks: ``n*f`` / ``f``."""

    name = "reducescatter"


class AllToAll(_PlainCollective):
    """Block ``p`` of rank ``r``'s output is block ``r`` of rank ``p``'s input: ``n*f`` / ``n*f``."""

    name = "alltoall"


class CountedCollective(Collective):
    """Base of the collectives with data-dependent counts (ours; docs/dsl.md, "Data-dependent
    counts"): one segment per count entry, out of place; ``chunk_factor`` and ``inplace`` exist
    so that the library's builders call every collective alike (DSLError for other values)."""

    def __init__(self, num_ranks: int, chunk_factor: int = 1, inplace: bool = False) -> None:
        if chunk_factor != 1 or inplace:
            raise DSLError(f"{type(self).__name__}: one segment per count entry, out of place (chunk_factor=1, "
                           f"inplace=False), got chunk_factor={chunk_factor!r}, inplace={inplace!r}")
        super().__init__(num_ranks, 1, False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_ranks})"


class AllToAllV(CountedCollective):
    """All-to-all with data-dependent counts: rank ``r``'s input is ``n`` segments, segment ``p``
    the ``counts[r][p]`` rows for rank ``p``; its output is ``n`` segments, segment ``p`` the
    ``counts[p][r]`` rows from rank ``p``, which must equal input segment ``r`` of rank ``p``.
    The counts are read at run time."""

    name = "alltoallv"


class AllGatherV(CountedCollective):
    """All-gather with data-dependent counts: rank ``r``'s input is one segment of
    ``counts[r][r]`` rows; its output is ``n`` segments, segment ``p`` rank ``p``'s rows."""

    name = "allgatherv"


class SendRecv(_PlainCollective):
    """Rank ``r`` receives rank ``r-1``'s input: ``f`` / ``f``."""

    name = "sendrecv"


class Broadcast(Collective):
    """Every rank ends with the root's input: ``f`` / ``f`` (ours; MSCCL++'s DSL has none)."""

    name = "broadcast"

    def __init__(self, num_ranks: int, chunk_factor: int, root: int = 0, inplace: bool = False) -> None:
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < num_ranks:
            raise DSLError(f"Broadcast: root {root!r} is not a rank of {num_ranks}")
        super().__init__(num_ranks, chunk_factor, inplace, root=root)
        self.root = root

    def __repr__(self) -> str:
        return f"Broadcast({self.num_ranks}, {self.chunk_factor}, root={self.root})"


class TestCollective(Collective):
    """A collective with free chunk counts and no postcondition (for tests and experiments)."""

    name = "test"
    __test__ = False  # not a pytest test class

    def __init__(self, num_ranks: int, input_size: int, output_size: int) -> None:
        for what, v in (("input_size", input_size), ("output_size", output_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise DSLError(f"TestCollective: {what} must be a non-negative int, got {v!r}")
        super().__init__(num_ranks, 1, False, input_size=input_size, output_size=output_size)
        self.input_size = input_size
        self.output_size = output_size

    def __repr__(self) -> str:
        return f"TestCollective({self.num_ranks}, {self.input_size}, {self.output_size})"
