"""Hand-built plans (as JSON dicts in the mscclang format) shared by the plan and CLI tests.

Like plans built by the DSL, they carry ``chunk_factor`` and a plan-wide ``reduce_op`` that every
reduction also names.

* :func:`kitchen_sink` — a 2-rank allreduce-shaped plan that uses every op kind, every channel
  type, remote buffers through memory and port channels, semaphores, a barrier, switch channels
  over two buffer kinds, a pipeline with nested ops and a thread-block group. It is structurally
  valid (passes ``validate_plan``) but is not a correct allreduce.
* :func:`allpairs_allreduce` — a correct n-rank allreduce: each rank puts chunk p of its input
  into peer p's scratch, reduces its own chunk, then puts the result into every peer's output.
"""

from __future__ import annotations

import copy


def L(kind: str, index: int, size: int = 1) -> dict:
    return {"type": kind, "index": index, "size": size}


def R(buffer_id: int, index: int, size: int = 1) -> dict:
    return {"buffer_id": buffer_id, "index": index, "size": size}


def W(switch_channel_id: int, index: int, size: int = 1) -> dict:
    return {"switch_channel_id": switch_channel_id, "index": index, "size": size}


def op(name: str, src=(), dst=(), ct: str = "none", ch=(), **extra) -> dict:
    d: dict = {"name": name}
    if src:
        d["src_buff"] = list(src)
    if dst:
        d["dst_buff"] = list(dst)
    if ch:
        d["channel_ids"] = list(ch)
    if ct != "none":
        d["channel_type"] = ct
    d.update(extra)
    return d


