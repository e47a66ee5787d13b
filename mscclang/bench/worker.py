"""One benchmark process per GPU: every (collective, size, implementation) cell is checked
against a reference on fresh random data, then timed eagerly and as a CUDA graph.

Implementations: ``mscclang`` (the :class:`~mscclang.comm.Communicator` on symmetric buffers
from ``comm.empty``), ``ordinary`` (the same calls on plain ``torch.empty`` tensors, prepared with
``comm.prepare`` and captured inside ``comm.graph_capture()``, as an application whose tensors come
from torch's allocator runs them), ``nccl`` (torch.distributed, NCCL_NVLS_ENABLE=0), ``symm`` (torch
SymmetricMemory two-shot allreduce, bf16 only). Ranks agree on every step through a gloo group
(a failure on one rank never leaves another waiting in a collective), rank 0 streams one JSON
line per record into ``<out>/results.jsonl``, and nothing new starts after the deadline.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from mscclang.bench.cells import Cell, gen_input
from mscclang.bench.families import family_of
from mscclang.bench.results import ORDINARY, Record
from mscclang.bench.sizes import format_size
from mscclang.config import nccl_env, settings
from mscclang.plan.collectives import collective as collective_row
from mscclang.plan.collectives import plan_collective
from mscclang.plan.dtypes import DTYPES, torch_dtype

MiB = 1 << 20
_T = TypeVar("_T")
#: unit roundoff per dtype (for the reduction error bound)
_UNIT = {d.name: d.unit_roundoff for d in DTYPES if d.gpu}


@dataclass
class BenchConfig:
    """What one bench run measures (picklable: handed to every worker)."""

    colls: list[str]
    sizes: list[int]
    impls: list[str]
    modes: list[str]
    dtype: str = "bfloat16"
    out_dir: str = "."
    deadline: float = 0.0           # time.time() after which no new cell starts
    blocks: int = 5                 # timed blocks per cell (median over blocks)
    warmup: int = 5
    iters_scale: float = 1.0        # scales the calls per timed block
    seed: int = 1
    tuning: Optional[str] = None
    runtime_timeout_s: float = 10.0
    max_failures: int = 2           # consecutive failures of an (impl, coll) before skipping it
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def iters_for(nbytes: int, scale: float = 1.0) -> int:
    """Calls per timed block: many for small messages (so the ranks' start skew spreads over
    many calls of a graph), few for large ones."""
    base = 200 if nbytes <= 256 * 1024 else 50 if nbytes <= MiB else 20 if nbytes <= 16 * MiB else 10 if nbytes <= 256 * MiB else 5
    return max(2, int(base * scale))


def median(times: list[float]) -> float:
    """The middle of ``times`` (sorted), the upper one of the two middles for an even count."""
    return sorted(times)[len(times) // 2]


def error_text(e: BaseException) -> str:
    """How a failure is recorded: the exception's type and the start of its message."""
    return f"{type(e).__name__}: {str(e)[:300]}"


def _debug_traceback() -> None:
    """Print the current exception's traceback when ``MSCCLANG_BENCH_DEBUG`` is set."""
    if settings.bench_debug:
        traceback.print_exc()


def is_mscclang(impl: str) -> bool:
    """Whether ``impl`` runs through the mscclang Communicator (``mscclang``, an ``--algos`` column
    ``mscclang:NAME``, or ``ordinary``)."""
    return impl == ORDINARY or impl.startswith("mscclang")


