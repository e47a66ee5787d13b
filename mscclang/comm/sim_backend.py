"""A CPU engine for the communicator: one thread per rank, every launch run for all ranks at
once by the simulator (``engine="sim"``) or by the collective's definition (``engine="reference"``).
:class:`SimBackend` assembles its three parts (:class:`SimLaunch`, the GPU runtime's
:class:`~mscclang.runtime.staging.SymmetricMemory` over :class:`SimAllocations`, and
:class:`SimRegistry`; see :mod:`mscclang.comm.backend`). A launch reads and writes the buffers its
checked call names, by address (they are CPU memory).

Used by the CPU tests and by machines without GPUs (e.g. the README's main job falls back to it).
It also polices the communicator: symmetric (zero-copy) plans must get buffers from
:meth:`SimAllocations.alloc` (``Communicator.empty``) at the same allocation and offset on every rank, or tensors registered
at the same registration on every rank, every peer address a rank would use being exactly where
that peer's registered tensor lives; in-place plans must get the collective's in-place layout and
out-of-place plans non-overlapping buffers, and every block must be a multiple of ``granule`` bytes.

Registration (``SimWorld(register="auto"|"explicit")``; ``"off"`` by default) runs the GPU
runtime's :class:`~mscclang.runtime.registration.Registry` over the threads: a tensor's storage
stands for its allocation, and mapping a peer's allocation gives its own address (the threads share
one address space), so the world can check the addresses. ``staging_cap`` caps staging as the
runtime's ``MSCCLANG_STAGING_CAP_BYTES`` does; ``unexportable(rank, address)`` marks allocations
that cannot be exported (like torch's expandable segments).
"""

from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from mscclang.comm.backend import Engine
from mscclang.comm.catalog import SYMMETRIC, infer_buffer_mode
from mscclang.comm.errors import CommError
from mscclang.comm.launch import capturing
from mscclang.errors import CallMismatch, CountsError, PlanError, RuntimeUnavailable
from mscclang.plan import reference
from mscclang.plan.call import Call, Copies
from mscclang.plan.collectives import collective
from mscclang.plan.dtypes import dtype_info, torch_dtype_info
from mscclang.plan.models import Plan
from mscclang.runtime.registration import AllocInfo, BufferName, Region, Registry, zero_copy_operands
from mscclang.runtime.staging import StagingPool, SymmetricMemory


#: integer types of the sizes of the ml_dtypes types (bfloat16, fp8), which torch and numpy
#: exchange through them
_BITS = {1: "uint8", 2: "int16"}


def torch_to_numpy(t: Any) -> np.ndarray:
    """A 1-D numpy copy of a CPU tensor (bfloat16 and fp8 through ml_dtypes)."""
    import torch

    t = t.detach().reshape(-1).cpu()
    info = torch_dtype_info(t.dtype)
    if info is not None and info.numpy_name.startswith("ml_dtypes."):
        return t.view(getattr(torch, _BITS[info.itemsize])).numpy().view(info.numpy).copy()
    return t.numpy().copy()


