"""A call's buffers: the sizes each collective takes, the in-place layouts, and the checks of a
tensor argument. One home for these rules; the runtime and the collective API call them. Plain
numbers in, :class:`~mscclang.errors.InvalidCall` out (tensors are duck-typed: anything with
``data_ptr``, ``numel``, ``element_size``, ``is_contiguous`` and a CUDA device)."""

from __future__ import annotations

from typing import Any, Optional

from mscclang.errors import InvalidCall

SAME_SIZE = ("allreduce", "alltoall", "sendrecv", "broadcast")


def output_bytes(collective: str, world_size: int, in_bytes: int) -> int:
    """The output bytes of a call with ``in_bytes`` of input."""
    if collective == "allgather":
        return in_bytes * world_size
    if collective == "reducescatter":
        return in_bytes // world_size
    return in_bytes


def check_tensor(t: Any, what: str, rank: int, device: Optional[int]) -> None:
    """``t`` is a contiguous CUDA tensor on device ``device`` (any CUDA device when None)."""
    if not hasattr(t, "data_ptr") or not hasattr(t, "is_cuda"):
        raise InvalidCall(f"rank {rank}: {what} must be a torch tensor, got {type(t).__name__}")
    if not t.is_cuda or (device is not None and t.get_device() != device):
        raise InvalidCall(f"rank {rank}: {what} is on {t.device}, but this executor runs on cuda:{device}; "
                          "move the tensor to that GPU")
    if not t.is_contiguous():
        raise InvalidCall(f"rank {rank}: {what} must be contiguous")


def check_sizes(collective: str, world_size: int, rank: int, in_bytes: int, out_bytes: int) -> None:
    """The input and output sizes fit the collective (allgather: output = n x input;
    reduce-scatter: input = n x output; the others: equal), and are not both empty."""
    n = world_size
    if collective == "allgather" and out_bytes != in_bytes * n:
        raise InvalidCall(f"rank {rank}: allgather output has {out_bytes} bytes; it must be {n} x the "
                          f"input's {in_bytes}")
    if collective == "reducescatter" and in_bytes != out_bytes * n:
        raise InvalidCall(f"rank {rank}: reducescatter input has {in_bytes} bytes; it must be {n} x the "
                          f"output's {out_bytes}")
    if collective in SAME_SIZE and in_bytes != out_bytes:
        raise InvalidCall(f"rank {rank}: {collective} input has {in_bytes} bytes and output {out_bytes}; they must "
                          "be equal")
    if in_bytes == 0 and out_bytes == 0:
        raise InvalidCall(f"rank {rank}: {collective} on empty tensors")


def is_inplace_layout(collective: str, rank: int, in_ptr: int, in_bytes: int, out_ptr: int,
                      out_bytes: int) -> bool:
    """Whether the buffers are the collective's in-place layout: allgather's input is this rank's
    block of the output, reduce-scatter's output this rank's block of the input, every other
    collective's input and output the same buffer."""
    if collective == "allgather":
        return in_ptr == out_ptr + rank * in_bytes
    if collective == "reducescatter":
        return out_ptr == in_ptr + rank * out_bytes
    return in_ptr == out_ptr


def overlap(in_ptr: int, in_bytes: int, out_ptr: int, out_bytes: int) -> bool:
    """Whether the two byte ranges overlap."""
    return in_ptr < out_ptr + out_bytes and out_ptr < in_ptr + in_bytes


def check_layout(collective: str, rank: int, plan_inplace: bool, plan_name: str, in_ptr: int, in_bytes: int,
                 out_ptr: int, out_bytes: int) -> None:
    """An in-place plan runs only on the in-place layout, an out-of-place plan only on buffers
    that do not overlap."""
    if plan_inplace:
        if not is_inplace_layout(collective, rank, in_ptr, in_bytes, out_ptr, out_bytes):
            where = {"allgather": "the input must be this rank's block of the output",
                     "reducescatter": "the output must be this rank's block of the input"}.get(
                         collective, "input and output must be the same tensor")
            raise InvalidCall(f"rank {rank}: plan {plan_name!r} is in place: {where} (got input at "
                              f"{in_ptr:#x}, output at {out_ptr:#x}); use an out-of-place plan for separate buffers")
    elif overlap(in_ptr, in_bytes, out_ptr, out_bytes):
        raise InvalidCall(f"rank {rank}: plan {plan_name!r} is out of place but its input and output overlap")
