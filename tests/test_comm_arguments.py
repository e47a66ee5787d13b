"""Bad arguments of the DSL and of the Communicator are one clear mscclang error naming the
argument and its value: a CollectiveProgram argument the plan model refuses is a DSLError (not
pydantic's ValidationError with its URL), a rank argument of the Communicator (broadcast's and
prepare's root, send's dst, recv's src) that is not an int rank an InvalidCall."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mscclang.comm import CommError
from mscclang.comm.sim_ranks import run_ranks, stub_plan
from mscclang.dsl.program import AllReduce, CollectiveProgram
from mscclang.dsl.rank import Semaphore
from mscclang.errors import DSLError, InvalidCall


@pytest.mark.parametrize("kw,needle", [
    ({"buffer_alignment": 3}, "buffer_alignment=3: buffer_alignment must be a power of two"),
    ({"buffer_alignment": 0}, "buffer_alignment=0"),
    ({"buffer_alignment": True}, "buffer_alignment=True"),
    ({"buffer_alignment": 1 << 21}, "buffer_alignment=2097152"),
    ({"min_message_size": 2.5}, "min_message_size=2.5"),
    ({"min_message_size": "1"}, "min_message_size='1'"),
    ({"max_message_size": -1}, "max_message_size=-1"),
    ({"max_message_size": 1 << 65}, f"max_message_size={1 << 65}"),
    ({"min_message_size": 10, "max_message_size": 5}, "min_message_size exceeds max_message_size"),
    ({"num_threads_per_block": 16}, "num_threads_per_block=16"),
    ({"num_threads_per_block": 64.0}, "num_threads_per_block=64.0"),
    ({"name": 5}, "name=5"),
    ({"name": "x" * 2000}, "at most 1024 characters"),
])
def test_a_program_argument_the_plan_refuses_is_a_dsl_error(kw, needle):
    """Seen: buffer_alignment=3 gave pydantic's ValidationError with its URL, at to_plan()."""
    args = {"name": "p", "collective": AllReduce(2, 1, True), "num_ranks": 2, **kw}
    with pytest.raises(DSLError) as e:
        with CollectiveProgram(**args) as prog:
            pass
        prog.to_plan()
    assert needle in str(e.value) and "pydantic" not in str(e.value) and "CollectiveProgram(" in str(e.value)


def test_a_value_no_dsl_call_checks_is_a_dsl_error_at_compile():
    with CollectiveProgram("big", AllReduce(2, 1 << 40, True), 2) as prog:
        pass
    with pytest.raises(DSLError, match="big: the compiled plan is refused at input_chunks"):
        prog.to_plan()
    with CollectiveProgram("sem", AllReduce(2, 1, True), 2) as prog:
        with pytest.raises(DSLError, match=r"initial_value must be an int in 0\.\.2147483647"):
            Semaphore(0, initial_value=1 << 40)


def _misuse(call):
    def body(comm):
        try:
            call(comm)
        except InvalidCall as e:
            return type(e).__name__, str(e)
        return None

    plans = [stub_plan("broadcast", 2, name="bc", inplace=True, root=0),
             stub_plan("broadcast", 2, name="bc1", inplace=True, root=1)]
    results, _, _ = run_ranks(2, body, plans=plans, timeout=10)
    return results


@pytest.mark.parametrize("call,needle", [
    (lambda c: c.broadcast(torch.ones(4), root="0"), "broadcast root '0' is not a rank: use an int in 0..1"),
    (lambda c: c.broadcast(torch.ones(4), root=1.0), "broadcast root 1.0 is not a rank: use an int in 0..1"),
    (lambda c: c.broadcast(torch.ones(4), root=True), "broadcast root True is not a rank: use an int in 0..1"),
    (lambda c: c.broadcast(torch.ones(4), root=None), "broadcast root None is not a rank: use an int in 0..1"),
    (lambda c: c.broadcast(torch.ones(4), root=torch.tensor(1.0)), "broadcast root tensor(1.) is not a rank"),
    (lambda c: c.broadcast(torch.ones(4), root=-1), "broadcast root -1 is not a rank: use an int in 0..1"),
    (lambda c: c.broadcast(torch.ones(4), root=2), "broadcast root 2 is not a rank: use an int in 0..1"),
    (lambda c: c.prepare("broadcast", torch.ones(4), root="1"), "broadcast root '1' is not a rank: use an int in 0..1"),
    (lambda c: c.prepare("broadcast", torch.ones(4), root=7), "broadcast root 7 is not a rank: use an int in 0..1"),
    (lambda c: c.send(torch.ones(4), dst="1"), "send dst '1' is not a rank: use an int in 0..1"),
    (lambda c: c.send(torch.ones(4), dst=c.rank), "not another rank of 2 (it is this one)"),
    (lambda c: c.send(torch.ones(4), dst=5), "send dst 5 is not a rank: use an int in 0..1"),
    (lambda c: c.recv(torch.ones(4), src=1.5), "recv src 1.5 is not a rank: use an int in 0..1"),
    (lambda c: c.recv(torch.ones(4), src=-3), "recv src -3 is not a rank: use an int in 0..1"),
])
def test_a_rank_argument_that_is_no_rank_is_an_invalid_call(call, needle):
    """Seen: broadcast(x, root='0') raised a raw TypeError ('<=' between int and str)."""
    for res in _misuse(call):
        assert res is not None and res[0] == "CommError" and needle in res[1], res


def test_integer_ranks_of_numpy_and_torch_are_ranks():
    def body(comm):
        out = []
        for root in (np.int64(1), torch.tensor(1)):
            t = torch.full((4,), float(comm.rank + 1))
            comm.broadcast(t, root=root)
            out.append(t.tolist())
        return out

    plans = [stub_plan("broadcast", 2, name="bc1", inplace=True, root=1)]
    results, _, _ = run_ranks(2, body, plans=plans, timeout=10)
    assert results == [[[2.0] * 4] * 2] * 2
    assert issubclass(CommError, InvalidCall)
