"""Plans (JSON dicts) whose correctness rests on a ``nop`` after a multi-channel wait, for the
per-thread acquisition tests (issue 33 item 1), and the mutants that delete that ``nop`` or swap
it with the wait.

* :func:`relay_allgather`: a 3-rank allgather through rank 0's output. Ranks 1 and 2 put their
  input into rank 0's output chunk and signal; rank 0 waits on both channels in one op (thread 0
  on rank 1, thread 1 on rank 2), ``nop``, then signals both in one op; ranks 1 and 2 then read
  the chunks they lack from rank 0's output. Thread 0's signal to rank 1 must carry rank 2's put,
  which only thread 1 waited for: without the ``nop`` it does not.
* ``relay_allgather(port=True)``: the same with rank 0's second signal (and the peers' wait
  for it) on port channels: a multi-channel port ``signal`` is one request per channel, channel
  ``k`` from thread ``k``.
* ``relay_allgather(semaphore=True)``: the same, but rank 0's peers write its scratch and the
  waiting block hands over to a second block through a semaphore, which copies the scratch into
  the output and then signals: the ``sem_release`` after the two-channel wait must carry both.
* :func:`mutants`: the plan with the ``nop`` after a given op deleted, and that ``nop`` swapped
  with the op before it.
"""

from __future__ import annotations

import copy

from tests.harness.plan_samples import L, R, op

#: (rank 0's block, op index) of the multi-channel wait whose nop the mutants remove
RELAY_WAIT = {False: (0, 3), True: (0, 1)}


def _chans(ids: list[int], port: bool) -> list[dict]:
    return [{"channel_type": t, "channel_ids": ids} for t in ("memory", "port")[:1 + port]]


def _peer_gpu(r: int, semaphore: bool, port: bool) -> dict:
    other = 3 - r
    dst = "s" if semaphore else "o"
    ops = [
        op("rlxwait", ct="memory", ch=[0]),
        op("nop"),
        op("put", [L("i", 0)], [R(0, r)], "memory"),
        op("nop"),
        op("signal", ct="memory", ch=[0]),
        op("wait", ct="port" if port else "memory", ch=[0]),
        op("nop"),
        op("copy", [L("i", 0)], [L("o", r)]),
        op("get", [R(1, 0), R(1, other)], [L("o", 0), L("o", other)], "memory"),
        op("nop"),
        op("signal", ct="memory", ch=[0]),
    ]
    rbufs = [{"rank": 0, "type": dst, "access_channel_types": ["memory"]},
             {"rank": 0, "type": "o", "access_channel_types": ["memory"]}]
    return {"id": r, "input_chunks": 1, "output_chunks": 3, "scratch_chunks": 0,
            "threadblocks": [{"id": 0, "ops": ops,
                              "channels": _chans([0], port),
                              "remote_buffer_refs": [{"access_channel_type": "memory",
                                                      "remote_buffer_ids": [0, 1]}]}],
            "channels": [{"channel_type": t, "connected_to": [0]} for t in ("memory", "port")[:1 + port]],
            "remote_buffers": rbufs, "semaphores": []}


def _rank0_gpu(semaphore: bool, port: bool) -> dict:
    both = [0, 1]
    chans = _chans(both, port)
    if not semaphore:
        tbs = [{"id": 0, "channels": chans, "ops": [
            op("copy", [L("i", 0)], [L("o", 0)]),
            op("nop"),
            op("rlxsignal", ct="memory", ch=both),
            op("wait", ct="memory", ch=both),
            op("nop"),
            op("signal", ct="port" if port else "memory", ch=both),
            op("wait", ct="memory", ch=both),
            op("nop"),
        ]}]
        return {"id": 0, "input_chunks": 1, "output_chunks": 3, "scratch_chunks": 0, "threadblocks": tbs,
                "channels": [{"channel_type": t, "connected_to": [1, 2]} for t in ("memory", "port")[:1 + port]],
                "remote_buffers": [], "semaphores": []}
    tbs = [
        {"id": 0, "channels": chans, "ops": [
            op("rlxsignal", ct="memory", ch=both),
            op("wait", ct="memory", ch=both),
            op("nop"),
            op("sem_release", semaphore_ids=[0]),
        ]},
        {"id": 1, "channels": chans, "ops": [
            op("copy", [L("i", 0)], [L("o", 0)]),
            op("sem_acquire", semaphore_ids=[0]),
            op("nop"),
            op("copy", [L("s", 1)], [L("o", 1)]),
            op("copy", [L("s", 2)], [L("o", 2)]),
            op("nop"),
            op("signal", ct="memory", ch=both),
            op("wait", ct="memory", ch=both),
            op("nop"),
        ]},
    ]
    return {"id": 0, "input_chunks": 1, "output_chunks": 3, "scratch_chunks": 3,
            "threadblocks": tbs, "channels": [{"channel_type": "memory", "connected_to": [1, 2]}],
            "remote_buffers": [], "semaphores": [{"init_value": 0}]}


def relay_allgather(semaphore: bool = False, port: bool = False) -> dict:
    """The 3-rank relay allgather described in the module docstring (a correct plan)."""
    if semaphore and port:
        raise ValueError("the semaphore relay signals on memory channels only")
    gpus = [_rank0_gpu(semaphore, port)] + [_peer_gpu(r, semaphore, port) for r in (1, 2)]
    name = "relay_allgather" + ("_sem" if semaphore else "") + ("_port" if port else "")
    return {"format": "mscclang.plan/1", "name": name, "collective": "allgather", "protocol": "Simple",
            "inplace": False, "chunk_factor": 1, "gpus": gpus}


def mutants(doc: dict, rank: int, tb: int, wait: int) -> dict[str, dict]:
    """``doc`` with the ``nop`` right after op ``wait`` of ``rank``'s block ``tb`` deleted
    (``"drop"``) and swapped with that op (``"swap"``, the nop before the wait)."""
    ops = doc["gpus"][rank]["threadblocks"][tb]["ops"]
    if ops[wait + 1]["name"] != "nop":
        raise ValueError(f"rank {rank} tb {tb} op {wait + 1} is {ops[wait + 1]['name']}, not a nop")
    out = {}
    for kind in ("drop", "swap"):
        m = copy.deepcopy(doc)
        lst = m["gpus"][rank]["threadblocks"][tb]["ops"]
        if kind == "drop":
            del lst[wait + 1]
        else:
            lst[wait], lst[wait + 1] = lst[wait + 1], lst[wait]
        out[kind] = m
    return out
