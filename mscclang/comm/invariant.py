"""The batch-invariant mode's rules: which plans it runs, and the plans it generates.

In the mode (``MSCCLANG_BATCH_INVARIANT=1``, ``Communicator(batch_invariant=True)`` or the torch
backend's ``BackendOptions(batch_invariant=True)``) a call runs only a plan that keeps the
contract of ``docs/semantics.md``: every reduced element is the canonical rank-order fold, at
every size the plan serves (:func:`keeps_contract`). Where no plan of the catalog keeps it (a
world size without shipped plans, say), the algorithm library's plans for that world size are
built, proven (:func:`prove_promise`) and kept for the life of the process
(:func:`generated_variants`); a call nothing can serve raises :class:`BatchInvariantError`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from mscclang.comm.catalog import PlanVariant
from mscclang.errors import CommError
from mscclang.plan.collectives import collective
from mscclang.plan.models import Plan

__all__ = ["BatchInvariantError", "Generated", "keeps_contract", "prove_promise", "generated_variants"]

log = logging.getLogger("mscclang.comm")

#: thread blocks per rank the generated bandwidth variants aim at (besides one instance each)
GENERATED_BLOCKS = 16

_LOCK = threading.Lock()
_GENERATED: dict[tuple[str, int], "Generated"] = {}


class BatchInvariantError(CommError):
    """A call of the batch-invariant mode that no plan keeping the contract can serve (one
    line: the call, its world size, bytes and dtype, and why); nothing ran."""


@dataclass(frozen=True)
class Generated:
    """The library's plans of one collective on one world size that keep the contract
    (``variants``), those dropped and why (``dropped``), and the seconds building and proving took."""

    variants: tuple[PlanVariant, ...]
    dropped: tuple[str, ...]
    seconds: float


def keeps_contract(plan: Plan) -> bool:
    """Whether the mode may run ``plan``: it promises batch invariance (``batch_invariant``
    true). A plan of a collective that reduces nothing may also leave the promise unsaid (every
    output element is a copy of one input element, whatever the plan, size or batch); a plan
    that denies it never runs."""
    if plan.batch_invariant is not None:
        return plan.batch_invariant
    return not collective(plan.collective).reduces


def prove_promise(plan: Plan) -> Optional[str]:
    """Why ``plan`` does not keep the contract, or None when it does: it must promise it
    (:func:`keeps_contract`) and pass the simulator's symbolic proof. The one place the mode
    proves a plan it generated."""
    if not keeps_contract(plan):
        return "it does not promise batch invariance"
    from mscclang.sim.verify import prove_consistent

    probs = prove_consistent(plan)
    return probs[0].message if probs else None


def _build(info: Any, n: int, instances: int, inplace: bool, params: tuple) -> Plan:
    """One library plan, named as ``plans/`` names its variants."""
    from mscclang.algorithms.generate import variant_stem
    from mscclang.algorithms.registry import Variant

    v = Variant(n, instances, None, inplace, params)
    return info.build(n, instances=instances, name=variant_stem(info, v), **v.kwargs())


def _library_plans(coll: str, n: int, dropped: list[str]) -> list[Plan]:
    """Every plan of the algorithm library for ``coll`` on ``n`` ranks the mode may generate:
    each algorithm without port channels (those run only where a tuning rule names them), in
    each in-place mode and parameter set it ships (every root of a rooted collective), with one
    instance and with as many as fill :data:`GENERATED_BLOCKS` thread blocks where its builder
    takes them (a build the builder refuses goes to ``dropped``, with why)."""
    from mscclang.algorithms import ALGORITHMS
    from mscclang.errors import MscclangError

    out = []
    for info in ALGORITHMS.values():
        if info.collective != coll or info.port_channels or not info.min_ranks <= n <= info.max_ranks:
            continue
        shapes = dict.fromkeys((v.inplace, tuple(p for p in v.params if p[0] != "root")) for v in info.variants)
        roots = range(n) if collective(coll).rooted else (None,)
        for inplace, params in shapes:
            for root in roots:
                ps = params + ((("root", root),) if root is not None else ())
                k = 1
                while k:
                    try:
                        plan = _build(info, n, k, inplace, ps)
                    except MscclangError as e:
                        dropped.append(f"{info.name} on {n} ranks with {k} instance(s): {e}")
                        break
                    out.append(plan)
                    more = GENERATED_BLOCKS // max(plan.max_threadblocks(), 1) if k == 1 else 0
                    k = more if more > 1 else 0
    return out


def generated_variants(coll: str, n: int) -> Generated:
    """The library's plans of ``coll`` on ``n`` ranks that keep the contract, built and proven
    at the first request, then kept for the life of the process (every rank builds the same:
    the library is deterministic)."""
    key = (coll, n)
    with _LOCK:
        got = _GENERATED.get(key)
        if got is None:
            t0 = time.perf_counter()
            keep: list[PlanVariant] = []
            dropped: list[str] = []
            unbuilt: list[str] = []
            for plan in _library_plans(coll, n, unbuilt):
                why = prove_promise(plan)
                if why is None:
                    keep.append(PlanVariant.from_plan(plan))
                else:
                    dropped.append(f"{plan.name}: {why}")
            got = _GENERATED[key] = Generated(tuple(keep), tuple(dropped + unbuilt), time.perf_counter() - t0)
            log.info("mscclang: batch-invariant mode: generated %d plan(s) of %s on %d ranks in %.2f s (%d dropped)",
                     len(keep), coll, n, got.seconds, len(dropped))
    return got


def refusal(what: str, why: str, rank: Optional[int] = None) -> BatchInvariantError:
    """The mode's one-line error for a call (``what``: the collective, world size, bytes and
    dtype) and the reason no plan keeping the contract serves it."""
    who = f"mscclang rank {rank}: " if rank is not None else "mscclang: "
    return BatchInvariantError(f"{who}batch-invariant mode: {what} has no plan that keeps the contract: "
                               + " ".join(why.split()))


def call_words(api: str, n: int, nbytes: int, dtype: Any) -> str:
    """``all_reduce of 4096 bytes (bfloat16) on 5 ranks``: what the mode's error names."""
    return f"{api} of {nbytes} bytes ({dtype}) on {n} ranks"
