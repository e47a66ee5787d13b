"""``CollectiveProgram``: the context manager that records a DSL program and compiles it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from pydantic import ValidationError

from mscclang.compiler.budget import check_ops, check_ranks, report
from mscclang.compiler.driver import compile_program
from mscclang.compiler.ir import IROp, IRProgram, IRRank
from mscclang.compiler.source import source_line
from mscclang.compiler.validate import MAX_THREADBLOCKS
from mscclang.dsl import _context
from mscclang.dsl.collectives import (  # noqa: F401  (re-exported like MSCCL++'s program module)
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Collective,
    ReduceScatter,
    SendRecv,
    TestCollective,
)
from mscclang.dsl.thread_block_group import ThreadBlockGroup
from mscclang.dsl.types import BufferType, Chunk
from mscclang.dsl.utils import AlgoSpec, ReplicationPolicy
from mscclang.config import settings
from mscclang.errors import DSLError
from mscclang.plan.io import plan_to_json, validation_error
from mscclang.plan.models import OpName, Plan

if TYPE_CHECKING:
    from mscclang.dsl.loop import LoopIterationContext
    from mscclang.dsl.rank import BaseBuffer

__all__ = ["CollectiveProgram"]


def _check_plan_fields(call: str, **values: object) -> None:
    """Arguments that become fields of the plan, checked by the plan model's own rules
    (:class:`~mscclang.plan.models.Plan`: types, bounds, a power-of-two alignment, the size
    range): a DSLError naming the argument and its value, not pydantic's report."""
    try:
        Plan.model_validate({"name": "", "collective": "", "gpus": [], **values})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        arg = err["loc"][0] if err["loc"] else None
        what = f"{arg}={values[arg]!r}: " if arg in values else ""
        raise DSLError(f"{call}: {what}{err['msg'].removeprefix('Value error, ')}") from None


