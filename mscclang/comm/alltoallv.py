"""All-to-all with data-dependent counts on plans: :meth:`Communicator.all_to_all_v`.

One call is two launches, with no host synchronisation when ``out`` is given:

1. **The count exchange.** Each rank writes its row ``[send counts to every rank, its input
   rows, its output rows, the rows it expects from every rank or -1]`` (int32, ``2 n + 2``
   entries, filled on the device by copies and fills, so a CUDA graph captures them) and an
   all-gather of the rows gives every rank the same count matrix ``[n, 2 n + 2]``, kept at a
   fixed address per communicator.
2. **The all-to-all-v plan** (``alltoallv_*``), which reads the matrix when it runs
   (docs/semantics.md, "Data-dependent counts"): every rank checks every count against every
   buffer, so a bad count raises :class:`~mscclang.errors.CountsError` on every rank alike.

The receive counts come back as a device tensor (column ``rank`` of the matrix). Without
``out``, the call reads the matrix on the host once to size it (its docstring says so). The
plan is the one a tuning rule for ``alltoallv`` names at the slot bytes (``capacity *
row_bytes``), else the LL one for small calls (the capacity's bytes within its range, rows a
multiple of 8 bytes), the zero-copy one when ``x`` and ``out`` are symmetric
(``Communicator.empty``), else the one through scratch. The copy-engine ``alltoallv_port`` runs
only where a rule names it. Without an engine that runs the plan, the call goes to
torch.distributed's ``all_to_all_single`` with the splits read on the host.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from mscclang.comm.catalog import Catalog, PlanVariant
from mscclang.comm.tracing import TracedCall
from mscclang.comm.tuning import NCCL, TuningTable
from mscclang.errors import CountsError, InvalidCall
from mscclang.plan.call import COUNT_COLUMNS, check_tensor, make_counted_call
from mscclang.plan.models import Plan

#: the plan collective
ALLTOALLV = "alltoallv"
#: what a row says when its rank gave no output (sized after the exchange)
UNSIZED = 2**31 - 1
#: the plan choices an all-to-all-v communicator remembers (slot sizes x alignments x symmetry)
CHOICES = 64

__all__ = ["CountedCalls", "ALLTOALLV"]


class CountedCalls:
    """The all-to-all-v calls of one rank, beside the rank's :class:`~mscclang.comm.launch.Launch`
    ``runs`` (its planner's rank, world and device, its engine, its torch.distributed fallback
    and its log), the communicator's ``catalog``, its ``all_gather(inp, out)`` (the count
    exchange) and its tuning ``table``. ``last``: the plan the last call ran (None: the
    fallback)."""

    def __init__(self, runs: Any, catalog: Catalog, all_gather: Callable[[Any, Any], Any],
                 table: Optional[TuningTable] = None) -> None:
        self.runs = runs
        self.table = table
        self.rank, self.world, self.device = runs.planner.rank, runs.planner.world_size, runs.planner.device
        self.catalog = catalog
        self.all_gather = all_gather
        self.note = runs.note
        self.last: Optional[str] = None
        self._row: Any = None
        self._matrix: Any = None
        self._choices: dict[tuple, Optional[Plan]] = {}

    def engine(self) -> Any:
        """The rank's engine now (None: none, or closed)."""
        return self.runs.engine

    def fallback(self, what: str) -> Any:
        """The torch.distributed fallback (CommError when disabled)."""
        return self.runs.need_fallback(what)

    def all_to_all_v(self, x: Any, send_counts: Any, out: Any = None, expect: Any = None,
                     capacity: Optional[int] = None) -> tuple[Any, Any]:
        """See :meth:`mscclang.comm.communicator.Communicator.all_to_all_v`."""
        import torch

        n, r = self.world, self.rank
        what = "all_to_all_v"
        check_tensor(x, f"{what}: x", r, self.device)
        counts = self._counts_arg(send_counts, "send_counts")
        if x.dim() < 1:
            raise InvalidCall(f"rank {r}: {what}: x must have a first dimension (its rows), got a 0-d tensor")
        if out is not None:
            check_tensor(out, f"{what}: out", r, self.device)
        if self._row is None:
            self._row = torch.empty(2 * n + COUNT_COLUMNS, dtype=torch.int32, device=self.device)
            self._matrix = torch.empty(n, 2 * n + COUNT_COLUMNS, dtype=torch.int32, device=self.device)
        # every argument of this rank checked before the exchange, which every rank joins
        make_counted_call(ALLTOALLV, r, n, self.device, x, out if out is not None else x.new_empty((0, *x.shape[1:])),
                          self._matrix, 0)
        row = self._row
        row[:n].copy_(counts)
        row[n].fill_(int(x.shape[0]))
        row[n + 1].fill_(int(out.shape[0]) if out is not None else UNSIZED)
        if expect is None:
            row[n + 2:].fill_(-1)
        else:
            row[n + 2:].copy_(self._counts_arg(expect, "the expected receive counts"))
        self.all_gather(row, self._matrix.view(-1))
        m = self._matrix
        recv = m[:, r].to(counts.dtype, copy=True)   # its own tensor: the next call rewrites the matrix
        host = None
        if out is None:   # one host read of the matrix: this rank's rows, every rank's capacity
            host = self._host_matrix(what)
            total = sum(host[p][r] for p in range(n))
            out = x.new_empty((total, *x.shape[1:]))
            capacity = max(sum(host[p][q] for p in range(n)) for q in range(n))
        elif capacity is None:
            capacity = int(out.shape[0])
        elif isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidCall(f"rank {r}: {what}: capacity {capacity!r} must be an int of at least 0")
        call = make_counted_call(ALLTOALLV, r, n, self.device, x, out, m, capacity)
        plan = self._choose(call, x, out)
        tracer = self.runs.tracer   # an open comm.trace() block: the launch traced, its segments' rows shown
        if plan is None:
            if tracer is not None:
                tracer.skipped.append(f"{ALLTOALLV} (torch.distributed fallback)")
            self._fallback(x, out, host, what)
            return out, recv
        self.last = plan.name
        if tracer is not None:
            rt = self.engine().launch.trace(plan, call)
            tracer.calls.append(TracedCall(ALLTOALLV, plan.name, x.numel() * x.element_size(), rt))
        else:
            self.engine().launch.run_call(plan, call)
        return out, recv

    def _counts_arg(self, t: Any, what: str) -> Any:
        """``t``: an integer tensor of ``world`` entries on the device (InvalidCall otherwise)."""
        check_tensor(t, f"all_to_all_v: {what}", self.rank, self.device)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype.itemsize > 8 or tuple(t.shape) != (self.world,):
            raise InvalidCall(f"rank {self.rank}: all_to_all_v: {what} must be an integer tensor of {self.world} "
                              f"entries (one per rank), got {t.dtype} of shape {tuple(t.shape)}")
        return t

    def _host_matrix(self, what: str) -> list[list[int]]:
        """The count matrix on the host (a synchronisation), checked as every rank checks it."""
        m = [[int(v) for v in row] for row in self._matrix.cpu().tolist()]
        check_matrix(m, self.world)
        return m

    def _choose(self, call: Any, x: Any, out: Any) -> Optional[Plan]:
        """The plan to run (None: the engine runs none, or the catalog has none), remembered per
        engine, slot bytes, row alignment and symmetry (at most :data:`CHOICES` of them), so a
        repeated call scans the catalog once."""
        eng = self.engine()
        if eng is None:
            return None
        a = call.counted
        # zero-copy on symmetric buffers (registered tensors do not run plans with segments on the GPU)
        zero_copy = bool(x.numel() and out.numel()) and eng.memory.is_symmetric(x) and eng.memory.is_symmetric(out)
        key = (id(eng), a.capacity * a.row_bytes, a.row_bytes % 8 == 0, zero_copy, call.dtype.name)
        if key not in self._choices:
            if len(self._choices) >= CHOICES:
                self._choices.clear()
            self._choices[key] = self._pick(eng, key[1], key[2], zero_copy, call.dtype.name)
        return self._choices[key]

    def _pick(self, eng: Any, nbytes: int, packets: bool, zero_copy: bool, dtype: str) -> Optional[Plan]:
        """:meth:`_choose`'s choice for slots of ``nbytes``: first the plans the tuning table's
        rule for all-to-all-v at these slot bytes names, in its order (``nccl``: torch.distributed;
        the only way to the copy-engine ``alltoallv_port``), then LL where rows are whole 8-byte
        words and the slots fit its range, zero-copy on symmetric buffers, else Simple. A plan
        the buffers cannot take (zero-copy on ordinary tensors, LL on rows of 4-byte words) is
        passed over; a note names why none runs."""
        found: dict[str, PlanVariant] = {}
        for v in self.catalog.matching(ALLTOALLV, self.world):
            found.setdefault(v.algorithm, v)
        rule = self.table.rule_for(ALLTOALLV, self.world, dtype, nbytes) if self.table is not None else None
        order = [c.plan for c in rule.candidates] if rule is not None else []
        order += ["alltoallv_ll"] if packets else []
        order += ["alltoallv_zero_copy"] if zero_copy else []
        order += ["alltoallv_simple"]
        for name in order:
            if name == NCCL:
                self.note(ALLTOALLV, f"mscclang rank {self.rank}: all_to_all_v runs on torch.distributed: the "
                          f"tuning rule for slots of {nbytes} bytes names nccl first")
                return None
            v = found.get(name)
            if (v is None or (v.protocol == "LL" and not (packets and v.fits(nbytes)))
                    or (v.symmetric and not zero_copy)):
                continue
            plan = v.load()
            why = eng.launch.runnable(plan)
            if why is None:
                return plan
            self.note(ALLTOALLV, f"mscclang rank {self.rank}: all_to_all_v falls back to torch.distributed: {why}")
            return None
        self.note(ALLTOALLV, f"mscclang rank {self.rank}: all_to_all_v falls back to torch.distributed: no "
                  f"all-to-all-v plan for {self.world} ranks")
        return None

    def _fallback(self, x: Any, out: Any, host: Optional[list[list[int]]], what: str) -> None:
        """torch.distributed's ``all_to_all_single`` with the splits of the matrix (read on the
        host: a synchronisation)."""
        fb = self.fallback(what)
        m = host if host is not None else self._host_matrix(what)
        n, r = self.world, self.rank
        sends = [m[r][q] for q in range(n)]
        recvs = [m[p][r] for p in range(n)]
        self.last = None
        fb.all_to_all_v(x[: sum(sends)], out[: sum(recvs)], sends, recvs)


