"""A closed Communicator runs nothing. Seen: after ``comm.close()``, ``all_reduce`` still ran
through the torch.distributed fallback (which ``close`` had released, and which the call made
again) and returned the sum. Every public method of the class is called on a closed
communicator here, and each raises CommError saying so; ``close`` itself stays idempotent."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from mscclang.comm import CommError, Communicator

#: every public method of Communicator, with arguments a caller could pass
CALLS = {
    "empty": lambda c: c.empty(8),
    "is_symmetric": lambda c: c.is_symmetric(torch.ones(8)),
    "all_reduce": lambda c: c.all_reduce(torch.ones(8)),
    "all_reduce_add_rms_norm": lambda c: c.all_reduce_add_rms_norm(torch.ones(2, 8), torch.ones(2, 8), torch.ones(8)),
    "prepare_all_reduce_add_rms_norm": lambda c: c.prepare_all_reduce_add_rms_norm(
        torch.ones(2, 8), torch.ones(2, 8), torch.ones(8)),
    "all_gather": lambda c: c.all_gather(torch.ones(8)),
    "reduce_scatter": lambda c: c.reduce_scatter(torch.ones(8)),
    "all_to_all": lambda c: c.all_to_all(torch.ones(8)),
    "all_to_all_v": lambda c: c.all_to_all_v(torch.ones(4, 4), torch.tensor([2, 2])),
    "moe_dispatch": lambda c: c.moe_dispatch(torch.ones(2, 8), torch.zeros(2, 1, dtype=torch.int64), 2, capacity=4),
    "moe_combine": lambda c: c.moe_combine(torch.ones(1, 4, 8), torch.ones(2, 1), None),
    "broadcast": lambda c: c.broadcast(torch.ones(8)),
    "send_recv": lambda c: c.send_recv(torch.ones(8)),
    "send": lambda c: c.send(torch.ones(8), 1),
    "recv": lambda c: c.recv(torch.ones(8), 1),
    "prepare": lambda c: c.prepare("all_reduce", torch.ones(8)),
    "register": lambda c: c.register(torch.ones(8)),
    "deregister": lambda c: c.deregister(torch.ones(8)),
    "graph_capture": lambda c: c.graph_capture().__enter__(),
    "begin_graph_capture": lambda c: c.begin_graph_capture(),
    "register_graph_buffers": lambda c: c.register_graph_buffers(),
    "use_tuning": lambda c: c.use_tuning({}),
    "warm_up": lambda c: c.warm_up(),
    "select": lambda c: c.select("all_reduce", 1024, torch.float32),
    "trace": lambda c: c.trace(),
    "memory": lambda c: c.memory(),
    "synchronize": lambda c: c.synchronize(),
    "reset": lambda c: c.reset(),
    "with": lambda c: c.__enter__(),
}


def _public_methods() -> set[str]:
    return {n for n, v in inspect.getmembers(Communicator) if not n.startswith("_") and callable(v)
            and not isinstance(inspect.getattr_static(Communicator, n), (classmethod, property))}


def test_every_public_method_is_listed():
    """A method added to the class without an entry here fails this test (and so gets one)."""
    assert _public_methods() - {"close"} == set(CALLS) - {"with"}


@pytest.fixture
def closed() -> Communicator:
    comm = Communicator(store=dist.HashStore(), rank=0, world_size=1, device="cpu")
    comm.close()
    comm.close()   # idempotent
    return comm


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_closed_communicator_refuses_every_call(closed: Communicator, name: str):
    with pytest.raises(CommError, match=r"rank 0: .* on a closed communicator \(close\(\) has run\)"):
        CALLS[name](closed)
    closed.close()   # still returns