class CollectiveProgram:
    """A collective algorithm being written: use as ``with CollectiveProgram(...) as prog:``.

    Every DSL call inside the block records ops into this program's IR. ``to_plan()`` compiles
    (validate, fuse, sync, hazard syncs, replicate, number) into a
    :class:`~mscclang.plan.models.Plan`; ``to_json()`` / ``JSON()`` serialise it. Compiling never
    changes the recorded program, so both can be called any number of times with identical output.
    All ids (channels, semaphores, barriers, scratch offsets) live in this object.

    ``strict`` (ours): a signal/wait imbalance on one channel is a :class:`~mscclang.DSLError`
    instead of a :class:`~mscclang.DSLWarning` (MSCCL++'s DSL compiles such programs; by default
    so do we, and ``mscclang verify`` reports the deadlock). ``consistent`` (ours) promises that
    every rank gets the same bits of a reduced element; ``batch_invariant`` (ours) promises more:
    every reduced element is the canonical expression (the ranks' sources in rank order, left to
    right), at every size, so its bits never depend on the message size, the plan or the batch;
    ``mscclang verify`` proves both promises and fails a plan that breaks one. The other arguments
    are MSCCL++'s.
    """

    def __init__(
        self,
        name: str,
        collective: Collective,
        num_ranks: int,
        instances: int = 1,
        protocol: str = "Simple",
        instr_fusion: bool = True,
        auto_sync: bool = True,
        replication_policy: ReplicationPolicy = ReplicationPolicy.interleaved,
        reuse_resources: bool = False,
        num_threads_per_block: int = 1024,
        use_double_scratch_buffer: bool = False,
        buffer_alignment: int = 16,
        min_message_size: int = 0,
        max_message_size: int = 2**64 - 1,
        strict: bool = False,
        consistent: Optional[bool] = None,
        batch_invariant: Optional[bool] = None,
        chunk_unit: Optional[str] = None,
        replicated_residual: Optional[bool] = None,
    ) -> None:
        call = f"CollectiveProgram({name!r})"
        if not isinstance(collective, Collective):
            raise DSLError(f"{call}: collective must be a Collective (AllReduce(...), ...), got {collective!r}")
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise DSLError(f"{call}: num_ranks must be a positive int, got {num_ranks!r}")
        if collective.num_ranks != num_ranks:
            raise DSLError(f"{call}: num_ranks is {num_ranks} but the collective {collective!r} "
                           f"has {collective.num_ranks} ranks")
        if protocol not in ("Simple", "LL"):
            raise DSLError(f"{call}: protocol must be 'Simple' or 'LL', got {protocol!r}")
        if not isinstance(instances, int) or instances < 1:
            raise DSLError(f"{call}: instances must be a positive int, got {instances!r}")
        if instances > MAX_THREADBLOCKS:
            raise DSLError(f"{call}: {instances} instances: each instance of a rank's thread block is a "
                           f"thread block, and a rank has at most {MAX_THREADBLOCKS}")
        check_ranks(num_ranks, call)
        if not isinstance(replication_policy, ReplicationPolicy):
            try:
                replication_policy = ReplicationPolicy(str(replication_policy))
            except ValueError:
                raise DSLError(f"{call}: unknown replication_policy {replication_policy!r}") from None
        _check_plan_fields(call, name=name, num_threads_per_block=num_threads_per_block,
                           buffer_alignment=buffer_alignment, min_message_size=min_message_size,
                           max_message_size=max_message_size, consistent=consistent,
                           batch_invariant=batch_invariant, chunk_unit=chunk_unit,
                           replicated_residual=replicated_residual)
        if (chunk_unit is not None or replicated_residual is not None) and not collective.spec.row.fused:
            raise DSLError(f"{call}: chunk_unit and replicated_residual are about AllReduceAddRMSNorm programs "
                           f"(their rows and residual), not {collective.spec.name}")
        self.name = name
        self.collective = collective
        self.num_ranks = num_ranks
        self.instances = instances
        self.protocol = protocol
        self.instr_fusion = instr_fusion
        self.auto_sync = auto_sync
        self.replication_policy = replication_policy
        self.reuse_resources = reuse_resources
        self.num_threads_per_block = num_threads_per_block
        self.use_double_scratch_buffer = use_double_scratch_buffer
        self.buffer_alignment = buffer_alignment
        self.min_message_size = min_message_size
        self.max_message_size = max_message_size
        self.strict = bool(strict)

        from mscclang.dsl.rank import BaseBuffer

        self._ir = IRProgram(
            name=name, spec=collective.spec,
            ranks=[IRRank(r, collective.input_chunks, collective.output_chunks) for r in range(num_ranks)],
            protocol=protocol, instances=instances, replication_policy=replication_policy.value,
            instr_fusion=bool(instr_fusion), auto_sync=bool(auto_sync),
            reuse_resources=bool(reuse_resources), num_threads_per_block=num_threads_per_block,
            use_double_scratch_buffer=bool(use_double_scratch_buffer),
            buffer_alignment=buffer_alignment, min_message_size=min_message_size,
            max_message_size=max_message_size, strict=bool(strict), consistent=consistent,
            batch_invariant=batch_invariant, chunk_unit=chunk_unit, replicated_residual=replicated_residual)
        #: per rank, the collective's buffers (MSCCL++'s ``prog.buffers[rank][BufferType.input]``)
        self.buffers: list[dict[BufferType, "BaseBuffer"]] = [
            {BufferType.input: BaseBuffer(r, BufferType.input, 0, collective.input_chunks),
             BufferType.output: BaseBuffer(r, BufferType.output, 0, collective.output_chunks)}
            for r in range(num_ranks)]
        if collective.spec.row.counted:   # the buffers are segments (docs/dsl.md, "Data-dependent counts")
            for r, rank in enumerate(self._ir.ranks):
                for kind, output in ((BufferType.input, False), (BufferType.output, True)):
                    rank.segments[kind] = collective.spec.row.segment_entries(num_ranks, r, output)
        if BufferType.residual in collective.buffer_sizes():
            for r, bufs in enumerate(self.buffers):
                bufs[BufferType.residual] = BaseBuffer(r, BufferType.residual, 0, collective.input_chunks)
        self._barrier_ids: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_ranks)]
        self._loop: Optional["LoopIterationContext"] = None
        self._loop_ops: dict[tuple[int, int], list[IROp]] = {}
        self._prev: Optional[CollectiveProgram] = None
        self._version = 0
        self._ops = 0
        self._max_ops = settings.compile_max_ops
        self._plan_cache: Optional[tuple[int, Plan]] = None

    @classmethod
    def from_spec(cls, spec: AlgoSpec, strict: bool = False) -> "CollectiveProgram":
        """A program built from an :class:`AlgoSpec` (fields map one to one)."""
        return cls(spec.name, spec.collective, spec.world_size, instances=spec.instances,
                   protocol=spec.protocol, instr_fusion=spec.instr_fusion, auto_sync=spec.auto_sync,
                   replication_policy=spec.replication_policy, reuse_resources=spec.reuse_resources,
                   num_threads_per_block=spec.num_threads_per_block,
                   use_double_scratch_buffer=spec.use_double_scratch_buffer,
                   buffer_alignment=spec.buffer_alignment, min_message_size=spec.min_message_size,
                   max_message_size=spec.max_message_size, strict=strict)

    # -- context -----------------------------------------------------------------------------

    def __enter__(self) -> "CollectiveProgram":
        self._prev = _context.set_program(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _context.set_program(self._prev)
        self._prev = None
        self._loop = None
        self._loop_ops = {}

    # -- recording helpers (used by the other DSL modules) ------------------------------------

    @property
    def ir(self) -> IRProgram:
        """The recorded program (read-only view; compile with :meth:`to_plan`)."""
        return self._ir

    @property
    def gpus(self) -> list[IRRank]:
        """Per-rank records (``gpus[r].scratch_chunks`` etc., as in MSCCL++)."""
        return self._ir.ranks

    def error(self, rank: Optional[int], tb: Optional[int], call: str, msg: str) -> DSLError:
        """A DSLError naming the rank, thread block and call."""
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if tb is not None:
            where.append(f"tb {tb}")
        prefix = ", ".join(where)
        return DSLError(f"{prefix + ': ' if prefix else ''}{call}: {msg}")

    def check_rank(self, rank: int, call: str, what: str = "rank") -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.num_ranks:
            raise self.error(None, None, call, f"{what} {rank!r} is out of range (the program has {self.num_ranks} ranks)")

    def check_tb(self, rank: int, tb: object, call: str) -> int:
        if not isinstance(tb, int) or isinstance(tb, bool):
            raise self.error(rank, None, call, f"thread block id must be an int, got {tb!r}")
        if not 0 <= tb < MAX_THREADBLOCKS:
            raise self.error(rank, tb, call, f"thread block id {tb} is outside 0..{MAX_THREADBLOCKS - 1}")
        return tb

    def tb_targets(self, rank: int, call: str, tb: Optional[int],
                   tb_group: Optional[ThreadBlockGroup]) -> list[tuple[int, Optional[tuple[int, int]]]]:
        """``[(tb, tbg_info or None)]`` for an op given ``tb=`` or ``tb_group=``."""
        if tb is not None and tb_group is not None:
            raise self.error(rank, tb, call, "give either 'tb' or 'tb_group', not both")
        if tb is not None:
            return [(self.check_tb(rank, tb, call), None)]
        if tb_group is not None:
            if not isinstance(tb_group, ThreadBlockGroup):
                raise self.error(rank, None, call, f"tb_group must be a ThreadBlockGroup, got {tb_group!r}")
            n = tb_group.numtb()
            return [(self.check_tb(rank, t, call), (i, n) if n > 1 else None)
                    for i, t in enumerate(tb_group.tb_list)]
        raise self.error(rank, None, call, "either 'tb' (thread block id) or 'tb_group' (ThreadBlockGroup) must be given")

    def check_chunk(self, chunk: object, call: str, rank: int, tb: Optional[int], what: str,
                    owner: Optional[int] = None) -> Chunk:
        """Check that ``chunk`` is a Chunk of ``owner`` (default ``rank``) inside its buffer."""
        if not isinstance(chunk, Chunk):
            raise self.error(rank, tb, call, f"{what} must be a Chunk (a slice of a buffer), got {chunk!r}")
        owner = rank if owner is None else owner
        if chunk.rank != owner:
            raise self.error(rank, tb, call, f"{what} {chunk} must belong to rank {owner}")
        n = self._ir.ranks[chunk.rank].chunks(chunk.buffer)
        if chunk.index < 0 or chunk.size < 1 or chunk.index + chunk.size > n:
            raise self.error(rank, tb, call, f"{what} {chunk} is out of bounds (the buffer has {n} chunks)")
        return chunk

    def check_same_size(self, rank: int, tb: Optional[int], call: str, *chunks: tuple[str, Chunk]) -> None:
        first_name, first = chunks[0]
        for nm, c in chunks[1:]:
            if c.size != first.size:
                raise self.error(rank, tb, call, f"size mismatch: {first_name} {first} has {first.size} chunks "
                                                 f"but {nm} {c} has {c.size}")

    def check_src_position(self, rank: int, tb: Optional[int], call: str, position: object, others: int) -> int:
        """``position`` of a reduction's own source among its ``others`` other sources: an int
        from 0 (first) to ``others`` (last)."""
        if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position <= others:
            raise self.error(rank, tb, call, f"src_position must be an int from 0 to {others} (the number "
                                             f"of other chunks), got {position!r}")
        return position

    def check_scratch(self, rank: int, tb: Optional[int], call: str, what: str, chunk: Chunk) -> None:
        if chunk.buffer != BufferType.scratch:
            raise self.error(rank, tb, call, f"{what} {chunk} holds packets and must be a scratch buffer")

    def add_op(self, rank: int, tb: int, op: IROp) -> None:
        """Append ``op`` to thread block ``tb`` of ``rank`` (or to the open pipeline body); an op
        without a ``source`` gets the program line of the DSL call being made."""
        self._version += 1
        self._ops += 1
        if self._ops * self.instances > self._max_ops:
            check_ops(self._ops, self.instances, f"CollectiveProgram({self.name!r})", so_far=True)
        if not self._ops % 4096:
            report(self._ops)
        if op.source is None:
            op.source = source_line()
        if self._loop is not None:
            self._loop_ops.setdefault((rank, tb), []).append(op)
        else:
            self._ir.ranks[rank].ensure_tb(tb).append(op)

    def barrier_id(self, rank: int, tbs: Sequence[int]) -> int:
        """The barrier id of this set of thread blocks on ``rank`` (one id per distinct set)."""
        table = self._barrier_ids[rank]
        return table.setdefault(tuple(sorted(tbs)), len(table))

    def touch(self) -> None:
        """Note a change of the recorded program (channels, buffers, semaphores)."""
        self._version += 1

    # -- pipelines ----------------------------------------------------------------------------

    def set_loop_context(self, loop: Optional["LoopIterationContext"]) -> None:
        """Open (``loop``) or close (``None``) a pipelined loop."""
        if loop is not None:
            if self._loop is not None:
                raise self.error(None, None, "LoopIterationContext", "nested pipelines are not supported")
            self._loop = loop
            self._loop_ops = {}
            return
        if self._loop is None:
            return
        ctx = (self._loop.unit, self._loop.num_chunks)
        source = self._loop.source
        body, self._loop, self._loop_ops = self._loop_ops, None, {}
        for (rank, tb), ops in body.items():
            self.add_op(rank, tb, IROp(name=OpName.pipeline, iter_context=ctx, body=ops,
                                       origin=f"LoopIterationContext(unit={ctx[0]}, num_chunks={ctx[1]})",
                                       source=source))

    # -- output -------------------------------------------------------------------------------

    def to_plan(self) -> Plan:
        """Compile the recorded program into a plan (cached until the program changes)."""
        if self._loop is not None:
            raise self.error(None, None, "to_plan", "a LoopIterationContext is still open")
        if self._plan_cache is not None and self._plan_cache[0] == self._version:
            return self._plan_cache[1].model_copy(deep=True)
        try:
            plan = compile_program(self._ir)
        except ValidationError as e:   # a value the DSL's own checks let through, by its JSON path
            err = validation_error(e)
            raise DSLError(f"{self.name}: the compiled plan is refused at {err.path}: {err.message}") from None
        self._plan_cache = (self._version, plan)
        return plan.model_copy(deep=True)

    def to_json(self, indent: int = 2, **kwargs: object) -> str:
        """The plan as JSON (format ``mscclang.plan/1``); identical text on every call."""
        return plan_to_json(self.to_plan(), indent=indent)

    def post_process_operations(self) -> None:
        """Compatibility no-op: MSCCL++ runs its passes here and again in ``to_json`` (replicating
        twice); ours compile inside :meth:`to_plan` from the unchanged recording."""
        self.to_plan()

