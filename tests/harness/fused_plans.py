"""A hand-written 2-rank ``allreduce_add_rms_norm`` plan (plan/2) for the runtime's tests: one
thread block per rank puts its input into the peer's scratch as LL packets, reduces its input
with the peer's packets into scratch, adds that into the residual, and normalises every row of
the residual into the output (FP8 with ``quant``)."""

from __future__ import annotations

from typing import Any

from mscclang.plan.models import Plan


def _ref(kind: str, index: int, size: int) -> dict:
    return {"type": kind, "index": index, "size": size}


def _op(name: str, src: list, dst: list, **kw: Any) -> dict:
    return {"name": name, "src_buff": src, "dst_buff": dst, "channel_ids": kw.pop("channel_ids", []),
            "channel_type": kw.pop("channel_type", "none"), "semaphore_ids": [], **kw}


def fused_oneshot_dict(quant: bool = False, nthreads: int = 512) -> dict:
    """The plan as JSON data (tests edit it to plant faults)."""
    gpus = []
    for r in range(2):
        norm = _op("rmsnorm", [_ref("r", 0, 2)], [_ref("o", 0, 2)], **({"quant": True} if quant else {}))
        ops = [
            _op("ppkt", [_ref("i", 0, 2)], [{"buffer_id": 0, "index": 0, "size": 2}], channel_ids=[0],
                channel_type="memory"),
            _op("repkt", [_ref("i", 0, 2), _ref("s", 0, 2)], [_ref("s", 4, 2)], reduce_op="sum"),
            _op("nop", [], []),
            _op("radd", [_ref("s", 4, 2)], [_ref("r", 0, 2)]),
            _op("nop", [], []),
            norm,
        ]
        gpus.append({
            "id": r, "input_chunks": 2, "output_chunks": 2, "scratch_chunks": 6,
            "channels": [{"channel_type": "memory", "connected_to": [1 - r], "rank_groups": []}],
            "remote_buffers": [{"rank": 1 - r, "type": "s", "access_channel_types": ["memory"]}],
            "semaphores": [],
            "threadblocks": [{"id": 0, "ops": ops, "channels": [{"channel_type": "memory", "channel_ids": [0]}],
                              "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": [0]}]}],
        })
    return {"format": "mscclang.plan/2", "name": "fused_oneshot_test" + ("_quant" if quant else ""),
            "collective": "allreduce_add_rms_norm", "protocol": "LL", "inplace": False, "reuse_resources": False,
            "num_threads_per_block": nthreads, "use_double_scratch_buffer": True, "buffer_alignment": 16,
            "min_message_size": 0, "max_message_size": 1 << 30, "num_ranks": 2, "chunk_factor": 1,
            "reduce_op": "sum", "gpus": gpus}


def fused_oneshot_plan(quant: bool = False, nthreads: int = 512) -> Plan:
    """:func:`fused_oneshot_dict` as a checked :class:`Plan`."""
    return Plan.model_validate(fused_oneshot_dict(quant, nthreads))
