"""The simulator's epilogue ops: ``rmsnorm`` over whole rows of the residual (``radd`` is a
reduction of the residual and its source, run as one by :mod:`mscclang.sim.packets`), and the
check that a norm reads only rows every rank's contribution has reached.

An ``rmsnorm`` reads and writes with its own row-wise thread mapping (:data:`ROW_UNIT`), so the
race machinery orders it after a ``radd`` (or any data op) of the same block on the same bytes
only across a ``nop``, as on the GPU.
"""

from __future__ import annotations

import numpy as np

from mscclang.errors import PlanError
from mscclang.plan.models import BufferKind
from mscclang.sim.epilogue import norm
from mscclang.sim.program import COp
from mscclang.sim.races import Actor, OpRef
from mscclang.sim.tasks import Task

#: the race log's thread-mapping unit of an rmsnorm (rows, not 16-byte pieces)
ROW_UNIT = -1


class EpilogueMixin:
    """``rmsnorm`` execution; mixed into :class:`mscclang.sim.engine.Simulation`, whose ``mem``,
    ``dtype``, ``epilogue``, ``spec``, ``sym_granule`` and ``_record`` it uses."""

    def _rmsnorm(self, task: Task, actor: Actor, cop: COp, opref: OpRef) -> None:
        rank = task.rank
        where = f"rank {rank} tb {task.tb} op {cop.index} rmsnorm"
        p = self.epilogue
        if p is None:
            raise PlanError(f"{where}: needs the epilogue's execution parameters (hidden size, weight, eps)")
        quant = bool(cop.op.quant)
        if quant and p.scale is None:
            raise PlanError(f"{where}: quant needs the fp8 scale (an execution parameter)")
        act = self.dtype
        rowb = p.hidden * act.itemsize
        piece = cop.groups[0].pieces[0]
        a, b = piece.offsets[0], piece.offsets[0] + piece.length
        src, dst = cop.op.src_buff[0], cop.op.dst_buff[0]
        if a % rowb or b % rowb:
            raise PlanError(f"{where}: residual chunks {src.index}..{src.index + src.size - 1} are bytes "
                            f"[{a}, {b}), not whole rows of {p.hidden} {act} elements ({rowb} bytes); a plan whose "
                            "norms cover single chunks says chunk_unit \"row\" (docs/dsl.md)")
        odt = p.out_dtype(act, quant)
        orow = p.hidden * odt.itemsize
        oa, ob = a // rowb * orow, b // rowb * orow
        mem = self.mem[rank]
        got = mem.layout.ref_span(BufferKind.output, dst.index, dst.size)
        if b > a and got != (oa, ob):
            raise PlanError(f"{where}: output chunks {dst.index}..{dst.index + dst.size - 1} are bytes "
                            f"[{got[0]}, {got[1]}) but the rows read belong at [{oa}, {ob}) of the "
                            f"{odt} output")
        if b <= a:
            return
        rkey, rbase = mem.alias[BufferKind.residual]
        okey, obase = mem.alias[BufferKind.output]
        rows = mem.storage[rkey][rbase + a: rbase + b].copy().view(act).reshape(-1, p.hidden)
        self._record(actor, rank, rkey, rbase + a, rbase + b, False, opref, task.launch, unit=ROW_UNIT)
        self._check_norm_rows(rank, rkey, rbase + a, rbase + b, opref)
        out = norm(rows, p, quant)
        mem.storage[okey][obase + oa: obase + ob] = out.reshape(-1).view(np.uint8)
        self._record(actor, rank, okey, obase + oa, obase + ob, True, opref, task.launch, unit=ROW_UNIT)
        if mem.shadow is not None:
            # output granule j follows residual granule j * ratio (an FP8 output has 1/ratio of
            # the bytes): its counts, and the norm of that residual value
            g, ratio = self.sym_granule, act.itemsize // odt.itemsize
            if (rbase + a) % g or (obase + oa) % g or (b - a) % (g * ratio):
                self.sym_ok = False
            else:
                lo, hi = (rbase + a) // g, (rbase + b) // g
                mem.shadow[okey][(obase + oa) // g: (obase + ob) // g] = mem.shadow[rkey][lo:hi:ratio]
                mem.expr[okey][(obase + oa) // g: (obase + ob) // g] = self.exprs.norm(  # type: ignore[index]
                    mem.expr[rkey][lo:hi:ratio], quant)  # type: ignore[index]

    def _check_norm_rows(self, rank: int, key: str, a: int, b: int, opref: OpRef) -> None:
        """A symbolic run of the fused collective: the residual bytes [a, b) a norm reads must
        hold every rank's contribution to their chunk exactly once (else the norm reads a row
        before its sum is complete: an ``early-norm-read``)."""
        mem = self.mem[rank]
        if mem.shadow is None or not self.spec.row.fused:
            return
        g = self.sym_granule
        if a % g or b % g:
            self.sym_ok = False
            return
        sh = mem.shadow[key][a // g: b // g]
        cin = self.plan.gpus[rank].input_chunks
        grid = mem.layout.input
        chunk = np.minimum((a + g * np.arange(sh.shape[0])) // max(grid.chunk_bytes, 1), cin - 1)
        want = np.zeros_like(sh)
        for p in range(self.n):
            want[np.arange(sh.shape[0]), p * cin + chunk] = 1
        bad = np.nonzero((sh != want).any(axis=1))[0]
        if bad.size:
            k = int(bad[0])
            have = int(sh[k].sum())
            self.problem("early-norm-read",
                         f"{opref} reads residual bytes [{a + g * k}, {a + g * k + g}) when they hold "
                         f"{have} of the {self.n} ranks' contributions to chunk {int(chunk[k])} (each "
                         "exactly once is needed): the norm reads a row before its sum is complete",
                         op=opref, rank=rank)
