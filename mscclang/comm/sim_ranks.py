"""Helpers to exercise the communicator on the CPU: stub plans, in-memory catalogs, and a
thread-per-rank harness over :mod:`mscclang.comm.sim_backend` (with a thread fallback that plays
torch.distributed's part)."""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Optional, Sequence, Union

from mscclang.comm.catalog import Catalog, PlanVariant
from mscclang.comm.communicator import Communicator
from mscclang.comm.errors import CommError
from mscclang.comm.sim_backend import SimWorld, numpy_to_torch, torch_to_numpy
from mscclang.comm.tuning import TuningTable
from mscclang.plan.collectives import collective as collective_row
from mscclang.plan.collectives import plan_collective
from mscclang.plan.models import MAX_MESSAGE_SIZE, BufferKind, ChannelDesc, ChannelType, Gpu, Plan, RemoteBuffer

def stub_plan(collective: str, world_size: int, *, name: Optional[str] = None, inplace: bool = False,
              symmetric: bool = False, protocol: str = "Simple", root: Optional[int] = None,
              min_bytes: int = 0, max_bytes: int = MAX_MESSAGE_SIZE, threads: int = 1024) -> Plan:
    """A plan with the metadata of a collective and no ops: enough for the selector, the
    communicator's staging logic and the reference engine (which computes the definition)."""
    coll = plan_collective(collective)
    n = world_size
    row = collective_row(coll)
    cin, cout = row.chunks(n, 1)
    kind = BufferKind.output if symmetric else BufferKind.scratch
    gpus = []
    for r in range(n):
        peers = [p for p in range(n) if p != r]
        gpus.append(Gpu(
            id=r, input_chunks=cin, output_chunks=cout, scratch_chunks=0 if symmetric else cin,
            channels=[ChannelDesc(channel_type=ChannelType.memory, connected_to=peers)] if peers else [],
            remote_buffers=[RemoteBuffer(rank=p, type=kind, access_channel_types=[ChannelType.memory])
                            for p in peers]))
    return Plan(name=name or f"{coll}_stub", collective=coll, protocol=protocol, inplace=inplace,
                num_threads_per_block=threads, root=root if row.rooted else None,
                min_message_size=min_bytes, max_message_size=max_bytes, gpus=gpus)


def catalog_of(plans: Sequence[Plan]) -> Catalog:
    """A catalog holding these plans (key = plan name, plus ``.ip`` for an in-place plan whose
    name an out-of-place plan also has)."""
    names = [p.name for p in plans]
    return Catalog(PlanVariant.from_plan(p, key=p.name + (".ip" if p.inplace and names.count(p.name) > 1 else ""))
                   for p in plans)


class ThreadFallback:
    """torch.distributed's role for threads: each collective is computed by the definition
    through a reference :class:`SimWorld`; ``calls`` records what ran."""

    def __init__(self, world: SimWorld) -> None:
        self.world = world
        self.calls: list[str] = []

    def _run(self, coll: str, rank: int, inp: Any, out: Any, op: str = "sum", root: int = 0) -> None:
        from mscclang.comm.sim_backend import _Launch

        plan = stub_plan(coll, self.world.world_size, name=f"fallback_{coll}", root=root)
        res = self.world.launch(rank, _Launch(plan, torch_to_numpy(inp), out.numel(), op, None, None))
        out.reshape(-1).copy_(numpy_to_torch(res, out))
        self.calls.append(coll)

    def bind(self, rank: int) -> "_BoundFallback":
        return _BoundFallback(self, rank)


class _BoundFallback:
    def __init__(self, fb: ThreadFallback, rank: int) -> None:
        self.fb, self.rank = fb, rank

    def all_reduce(self, inp: Any, out: Any, op: str) -> None:
        self.fb._run("allreduce", self.rank, inp, out, op)

    def all_gather(self, inp: Any, out: Any) -> None:
        self.fb._run("allgather", self.rank, inp, out)

    def reduce_scatter(self, inp: Any, out: Any, op: str) -> None:
        self.fb._run("reducescatter", self.rank, inp, out, op)

    def all_to_all(self, inp: Any, out: Any) -> None:
        self.fb._run("alltoall", self.rank, inp.clone(), out)

    def broadcast(self, tensor: Any, root: int) -> None:
        self.fb._run("broadcast", self.rank, tensor.clone(), tensor, root=root)

    def all_to_all_v(self, inp: Any, out: Any, sends: list, recvs: list) -> None:
        """Rows by the definition: every rank's input and send counts exchanged, this rank's
        rows picked out in rank order."""
        import pickle

        import torch

        row = inp[0].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
        mine = inp.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        every = [pickle.loads(b) for b in self.fb.world.exchange(self.rank, pickle.dumps((mine, list(sends), row)),
                                                                 "all_to_all_v")]
        got = b"".join(data[sum(s[: self.rank]) * rb: sum(s[: self.rank + 1]) * rb] for data, s, rb in every)
        width = math.prod(out.shape[1:]) * out.element_size()
        if len(got) != sum(recvs) * width:
            raise CommError(f"rank {self.rank}: all_to_all_v: the splits disagree with the rows received")
        if got:
            out.reshape(-1).view(torch.uint8)[: len(got)].copy_(torch.frombuffer(bytearray(got), dtype=torch.uint8))
        self.fb.calls.append("all_to_all_v")

    def send_recv(self, inp: Any, out: Any, rank: int, world_size: int) -> None:
        self.fb._run("sendrecv", self.rank, inp.clone(), out)

    def send(self, tensor: Any, dst: int) -> None:
        raise CommError("the thread fallback has no point-to-point send")

    def recv(self, tensor: Any, src: int) -> None:
        raise CommError("the thread fallback has no point-to-point recv")


def run_ranks(world_size: int, fn: Callable[[Communicator], Any], *, plans: Sequence[Plan] = (),
              catalog: Optional[Catalog] = None, tuning: Optional[TuningTable] = None,
              engine: str = "reference", granule: Union[int, Callable[[Plan], int]] = 1,
              fallback: bool = True, batch_invariant: Optional[bool] = None,
              timeout: float = 60.0, refuse_unaligned: int = 0,
              **world_options: Any) -> tuple[list[Any], SimWorld, ThreadFallback]:
    """Run ``fn(comm)`` on ``world_size`` threads, one communicator each; return the results
    (rank order), the world and the fallback. The first exception of any rank is re-raised.
    ``batch_invariant`` goes to every :class:`Communicator`.
    ``world_options`` go to :class:`SimWorld` (``register``, ``staging_cap``, ``unexportable``,
    ``max_registrations``)."""
    world = SimWorld(world_size, engine=engine, granule=granule, timeout=timeout,
                     refuse_unaligned=refuse_unaligned, **world_options)
    fb = ThreadFallback(SimWorld(world_size, engine="reference", timeout=timeout))
    cat = catalog if catalog is not None else catalog_of(plans)
    results: list[Any] = [None] * world_size
    errors: list[Optional[BaseException]] = [None] * world_size

    def body(r: int) -> None:
        try:
            comm = Communicator(backend=world.backend(r), tuning=tuning or TuningTable(), plans=cat,
                                fallback=fb.bind(r) if fallback else False, batch_invariant=batch_invariant)
            results[r] = fn(comm)
        except BaseException as e:  # re-raised in the caller
            errors[r] = e
            world._barrier.abort()
            fb.world._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    for e in errors:
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise e
    for e in errors:
        if e is not None:
            raise e
    return results, world, fb