def _sync(device: Any) -> None:
    """Wait for the device (no-op on the CPU, so the checks can be tested without a GPU)."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def timed_blocks(launch: Callable[[], None], calls: int, blocks: int, barrier: Callable[[], None]) -> list[float]:
    """Microseconds per call of ``blocks`` timed runs of ``launch()`` (which makes ``calls``
    calls: one graph replay of that many, say), each run started after ``barrier()`` and a device
    synchronisation, timed by CUDA events on the current stream."""
    import torch

    times = []
    for _ in range(blocks):
        barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / calls)
    return times


def capture_graph(body: Callable[[], _T]) -> tuple[Any, _T]:
    """Capture ``body()`` into a new CUDA graph on a side stream (after a device sync) and
    return the graph and what ``body`` returned; do first-time setup before, never inside."""
    import torch

    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            result = body()
    torch.cuda.current_stream().wait_stream(s)
    return g, result


class BenchWorker:
    """The loop of one rank (see the module docstring)."""

    def __init__(self, rank: int, world: int, cfg: BenchConfig) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world, self.cfg = rank, world, cfg
        self.device = torch.device("cuda", torch.cuda.current_device())   # run_rank bound it
        self.dtype = torch_dtype(cfg.dtype)
        self.esz = torch.empty((), dtype=self.dtype).element_size()
        self.ctrl = dist.new_group(backend="gloo")
        self.out_dir = Path(cfg.out_dir)
        self.comm: Any = None
        self.comm_error: Optional[str] = None
        self.sym: tuple[Any, Any] = (None, None)
        self.failures: dict[tuple[str, str], int] = {}
        self.seed = cfg.seed

    # -- agreement over gloo --------------------------------------------------------------------
    def agree(self, ok: bool) -> bool:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctrl)
        return bool(t.item())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.ctrl)

    def in_time(self) -> bool:
        """Whether every rank is still before the deadline (so a new measurement may start)."""
        return self.agree(time.time() < self.cfg.deadline)

    # -- output ---------------------------------------------------------------------------------
    def append_line(self, filename: str, obj: dict) -> None:
        """Rank 0 appends ``obj`` as one JSON line to ``<out>/<filename>``."""
        if self.rank == 0:
            with open(self.out_dir / filename, "a") as f:
                f.write(json.dumps(obj) + "\n")

    def emit(self, rec: Record) -> None:
        if self.rank != 0:
            return
        self.append_line("results.jsonl", rec.to_dict())
        if rec.measured:
            line = (f"{rec.coll:14s} {rec.impl:8s} {rec.mode:5s} {format_size(rec.bytes):>5s} "
                    f"{rec.us:10.2f} us {rec.busbw or 0:7.1f} GB/s  {rec.plan or ''}")
        else:
            line = (f"{rec.coll:14s} {rec.impl:8s} {rec.mode:5s} {format_size(rec.bytes):>5s} "
                    f"{'FAIL' if not (rec.error or '').startswith('skipped') else 'skip':>10s}     "
                    f"{(rec.error or '')[:160]}")
        print(line, flush=True)

    def write_meta(self) -> None:
        if self.rank != 0:
            return
        import torch

        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001
            nccl = None
        meta = {
            "device": torch.cuda.get_device_name(self.device), "world_size": self.world,
            "ranks_per_gpu": settings.ranks_per_gpu,
            "dtype": self.cfg.dtype, "torch": torch.__version__, "nccl": nccl,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": self.cfg.to_dict(),
            "mscclang": {"error": self.comm_error,
                         "tuning": None if self.comm is None else self.comm.tuning.source},
        }
        (self.out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        import torch

        wants_comm = (any(is_mscclang(i) for i in self.cfg.impls)
                      or any(family_of(c) is not None for c in self.cfg.colls))
        if wants_comm:
            try:
                self.comm = self.make_comm()
                if self.comm.backend is None:
                    self.comm_error = self.comm._runtime_error
                if any(i.startswith("mscclang") for i in self.cfg.impls):   # symmetric pools
                    maxb = max(self.cfg.sizes)
                    self.sym = (self.comm.empty(maxb, dtype=torch.uint8), self.comm.empty(maxb, dtype=torch.uint8))
            except Exception as e:  # noqa: BLE001 - recorded per cell
                self.comm_error = f"{type(e).__name__}: {e}"
                self.comm = None
        ok = self.agree(self.comm is not None or not wants_comm)
        if not ok and self.comm_error is None:
            self.comm_error = "the communicator failed on another rank"
        if not ok:
            self.comm = None
        self.symm_group = None
        if "symm" in self.cfg.impls:
            try:
                import torch.distributed as dist
                import torch.distributed._symmetric_memory as symm_mem

                self.symm_group = dist.group.WORLD.group_name
                if hasattr(symm_mem, "enable_symm_mem_for_group"):
                    try:
                        symm_mem.enable_symm_mem_for_group(self.symm_group)
                    except Exception:  # noqa: BLE001 - newer torch enables it by default
                        pass
            except Exception as e:  # noqa: BLE001
                self.symm_error = f"{type(e).__name__}: {e}"
                self.symm_group = None
        self.write_meta()

    def make_comm(self) -> Any:
        """This rank's Communicator over torch.distributed's default group."""
        from mscclang.comm import Communicator

        return Communicator.from_torch(tuning=self.cfg.tuning,
                                       runtime_options={"timeout_s": self.cfg.runtime_timeout_s})

    # -- cells ----------------------------------------------------------------------------------
    def make_cell(self, coll: str, impl: str, nbytes: int, prepare: bool = True) -> Cell:
        """The buffers and the call of ``(coll, impl, nbytes)``. For the mscclang
        implementations the call is set up with ``comm.prepare`` first unless ``prepare`` is
        False (the first-call measurement times an unprepared call)."""
        import torch
        import torch.distributed as dist

        fam = family_of(coll)
        if fam is not None:
            return fam.make_cell(self, coll, impl, nbytes)
        n, esz, dt, dev = self.world, self.esz, self.dtype, self.device
        total = nbytes // esz
        row = collective_row(coll)
        in_e, out_e = row.call_bytes(n, total)   # element counts of a message of total elements
        single = row.blocks(n) == (1, 1)
        kw = {"root": 0} if row.rooted else {}
        if impl.startswith("mscclang"):
            self._force_algo(coll, impl.partition(":")[2] or None)
            impl = "mscclang"
        elif impl == ORDINARY:
            self._force_algo(coll, None)
        if impl in ("mscclang", ORDINARY):
            if self.comm is None:
                raise RuntimeError(f"no mscclang communicator: {self.comm_error}")
            comm = self.comm
            if impl == "mscclang":
                a, b = self.sym
                a, b = a[:nbytes], b[:nbytes]
                capture = None
            else:   # plain tensors from torch's allocator, as an application has them
                a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                b = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                capture = comm.graph_capture
            # prepare() first, as a user would before timing or capturing a call: it also builds
            # the specialised kernel of sizes the 'auto' policy specialises only when hot, so the
            # checked call runs the kernel that is then timed
            setup = comm.prepare if prepare else (lambda *_args, **_kw: None)
            i, o = a[:in_e * esz].view(dt), b[:out_e * esz].view(dt)
            run = getattr(comm, coll)
            if single:   # all_reduce, broadcast: one tensor
                setup(coll, i, **kw)
                return Cell(lambda: run(i, **kw), i, i, in_e, capture=capture)
            setup(coll, i, o)
            return Cell(lambda: run(i, out=o), i, o, in_e, capture=capture)
        elif impl == "nccl" and row.torch is not None:
            i = torch.empty(in_e, dtype=dt, device=dev)
            o = i if single else torch.empty(out_e, dtype=dt, device=dev)
            fn = getattr(dist, row.torch)   # the torch.distributed function of the collective
            if single:
                src = {"src": 0} if row.rooted else {}
                return Cell(lambda: fn(i, **src), i, i, in_e)
            return Cell(lambda: fn(o, i), i, o, in_e)
        elif impl == "symm":
            import torch.distributed._symmetric_memory as symm_mem

            if self.symm_group is None:
                raise RuntimeError(f"torch SymmetricMemory unavailable: {getattr(self, 'symm_error', '?')}")
            buf = symm_mem.empty(total, dtype=dt, device=dev)
            symm_mem.rendezvous(buf, self.symm_group)
            g = self.symm_group
            cell = Cell(lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", g), buf, buf, total)
            cell.plan = "two_shot_all_reduce_"
            return cell
        raise RuntimeError(f"no {impl} implementation of {coll}")

    def _algo_serves(self, algo: str, coll: str) -> bool:
        """Whether the library has a plan of ``algo`` (an algorithm or plan variant name) for
        ``coll`` at this world size; without a communicator, let the cell report why."""
        if self.comm is None:
            return True

        return bool(self.comm.catalog.find_all(algo, plan_collective(coll), self.world))

    def _force_algo(self, coll: str, algo: Optional[str]) -> None:
        """Make the communicator run ``algo`` for ``coll`` (an ``mscclang:NAME`` column), or
        restore the tuning of the plain ``mscclang`` column. Every rank does the same."""
        if self.comm is None:
            return
        if getattr(self, "_tuning0", None) is None:
            self._tuning0 = self.comm.tuning
        if algo is None:
            if getattr(self, "_forced", None) is not None:
                self.comm.use_tuning(self._tuning0)
                self._forced = None
            return

        self.comm.use_tuning({"format": "mscclang.tuning/1", "source": f"bench: {algo} forced",
                              "plans_dir": None,
                              "rules": [{"collective": plan_collective(coll), "candidates": [{"plan": algo}]}]})
        self._forced = algo

    def check(self, coll: str, cell: Cell) -> tuple[bool, str]:
        """Fresh random inputs, poisoned output, one call, compare with the reference."""
        fam = family_of(coll)
        seed = self.fill(cell) if fam is None else fam.fill(self, cell)
        _sync(self.device)
        self.barrier()
        cell.op()
        _sync(self.device)
        return self.compare(coll, cell, seed) if fam is None else fam.compare(self, cell, seed)

    def fill(self, cell: Cell) -> int:
        """Fresh random inputs (a new seed, the same on every rank) and a poisoned output for
        one checked call of ``cell``; returns the seed :meth:`compare` needs."""
        dt = self.dtype
        self.seed += 1
        cell.inp.copy_(gen_input(self.seed, self.rank, cell.numel_in, dt, self.device))
        if cell.out.data_ptr() != cell.inp.data_ptr():
            cell.out.fill_(float("nan") if dt.is_floating_point else -(2 ** 31))
        return self.seed

    def compare(self, coll: str, cell: Cell, seed: int) -> tuple[bool, str]:
        """Whether ``cell``'s output is the reference result of ``coll`` on the inputs of ``seed``
        (sums within the any-order error bound, copies exact); (ok, what is wrong)."""
        import torch

        n, r, dt, dev = self.world, self.rank, self.dtype, self.device
        out = cell.out.reshape(-1)
        if dt.is_floating_point and not bool(torch.isfinite(out.float() if out.element_size() == 1 else out).all()):
            return False, "non-finite values in the output (unwritten or wrong)"
        from mscclang.plan.reference import output_blocks

        # where each output element comes from: the collective's definition (broadcast: root 0)
        for blk in output_blocks(plan_collective(coll), n, r, cell.numel_in, 0):
            got = out[blk.out_start:blk.out_start + blk.length]
            lo, hi = blk.in_start, blk.in_start + blk.length
            if blk.reduced:  # a sum in any order: within the error bound (int32: exact)
                acc = absacc = None
                for p in blk.sources:
                    x = gen_input(seed, p, cell.numel_in, dt, dev)[lo:hi]
                    xf = x.double() if dt == torch.int32 else x.float()
                    acc = xf.clone() if acc is None else acc + xf
                    absacc = xf.abs() if absacc is None else absacc + xf.abs()
                    del x, xf
                err = (got.double() if dt == torch.int32 else got.float()) - acc
                if dt == torch.int32:
                    bad = err != 0
                else:
                    bound = 2 * n * _UNIT[self.cfg.dtype] * absacc + _UNIT[self.cfg.dtype] * acc.abs() + 1e-30
                    bad = err.abs() > bound
                nbad = int(bad.sum())
                if nbad:
                    i = int(bad.nonzero()[0])
                    return False, (f"{nbad} of {blk.length} elements wrong; first at {lo + i}: got "
                                   f"{float(got[i])}, want {float(acc[i])}")
                continue
            (p,) = blk.sources  # copies must be exact
            want = gen_input(seed, p, cell.numel_in, dt, dev)[lo:hi]
            if out.element_size() == 1:   # fp8: torch compares no fp8 tensors; their bytes then
                got, want = got.view(torch.uint8), want.view(torch.uint8)
            if not torch.equal(got, want):
                nbad = int((got != want).sum())
                return False, f"block from rank {p}: {nbad} of {got.numel()} elements differ"
        return True, ""

    def check_call(self, coll: str, impl: str, nbytes: int,
                   prepare: Optional[Callable[[], None]] = None) -> tuple[bool, str, Optional[Cell]]:
        """``prepare()`` (if given), build the cell of ``(coll, impl, nbytes)`` and :meth:`check`
        one call. An exception fails the check with :func:`error_text`. For ``mscclang`` the
        cell's plan becomes the label of the plan that ran. Returns (ok, error, cell or None)."""
        cell: Optional[Cell] = None
        try:
            if prepare is not None:
                prepare()
            cell = self.make_cell(coll, impl, nbytes)
            ok, err = self.check(coll, cell)
            if is_mscclang(impl) and self.comm is not None and self.comm.last is not None:
                cell.plan = self.comm.last.label()
        except Exception as e:  # noqa: BLE001 - recorded
            ok, err = False, error_text(e)
            _debug_traceback()
        return ok, err, cell

    def _timed_blocks(self, launch: Callable[[], None], iters: int) -> list[float]:
        """Microseconds per call of ``cfg.blocks`` timed runs of ``launch`` (``iters`` calls
        each), every block started together on all ranks."""
        return timed_blocks(launch, iters, self.cfg.blocks, self.barrier)

    def time_eager(self, cell: Cell, iters: int) -> list[float]:
        """Per-call times of ``iters`` eager calls a block, after ``cfg.warmup`` calls."""
        import torch

        for _ in range(self.cfg.warmup):
            cell.op()
        torch.cuda.synchronize()

        def calls() -> None:
            for _ in range(iters):
                cell.op()

        return self._timed_blocks(calls, iters)

    def time_graph(self, cell: Cell, iters: int) -> list[float]:
        """Per-call times of one CUDA graph of ``iters`` calls, replayed once a block."""
        import torch

        for _ in range(2):
            cell.op()  # first-time setup (registration, device plans) never inside a capture

        def calls() -> None:
            for _ in range(iters):
                cell.op()

        if cell.capture is not None:
            with cell.capture():
                g, _ = capture_graph(calls)
        else:
            g, _ = capture_graph(calls)
        cell.keep.append(g)
        g.replay()
        torch.cuda.synchronize()
        return self._timed_blocks(g.replay, iters)

    def last_kernel(self, impl: str) -> str:
        """'spec' or 'interpreter': the kernel the timed calls of a mscclang cell launched (for a
        graph, the one captured), '' when unknown (NCCL, torch, no executor)."""
        if not is_mscclang(impl) or self.comm is None:
            return ""
        last = getattr(self.comm, "last", None)
        if last is None or getattr(last, "mode", "") == "nccl":
            return ""
        be = self.comm.backend
        return "" if be is None else str(getattr(be.launch, "last_kernel", "") or "")

    def measure(self, cell: Cell, mode: str, iters: int) -> list[float]:
        """Sorted per-call times of ``cell`` in ``mode`` ("graph" or "eager")."""
        times = self.time_graph(cell, iters) if mode == "graph" else self.time_eager(cell, iters)
        return sorted(times)

    def _after_failure(self, impl: str) -> None:
        if is_mscclang(impl) and self.comm is not None:
            try:
                self.comm.reset()
            except Exception:  # noqa: BLE001 - nothing more to do
                pass

    def run_cell(self, coll: str, impl: str, nbytes: int) -> None:
        import torch

        algo = impl.partition(":")[2]
        if algo and not self._algo_serves(algo, coll):
            return   # an --algos column of another collective: no cell (the table omits it)
        fam = family_of(coll)
        modes = list(fam.modes) if fam is not None and fam.modes else self.cfg.modes
        base = dict(coll=coll, impl=impl, bytes=nbytes, dtype=self.cfg.dtype)

        def emit_all(error: str, plan: Optional[str] = None) -> None:
            for m in modes:
                self.emit(Record(mode=m, error=error, plan=plan, **base))

        key = (impl, coll)
        if self.failures.get(key, 0) >= self.cfg.max_failures:
            emit_all("skipped: earlier failures of this collective")
            return
        if not self.in_time():
            emit_all("skipped: time limit")
            return
        n = self.world
        if fam is None and ((nbytes // self.esz) % n or nbytes % self.esz):
            emit_all(f"skipped: {nbytes} bytes do not split into {n} ranks of {self.cfg.dtype}")
            return
        ok, err, cell = self.check_call(coll, impl, nbytes)
        if not self.agree(ok):
            if err.startswith("RuntimeError: skipped:"):   # not run here, for a reason (no FlashInfer ...)
                emit_all(err.partition("RuntimeError: ")[2])
                return
            self.failures[key] = self.failures.get(key, 0) + 1
            self._after_failure(impl)
            emit_all(f"check failed: {err or 'wrong result or error on another rank'}",
                     plan=cell.plan if cell else None)
            return
        self.failures[key] = 0
        if cell is None:  # pragma: no cover - agree(ok) implies a cell
            return
        iters = iters_for(nbytes, self.cfg.iters_scale)
        factor = collective_row(coll if fam is None else fam.bus).busbw(n)
        for m in modes:
            times: list[float] = []
            err = ""
            try:
                times = (self.measure(cell, m, iters) if fam is None or fam.measure is None
                         else fam.measure(self, cell, m, iters))
                ok = all(math.isfinite(t) and t > 0 for t in times)
            except Exception as e:  # noqa: BLE001
                ok, err = False, error_text(e)
                torch.cuda.synchronize()
            if not self.agree(ok):
                self._after_failure(impl)
                self.emit(Record(mode=m, error=f"{m} run failed: {err or 'on another rank'}", plan=cell.plan, **base))
                continue
            med = median(times)
            kernel = self.last_kernel(impl)
            self.emit(Record(mode=m, us=round(med, 3), busbw=round(nbytes / med / 1e3 * factor, 2), ok=True,
                             plan=cell.plan or None, iters=iters, us_min=round(times[0], 3),
                             us_max=round(times[-1], 3), extra=self._extra(kernel, m, times), **base))
        cell.keep.clear()
        del cell

    @staticmethod
    def _extra(kernel: str, mode: str, times: list[float]) -> dict:
        """A record's extra fields: the kernel that ran, and for a ``chain`` mode (per-period
        samples, sorted) the 99th percentile."""
        extra: dict = {"kernel": kernel} if kernel else {}
        if mode == "chain" and times:
            extra["p99"] = round(times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)], 3)
        return extra

    def run(self) -> None:
        import torch

        self.setup()
        for coll in self.cfg.colls:
            fam = family_of(coll)
            sizes = self.cfg.sizes if fam is None else fam.sizes(self.cfg, self.esz, self.world)
            impls = self.cfg.impls if fam is None else fam.impls
            for nbytes in sizes:
                for impl in impls:
                    if impl == "symm" and (coll != "all_reduce" or self.cfg.dtype != "bfloat16"):
                        continue
                    self.run_cell(coll, impl, nbytes)
            torch.cuda.empty_cache()


