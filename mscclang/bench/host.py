"""``mscclang bench --host``: what a call costs the host, beside a torch launch.

Each rank, after one checked call and a warm-up, queues ``calls`` calls (default 200) without
waiting for the GPU and divides the loop's wall time by ``calls``: host microseconds per queued
call, the median of ``repeats`` loops (each loop starts on every rank together, after a device
synchronisation; the synchronisation after it is outside the timing). The figure is the slower
rank's. Rows (:data:`LABELS`):

* torch's ``x.add_(1)`` and ``y.copy_(x)`` on the same device, timed the same way in the same
  process: their mean is a torch launch, the unit of the other rows;
* ``Communicator.all_reduce`` on a symmetric tensor (``comm.empty``) and on an ordinary one
  (``torch.empty``), and ``torch.distributed.all_reduce`` of an ordinary tensor through mscclang's
  backend, each at every size (default 1K, 64K and 1M elements). The backend's group is a
  ``new_group(backend="mscclang")`` whose Communicator is the one the other rows call, so the
  ``dist`` row differs from the ``ordinary`` one by the backend's path alone;
* the fused ``all_reduce_add_rms_norm`` of 16 tokens of 4,096;
* ``torch.distributed.all_reduce`` through a process group written in Python that does nothing
  (``floor``, smallest size only): torch's own part of every ``dist`` call, which a Python
  backend cannot avoid, so the ``dist`` rows' ratio to the Communicator is at least
  ``(Communicator + floor) / Communicator``.

Every mscclang row is prepared (``comm.prepare``, as the sweep does) and checked against the
reference on random data before it is timed (a wrong result is a failure, not a time); its input
is then zeroed, so that the timed calls change no value. Ranks may share a GPU
(``MSCCLANG_RANKS_PER_GPU=2`` on one GPU): the host's time is what is measured, and 200 queued
calls fit CUDA's launch queue. The goals are :func:`~mscclang.bench.targets.check_host_targets`'s.

Results: one :class:`HostRecord` per row, streamed by rank 0 into ``<out>/host.jsonl``, rendered
as ``host.json`` (or ``--json PATH``) and ``host.md``.
"""

from __future__ import annotations

import datetime
import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from mscclang.bench.fused import FUSED
from mscclang.bench.report import facts_lines, targets_lines, write_report
from mscclang.bench.results import ORDINARY, LineRecord
from mscclang.bench.sizes import format_size
from mscclang.bench.targets import TORCH_LAUNCHES, check_host_targets, torch_launch_us
from mscclang.bench.cells import Cell
from mscclang.bench.worker import BenchConfig, BenchWorker, _sync, error_text, median, run_rank
from mscclang.comm.errors import CommError
from mscclang.plan.dtypes import dtype_info

HOST_FORMAT = "mscclang.bench.host/1"
JSONL = "host.jsonl"
#: the message sizes, in elements
HOST_ELEMENTS = (1 << 10, 1 << 16, 1 << 20)
#: the fused row's x: tokens x hidden
FUSED_TOKENS, FUSED_HIDDEN = 16, 4096
DEFAULT_CALLS, DEFAULT_REPEATS, WARMUP = 200, 5, 20
#: most calls one loop may queue: CUDA's launch queue holds about 1,000 launches, and an ordinary
#: tensor's call may take three (copy in, kernel, copy out); a full queue would time the GPU
MAX_CALLS = 250
#: every row's name -> what it times
LABELS = {"add": "torch x.add_(1)", "copy": "torch y.copy_(x)",
          "symmetric": "Communicator.all_reduce, symmetric tensor",
          "ordinary": "Communicator.all_reduce, ordinary tensor",
          "fused": f"all_reduce_add_rms_norm, T={FUSED_TOKENS}",
          "dist": "torch.distributed.all_reduce (mscclang backend)",
          "floor": "torch.distributed.all_reduce (a Python group that does nothing)"}
#: rows timed without a checked call first (they compute nothing of their own)
UNCHECKED = (*TORCH_LAUNCHES, "floor")


@dataclass
class HostRecord(LineRecord):
    """One row: ``call`` (a :data:`LABELS` key) on ``elements`` elements (``bytes`` bytes) of
    ``dtype``; ``us`` the slower rank's host microseconds per queued call, ``rank_us`` every
    rank's; ``ok`` when it was checked and timed, else ``error`` (``skipped: ...`` when not run)."""

    KIND, REQUIRED = "host record", ("call", "elements", "bytes", "dtype")

    call: str
    elements: int
    bytes: int
    dtype: str
    us: Optional[float] = None
    rank_us: list[float] = field(default_factory=list)
    ok: bool = False
    error: Optional[str] = None
    plan: Optional[str] = None

    @property
    def label(self) -> str:
        """What the row times (e.g. ``Communicator.all_reduce, ordinary tensor``)."""
        return LABELS.get(self.call, self.call)


