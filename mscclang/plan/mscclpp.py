"""Conversion between mscclang plans and MSCCL++ 0.9 execution plans (JSON dicts).

MSCCL++ plans use the same key names and op names as ours (see docs/plan.schema.json for ours), so the conversion is mostly a matter of:

* the top level: MSCCL++ has no ``format``, ``num_ranks``, ``root``, ``chunk_factor``,
  ``reduce_op`` or ``packet_type``;
* accepting the spellings older MSCCL++ files use: ``"buff"`` for a switch channel's
  ``buffer_type``, ``"tbg"`` for ``tbg_info``, a ``"buff"`` key in thread-block channel lists and
  a ``"rank"`` key inside buffer references (both ignored by MSCCL++'s parser);
* barriers: MSCCL++ carries only ``barrier_id`` and ``num_threadblocks``; on import we fill in
  ``barrier_tbs`` (the thread blocks of the rank that use the id), on export we drop it;
* on import ``chunk_factor`` is set to what rank 0's chunk counts imply, and the plan's
  ``reduce_op`` to the reduce op the reductions name when they all name the same one (as plans
  built by our DSL carry them); on export a plan-wide ``reduce_op`` is written into every
  reduction op, where MSCCL++ keeps it;
* reductions: MSCCL++ adds the local source (``src_buff[0]``) first. Ours may add it later
  (``src0_position``); at place 1 the export writes it first, which is the same sum bit for bit
  (the first two operands commute: ``x1 + x0 == x0 + x1``), and drops ``src0_position``;
* refusing, on export, what MSCCL++ cannot express: a broadcast root, an epilogue op, a lone
  ``glre`` (its parser has no such op), an LL8 default packet type, a plan-wide reduce op that
  disagrees with an op's, a chunk factor that the chunk counts do not imply, a local source at
  place 2 or later (no exact reordering exists).

``to_mscclpp`` emits keys in the order MSCCL++'s DSL writes them and omits empty optional fields,
as that DSL does, so ``from_mscclpp(to_mscclpp(p))`` is ``p`` up to a normalisation, for every
plan ``to_mscclpp`` accepts whose ``barrier_tbs``, ``chunk_factor`` and ``reduce_op`` are what
import infers (true of plans built by the DSL): ``consistent``, ``batch_invariant`` and the ops'
``src`` (MSCCL++ has no such fields) are absent, and so is ``src0_position`` 0 or 1 (local first).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationError

from mscclang.errors import PlanError
from mscclang.plan.collectives import collective
from mscclang.plan.io import count_ops, validation_error
from mscclang.plan.models import (
    MAX_MESSAGE_SIZE,
    PLAN_FORMAT,
    BufferRef,
    ChannelType,
    Op,
    OpName,
    PacketType,
    Plan,
    REDUCE_OPS,
)

__all__ = ["from_mscclpp", "to_mscclpp", "is_mscclpp_plan", "MSCCLPP_COLLECTIVES"]

MSCCLPP_COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "sendrecv", "test",
                       "custom")

_TOP_KEYS = ("name", "collective", "protocol", "inplace", "reuse_resources", "gpus",
             "num_threads_per_block", "use_double_scratch_buffer", "buffer_alignment",
             "min_message_size", "max_message_size")
_GPU_KEYS = ("id", "input_chunks", "output_chunks", "scratch_chunks", "threadblocks", "channels",
             "remote_buffers", "semaphores")
_TB_KEYS = ("id", "ops", "channels", "remote_buffer_refs")
_OP_KEYS = ("name", "src_buff", "dst_buff", "channel_ids", "channel_type", "tbg_info", "tbg",
            "reduce_op", "barrier_id", "num_threadblocks", "semaphore_ids", "iter_context", "ops")
_REF_KEYS = ("type", "buffer_id", "switch_channel_id", "index", "size", "rank")


def is_mscclpp_plan(data: Any) -> bool:
    """Whether a parsed JSON document looks like an MSCCL++ plan (no ``format``, has ``gpus``)."""
    return isinstance(data, dict) and "format" not in data and "gpus" in data


def _need_dict(x: Any, path: str) -> dict:
    if not isinstance(x, dict):
        raise PlanError(f"expected a JSON object, got {type(x).__name__}", path)
    return x


def _need_list(x: Any, path: str) -> list:
    if not isinstance(x, list):
        raise PlanError(f"expected a JSON array, got {type(x).__name__}", path)
    return x


def _unknown(d: dict, allowed: tuple[str, ...], path: str) -> None:
    for k in d:
        if k not in allowed:
            where = f"{path}.{k}" if path else k
            raise PlanError(f"unknown key {k!r} in an MSCCL++ plan (known: {', '.join(allowed)})", where)


def _ref_from(d: Any, path: str) -> dict:
    d = _need_dict(d, path)
    _unknown(d, _REF_KEYS, path)
    return {k: v for k, v in d.items() if k != "rank"}  # "rank" is ignored by MSCCL++ too


def _op_from(d: Any, path: str) -> dict:
    d = _need_dict(d, path)
    _unknown(d, _OP_KEYS, path)
    out: dict = {}
    for k, v in d.items():
        if k in ("src_buff", "dst_buff"):
            out[k] = [_ref_from(x, f"{path}.{k}[{i}]") for i, x in enumerate(_need_list(v, f"{path}.{k}"))]
        elif k == "tbg":
            if "tbg_info" in d:
                raise PlanError("both 'tbg' and 'tbg_info' are given", f"{path}.tbg")
            out["tbg_info"] = v
        elif k == "ops":
            out[k] = [_op_from(x, f"{path}.ops[{i}]") for i, x in enumerate(_need_list(v, f"{path}.ops"))]
        else:
            out[k] = v
    return out


def _tb_from(d: Any, path: str) -> dict:
    d = _need_dict(d, path)
    _unknown(d, _TB_KEYS, path)
    out: dict = {"id": d.get("id")}
    out["ops"] = [_op_from(x, f"{path}.ops[{i}]")
                  for i, x in enumerate(_need_list(d.get("ops", []), f"{path}.ops"))]
    chans = []
    for i, c in enumerate(_need_list(d.get("channels", []), f"{path}.channels")):
        c = _need_dict(c, f"{path}.channels[{i}]")
        _unknown(c, ("channel_type", "channel_ids", "buff"), f"{path}.channels[{i}]")
        chans.append({k: v for k, v in c.items() if k != "buff"})
    out["channels"] = chans
    out["remote_buffer_refs"] = d.get("remote_buffer_refs", [])
    return out


def _gpu_from(d: Any, path: str) -> dict:
    d = _need_dict(d, path)
    _unknown(d, _GPU_KEYS, path)
    out = dict(d)
    out["threadblocks"] = [_tb_from(x, f"{path}.threadblocks[{i}]")
                           for i, x in enumerate(_need_list(d.get("threadblocks", []), f"{path}.threadblocks"))]
    chans = []
    for i, c in enumerate(_need_list(d.get("channels", []), f"{path}.channels")):
        cp = f"{path}.channels[{i}]"
        c = dict(_need_dict(c, cp))
        _unknown(c, ("channel_type", "connected_to", "buffer_type", "buff", "rank_groups"), cp)
        if "buff" in c:
            if "buffer_type" in c:
                raise PlanError("both 'buff' and 'buffer_type' are given", f"{cp}.buff")
            c["buffer_type"] = c.pop("buff")
        chans.append(c)
    out["channels"] = chans
    return out


def _fill_barrier_tbs(plan: Plan) -> None:
    for g in plan.gpus:
        users: dict[int, set[int]] = {}
        for t, tb in enumerate(g.threadblocks):
            for o in tb.all_ops():
                if o.name == OpName.barrier and o.barrier_id is not None:
                    users.setdefault(o.barrier_id, set()).add(t)
        for o in g.all_ops():
            if o.name == OpName.barrier and o.barrier_tbs is None and o.barrier_id is not None:
                o.barrier_tbs = sorted(users[o.barrier_id])


def from_mscclpp(data: dict, check: bool = True) -> Plan:
    """Convert a parsed MSCCL++ 0.9 execution plan into a :class:`Plan`.

    Unknown keys are refused (with their JSON path) rather than dropped. With ``check`` (the
    default) the result also passes :func:`mscclang.plan.check.validate_plan`.
    """
    d = _need_dict(data, "$")
    if "format" in d:
        raise PlanError(f"this is already an mscclang plan (format {d['format']!r}), not an MSCCL++ one",
                        "format")
    gpus = d.get("gpus")
    if "colletive" in d or (isinstance(gpus, list) and any(isinstance(g, dict) and "inputChunks" in g
                                                            for g in gpus)):
        raise PlanError("this is a pre-0.9 MSCCL++ plan (camelCase keys); only the 0.9 format is supported")
    _unknown(d, _TOP_KEYS, "")
    for key in ("name", "collective", "gpus"):
        if key not in d:
            raise PlanError(f"an MSCCL++ plan needs {key!r}", key)
    doc: dict = {"format": PLAN_FORMAT}
    for k in _TOP_KEYS:
        if k in d and k != "gpus":
            doc[k] = d[k]
    count_ops(d)  # bounded, and nested pipelines refused before the recursive conversion
    doc["gpus"] = [_gpu_from(g, f"gpus[{i}]") for i, g in enumerate(_need_list(d["gpus"], "gpus"))]
    try:
        plan = Plan.model_validate(doc)
    except ValidationError as e:
        raise validation_error(e) from None
    _fill_barrier_tbs(plan)
    if plan.gpus:
        plan.chunk_factor = _derived_chunk_factor(plan)
    named = {o.reduce_op for o in plan.all_ops() if o.reduce_op is not None}
    if len(named) == 1:
        plan.reduce_op = named.pop()
    if check:
        from mscclang.plan.check import validate_plan

        validate_plan(plan)
    return plan


# ---------------------------------------------------------------------------------------- export

def _ref_to(ref: BufferRef) -> dict:
    if ref.type is not None:
        out: dict = {"type": ref.type.value}
    elif ref.buffer_id is not None:
        out = {"buffer_id": ref.buffer_id}
    else:
        out = {"switch_channel_id": ref.switch_channel_id}
    out["index"] = ref.index
    out["size"] = ref.size
    return out


def _op_to(op: Op, plan_reduce: Optional[str], path: str) -> dict:
    if op.name == OpName.glre:
        raise PlanError("MSCCL++ cannot execute a lone 'glre' (its plan parser has no such op); "
                        "fuse it with a gstore of its result into 'glres'", f"{path}.name")
    out: dict = {"name": op.name.value}
    if op.src_buff:
        out["src_buff"] = [_ref_to(x) for x in op.src_buff]
    if op.dst_buff:
        out["dst_buff"] = [_ref_to(x) for x in op.dst_buff]
    if op.channel_ids:
        out["channel_ids"] = list(op.channel_ids)
    if op.channel_type != ChannelType.none:
        out["channel_type"] = op.channel_type.value
    if op.tbg_info is not None:
        out["tbg_info"] = {"tb_id": op.tbg_info.tb_id, "tbg_size": op.tbg_info.tbg_size}
    reduce_op = op.reduce_op.value if op.reduce_op is not None else None
    if plan_reduce is not None and op.name in REDUCE_OPS:
        if reduce_op is not None and reduce_op != plan_reduce:
            raise PlanError(f"the op reduces with {reduce_op} but the plan's reduce_op is {plan_reduce}; "
                            "MSCCL++ has no plan-wide reduce op to override it", f"{path}.reduce_op")
        reduce_op = plan_reduce
    if reduce_op is not None:
        out["reduce_op"] = reduce_op
    if op.src0_position is not None and op.src0_position >= 2:  # places 0 and 1 are one sum: x0+x1 == x1+x0
        raise PlanError(f"{op.name.value} adds its local source at place {op.src0_position}; MSCCL++ adds it "
                        "first, and only the first two operands of a sum commute exactly, so MSCCL++ cannot "
                        "express this order", f"{path}.src0_position")
    if op.barrier_id is not None:
        out["barrier_id"] = op.barrier_id
    if op.num_threadblocks is not None:
        out["num_threadblocks"] = op.num_threadblocks
    if op.semaphore_ids:
        out["semaphore_ids"] = list(op.semaphore_ids)
    if op.iter_context is not None:
        out["iter_context"] = {"unit_size": op.iter_context.unit_size,
                               "num_chunks": op.iter_context.num_chunks}
    if op.ops is not None:
        out["ops"] = [_op_to(x, plan_reduce, f"{path}.ops[{j}]") for j, x in enumerate(op.ops)]
    return out


def _derived_chunk_factor(plan: Plan) -> Optional[int]:
    g = plan.gpus[0]
    return collective(plan.collective).chunk_factor(len(plan.gpus), g.input_chunks, g.output_chunks) or None


def to_mscclpp(plan: Plan) -> dict:
    """Convert a plan into an MSCCL++ 0.9 execution plan (a JSON-ready dict).

    Raises :class:`PlanError` (with the JSON path) for what MSCCL++ cannot express, among it
    every ``mscclang.plan/2`` plan (MSCCL++ has no epilogue ops: the first one is named) and a
    reduction adding its local source at place 2 or later (``src0_position``); at place 1 it is
    written first, the same sum bit for bit. The result is exact: importing it gives the plan
    back up to the normalisation of the module docstring.
    """
    epilogue = plan.epilogue_ops()
    if epilogue:
        path, op = epilogue[0]
        raise PlanError(f"MSCCL++ has no epilogue ops: this {plan.format} plan holds {op.name.value} "
                        "(the fused residual add / RMSNorm) and cannot be exported", f"{path}.name")
    if plan.format != PLAN_FORMAT:
        raise PlanError(f"MSCCL++ export takes {PLAN_FORMAT} plans, not {plan.format}", "format")
    if plan.root is not None or collective(plan.collective).rooted:
        raise PlanError("MSCCL++ plans have no broadcast collective and no root; this plan cannot be "
                        "exported", "root" if plan.root is not None else "collective")
    if plan.collective not in MSCCLPP_COLLECTIVES:
        raise PlanError(f"MSCCL++ knows no collective {plan.collective!r} "
                        f"(known: {', '.join(MSCCLPP_COLLECTIVES)})", "collective")
    if plan.packet_type == PacketType.LL8:
        raise PlanError("MSCCL++ plans cannot name a packet type (MSCCL++ uses LL16 unless the caller "
                        "picks LL8 at launch); export with packet_type unset or LL16", "packet_type")
    if plan.chunk_factor is not None and plan.gpus and plan.chunk_factor != _derived_chunk_factor(plan):
        raise PlanError(f"chunk_factor {plan.chunk_factor} is not what MSCCL++ would infer from rank 0's "
                        "chunk counts, so it would be lost", "chunk_factor")
    plan_reduce = plan.reduce_op.value if plan.reduce_op is not None else None
    gpus = []
    for r, g in enumerate(plan.gpus):
        tbs = []
        for t, tb in enumerate(g.threadblocks):
            base = f"gpus[{r}].threadblocks[{t}]"
            tbs.append({
                "id": tb.id,
                "ops": [_op_to(op, plan_reduce, f"{base}.ops[{i}]") for i, op in enumerate(tb.ops)],
                "channels": [{"channel_type": c.channel_type.value, "channel_ids": list(c.channel_ids)}
                             for c in tb.channels],
                "remote_buffer_refs": [{"access_channel_type": x.access_channel_type.value,
                                        "remote_buffer_ids": list(x.remote_buffer_ids)}
                                       for x in tb.remote_buffer_refs],
            })
        chans = []
        for c in g.channels:
            if c.channel_type == ChannelType.switch:
                chans.append({
                    "channel_type": "switch",
                    "buffer_type": c.buffer_type.value,  # type: ignore[union-attr]
                    "rank_groups": [{"size": x.size, "ranks": list(x.ranks)} for x in c.rank_groups],
                })
            else:
                chans.append({"channel_type": c.channel_type.value, "connected_to": list(c.connected_to)})
        gpus.append({
            "id": g.id,
            "input_chunks": g.input_chunks,
            "output_chunks": g.output_chunks,
            "scratch_chunks": g.scratch_chunks,
            "threadblocks": tbs,
            "channels": chans,
            "remote_buffers": [{"rank": b.rank, "type": b.type.value,
                                "access_channel_types": [c.value for c in b.access_channel_types]}
                               for b in g.remote_buffers],
            "semaphores": [{"init_value": s.init_value} for s in g.semaphores],
        })
    return {
        "name": plan.name,
        "collective": plan.collective,
        "protocol": plan.protocol,
        "inplace": plan.inplace,
        "reuse_resources": plan.reuse_resources,
        "gpus": gpus,
        "num_threads_per_block": plan.num_threads_per_block,
        "use_double_scratch_buffer": plan.use_double_scratch_buffer,
        "buffer_alignment": plan.buffer_alignment,
        "min_message_size": plan.min_message_size,
        "max_message_size": plan.max_message_size if plan.max_message_size is not None else MAX_MESSAGE_SIZE,
    }
