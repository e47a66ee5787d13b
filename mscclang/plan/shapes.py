"""A call's buffers: the sizes each collective takes, the in-place layouts, and the checks of a
tensor argument. One home for these rules; the runtime and the collective API call them. Plain
numbers in, :class:`~mscclang.errors.InvalidCall` out (tensors are duck-typed: anything with
``data_ptr``, ``numel``, ``element_size``, ``is_contiguous`` and a CUDA device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mscclang.errors import CommError, InvalidCall
from mscclang.plan.collectives import plan_collective

SAME_SIZE = ("allreduce", "alltoall", "sendrecv", "broadcast")


def output_bytes(collective: str, world_size: int, in_bytes: int) -> int:
    """The output bytes of a call with ``in_bytes`` of input."""
    if collective == "allgather":
        return in_bytes * world_size
    if collective == "reducescatter":
        return in_bytes // world_size
    return in_bytes


def check_tensor(t: Any, what: str, rank: int, device: Any, owner: str = "executor") -> None:
    """``t`` is a contiguous tensor on ``device``: a CUDA device index (the runtime: the tensor
    must be on that GPU), or a ``torch.device`` (the collective API: its type, and its index when
    it has one). ``owner`` names what runs there in the message."""
    if not hasattr(t, "data_ptr") or not hasattr(t, "is_contiguous"):
        raise CommError(f"rank {rank}: {what} must be a torch tensor, got {type(t).__name__}")
    if isinstance(device, int) or device is None:
        wrong = not getattr(t, "is_cuda", False) or (device is not None and t.get_device() != device)
        where = f"cuda:{device}"
    else:
        td = t.device
        wrong = td.type != device.type or (td.type == "cuda" and device.index is not None and td.index != device.index)
        where = str(device)
    if wrong:
        raise CommError(f"rank {rank}: {what} is on {t.device}, but this {owner} runs on {where}; "
                        "move the tensor there first")
    if not t.is_contiguous():
        raise CommError(f"rank {rank}: {what} must be contiguous")


def check_pair(what: str, rank: int, inp: Any, out: Any, device: Any, owner: str) -> None:
    """Both tensors of a call checked (:func:`check_tensor`), and of one dtype."""
    for name, t in (("input", inp), ("output", out)):
        check_tensor(t, f"{what}{name}", rank, device, owner)
    if inp.dtype != out.dtype:
        raise CommError(f"rank {rank}: {what}input dtype {inp.dtype} differs from output dtype {out.dtype}")


def call_layout(collective: str, rank: int, in_ptr: int, in_bytes: int, out_ptr: int, out_bytes: int,
                block_bytes: int) -> bool:
    """Whether a call's buffers are the collective's in-place layout (True) or do not overlap
    (False); CommError for any other overlap. ``block_bytes``: one rank's block."""
    if not overlap(in_ptr, in_bytes, out_ptr, out_bytes):
        return False
    if collective == "allgather":
        ok = in_ptr == out_ptr + rank * block_bytes
    elif collective == "reducescatter":
        ok = out_ptr == in_ptr + rank * block_bytes
    else:
        ok = in_ptr == out_ptr and in_bytes == out_bytes
    if not ok:
        where = {"allgather": "this rank's block of the output",
                 "reducescatter": "this rank's block of the input"}.get(collective, "the same tensor")
        raise CommError(f"rank {rank}: {collective} input and output overlap but are not the "
                        f"in-place layout (the {'input' if collective == 'allgather' else 'output'} "
                        f"must be {where})")
    return True


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


# blocks: a collective's buffers as blocks x block_elems (the communicator pads blocks)

@dataclass(frozen=True)
class BlockShape:
    """``in_blocks`` x ``block_elems`` input elements, ``out_blocks`` x ``block_elems`` output."""

    in_blocks: int
    out_blocks: int
    block_elems: int

    @property
    def in_elems(self) -> int:
        return self.in_blocks * self.block_elems

    @property
    def out_elems(self) -> int:
        return self.out_blocks * self.block_elems

    def padded(self, block_elems: int) -> "BlockShape":
        return BlockShape(self.in_blocks, self.out_blocks, block_elems)


def block_shape(collective: str, world_size: int, in_elems: int, out_elems: int) -> BlockShape:
    """Block structure of a call; raises :class:`CommError` when the element counts do not fit
    the collective (e.g. an all-to-all input not divisible by the world size)."""
    coll = plan_collective(collective)
    n = world_size
    if coll == "allgather":
        if out_elems != n * in_elems:
            raise CommError(f"all_gather needs an output of {n} x {in_elems} = {n * in_elems} "
                            f"elements, got {out_elems}")
        return BlockShape(1, n, in_elems)
    if coll == "reducescatter":
        if in_elems != n * out_elems:
            raise CommError(f"reduce_scatter needs an input of {n} x {out_elems} = {n * out_elems} "
                            f"elements, got {in_elems}")
        return BlockShape(n, 1, out_elems)
    if coll == "alltoall":
        if in_elems != out_elems:
            raise CommError(f"all_to_all needs equal input and output element counts, got "
                            f"{in_elems} and {out_elems}")
        if in_elems % n:
            raise CommError(f"all_to_all needs an element count divisible by the world size {n}, "
                            f"got {in_elems}")
        return BlockShape(n, n, in_elems // n)
    if in_elems != out_elems:
        raise CommError(f"{coll} needs equal input and output element counts, got {in_elems} "
                        f"and {out_elems}")
    return BlockShape(1, 1, in_elems)


def call_bytes(collective: str, world_size: int, message: int) -> tuple[int, int]:
    """(input, output) bytes of a call whose message size (:func:`message_bytes`: allgather's
    output, every other collective's input) is ``message``; any collective name spelling."""
    coll = plan_collective(collective)
    if coll == "allgather":
        return message // world_size, message
    return message, output_bytes(coll, world_size, message)


def message_bytes(collective: str, in_bytes: int, out_bytes: int) -> int:
    """The size a plan's range and the tuning thresholds are compared with: allgather's output,
    every other collective's input."""
    return out_bytes if plan_collective(collective) == "allgather" else in_bytes