def host_config(dtype: str = "bfloat16", out_dir: str = ".", tuning: Optional[str] = None,
                calls: int = DEFAULT_CALLS, repeats: int = DEFAULT_REPEATS,
                elements: tuple[int, ...] = HOST_ELEMENTS, hidden: int = FUSED_HIDDEN) -> BenchConfig:
    """The host mode's configuration: ``calls`` queued calls a loop (1 to :data:`MAX_CALLS`),
    ``repeats`` loops a row, messages of ``elements`` elements, the fused row's rows of ``hidden``
    elements; :class:`CommError` naming a value out of range."""
    if not 1 <= calls <= MAX_CALLS or repeats < 1 or not elements or min(elements) < 1 or hidden < 1:
        raise CommError(f"bench --host: calls {calls} (1..{MAX_CALLS}), repeats {repeats} (>= 1), elements "
                        f"{list(elements)} and hidden {hidden} (positive) are out of range")
    esz = dtype_info(dtype).itemsize
    return BenchConfig(colls=[], sizes=[max(elements) * esz], impls=["mscclang", ORDINARY], modes=["eager"],
                       dtype=dtype, out_dir=out_dir, blocks=repeats, warmup=WARMUP, tuning=tuning,
                       extra={"calls": calls, "elements": list(elements), "hidden": hidden})


def host_rows(cfg: BenchConfig) -> list[tuple[str, int]]:
    """The rows of a run, in order, as (call, elements)."""
    sizes = sorted(cfg.extra["elements"])
    return ([(c, sizes[0]) for c in TORCH_LAUNCHES] + [("symmetric", n) for n in sizes]
            + [("ordinary", n) for n in sizes] + [("fused", FUSED_TOKENS * cfg.extra["hidden"])]
            + [("dist", n) for n in sizes] + [("floor", sizes[0])])


def host_us_per_call(call: Callable[[], Any], calls: int, repeats: int, sync: Callable[[], None],
                     barrier: Callable[[], None]) -> list[float]:
    """Host microseconds per call of ``repeats`` loops of ``calls`` calls of ``call()``: each loop
    after ``sync()`` (the device idle) and ``barrier()`` (every rank ready), its wall time over
    ``calls``; the ``sync()`` after it is not timed."""
    out = []
    for _ in range(repeats):
        sync()
        barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
        sync()
    return out


class HostWorker(BenchWorker):
    """One rank of the host-time measurement (see the module docstring)."""

    group: Any = None                 # the mscclang process group of the ``dist`` rows
    group_error: Optional[str] = None
    floor_group: Any = None           # the do-nothing group of the ``floor`` row

    def make_comm(self) -> Any:
        """The Communicator of a ``new_group(backend="mscclang")`` (with ``cfg.tuning``), so that
        every row runs one Communicator; without that group, the default one's (and the ``dist``
        rows are skipped with the reason)."""
        import torch.distributed as dist

        import mscclang.distributed  # noqa: F401 - registers the backend

        try:
            self.group = dist.new_group(backend="mscclang",
                                        timeout=datetime.timedelta(seconds=self.cfg.runtime_timeout_s))
            comm = self.group.communicator
            if self.cfg.tuning:
                comm.use_tuning(self.cfg.tuning)
        except Exception as e:  # noqa: BLE001 - recorded on the dist rows
            self.group, self.group_error = None, error_text(e)
            return super().make_comm()
        # no new_group: torch.distributed's calls run a group object handed to them as it is
        self.floor_group = floor_group_class()(self.rank, self.world)
        return comm

    def each_rank(self, value: float) -> list[float]:
        """Every rank's ``value``, in rank order (over the gloo group)."""
        import torch
        import torch.distributed as dist

        out = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([value], dtype=torch.float64), group=self.ctrl)
        return [float(t.item()) for t in out]

    def host_cell(self, call: str, elements: int) -> Cell:
        """The tensors and the call of a row (mscclang rows prepared, not yet checked)."""
        import torch
        import torch.distributed as dist

        dt, dev = self.dtype, self.device
        if call in TORCH_LAUNCHES:
            x, y = torch.zeros(elements, dtype=dt, device=dev), torch.zeros(elements, dtype=dt, device=dev)
            return Cell((lambda: x.add_(1)) if call == "add" else (lambda: y.copy_(x)), x, y, elements)
        if call == "fused":
            return self.make_cell(FUSED, "mscclang", elements * self.esz)
        if call in ("dist", "floor"):
            group = self.group if call == "dist" else self.floor_group
            if group is None:   # both are made with the mscclang group, or neither
                raise RuntimeError(f"skipped: no mscclang process group here ({self.group_error})")
            x = torch.empty(elements, dtype=dt, device=dev)
            return Cell(lambda: dist.all_reduce(x, group=group), x, x, elements)
        return self.make_cell("all_reduce", "mscclang" if call == "symmetric" else ORDINARY, elements * self.esz)

    def measure_row(self, call: str, elements: int) -> HostRecord:
        """One row (every rank, together): build, check, warm up, time."""
        rec = HostRecord(call, elements, elements * self.esz, self.cfg.dtype)
        if not self.in_time():
            rec.error = "skipped: time limit"
            return rec
        ok, err, cell = True, "", None
        try:
            cell = self.host_cell(call, elements)
            if call not in UNCHECKED:
                ok, err = self.check(FUSED if call == "fused" else "all_reduce", cell)
                cell.inp.zero_()   # the timed calls then add zeros: no value grows
                if call != "fused" and self.comm is not None and self.comm.last is not None:
                    cell.plan = self.comm.last.label()
        except Exception as e:  # noqa: BLE001 - recorded
            ok, err = False, error_text(e)
        if not self.agree(ok) or cell is None:
            skipped = err.startswith("RuntimeError: skipped:")
            rec.error = err.partition(": ")[2] if skipped else f"check failed: {err or 'on another rank'}"
            self._after_failure(ORDINARY)
            return rec
        med = 0.0
        try:
            for _ in range(self.cfg.warmup):
                cell.op()
            times = host_us_per_call(cell.op, int(self.cfg.extra["calls"]), self.cfg.blocks,
                                     lambda: _sync(self.device), self.barrier)
            med = median(times)
            ok = math.isfinite(med) and med > 0
        except Exception as e:  # noqa: BLE001 - recorded
            ok, err = False, error_text(e)
            _sync(self.device)
        if not self.agree(ok):
            rec.error = f"timed calls failed: {err or 'on another rank'}"
            self._after_failure(ORDINARY)
            return rec
        rec.rank_us = [round(u, 3) for u in self.each_rank(med)]
        rec.us, rec.ok, rec.plan = max(rec.rank_us), True, cell.plan or None
        return rec

    def run(self) -> None:
        """Every row in order; rank 0 streams one record a line."""
        self.setup()
        for call, elements in host_rows(self.cfg):
            rec = self.measure_row(call, elements)
            self.append_line(JSONL, rec.to_dict())
            if self.rank == 0:
                state = f"{rec.us:9.2f} us" if rec.ok else (rec.error or "")[:160]
                print(f"{rec.label:48s} {format_size(elements):>5s} {state}", flush=True)


