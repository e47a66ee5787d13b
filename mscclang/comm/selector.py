"""The selector: which plan variant runs a :class:`~mscclang.plan.call.Call`, by its collective,
world size, message bytes and dtype.

The tuning table names candidates per size range; the catalog says which variants exist. The
selector turns a call into an ordered list of :class:`Choice` (plan variants, possibly ending with
torch.distributed); the communicator takes the first one it can run (e.g. a zero-copy plan only
on symmetric buffers). Without a rule for the call, a built-in heuristic orders the catalog's
variants whose size range holds the message: LL plans first up to 256 KiB, Simple plans above.
Plans that use port channels are never chosen by the heuristic: they run only where a tuning rule
names them (``mscclang tune`` measures them like every other variant).

In the batch-invariant mode (:mod:`mscclang.comm.invariant`) only plans that keep the contract are
listed: a tuning rule's plan without the promise, and its torch.distributed candidate, are
refused (logged once) in favour of the heuristic's plans that keep it; where the catalog has none
for the call, the algorithm library's plans for the world size are generated (each proven before
it first runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from mscclang.comm.catalog import Catalog, PlanVariant
from mscclang.comm.invariant import GeneratedVariant, generated_variants, keeps_contract
from mscclang.comm.tuning import Rule, TuningTable
from mscclang.plan.call import Call

log = logging.getLogger("mscclang.comm")

#: below or at this size the heuristic prefers LL (packet) plans
LL_THRESHOLD = 256 * 1024


@dataclass(frozen=True)
class Choice:
    """One way to run a call: plan variants of one candidate (``variants``, e.g. the in-place
    and out-of-place plans of an algorithm; the communicator takes the one that fits the call
    best), or torch.distributed (no variants)."""

    variants: tuple[PlanVariant, ...] = ()
    packet_type: Optional[str] = None
    why: str = ""

    @property
    def is_nccl(self) -> bool:
        return not self.variants

    @property
    def variant(self) -> Optional[PlanVariant]:
        """The first variant (``None`` for torch.distributed)."""
        return self.variants[0] if self.variants else None

    def label(self) -> str:
        if not self.variants:
            return "nccl"
        lab = self.variants[0].label()
        return f"{lab} {self.packet_type}" if self.packet_type else lab


def keeps(v: PlanVariant) -> bool:
    """Whether the batch-invariant mode may run variant ``v``
    (:func:`~mscclang.comm.invariant.keeps_contract` of the index's promise, else the plan's; a
    plan that cannot be loaded may not; a generated one is proven when loaded)."""
    from mscclang.errors import MscclangError

    if isinstance(v, GeneratedVariant):
        return True   # proven at its first load, which refuses it otherwise
    try:   # the index's word, else the plan's
        return keeps_contract(v.batch_invariant if v.batch_invariant is not None else v.load().batch_invariant,
                              v.collective)
    except (MscclangError, OSError):
        return False


class Selector:
    """Maps calls to ordered choices; results are memoised per (collective, n, bytes, dtype).
    ``batch_invariant``: list only plans that keep the contract (module docstring)."""

    def __init__(self, table: TuningTable, catalog: Catalog, batch_invariant: bool = False) -> None:
        self.table = table
        self.catalog = catalog
        self.batch_invariant = batch_invariant
        self._memo: dict[tuple, list[Choice]] = {}
        self._refused: set[str] = set()
        self._generated: dict[tuple[str, int], Catalog] = {}

    def choices(self, call: Call) -> list[Choice]:
        """Ordered choices for ``call`` (by its collective, world size, message bytes and dtype;
        :func:`~mscclang.plan.call.message_call` makes one of a size); the list ends with
        torch.distributed when the rule names it, and is empty when no plan can run the call at
        all (the caller falls back)."""
        coll, world_size, nbytes, dt = call.collective.name, call.world, call.message_bytes, call.dtype.name
        key = (coll, world_size, nbytes, dt)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        rule = self.table.rule_for(coll, world_size, dt, nbytes)
        out = self._from_rule(rule, coll, world_size, nbytes) if rule else []
        if not out:
            # no rule, or none of its plans exists here: heuristic over the catalog
            out = self.heuristic(coll, world_size, nbytes)
        if not out and self.batch_invariant:
            out = self.heuristic(coll, world_size, nbytes, self.generated(coll, world_size))
        self._memo[key] = out
        return out

    def extra_choices(self, call: Call) -> list[Choice]:
        """The catalog's other variants for a call, in heuristic order: those :meth:`choices`
        does not list (in the batch-invariant mode, then the generated plans' too). The
        communicator tries them only when nothing :meth:`choices` lists can run the call (e.g.
        every named variant is missing, or only torch.distributed is left and the fallback is
        disabled)."""
        listed = {v.key for c in self.choices(call) for v in c.variants}
        coll, world_size, nbytes = call.collective.name, call.world, call.message_bytes
        more = self.heuristic(coll, world_size, nbytes)
        if self.batch_invariant:
            more += self.heuristic(coll, world_size, nbytes, self.generated(coll, world_size))
        return [c for c in more if c.variants and c.variants[0].key not in listed]

    def generated(self, coll: str, n: int) -> Catalog:
        """The algorithm library's plans of ``coll`` on ``n`` ranks that keep the contract
        (:func:`~mscclang.comm.invariant.generated_variants`: made once per process, each proven
        at its first load), which the batch-invariant mode runs where the catalog has none for a
        call. Kept apart from the catalog, so the choice of a call the catalog serves never
        depends on what was generated before it."""
        got = self._generated.get((coll, n))
        if got is None:
            got = self._generated[(coll, n)] = Catalog(generated_variants(coll, n).variants)
        return got

    def explain(self, call: Call) -> str:
        """Why the batch-invariant mode lists no plan for ``call`` (its error's reason)."""
        coll, n, nbytes = call.collective.name, call.world, call.message_bytes
        fit = [v for v in self.catalog.matching(coll, n) if v.fits(nbytes)]
        gen = generated_variants(coll, n)
        if not fit and not gen.variants and not gen.dropped:
            return f"neither the plans nor the algorithm library have {coll} on {n} ranks"
        bad = [f"{v.key}: it does not promise batch invariance" for v in fit if not keeps(v)] + list(gen.dropped)
        more = f", and {len(bad) - 1} more" if len(bad) > 1 else ""
        return f"no plan holding {nbytes} bytes keeps it" + (f" ({bad[0]}{more})" if bad else "")

    def _refuse(self, where: str, label: str) -> None:
        """Log once that the batch-invariant mode refuses a tuning rule's candidate."""
        if label not in self._refused:
            self._refused.add(label)
            log.warning("mscclang: batch-invariant mode refuses %s (%s): it does not keep the batch-invariance "
                        "contract", label, where)

    def _from_rule(self, rule: Rule, coll: str, n: int, nbytes: int) -> list[Choice]:
        out: list[Choice] = []
        where = f"rule {coll} n={rule.world_size} <= {rule.max_bytes}"
        for cand in rule.candidates:
            if cand.is_nccl:
                if self.batch_invariant:
                    self._refuse(where, "torch.distributed")
                else:
                    out.append(Choice((), None, f"{where}: nccl"))
                continue
            vs = [v for v in self.catalog.find_all(cand.plan, coll, n, cand.instances, cand.threads)
                  if v.fits(nbytes)]
            if self.batch_invariant and vs and not any(map(keeps, vs)):
                self._refuse(where, cand.label())
            vs = [v for v in vs if not self.batch_invariant or keeps(v)]
            if vs:
                out.append(Choice(tuple(vs), cand.packet_type, f"{where}: {cand.label()}"))
        return out

    def heuristic(self, coll: str, n: int, nbytes: int, catalog: Optional[Catalog] = None) -> list[Choice]:
        """Every catalog variant of ``coll`` on ``n`` ranks whose size range holds ``nbytes``,
        except those that use port channels (opt-in through a tuning rule) and, in the
        batch-invariant mode, those that do not keep the contract: LL plans first up to
        :data:`LL_THRESHOLD`, Simple plans first above; among them more instances first for
        large messages, fewer for small ones. ``catalog``: another catalog than the selector's."""
        variants = [v for v in (self.catalog if catalog is None else catalog).matching(coll, n)
                    if v.fits(nbytes) and not v.uses_port_channels() and (not self.batch_invariant or keeps(v))]
        small = nbytes <= LL_THRESHOLD

        def rank(v: PlanVariant) -> tuple:
            proto_first = 0 if (v.protocol == "LL") == small else 1
            # larger messages: more instances first; small: fewer
            inst = v.instances or 1
            return (proto_first, inst if small else -inst, v.key)

        return [Choice((v,), None, "heuristic") for v in sorted(variants, key=rank)]


#: the fused one-shot's largest message (bytes of x): above it the two-shot runs when it can
FUSED_ONESHOT_MAX_BYTES = 256 * 1024


@dataclass(frozen=True)
class FusedShape:
    """What choosing a fused (``allreduce_add_rms_norm``) plan depends on: the call's rows of
    ``hidden`` elements, its bytes, whether the norm writes FP8 and whether it is in place."""

    rows: int
    hidden: int
    nbytes: int
    quant: bool
    inplace: bool


def select_fused(catalog: Catalog, ranks: int, shape: FusedShape, invariant: bool = False) -> Optional[PlanVariant]:
    """The catalog's fused plan for ``shape`` on ``ranks`` ranks, or None: a two-shot above
    :data:`FUSED_ONESHOT_MAX_BYTES`, else a one-shot (both run any row count: the two-shot's
    chunks are whole rows, ``ceil(rows / ranks)`` per rank). Variants must match in place, FP8
    (their norms' ``quant``) and ranks, and hold the size in their range (the shipped one-shot:
    up to 1 MiB; the two-shot: any size); a two-shot whose chunks are not rows runs only when the
    rows split evenly into chunks of whole rows. ``invariant``: only plans that keep the
    batch-invariance contract (:func:`keeps`)."""
    from mscclang.errors import MscclangError
    from mscclang.plan.collectives import collective
    from mscclang.sim.fused import plan_quantises

    found: dict[str, PlanVariant] = {}
    for v in catalog:
        if not collective(v.collective).fused or v.ranks != ranks or v.inplace != shape.inplace or not v.fits(shape.nbytes):
            continue
        if invariant and not keeps(v):
            continue
        kind = "twoshot" if "twoshot" in v.algorithm else "oneshot"
        try:
            if kind not in found and plan_quantises(v.load()) == shape.quant:
                found[kind] = v
        except MscclangError:   # a generated plan its proof refused, say: never chosen
            continue
    two = found.get("twoshot")
    even = False
    if two is not None:   # a two-shot's norm covers its rank's chunk: the chunks must be whole rows
        tp = two.load()
        per = shape.rows // ranks * shape.hidden   # elements per rank when the rows split evenly
        act = shape.nbytes // max(shape.rows * shape.hidden, 1)
        even = tp.chunk_unit == "row" or (shape.rows % ranks == 0 and all(
            per * isz % tp.buffer_alignment == 0 for isz in (act, 1 if shape.quant else act)))
    if two is not None and even and (shape.nbytes > FUSED_ONESHOT_MAX_BYTES or "oneshot" not in found):
        return found["twoshot"]
    return found.get("oneshot")