def rank_binding(rank: int, visible: int) -> tuple[int, str]:
    """The GPU rank ``rank`` binds among ``visible`` ones and the backend of the workers' default
    process group: a GPU per rank and NCCL, or, when ``MSCCLANG_RANKS_PER_GPU`` lets ranks share a
    GPU (GPU ``rank // ranks_per_gpu``), gloo, since NCCL refuses two ranks on one GPU."""
    from mscclang.comm.fallback import torch_backend_for
    from mscclang.runtime.workers import device_of_rank

    return device_of_rank(rank, visible, settings.ranks_per_gpu), torch_backend_for("cuda")


def run_rank(worker_cls: type[BenchWorker], rank: int, world: int, cfg: BenchConfig, port: int) -> None:
    """The body of one rank's process: bind the rank's GPU and join the default process group
    (:func:`rank_binding`; NVLink multicast off), run ``worker_cls(rank, world, cfg)``, and leave
    the process (exit status 1 after an error). Ctrl-C is the parent's to handle (it stops the
    workers): ignored here, so no rank prints a traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(nccl_env())
    import torch
    import torch.distributed as dist

    gpu, backend = rank_binding(rank, torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            **({"device_id": torch.device("cuda", gpu)} if backend == "nccl" else {}))
    code = 0
    try:
        w = worker_cls(rank, world, cfg)
        w.run()
        w.barrier()
        torch.cuda.synchronize()
    except BaseException:  # noqa: BLE001 - report, then leave with an error code
        traceback.print_exc()
        code = 1
    # destroy_process_group after CUDA-graph capture has hung at exit on the H200 machine:
    # leave directly (the parent collects the streamed results)
    os._exit(code)


def worker_entry(rank: int, world: int, cfg: BenchConfig, port: int) -> None:
    """``torch.multiprocessing`` entry point of one rank."""
    run_rank(BenchWorker, rank, world, cfg, port)
