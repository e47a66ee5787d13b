"""``mscclang tune``, the CPU half: which candidates to measure, compiling and verifying extra
variants, and turning measurements into a tuning table.

A *candidate* is (algorithm, instances, threads): every shipped or compiled variant with those
(its in-place and out-of-place plans) runs under it, as in a tuning rule. Extra variants (more
instances or other thread counts than ``plans/`` ships) are compiled with the algorithm library
and verified in the simulator before anything times them; only verified ones are measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from mscclang.comm.catalog import Catalog, PlanVariant, infer_buffer_mode
from mscclang.comm.tuning import NCCL, TUNING_FORMAT, Candidate, Rule, TuningTable
from mscclang.plan.collectives import collective as collective_row
from mscclang.plan.io import save_plan


@dataclass(frozen=True)
class CandidateKey:
    """What a tuning rule names: an algorithm with instances and threads (or NCCL)."""

    algorithm: str
    instances: Optional[int] = None
    threads: Optional[int] = None

    @property
    def is_nccl(self) -> bool:
        return self.algorithm == NCCL

    def candidate(self, us: Optional[float] = None) -> Candidate:
        if self.is_nccl:
            return Candidate(plan=NCCL, us=us)
        return Candidate(plan=self.algorithm, instances=self.instances, threads=self.threads, us=us)

    def label(self) -> str:
        return self.candidate().label()


NCCL_KEY = CandidateKey(NCCL)


def candidates(catalog: Catalog, collective: str, world_size: int) -> list[CandidateKey]:
    """Every (algorithm, instances, threads) the catalog has for a collective and world size."""
    seen: dict[CandidateKey, None] = {}
    for v in catalog.matching(collective, world_size):
        if collective_row(collective).rooted and (v.root or 0) != 0:
            continue
        seen.setdefault(CandidateKey(v.algorithm, v.instances, v.threads), None)
    return list(seen)


@dataclass
class ExtraResult:
    """Extra variants compiled for tuning: those that verified, and why the others did not."""

    added: list[PlanVariant] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)


def compile_extra(catalog: Catalog, collectives: Sequence[str], world_size: int,
                  instances: Sequence[int], threads: Sequence[int], out_dir: Optional[Path],
                  verify: bool = True, progress: Optional[Callable[[Iterable], Iterable]] = None,
                  schedules: int = 2) -> ExtraResult:
    """Compile the library's algorithms of ``collectives`` for every instances x threads not in
    the catalog yet, verify each in the simulator, add the verified ones to ``catalog`` and save
    them into ``out_dir`` (when given). ``threads`` empty: each algorithm's default."""
    from mscclang.algorithms import ALGORITHMS

    jobs = []
    for info in ALGORITHMS.values():
        if info.collective not in collectives or not info.min_ranks <= world_size <= info.max_ranks:
            continue
        params = dict(info.variants[0].params) if info.variants else {}
        for inst in instances:
            for thr in (threads or [info.default_threads]):
                have = catalog.find_all(info.name, info.collective, world_size, inst, thr)
                if have:
                    continue
                for ip in info.inplace_modes:
                    jobs.append((info, inst, thr, ip, params))
    res = ExtraResult()
    it: Iterable = jobs if progress is None else progress(jobs)
    for info, inst, thr, ip, params in it:
        key = f"{info.name}.r{world_size}.i{inst}.t{thr}" + (".inplace" if ip else "")
        try:
            plan = info.build(world_size, instances=inst, num_threads_per_block=thr, inplace=ip, **params)
        except Exception as e:  # noqa: BLE001 - a variant the program cannot build
            res.rejected.append((key, f"build: {type(e).__name__}: {e}"))
            continue
        if verify:
            from mscclang.sim import default_sizes
            from mscclang.sim import verify as sim_verify

            try:
                rep = sim_verify(plan, sizes=default_sizes(plan)[:1], schedules=schedules,
                                 dtypes=("float16",), launches=2)
            except Exception as e:  # noqa: BLE001
                res.rejected.append((key, f"verify: {type(e).__name__}: {e}"))
                continue
            if not rep.ok:
                first = rep.problems[0] if rep.problems else None
                res.rejected.append((key, f"verify: {first}"))
                continue
        path = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"{key}.json"
            save_plan(plan, path)
        v = PlanVariant(key=key, algorithm=info.name, collective=info.collective, ranks=world_size,
                        protocol=plan.protocol, buffer_mode=infer_buffer_mode(plan), inplace=plan.inplace,
                        min_bytes=plan.min_message_size, max_bytes=plan.max_message_size,
                        instances=inst, threads=thr, root=plan.root, path=path, _plan=plan)
        catalog.add(v)
        res.added.append(v)
    return res


