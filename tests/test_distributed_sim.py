"""The torch.distributed backend's op mapping onto the library's plans, on the CPU: each rank's
:class:`~mscclang.distributed.MscclangProcessGroup` runs on a Communicator whose back end is the
simulator (every call runs a shipped plan, simulated for all ranks at once; threads stand for the
ranks), and every result is compared exactly with the result computed locally: reductions, on
data whose sums depend on the order, with :mod:`mscclang.reference`'s canonical fold (every plan
keeps it). Nothing may go to torch.distributed: the fallback records no call."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from mscclang import reference
from mscclang.comm.sim_ranks import run_ranks
from mscclang.comm.tuning import load_tuning
from mscclang.distributed import MscclangProcessGroup
from tests.harness.data import spread

WORLD = 2


def _x(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: sums of these depend on their order (int32: exact in any order)."""
    return spread(n, dtype, 1000 * seed + rank)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _opts(kind, reduce_op=None, async_op: bool = False, root=None):
    o = kind()
    if reduce_op is not None:
        o.reduceOp = reduce_op
    if root is not None:
        o.rootRank, o.rootTensor = root, 0
    o.asyncOp = async_op
    return o


def _pg(comm) -> MscclangProcessGroup:
    return MscclangProcessGroup(None, comm.rank, comm.world_size, device="cpu", communicator=comm)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_run_the_librarys_plans(catalog, world: int):
    def body(comm):
        pg, r, n = _pg(comm), comm.rank, comm.world_size
        done = 0
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
            for numel in (n, 1000, 4104):   # divisible by 2 and 4
                xs = [_x(q, numel, dtype, numel) for q in range(n)]
                canonical = reference.all_reduce(xs)
                ops = {dist.ReduceOp.SUM: canonical, dist.ReduceOp.MIN: reference.all_reduce(xs, "min"),
                       dist.ReduceOp.MAX: reference.all_reduce(xs, "max")}
                if dtype.is_floating_point:
                    ops[dist.ReduceOp.AVG] = canonical.clone().div_(n)   # the backend's avg: the sum, then div_
                for op, want in ops.items():
                    t = xs[r].clone()
                    assert pg.allreduce([t], _opts(dist.AllreduceOptions, op)).wait()
                    assert torch.equal(_bits(t), _bits(want)), (dtype, numel, op)
                    done += 1
                out = torch.empty(numel * n, dtype=dtype)
                pg._allgather_base(out, xs[r], _opts(_c10d.AllgatherOptions)).wait()
                assert torch.equal(out, torch.cat(xs))
                outs = [torch.empty(numel, dtype=dtype) for _ in range(n)]
                pg.allgather([outs], [xs[r]], _opts(_c10d.AllgatherOptions)).wait()
                assert torch.equal(torch.cat(outs), torch.cat(xs))
                out = torch.empty(numel // n, dtype=dtype)
                pg._reduce_scatter_base(out, xs[r], _opts(dist.ReduceScatterOptions, dist.ReduceOp.SUM)).wait()
                assert torch.equal(_bits(out), _bits(canonical.chunk(n)[r]))
                out = torch.empty(numel // n, dtype=dtype)
                pg.reduce_scatter([out], [list(xs[r].chunk(n))], _opts(dist.ReduceScatterOptions, dist.ReduceOp.SUM)).wait()
                assert torch.equal(_bits(out), _bits(canonical.chunk(n)[r]))
                out = torch.empty(numel, dtype=dtype)
                pg.alltoall_base(out, xs[r], [], [], _opts(dist.AllToAllOptions)).wait()
                assert torch.equal(out, torch.cat([x.chunk(n)[r] for x in xs]))
                for root in range(n):
                    t = xs[r].clone()
                    pg.broadcast([t], _opts(dist.BroadcastOptions, root=root)).wait()
                    assert torch.equal(t, xs[root])
                done += 6
        pg.barrier(_opts(dist.BarrierOptions)).wait()
        # coalesced all_reduce (DDP's buckets may come this way): one call per tensor
        ts = [_x(r, 64, torch.float32, 7), _x(r, 130, torch.float32, 8)]
        want = [reference.all_reduce([_x(q, 64, torch.float32, 7) for q in range(n)]),
                reference.all_reduce([_x(q, 130, torch.float32, 8) for q in range(n)])]
        pg.allreduce_coalesced(ts, _opts(dist.AllreduceCoalescedOptions, dist.ReduceOp.SUM)).wait()
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ts, want))
        assert pg._inner == {}
        pg.shutdown()
        return done

    results, _, fb = run_ranks(world, body, catalog=catalog, tuning=load_tuning(), engine="sim")
    assert len(set(results)) == 1 and results[0] > 100
    assert fb.calls == []   # every call ran a plan


