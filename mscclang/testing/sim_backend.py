"""A CPU backend for the communicator: one thread per rank, every launch run for all ranks at
once by the simulator (``engine="sim"``) or by the collective's definition (``engine="reference"``).

Used by the CPU tests and by machines without GPUs (e.g. the README's main job falls back to it).
It also polices the communicator: symmetric (zero-copy) plans must get buffers from
:meth:`SimBackend.empty` at the same allocation and offset on every rank, in-place plans must get
the collective's in-place layout and out-of-place plans non-overlapping buffers, and every block
must be a multiple of ``granule`` bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np

from mscclang.comm.backend import Backend
from mscclang.comm.catalog import SYMMETRIC, infer_buffer_mode
from mscclang.comm.errors import CommError
from mscclang.comm.names import dtype_name
from mscclang.comm.padding import block_shape
from mscclang.errors import PlanError
from mscclang.plan.models import Plan


def torch_to_numpy(t: Any) -> np.ndarray:
    """A 1-D numpy copy of a CPU tensor (bfloat16 through ml_dtypes)."""
    import torch

    t = t.detach().reshape(-1).cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def numpy_to_torch(a: np.ndarray, like: Any) -> Any:
    """A tensor of ``like``'s dtype and device holding ``a``."""
    import torch

    if like.dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(like.device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(like.device)


def reference_outputs(plan: Plan, inputs: list[np.ndarray], out_elems: int, reduce_op: str) -> list[np.ndarray]:
    """Each rank's output by the collective's definition (reductions in rank order, every step
    in fp32 for 16-bit floats, as the kernel does)."""
    n = len(inputs)
    coll = plan.collective
    dt = inputs[0].dtype
    shape = block_shape(coll, n, inputs[0].size, out_elems)
    k = shape.block_elems

    def reduce(arrs: list[np.ndarray]) -> np.ndarray:
        f = {"sum": np.add, "min": np.minimum, "max": np.maximum}[reduce_op]
        wide = np.float32 if dt.kind == "f" or dt.name == "bfloat16" else None
        acc = arrs[0].astype(wide) if wide else arrs[0].copy()
        for a in arrs[1:]:
            acc = f(acc, a.astype(wide) if wide else a)
            if wide:
                acc = acc.astype(dt).astype(wide)  # round every step
        return acc.astype(dt)

    if coll == "allreduce":
        res = reduce(inputs)
        return [res.copy() for _ in range(n)]
    if coll == "allgather":
        res = np.concatenate(inputs)
        return [res.copy() for _ in range(n)]
    if coll == "reducescatter":
        return [reduce([x[r * k:(r + 1) * k] for x in inputs]) for r in range(n)]
    if coll == "alltoall":
        return [np.concatenate([inputs[p][r * k:(r + 1) * k] for p in range(n)]) for r in range(n)]
    if coll == "broadcast":
        root = plan.root or 0
        return [inputs[root].copy() for _ in range(n)]
    if coll == "sendrecv":
        return [inputs[(r - 1) % n].copy() for r in range(n)]
    raise CommError(f"the reference engine has no definition of {coll!r}")


@dataclass
class _Launch:
    plan: Plan
    inp: np.ndarray
    out_elems: int
    reduce_op: str
    packet_type: Optional[str]
    sym: Optional[tuple]


class SimWorld:
    """State shared by the ranks' :class:`SimBackend` s (one per thread)."""

    def __init__(self, world_size: int, *, engine: str = "sim",
                 granule: Union[int, Callable[[Plan], int]] = 1,
                 timeout: float = 60.0, refuse_unaligned: int = 0) -> None:
        if engine not in ("sim", "reference"):
            raise CommError(f"engine must be 'sim' or 'reference', got {engine!r}")
        self.world_size = world_size
        self.engine = engine
        # bytes every block must be a multiple of: a number, or a function of the plan (e.g.
        # mscclang.comm.backend.runtime_granule, the GPU runtime's rule)
        self.granule = granule
        self.timeout = timeout
        # like the GPU runtime: refuse (PlanError, before launching) multi-block calls whose
        # blocks are not a multiple of this many bytes; ``refusals`` counts them
        self.refuse_unaligned = refuse_unaligned
        self.refusals = 0
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[Optional[_Launch]] = [None] * world_size
        self._results: list[Optional[np.ndarray]] = [None] * world_size
        self._error: Optional[BaseException] = None
        self.launches: list[str] = []  # plan names, one per launch (for tests)

    def backend(self, rank: int) -> "SimBackend":
        return SimBackend(self, rank)

    def _compute(self) -> None:
        slots = self._slots
        plans = {s.plan.name for s in slots if s is not None}
        if len(plans) != 1 or any(s is None for s in slots):
            raise CommError(f"ranks launched different plans: {sorted(plans)}")
        first = slots[0]
        assert first is not None
        for r, s in enumerate(slots):
            assert s is not None
            if s.inp.nbytes != first.inp.nbytes or s.out_elems != first.out_elems:
                raise CommError(f"rank {r} launched {first.plan.name} with other sizes than rank 0")
            if s.reduce_op != first.reduce_op:
                raise CommError(f"rank {r} launched with reduce op {s.reduce_op}, rank 0 with {first.reduce_op}")
            if s.sym != first.sym:
                raise CommError(f"zero-copy plan {first.plan.name}: rank {r}'s buffers are at "
                                f"{s.sym}, rank 0's at {first.sym} (not symmetric)")
        inputs = [s.inp for s in slots]  # type: ignore[union-attr]
        self._slots = [None] * self.world_size  # free for the next launch
        if self.engine == "sim":
            from mscclang.sim import run

            outs = run(first.plan, inputs, output_bytes=first.out_elems * first.inp.itemsize,
                       reduce_op=first.reduce_op, packet_type=first.packet_type or "LL16")
        else:
            outs = reference_outputs(first.plan, inputs, first.out_elems, first.reduce_op)
        self._results = list(outs)
        self.launches.append(first.plan.name)

    def launch(self, rank: int, launch: _Launch) -> np.ndarray:
        self._slots[rank] = launch
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


class SimBackend(Backend):
    """One rank's view of a :class:`SimWorld` (CPU tensors)."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        import torch

        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.device = torch.device("cpu")
        self._allocs: list[Any] = []
        self.prepared: list[str] = []

    def empty(self, numel: int, dtype: Any) -> Any:
        import torch

        t = torch.zeros(numel, dtype=dtype)  # zeroed, like the GPU runtime's symmetric memory
        self._allocs.append(t)
        return t

    def _where(self, t: Any) -> Optional[tuple[int, int]]:
        ptr = t.data_ptr()
        for i, a in enumerate(self._allocs):
            base = a.data_ptr()
            if base <= ptr < base + max(a.numel() * a.element_size(), 1):
                return i, ptr - base
        return None

    def is_symmetric(self, tensor: Any) -> bool:
        return self._where(tensor) is not None

    def granule(self, plan: Plan) -> int:
        g = self.world.granule
        return int(g(plan)) if callable(g) else int(g)

    def prepare(self, plan: Plan, inp: Any, out: Any, *, packet_type: Optional[str] = None,
                reduce_op: Optional[str] = None) -> None:
        self.prepared.append(plan.name)

    def _check(self, plan: Plan, inp: Any, out: Any) -> None:
        n = self.world_size
        esz = inp.element_size()
        shape = block_shape(plan.collective, n, inp.numel(), out.numel())
        if (self.world.refuse_unaligned and shape.in_blocks * shape.out_blocks > 1
                and (shape.block_elems * esz) % self.world.refuse_unaligned):
            self.world.refusals += 1
            raise PlanError(f"rank {self.rank}: packet offsets at this size are not aligned")
        granule = self.granule(plan)
        if (shape.block_elems * esz) % granule:
            raise CommError(f"rank {self.rank}: block of {shape.block_elems * esz} bytes is not a "
                            f"multiple of the granule {granule}")
        a0, a1 = inp.data_ptr(), inp.data_ptr() + inp.numel() * esz
        b0, b1 = out.data_ptr(), out.data_ptr() + out.numel() * esz
        overlap = not (a1 <= b0 or b1 <= a0)
        if plan.inplace:
            k = shape.block_elems * esz
            want = {"allgather": a0 == b0 + self.rank * k,
                    "reducescatter": b0 == a0 + self.rank * k}.get(plan.collective, a0 == b0)
            if not want:
                raise CommError(f"rank {self.rank}: in-place plan {plan.name} got buffers that "
                                "are not the in-place layout")
        elif overlap:
            raise CommError(f"rank {self.rank}: out-of-place plan {plan.name} got overlapping buffers")

    def execute(self, plan: Plan, inp: Any, out: Any, *, reduce_op: str = "sum",
                packet_type: Optional[str] = None) -> None:
        self._check(plan, inp, out)
        sym = None
        if infer_buffer_mode(plan) == SYMMETRIC:
            wi, wo = self._where(inp), self._where(out)
            if wi is None or wo is None:
                raise CommError(f"rank {self.rank}: zero-copy plan {plan.name} needs symmetric "
                                "buffers (from Communicator.empty)")
            # in-place allgather/reducescatter: this rank's block sits at rank * block bytes
            shift = block_shape(plan.collective, self.world_size, inp.numel(), out.numel()).block_elems \
                * inp.element_size() * self.rank
            if plan.inplace and plan.collective == "allgather":
                wi = (wi[0], wi[1] - shift)
            elif plan.inplace and plan.collective == "reducescatter":
                wo = (wo[0], wo[1] - shift)
            sym = (wi, wo)
        dtype_name(inp.dtype)
        launch = _Launch(plan, torch_to_numpy(inp), out.numel(), reduce_op, packet_type, sym)
        res = self.world.launch(self.rank, launch)
        out.reshape(-1).copy_(numpy_to_torch(res, out))
