"""The executor's host-side logic without a GPU: argument checks (device, dtype, contiguity,
sizes, in-place layout, overlap) and the call descriptions ranks compare. Tensors are stand-ins
that say they live on a CUDA device, so every check after the device check is reached."""

from __future__ import annotations

import types

import pytest
import torch

from mscclang.errors import InvalidCall
from mscclang.runtime.executor import Executor, LoadedPlan
from mscclang.comm.sim_ranks import stub_plan


class FakeCuda:
    """What :func:`mscclang.plan.call.make_call` reads of a tensor, at a chosen address."""

    def __init__(self, numel: int, addr: int, dtype=torch.float16, device: int = 0, cuda: bool = True,
                 contiguous: bool = True) -> None:
        self._n, self._a, self.dtype = numel, addr, dtype
        self.is_cuda, self._dev, self._contig = cuda, device, contiguous
        self.device = f"cuda:{device}" if cuda else "cpu"

    def data_ptr(self) -> int:
        return self._a

    def numel(self) -> int:
        return self._n

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def get_device(self) -> int:
        return self._dev if self.is_cuda else -1

    def is_contiguous(self) -> bool:
        return self._contig


def _ex(rank: int = 1, world: int = 2) -> Executor:
    ex = object.__new__(Executor)
    ex.comm = types.SimpleNamespace(rank=rank, world_size=world, device=0)
    return ex


def _lp(coll: str, inplace: bool, world: int = 2) -> LoadedPlan:
    plan = stub_plan(coll, world, inplace=inplace, protocol="LL")
    return LoadedPlan(plan, False, "ll16", "sum", 1024, 1)


def _sizes(ex: Executor, lp: LoadedPlan, inp, out) -> tuple:
    c = ex.call(lp, inp, out)
    return c.in_bytes, c.out_bytes


def test_good_calls_give_their_sizes():
    ex = _ex()
    assert _sizes(ex, _lp("allreduce", False), FakeCuda(512, 0x1000), FakeCuda(512, 0x9000)) == (1024, 1024)
    assert _sizes(ex, _lp("allreduce", True), FakeCuda(512, 0x1000), FakeCuda(512, 0x1000)) == (1024, 1024)
    # in-place allgather: the input is rank 1's block of the output
    assert _sizes(ex, _lp("allgather", True), FakeCuda(256, 0x1000 + 512), FakeCuda(512, 0x1000)) == (512, 1024)
    # in-place reduce-scatter: the output is rank 1's block of the input
    assert _sizes(ex, _lp("reducescatter", True), FakeCuda(512, 0x1000), FakeCuda(256, 0x1000 + 512)) \
        == (1024, 512)


@pytest.mark.parametrize("coll,inplace,inp,out,match", [
    ("allreduce", False, FakeCuda(512, 0x1000, cuda=False), FakeCuda(512, 0x9000), "is on cpu"),
    ("allreduce", False, FakeCuda(512, 0x1000), FakeCuda(512, 0x9000, device=1), "is on cuda:1"),
    ("allreduce", False, FakeCuda(512, 0x1000, contiguous=False), FakeCuda(512, 0x9000), "contiguous"),
    ("allreduce", False, FakeCuda(512, 0x1000, torch.float64), FakeCuda(512, 0x9000, torch.float64),
     "which mscclang does not run"),
    ("allreduce", False, FakeCuda(512, 0x1000), FakeCuda(512, 0x9000, torch.float32), "differs"),
    ("allreduce", False, FakeCuda(512, 0x1000), FakeCuda(500, 0x9000), "equal input and output element counts"),
    ("allgather", False, FakeCuda(256, 0x1000), FakeCuda(256, 0x9000), "rank 1: all_gather needs an output of 2 x 256"),
    ("reducescatter", False, FakeCuda(256, 0x1000), FakeCuda(256, 0x9000), "rank 1: reduce_scatter needs an input of 2 x 256"),
    ("allreduce", False, FakeCuda(0, 0x1000), FakeCuda(0, 0x9000), "empty"),
    ("allreduce", True, FakeCuda(512, 0x1000), FakeCuda(512, 0x9000), "same tensor"),
    ("allgather", True, FakeCuda(256, 0x1000), FakeCuda(512, 0x1000), "this rank's block of the output"),
    ("reducescatter", True, FakeCuda(512, 0x1000), FakeCuda(256, 0x1000), "this rank's block of the input"),
    ("allreduce", False, FakeCuda(512, 0x1000), FakeCuda(512, 0x1000), "overlap"),
    ("allreduce", False, FakeCuda(512, 0x1000), FakeCuda(512, 0x1200), "overlap"),
])
def test_bad_calls_are_refused(coll, inplace, inp, out, match):
    with pytest.raises(InvalidCall, match=match):
        _ex().call(_lp(coll, inplace), inp, out)