def test_async_work_holds_the_result_and_errors_come_through_wait(catalog):
    from mscclang.errors import InvalidCall

    def body(comm):
        pg, r = _pg(comm), comm.rank
        t = _x(r, 1000, torch.bfloat16, 3)
        w = pg.allreduce([t], _opts(dist.AllreduceOptions, dist.ReduceOp.SUM, async_op=True))
        want = (_x(0, 1000, torch.bfloat16, 3).double() + _x(1, 1000, torch.bfloat16, 3).double()).to(torch.bfloat16)
        assert w.wait() and w.is_success() and torch.equal(t, want)
        assert torch.equal(w.get_future().wait()[0], want)
        # a root outside the group: raised from the call when synchronous, from wait() when not
        with pytest.raises(InvalidCall):
            pg.broadcast([t], _opts(dist.BroadcastOptions, root=5))
        w = pg.broadcast([t], _opts(dist.BroadcastOptions, root=5, async_op=True))
        assert not w.is_success()
        with pytest.raises(InvalidCall):
            w.wait()
        with pytest.raises(InvalidCall):   # never a failed future (DDP's reducer crashed on one)
            w.get_future()
        pg.shutdown()
        return True

    results, _, fb = run_ranks(WORLD, body, catalog=catalog, tuning=load_tuning(), engine="sim")
    assert results == [True, True]


def test_methods_called_without_options_use_the_defaults(catalog):
    """Found by these tests: ``all_gather`` with no options raised AttributeError (torch does not
    re-export ``AllgatherOptions`` from torch.distributed). Every mapped method takes None."""

    def body(comm):
        pg, r, n = _pg(comm), comm.rank, comm.world_size
        xs = [_x(q, 8, torch.float32, 11) for q in range(n)]
        t = xs[r].clone()
        pg.allreduce([t]).wait()
        assert torch.equal(t, sum(xs))
        out = torch.empty(8 * n)
        pg._allgather_base(out, xs[r]).wait()
        outs = [torch.empty(8) for _ in range(n)]
        pg.allgather([outs], [xs[r]]).wait()
        assert torch.equal(out, torch.cat(xs)) and torch.equal(torch.cat(outs), torch.cat(xs))
        out = torch.empty(8 // n)
        pg._reduce_scatter_base(out, xs[r]).wait()
        assert torch.equal(out, sum(xs).chunk(n)[r])
        out = torch.empty(8)
        pg.alltoall_base(out, xs[r], [], []).wait()
        t = xs[r].clone()
        pg.broadcast([t]).wait()
        assert torch.equal(t, xs[0])
        pg.barrier().wait()
        pg.shutdown()
        return True

    results, _, fb = run_ranks(WORLD, body, catalog=catalog, tuning=load_tuning(), engine="sim")
    assert results == [True, True] and fb.calls == []


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_all_to_alls_run_the_all_to_all_v_plans(catalog, world):
    """``all_to_all_single`` with explicit splits (zeros among them) and list ``all_to_all`` of
    unequal sizes run on the all-to-all-v plans: rows of 2-D tensors, and 1-D 16-bit tensors as
    4-byte words; every rank's bytes against the result computed locally."""
    def body(comm):
        pg, r, n = _pg(comm), comm.rank, comm.world_size
        sends = [[(p + 2 * q) % 3 * 2 for q in range(n)] for p in range(n)]   # rank p sends sends[p][q] to q
        recvs = [sends[p][r] for p in range(n)]
        rows = [torch.arange(sum(sends[p]) * 3, dtype=torch.float32).view(-1, 3) + 100 * p for p in range(n)]
        out = torch.full((sum(recvs), 3), -1.0)
        pg.alltoall_base(out, rows[r], recvs, sends[r], _opts(dist.AllToAllOptions)).wait()
        want = torch.cat([rows[p][sum(sends[p][:r]): sum(sends[p][: r + 1])] for p in range(n)])
        assert torch.equal(out, want)
        assert comm.last_all_to_all_v is not None and comm.last_all_to_all_v.startswith("alltoallv_")
        flat = [(torch.arange(sum(sends[p]), dtype=torch.int32) + 1000 * p).to(torch.bfloat16) for p in range(n)]
        out = torch.zeros(sum(recvs), dtype=torch.bfloat16)
        pg.alltoall_base(out, flat[r], recvs, sends[r], _opts(dist.AllToAllOptions)).wait()
        want = torch.cat([flat[p][sum(sends[p][:r]): sum(sends[p][: r + 1])] for p in range(n)])
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        ins = [torch.full((sends[r][q],), float(10 * r + q)) for q in range(n)]
        outs = [torch.empty(recvs[p]) for p in range(n)]
        pg.alltoall(outs, ins, _opts(dist.AllToAllOptions)).wait()
        assert all(torch.equal(o, torch.full((recvs[p],), float(10 * p + r))) for p, o in enumerate(outs))
        assert pg._inner == {}
        return True

    results, _, fb = run_ranks(world, body, catalog=catalog, tuning=load_tuning(), engine="sim")
    assert results == [True] * world
    assert fb.calls == []   # every call ran a plan
