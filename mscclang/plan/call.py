"""A call described once: :class:`Call`, made by :func:`make_call`, the one function that reads a
call's tensors to judge them (device, contiguity, dtype and accumulation, sizes, in-place layout,
overlaps, and the fused collective's residual, weight and parameters). Everything below it (the
planner, the GPU runtime's executor and entries, the CPU back end, the epilogue's packing) takes
the :class:`Call` and reads no tensor to check it again.

Torch-free: tensors are duck-typed (``data_ptr``, ``numel``, ``element_size``, ``is_contiguous``,
``dtype``, ``device`` or ``is_cuda``/``get_device``); errors are :class:`~mscclang.errors.InvalidCall`
(a :class:`~mscclang.errors.CommError`). The collective's own rules (blocks, message side,
in-place layout) are its row of :data:`mscclang.plan.collectives.TABLE`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from mscclang.errors import InvalidCall
from mscclang.plan.collectives import BlockShape, Collective, collective as collective_row
from mscclang.plan.dtypes import (EPILOGUE_DTYPES, DtypeInfo, check_reduction, find_dtype, gpu_dtype, kernel_code,
                                  torch_dtype_info)
from mscclang.plan.models import ReduceOp

__all__ = ["Call", "Copy", "Copies", "CountedArgs", "EpiCall", "FusedArgs", "make_call", "make_counted_call", "message_call", "check_tensor", "overlap", "reduce_op_name",
           "MIN_HIDDEN", "MAX_HIDDEN", "PARTIAL"]

#: the fused collective's hidden sizes: multiples of PARTIAL from MIN_HIDDEN to MAX_HIDDEN
MIN_HIDDEN = 8
MAX_HIDDEN = 65536
PARTIAL = 8
#: the reduce ops a call takes
REDUCE_OP_NAMES = tuple(op.value for op in ReduceOp)


def overlap(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    """Whether byte ranges ``[a, a + a_bytes)`` and ``[b, b + b_bytes)`` overlap."""
    return a < b + b_bytes and b < a + a_bytes


def reduce_op_name(op: object) -> str:
    """Canonical reduce op name: ``"sum"``, ``ReduceOp.sum``, torch's ``ReduceOp.SUM``, any case;
    InvalidCall naming the supported ones for anything else."""
    s = getattr(op, "value", None)
    if not isinstance(s, str):
        s = getattr(op, "name", None) if not isinstance(op, str) else op
    if not isinstance(s, str):
        s = str(op)
    s = s.rsplit(".", 1)[-1].lower()
    if s not in REDUCE_OP_NAMES:
        raise InvalidCall(f"unsupported reduce op {op!r}; supported: {', '.join(REDUCE_OP_NAMES)}")
    return s


def check_tensor(t: Any, what: str, rank: int, device: Any, owner: str = "executor") -> None:
    """``t`` is a contiguous tensor on ``device``: a CUDA device index (the runtime: the tensor
    must be on that GPU), or a ``torch.device`` (the collective API: its type, and its index when
    it has one). ``owner`` names what runs there in the message."""
    if not hasattr(t, "data_ptr") or not hasattr(t, "is_contiguous"):
        raise InvalidCall(f"rank {rank}: {what} must be a torch tensor, got {type(t).__name__}")
    if isinstance(device, int) or device is None:
        wrong = not getattr(t, "is_cuda", False) or (device is not None and t.get_device() != device)
        where = f"cuda:{device}"
    else:
        td = t.device
        wrong = td.type != device.type or (td.type == "cuda" and device.index is not None and td.index != device.index)
        where = str(device)
    if wrong:
        raise InvalidCall(f"rank {rank}: {what} is on {t.device}, but this {owner} runs on {where}; "
                          "move the tensor there first")
    if not t.is_contiguous():
        raise InvalidCall(f"rank {rank}: {what} must be contiguous")


@dataclass(slots=True)
class FusedArgs:
    """The fused collective's arguments beside its input and output (what :func:`make_call`
    checks): the ``residual`` and ``weight`` tensors, ``eps``, the FP8 ``scale`` (None: no FP8
    output) and ``hidden`` (None: the weight's length; the runtime's epilogue names it). Made at
    every fused call, so not frozen: a frozen record's construction cost 0.45 us more."""

    residual: Any
    weight: Any
    eps: Any = 1e-6
    scale: Any = None
    hidden: Optional[int] = None