@functools.cache
def floor_group_class() -> type:
    """A process group written in Python that does nothing: its ``allreduce`` returns a completed
    Work (the ``floor`` row's group; made with ``(rank, size)``)."""
    import torch.distributed as dist

    class Done(dist.Work):
        def wait(self, timeout: Any = None) -> bool:
            return True

    class Floor(dist.ProcessGroup):
        def allreduce(self, tensors: list, opts: Any = None) -> Any:
            return Done()

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "floor"

    return Floor


def host_entry(rank: int, world: int, cfg: BenchConfig, port: int) -> None:
    """``torch.multiprocessing`` entry point of one rank."""
    run_rank(HostWorker, rank, world, cfg, port)


def markdown(records: list[HostRecord], meta: Optional[dict] = None) -> str:
    """The table (one row per record: its time and its ratio to a torch launch) and the targets."""
    meta = meta or {}
    extra = meta.get("config", {}).get("extra", {})
    unit = torch_launch_us(records)
    lines = ["# mscclang bench --host: host time per queued call", ""]
    lines += facts_lines(meta, (("dtype", "dtype"), ("ranks_per_gpu", "ranks per GPU"), ("torch", "torch"),
                                ("date", "date")))
    lines += [f"Host microseconds per call of a loop queuing {extra.get('calls', DEFAULT_CALLS)} calls without "
              "waiting for the GPU (after a checked call and a warm-up), the median of "
              f"{meta.get('config', {}).get('blocks', DEFAULT_REPEATS)} loops, the slower rank's. `x torch` = the "
              "row's time over a torch launch (the mean of the two torch rows"
              + (f", {unit:.2f} us" if unit else "") + ", timed the same way in the same processes). "
              "FAIL = wrong result or error, skip = not run.", "",
              "| call | elements | host us per call | x torch | plan |", "|---|---|---|---|---|"]
    for r in records:
        if r.ok and r.us is not None:
            ratio = "-" if unit is None else f"{r.us / unit:.2f}"
            lines.append(f"| {r.label} | {format_size(r.elements)} | {r.us:.2f} | {ratio} | {r.plan or '-'} |")
        else:
            mark = "skip" if (r.error or "").startswith("skipped") else "FAIL"
            lines.append(f"| {r.label} | {format_size(r.elements)} | {mark} | - | {r.plan or '-'} |")
    notes = [r for r in records if not r.ok and r.error]
    if notes:
        lines += [""] + [f"- {r.label}, {format_size(r.elements)}: {r.error}" for r in notes[:12]]
    lines += [""] + targets_lines("## Targets (host time)", check_host_targets(records), "call")
    return "\n".join(lines).rstrip("\n") + "\n"


def render(records: list[HostRecord], meta: dict, out_dir: Union[str, Path],
           json_path: Optional[Union[str, Path]] = None) -> dict[str, Path]:
    """Write ``host.json`` (or ``json_path``) and ``host.md`` into ``out_dir``; their paths."""
    doc = {"format": HOST_FORMAT, "meta": meta, "results": [r.to_dict() for r in records]}
    return write_report(out_dir, "host", doc, markdown(records, meta), json_path)
