"""Canonical names: collectives (API name <-> plan name), dtypes, reduce ops, bus-bandwidth
factors. Pure data, shared by the communicator, the selector, the tuner and the benchmark."""

from __future__ import annotations

from mscclang.comm.errors import CommError

# API name (Communicator method) -> plan ``collective`` name
API_TO_PLAN: dict[str, str] = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "reduce_scatter": "reducescatter",
    "all_to_all": "alltoall",
    "broadcast": "broadcast",
    "send_recv": "sendrecv",
}
PLAN_TO_API: dict[str, str] = {v: k for k, v in API_TO_PLAN.items()}

#: Collectives the tuner and the benchmark know, by plan name.
COLLECTIVES: tuple[str, ...] = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast")

DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "int32")
DTYPE_SIZES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4}
_DTYPE_ALIASES = {
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "int": "int32", "i32": "int32",
}
REDUCE_OPS: tuple[str, ...] = ("sum", "min", "max")


def plan_collective(name: str) -> str:
    """Plan name of a collective given either spelling (``all_reduce`` or ``allreduce``)."""
    key = name.strip().lower().replace("-", "_")
    if key in API_TO_PLAN:
        return API_TO_PLAN[key]
    key2 = key.replace("_", "")
    if key2 in PLAN_TO_API:
        return key2
    raise CommError(f"unknown collective {name!r}; known: {', '.join(API_TO_PLAN)}")


def dtype_name(dtype: object) -> str:
    """Canonical dtype name of a torch dtype, numpy dtype or string (``float16`` ...)."""
    s = str(dtype)
    for prefix in ("torch.", "numpy."):
        if s.startswith(prefix):
            s = s[len(prefix):]
    s = s.lower()
    s = _DTYPE_ALIASES.get(s, s)
    if s not in DTYPE_SIZES:
        raise CommError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")
    return s


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
    coll = plan_collective(collective)
    n = world_size
    if n <= 1:
        return 1.0
    if coll == "allreduce":
        return 2.0 * (n - 1) / n
    if coll in ("allgather", "reducescatter", "alltoall"):
        return (n - 1) / n
    return 1.0