def _ks_gpu(r: int, with_glre: bool) -> dict:
    p = 1 - r
    # remote buffers: 0 = peer output (memory, port), 1 = peer scratch (memory, port), 2 = peer input
    tb0_ops = [
        op("nop"),
        op("rlxsignal", ct="memory", ch=[0]),
        op("rlxwait", ct="memory", ch=[0]),
        op("put", [L("i", 0, 2)], [R(0, 0, 2)], "memory"),
        op("put", [L("i", 2, 2)], [R(0, 2, 2)], "port", [0]),
        op("pws", [L("o", 0)], [R(0, 0)], "port", [0]),
        op("pwsf", [L("o", 1)], [R(0, 1)], "port", [0]),
        op("flush", ct="port", ch=[0]),
        op("signal", ct="memory", ch=[0, 1]),
        op("wait", ct="memory", ch=[0, 1]),
        op("get", [R(2, 0, 2)], [L("o", 0, 2)], "memory", [1]),
        op("copy", [L("i", 0)], [L("o", 0)]),
        op("cpkt", [L("i", 0)], [L("s", 0)]),
        op("upkt", [L("s", 0)], [L("o", 1)]),
        op("ppkt", [L("i", 1)], [R(1, 2)], "memory"),
        op("ppkt", [L("s", 0)], [R(1, 3)], "port", [0]),
        op("rppkt", [L("s", 2)], [R(1, 4)], "memory"),
        op("re", [L("i", 0), L("s", 1), L("o", 2)], [L("o", 0)], reduce_op="max"),
        op("res", [L("i", 0), L("o", 1)], [L("o", 0), R(0, 0)], "memory", reduce_op="max"),
        op("rre", [L("i", 0), R(2, 0)], [L("o", 0)], "memory", reduce_op="max"),
        op("rres", [L("i", 0), R(2, 1)], [L("o", 1), R(0, 1)], "memory", reduce_op="max"),
        op("repkt", [L("i", 0), L("s", 1)], [L("o", 0)], reduce_op="max"),
        op("respkt", [L("i", 0), L("s", 1)], [L("o", 0), R(1, 5)], "memory", reduce_op="max"),
        op("recpkt", [L("i", 0), L("s", 1)], [L("o", 0), L("s", 6)], reduce_op="max"),
        op("recspkt", [L("i", 0), L("s", 1)], [L("o", 0), L("s", 6), R(1, 7)], "memory", reduce_op="max"),
        op("sem_release", semaphore_ids=[0]),
        op("sem_acquire", semaphore_ids=[1]),
        op("barrier", barrier_id=0, num_threadblocks=2, barrier_tbs=[0, 1]),
    ]
    tb1_ops = [
        op("barrier", barrier_id=0, num_threadblocks=2, barrier_tbs=[0, 1]),
        op("glres", [W(0, 0, 2)], [W(0, 0, 2)], "switch", [0], reduce_op="max"),
        op("gstore", [L("o", 0, 2)], [W(0, 2, 2)], "switch", [0]),
        op("gstorepkt", [L("s", 0)], [W(1, 0)], "switch", [1]),
        op("pipeline", iter_context={"unit_size": 4096, "num_chunks": 2}, ops=[
            op("sem_acquire", semaphore_ids=[0]),
            op("copy", [L("i", 0, 2)], [L("o", 0, 2)]),
            op("sem_release", semaphore_ids=[1]),
        ]),
    ]
    if with_glre:
        tb1_ops.append(op("glre", [W(0, 0)], [L("o", 0)], "switch", [0], reduce_op="max"))
    grp = [op("copy", [L("i", 0, 4)], [L("o", 0, 4)], tbg_info={"tb_id": k, "tbg_size": 2})
           for k in range(2)]
    return {
        "id": r, "input_chunks": 4, "output_chunks": 4, "scratch_chunks": 8,
        "threadblocks": [
            {"id": 0, "ops": tb0_ops,
             "channels": [{"channel_type": "memory", "channel_ids": [0, 1]},
                          {"channel_type": "port", "channel_ids": [0]}],
             "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": [0, 1, 2]},
                                    {"access_channel_type": "port", "remote_buffer_ids": [0, 1]}]},
            {"id": 1, "ops": tb1_ops,
             "channels": [{"channel_type": "switch", "channel_ids": [0, 1]}],
             "remote_buffer_refs": []},
            {"id": 2, "ops": [grp[0]], "channels": [], "remote_buffer_refs": []},
            {"id": 3, "ops": [grp[1]], "channels": [], "remote_buffer_refs": []},
        ],
        "channels": [
            {"channel_type": "memory", "connected_to": [p, p]},
            {"channel_type": "port", "connected_to": [p]},
            {"channel_type": "switch", "buffer_type": "o", "rank_groups": [{"size": 2, "ranks": [0, 1]}]},
            {"channel_type": "switch", "buffer_type": "s", "rank_groups": [{"size": 2, "ranks": [0, 1]}]},
        ],
        "remote_buffers": [
            {"rank": p, "type": "o", "access_channel_types": ["memory", "port"]},
            {"rank": p, "type": "s", "access_channel_types": ["memory", "port"]},
            {"rank": p, "type": "i", "access_channel_types": ["memory"]},
        ],
        "semaphores": [{"init_value": 0}, {"init_value": 1}],
    }


def kitchen_sink(with_glre: bool = False) -> dict:
    """Every op kind on 2 ranks (see the module docstring); ``with_glre`` adds a lone glre."""
    return {
        "format": "mscclang.plan/1",
        "name": "kitchen_sink",
        "collective": "allreduce",
        "protocol": "LL",
        "inplace": False,
        "use_double_scratch_buffer": True,
        "chunk_factor": 2,
        "reduce_op": "max",
        "gpus": [_ks_gpu(r, with_glre) for r in range(2)],
    }