def test_not_a_tensor():
    with pytest.raises(InvalidCall, match="must be a torch tensor"):
        _ex().call(_lp("allreduce", False), [1, 2], FakeCuda(2, 0x10))


def test_call_description_names_collective_sizes_dtype_plan_packet_and_op():
    ex = _ex()
    from mscclang.runtime.state import describe_call

    d = describe_call(_lp("allreduce", False).plan, 2048, 2048, "bf16", "ll16", "sum")
    assert d.startswith("allreduce of 2048 B bf16 on plan ") and d.endswith(" LL16 sum")
    d = describe_call(_lp("allgather", False).plan, 512, 1024, "f32", "ll8", "sum")
    assert "512 B in, 1024 B out" in d and "sum" not in d


def test_memory_report_counts_live_and_retired_contexts_and_symmetric_buffers():
    from mscclang.comm import Communicator
    from mscclang.comm.backend import RuntimeBackend
    from mscclang.comm.tuning import TuningTable
    from mscclang.runtime.bootstrap import Bootstrap as RuntimeComm, SymAlloc
    from mscclang.comm.sim_ranks import catalog_of

    ex = _ex()
    from mscclang.runtime.contexts import ContextPool

    ex.kernels = types.SimpleNamespace(count=lambda: 3)
    ex.capture = types.SimpleNamespace(arena_bytes=lambda: 0)
    ex.entries = types.SimpleNamespace(evicted=0)
    ex.staging = types.SimpleNamespace(cap=128 << 20)
    ex.contexts = ContextPool(ex.comm, None, None, 0, lambda: False)
    ctx = lambda scratch, plans: types.SimpleNamespace(  # noqa: E731
        scratch_bytes=scratch, sync=types.SimpleNamespace(size=4096),
        plans={i: types.SimpleNamespace(nbytes=n) for i, n in enumerate(plans)})
    lp = _lp("allreduce", False)
    lp.ctx, lp.retired, lp.fast = ctx(1 << 20, [100, 200]), [ctx(1 << 19, [50])], {1: None, 2: None}
    ex._loaded = {1: lp}
    m = ex.memory()
    assert m == dict(scratch=1 << 20, sync=4096, retired_scratch=1 << 19, retired_sync=4096, device_plans=350,
                     contexts=1, retired_contexts=1, launch_entries=2, kernels=3, graph_arena=0,
                     evicted_entries=0)
    rc = object.__new__(RuntimeComm)
    rc._sym = [SymAlloc(0, 0, 1 << 21, 1), SymAlloc(1, 0, 256, 2, internal=True)]
    assert rc.memory() == {"symmetric": 1 << 21, "staging": 256, "symmetric_buffers": 1, "staging_buffers": 1}
    ex.comm = rc
    be = RuntimeBackend(rank=0, world_size=2, device=torch.device("cpu"), executor=ex)
    comm = Communicator(backend=be, plans=catalog_of([]), tuning=TuningTable(), fallback=False)
    got = comm.memory()
    assert got["total_bytes"] == (1 << 20) + 4096 + (1 << 19) + 4096 + 350 + (1 << 21) + 256
    assert got["kernels"] == 3
