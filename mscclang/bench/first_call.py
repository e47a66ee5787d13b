"""``mscclang bench --first-calls``: what the first eager call of a message size costs.

For every collective and every size, a size the communicator has never seen (nothing prepared,
no earlier call of that collective and size), each rank times the FIRST eager call and then the
SECOND call of the same size: host wall time around the call and the device synchronisation,
each call on fresh ordinary tensors (``torch.empty``) holding fresh random data, every result
checked against the reference before it is reported (a wrong result is reported as a failure, not
timed). The figure is the slower rank's. The first call carries the set-up a new size costs (plan
selection, registration or staging, device plan, kernel); the second shows what remains. Before
the first size, one untimed checked call of each collective at :func:`warmup_bytes` (a size not in
the list) takes the process's one-time start-up (the runtime's first kernel load), so that it is
not charged to the first size. A size whose first call ran a plan no earlier call of the process
ran (the warm-up's included) is a plan's first call (``new_plan``); any other is a new size of a
loaded plan: the report judges each against its target
(:func:`~mscclang.bench.targets.check_first_call_targets`). Ranks may share a GPU
(``MSCCLANG_RANKS_PER_GPU``).

Results: one :class:`FirstCallRecord` per (collective, size), streamed by rank 0 into
``<out>/first_calls.jsonl``, rendered as ``first_calls.json`` and ``first_calls.md``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from mscclang.bench.report import facts_lines, targets_lines, write_report
from mscclang.bench.results import ORDINARY, LineRecord, read_jsonl
from mscclang.bench.targets import check_first_call_targets
from mscclang.bench.worker import BenchConfig, BenchWorker, _sync, error_text, run_rank

FIRST_CALL_FORMAT = "mscclang.bench.first_calls/1"
JSONL = "first_calls.jsonl"


@dataclass
class FirstCallRecord(LineRecord):
    """One (collective, size): the first and the second call's time in milliseconds (the
    slower rank's), whether both results were right, the plan each call ran, and whether the
    first call's plan was new to the process (None: not known, e.g. torch.distributed ran it)."""

    KIND, REQUIRED, DEFAULTS = "first-call record", ("coll", "bytes"), {"dtype": "bfloat16"}

    coll: str
    bytes: int
    dtype: str
    first_ms: Optional[float] = None
    second_ms: Optional[float] = None
    ok: bool = False
    error: Optional[str] = None
    plan_first: Optional[str] = None
    plan_second: Optional[str] = None
    new_plan: Optional[bool] = None

    @property
    def ratio(self) -> Optional[float]:
        """First call's time over the second's (None unless both were measured)."""
        if not self.ok or not self.first_ms or not self.second_ms:
            return None
        return self.first_ms / self.second_ms


def warmup_bytes(sizes: list[int]) -> int:
    """The warm-up call's size: the smallest power of two from 8 KiB up that is not in ``sizes``."""
    b = 8192
    while b in sizes:
        b *= 2
    return b