def allpairs_allreduce(n: int = 8, name: str = "allpairs_allreduce") -> dict:
    """A correct n-rank allreduce with one chunk per rank (chunk factor 1)."""
    gpus = []
    for r in range(n):
        peers = [p for p in range(n) if p != r]
        chans = list(range(len(peers)))
        # remote buffers: 2k = peer k's scratch, 2k+1 = peer k's output
        ops = [
            op("nop"),
            op("rlxsignal", ct="memory", ch=chans),
            op("rlxwait", ct="memory", ch=chans),
            op("nop"),
            op("put", [L("i", p) for p in peers], [R(2 * k, r) for k, p in enumerate(peers)], "memory"),
            op("nop"),
            op("signal", ct="memory", ch=chans),
            op("wait", ct="memory", ch=chans),
            op("nop"),
            op("re", [L("i", r)] + [L("s", p) for p in peers], [L("o", r)], reduce_op="sum"),
            op("nop"),
            op("put", [L("o", r) for _ in peers], [R(2 * k + 1, r) for k, _ in enumerate(peers)], "memory"),
            op("nop"),
            op("signal", ct="memory", ch=chans),
            op("wait", ct="memory", ch=chans),
            op("nop"),
        ]
        rbufs = []
        for p in peers:
            rbufs.append({"rank": p, "type": "s", "access_channel_types": ["memory"]})
            rbufs.append({"rank": p, "type": "o", "access_channel_types": ["memory"]})
        gpus.append({
            "id": r, "input_chunks": n, "output_chunks": n, "scratch_chunks": n,
            "threadblocks": [{
                "id": 0, "ops": ops,
                "channels": [{"channel_type": "memory", "channel_ids": chans}],
                "remote_buffer_refs": [{"access_channel_type": "memory",
                                        "remote_buffer_ids": list(range(len(rbufs)))}],
            }],
            "channels": [{"channel_type": "memory", "connected_to": peers}],
            "remote_buffers": rbufs,
            "semaphores": [],
        })
    return {"format": "mscclang.plan/1", "name": name, "collective": "allreduce",
            "protocol": "Simple", "inplace": False, "chunk_factor": 1, "reduce_op": "sum", "gpus": gpus}


def mscclpp_packet_allreduce() -> dict:
    """A 2-rank LL allreduce in MSCCL++ 0.9 form, with the legacy spellings MSCCL++ files use
    (``buff`` for a switch channel's buffer type, ``tbg``, ``rank`` inside buffer refs)."""
    gpus = []
    for r in range(2):
        p = 1 - r
        mine, theirs = (0, 1) if r == 0 else (1, 0)
        tbs = []
        for t in range(2):
            ops = [
                {"name": "ppkt", "channel_type": "memory",
                 "src_buff": [{"type": "i", "index": 2 * theirs, "size": 2, "rank": r}],
                 "dst_buff": [{"buffer_id": 0, "index": 2 * r, "size": 2}],
                 "tbg": {"tb_id": t, "tbg_size": 2}},
                {"name": "respkt", "channel_type": "memory", "reduce_op": "sum",
                 "src_buff": [{"type": "i", "index": 2 * mine + t, "size": 1},
                              {"type": "s", "index": 2 * p + t, "size": 1}],
                 "dst_buff": [{"type": "i", "index": 2 * mine + t, "size": 1},
                              {"buffer_id": 0, "index": 4 + 2 * r + t, "size": 1}]},
                {"name": "upkt", "src_buff": [{"type": "s", "index": 4 + 2 * p + t, "size": 1}],
                 "dst_buff": [{"type": "i", "index": 2 * theirs + t, "size": 1}]},
            ]
            tbs.append({"id": t, "ops": ops,
                        "channels": [{"channel_type": "memory", "channel_ids": [0]}],
                        "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": [0]}]})
        gpus.append({
            "id": r, "input_chunks": 4, "output_chunks": 0, "scratch_chunks": 8,
            "threadblocks": tbs,
            "channels": [{"channel_type": "memory", "connected_to": [p]},
                         {"channel_type": "switch", "buff": "i",
                          "rank_groups": [{"size": 2, "ranks": [0, 1]}]}],
            "remote_buffers": [{"rank": p, "type": "s", "access_channel_types": ["memory"]}],
            "semaphores": [],
        })
    return {
        "name": "allreduce_pkt", "collective": "allreduce", "protocol": "LL", "inplace": True,
        "reuse_resources": False, "gpus": gpus, "num_threads_per_block": 1024,
        "use_double_scratch_buffer": True, "buffer_alignment": 16, "min_message_size": 0,
        "max_message_size": 2**64 - 1,
    }


def clone(d: dict) -> dict:
    return copy.deepcopy(d)