def numpy_to_torch(a: np.ndarray, like: Any) -> Any:
    """A tensor of ``like``'s dtype and device holding ``a``."""
    import torch

    info = torch_dtype_info(like.dtype)
    if info is not None and info.numpy_name.startswith("ml_dtypes."):
        bits = np.dtype(_BITS[info.itemsize])
        return torch.from_numpy(np.ascontiguousarray(a).view(bits)).view(like.dtype).to(like.device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(like.device)


def reference_outputs(plan: Plan, inputs: list[np.ndarray], out_elems: int, reduce_op: str) -> list[np.ndarray]:
    """Each rank's output by the collective's definition (:mod:`mscclang.plan.reference`), after
    checking that ``out_elems`` fits the call (CommError otherwise)."""
    collective(plan.collective).shape(len(inputs), inputs[0].size, out_elems)
    try:
        return reference.reference_outputs(plan.collective, inputs, reduce_op, plan.root)
    except ValueError as e:
        raise CommError(f"the reference engine cannot run {plan.name}: {e}") from e


@dataclass
class _Launch:
    plan: Plan
    inp: np.ndarray
    out_elems: int
    reduce_op: str
    packet_type: Optional[str]
    sym: Optional[tuple]
    #: the accumulation dtype of an fp8 reduction (None for other dtypes)
    accum: Optional[str] = None
    #: per operand (input, output) of a registration: {peer: address this rank uses for it}
    peers: tuple = (None, None)
    #: per operand: where this rank's registered tensor starts
    bases: tuple = (None, None)
    kind: str = "launch"
    #: plan/2 (fused) launches: this rank's residual and the epilogue's parameters
    residual: Optional[np.ndarray] = None
    epilogue: Any = None
    #: plan/3 (segments) launches: the count matrix as the exchange left it, the row's bytes and
    #: the scratch slot's rows
    counts: Optional[list] = None
    row_bytes: int = 0
    capacity: int = 0


class SimWorld:
    """State shared by the ranks' :class:`SimBackend` s (one per thread)."""

    def __init__(self, world_size: int, *, engine: str = "sim",
                 granule: Union[int, Callable[[Plan], int]] = 1,
                 timeout: float = 60.0, refuse_unaligned: int = 0, register: str = "off",
                 staging_cap: Optional[int] = None,
                 unexportable: Optional[Callable[[int, int], bool]] = None,
                 max_registrations: int = 64) -> None:
        if engine not in ("sim", "reference"):
            raise CommError(f"engine must be 'sim' or 'reference', got {engine!r}")
        self.world_size = world_size
        self.engine = engine
        # bytes every block must be a multiple of: a number, or a function of the plan (e.g.
        # mscclang.runtime.state.runtime_granule, the GPU runtime's rule)
        self.granule = granule
        self.timeout = timeout
        # like the GPU runtime: refuse (PlanError, before launching) multi-block calls whose
        # blocks are not a multiple of this many bytes; ``refusals`` counts them
        self.refuse_unaligned = refuse_unaligned
        self.refusals = 0
        self.register = register
        self.staging_cap = staging_cap
        self.unexportable = unexportable
        self.max_registrations = max_registrations
        self._xslots: list[Any] = [None] * world_size
        self.exchanges: list[tuple[int, str]] = []   # (rank, tag) of every store-like exchange
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[Optional[_Launch]] = [None] * world_size
        self._results: list[Optional[np.ndarray]] = [None] * world_size
        self._error: Optional[BaseException] = None
        self.launches: list[str] = []  # plan names, one per launch (for tests)

    def backend(self, rank: int) -> "SimBackend":
        return SimBackend(self, rank)

    def exchange(self, rank: int, data: bytes, tag: str) -> list[bytes]:
        """Every rank's ``data`` for a step named ``tag`` (CallMismatch on every rank when the tags
        differ, or when a rank launches instead)."""
        self.exchanges.append((rank, tag))
        self._xslots[rank] = (tag, bytes(data))
        self._barrier.wait()
        got = list(self._xslots)
        self._barrier.wait()
        tags = [g[0] if isinstance(g, tuple) else f"a launch of {g}" for g in got]
        if len(set(tags)) > 1:
            raise CallMismatch("ranks disagree on the call (" + ", ".join(f"rank {q}: {t}" for q, t in enumerate(tags))
                               + ")")
        return [g[1] for g in got]

    def _compute(self) -> None:
        slots = self._slots
        plans = {s.plan.name for s in slots if s is not None}
        if len(plans) != 1 or any(s is None for s in slots):
            raise CommError(f"ranks launched different plans: {sorted(plans)}")
        first = slots[0]
        assert first is not None
        for r, s in enumerate(slots):
            assert s is not None
            if s.counts is not None:
                if s.counts != first.counts or s.row_bytes != first.row_bytes:
                    raise CommError(f"rank {r} launched {first.plan.name} with another count matrix or row than "
                                    "rank 0")
                if s.capacity != first.capacity:
                    raise CountsError(f"rank {r} passed a capacity of {s.capacity} rows, rank 0 {first.capacity}: "
                                      "every rank passes the same (the most rows any rank's out takes)")
                continue
            if s.inp.nbytes != first.inp.nbytes or s.out_elems != first.out_elems:
                raise CommError(f"rank {r} launched {first.plan.name} with other sizes than rank 0")
            if s.reduce_op != first.reduce_op or s.accum != first.accum:
                raise CommError(f"rank {r} launched with reduce op {s.reduce_op} (accumulation {s.accum}), "
                                f"rank 0 with {first.reduce_op} ({first.accum})")
            if s.sym != first.sym:
                raise CommError(f"zero-copy plan {first.plan.name}: rank {r}'s buffers are at "
                                f"{s.sym}, rank 0's at {first.sym} (not symmetric)")
            for i, what in enumerate(("input", "output")):
                for q, addr in (s.peers[i] or {}).items():
                    want = slots[q].bases[i]  # type: ignore[union-attr]
                    if addr != want:
                        raise CommError(f"zero-copy plan {first.plan.name}: rank {r} would reach rank {q}'s "
                                        f"registered {what} at {addr:#x}, but it is at {want:#x}")
        inputs = [s.inp for s in slots]  # type: ignore[union-attr]
        self._slots = [None] * self.world_size  # free for the next launch
        if first.counts is not None:
            self._results = self._counted(first, inputs, [s.out_elems for s in slots])  # type: ignore[union-attr]
            self.launches.append(first.plan.name)
            return
        if first.residual is not None:
            from mscclang.sim.fused import run_fused

            run = run_fused(first.plan, inputs, [s.residual for s in slots], first.epilogue)  # type: ignore[union-attr]
            if not run.outputs:
                raise CommError(f"plan {first.plan.name}: {run.problems[0].message}")
            self._results = list(zip(run.outputs, run.residuals))  # type: ignore[arg-type]
            self.launches.append(first.plan.name)
            return
        if self.engine == "sim":
            from mscclang.sim import run

            outs = run(first.plan, inputs, output_bytes=first.out_elems * first.inp.itemsize,
                       reduce_op=first.reduce_op, packet_type=first.packet_type or "LL16", accum=first.accum)
        else:
            outs = reference_outputs(first.plan, inputs, first.out_elems, first.reduce_op)
        self._results = list(outs)
        self.launches.append(first.plan.name)

    def _counted(self, first: _Launch, inputs: list[np.ndarray], out_elems: list[int]) -> list[np.ndarray]:
        """A plan with segments, for every rank: the count matrix checked as the GPU checks it,
        then the simulator (or, with the reference engine, the rows moved by definition). Each
        rank's output holds what it received and, past it, its output as it was."""
        from mscclang.comm.alltoallv import counted_call_of
        from mscclang.sim.counted import run_counted

        plan, rb = first.plan, first.row_bytes
        call = counted_call_of(plan, first.counts, rb, first.capacity,   # CountsError alike on every rank
                               [k // rb for k in out_elems])
        raw = [x.view(np.uint8) for x in inputs]
        outs = [np.zeros(n * x.itemsize, np.uint8) for n, x in zip(out_elems, inputs)]
        if self.engine == "sim":
            got = run_counted(plan, raw, call.counts, rb, out_rows=call.out_rows, capacity=call.capacity,
                              packet_type=first.packet_type or "LL16")
        else:
            n = len(inputs)
            got = [np.concatenate([np.zeros(0, np.uint8)] + [raw[p][sum(call.counts[p][:r]) * rb:
                                                                     sum(call.counts[p][:r + 1]) * rb]
                                                              for p in range(n)]) for r in range(n)]
        results = []
        for r, (o, g) in enumerate(zip(outs, got)):
            recv = sum(row[r] for row in call.counts) * rb
            o[:recv] = g[:recv]
            results.append((o, recv))
        return results

    def launch(self, rank: int, launch: _Launch) -> np.ndarray:
        self._slots[rank] = launch
        self._xslots[rank] = launch.plan.name
        self._barrier.wait()
        if rank == 0:
            try:
                self._error = None
                self._compute()
            except BaseException as e:  # handed to every rank below
                self._error = e
        self._barrier.wait()
        err = self._error
        res = self._results[rank]
        self._barrier.wait()  # everyone has read its result before the next launch overwrites it
        if err is not None:
            raise err
        assert res is not None
        return res


def _host(ptr: int, nbytes: int, dtype: Any) -> np.ndarray:
    """The ``nbytes`` at CPU address ``ptr`` as a writable numpy view of ``dtype``: the buffers a
    checked :class:`~mscclang.plan.call.Call` names (live CPU tensors of the caller's, or staging)."""
    if nbytes == 0:
        return np.zeros(0, dtype)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)).view(dtype)


def _copy(copies: tuple) -> None:
    """Run :class:`~mscclang.plan.call.Copy` records on CPU memory."""
    for c in copies:
        for r in range(c.rows):
            ctypes.memmove(c.dst + r * c.dst_pitch, c.src + r * c.src_pitch, c.width)


@dataclass(frozen=True)
class SimBound:
    """What :meth:`SimLaunch.run_call` returns: the call, launched again by
    :meth:`SimLaunch.launch_bound`."""

    plan: Plan
    call: Call
    packet_type: Optional[str]
    copies: Optional[Copies]


@dataclass(eq=False)
class SimAlloc:
    """A symmetric buffer of the simulator: the runtime's
    :class:`~mscclang.runtime.bootstrap.SymAlloc` over a CPU ``tensor`` (``index``: its number in
    allocation order, the same on every rank; ``label="staging"``: reported as staging)."""

    index: int
    tensor: Any
    label: str = ""
    pinned: bool = False
    temp: bool = False
    internal: bool = False

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()

    @property
    def size(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class SimAllocations:
    """One rank's symmetric buffers on the simulator, what the GPU runtime's communicator offers
    its :class:`~mscclang.runtime.staging.SymmetricMemory` (the engine's memory part): zeroed CPU
    tensors kept in allocation order. Releasing is collective, as on the GPU. ``released``: the
    bytes of every buffer released (for tests)."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self._allocs: list[Optional[SimAlloc]] = []   # None: released (indices stay)
        self.released: list[int] = []

    def new(self, numel: int, dtype: Any, label: str = "") -> SimAlloc:
        """A new zeroed buffer, kept in allocation order (its record; the staging pool's allocator)."""
        import torch

        a = SimAlloc(len(self._allocs), torch.zeros(numel, dtype=dtype), label)
        self._allocs.append(a)
        return a

    def alloc(self, numel: int, dtype: Any, label: str = "") -> Any:
        return self.new(numel, dtype, label).tensor

    def tensor_of(self, a: SimAlloc) -> Any:
        return a.tensor

    def symmetric_of(self, ptr: int) -> Optional[SimAlloc]:
        """The buffer holding address ``ptr``, or None."""
        for a in self._allocs:
            if a is not None and a.base <= ptr < a.base + max(a.size, 1):
                return a
        return None

    def free(self, allocs: list, why: str) -> None:
        """Collective (the staging pool's release): drop ``allocs`` on every rank at the same call."""
        self.world.exchange(self.rank, b"", f"release {len(allocs)} staging buffer(s)")
        for a in allocs:
            self.released.append(a.size)
            self._allocs[a.index] = None

    def memory(self) -> dict[str, int]:
        """Bytes of staging held now."""
        return {"staging": sum(a.size for a in self._allocs if a is not None and a.label == "staging")}


class SimRegistry:
    """The simulator's registry part: the GPU runtime's
    :class:`~mscclang.runtime.registration.Registry` (``registry``) over the world's threads, a
    tensor's storage standing for its allocation. No capture sessions (no CUDA graphs here)."""

    def __init__(self, world: SimWorld, rank: int, allocs: SimAllocations) -> None:
        self.world = world
        self.rank = rank
        self.symmetric = allocs
        self.storages: dict[int, tuple] = {}   # storage address -> (bytes, id, weak reference)
        self._ids = 0
        self.registry = Registry(_SimComm(world, rank), _SimIpc(self), mode=world.register,
                                 max_regions=world.max_registrations, verify=False)

    @property
    def mode(self) -> str:
        return self.registry.mode

    def zero_copy_ok(self, inp: Any, out: Any) -> bool:
        esz = inp.element_size()
        return zero_copy_operands(self.symmetric.symmetric_of, self.registry, inp.data_ptr(), out.data_ptr(),
                                  inp.numel() * esz, out.numel() * esz) is not None

    def classify(self, tensor: Any) -> Any:
        got = self.symmetric.symmetric_of(tensor.data_ptr())
        if got is not None:
            return BufferName("sym", got.index)
        reg = self.registry.lookup(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        return None if reg is None else reg.index

    def register(self, tensors: list) -> list[bool]:
        from torch.multiprocessing.reductions import StorageWeakRef

        items: list = []
        sym: list[bool] = []
        for t in tensors:
            n = t.numel() * t.element_size()
            mine = self.symmetric.symmetric_of(t.data_ptr()) is not None
            if mine or n == 0:
                items.append((None, n, None))
                sym.append(mine)
                continue
            st = t.untyped_storage()
            old = self.storages.get(st.data_ptr())
            if old is None or old[2].expired() or old[0] != st.nbytes():
                self._ids += 1   # a new allocation (a new storage at a reused address gets a new id)
                self.storages[st.data_ptr()] = (st.nbytes(), self._ids, StorageWeakRef(st))
            items.append((t.data_ptr(), n, StorageWeakRef(st)))
            sym.append(False)
        got = self.registry.register(items)
        return [s or g is not None for s, g in zip(sym, got)]

    def deregister(self, tensors: list) -> int:
        return self.registry.deregister([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])

    def uses(self, cls: Any) -> int:
        if not (isinstance(cls, BufferName) and cls.kind == "reg"):
            return 0
        return self.registry.uses(cls.index)

    def begin_capture(self, arena_bytes: Optional[int] = None) -> bool:
        return False

    def end_capture(self, failed: bool = False) -> int:
        return 0


class SimLaunch:
    """The simulator's launch part: every launch runs for all ranks at once on the world (after
    the checks the GPU runtime makes: layout, granule, ``refuse_unaligned``). ``prepared``: the
    plans prepared (for tests). No traced kernels."""

    traces = False

    def __init__(self, world: SimWorld, rank: int, allocs: SimAllocations, registry: SimRegistry) -> None:
        self.world = world
        self.rank = rank
        self.symmetric = allocs
        self.registry = registry.registry
        self.prepared: list[str] = []

    def launch_bound(self, bound: Any) -> bool:
        """Launch a :class:`SimBound` again (the simulator checks the call again each time)."""
        self._launch(bound.plan, bound.call, bound.packet_type, bound.copies)
        return True

    def runnable(self, plan: Plan) -> Optional[str]:
        return None

    def trace(self, plan: Plan, call: Call, packet_type: Optional[str] = None, copies: Optional[Copies] = None) -> Any:
        raise RuntimeUnavailable(f"rank {self.rank}: the simulator has no traced kernels")

    def fits(self, plan: Plan, in_bytes: int, out_bytes: int, packet_type: Optional[str] = None) -> bool:
        """Like the GPU runtime (``refuse_unaligned``): multi-block calls whose blocks are not a
        multiple of that many bytes do not fit."""
        k = self.world.refuse_unaligned
        if not k:
            return True
        n = self.world.world_size
        blocks = {"allgather": (1, n), "reducescatter": (n, 1), "alltoall": (n, n)}.get(plan.collective, (1, 1))
        block = in_bytes // blocks[0]
        return blocks[0] * blocks[1] == 1 or block % k == 0

    def granule(self, plan: Plan) -> int:
        g = self.world.granule
        return int(g(plan)) if callable(g) else int(g)

    def prepare_call(self, plan: Plan, call: Call, packet_type: Optional[str] = None) -> None:
        self.prepared.append(plan.name)

    def _run_counted(self, plan: Plan, call: Call, packet_type: Optional[str]) -> None:
        """A plan with segments: the count matrix read where the call names it (int32, as the
        exchange left it), the rows received written into the output, the rest left as it was."""
        a = call.counted
        assert a is not None
        n = call.world
        m = _host(a.counts_ptr, n * (2 * n + 2) * 4, np.int32).reshape(n, 2 * n + 2).tolist()
        inp = _host(call.in_ptr, call.in_bytes, np.uint8).copy()
        launch = _Launch(plan, inp, call.out_bytes, call.op, packet_type, None, counts=m, row_bytes=a.row_bytes,
                         capacity=a.capacity)
        res, nbytes = self.world.launch(self.rank, launch)
        _host(call.out_ptr, call.out_bytes, np.uint8)[:nbytes] = res[:nbytes]

    def _check(self, plan: Plan, call: Call) -> None:
        """What this engine needs beyond the checked call: the plan runs the buffers as they are
        (:meth:`~mscclang.plan.call.Call.check_plan`), whole granules (and, like the GPU runtime
        with ``refuse_unaligned``, aligned packet offsets) per block."""
        call.check_plan(plan)
        block = call.shape.block_elems * call.dtype.itemsize
        if (self.world.refuse_unaligned and call.shape.in_blocks * call.shape.out_blocks > 1
                and block % self.world.refuse_unaligned):
            self.world.refusals += 1
            raise PlanError(f"rank {self.rank}: packet offsets at this size are not aligned")
        granule = self.granule(plan)
        if block % granule:
            raise CommError(f"rank {self.rank}: block of {block} bytes is not a multiple of the granule {granule}")

    def run_call(self, plan: Plan, call: Call, packet_type: Optional[str] = None,
                 copies: Optional[Copies] = None) -> Any:
        """Run the call with its ``copies`` around it; a :class:`SimBound` to launch it again
        (None for a plan with segments, as on the GPU)."""
        self._launch(plan, call, packet_type, copies)
        return SimBound(plan, call, packet_type, copies) if call.counted is None else None

    def _launch(self, plan: Plan, call: Call, packet_type: Optional[str], copies: Optional[Copies]) -> None:
        if copies is not None:
            _copy(copies.before)
        self._run(plan, call, packet_type)
        if copies is not None:
            _copy(copies.after)

    def _run(self, plan: Plan, call: Call, packet_type: Optional[str]) -> None:
        if call.epi is not None:
            self._run_fused(plan, call)
            return
        if call.counted is not None:
            self._run_counted(plan, call, packet_type)
            return
        self._check(plan, call)
        sym = None
        peers: tuple = (None, None)
        bases: tuple = (None, None)
        if infer_buffer_mode(plan) == SYMMETRIC:
            zc = zero_copy_operands(self.symmetric.symmetric_of, self.registry, call.in_ptr, call.out_ptr,
                                    call.in_bytes, call.out_bytes)
            if zc is None:
                raise CommError(f"rank {self.rank}: zero-copy plan {plan.name} needs symmetric "
                                "buffers (from Communicator.empty) or registered tensors")
            # in-place allgather/reducescatter: this rank's block sits at rank * block bytes
            shift = (call.collective.inplace_offset(self.rank, call.shape.block_elems * call.dtype.itemsize)
                     if plan.inplace else 0)
            d_in = zc.in_delta - (shift if call.collective.inplace == "input_in_output" else 0)
            d_out = zc.out_delta - (shift if call.collective.inplace == "output_in_input" else 0)
            kind = lambda b: "reg" if isinstance(b, Region) else "sym"  # noqa: E731
            for b in {id(zc.in_buf): zc.in_buf, id(zc.out_buf): zc.out_buf}.values():
                if isinstance(b, Region):
                    b.uses += 1
            sym = ((kind(zc.in_buf), zc.in_buf.index, d_in), (kind(zc.out_buf), zc.out_buf.index, d_out))
            # a registration: the address each peer's buffer is reached at must be where it lives
            peers = tuple({q: a for q, a in b.peer_bases.items() if q != self.rank} if isinstance(b, Region)
                          else None for b in (zc.in_buf, zc.out_buf))
            bases = (zc.in_buf.base, zc.out_buf.base)
        dt = call.dtype.numpy
        inp = _host(call.in_ptr, call.in_bytes, dt).copy()
        launch = _Launch(plan, inp, call.out_bytes // call.dtype.itemsize, call.op, packet_type, sym, call.accum,
                         peers, bases)
        res = self.world.launch(self.rank, launch)
        _host(call.out_ptr, call.out_bytes, dt)[:] = np.asarray(res).astype(dt, copy=False)
        return

    def _run_fused(self, plan: Plan, call: Call) -> None:
        """A fused (plan/2) call on the simulator: the residual is read and written."""
        from mscclang.sim.epilogue import EpilogueParams

        call.check_plan(plan)
        e = call.epi
        if not e.weight_ptr:
            raise CommError(f"rank {self.rank}: the simulator runs {plan.name} with a weight only")
        dt = call.dtype.numpy
        wdt = dtype_info(e.weight_dtype).numpy
        weight = _host(e.weight_ptr, e.hidden * wdt.itemsize, wdt).copy()
        residual = _host(e.residual_ptr, call.in_bytes, dt)
        params = EpilogueParams(e.hidden, weight, e.eps, scale=e.scale, fp8=dtype_info(e.fp8).numpy if e.fp8 else None)
        out_elems = call.out_bytes // (1 if e.fp8 else call.dtype.itemsize)
        launch = _Launch(plan, _host(call.in_ptr, call.in_bytes, dt).copy(), out_elems, "sum", None, None,
                         residual=residual.copy(), epilogue=params)
        res_out, new_res = self.world.launch(self.rank, launch)  # type: ignore[misc]
        residual[:] = np.asarray(new_res).astype(dt, copy=False)
        if e.fp8:   # the FP8 bytes
            _host(call.out_ptr, call.out_bytes, np.uint8)[:] = np.ascontiguousarray(res_out).view(np.uint8)
        else:
            _host(call.out_ptr, call.out_bytes, dt)[:] = np.asarray(res_out).astype(dt, copy=False)


class SimBackend(Engine):
    """One rank's engine over a :class:`SimWorld` (CPU tensors): :class:`SimLaunch`, the GPU
    runtime's :class:`~mscclang.runtime.staging.SymmetricMemory` over :class:`SimAllocations`
    and a :class:`~mscclang.runtime.staging.StagingPool` capped at the world's ``staging_cap``,
    and :class:`SimRegistry`; its lifecycle has nothing to wait for."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        import torch

        self.world = world
        allocs = SimAllocations(world, rank)
        registry = SimRegistry(world, rank, allocs)
        pool = StagingPool(lambda n, api: allocs.new(n, torch.uint8, "staging"), allocs.free, lambda tag: None,
                           world.staging_cap if world.staging_cap is not None else 1 << 62, capturing, rank)
        memory = SymmetricMemory(allocs, pool, registry.registry.memory)
        super().__init__(SimLaunch(world, rank, allocs, registry), memory, registry, rank, world.world_size,
                         torch.device("cpu"))


@dataclass
class _SimComm:
    """What a Registry needs of a communicator, over the world's threads."""

    world: SimWorld
    rank: int
    call: str = ""
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.world_size = self.world.world_size

    def exchange(self, data: bytes, tag: str) -> list[bytes]:
        return self.world.exchange(self.rank, data, tag)


class _SimIpc:
    """Registration's driver calls on the CPU: a registered tensor's storage stands for its
    allocation; a peer's allocation is "mapped" at its own address (one address space)."""

    def __init__(self, owner: SimRegistry) -> None:
        self.owner = owner
        self.opened = 0
        self.closed = 0

    def describe(self, ptr: int) -> AllocInfo:
        for base, (size, bid, _) in self.owner.storages.items():
            if base <= ptr < base + max(size, 1):
                bad = self.owner.world.unexportable
                ok = not (bad is not None and bad(self.owner.rank, ptr))
                return AllocInfo(base, size, bid, ok, "" if ok else "a simulated expandable segment")
        raise RuntimeUnavailable(f"{ptr:#x} is not in a known allocation")

    def export(self, base: int) -> bytes:
        size, bid, _ = self.owner.storages[base]
        return struct.pack("<QQQ", base, size, bid).ljust(64, b"\0")

    def open(self, handle: bytes) -> int:
        self.opened += 1
        return struct.unpack_from("<Q", handle)[0]

    def close(self, addr: int) -> None:
        self.closed += 1

    def synchronize(self) -> None:
        pass
