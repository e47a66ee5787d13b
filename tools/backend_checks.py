#!/usr/bin/env python3
"""User-level checks of the ``mscclang`` torch.distributed backend, run under torchrun on GPUs::

    torchrun --nproc-per-node 2 tools/backend_checks.py [--out FILE]

The only mscclang lines are ``import mscclang.distributed`` and ``init_process_group("mscclang")``;
everything else is ordinary torch code on ordinary tensors. Each rank binds GPU
``LOCAL_RANK % device_count`` (with one GPU, export ``MSCCLANG_RANKS_PER_GPU=2``: the two ranks
share it, and what torch.distributed cannot run on NCCL there goes to gloo). Without CUDA every
check runs on CPU tensors (the Communicator then runs each call through its gloo fallback: what
is checked is that torch's callers reach the right operations), except the CUDA-graph capture and
the host-overhead measurement.

Checks, each result compared with the reference every rank computes locally. The inputs' sums
depend on their order (``tests.harness.data``: normal values times ``2**k``, ``k`` in -8..7;
int32 over its whole range, wrapping). After every all-reduce each rank's bytes are compared
with every other rank's (through their digests). A reduction that ran
on a plan must give the canonical result of ``mscclang.reference`` (the ranks folded in rank
order, whatever the size or plan) bit for bit; one the Communicator handed to torch (no plan for
it: every call without a GPU) or that went to the inner torch group (float64, ``reduce``) sums in
torch's order, so it is held to the exact sum within the any-order bound (min, max and integers:
exact). Data movement is compared exactly:

* ``all_reduce`` (sum, avg, min, max; fp16, bf16, fp32, int32; 1 to 1M elements),
  ``all_gather_into_tensor``, list ``all_gather``, ``reduce_scatter_tensor``, list
  ``reduce_scatter``, ``all_to_all_single`` (equal splits), ``broadcast`` from every root,
  ``barrier``, ``send``/``recv``, ``batch_isend_irecv``;
* ``async_op=True``: ``wait()`` then the result, and ``get_future()``;
* calls that go to the inner group: float64 ``all_reduce``, uneven ``all_to_all_single``, ``reduce``;
* CUDA-graph capture of ``dist.all_reduce`` on a size run once eagerly, replayed on new data;
* DDP: 30 training steps of a small MLP on the backend and on a reference group of the same ranks
  (NCCL with a GPU per rank, else gloo), every replica's parameters the same bytes on every rank,
  and bit-identical to the reference's where a sum has the same bits in both groups' orders (two
  ranks, or no GPU), else within 1e-5;
* FSDP2 (``fully_shard`` per layer and on the model, a DeviceMesh over the group): 10 steps,
  parameters against the same run on the reference group, bit-identical on the same terms (on
  ranks sharing a GPU, where the reference would be gloo on CUDA tensors, which gloo cannot
  reduce-scatter: against the same run on the CPU over gloo, within 1e-5);
* tensor parallelism: a DeviceMesh over the backend, ``ColwiseParallel`` then ``RowwiseParallel``
  on a two-layer MLP, the output the same bytes on every rank and within 1e-5 of the unsharded
  model's;
* torch.compile of a function calling ``torch.distributed._functional_collectives.all_reduce``
  (backends ``eager`` and ``inductor``), exact;
* the host time per eager ``dist.all_reduce`` of 4,096 bf16 elements against the same call on the
  group's Communicator, the backend's own host path (the Communicator swapped for a no-op), and
  the time per call of CUDA-graph replays through each (on a shared GPU the GPU times mean little).

Rank 0 prints one JSON line (and writes it to ``--out``): per check ``ok`` and, on failure, the
error. Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import mscclang.distributed  # noqa: F401 - registers the "mscclang" backend
from mscclang import reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository: tests.harness
from tests.harness.data import rank_input  # noqa: E402 - order-sensitive data, the GPU suite's

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32)
SIZES = (1, 1000, 65537, 1 << 20)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (a comparison of bits: NaN equals NaN)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(width)


class Checks:
    """The checks of one rank; ``results`` maps a check's name to None (passed) or the error."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.results: dict[str, Any] = {}
        self.seed = 0

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.results[name] = None
        except Exception as e:  # noqa: BLE001 - recorded, the next check runs
            self.results[name] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()

    def xs(self, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's input for the next call (the same on every rank)."""
        self.seed += 1
        return [rank_input(self.seed, r, numel, dtype, self.device) for r in range(self.world)]

    @staticmethod
    def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        """``got`` has exactly the bits of ``want`` (NaN included)."""
        a, b = _bits(got), _bits(want.to(got.device))
        if not torch.equal(a, b):
            bad = int((a != b).sum())
            raise AssertionError(f"{what}: {bad} of {want.numel()} elements differ from the reference")

    def agree(self, got: torch.Tensor, what: str) -> None:
        """Every rank holds the same bytes in ``got`` (their SHA-256 digests, gathered)."""
        digest = hashlib.sha256(got.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        all_digests: list = [None] * self.world
        dist.all_gather_object(all_digests, digest.hexdigest())
        differ = [q for q, d in enumerate(all_digests) if d != all_digests[0]]
        if differ:
            raise AssertionError(f"{what}: rank(s) {differ} hold other bytes than rank 0")

    @staticmethod
    def close(got: torch.Tensor, xs: list, what: str, scale: float = 1.0) -> None:
        """A sum in torch's order: within the any-order bound of the exact sum times ``scale``
        (per element: the dtype's epsilon x (rank count x the scaled sum of magnitudes + the
        result's magnitude, its last rounding))."""
        wide = torch.stack([x.double().cpu() for x in xs])
        want = wide.sum(0) * scale
        bound = torch.finfo(got.dtype).eps * (len(xs) * wide.abs().sum(0) * scale + want.abs())
        err = (got.double().cpu() - want).abs()
        if bool((err > bound).any()):
            raise AssertionError(f"{what}: {int((err > bound).sum())} elements beyond the any-order bound of the sum")

    def reduced(self, got: torch.Tensor, xs: list, what: str, op: str = "sum", block: int = -1) -> None:
        """The result of the reduction just called (``block``: this rank's block of a
        reduce-scatter): the canonical bits where a plan ran it (or the result is exact in any
        order), else within the any-order bound; after an all-reduce, the same bytes on every rank."""
        if block < 0:
            self.agree(got, what)
        want = self.canonical(xs, op)
        if block >= 0:
            want = want.chunk(self.world)[block]
            xs = [x.chunk(self.world)[block] for x in xs]
        last = dist.group.WORLD.communicator.last
        if (last is not None and last.mode != "nccl") or op in ("min", "max") or not got.is_floating_point():
            self.same(got, want, what)
        else:
            self.close(got, xs, what, 1.0 / self.world if op == "avg" else 1.0)

    def canonical(self, xs: list, op: str = "sum") -> torch.Tensor:
        """The canonical all-reduce of ``xs`` (avg: the canonical sum divided by the rank count
        on this device, as the backend divides)."""
        if op == "avg":
            return reference.all_reduce(xs).to(self.device).div_(self.world)
        return reference.all_reduce(xs, op).to(self.device)

    # -------------------------------------------------------------------------------- checks
    def all_reduce(self) -> None:
        ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        for dtype in DTYPES:
            for numel in SIZES:
                for name, op in ops.items():
                    if name == "avg" and not dtype.is_floating_point:
                        continue
                    xs = self.xs(numel, dtype)
                    t = xs[self.rank].clone()
                    dist.all_reduce(t, op=op)
                    self.reduced(t, xs, f"all_reduce {name} {dtype} {numel}", name)

    def gathers(self) -> None:
        n = self.world
        for dtype in (torch.bfloat16, torch.float32):
            for numel in (1000, 65536):
                xs = self.xs(numel, dtype)
                out = torch.empty(numel * n, dtype=dtype, device=self.device)
                dist.all_gather_into_tensor(out, xs[self.rank])
                self.same(out, torch.cat(xs), f"all_gather_into_tensor {dtype} {numel}")
                outs = [torch.empty(numel, dtype=dtype, device=self.device) for _ in range(n)]
                dist.all_gather(outs, xs[self.rank])
                self.same(torch.cat(outs), torch.cat(xs), f"all_gather list {dtype} {numel}")
                xs = self.xs(numel * n, dtype)
                out = torch.empty(numel, dtype=dtype, device=self.device)
                dist.reduce_scatter_tensor(out, xs[self.rank])
                self.reduced(out, xs, f"reduce_scatter_tensor {dtype} {numel}", block=self.rank)
                out = torch.empty(numel, dtype=dtype, device=self.device)
                dist.reduce_scatter(out, list(xs[self.rank].chunk(n)))
                self.reduced(out, xs, f"reduce_scatter list {dtype} {numel}", block=self.rank)
                out = torch.empty(numel * n, dtype=dtype, device=self.device)
                dist.all_to_all_single(out, xs[self.rank])
                self.same(out, torch.cat([x.chunk(n)[self.rank] for x in xs]), f"all_to_all_single {dtype}")

    def broadcast_barrier(self) -> None:
        for root in range(self.world):
            xs = self.xs(4099, torch.bfloat16)
            t = xs[self.rank].clone()
            dist.broadcast(t, src=root)
            self.same(t, xs[root], f"broadcast root {root}")
        dist.barrier()

    def point_to_point(self) -> None:
        n, r = self.world, self.rank
        xs = self.xs(2048, torch.float32)
        got = torch.empty_like(xs[r])
        if r % 2 == 0:
            dist.send(xs[r], dst=(r + 1) % n)
            dist.recv(got, src=(r + 1) % n)
        else:
            dist.recv(got, src=(r - 1) % n)
            dist.send(xs[r], dst=(r - 1) % n)
        self.same(got, xs[(r + 1) % n if r % 2 == 0 else (r - 1) % n], "send/recv")
        xs = self.xs(2048, torch.float32)
        got = torch.empty_like(xs[r])
        ops = [dist.P2POp(dist.isend, xs[r], (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        self.same(got, xs[(r - 1) % n], "batch_isend_irecv ring")

    def async_ops(self) -> None:
        xs = self.xs(100_000, torch.bfloat16)
        t = xs[self.rank].clone()
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        self.reduced(t, xs, "async all_reduce after wait()")
        t = xs[self.rank].clone()
        fut = dist.all_reduce(t, async_op=True).get_future()
        self.reduced(fut.wait()[0], xs, "async all_reduce future")

    def inner_group(self) -> None:
        n, r = self.world, self.rank
        xs = self.xs(1000, torch.float64)
        t = xs[r].clone()
        dist.all_reduce(t)
        self.close(t, xs, "float64 all_reduce (inner group)")
        self.agree(t, "float64 all_reduce (inner group)")
        xs = self.xs(3 * n, torch.float32)
        t = xs[r].clone()
        dist.reduce(t, dst=0)
        if r == 0:
            self.close(t, xs, "reduce (inner group)")
        splits = [r + 1 + q for q in range(n)]   # rank r sends r+1+q elements to rank q
        inp = torch.arange(sum(splits), dtype=torch.float32, device=self.device) + 100 * r
        outs = [q + 1 + r for q in range(n)]
        out = torch.empty(sum(outs), dtype=torch.float32, device=self.device)
        dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=splits)
        want = []
        for q in range(n):
            qs = [q + 1 + j for j in range(n)]
            start = sum(qs[:r])
            want.append(torch.arange(start, start + qs[r], dtype=torch.float32, device=self.device) + 100 * q)
        self.same(out, torch.cat(want), "uneven all_to_all_single (inner group)")

    def graph(self) -> None:
        numel = 8192
        t = torch.zeros(numel, dtype=torch.bfloat16, device=self.device)
        dist.all_reduce(t)   # the size runs once eagerly: its set-up happens outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                dist.all_reduce(t)
        torch.cuda.current_stream().wait_stream(s)
        for i in range(5):
            xs = self.xs(numel, torch.bfloat16)
            t.copy_(xs[self.rank])
            g.replay()
            torch.cuda.synchronize()
            self.reduced(t, xs, f"graph replay {i}")

    def same_order(self) -> bool:
        """Whether a sum over the ranks has the same bits on mscclang and on the reference group:
        two ranks (a sum of two is the same in either order), or no GPU (every call of both goes
        to gloo). Otherwise mscclang's plans fold in rank order and NCCL or gloo in theirs, so a
        training run compared with the reference's is close, not bit-identical."""
        return self.world == 2 or self.device.type == "cpu"

    def reference_group(self) -> Any:
        """NCCL with a GPU per rank, else gloo (CPU, or ranks sharing a GPU)."""
        from mscclang.comm.fallback import torch_backend_for

        return dist.new_group(backend=torch_backend_for(self.device.type))

    def ddp(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ref = self.reference_group()
        cuda = self.device.type == "cuda"

        def train(group: Any) -> list[torch.Tensor]:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(self.device)
            m = DDP(model, device_ids=[self.device.index] if cuda else None, process_group=group, bucket_cap_mb=0.01)
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            gen = torch.Generator().manual_seed(1000 + self.rank)
            for _ in range(30):
                x = torch.randn(16, 64, generator=gen).to(self.device)
                y = torch.randn(16, 8, generator=gen).to(self.device)
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                opt.step()
            if cuda:
                torch.cuda.synchronize()
            return [p.detach().clone() for p in model.parameters()]

        ours, theirs = train(dist.group.WORLD), train(ref)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            self.agree(a, f"DDP parameter {i} (every replica)")
            if self.same_order():
                self.same(a, b, f"DDP parameter {i} (mscclang against the reference group)")
            elif not torch.allclose(a, b, atol=1e-5, rtol=1e-5):
                raise AssertionError(f"DDP parameter {i}: max |diff| {float((a - b).abs().max())} from the reference group")

    def _fsdp_train(self, mesh: Any, device: torch.device) -> list[torch.Tensor]:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 7)).to(device)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)   # uneven: 33x64 and 7 rows do not split evenly
        fully_shard(m, mesh=mesh)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + self.rank)
        for _ in range(10):
            x = torch.randn(8, 33, generator=g).to(device)
            y = torch.randn(8, 7, generator=g).to(device)
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        return [p.full_tensor().detach().cpu().clone() for p in m.parameters()]

    def fsdp2(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        from mscclang.comm.fallback import torch_backend_for

        ours = self._fsdp_train(init_device_mesh(self.device.type, (self.world,)), self.device)
        shared = self.device.type == "cuda" and torch_backend_for("cuda") == "gloo"
        if shared:   # ranks share a GPU: the reference runs on the CPU over gloo
            ref = self._fsdp_train(DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu"), torch.device("cpu"))
        else:
            ref = self._fsdp_train(DeviceMesh.from_group(self.reference_group(), self.device.type), self.device)
        exact = self.same_order() and not shared
        for i, (a, b) in enumerate(zip(ours, ref)):
            if exact:
                self.same(a, b, f"FSDP2 parameter {i}")
            elif not torch.allclose(a, b, atol=1e-5, rtol=1e-5):
                raise AssertionError(f"FSDP2 parameter {i}: max |diff| {float((a - b).abs().max())}")

    def tensor_parallel(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(self.device.type, (self.world,))
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(self.device)
        ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(self.device)
        ref.load_state_dict(m.state_dict())
        tp = parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5)).to(self.device)
        y = tp(x)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        want = ref(x)
        self.agree(y, "tensor-parallel output (every rank)")   # the row-parallel all-reduce's result
        if not torch.allclose(y, want, atol=1e-5, rtol=1e-5):
            raise AssertionError(f"tensor-parallel output: max |diff| {float((y - want).abs().max())}")

    def compiled(self) -> None:
        import torch.distributed._functional_collectives as funcol

        def f(x: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

        x = torch.full((1024,), float(self.rank + 1), device=self.device)
        want = torch.full((1024,), 2.0 * sum(range(1, self.world + 1)) + 1, device=self.device)
        for backend in ("eager", "inductor"):
            torch._dynamo.reset()
            self.same(torch.compile(f, backend=backend)(x), want, f"torch.compile ({backend}) functional all_reduce")

    def overhead(self) -> dict:
        """Host time per eager call (medians of 200): ``dist.all_reduce``, the group's own
        ``allreduce`` called directly, the Communicator's ``all_reduce``, and torch's wrapper plus
        the group's Python path alone (the Communicator swapped for a no-op: what the backend
        costs the host, whatever the GPU does); then the time per call of CUDA-graph replays of 20
        captured calls, through ``dist.all_reduce`` and through the Communicator (replays run no
        Python: the two should be equal)."""
        pg = dist.group.WORLD
        comm = pg.communicator
        t = torch.ones(4096, dtype=torch.bfloat16, device=self.device)
        sync = dist.AllreduceOptions()
        sync.asyncOp = False

        def med(fn: Callable[[], Any], n: int = 200) -> float:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            return sorted(ts)[len(ts) // 2] * 1e6

        via_dist = med(lambda: dist.all_reduce(t))
        via_group = med(lambda: pg.allreduce([t], sync).wait())
        direct = med(lambda: comm.all_reduce(t))
        real, pg._comm = pg._comm, _NoOpCommunicator()
        try:
            path = med(lambda: dist.all_reduce(t), 2000)
        finally:
            pg._comm = real

        def replay_us(call: Callable[[], Any]) -> float:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    for _ in range(20):
                        call()
            torch.cuda.current_stream().wait_stream(s)
            per = []
            for _ in range(30):
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                g.replay()
                torch.cuda.synchronize()
                per.append((time.perf_counter() - t0) / 20)
            return sorted(per)[len(per) // 2] * 1e6

        g_dist = replay_us(lambda: dist.all_reduce(t))
        g_comm = replay_us(lambda: comm.all_reduce(t))
        return {"dist_all_reduce_us": round(via_dist, 1), "group_allreduce_us": round(via_group, 1),
                "communicator_all_reduce_us": round(direct, 1), "host_overhead_us": round(via_dist - direct, 1),
                "backend_host_path_us": round(path, 2), "graph_dist_us": round(g_dist, 2),
                "graph_communicator_us": round(g_comm, 2)}


class _NoOpCommunicator:
    """Stands in for the group's Communicator while the backend's own host path is timed."""

    def all_reduce(self, tensor: Any, op: Any = "sum", out: Any = None) -> Any:
        return tensor


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(prog="backend_checks.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", metavar="FILE", help="also write rank 0's JSON line to FILE")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        print("backend_checks: run under torchrun (torchrun --nproc-per-node 2 tools/backend_checks.py)",
              file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("mscclang")
    c = Checks(device)
    t0 = time.perf_counter()
    names = ["all_reduce", "gathers", "broadcast_barrier", "point_to_point", "async_ops", "inner_group",
             "ddp", "fsdp2", "tensor_parallel", "compiled"]
    for name in names + (["graph"] if cuda else []):
        c.run(name, getattr(c, name))
        dist.barrier()
    extra: dict = {}
    if cuda:
        c.run("overhead", lambda: extra.update(c.overhead()))
    res = {"world_size": c.world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "ranks_per_gpu": os.environ.get("MSCCLANG_RANKS_PER_GPU", "1"), "seconds": round(time.perf_counter() - t0, 1),
           "checks": {k: ("ok" if v is None else v) for k, v in c.results.items()}, **extra}
    failed = [k for k, v in c.results.items() if v is not None]
    flags = torch.tensor([len(failed)], dtype=torch.int32, device=device)
    dist.all_reduce(flags)
    if c.rank == 0:
        line = json.dumps(res)
        print(line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
    dist.destroy_process_group()
    return 0 if int(flags.item()) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