@dataclass(frozen=True)
class EpiCall:
    """The fused part of a :class:`Call`: the residual's and the weight's addresses (the weight 0
    when none was passed), the weight's dtype name, the row length ``hidden``, ``eps``, the FP8
    ``scale`` and type name (None: the norm writes the activation dtype)."""

    residual_ptr: int
    weight_ptr: int
    weight_dtype: Optional[str]
    hidden: int
    eps: float
    scale: Optional[float] = None
    fp8: Optional[str] = None

    @property
    def quant(self) -> bool:
        return self.scale is not None


@dataclass(frozen=True)
class CountedArgs:
    """The part of a :class:`Call` of a collective with data-dependent counts (all-to-all-v):
    the address of the call's count matrix (int32 ``[world][2 world + 2]`` in device memory:
    row ``i`` is what rank ``i`` contributed: its counts to every rank, its input rows, its
    output rows, the rows it expects from every rank or -1; docs/semantics.md, "Data-dependent
    counts"), the bytes of one row, this rank's input and output rows and the rows of a
    scratch slot (``capacity``, the same on every rank)."""

    counts_ptr: int
    row_bytes: int
    in_rows: int
    out_rows: int
    capacity: int


@dataclass(frozen=True)
class Copy:
    """One device copy enqueued with a call's kernel: ``rows`` rows of ``width`` bytes from
    ``src`` (row starts ``src_pitch`` bytes apart) to ``dst`` (``dst_pitch`` apart); one row is a
    flat copy. Made once per call by :meth:`Call.copies` from the addresses it names."""

    dst: int
    src: int
    width: int
    rows: int = 1
    dst_pitch: int = 0
    src_pitch: int = 0


@dataclass(frozen=True)
class Copies:
    """The copies a call runs around its kernel when the plan runs on other buffers than the
    caller's (:meth:`Call.copies`): ``before`` (the input into the plan's buffers) and ``after``
    (the output back), on the kernel's stream, in that order."""

    before: tuple[Copy, ...] = ()
    after: tuple[Copy, ...] = ()


def _blocks(dst: int, dst_elems: int, src: int, src_elems: int, rows: int, elems: int, esz: int) -> Copy:
    """``rows`` blocks of ``elems`` elements, from blocks of ``src_elems`` to blocks of
    ``dst_elems``: one flat copy when neither side is padded."""
    if rows == 1 or dst_elems == src_elems == elems:
        return Copy(dst, src, rows * elems * esz)
    return Copy(dst, src, elems * esz, rows, dst_elems * esz, src_elems * esz)


