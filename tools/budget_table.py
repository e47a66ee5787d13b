"""The verify budget's estimates (:mod:`mscclang.sim.budget`) against measured runs.

For every case (a plan built here: rings, full meshes, the library's LL plans, up to 1000 ranks,
and the ``verify`` arguments it runs with) a fresh process builds the plan, takes
:func:`~mscclang.sim.verify.estimate_verify` of the run, then runs
:func:`~mscclang.sim.verify.verify` and measures its CPU time (``time.process_time``: on a
machine shared with other jobs the wall time is several times that; it is kept too) and its
peak memory (``ru_maxrss`` of that process, which the estimate's interpreter base covers). One
row per case: estimate, measurement and their ratio (estimate / measured), printed as text or
written as a markdown table (``--markdown FILE``). ``--only NAME,...`` picks cases; ``--max-ranks``
leaves out the larger ones.

``--fit`` measures the table's cases and :data:`FIT_CASES` and fits the time estimate's weights
(:data:`mscclang.sim.budget.SECONDS_PER`) to them: a non-negative least-squares fit of the
measured seconds to the estimate's counted terms, each run weighted by its inverse time (so the
fit minimises relative error); it prints the weights to paste and each run's ratio.

    python3 tools/budget_table.py [--only CASES] [--max-ranks N] [--markdown notes/table.md]
    python3 tools/budget_table.py --fit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Case:
    """One row: a plan (``kind`` at ``ranks`` ranks) and the verify arguments it runs with
    (``sizes`` None: the default sizes; ``schedules``)."""

    name: str
    kind: str
    ranks: int
    schedules: int = 10
    sizes: Optional[tuple[int, ...]] = None


@dataclass
class Row:
    """What one case estimated and measured (seconds, bytes)."""

    case: str
    ranks: int
    est_seconds: float
    seconds: float
    est_memory: int
    memory: int
    ok: bool
    terms: dict = field(default_factory=dict)
    wall: float = 0.0   # wall seconds (``seconds`` is the process's CPU time: a loaded machine's
    #                     wall time is several times its CPU time)

    @property
    def time_ratio(self) -> float:
        return self.est_seconds / max(self.seconds, 1e-9)

    @property
    def memory_ratio(self) -> float:
        return self.est_memory / max(self.memory, 1)


def ring_allgather(n: int):
    """A ring allgather (zero-copy, symmetric buffers): after a ready word from the next rank,
    every rank forwards, in ``n - 1`` steps, the chunk it got last into the next rank's output,
    signalling it after each step and waiting for the previous rank's signal: a dependency chain
    ``n - 1`` signals long."""
    from mscclang.algorithms.common import (data_handshake, input_of, library_program, mesh, output_of,
                                            ready_handshake)
    from mscclang.dsl import AllGather, Rank

    prog = library_program("ring_allgather", AllGather, n, 1, False, "Simple", 512, None, 0, 1 << 40)
    with prog:
        pairs = [(r, p) for r in range(n) for p in sorted({(r + 1) % n, (r - 1) % n})]
        ch = mesh(n, pairs)
        for r in range(n):
            nxt, prv = (r + 1) % n, (r - 1) % n
            ready_handshake(ch, r, to=[prv], frm=[nxt], tb=0)
            Rank(r).copy(output_of(r)[r], input_of(r)[0], tb=0)
            for s in range(n - 1):
                c = (r - s) % n
                ch[(r, nxt)].put(output_of(nxt)[c], output_of(r)[c], tb=0)
                data_handshake(ch, r, to=[nxt], frm=[prv], tb=0)
    return prog.to_plan()


def full_ring(n: int, all_peers: bool = True) -> dict:
    """A ring of ``n`` ranks (signal the next rank, wait for the previous) in which every rank
    declares a memory channel to every other rank (``all_peers``; else to its two neighbours),
    using two: ``n * (n - 1)`` channel ends for ``2 n`` signals and waits."""
    gpus = []
    for r in range(n):
        peers = [p for p in range(n) if p != r and (all_peers or p in ((r + 1) % n, (r - 1) % n))]
        used = [peers.index((r + 1) % n), peers.index((r - 1) % n)]
        gpus.append({"id": r, "input_chunks": 1, "output_chunks": 1, "scratch_chunks": 0,
                     "channels": [{"channel_type": "memory", "connected_to": peers}],
                     "threadblocks": [{
                         "id": 0, "channels": [{"channel_type": "memory", "channel_ids": used}],
                         "ops": [{"name": "signal", "channel_type": "memory", "channel_ids": [0]},
                                 {"name": "wait", "channel_type": "memory", "channel_ids": [1]}]}]})
    return {"format": "mscclang.plan/1", "name": f"full_ring.r{n}", "collective": "test", "gpus": gpus}


def build_plan(kind: str, n: int):
    """The plan of a case: ``ring_allgather``, ``full_mesh`` (every rank signals every other),
    ``full_ring`` (:func:`full_ring`) or a library algorithm's builder at ``n`` ranks (any rank
    count)."""
    from mscclang.algorithms import ALGORITHMS
    from mscclang.plan import load_plan
    from tools.fuzz import fully_connected_plan

    if kind == "ring_allgather":
        return ring_allgather(n)
    if kind == "full_mesh":
        return load_plan(fully_connected_plan(n))
    if kind == "full_ring":
        return load_plan(full_ring(n))
    info = ALGORITHMS[kind]
    return info.builder(n, instances=1, num_threads_per_block=info.default_threads,
                        inplace=info.inplace_modes[0], min_message_size=info.min_message_size,
                        max_message_size=info.max_message_size)


CASES: tuple[Case, ...] = (
    Case("ring_allgather.r8", "ring_allgather", 8),
    Case("ring_allgather.r32", "ring_allgather", 32, 2),
    Case("ring_allgather.r128", "ring_allgather", 128, 1, (4096,)),
    Case("sendrecv_simple.r1000 (ring)", "sendrecv_simple", 1000, 2, (16000,)),
    Case("sendrecv_ll.r128 (ring)", "sendrecv_ll", 128, 4),
    Case("full_mesh.r32", "full_mesh", 32),
    Case("full_mesh.r128", "full_mesh", 128, 2),
    Case("full_mesh.r1000", "full_mesh", 1000, 1, (16,)),
    Case("full_ring.r1000", "full_ring", 1000, 2),
    Case("allgather_simple.r32", "allgather_simple", 32, 2),
    Case("allgather_zero_copy.r32", "allgather_zero_copy", 32, 2),
    Case("allreduce_rsag_simple.r8", "allreduce_rsag_simple", 8),
    Case("allgather_ll.r8", "allgather_ll", 8),
    Case("allgather_ll.r32", "allgather_ll", 32, 2),
    Case("allgather_ll.r128", "allgather_ll", 128, 1, (2048,)),
    Case("allreduce_oneshot_ll.r8", "allreduce_oneshot_ll", 8),
    Case("allreduce_oneshot_ll.r32", "allreduce_oneshot_ll", 32, 1, (512,)),
    Case("allreduce_twostep_ll.r32", "allreduce_twostep_ll", 32, 1, (4096,)),
    Case("reducescatter_ll.r32", "reducescatter_ll", 32, 2),
    Case("alltoall_ll.r32", "alltoall_ll", 32, 1, (16384,)),
    Case("broadcast_ll.r128", "broadcast_ll", 128, 2),
    Case("fused_oneshot_ll.r8", "allreduce_add_rms_norm_oneshot_ll", 8),
    Case("fused_twoshot_ll.r8", "allreduce_add_rms_norm_twoshot_ll", 8),
)

#: more runs for ``--fit`` only (other rank counts, sizes and schedule counts of the same kinds)
FIT_CASES: tuple[Case, ...] = tuple(Case(f"{k}.r{n}.s{s}" + (f".{z[0]}" if z else ""), k, n, s, z) for k, n, s, z in (
    ("ring_allgather", 16, 4, None), ("ring_allgather", 64, 2, (4096,)), ("full_mesh", 8, 10, None),
    ("full_mesh", 64, 4, None), ("full_mesh", 200, 1, (64,)), ("sendrecv_simple", 250, 4, None),
    ("sendrecv_simple", 500, 2, (8000,)), ("sendrecv_ll", 32, 10, None), ("allgather_ll", 16, 4, None),
    ("allgather_ll", 64, 1, (1024,)), ("allreduce_oneshot_ll", 16, 2, None), ("allreduce_oneshot_ll", 4, 10, None),
    ("allreduce_twostep_ll", 8, 10, None), ("allreduce_twostep_ll", 16, 2, None), ("reducescatter_ll", 8, 10, None),
    ("reducescatter_ll", 16, 2, None), ("alltoall_ll", 8, 10, None), ("alltoall_ll", 16, 4, None),
    ("broadcast_ll", 32, 10, None), ("broadcast_ll", 64, 4, None), ("allgather_simple", 8, 10, None),
    ("allgather_simple", 64, 1, (8192,)), ("allreduce_rsag_simple", 16, 4, None),
    ("allreduce_rsag_simple", 4, 10, None), ("allreduce_rsag_simple", 8, 1, (4 << 20,)),
    ("allgather_simple", 8, 2, (4 << 20,)), ("allreduce_rsag_pipelined", 4, 1, (4 << 20,)),
    ("allreduce_oneshot_ll", 8, 1, (1 << 18,)), ("alltoall_ll", 8, 2, (1 << 20,)),
    ("allreduce_port_pipelined", 4, 1, (1 << 20,)), ("reducescatter_ll", 8, 1, (1 << 18,)),
    ("allreduce_add_rms_norm_oneshot_ll", 2, 10, None), ("allreduce_add_rms_norm_twoshot_ll", 4, 4, None),
    ("full_ring", 300, 2, None), ("full_ring", 100, 10, None)))


PLAN_DIR = Path("/tmp/budget_table_plans")


def plan_file(case: Case) -> Path:
    """``case``'s plan as a JSON file (built once, kept in :data:`PLAN_DIR`)."""
    from mscclang.plan import plan_to_dict

    f = PLAN_DIR / f"{case.kind}.r{case.ranks}.json"
    if not f.exists():
        PLAN_DIR.mkdir(exist_ok=True)
        f.write_text(json.dumps(plan_to_dict(build_plan(case.kind, case.ranks))))
    return f