class FirstCallWorker(BenchWorker):
    """One rank of the first-call measurement (see the module docstring)."""

    def _timed_call(self, coll: str, nbytes: int) -> tuple[float, bool, str, str]:
        """One unprepared eager call of ``coll`` at ``nbytes`` on fresh tensors and data: the
        host time around it and the device sync in ms, whether its result is right, what is
        wrong, and the plan that ran."""
        cell = self.make_cell(coll, ORDINARY, nbytes, prepare=False)
        seed = self.fill(cell)
        _sync(self.device)
        self.barrier()
        t0 = time.perf_counter()
        cell.op()
        _sync(self.device)
        ms = (time.perf_counter() - t0) * 1000.0
        ok, err = self.compare(coll, cell, seed)
        last = self.comm.last if self.comm is not None else None
        return ms, ok, err, last.label() if last is not None else ""

    def measure_size(self, coll: str, nbytes: int) -> FirstCallRecord:
        """The first and the second call of a new size (every rank, together)."""
        rec = FirstCallRecord(coll, nbytes, self.cfg.dtype)
        if (nbytes // self.esz) % self.world or nbytes % self.esz:
            rec.error = f"skipped: {nbytes} bytes do not split into {self.world} ranks of {self.cfg.dtype}"
            return rec
        times: list[float] = []
        for which in ("first", "second"):
            ms, ok, err, plan = 0.0, False, "", ""
            try:
                ms, ok, err, plan = self._timed_call(coll, nbytes)
            except Exception as e:  # noqa: BLE001 - recorded
                err = error_text(e)
            setattr(rec, f"plan_{which}", plan or None)
            slowest = self.slowest(ms)
            if not self.agree(ok):
                rec.error = f"{which} call: {err or 'wrong result or error on another rank'}"
                self._after_failure(ORDINARY)
                return rec
            times.append(slowest)
            if which == "first":
                last = self.comm.last if self.comm is not None else None
                key = None if last is None or last.plan is None else last.plan.name
                if key is not None:
                    rec.new_plan = key not in self.plans_run
                    self.plans_run.add(key)
        rec.first_ms, rec.second_ms = round(times[0], 4), round(times[1], 4)
        rec.ok = True
        return rec

    def slowest(self, ms: float) -> float:
        """The largest of every rank's ``ms`` (over the gloo group)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([ms], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return float(t.item())

    def run(self) -> None:
        """Every collective and size in order; rank 0 streams one record a line."""
        self.setup()
        self.plans_run: set[str] = set()   # the plans this process has run (names)
        if self.cfg.extra.get("warm_up"):
            t0 = time.perf_counter()
            warmed = self.comm.warm_up(self.cfg.colls, dtype=self.dtype, max_bytes=max(self.cfg.sizes))
            self.plans_run |= {w.plan for w in warmed if w.plan is not None}
            if self.rank == 0:
                print(f"warm_up: {len(warmed)} calls, {len(self.plans_run)} plans, "
                      f"{time.perf_counter() - t0:.2f} s", flush=True)
        warm = warmup_bytes(list(self.cfg.sizes))
        for coll in self.cfg.colls:
            w = self.measure_size(coll, warm)
            if self.rank == 0 and not w.ok:
                print(f"{coll:14s} warm-up call of {warm} B: {w.error}", flush=True)
        for coll in self.cfg.colls:
            for nbytes in self.cfg.sizes:
                if not self.in_time():
                    rec = FirstCallRecord(coll, nbytes, self.cfg.dtype, error="skipped: time limit")
                else:
                    rec = self.measure_size(coll, nbytes)
                self.append_line(JSONL, rec.to_dict())
                if self.rank == 0:
                    state = (f"{rec.first_ms:10.3f} ms {rec.second_ms:10.3f} ms" if rec.ok
                             else (rec.error or "")[:160])
                    print(f"{coll:14s} {nbytes:>10d} B {state}", flush=True)


def first_call_entry(rank: int, world: int, cfg: BenchConfig, port: int) -> None:
    """``torch.multiprocessing`` entry point of one rank."""
    run_rank(FirstCallWorker, rank, world, cfg, port)


def read_records(path: Union[str, Path]) -> list[FirstCallRecord]:
    """The records streamed into ``path`` (a torn last line is ignored)."""
    return read_jsonl(path, FirstCallRecord.from_dict)


def markdown(records: list[FirstCallRecord], meta: Optional[dict] = None) -> str:
    """The table: one row per (collective, size) with both times and their ratio."""
    meta = meta or {}
    lines = ["# mscclang bench: first call of a new size", ""]
    lines += facts_lines(meta, (("dtype", "dtype"), ("ranks_per_gpu", "ranks per GPU"), ("torch", "torch"),
                                ("date", "date")))
    lines += ["Host wall time of one eager call plus the device synchronisation, in milliseconds (the "
              "slower rank's), on fresh ordinary tensors and fresh random data; the first call is the "
              "first the communicator sees of that size (an untimed call of another size warmed the "
              "process up first). Every result was checked against the "
              "reference; FAIL = wrong result or error, skip = not run.", "",
              "| collective | bytes | first call ms | second call ms | ratio | plan (second call) |",
              "|---|---|---|---|---|---|"]
    for r in records:
        if r.ok:
            ratio = r.ratio
            lines.append(f"| {r.coll} | {r.bytes} | {r.first_ms:.3f} | {r.second_ms:.3f} | "
                         f"{'-' if ratio is None else f'{ratio:.1f}'} | {r.plan_second or '-'} |")
        else:
            mark = "skip" if (r.error or "").startswith("skipped") else "FAIL"
            lines.append(f"| {r.coll} | {r.bytes} | {mark} | {mark} | - | {r.plan_first or '-'} |")
    errs = [r for r in records if not r.ok and r.error and not r.error.startswith("skipped")]
    if errs:
        lines.append("")
        lines += [f"- {r.coll} {r.bytes} B: {r.error}" for r in errs[:8]]
    lines += [""] + targets_lines("## Targets (a plan's first call, a new size of a loaded plan)",
                                  check_first_call_targets(records), "call")
    return "\n".join(lines).rstrip("\n") + "\n"


def render(records: list[FirstCallRecord], meta: dict, out_dir: Union[str, Path],
           json_path: Optional[Union[str, Path]] = None) -> dict[str, Path]:
    """Write ``first_calls.json`` (or ``json_path``) and ``first_calls.md`` into ``out_dir``;
    returns their paths."""
    doc = {"format": FIRST_CALL_FORMAT, "meta": meta, "results": [r.to_dict() for r in records]}
    return write_report(out_dir, "first_calls", doc, markdown(records, meta), json_path)
