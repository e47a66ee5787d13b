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

from mscclang.errors import CommError, InvalidCall, PlanError

if TYPE_CHECKING:  # pragma: no cover
    from mscclang.plan.models import Plan

#: the fused allreduce + residual add + RMSNorm (plan/2; docs/semantics.md, "Epilogue ops")
FUSED_NORM = "allreduce_add_rms_norm"


@dataclass(frozen=True)
class Collective:
    """One collective's rules, the one home of each (every name list, size rule and in-place
    layout elsewhere is read from :data:`TABLE`). With ``n`` ranks and a chunk factor ``f``:

    * ``api``: its ``Communicator`` method (None: not one the communicator runs);
    * ``in_blocks`` / ``out_blocks``: how many blocks of one size each buffer holds, 1 or ``n``
      (``"n"``); ``in_chunks`` / ``out_chunks`` likewise for its chunks per ``f`` (``n f`` or ``f``);
    * ``message``: which side's bytes are the message size (plan ranges, tuning thresholds):
      ``"output"`` for allgather, else ``"input"``;
    * ``reduces``; ``inplace_copy``: an out-of-place call may run an in-place plan by copying its
      input into the output first; ``inplace``: where the input lies in the output (``"same"``: one
      buffer; ``"input_in_output"``: the input is block ``rank`` of the output;
      ``"output_in_input"``: the reverse); ``bus``: the nccl-tests bus-bandwidth factor's scale
      (``bus * (n - 1) / n``; 0: factor 1); ``sized``: the buffers' sizes follow from the blocks
      (test and custom plans' do not); ``postcondition``: it says what its outputs hold;
    * ``sources``: where output block ``p`` comes from: ``"all"`` ranks (reduced), ``"each"``
      (rank ``p``), the ``"root"`` (broadcast) or the rank's ``"sender"`` (sendrecv: the previous
      rank unless the plan names them); ``from_block``: which input block of those ranks,
      ``"0"`` or the receiving ``"rank"``'s; ``fused``: the epilogue collective (plan/2);
      ``torch``: its ``torch.distributed`` function (one tensor, or output and input);
      ``counted``: its buffers are segments whose row counts are read at run time from the
      call's count matrix (:meth:`segment_entries`; docs/semantics.md, "Data-dependent
      counts")."""

    name: str
    api: Optional[str]
    in_blocks: str = "1"
    out_blocks: str = "1"
    in_chunks: str = "n"
    out_chunks: str = "n"
    message: str = "input"
    reduces: bool = False
    inplace_copy: bool = True
    inplace: str = "same"
    bus: float = 0.0
    sized: bool = True
    postcondition: bool = True
    sources: str = "all"
    from_block: str = "0"
    fused: bool = False
    torch: Optional[str] = None
    counted: bool = False

    @property
    def rooted(self) -> bool:
        """Whether a call names a root (broadcast)."""
        return self.sources == "root"

    @property
    def has_senders(self) -> bool:
        """Whether a plan may name each rank's sender (sendrecv)."""
        return self.sources == "sender"

    def source_ranks(self, n: int, p: int, root: Optional[int] = None, sender: int = 0) -> tuple[int, ...]:
        """The ranks whose input reaches output block ``p`` (reduced when :attr:`reduces`)."""
        return {"all": tuple(range(n)), "each": (p,), "root": (root,), "sender": (sender,)}[self.sources]  # type: ignore[return-value]

    def source_block(self, rank: int) -> int:
        """Which input block of the source ranks reaches ``rank``'s output."""
        return rank if self.from_block == "rank" else 0

    def block_chunks(self, n: int, in_chunks: int, out_chunks: int) -> int:
        """The chunks of one block, from a plan's chunk counts (at least 1)."""
        bi, bo = self.blocks(n)
        if bi > 1:
            return max(1, in_chunks // bi)
        if bo > 1:
            return max(1, out_chunks // bo)
        return in_chunks or out_chunks or 1

    def blocks(self, n: int) -> tuple[int, int]:
        """(input blocks, output blocks) over ``n`` ranks."""
        return (n if self.in_blocks == "n" else 1), (n if self.out_blocks == "n" else 1)

    def chunks(self, n: int, f: int) -> tuple[int, int]:
        """(input chunks, output chunks) of one rank with chunk factor ``f``."""
        return (n * f if self.in_chunks == "n" else f), (n * f if self.out_chunks == "n" else f)

    @property
    def multi_block(self) -> bool:
        """Whether a buffer holds one block per rank (blocks start inside the buffer)."""
        return "n" in (self.in_blocks, self.out_blocks)

    def shape(self, n: int, in_elems: int, out_elems: int) -> "BlockShape":
        """The blocks of a call of ``in_elems`` and ``out_elems`` elements (counts or bytes);
        :class:`~mscclang.errors.InvalidCall` naming the rule when they do not fit."""
        bi, bo = self.blocks(n)
        api = self.api or self.name
        if bi > 1 and bo == 1:   # the input holds the blocks: its size follows from the output's
            if in_elems != bi * out_elems:
                raise InvalidCall(f"{api} needs an input of {bi} x {out_elems} = {bi * out_elems} elements, "
                                  f"got {in_elems}")
            return BlockShape(bi, 1, out_elems)
        if bo == 1 or bi > 1:
            if in_elems != out_elems:
                raise InvalidCall(f"{api} needs equal input and output element counts, got {in_elems} and "
                                  f"{out_elems}")
            if in_elems % bi:
                raise InvalidCall(f"{api} needs an element count divisible by the world size {n}, got {in_elems}")
            return BlockShape(bi, bo, in_elems // bi)
        if out_elems != bo * in_elems:
            raise InvalidCall(f"{api} needs an output of {bo} x {in_elems} = {bo * in_elems} elements, got "
                              f"{out_elems}")
        return BlockShape(1, bo, in_elems)

    def output_elems(self, n: int, in_elems: int) -> int:
        """One rank's output size for an input of ``in_elems`` (elements or bytes, whole blocks)."""
        bi, bo = self.blocks(n)
        return in_elems // bi * bo

    def call_bytes(self, n: int, message: int) -> tuple[int, int]:
        """(input, output) bytes of a call whose message size is ``message``."""
        bi, bo = self.blocks(n)
        if self.message == "output":
            return message // bo * bi, message
        return message, message // bi * bo

    def message_bytes(self, in_bytes: int, out_bytes: int) -> int:
        """The message size of a call: the side :attr:`message` names."""
        return out_bytes if self.message == "output" else in_bytes

    def inplace_offset(self, rank: int, block: int) -> int:
        """Where the smaller buffer starts in the larger one in the in-place layout (bytes or
        elements, ``block`` one rank's block): ``rank * block`` for allgather's input in its output
        and reduce-scatter's output in its input, else 0."""
        return rank * block if self.inplace != "same" else 0

    def busbw(self, n: int) -> float:
        """nccl-tests' bus-bandwidth factor: bus bandwidth = message bytes / time * factor."""
        return self.bus * (n - 1) / n if self.bus and n > 1 else 1.0

    def segment_entries(self, n: int, rank: int, output: bool) -> list[tuple[int, int]]:
        """A counted collective's segments of ``rank``'s input (or ``output``), in buffer order:
        the count-matrix entry ``(i, j)`` whose value is each segment's row count. The one home
        of the rule. all-to-all-v: the input holds the rows for each peer ``p`` (entry
        ``(rank, p)``), the output the rows from each peer (``(p, rank)``); all-gather-v: the
        input is the rank's own rows (``(rank, rank)``), the output every rank's (``(p, p)``)."""
        if self.name == "alltoallv":
            return [(p, rank) for p in range(n)] if output else [(rank, p) for p in range(n)]
        if self.name == "allgatherv":
            return [(p, p) for p in range(n)] if output else [(rank, rank)]
        raise PlanError(f"{self.name} has no segments")

    def segment_source(self, rank: int, segment: int) -> tuple[int, int]:
        """(rank, input segment) whose rows a counted collective's output segment ``segment`` of
        ``rank`` must hold: all-to-all-v ``(segment, rank)``, all-gather-v ``(segment, 0)``."""
        return (segment, rank) if self.name == "alltoallv" else (segment, 0)

    def chunk_factor(self, n: int, in_chunks: int, out_chunks: int) -> int:
        """A plan's chunks per rank ``f`` from rank 0's chunk counts (0 when they do not divide)."""
        if not self.sized:
            return in_chunks or out_chunks
        c = in_chunks if in_chunks else out_chunks
        per = n if (self.in_chunks if in_chunks else self.out_chunks) == "n" else 1
        return c // per if c % per == 0 else 0


#: every collective, by plan name (the one table; every list of names is read from it)
TABLE: dict[str, Collective] = {c.name: c for c in (
    Collective("allreduce", "all_reduce", reduces=True, bus=2.0, torch="all_reduce"),
    Collective("allgather", "all_gather", out_blocks="n", in_chunks="1", message="output",
               inplace="input_in_output", bus=1.0, sources="each", torch="all_gather_into_tensor"),
    Collective("reducescatter", "reduce_scatter", in_blocks="n", out_chunks="1", reduces=True, inplace_copy=False,
               inplace="output_in_input", bus=1.0, from_block="rank", torch="reduce_scatter_tensor"),
    Collective("alltoall", "all_to_all", in_blocks="n", out_blocks="n", bus=1.0, sources="each", from_block="rank",
               torch="all_to_all_single"),
    Collective("sendrecv", "send_recv", in_chunks="1", out_chunks="1", sources="sender"),
    Collective("broadcast", "broadcast", in_chunks="1", out_chunks="1", sources="root", torch="broadcast"),
    Collective(FUSED_NORM, "all_reduce_add_rms_norm", reduces=True, inplace_copy=False, bus=2.0, fused=True),
    Collective("alltoallv", "all_to_all_v", in_blocks="n", out_blocks="n", bus=1.0, sources="each",
               from_block="rank", inplace_copy=False, counted=True),
    Collective("allgatherv", "all_gather_v", out_blocks="n", in_chunks="1", message="output", bus=1.0,
               sources="each", inplace_copy=False, counted=True),
    Collective("test", None, in_chunks="1", out_chunks="1", inplace_copy=False, sized=False, postcondition=False),
    Collective("custom", None, in_chunks="1", out_chunks="1", inplace_copy=False, sized=False, postcondition=False),
)}
#: every plan ``collective`` name
COLLECTIVES = tuple(TABLE)
#: API name (``Communicator`` method) -> plan ``collective`` name, for the one-tensor collectives
#: the communicator runs by name (``prepare``, ``select``, tuning rules; not the fused one, whose
#: call takes a residual and a weight, nor the counted ones, whose call takes counts)
API_TO_PLAN: dict[str, str] = {c.api: c.name for c in TABLE.values() if c.api and not c.fused and not c.counted}
#: plan ``collective`` name -> API name
PLAN_TO_API: dict[str, str] = {v: k for k, v in API_TO_PLAN.items()}
_BY_API: dict[str, Collective] = {c.api: c for c in TABLE.values() if c.api}


def collective(name: str) -> Collective:
    """The table's row of a plan collective name, or of an API name (``all_reduce``,
    ``all_reduce_add_rms_norm``); PlanError (JSON path ``collective``) for any other name."""
    row = TABLE.get(name) or _BY_API.get(name)
    if row is None:
        raise PlanError(unknown_collective_message(name), "collective")
    return row


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


def unknown_collective_message(name: object) -> str:
    """The error text for a collective name that is not one of :data:`COLLECTIVES`."""
    close = difflib.get_close_matches(str(name), COLLECTIVES, n=1) if isinstance(name, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown collective {name!r}{hint}; known: {', '.join(COLLECTIVES)}"


#: API name -> plan name of the collectives with data-dependent counts (``all_to_all_v``)
COUNTED_API_TO_PLAN: dict[str, str] = {c.api: c.name for c in TABLE.values() if c.api and c.counted}


def find_plan_collective(name: str, counted: bool = False) -> Optional[str]:
    """Plan name of a collective the communicator runs, given either spelling (``all_reduce``,
    ``allreduce``, ``All-Reduce``), or ``None`` when it names none; with ``counted`` the
    collectives with data-dependent counts too (``all_to_all_v``: what a tuning rule may name)."""
    key = str(name).strip().lower().replace("-", "_")
    names = {**API_TO_PLAN, **COUNTED_API_TO_PLAN} if counted else API_TO_PLAN
    if key in names:
        return names[key]
    key2 = key.replace("_", "")
    return key2 if key2 in names.values() else None


def unknown_api_collective_message(name: object, counted: bool = False) -> str:
    """The error text for a name :func:`find_plan_collective` does not know."""
    return f"unknown collective {name!r}; known: {', '.join([*API_TO_PLAN, *(COUNTED_API_TO_PLAN if counted else ())])}"


def plan_collective(name: str, counted: bool = False) -> str:
    """Plan name of a collective given either spelling (``all_reduce`` or ``allreduce``; with
    ``counted`` also ``all_to_all_v``); :class:`~mscclang.errors.CommError` (an ``InvalidCall``)
    naming the known API names for anything else."""
    found = find_plan_collective(name, counted)
    if found is None:
        raise CommError(unknown_api_collective_message(name, counted))
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
        if self.row.rooted and (self.root is None or not 0 <= self.root < self.num_ranks):
            raise PlanError(f"{self.name} root {self.root} is not a rank of {self.num_ranks}")
        if self.senders is not None:
            if not self.row.has_senders:
                raise PlanError(f"senders are only meaningful for sendrecv, not {self.name}")
            check_senders(self.senders, self.num_ranks)

    @property
    def row(self) -> Collective:
        """The collective's row of :data:`TABLE`."""
        return TABLE[self.name]

    @property
    def has_postcondition(self) -> bool:
        """Whether the collective says what its outputs must hold (``test``/``custom``: no)."""
        return self.row.postcondition

    def sender(self, rank: int) -> int:
        """sendrecv: the rank whose input ``rank`` receives."""
        if self.senders is not None:
            return self.senders[rank]
        return (rank - 1) % self.num_ranks

    @property
    def input_chunks(self) -> int:
        if self.input_chunks_override is not None:
            return self.input_chunks_override
        return self.row.chunks(self.num_ranks, self.chunk_factor)[0]

    @property
    def output_chunks(self) -> int:
        if self.output_chunks_override is not None:
            return self.output_chunks_override
        return self.row.chunks(self.num_ranks, self.chunk_factor)[1]

    @property
    def is_reduction(self) -> bool:
        return self.row.reduces

    def input_in_output(self, rank: int) -> Optional[int]:
        """For in-place collectives: the output chunk index where ``rank``'s input starts (the
        input aliases the output from there on); ``None`` when out of place."""
        if not self.inplace or self.row.inplace == "output_in_input":
            return None
        return self.row.inplace_offset(rank, self.chunk_factor)

    def output_in_input(self, rank: int) -> Optional[int]:
        """For in-place reducescatter: the input chunk index where ``rank``'s output starts."""
        if self.inplace and self.row.inplace == "output_in_input":
            return self.row.inplace_offset(rank, self.chunk_factor)
        return None

    def expect(self, rank: int, chunk: int) -> Optional[Expect]:
        """What output chunk ``chunk`` of ``rank`` must hold (``None``: unconstrained): output block
        ``p``'s chunk ``j`` holds chunk ``j`` of the source block of :meth:`Collective.source_ranks`
        (the fused output: the norm of the reduced rows)."""
        row = self.row
        if not row.postcondition:
            return None
        n = self.num_ranks
        bi, bo = row.blocks(n)
        p, j = divmod(chunk, max(1, self.output_chunks // bo))
        k = row.source_block(rank) * (self.input_chunks // bi) + j
        srcs = row.source_ranks(n, p, self.root, self.sender(rank))
        return Expect(tuple((q, k) for q in srcs), row.reduces)

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
    row = TABLE[name]
    f = plan.chunk_factor
    if f is None:
        f = row.chunk_factor(n, g.input_chunks, g.output_chunks)
        if not f and g.input_chunks:
            raise PlanError(f"{name} plan has {g.input_chunks} input chunks, not a multiple of {n} ranks",
                            "gpus[0].input_chunks")
    kw: dict = {}
    if not row.sized:
        kw = dict(input_chunks_override=g.input_chunks, output_chunks_override=g.output_chunks)
    if senders is not None:
        kw["senders"] = tuple(senders)
    return CollectiveSpec(name, n, f, plan.inplace, plan.root, **kw)