def check_matrix(m: list[list[int]], n: int) -> None:
    """A count matrix read on the host is one every rank can run: counts not negative, each
    rank's sends within its input rows and receives within its output rows, and each stated
    expectation equal to its sender's count (:class:`CountsError` naming the rank and entry,
    raised alike on every rank, since every rank holds the same matrix). The plans and the GPU
    check the same rule (:func:`mscclang.plan.segments.check_counts`)."""
    for i in range(n):
        for j in range(n):
            if m[i][j] < 0:
                raise CountsError(f"rank {i}: count [{i}][{j}] is {m[i][j]}: counts must be at least 0")
    for i in range(n):
        sends = sum(m[i][:n])
        if sends > m[i][n]:
            raise CountsError(f"rank {i}: its send counts {m[i][:n]} add up to {sends} rows, more than its x's "
                              f"{m[i][n]} rows")
        recv = sum(m[p][i] for p in range(n))
        if recv > m[i][n + 1]:
            raise CountsError(f"rank {i}: it receives {recv} rows ({[m[p][i] for p in range(n)]}), more than its "
                              f"out's {m[i][n + 1]} rows")
        for p in range(n):
            want = m[i][n + 2 + p]
            if want >= 0 and want != m[p][i]:
                raise CountsError(f"rank {i} expects {want} rows from rank {p}, but rank {p} sends it {m[p][i]}")


def counted_call_of(plan: Plan, m: list[list[int]], row_bytes: int, capacity: int, out_rows: list[int]) -> Any:
    """The simulator's :class:`~mscclang.plan.segments.CountedCall` of a count matrix as the
    exchange leaves it (checked by :func:`check_matrix` first), each rank's output ``out_rows``
    long (what its call passed: a rank that gave no output said :data:`UNSIZED` in the matrix)."""
    from mscclang.plan.segments import counted_call

    n = len(m)
    check_matrix(m, n)
    return counted_call(plan, [row[:n] for row in m], row_bytes, [row[n] for row in m], out_rows, capacity)

