#!/usr/bin/env python3
"""The user-API allreduce measurement (issue 13): CUDA-graph allreduce through the public
``mscclang.Communicator``, beside NCCL and torch SymmetricMemory, per message size.

For every size (bytes of bfloat16 data) and every tensor kind

* ``symmetric``: a tensor from ``comm.empty`` (zero-copy plans run on it directly),
* ``ordinary``:  a plain ``torch.empty`` tensor (mscclang copies through its registered scratch),
* ``nccl``:      ``torch.distributed.all_reduce`` on a plain tensor (NCCL, NVLink multicast off),
* ``symm``:      torch SymmetricMemory's ``torch.ops.symm_mem.two_shot_all_reduce_`` (skipped,
  with the reason, where this torch lacks it),

the script

1. sets the call up: ``comm.prepare("all_reduce", x)`` for the mscclang kinds (before the checked
   call, so the checked call runs the kernel the graph will record: prepare builds the
   plan-specialised kernel of sizes that the default policy specialises only once hot);
   ``rendezvous`` for ``symm``;
2. checks one eager in-place call on fresh random data: against the exact sum of every rank's
   input (every rank regenerates every rank's data from its seed), within the bf16 bound
   ``2 * world * 2^-8 * sum_r |x_r|``, and against NCCL's result of the same data (within the same
   bound; the table says whether it is also bit-identical, which it is at 2 ranks when both round
   the fp32 sum once);
3. captures ``--calls`` (50) in-place calls in one CUDA graph, replays it once on known inputs
   (rank-dependent small integers times a power of two, so every partial sum is exact in bf16 at
   2, 4 and 8 ranks) and checks the result exactly (other world sizes: within a relative bound);
4. times ``--replays`` (5) replays with CUDA events (inputs re-initialised before each, outside the
   timed region; the ranks meet on the host, then on the GPU through a one-element NCCL allreduce
   just before the start event, so the ranks' host start skew is not timed; ``--align host``
   skips that); the figure is the median replay's time divided by the calls, on the slower rank.

The markdown table has the four kinds in microseconds per call, ordinary / symmetric and
symmetric / NCCL, and the issue's goal per size (met / MISSED for the symmetric and the ordinary
tensor; a size where the library handed the call to NCCL never counts as met).
``--bench-json DIR/bench.json`` adds the figures of a ``mscclang bench`` run beside them.

Run (one process per GPU, at least two):

    torchrun --nproc-per-node 2 examples/graph_allreduce.py [--sizes 1K,64K] [--json out.json]
    python3 examples/graph_allreduce.py --nproc 2 [--quick] [--json out.json]

NCCL runs with ``NCCL_NVLS_ENABLE=0`` (set here when unset; any other value is refused, as is
``MSCCLANG_ENABLE_NVLS``). Exit status: 0 when every cell that ran passed its checks (goals met or
not), and also when the machine has fewer than two CUDA GPUs (the run is skipped with a message
saying so); 1 when a check or a run failed; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

KiB, MiB = 1 << 10, 1 << 20
#: the tensor kinds measured, in table order
KINDS: tuple[str, ...] = ("symmetric", "ordinary", "nccl", "symm")
KIND_LABELS = {"symmetric": "mscclang, symmetric tensor (comm.empty)", "ordinary": "mscclang, ordinary tensor",
               "nccl": "NCCL", "symm": "torch symm two-shot"}
#: the mscclang kinds (the others are the peers)
MSCCLANG_KINDS = ("symmetric", "ordinary")
#: the issue's goals: microseconds per call, CUDA graph, bf16, 2x H200
GOALS_US: dict[int, float] = {1 * KiB: 2.0, 64 * KiB: 2.7, 256 * KiB: 3.6, 1 * MiB: 7.0, 4 * MiB: 15.0,
                              16 * MiB: 50.0, 64 * MiB: 195.0}
DEFAULT_SIZES: tuple[int, ...] = tuple(sorted(GOALS_US))
#: ``--quick``: a 3-size smoke run
QUICK_SIZES: tuple[int, ...] = (1 * KiB, 1 * MiB, 64 * MiB)
CALLS, REPLAYS = 50, 5
#: unit roundoff of bfloat16
BF16_U = 2.0 ** -8
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: a skipped run (fewer than two GPUs) is not a failure
EXIT_SKIPPED = 0
FORMAT = "mscclang.graph_allreduce/1"
#: the largest magnitude (power of two) the graph check's values may reach, and the smallest start
_MAX_EXP, _MIN_EXP = 100, -120
_T = TypeVar("_T")


class UsageError(Exception):
    """A bad argument or environment (exit status 2)."""


class CellFailed(Exception):
    """A stage of one (size, kind) failed on at least one rank (the message names the ranks)."""


class CellSkipped(Exception):
    """Every rank skipped a (size, kind), e.g. torch lacks SymmetricMemory's two-shot allreduce."""


# ---------------------------------------------------------------------------------------------
# arguments

