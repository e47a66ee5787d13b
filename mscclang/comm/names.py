"""The communicator's view of the canonical names: collectives (API name <-> plan name) and
dtypes, whose one home is :mod:`mscclang.plan.collectives` and :mod:`mscclang.plan.dtypes`
(re-exported here, their lookups raising :class:`~mscclang.comm.errors.CommError`), plus reduce
ops and bus-bandwidth factors. Pure data, shared by the communicator, the selector, the tuner and
the benchmark."""

from __future__ import annotations

from typing import Any

from mscclang.comm.errors import CommError
from mscclang.plan import collectives as _collectives
from mscclang.plan.collectives import API_TO_PLAN, PLAN_TO_API
from mscclang.plan.collectives import collective as collective_row
from mscclang.plan.dtypes import DTYPES as _DTYPE_TABLE
from mscclang.plan.dtypes import GPU_DTYPES, find_dtype
from mscclang.plan.models import REDUCE_OP_NAMES

__all__ = ["API_TO_PLAN", "PLAN_TO_API", "DTYPES", "DTYPE_SIZES", "REDUCE_OPS", "plan_collective",
           "call_text", "dtype_name", "reduce_op_name", "busbw_factor"]

#: canonical names of the dtypes the communicator runs
DTYPES: tuple[str, ...] = GPU_DTYPES
DTYPE_SIZES: dict[str, int] = {d.name: d.itemsize for d in _DTYPE_TABLE if d.gpu}
REDUCE_OPS: tuple[str, ...] = REDUCE_OP_NAMES


def plan_collective(name: str) -> str:
    """Plan name of a collective given either spelling (``all_reduce`` or ``allreduce``):
    :func:`mscclang.plan.collectives.plan_collective`, raising :class:`CommError` for a name that
    is neither."""
    found = _collectives.find_plan_collective(name)
    if found is None:
        raise CommError(_collectives.unknown_api_collective_message(name))
    return found


def dtype_name(dtype: object) -> str:
    """Canonical dtype name of a torch dtype, numpy dtype or string (``float16`` ...) the
    communicator runs; :class:`CommError` naming the supported ones for any other."""
    info = find_dtype(dtype)
    if info is None or not info.gpu:
        raise CommError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")
    return info.name


def call_text(collective: str, inp: Any, out: Any) -> str:
    """A call as the ranks compare it and errors name it, e.g. ``allgather of 8 x float32 into
    16`` (the plan collective, element counts, dtype)."""
    into = f" into {out.numel()}" if out.numel() != inp.numel() else ""
    return f"{collective} of {inp.numel()} x {dtype_name(inp.dtype)}{into}"


def reduce_op_name(op: object) -> str:
    """Canonical reduce op name: accepts ``"sum"``, ``ReduceOp.sum``, torch's ``ReduceOp.SUM``."""
    s = getattr(op, "value", None)
    if not isinstance(s, str):
        s = getattr(op, "name", None) if not isinstance(op, str) else op
    if not isinstance(s, str):
        s = str(op)
    s = s.rsplit(".", 1)[-1].lower()
    if s not in REDUCE_OPS:
        raise CommError(f"unsupported reduce op {op!r}; supported: {', '.join(REDUCE_OPS)}")
    return s


def busbw_factor(collective: str, world_size: int) -> float:
    """Bus-bandwidth factor of nccl-tests: bus bandwidth = bytes / time * factor.

    ``bytes`` is the message size (allgather: output bytes; other collectives: input bytes)."""
    return collective_row(plan_collective(collective)).busbw(world_size)
