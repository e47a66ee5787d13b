"""Collective definitions as data: chunk counts, buffer aliasing, precondition, postcondition.

This module sits at the plan level so that the simulator (which never imports the DSL) can check
a plan against the collective it claims to implement. The DSL's collective classes wrap these.

Precondition: chunk ``k`` of rank ``r``'s input holds the symbol ``(r, k)``.
Postcondition: for every output chunk, an :class:`Expect`: the symbols that must reach it, and
whether they are reduced (each exactly once) or copied (exactly one symbol).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from mscclang.errors import CommError, PlanError

if TYPE_CHECKING:  # pragma: no cover
    from mscclang.plan.models import Plan

#: every plan ``collective`` name (the one list; the others below are its subsets)
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "sendrecv", "broadcast",
               "allreduce_add_rms_norm", "test", "custom")
#: the fused allreduce + residual add + RMSNorm (plan/2; docs/semantics.md, "Epilogue ops")
FUSED_NORM = "allreduce_add_rms_norm"

#: API name (``Communicator`` method) -> plan ``collective`` name, for the collectives the
#: communicator runs
API_TO_PLAN: dict[str, str] = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "reduce_scatter": "reducescatter",
    "all_to_all": "alltoall",
    "broadcast": "broadcast",
    "send_recv": "sendrecv",
}
#: plan ``collective`` name -> API name
PLAN_TO_API: dict[str, str] = {v: k for k, v in API_TO_PLAN.items()}
#: the API names, in the order of :data:`API_TO_PLAN`
API_COLLECTIVES: tuple[str, ...] = tuple(API_TO_PLAN)

#: collectives an out-of-place call may run on an in-place plan by first copying its input into
#: the output (their in-place plans read the input from where the output lies)
INPLACE_COPY_COLLECTIVES: tuple[str, ...] = ("allreduce", "broadcast", "alltoall", "allgather", "sendrecv")
#: collectives whose buffers hold one block per rank, so that blocks start inside the buffer
#: (allgather's output, reduce-scatter's input, all-to-all's both)
MULTI_BLOCK_COLLECTIVES: tuple[str, ...] = ("allgather", "reducescatter", "alltoall")

#: collectives whose plans state no postcondition (op-emission tests and experiments): the
#: simulator checks them for deadlocks and races only
NO_POSTCONDITION = ("test", "custom")


def unknown_collective_message(name: object) -> str:
    """The error text for a collective name that is not one of :data:`COLLECTIVES`."""
    close = difflib.get_close_matches(str(name), COLLECTIVES, n=1) if isinstance(name, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown collective {name!r}{hint}; known: {', '.join(COLLECTIVES)}"


def find_plan_collective(name: str) -> Optional[str]:
    """Plan name of a collective the communicator runs, given either spelling (``all_reduce``,
    ``allreduce``, ``All-Reduce``), or ``None`` when it names none."""
    key = str(name).strip().lower().replace("-", "_")
    if key in API_TO_PLAN:
        return API_TO_PLAN[key]
    key2 = key.replace("_", "")
    if key2 in PLAN_TO_API:
        return key2
    return None


def unknown_api_collective_message(name: object) -> str:
    """The error text for a name :func:`find_plan_collective` does not know."""
    return f"unknown collective {name!r}; known: {', '.join(API_TO_PLAN)}"


def plan_collective(name: str) -> str:
    """Plan name of a collective given either spelling (``all_reduce`` or ``allreduce``);
    :class:`~mscclang.errors.CommError` (an ``InvalidCall``) naming the known API names for
    anything else."""
    found = find_plan_collective(name)
    if found is None:
        raise CommError(unknown_api_collective_message(name))
    return found


@dataclass(frozen=True)
class Expect:
    """What one output chunk must hold: ``sources`` are (rank, input chunk) pairs; with
    ``reduced`` the chunk is the reduction of all of them (each exactly once), otherwise
    ``sources`` has one entry and the chunk is a copy of it."""

    sources: tuple[tuple[int, int], ...]
    reduced: bool


@dataclass(frozen=True)
class CollectiveSpec:
    """A collective over ``num_ranks`` ranks with ``chunk_factor`` chunks per rank."""

    name: str
    num_ranks: int
    chunk_factor: int
    inplace: bool = False
    root: Optional[int] = None
    input_chunks_override: Optional[int] = None
    output_chunks_override: Optional[int] = None
    #: sendrecv only: ``senders[r]`` is the rank whose input rank ``r`` receives (a permutation
    #: of the ranks); ``None`` means rank ``r - 1`` (a ring)
    senders: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.name not in COLLECTIVES:
            raise PlanError(unknown_collective_message(self.name), "collective")
        if self.num_ranks < 1:
            raise PlanError(f"a collective needs at least one rank, got {self.num_ranks}")
        if self.name == "broadcast" and (self.root is None or not 0 <= self.root < self.num_ranks):
            raise PlanError(f"broadcast root {self.root} is not a rank of {self.num_ranks}")
        if self.senders is not None:
            if self.name != "sendrecv":
                raise PlanError(f"senders are only meaningful for sendrecv, not {self.name}")
            check_senders(self.senders, self.num_ranks)

    @property
    def has_postcondition(self) -> bool:
        """Whether the collective says what its outputs must hold (``test``/``custom``: no)."""
        return self.name not in NO_POSTCONDITION

    def sender(self, rank: int) -> int:
        """sendrecv: the rank whose input ``rank`` receives."""
        if self.senders is not None:
            return self.senders[rank]
        return (rank - 1) % self.num_ranks

    @property
    def input_chunks(self) -> int:
        n, f = self.num_ranks, self.chunk_factor
        if self.input_chunks_override is not None:
            return self.input_chunks_override
        return {"allgather": f, "allreduce": n * f, "reducescatter": n * f, "alltoall": n * f,
                "sendrecv": f, "broadcast": f, FUSED_NORM: n * f}.get(self.name, f)

    @property
    def output_chunks(self) -> int:
        n, f = self.num_ranks, self.chunk_factor
        if self.output_chunks_override is not None:
            return self.output_chunks_override
        return {"allgather": n * f, "allreduce": n * f, "reducescatter": f, "alltoall": n * f,
                "sendrecv": f, "broadcast": f, FUSED_NORM: n * f}.get(self.name, f)

    @property
    def is_reduction(self) -> bool:
        return self.name in ("allreduce", "reducescatter", FUSED_NORM)

    def input_in_output(self, rank: int) -> Optional[int]:
        """For in-place collectives: the output chunk index where ``rank``'s input starts (the
        input aliases the output from there on); ``None`` when out of place."""
        if not self.inplace:
            return None
        if self.name == "allgather":
            return rank * self.chunk_factor
        if self.name in ("allreduce", "alltoall", "sendrecv", "broadcast", FUSED_NORM, "test", "custom"):
            return 0
        return None

    def output_in_input(self, rank: int) -> Optional[int]:
        """For in-place reducescatter: the input chunk index where ``rank``'s output starts."""
        if self.inplace and self.name == "reducescatter":
            return rank * self.chunk_factor
        return None

    def expect(self, rank: int, chunk: int) -> Optional[Expect]:
        """What output chunk ``chunk`` of ``rank`` must hold (``None``: unconstrained)."""
        n, f = self.num_ranks, self.chunk_factor
        name = self.name
        if name in ("allreduce", FUSED_NORM):  # the fused output: the norm of the reduced rows
            return Expect(tuple((p, chunk) for p in range(n)), True)
        if name == "allgather":
            p, j = divmod(chunk, f)
            return Expect(((p, j),), False)
        if name == "reducescatter":
            return Expect(tuple((p, rank * f + chunk) for p in range(n)), True)
        if name == "alltoall":
            p, j = divmod(chunk, f)
            return Expect(((p, rank * f + j),), False)
        if name == "sendrecv":
            return Expect(((self.sender(rank), chunk),), False)
        if name == "broadcast":
            return Expect(((self.root, chunk),), False)  # type: ignore[arg-type]
        return None

    def postcondition(self) -> dict[tuple[int, int], Expect]:
        """Every constrained (rank, output chunk) and what it must hold."""
        out: dict[tuple[int, int], Expect] = {}
        for r in range(self.num_ranks):
            for c in range(self.output_chunks):
                e = self.expect(r, c)
                if e is not None:
                    out[(r, c)] = e
        return out