def parse_size(text: str) -> int:
    """``"64K"`` -> 65536: a positive, even byte count (bf16 elements) in mscclang's byte-count
    grammar (:func:`mscclang.units.parse_bytes`: an optional K/M/G/T suffix, KiB-based)."""
    ensure_mscclang_importable()
    from mscclang.units import parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError:
        raise UsageError(f"bad size {text!r}: use a byte count with an optional K, M or G suffix (e.g. 64K)") from None
    if n <= 0 or n % 2:
        raise UsageError(f"bad size {text!r}: need a positive, even number of bytes (bf16 elements)")
    return n


def parse_sizes(items: Sequence[str]) -> list[int]:
    """Sizes from ``--sizes`` items, each a size or a comma list: sorted, without duplicates."""
    out = {parse_size(p) for item in items for p in item.split(",") if p.strip()}
    if not out:
        raise UsageError("no sizes given")
    return sorted(out)


def format_size(nbytes: int) -> str:
    """65536 -> ``64K``; 3 MiB -> ``3M``; 1536 -> ``1536`` (:func:`mscclang.units.format_size`)."""
    ensure_mscclang_importable()
    from mscclang.units import format_size as fmt

    return fmt(nbytes)


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="graph_allreduce.py",
        description="CUDA-graph allreduce through mscclang's public Communicator API (symmetric and "
                    "ordinary tensors) beside NCCL and torch SymmetricMemory two-shot: checked "
                    "first, then the median of REPLAYS replays of one graph of CALLS in-place "
                    "calls, in microseconds per call, against the issue's goals.",
        epilog="Run under `torchrun --nproc-per-node N` or as `python3 graph_allreduce.py --nproc N`. "
               "Exit status: 0 every cell that ran passed its checks (or the run was skipped: fewer "
               "than 2 CUDA GPUs), 1 a check or a run failed, 2 usage error.")
    p.add_argument("--sizes", nargs="+", metavar="SIZE",
                   help="message sizes in bytes of bf16 data (1K, 64K, 4M or comma lists); "
                        "default " + ",".join(format_size(s) for s in DEFAULT_SIZES))
    p.add_argument("--quick", action="store_true",
                   help="smoke run at " + ", ".join(format_size(s) for s in QUICK_SIZES) + " (with --sizes: ignored)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma list of {', '.join(KINDS)} (default: all)")
    p.add_argument("--calls", type=int, default=CALLS, help=f"in-place calls captured in one graph (default {CALLS})")
    p.add_argument("--replays", type=int, default=REPLAYS, help=f"timed replays; the median counts (default {REPLAYS})")
    p.add_argument("--align", choices=("device", "host"), default="device",
                   help="how the ranks start each timed replay together: 'device' (default) meets on "
                        "the host, then in a one-element NCCL allreduce right before the start event; "
                        "'host' only on the host (the ranks' start skew then lands in the timing)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random check data (default 1)")
    p.add_argument("--nproc", type=int, default=None,
                   help="without torchrun: processes (GPUs) to spawn (default: every visible GPU)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="without torchrun: stop the processes after S seconds (default 900)")
    p.add_argument("--json", metavar="FILE", help="also write every figure and check to FILE")
    p.add_argument("--bench-json", metavar="FILE",
                   help="a `mscclang bench` bench.json: its allreduce graph figures go beside these")
    p.add_argument("--from-json", metavar="FILE",
                   help="measure nothing: print the table of an earlier --json FILE")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the arguments; ``args.sizes`` becomes a sorted list of byte counts and
    ``args.kinds`` a list. Usage errors exit with status 2 (argparse's convention)."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.sizes = parse_sizes(args.sizes) if args.sizes else list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise UsageError(f"unknown kind(s) {', '.join(bad) or '(none given)'}: choose from {', '.join(KINDS)}")
        args.kinds = [k for k in KINDS if k in kinds]
        if args.calls < 1 or args.replays < 1:
            raise UsageError("--calls and --replays must be at least 1")
        if args.nproc is not None and args.nproc < 2:
            raise UsageError("--nproc must be at least 2 (an allreduce needs two ranks)")
        if args.timeout <= 0:
            raise UsageError("--timeout must be positive")
    except UsageError as e:
        p.error(str(e))
    return args


def nvlink_multicast_guard(environ: Optional[dict] = None) -> None:
    """Make NCCL run without NVLink multicast: set ``NCCL_NVLS_ENABLE=0`` when unset; refuse any
    other value, and refuse ``MSCCLANG_ENABLE_NVLS`` (:class:`UsageError`)."""
    env = os.environ if environ is None else environ
    v = env.get("NCCL_NVLS_ENABLE")
    if v is None or not v.strip():
        env["NCCL_NVLS_ENABLE"] = "0"
    elif v.strip() != "0":
        raise UsageError(f"NCCL_NVLS_ENABLE={v!r}: this measurement runs NCCL without NVLink multicast; "
                         "unset it or set it to 0")
    ensure_mscclang_importable()
    from mscclang.config import Settings
    from mscclang.errors import MscclangError

    try:
        nvls = Settings(env).enable_nvls
    except MscclangError as e:  # a value that is not a switch
        raise UsageError(str(e)) from None
    if nvls:
        raise UsageError(f"MSCCLANG_ENABLE_NVLS={env.get('MSCCLANG_ENABLE_NVLS')!r}: NVLink multicast "
                         "stays off here; unset it")


# ---------------------------------------------------------------------------------------------
# results and the table

@dataclass
class CellResult:
    """One (size, kind): its time per call and its checks, or why it failed or was skipped."""

    size: int
    kind: str
    us: Optional[float] = None                 # median replay / calls, on the slower rank
    us_ranks: list[float] = field(default_factory=list)     # each rank's median
    replays_us: list[float] = field(default_factory=list)   # rank 0's per-call time of each replay
    plan: Optional[str] = None                 # mscclang: the plan that ran (``nccl``: handed to NCCL)
    eager_err_exact: Optional[float] = None    # max |result - exact sum| of the checked eager call
    eager_err_nccl: Optional[float] = None     # max |result - NCCL's result| of the same data
    eager_bit_exact_nccl: Optional[bool] = None
    graph_check: Optional[str] = None          # how the first replay matched the expected values
    error: Optional[str] = None
    skipped: Optional[str] = None

    @property
    def measured(self) -> bool:
        """Whether the cell was checked and timed."""
        return self.us is not None and self.error is None and self.skipped is None

    @property
    def fell_back(self) -> bool:
        """Whether the library handed this mscclang call to NCCL (never counts as a goal met)."""
        return self.kind in MSCCLANG_KINDS and (self.plan or "").startswith("nccl")

    def to_dict(self) -> dict:
        """A JSON-ready dict (every field)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CellResult":
        """The inverse of :meth:`to_dict` (unknown keys ignored; size and kind required)."""
        if "size" not in d or "kind" not in d:
            raise UsageError(f"a result lacks size or kind: {d}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def _us(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def goal_verdict(res: Optional[CellResult], goal: Optional[float]) -> str:
    """``met`` / ``MISSED`` for one mscclang cell against the size's goal ("-" without a goal)."""
    if goal is None:
        return "-"
    if res is None or not res.measured:
        return "not measured"
    if res.fell_back:
        return "MISSED (handed to NCCL)"
    return "met" if res.us <= goal else "MISSED"


def _cell_text(res: Optional[CellResult]) -> str:
    if res is None:
        return "-"
    if res.measured:
        return _us(res.us)
    if res.skipped:
        return "n/a"
    return "FAILED"


def format_table(results: Sequence[CellResult], meta: Optional[dict] = None,
                 bench: Optional[dict[int, float]] = None) -> str:
    """The markdown report: a header line, the timing table (the four kinds, the two ratios, the
    goal and its verdicts, optionally the bench's figure), the goal count and the checks table."""
    meta = meta or {}
    by = {(r.size, r.kind): r for r in results}
    sizes = sorted({r.size for r in results})
    kinds = [k for k in KINDS if any(r.kind == k for r in results)]
    lines = []
    what = ", ".join(str(x) for x in (meta.get("device"), f"{meta['world_size']} ranks" if meta.get("world_size") else None,
                                      f"torch {meta['torch']}" if meta.get("torch") else None,
                                      f"NCCL {meta['nccl']}" if meta.get("nccl") else None) if x)
    calls, replays = meta.get("calls", CALLS), meta.get("replays", REPLAYS)
    lines.append(f"Allreduce, bfloat16, in place, CUDA graph of {calls} calls, median of {replays} replays, "
                 f"microseconds per call (slower rank){'; ' + what if what else ''}; "
                 f"NCCL_NVLS_ENABLE={meta.get('nccl_nvls_enable', '0')}, ranks aligned: {meta.get('align', 'device')}.")
    lines.append("")
    head = ["size"] + [KIND_LABELS[k] for k in kinds]
    if "symmetric" in kinds and "ordinary" in kinds:
        head.append("ordinary / symmetric")
    if "symmetric" in kinds and "nccl" in kinds:
        head.append("symmetric / NCCL")
    if bench is not None:
        head.append("bench: mscclang")
    head += ["goal", "symmetric vs goal", "ordinary vs goal"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    met = total = 0
    for s in sizes:
        row = [format_size(s)] + [_cell_text(by.get((s, k))) for k in kinds]
        sym, ordi, nccl = (by.get((s, k)) for k in ("symmetric", "ordinary", "nccl"))
        sym_us = sym.us if sym is not None and sym.measured else None
        ord_us = ordi.us if ordi is not None and ordi.measured else None
        nccl_us = nccl.us if nccl is not None and nccl.measured else None
        if "symmetric" in kinds and "ordinary" in kinds:
            row.append(_ratio(ord_us, sym_us))
        if "symmetric" in kinds and "nccl" in kinds:
            row.append(_ratio(sym_us, nccl_us))
        if bench is not None:
            row.append(_us(bench.get(s)))
        goal = GOALS_US.get(s)
        row.append("-" if goal is None else f"<= {goal:g}")
        vs = goal_verdict(sym, goal) if "symmetric" in kinds else "-"
        vo = goal_verdict(ordi, goal) if "ordinary" in kinds else "-"
        row += [vs, vo]
        if goal is not None and "symmetric" in kinds:
            total += 1
            met += vs == "met"
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    if total:
        lines.append(f"Goals met (symmetric tensor): {met} of {total}.")
        lines.append("")
    lines.append("Checks (eager: one call on random data, against the exact sum within "
                 "2·world·2^-8·Σ|x| and against NCCL's result of the same data; graph: the first replay "
                 "on known inputs):")
    lines.append("")
    lines.append("| size | kind | plan | eager: max err vs exact | eager: vs NCCL | graph replay | problem |")
    lines.append("|---|---|---|---|---|---|---|")
    for s in sizes:
        for k in kinds:
            r = by.get((s, k))
            if r is None:
                continue
            if r.eager_err_nccl is None:
                vs_nccl = "-"
            elif r.eager_bit_exact_nccl:
                vs_nccl = "bit-identical"
            else:
                vs_nccl = f"max err {r.eager_err_nccl:.3g}"
            err_exact = "-" if r.eager_err_exact is None else f"{r.eager_err_exact:.3g}"
            problem = r.skipped and f"skipped: {r.skipped}" or r.error or ""
            problem = problem.replace("|", "/").replace("\n", " ")
            lines.append(f"| {format_size(s)} | {k} | {r.plan or '-'} | {err_exact} | {vs_nccl} | "
                         f"{r.graph_check or '-'} | {problem[:300]} |")
    return "\n".join(lines) + "\n"


def exit_code(results: Sequence[CellResult]) -> int:
    """0 when every cell that ran passed (skipped cells do not count), else 1; 1 without any."""
    if not results or not any(r.measured for r in results):
        return EXIT_FAILED
    return EXIT_FAILED if any(r.error for r in results) else EXIT_OK


def save_json(path: str, results: Sequence[CellResult], meta: dict) -> None:
    """Write ``{"format", "meta", "results"}`` to ``path``."""
    doc = {"format": FORMAT, "meta": meta, "results": [r.to_dict() for r in results]}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_json(path: str) -> tuple[list[CellResult], dict]:
    """Read a file :func:`save_json` wrote (:class:`UsageError` when it is not one)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UsageError(f"{path} is not a graph_allreduce result (format {FORMAT})")
    return [CellResult.from_dict(d) for d in doc.get("results", [])], doc.get("meta", {})


def load_bench(path: str) -> dict[int, float]:
    """mscclang's allreduce CUDA-graph figures (bytes -> us) from a ``mscclang bench`` JSON."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    recs = doc.get("results", doc) if isinstance(doc, dict) else doc
    if not isinstance(recs, list):
        raise UsageError(f"{path}: no 'results' list (not a bench.json)")
    out = {}
    for r in recs:
        if (isinstance(r, dict) and r.get("coll") in ("all_reduce", "allreduce") and r.get("impl") == "mscclang"
                and r.get("mode") == "graph" and r.get("us") is not None and not r.get("error")):
            out[int(r["bytes"])] = float(r["us"])
    return out


# ---------------------------------------------------------------------------------------------
# check data (pure functions of torch tensors: also run on the CPU)

def random_input(seed: int, size_index: int, rank: int, numel: int, device: Any) -> Any:
    """Rank ``rank``'s random bf16 input for the size ``size_index`` (any rank can regenerate any
    rank's: a seeded generator on the device type)."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + 7919 * size_index + rank)
    return torch.randn(numel, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def pattern_params(world: int, calls: int) -> tuple[int, int]:
    """``(amplitude, exponent)`` of the graph check's inputs: integers in [-amplitude, amplitude]
    times 2^exponent, so that after ``calls`` in-place allreduces (each multiplies the sum by
    ``world``) the values stay within 2^100, and every partial sum of every call is an integer of
    at most 256 (times a power of two: exact in bf16) at 2, 4 and 8 ranks.
    :class:`UsageError` when ``calls`` is too many for ``world`` to stay in bf16's range."""
    amp = max(1, min(4, 256 // (world * world)))
    top = math.log2(amp * world) + (calls - 1) * math.log2(world)
    exp = min(0, math.floor(_MAX_EXP - top))
    if exp < _MIN_EXP:
        most = 1 + int((_MAX_EXP - _MIN_EXP - math.log2(amp * world)) / math.log2(world))
        raise UsageError(f"--calls {calls} at {world} ranks: the values of {calls} in-place allreduces "
                         f"leave bf16's range; at most {most} calls can be checked at this world size")
    return amp, exp


def graph_input(numel: int, rank: int, world: int, calls: int, device: Any) -> Any:
    """Rank ``rank``'s known input of the graph check (bf16; see :func:`pattern_params`)."""
    import torch

    amp, exp = pattern_params(world, calls)
    i = torch.arange(numel, device=device, dtype=torch.int64)
    v = (i * 7 + 3 * rank) % (2 * amp + 1) - amp
    return (v.to(torch.float64) * 2.0 ** exp).to(torch.bfloat16)


def graph_expected(numel: int, world: int, calls: int, device: Any) -> Any:
    """The exact result (float64) of ``calls`` in-place allreduces of :func:`graph_input`."""
    import torch

    s = sum(graph_input(numel, r, world, calls, device).to(torch.float64) for r in range(world))
    return s * float(world) ** (calls - 1)


def check_graph_result(got: Any, expected: Any, world: int, calls: int) -> str:
    """Compare the first replay's result with :func:`graph_expected`: exactly at a power-of-two
    world size of at most 8 (every partial sum is exact in bf16), else within
    ``calls * world * 2^-8`` relative. Returns how it matched; raises ``AssertionError`` naming the
    first wrong element."""
    import torch

    g = got.to(torch.float64)
    exact = world in (2, 4, 8)
    if exact:
        bad = g != expected
    else:
        bad = ~torch.isfinite(g) | ((g - expected).abs() > calls * world * BF16_U * expected.abs())
    nbad = int(bad.sum())
    if nbad:
        i = int(bad.nonzero()[0])
        raise AssertionError(f"graph replay: {nbad} of {g.numel()} elements wrong; first at {i}: got "
                             f"{float(g[i])!r}, want {float(expected[i])!r}")
    return "exact" if exact else f"within {calls * world * BF16_U:.2g} relative"


def check_eager_result(got: Any, exact: Any, absum: Any, nccl: Any, world: int) -> tuple[float, float, bool]:
    """Check one eager allreduce result against the exact sum (fp32/fp64) and NCCL's result of the
    same data, both within ``2 * world * 2^-8 * sum |x|``. Returns (max error vs exact, max error vs
    NCCL, bit-identical to NCCL); raises ``AssertionError`` naming the first wrong element."""
    import torch

    g = got.to(torch.float64)
    if not bool(torch.isfinite(g).all()):
        i = int((~torch.isfinite(g)).nonzero()[0])
        raise AssertionError(f"eager call: non-finite result at {i} ({float(g[i])})")
    bound = 2 * world * BF16_U * absum.to(torch.float64) + 1e-30
    e_exact = (g - exact.to(torch.float64)).abs()
    e_nccl = (g - nccl.to(torch.float64)).abs()
    for what, e in (("the exact sum", e_exact), ("NCCL's result", e_nccl)):
        bad = e > bound
        nbad = int(bad.sum())
        if nbad:
            i = int(bad.nonzero()[0])
            raise AssertionError(f"eager call: {nbad} of {g.numel()} elements off {what}; first at {i}: got "
                                 f"{float(g[i])!r}, exact {float(exact[i])!r}, NCCL {float(nccl[i])!r}")
    bit = bool(torch.equal(got.view(torch.int16), nccl.view(torch.int16)))
    return float(e_exact.max()), float(e_nccl.max()), bit


# ---------------------------------------------------------------------------------------------
# the measurement (one process per GPU)

class _HostEvent:
    """A host clock with the part of ``torch.cuda.Event``'s interface the timing uses (CPU runs)."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        """Milliseconds from this event to ``end``."""
        return (end.t - self.t) * 1000.0


class _Cell:
    """The buffer and the in-place call of one (size, kind)."""

    def __init__(self, x: Any, op: Callable[[], Any]) -> None:
        self.x = x
        self.op = op


class Measurement:
    """One rank's side of the run: every (size, kind) stage by stage, the ranks agreeing on each
    stage's outcome over a gloo group (a failure on one rank never leaves another waiting in a
    collective of a stage the failed rank skips)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, device: Any) -> None:
        import torch
        import torch.distributed as dist

        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.ctrl = dist.new_group(backend="gloo")
        self.comm: Any = None
        self.comm_error: Optional[str] = None
        self.align_buf = torch.zeros(1, dtype=torch.float32, device=device)
        pattern_params(world, args.calls)   # refuse impossible --calls before anything runs

    # -- agreement ----------------------------------------------------------------------------
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (over gloo)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def barrier(self) -> None:
        """Meet on the host (gloo)."""
        import torch.distributed as dist

        dist.barrier(group=self.ctrl)

    def stage(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on every rank; raise :class:`CellSkipped` when every rank skipped, else
        :class:`CellFailed` naming each failed rank's error when any failed."""
        err: Optional[str] = None
        val: Any = None
        try:
            val = fn()
        except CellSkipped as e:
            err = f"skipped: {e}"
        except Exception as e:  # noqa: BLE001 - reported in the table
            err = f"{type(e).__name__}: {str(e)[:400]}"
            if os.environ.get("GRAPH_ALLREDUCE_DEBUG"):
                traceback.print_exc()
            self._sync_quietly()
        errs = self.gather(err)
        if all(e is not None and e.startswith("skipped: ") for e in errs):
            raise CellSkipped(errs[0][len("skipped: "):])
        groups: dict[str, list[int]] = {}
        for r, e in enumerate(errs):
            if e is not None:
                groups.setdefault(e, []).append(r)
        if groups:
            raise CellFailed(f"{what}: " + "; ".join(
                f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}" for e, rs in groups.items()))
        return val

    def _sync(self) -> None:
        """Wait for this rank's GPU (nothing to wait for on a CPU device: the checks and the
        stages can then be exercised without a GPU)."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sync_quietly(self) -> None:
        try:
            self._sync()
        except Exception:  # noqa: BLE001 - the stage's error is what gets reported
            pass

    def _event(self) -> Any:
        """A timing event: a CUDA event, or a host clock on a CPU device."""
        import torch

        return torch.cuda.Event(enable_timing=True) if self.device.type == "cuda" else _HostEvent()

    # -- set-up -------------------------------------------------------------------------------
    def setup(self) -> None:
        """The mscclang Communicator (when a mscclang kind is measured), as a user builds it."""
        if not any(k in MSCCLANG_KINDS for k in self.args.kinds):
            return

        def make() -> Any:
            import mscclang

            comm = mscclang.Communicator.from_torch()
            if getattr(comm, "backend", None) is None:
                raise RuntimeError("mscclang's GPU runtime is unavailable on this rank (every call would "
                                   "run on NCCL, so mscclang would not be measured)")
            return comm

        try:
            self.comm = self.stage("Communicator.from_torch", make)
        except (CellFailed, CellSkipped) as e:
            self.comm_error = str(e)

    def make_cell(self, kind: str, numel: int) -> _Cell:
        """Allocate the buffer of ``kind`` and set its call up (prepare / rendezvous)."""
        import torch
        import torch.distributed as dist

        bf16 = torch.bfloat16
        if kind in MSCCLANG_KINDS:
            if self.comm is None:
                raise RuntimeError(f"no mscclang communicator ({self.comm_error})")
            comm = self.comm
            if kind == "symmetric":
                x = comm.empty(numel, dtype=bf16)
                if not comm.is_symmetric(x):
                    raise RuntimeError("comm.empty returned a tensor the communicator does not call symmetric")
            else:
                x = torch.empty(numel, dtype=bf16, device=self.device)
            comm.prepare("all_reduce", x)
            return _Cell(x, lambda: comm.all_reduce(x))
        if kind == "nccl":
            x = torch.empty(numel, dtype=bf16, device=self.device)
            return _Cell(x, lambda: dist.all_reduce(x))
        if kind == "symm":
            try:
                import torch.distributed._symmetric_memory as symm_mem

                two_shot = torch.ops.symm_mem.two_shot_all_reduce_
            except (ImportError, AttributeError, RuntimeError) as e:
                raise CellSkipped(f"torch {torch.__version__} has no SymmetricMemory two-shot allreduce ({e})") from None
            group = dist.group.WORLD.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:   # needed by older torch; deprecated (a no-op) in newer ones
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        enable(group)
                    except Exception:  # noqa: BLE001 - newer torch enables every group
                        pass
            x = symm_mem.empty(numel, dtype=bf16, device=self.device)
            symm_mem.rendezvous(x, group)
            return _Cell(x, lambda: two_shot(x, "sum", group))
        raise UsageError(f"unknown kind {kind!r}")

    # -- stages -------------------------------------------------------------------------------
    def eager_check(self, cell: _Cell, data: dict, res: CellResult) -> None:
        """One eager call on this size's random data, checked (:func:`check_eager_result`)."""
        cell.x.copy_(data["x"])
        self._sync()
        self.barrier()
        cell.op()
        self._sync()
        if res.kind in MSCCLANG_KINDS:
            last = getattr(self.comm, "last", None)
            res.plan = last.label() if last is not None and hasattr(last, "label") else None
        res.eager_err_exact, res.eager_err_nccl, res.eager_bit_exact_nccl = check_eager_result(
            cell.x, data["exact"], data["absum"], data["nccl"], self.world)

    def capture(self, cell: _Cell) -> Any:
        """``--calls`` in-place calls in one CUDA graph (captured on a side stream)."""
        import torch

        self._sync()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                for _ in range(self.args.calls):
                    cell.op()
        torch.cuda.current_stream(self.device).wait_stream(s)
        self._sync()
        return g

    def replay_check(self, cell: _Cell, graph: Any, data: dict, res: CellResult) -> None:
        """Replay the graph once on the known inputs and check the result exactly."""
        cell.x.copy_(data["pattern"])
        self._sync()
        self.barrier()
        graph.replay()
        self._sync()
        res.graph_check = check_graph_result(cell.x, data["expected"], self.world, self.args.calls)

    def time_replays(self, cell: _Cell, graph: Any, data: dict) -> list[float]:
        """Microseconds per call of each of ``--replays`` timed replays (CUDA events); the known
        inputs are restored before each replay, outside the timed region."""
        import torch.distributed as dist

        times = []
        for _ in range(self.args.replays):
            cell.x.copy_(data["pattern"])
            self._sync()
            self.barrier()
            if self.args.align == "device":
                dist.all_reduce(self.align_buf)   # the GPUs leave this together; the events follow it
            a, b = self._event(), self._event()
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0 / self.args.calls)
        return times

    def size_data(self, index: int, nbytes: int) -> dict:
        """This size's check data: this rank's random input, the exact sum and sum of magnitudes
        of every rank's input, NCCL's result, the graph check's input and expected result."""
        import torch
        import torch.distributed as dist

        numel, dev, n = nbytes // 2, self.device, self.world
        x = random_input(self.args.seed, index, self.rank, numel, dev)
        exact = torch.zeros(numel, dtype=torch.float64, device=dev)
        absum = torch.zeros(numel, dtype=torch.float64, device=dev)
        for r in range(n):
            xr = x if r == self.rank else random_input(self.args.seed, index, r, numel, dev)
            exact += xr.to(torch.float64)
            absum += xr.to(torch.float64).abs()
            del xr
        nccl = x.clone()
        dist.all_reduce(nccl)
        self._sync()
        return {"x": x, "exact": exact, "absum": absum, "nccl": nccl,
                "pattern": graph_input(numel, self.rank, n, self.args.calls, dev),
                "expected": graph_expected(numel, n, self.args.calls, dev)}

    def run_cell(self, kind: str, nbytes: int, data: dict) -> CellResult:
        """Set up, check eagerly, capture, check the first replay, time: one (size, kind)."""
        res = CellResult(nbytes, kind)
        cell = graph = None
        try:
            cell = self.stage("set-up", lambda: self.make_cell(kind, nbytes // 2))
            self.stage("eager check", lambda: self.eager_check(cell, data, res))
            graph = self.stage("capture", lambda: self.capture(cell))
            self.stage("first replay check", lambda: self.replay_check(cell, graph, data, res))
            times = self.stage("timed replays", lambda: self.time_replays(cell, graph, data))
            meds = self.gather(statistics.median(times))
            res.us_ranks = [round(m, 3) for m in meds]
            res.us = round(max(meds), 3)
            res.replays_us = [round(t, 3) for t in self.gather(times)[0]]
        except CellSkipped as e:
            res.skipped = str(e)
        except CellFailed as e:
            res.error = str(e)
            if kind in MSCCLANG_KINDS and self.comm is not None:
                try:
                    self.comm.reset()   # every rank got the same CellFailed: all reset
                except Exception:  # noqa: BLE001
                    pass
        finally:
            cell = graph = None   # the graph and the buffers go before the next cell
            self._sync_quietly()
        return res

    def meta(self) -> dict:
        """The run's circumstances (device, versions, method)."""
        import torch

        cuda = self.device.type == "cuda"
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001
            nccl = None
        from mscclang.config import settings

        try:
            import mscclang

            version = getattr(mscclang, "__version__", None)
        except Exception:  # noqa: BLE001
            version = None
        return {"device": torch.cuda.get_device_name(self.device) if cuda else str(self.device),
                "world_size": self.world,
                "torch": torch.__version__, "nccl": nccl, "mscclang": version,
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "calls": self.args.calls,
                "replays": self.args.replays, "align": self.args.align, "seed": self.args.seed,
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                "sizes": list(self.args.sizes), "kinds": list(self.args.kinds),
                "tuning": settings.tuning, "specialize": settings.specialize}

    def run(self) -> int:
        """Every size and kind; rank 0 prints progress, the table and writes ``--json``. Returns
        the exit status (the same on every rank)."""
        import torch

        log = (lambda m: print(m, file=sys.stderr, flush=True)) if self.rank == 0 else (lambda m: None)
        self.setup()
        results: list[CellResult] = []
        for index, nbytes in enumerate(self.args.sizes):
            try:
                data = self.stage("check data", lambda: self.size_data(index, nbytes))
            except (CellFailed, CellSkipped) as e:
                for kind in self.args.kinds:
                    results.append(CellResult(nbytes, kind, error=str(e)))
                continue
            for kind in self.args.kinds:
                r = self.run_cell(kind, nbytes, data)
                results.append(r)
                state = (f"{r.us:.2f} us/call" if r.measured else
                         f"skipped: {r.skipped}" if r.skipped else f"FAILED: {r.error}")
                log(f"graph_allreduce: {format_size(nbytes):>5s} {kind:9s} {state}"
                    f"{'  [' + r.plan + ']' if r.plan else ''}")
            del data
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        code = exit_code(results)
        if self.rank == 0:
            meta = self.meta()
            bench = load_bench(self.args.bench_json) if self.args.bench_json else None
            print(format_table(results, meta, bench), flush=True)
            if self.args.json:
                save_json(self.args.json, results, meta)
                log(f"graph_allreduce: wrote {self.args.json}")
        return code


def run_rank(args: argparse.Namespace, rank: int, world: int, local_rank: int) -> int:
    """One rank: join the NCCL process group (env:// rendezvous), measure, return the status."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                            timeout=datetime.timedelta(seconds=300))
    m = Measurement(args, rank, world, device)
    code = m.run()
    m.barrier()
    torch.cuda.synchronize(device)
    return code


def _leave(code: int) -> None:
    """Flush and end the process at once: destroying a process group after CUDA-graph capture
    has hung at exit on H200 machines; the results are already printed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawned(index: int, args: argparse.Namespace, world: int) -> None:
    """``torch.multiprocessing`` entry point of one spawned rank (the parent set MASTER_*)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent handles Ctrl-C
    os.environ.update(RANK=str(index), WORLD_SIZE=str(world), LOCAL_RANK=str(index),
                      LOCAL_WORLD_SIZE=str(world))
    code = EXIT_FAILED
    try:
        code = run_rank(args, index, world, index)
    except BaseException as e:  # noqa: BLE001 - say what happened, then leave with status 1
        print(f"graph_allreduce: rank {index}: {type(e).__name__}: {e}", file=sys.stderr)
        if os.environ.get("GRAPH_ALLREDUCE_DEBUG"):
            traceback.print_exc()
    _leave(code)


def ensure_mscclang_importable() -> None:
    """Make ``import mscclang`` work: the checkout this script lies in (its parent folder goes
    first on ``sys.path``, which spawned ranks inherit, so the script runs the library of its own
    version), or else the installed package. :class:`UsageError` when neither has it."""
    root = Path(__file__).resolve().parent.parent
    if (root / "mscclang" / "__init__.py").is_file() and "mscclang" not in sys.modules:
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
            importlib.invalidate_caches()
    if importlib.util.find_spec("mscclang") is not None:
        return
    raise UsageError("mscclang is not importable: install it (python3 -m pip install -e . in the repository)")


def gpu_count() -> int:
    """Visible CUDA GPUs (0 without CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def under_torchrun(environ: Optional[dict] = None) -> bool:
    """Whether a launcher (torchrun) started this process as one rank."""
    env = os.environ if environ is None else environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def skip_reason() -> Optional[str]:
    """Why this machine cannot run the measurement at all (None when it can): fewer than two
    CUDA GPUs."""
    have = gpu_count()
    if have < 2:
        return (f"needs at least 2 CUDA GPUs (one process per GPU); this machine has {have}. "
                "Nothing was measured.")
    return None


def spawn(args: argparse.Namespace, world: int) -> int:
    """Start ``world`` ranks with torch.multiprocessing; their exit status (1 if one crashed or
    the timeout passed)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    ctx = mp.start_processes(_spawned, args=(args, world), nprocs=world, join=False, start_method="spawn")
    deadline = time.time() + args.timeout
    try:
        while not ctx.join(timeout=2):
            if time.time() > deadline:
                print(f"graph_allreduce: still running after {args.timeout:.0f} s (--timeout): stopped",
                      file=sys.stderr)
                _stop(ctx)
                return EXIT_FAILED
    except mp.ProcessExitedException as e:   # a rank left with a non-zero status: stop the others
        _stop(ctx)
        code = getattr(e, "exit_code", None)
        if code == EXIT_FAILED:
            return EXIT_FAILED   # the ranks said why
        print(f"graph_allreduce: a rank ended abnormally: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return EXIT_FAILED
    except mp.ProcessRaisedException as e:
        _stop(ctx)
        print(f"graph_allreduce: a rank failed: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        _stop(ctx)
        print("graph_allreduce: interrupted", file=sys.stderr)
        return 130
    return EXIT_OK


def _stop(ctx: Any) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(timeout=10)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (see the module docstring); returns the exit status."""
    args = parse_args(argv)
    try:
        if args.from_json:
            results, meta = load_json(args.from_json)
            bench = load_bench(args.bench_json) if args.bench_json else None
            print(format_table(results, meta, bench), end="")
            return exit_code(results)
        if args.bench_json:
            load_bench(args.bench_json)   # a bad file is refused before anything runs
        nvlink_multicast_guard()
        if any(k in MSCCLANG_KINDS for k in args.kinds):
            ensure_mscclang_importable()
        if under_torchrun():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local = int(os.environ["LOCAL_RANK"])
            why = skip_reason()
            if why is not None:
                if rank == 0:
                    print(f"graph_allreduce: skipped: {why}", file=sys.stderr)
                return EXIT_SKIPPED
            if world < 2:
                raise UsageError(f"WORLD_SIZE={world}: an allreduce needs at least 2 ranks")
            if local >= gpu_count():
                raise UsageError(f"LOCAL_RANK={local} but only {gpu_count()} GPUs are visible")
            pattern_params(world, args.calls)
            try:
                code = run_rank(args, rank, world, local)
            except Exception as e:  # noqa: BLE001 - one line, then status 1
                print(f"graph_allreduce: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
                code = EXIT_FAILED
            _leave(code)
        why = skip_reason()
        if why is not None:
            print(f"graph_allreduce: skipped: {why}", file=sys.stderr)
            return EXIT_SKIPPED
        have = gpu_count()
        world = args.nproc or have
        if world > have:
            raise UsageError(f"--nproc {world}: only {have} GPUs are visible")
        pattern_params(world, args.calls)
        return spawn(args, world)
    except UsageError as e:
        print(f"graph_allreduce: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
