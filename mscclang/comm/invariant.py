"""The batch-invariant mode's rules: which plans it runs, and the plans it generates.

In the mode (``MSCCLANG_BATCH_INVARIANT=1``, ``Communicator(batch_invariant=True)`` or the torch
backend's ``BackendOptions(batch_invariant=True)``) a call runs only a plan that keeps the
contract of ``docs/semantics.md``: every reduced element is the canonical rank-order fold, at
every size the plan serves (:func:`keeps_contract`). Where no plan of the catalog keeps it (a
world size without shipped plans, say), the algorithm library's plans for that world size are
made and kept for the life of the process (:func:`generated_variants`), each proven
(:func:`prove_promise`) before it first runs; a call nothing can serve raises
:class:`~mscclang.comm.errors.BatchInvariantError`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mscclang.comm.catalog import PlanVariant
from mscclang.comm.errors import BatchInvariantError
from mscclang.errors import MscclangError, PlanError
from mscclang.plan.collectives import collective
from mscclang.plan.models import Plan

__all__ = ["Generated", "GeneratedVariant", "keeps_contract", "prove_promise",
           "generated_variants"]

log = logging.getLogger("mscclang.comm")

#: thread blocks per rank the generated bandwidth variants aim at (besides one instance each)
GENERATED_BLOCKS = 16

_LOCK = threading.RLock()
_GENERATED: dict[tuple[str, int], "Generated"] = {}


@dataclass(frozen=True)
class Generated:
    """The library's plans of one collective on one world size the mode may run (``variants``,
    each proven at its first load), those dropped and why (``dropped``), and the seconds making
    them took."""

    variants: tuple[PlanVariant, ...]
    dropped: tuple[str, ...]
    seconds: float


def keeps_contract(promise: Optional[bool], coll: str) -> bool:
    """Whether the mode may run a plan of collective ``coll`` whose ``batch_invariant`` is
    ``promise``: it promises batch invariance. A plan of a collective that reduces nothing may
    also leave the promise unsaid (every output element is a copy of one input element, whatever
    the plan, size or batch); a plan that denies it never runs."""
    return promise if promise is not None else not collective(coll).reduces


def prove_promise(plan: Plan) -> Optional[str]:
    """Why ``plan`` does not keep the contract, or None when it does: it must promise it
    (:func:`keeps_contract`), every rank must get the same bits
    (:func:`mscclang.sim.verify.prove_consistent`) and, for a reduction, every reduced element
    must be the canonical expression at every size
    (:func:`mscclang.sim.verify.prove_batch_invariant`). The one place the mode proves a plan
    it generated."""
    if not keeps_contract(plan.batch_invariant, plan.collective):
        return "it does not promise batch invariance"
    from mscclang.sim.verify import prove_batch_invariant, prove_consistent

    probs = prove_consistent(plan)
    if probs:
        return probs[0].message
    proof = prove_batch_invariant(plan)
    if proof.problems:
        return proof.problems[0].message.splitlines()[0]
    if proof.skipped and not proof.sizes:
        return f"its data moves could not be followed symbolically at sizes {proof.skipped}"
    return None


@dataclass
class GeneratedVariant(PlanVariant):
    """A plan of the algorithm library the mode generated (:func:`generated_variants`): built at
    its first load unless it already was (``make``), and proven there (:func:`prove_promise`); a
    plan that does not keep the contract raises PlanError at that load and every later one, so it
    never runs (alike on every rank: the library and the proof are deterministic)."""

    make: Optional[Callable[[], Plan]] = field(default=None, repr=False, compare=False)
    _refused: Optional[str] = field(default=None, repr=False, compare=False)   # "" once proven

    def load(self) -> Plan:
        with _LOCK:
            if self._refused is None:
                t0 = time.perf_counter()
                try:
                    self._plan = self._plan if self._plan is not None else self.make()  # type: ignore[misc]
                    self._refused = prove_promise(self._plan) or ""
                except MscclangError as e:   # the builder refuses this instance count
                    self._refused = str(e)
                log.info("mscclang: batch-invariant mode: %s built and proven in %.2f s%s", self.key,
                         time.perf_counter() - t0, f": refused, {self._refused}" if self._refused else "")
        if self._refused:
            raise PlanError(self._refused)
        return self._plan  # type: ignore[return-value]


def _variant(info: Any, n: int, k: int, inplace: bool, params: tuple, plan: Optional[Plan] = None) -> GeneratedVariant:
    """The variant of library algorithm ``info`` on ``n`` ranks with ``k`` instances, named as
    ``plans/`` names its variants (``plan``: already built)."""
    from mscclang.algorithms.generate import variant_stem
    from mscclang.algorithms.registry import Variant

    v = Variant(n, k, None, inplace, params)
    key = variant_stem(info, v)
    return GeneratedVariant(
        key=key, algorithm=info.name, collective=info.collective, ranks=n, protocol=info.protocol,
        buffer_mode=info.buffer_mode, inplace=inplace, min_bytes=info.min_message_size,
        max_bytes=info.max_message_size, instances=k, threads=info.default_threads, root=dict(params).get("root"),
        port_channels=False, _plan=plan, make=lambda: info.build(n, instances=k, name=key, **v.kwargs()))


def _library_variants(coll: str, n: int, dropped: list[str]) -> list[GeneratedVariant]:
    """Every plan of the algorithm library for ``coll`` on ``n`` ranks the mode may generate:
    each algorithm without port channels (those run only where a tuning rule names them), in
    each in-place mode and parameter set it ships (every root of a rooted collective), with one
    instance (built now: one that does not promise batch invariance goes to ``dropped``, with
    why) and with as many as fill :data:`GENERATED_BLOCKS` thread blocks (built at first load)."""
    from mscclang.algorithms import ALGORITHMS

    out = []
    for info in ALGORITHMS.values():
        if info.collective != coll or info.port_channels or not info.min_ranks <= n <= info.max_ranks:
            continue
        shapes = dict.fromkeys((v.inplace, tuple(p for p in v.params if p[0] != "root")) for v in info.variants)
        roots = range(n) if collective(coll).rooted else (None,)
        for inplace, params in shapes:
            for ps in (params + ((("root", r),) if r is not None else ()) for r in roots):
                one = _variant(info, n, 1, inplace, ps)
                try:
                    plan = one.make()  # type: ignore[misc]
                except MscclangError as e:
                    dropped.append(f"{one.key}: {e}")
                    continue
                if not keeps_contract(plan.batch_invariant, plan.collective):
                    dropped.append(f"{one.key}: it does not promise batch invariance")
                    continue
                one._plan = plan
                more = GENERATED_BLOCKS // max(plan.max_threadblocks(), 1)
                out += [one] + ([_variant(info, n, more, inplace, ps)] if more > 1 else [])
    return out


def generated_variants(coll: str, n: int) -> Generated:
    """The library's plans of ``coll`` on ``n`` ranks that may keep the contract, made at the
    first request and kept for the life of the process (every rank makes the same: the library
    is deterministic). Each is proven at its first load (:class:`GeneratedVariant`), so a call
    pays the proof of the plans it runs only."""
    key = (coll, n)
    with _LOCK:
        got = _GENERATED.get(key)
        if got is None:
            t0 = time.perf_counter()
            dropped: list[str] = []
            variants = _library_variants(coll, n, dropped)
            got = _GENERATED[key] = Generated(tuple(variants), tuple(dropped), time.perf_counter() - t0)
            log.info("mscclang: batch-invariant mode: %d plan(s) of %s on %d ranks made in %.2f s (%d dropped)",
                     len(variants), coll, n, got.seconds, len(dropped))
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