@dataclass(frozen=True)
class Call:
    """One checked call: its :class:`~mscclang.plan.collectives.Collective` row, this ``rank`` of
    ``world``, the input and output addresses and bytes, the element type ``dtype`` (the input's;
    a fused call's FP8 output is ``epi.fp8``), the reduce ``op`` and fp8 accumulation dtype
    ``accum``, whether the buffers are the collective's in-place layout, the call's blocks
    ``shape`` (elements), its fused part ``epi`` and the ``root`` of a rooted collective (0 for
    every other)."""

    collective: Collective
    rank: int
    world: int
    in_ptr: int
    in_bytes: int
    out_ptr: int
    out_bytes: int
    dtype: DtypeInfo
    op: str
    accum: Optional[str]
    inplace: bool
    shape: BlockShape
    epi: Optional[EpiCall] = None
    root: int = 0
    counted: Optional[CountedArgs] = None

    @property
    def empty(self) -> bool:
        return self.in_bytes == 0 and self.out_bytes == 0

    @property
    def message_bytes(self) -> int:
        """The message size (the plans' ranges and the tuning thresholds compare it)."""
        return self.collective.message_bytes(self.in_bytes, self.out_bytes)

    @property
    def kernel_code(self) -> str:
        """The GPU kernel module's code of this call's dtype and accumulation (``f16``,
        ``f8e4m3_a32``)."""
        return kernel_code(self.dtype.code, self.accum)

    @property
    def row_bytes(self) -> int:
        """A fused call's input row (hidden x element size); 0 for every other call."""
        return self.epi.hidden * self.dtype.itemsize if self.epi is not None else 0

    def describe(self) -> str:
        """``all_reduce of 1024 x bfloat16`` (what a log line or a mismatch names)."""
        n = self.in_bytes // max(self.dtype.itemsize, 1)
        more = f" into {self.out_bytes // max(self.dtype.itemsize, 1)}" if self.out_bytes != self.in_bytes else ""
        return f"{self.collective.api or self.collective.name} of {n} x {self.dtype.name}{more}"

    def on(self, inp: Any, out: Any, inplace: bool) -> "Call":
        """The same call on other buffers that mscclang made (an in-place plan's copy of the
        input, staging padded to whole granules): their addresses and sizes, nothing judged."""
        from dataclasses import replace

        esz = self.dtype.itemsize
        bi, bo = self.shape.in_blocks, self.shape.out_blocks
        return replace(self, in_ptr=inp.data_ptr(), in_bytes=inp.numel() * esz, out_ptr=out.data_ptr(),
                       out_bytes=out.numel() * esz, inplace=inplace,
                       shape=BlockShape(bi, bo, inp.numel() // bi if bi else 0))

    def copies(self, moved: "Call", staged: bool) -> Copies:
        """The copies that run this call on ``moved`` (:meth:`on`): ``staged`` (the blocks
        padded to ``moved``'s, on staging buffers): every input block into its padded block
        before the kernel and the first ``block_elems`` of every output block back after it;
        otherwise (an out-of-place call on an in-place plan) the input into its place in the
        output before the kernel."""
        esz, k = self.dtype.itemsize, self.shape.block_elems
        if not staged:
            return Copies((Copy(moved.in_ptr, self.in_ptr, self.in_bytes),))
        kp = moved.shape.block_elems
        return Copies((_blocks(moved.in_ptr, kp, self.in_ptr, k, self.shape.in_blocks, k, esz),),
                      (_blocks(self.out_ptr, k, moved.out_ptr, kp, self.shape.out_blocks, k, esz),))

    def fits_plan(self, plan: Any) -> bool:
        """Whether ``plan`` runs these buffers as they are: an in-place plan only the in-place
        layout, an out-of-place plan only buffers that do not overlap."""
        return bool(plan.inplace) == self.inplace

    def check_plan(self, plan: Any) -> None:
        """InvalidCall when ``plan`` does not run these buffers as they are (:meth:`fits_plan`)."""
        if self.fits_plan(plan):
            return
        if plan.inplace:
            where = {"input_in_output": "the input must be this rank's block of the output",
                     "output_in_input": "the output must be this rank's block of the input"}.get(
                         self.collective.inplace, "input and output must be the same tensor")
            raise InvalidCall(f"rank {self.rank}: plan {plan.name!r} is in place: {where} (got input at "
                              f"{self.in_ptr:#x}, output at {self.out_ptr:#x}); use an out-of-place plan for "
                              "separate buffers")
        raise InvalidCall(f"rank {self.rank}: plan {plan.name!r} is out of place but its input and output overlap")


def _elements(t: Any) -> tuple[int, int, int]:
    """(address, element count, element size) of a tensor."""
    return t.data_ptr(), t.numel(), t.element_size()


def _info(t: Any, rank: int, what: str) -> DtypeInfo:
    info = torch_dtype_info(t.dtype) if not isinstance(t.dtype, DtypeInfo) else t.dtype
    if info is None:
        info = find_dtype(t.dtype)
    if info is None or not info.gpu:
        raise InvalidCall(f"rank {rank}: {what} has dtype {t.dtype}, which mscclang does not run; use "
                          "float16, bfloat16, float32, int32, float8_e4m3fn or float8_e5m2")
    return info


def make_call(coll: Union[str, Collective], rank: int, world: int, device: Any, inp: Any, out: Any,
              op: Any = "sum", accum: Any = None, epi: Optional[FusedArgs] = None,
              owner: str = "communicator", root: int = 0) -> Call:
    """The :class:`Call` of ``coll`` (a plan or API name, or a table row) on ``rank`` of
    ``world`` with tensors ``inp`` and ``out`` on ``device`` (a CUDA device index for the runtime,
    a ``torch.device`` for the collective API; ``owner`` names which in messages), reduced with
    ``op`` (and ``accum``, fp8's accumulation dtype), after checking everything about them
    (InvalidCall naming the first thing wrong): tensors, contiguous, on the device, of one dtype
    mscclang runs (a fused FP8 output aside), ``op`` and ``accum`` what the dtype reduces with,
    sizes that fit the collective, buffers that either do not overlap or are the collective's
    in-place layout, for the fused collective (``epi``) its residual, weight and parameters, and
    for a rooted one its ``root``, a rank of ``world``."""
    row = coll if isinstance(coll, Collective) else collective_row(coll)
    name = row.api or row.name
    root = _root(row, rank, world, root)
    for what, t in (("input", inp), ("output", out)):
        check_tensor(t, f"{name} {what}", rank, device, owner)
    dt = _info(inp, rank, f"{name} input")
    in_ptr, in_n, esz = _elements(inp)
    out_ptr, out_n, oesz = _elements(out)
    opname = reduce_op_name(op)
    if epi is not None:
        e = _fused(rank, device, owner, inp, out, dt, opname, epi)
        shape = BlockShape(1, 1, in_n)
        inplace = in_ptr == out_ptr
        if not inplace and overlap(in_ptr, in_n * esz, out_ptr, out_n * oesz):
            raise InvalidCall(f"rank {rank}: the fused output overlaps the input (pass x itself, or separate tensors)")
        return Call(row, rank, world, in_ptr, in_n * esz, out_ptr, out_n * oesz, dt, opname, None, inplace, shape, e)
    if out.dtype != inp.dtype:
        raise InvalidCall(f"rank {rank}: {name} input dtype {inp.dtype} differs from output dtype {out.dtype}")
    acc = check_reduction(dt, opname, accum) if row.reduces or accum is not None else None
    shape = _shape(row, rank, world, in_n, out_n)
    in_b, out_b = in_n * esz, out_n * esz
    inplace = False
    if overlap(in_ptr, in_b, out_ptr, out_b):
        off = row.inplace_offset(rank, shape.block_elems * esz)
        inplace = (in_ptr == out_ptr + off if row.inplace == "input_in_output" else
                   out_ptr == in_ptr + off if row.inplace == "output_in_input" else
                   in_ptr == out_ptr and in_b == out_b)
        if not inplace:
            where = {"input_in_output": "the input must be this rank's block of the output",
                     "output_in_input": "the output must be this rank's block of the input"}.get(
                         row.inplace, "the same tensor")
            raise InvalidCall(f"rank {rank}: {name} input and output overlap but are not the in-place layout "
                              f"({where})")
    return Call(row, rank, world, in_ptr, in_b, out_ptr, out_b, dt, opname, acc, inplace, shape, root=root)


#: the columns of a count matrix's row beyond the counts: the input rows, the output rows
COUNT_COLUMNS = 2


def make_counted_call(coll: Union[str, Collective], rank: int, world: int, device: Any, x: Any, out: Any,
                      counts: Any, capacity: int, owner: str = "communicator") -> Call:
    """The :class:`Call` of a collective with data-dependent counts (``all_to_all_v``) after
    checking its tensors (InvalidCall naming the first thing wrong): ``x`` and ``out`` contiguous
    on ``device``, of one dtype mscclang moves, at least 1-D, rows of the same shape (``x[i]``
    and ``out[i]``: the rows moved), a row a multiple of 4 bytes, not overlapping; ``counts``
    the call's int32 ``[world, 2 world + 2]`` count matrix on ``device``. ``capacity``: the rows
    of a scratch slot, the same on every rank."""
    row = coll if isinstance(coll, Collective) else collective_row(coll)
    name = row.api or row.name
    for what, t in (("x", x), ("out", out), ("the count matrix", counts)):
        check_tensor(t, f"{name}: {what}", rank, device, owner)
    dt = _info(x, rank, f"{name}: x")
    if out.dtype != x.dtype:
        raise InvalidCall(f"rank {rank}: {name}: out has dtype {out.dtype}, x {x.dtype} (they must match)")
    if x.dim() < 1 or out.dim() != x.dim() or tuple(out.shape[1:]) != tuple(x.shape[1:]):
        raise InvalidCall(f"rank {rank}: {name}: x of shape {tuple(x.shape)} and out of shape {tuple(out.shape)} "
                          "must be rows of one shape (they may differ in the first dimension only)")
    esz = x.element_size()
    width = math.prod(x.shape[1:])
    row_bytes = width * esz
    if row_bytes == 0 or row_bytes % 4:
        raise InvalidCall(f"rank {rank}: {name}: a row of x ({tuple(x.shape[1:])} x {x.dtype}) is {row_bytes} bytes; "
                          "rows must be a positive multiple of 4 bytes")
    if (getattr(counts, "dtype", None) is None or "int32" not in str(counts.dtype)
            or tuple(counts.shape) != (world, 2 * world + COUNT_COLUMNS)):
        raise InvalidCall(f"rank {rank}: {name}: the count matrix must be int32 of shape "
                          f"({world}, {2 * world + COUNT_COLUMNS}), got {getattr(counts, 'dtype', None)} "
                          f"{tuple(getattr(counts, 'shape', ()))}")
    in_b, out_b = x.numel() * esz, out.numel() * esz
    if in_b and out_b and overlap(x.data_ptr(), in_b, out.data_ptr(), out_b):
        raise InvalidCall(f"rank {rank}: {name}: x and out overlap (the call runs out of place)")
    args = CountedArgs(counts.data_ptr(), row_bytes, x.shape[0], out.shape[0], capacity)
    return Call(row, rank, world, x.data_ptr(), in_b, out.data_ptr(), out_b, dt, "sum", None, False,
                BlockShape(1, 1, x.numel()), counted=args)


def _root(row: Collective, rank: int, world: int, root: Any) -> int:
    """A rooted collective's ``root`` (InvalidCall unless a rank of ``world``), else 0."""
    if not row.rooted:
        return 0
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < world:
        raise InvalidCall(f"rank {rank}: {row.api or row.name} root {root!r} is not a rank of {world}")
    return root


def _number(v: Any) -> Optional[float]:
    """``v`` as a float when it is a real number (an int, a float, a numpy scalar or a one-element
    tensor; not a bool), else None."""
    item = getattr(v, "item", None)
    if callable(item) and not isinstance(v, (int, float)):
        try:
            v = item()
        except (TypeError, ValueError, RuntimeError):
            return None
    return None if isinstance(v, bool) or not isinstance(v, (int, float)) else float(v)


def _shape(row: Collective, rank: int, world: int, in_elems: int, out_elems: int) -> BlockShape:
    """The table's shape rule, its refusal naming the rank."""
    try:
        return row.shape(world, in_elems, out_elems)
    except InvalidCall as e:
        raise InvalidCall(f"rank {rank}: {e}") from None


def _fused(rank: int, device: Any, owner: str, x: Any, out: Any, dt: DtypeInfo, op: str, a: FusedArgs) -> EpiCall:
    """The fused collective's checks (docs/semantics.md, "Epilogue ops"), in one place."""
    what = "all_reduce_add_rms_norm"
    if dt.name not in EPILOGUE_DTYPES:
        raise InvalidCall(f"rank {rank}: {what}: x has dtype {x.dtype}; use float16, bfloat16 or float32")
    if op != "sum":
        raise InvalidCall(f"rank {rank}: {what} reduces with sum, not {op}")
    n = x.numel()
    res, w = a.residual, a.weight
    if res is None:
        raise InvalidCall(f"rank {rank}: {what}: pass the residual")
    check_tensor(res, f"{what}: residual", rank, device, owner)
    if res.dtype != x.dtype:
        raise InvalidCall(f"rank {rank}: {what}: residual has dtype {res.dtype}, x {x.dtype} (they must match)")
    if res.numel() != n or getattr(res, "shape", None) != getattr(x, "shape", None):
        raise InvalidCall(f"rank {rank}: {what}: residual has shape {tuple(res.shape)}, x {tuple(x.shape)}")
    h = a.hidden
    if w is not None:
        check_tensor(w, f"{what}: weight", rank, device, owner)
        if w.dim() != 1:
            raise InvalidCall(f"rank {rank}: {what}: the weight must be one row (1-D), got shape {tuple(w.shape)}")
        if h is None:
            h = w.numel()
        elif w.numel() != h:
            raise InvalidCall(f"rank {rank}: {what}: the weight has {w.numel()} elements; it must be one row of {h}")
        winfo = torch_dtype_info(w.dtype)
        if winfo is None or winfo.name not in ("float32", dt.name):
            raise InvalidCall(f"rank {rank}: {what}: the weight has dtype {w.dtype}; use float32 or x's {x.dtype}")
    if isinstance(h, bool) or not isinstance(h, int) or h % PARTIAL or not MIN_HIDDEN <= h <= MAX_HIDDEN:
        raise InvalidCall(f"rank {rank}: {what}: the hidden size (weight length) {h!r} must be a multiple of "
                          f"{PARTIAL} from {MIN_HIDDEN} to {MAX_HIDDEN}")
    if n % h:
        raise InvalidCall(f"rank {rank}: {what}: the hidden size {h} (weight length) does not divide x of shape "
                          f"{tuple(x.shape)}")
    if getattr(x, "dim", lambda: 1)() >= 2 and x.shape[-1] != h:   # a torch or vLLM user means the last dimension
        raise InvalidCall(f"rank {rank}: {what}: weight has {h} elements but x of shape {tuple(x.shape)} has a last "
                          f"dimension (the hidden size) of {x.shape[-1]}; they must be equal")
    eps = _number(a.eps)
    if eps is None or not math.isfinite(eps) or eps < 0:
        raise InvalidCall(f"rank {rank}: {what}: eps must be a finite number >= 0, got {a.eps!r}")
    scale = None if a.scale is None else _number(a.scale)
    fp8 = None
    if a.scale is not None:
        if scale is None or not math.isfinite(scale) or scale <= 0:
            raise InvalidCall(f"rank {rank}: {what}: fp8_scale must be a finite number > 0, got {a.scale!r}")
        if out is x:
            raise InvalidCall(f"rank {rank}: {what}: with fp8_scale, pass out= (an FP8 tensor of x's shape)")
        oi = torch_dtype_info(out.dtype)
        if oi is None or not oi.accumulates:
            raise InvalidCall(f"rank {rank}: {what}: out has dtype {out.dtype}; with fp8_scale it must be "
                              "float8_e4m3fn or float8_e5m2")
        fp8 = oi.name
    elif out.dtype != x.dtype:
        raise InvalidCall(f"rank {rank}: {what}: out has dtype {out.dtype}; without fp8_scale it must be x's "
                          f"{x.dtype}")
    if out.numel() != n or (hasattr(out, "shape") and hasattr(x, "shape") and out.shape != x.shape):
        raise InvalidCall(f"rank {rank}: {what}: out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
    rb = n * x.element_size()
    for other, t in (("x", x), ("the output", out)):
        if overlap(res.data_ptr(), rb, t.data_ptr(), t.numel() * t.element_size()):
            raise InvalidCall(f"rank {rank}: {what}: the residual overlaps {other}")
    return EpiCall(res.data_ptr(), 0 if w is None else w.data_ptr(),
                   None if w is None else torch_dtype_info(w.dtype).name, h, float(eps), scale, fp8)



def sized_call(coll: Union[str, Collective], rank: int, world: int, dtype: DtypeInfo, in_bytes: int, out_bytes: int,
               op: Any = "sum", accum: Any = None, in_ptr: int = 0, out_ptr: int = 1, hidden: int = 0,
               root: int = 0) -> Call:
    """The :class:`Call` of a call known by its sizes only (preparing one before its tensors
    exist; a fused call's ``hidden`` size, whose residual and weight come with each call): the
    sizes must fit the collective (InvalidCall); the addresses default to two distinct ones."""
    row = coll if isinstance(coll, Collective) else collective_row(coll)
    opname = reduce_op_name(op)
    acc = check_reduction(dtype, opname, accum) if row.reduces and hidden == 0 else None
    isz = max(dtype.itemsize, 1)
    # a fused call's output may be FP8: one block of the input's elements either way
    shape = BlockShape(1, 1, in_bytes // isz) if hidden else _shape(row, rank, world, in_bytes // isz, out_bytes // isz)
    epi = EpiCall(0, 0, None, hidden, 0.0) if hidden else None
    return Call(row, rank, world, in_ptr, in_bytes, out_ptr, out_bytes, dtype, opname, acc, in_ptr == out_ptr,
                shape, epi, _root(row, rank, world, root))


def message_call(coll: Union[str, Collective], world: int, nbytes: int, dtype: object, rank: int = 0) -> Call:
    """The :class:`Call` of a message of ``nbytes`` (the collective's message side, as plans' size
    ranges and tuning rules name calls) of ``dtype`` (any spelling of a dtype the GPU runs;
    CommError for another) on ``rank`` of ``world``: what the selector is asked about a size."""
    row = coll if isinstance(coll, Collective) else collective_row(coll)
    return sized_call(row, rank, world, gpu_dtype(dtype), *row.call_bytes(world, nbytes))