def check_senders(senders: Sequence[int], num_ranks: int) -> tuple[int, ...]:
    """Validate a sendrecv sender map (``senders[r]``: the rank ``r`` receives from): one entry
    per rank, each a rank, every rank sending to exactly one rank (a permutation)."""
    s = tuple(senders)
    if len(s) != num_ranks:
        raise PlanError(f"senders has {len(s)} entries but the plan has {num_ranks} ranks")
    for r, p in enumerate(s):
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < num_ranks:
            raise PlanError(f"senders[{r}] = {p!r} is not a rank of {num_ranks}")
    seen: dict[int, int] = {}
    for r, p in enumerate(s):
        if p in seen:
            raise PlanError(f"ranks {seen[p]} and {r} both receive from rank {p}: a send/recv "
                            "sender map must be a permutation (every rank sends to one rank)")
        seen[p] = r
    return s


def spec_from_plan(plan: "Plan", senders: Optional[Sequence[int]] = None) -> CollectiveSpec:
    """Recover the collective's spec from a plan's metadata and rank 0's chunk counts.

    ``senders`` (sendrecv only) gives, per rank, the rank whose input it receives; the default is
    rank ``r - 1``. An unknown collective name raises :class:`PlanError` at JSON path
    ``collective``."""
    n = len(plan.gpus)
    name = plan.collective
    if name not in COLLECTIVES:
        raise PlanError(unknown_collective_message(name), "collective")
    if not plan.gpus:
        raise PlanError("a plan needs at least one rank", "gpus")
    g = plan.gpus[0]
    f = plan.chunk_factor
    if f is None:
        if name == "allgather":
            f = g.input_chunks
        elif name in ("allreduce", "reducescatter", "alltoall", FUSED_NORM):
            if g.input_chunks % n:
                raise PlanError(f"{name} plan has {g.input_chunks} input chunks, not a multiple of {n} ranks", "gpus[0].input_chunks")
            f = g.input_chunks // n
        else:
            f = g.input_chunks or g.output_chunks
    kw: dict = {}
    if name in NO_POSTCONDITION:
        kw = dict(input_chunks_override=g.input_chunks, output_chunks_override=g.output_chunks)
    if senders is not None:
        kw["senders"] = tuple(senders)
    return CollectiveSpec(name, n, f, plan.inplace, plan.root, **kw)