def estimate(case: Case):
    """``case``'s plan (loaded as ``mscclang verify`` loads it), its sizes and the estimate of
    its verify."""
    from mscclang.plan import load_plan
    from mscclang.sim.dtypes import parse_dtype
    from mscclang.sim.runner import default_launches
    from mscclang.sim.verify import DEFAULT_DTYPES, default_sizes, estimate_verify

    plan = load_plan(plan_file(case))
    sizes = list(case.sizes) if case.sizes else default_sizes(plan)
    if plan.has_epilogue_ops():   # a fused plan: verify runs its own cases (rows x hidden)
        from mscclang.sim.fused import estimate_fused

        sizes = list(case.sizes) if case.sizes else None
        return plan, sizes, estimate_fused(plan, sizes=sizes, schedules=case.schedules)
    dts = [parse_dtype(d) for d in DEFAULT_DTYPES]
    return plan, sizes, estimate_verify(plan, sizes, dts, case.schedules, default_launches(plan))


def measure(case: Case) -> Row:
    """Estimate and run ``case``'s verify in this process (call it in a fresh one: the peak is
    the process's)."""
    import resource
    import time

    from mscclang.sim.verify import verify

    plan, sizes, est = estimate(case)
    t, cpu = time.perf_counter(), time.process_time()
    rep = verify(plan, sizes=sizes, schedules=case.schedules)
    wall, seconds = time.perf_counter() - t, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return Row(case.name, case.ranks, est.seconds, seconds, est.memory_bytes, peak, rep.passed(), est.terms, wall)