def build_table(measured: dict[str, dict[int, dict[CandidateKey, float]]], world_size: int,
                machine: Optional[str] = None, source: Optional[str] = None,
                plans_dir: Optional[str] = None, keep: int = 4) -> TuningTable:
    """Tuning table from measurements ``measured[collective][bytes][candidate] = us``.

    For each size the candidates are ordered by time; consecutive sizes with the same winner
    share one rule whose ``max_bytes`` is the largest of them (the last rule has no limit). A
    rule lists up to ``keep`` candidates: the winner first, then the fastest others at the rule's
    largest size, so a call that cannot run the winner (e.g. a zero-copy plan on ordinary
    tensors) takes the next best. NCCL appears where it was measured, like any candidate.
    """
    rules: list[Rule] = []
    for coll in sorted(measured):
        by_size = measured[coll]
        sizes = sorted(s for s in by_size if by_size[s])
        runs: list[tuple[CandidateKey, list[int]]] = []
        for s in sizes:
            best = min(by_size[s].items(), key=lambda kv: (kv[1], kv[0].label()))[0]
            if runs and runs[-1][0] == best:
                runs[-1][1].append(s)
            else:
                runs.append((best, [s]))
        for i, (winner, ss) in enumerate(runs):
            last = ss[-1]
            ranked = sorted(by_size[last].items(), key=lambda kv: (kv[1], kv[0].label()))
            order = [winner] + [k for k, _ in ranked if k != winner]
            cands = [k.candidate(round(by_size[last].get(k, 0.0), 3) or None) for k in order[:keep]]
            rules.append(Rule(collective=coll, world_size=world_size, dtypes=["*"],
                              max_bytes=None if i == len(runs) - 1 else last, candidates=cands))
    return TuningTable(format=TUNING_FORMAT, machine=machine, source=source, plans_dir=plans_dir,
                       rules=rules)


@dataclass(frozen=True)
class Predicted:
    """A candidate's predicted time for one collective and size (the cost model, no GPU);
    ``inplace``: the in-place variant (the same label has an out-of-place one)."""

    label: str
    us: float
    inplace: bool = False


def rank_by_prediction(catalog: Catalog, collective: str, world_size: int, input_bytes: int,
                       topology: str = "nvlink") -> list[Predicted]:
    """The catalog's variants that take ``input_bytes`` of ``collective``, fastest first by the
    cost model (:mod:`mscclang.sim.cost`). A ranking to choose what to measure: a tuning file is
    only ever written from measurements."""
    from mscclang.errors import PlanError
    from mscclang.sim import cost

    n = world_size
    row = collective_row(collective)
    out_bytes = row.output_elems(n, input_bytes)
    msg = row.message_bytes(input_bytes, out_bytes)
    topo = cost.load_topology(topology, n)
    ranked = []
    for v in catalog.matching(collective, n):
        if (row.rooted and (v.root or 0) != 0) or not v.fits(msg):
            continue
        try:
            ranked.append(Predicted(v.label(), cost.predict(v.load(), input_bytes, out_bytes, topo).total_us,
                                    v.inplace))
        except PlanError:
            continue
    return sorted(ranked, key=lambda p: p.us)
