"""The library's port-channel algorithms through the public Communicator on the simulator back
end (the living definition the GPU runs are compared with): a tuning rule names them, the calls
run on them (never the fallback), on symmetric buffers directly and on ordinary tensors, and the
results equal the collectives' definitions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mscclang.comm.tuning import tuning_from_dict
from mscclang.plan.io import load_plan
from mscclang.comm.sim_ranks import catalog_of, run_ranks

ROOT = Path(__file__).resolve().parents[1] / "plans"


def _plans(n):
    names = [f"allgather_port.r{n}.i1", f"allgather_port.r{n}.i1.inplace", f"alltoall_port.r{n}.i1",
             f"allreduce_port_pipelined.r{n}.i1.steps4", f"allreduce_port_pipelined.r{n}.i1.steps4.inplace"]
    return [load_plan((ROOT / f"{x}.json").read_text()) for x in names]


def _tuning():
    return tuning_from_dict({"format": "mscclang.tuning/1", "rules": [
        {"collective": "allgather", "candidates": [{"plan": "allgather_port"}]},
        {"collective": "alltoall", "candidates": [{"plan": "alltoall_port"}]},
        {"collective": "allreduce", "candidates": [{"plan": "allreduce_port_pipelined"}]},
    ]})


@pytest.mark.parametrize("n", [2, 4])
def test_port_algorithms_through_the_communicator(n):
    numel = 1 << 18   # 1 MiB of int32: the port plans start at 1 MiB (large-message path)

    def body(comm):
        r = comm.rank
        g = torch.Generator().manual_seed(10 + r)
        x = torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int32)
        out = {}
        for kind in ("symmetric", "ordinary"):
            if kind == "symmetric":
                a = comm.empty(numel, dtype=torch.int32)
                a.copy_(x)
                o = comm.empty(numel * n, dtype=torch.int32)
                t = comm.empty(numel, dtype=torch.int32)
            else:
                a, o, t = x.clone(), torch.empty(numel * n, dtype=torch.int32), torch.empty(numel, dtype=torch.int32)
            comm.all_gather(a, out=o)
            comm.all_to_all(a, out=t)
            y = a.clone() if kind == "ordinary" else a
            comm.all_reduce(y)
            out[kind] = (o.clone(), t.clone(), y.clone())
        return x, out

    results, world, fb = run_ranks(n, body, catalog=catalog_of(_plans(n)), tuning=_tuning(), engine="sim")
    assert fb.calls == [], fb.calls
    xs = [res[0] for res in results]
    total = torch.stack(xs).sum(0)
    block = numel // n
    for r, (_, out) in enumerate(results):
        for kind, (o, t, y) in out.items():
            assert torch.equal(o, torch.cat(xs)), (r, kind)
            want_a2a = torch.cat([xs[q][r * block:(r + 1) * block] for q in range(n)])
            assert torch.equal(t, want_a2a), (r, kind)
            assert torch.equal(y, total), (r, kind)