def _run_case(case: Case, timeout: float) -> Optional[Row]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MSCCLANG_SIM_MAX_MEMORY": "64G",
           "MSCCLANG_SIM_MAX_SECONDS": "100000"}
    # the plan is built in a process of its own: a measuring process's ru_maxrss counts the
    # memory of the process it was forked from, so this one stays small
    subprocess.run([sys.executable, __file__, "--build", case.name], check=True, timeout=timeout, cwd=ROOT, env=env)
    r = subprocess.run([sys.executable, __file__, "--one", case.name], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=env)
    if r.returncode != 0:
        print(f"{case.name}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
        return None
    return Row(**json.loads(r.stdout.strip().splitlines()[-1]))


def _gib(b: int) -> str:
    return f"{b / 2**30:.3g} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def markdown(rows: list[Row]) -> str:
    """The rows as a markdown table."""
    out = ["| case | ranks | est. time | measured CPU | (wall) | est./meas. | est. memory | measured peak "
           "| est./meas. |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r.case} | {r.ranks} | {r.est_seconds:.3g} s | {r.seconds:.3g} s | {r.wall:.3g} s | "
                   f"{r.time_ratio:.2f} | {_gib(r.est_memory)} | {_gib(r.memory)} | {r.memory_ratio:.2f} |")
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """See the module docstring; exit status 1 when a row is off by more than 2x either way."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--build", help=argparse.SUPPRESS)
    ap.add_argument("--fit", action="store_true", help="fit the time estimate's weights (see above)")
    ap.add_argument("--save", type=Path, help="write the measured rows here (JSON)")
    ap.add_argument("--refit", type=Path, help="fit to the rows --save wrote, re-estimating them (after a "
                                                 "change of the model), measuring nothing; --markdown writes them")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--max-ranks", type=int, default=1 << 30)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each case this many times (fresh processes): the median time, the largest peak")
    a = ap.parse_args(argv)
    by_name: dict[str, Case] = {c.name: c for c in CASES + FIT_CASES}
    if a.one:
        print(json.dumps(asdict(measure(by_name[a.one]))))
        return 0
    if a.build:
        plan_file(by_name[a.build])
        return 0
    if a.refit:
        rows = [Row(**r) for r in json.loads(a.refit.read_text())]
        for r in rows:
            est = estimate(by_name[r.case])[2]
            r.terms, r.est_seconds, r.est_memory = est.terms, est.seconds, est.memory_bytes
        if a.markdown:   # the saved measurements against the package's estimates now
            a.markdown.write_text(markdown(rows))
        fit(rows)
        return 0
    pool = CASES + FIT_CASES if a.fit else CASES
    picked = [c for c in pool if (not a.only or c.name in a.only.split(",")) and c.ranks <= a.max_ranks]
    rows: list[Row] = []
    bad = 0
    for c in picked:
        runs = [_run_case(c, a.timeout) for _ in range(max(a.repeat, 1))]
        if any(r is None for r in runs):
            bad += 1
            continue
        row = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]   # the median time
        row.memory = max(r.memory for r in runs)
        rows.append(row)
        off = not (0.5 <= row.time_ratio <= 2 and 0.5 <= row.memory_ratio <= 2)
        bad += off
        print(f"{row.case:34s} time {row.est_seconds:9.3g} / {row.seconds:9.3g} s = {row.time_ratio:5.2f}   "
              f"memory {_gib(row.est_memory):>10s} / {_gib(row.memory):>10s} = {row.memory_ratio:5.2f}"
              f"{'  OFF' if off else ''}", flush=True)
    if a.markdown:
        a.markdown.write_text(markdown(rows))
    if a.save:
        a.save.write_text(json.dumps([asdict(r) for r in rows]))
    if a.fit:
        fit(rows)
    return 1 if bad else 0


def fit(rows: list[Row]) -> dict[str, float]:
    """Fit the weights of the time terms to ``rows`` (non-negative least squares, relative
    error); print them and each row's ratio under them."""
    import numpy as np
    from scipy.optimize import nnls   # a development tool's dependency, not the package's

    from mscclang.sim.budget import SECONDS_PER

    keys = list(SECONDS_PER)
    rows = [r for r in rows if r.terms and r.seconds > 0.05]
    x = np.array([[r.terms.get(k, 0.0) for k in keys] for r in rows])
    y = np.array([r.seconds for r in rows])
    w, _ = nnls(x / y[:, None], np.ones(len(y)))
    print("SECONDS_PER = {")
    for k, v in zip(keys, w):
        print(f"    {k!r}: {v:.2g},")
    print("}")
    for r, p in sorted(zip(rows, x @ w), key=lambda t: t[1] / t[0].seconds):
        print(f"{r.case:34s} fitted {p:8.3g} s / measured {r.seconds:8.3g} s = {p / r.seconds:5.2f}")
    return dict(zip(keys, w))


if __name__ == "__main__":
    sys.exit(main())
