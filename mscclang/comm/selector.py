"""The selector: which plan variant runs a call, by (collective, world size, bytes, dtype).

The tuning table names candidates per size range; the catalog says which variants exist. The
selector turns a call into an ordered list of :class:`Choice` (plan variants, possibly ending with
torch.distributed); the communicator takes the first one it can run (e.g. a zero-copy plan only
on symmetric buffers). Without a rule for the call, a built-in heuristic orders the catalog's
variants whose size range holds the message: LL plans first up to 256 KiB, Simple plans above.
Plans that use port channels are never chosen by the heuristic: they run only where a tuning rule
names them (``mscclang tune`` measures them like every other variant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mscclang.comm.catalog import Catalog, PlanVariant
from mscclang.comm.names import dtype_name, plan_collective
from mscclang.comm.tuning import Rule, TuningTable

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


class Selector:
    """Maps calls to ordered choices; results are memoised per (collective, n, bytes, dtype)."""

    def __init__(self, table: TuningTable, catalog: Catalog) -> None:
        self.table = table
        self.catalog = catalog
        self._memo: dict[tuple, list[Choice]] = {}

    def choices(self, collective: str, world_size: int, nbytes: int, dtype: object) -> list[Choice]:
        """Ordered choices for a call; the list ends with torch.distributed when the rule names
        it, and is empty when no plan can run the call at all (the caller falls back)."""
        coll = plan_collective(collective)
        dt = dtype_name(dtype)
        key = (coll, world_size, nbytes, dt)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        rule = self.table.rule_for(coll, world_size, dt, nbytes)
        out = self._from_rule(rule, coll, world_size, nbytes) if rule else []
        if not out:
            # no rule, or none of its plans exists here: heuristic over the catalog
            out = self.heuristic(coll, world_size, nbytes)
        self._memo[key] = out
        return out

    def extra_choices(self, collective: str, world_size: int, nbytes: int, dtype: object) -> list[Choice]:
        """The catalog's other variants for a call, in heuristic order: those :meth:`choices`
        does not list. The communicator tries them only when nothing :meth:`choices` lists can
        run the call (e.g. every named variant is missing, or only torch.distributed is left and
        the fallback is disabled)."""
        listed = {v.key for c in self.choices(collective, world_size, nbytes, dtype) for v in c.variants}
        return [c for c in self.heuristic(plan_collective(collective), world_size, nbytes)
                if c.variants and c.variants[0].key not in listed]

    def _from_rule(self, rule: Rule, coll: str, n: int, nbytes: int) -> list[Choice]:
        out: list[Choice] = []
        where = f"rule {coll} n={rule.world_size} <= {rule.max_bytes}"
        for cand in rule.candidates:
            if cand.is_nccl:
                out.append(Choice((), None, f"{where}: nccl"))
                continue
            vs = [v for v in self.catalog.find_all(cand.plan, coll, n, cand.instances, cand.threads)
                  if v.fits(nbytes)]
            if vs:
                out.append(Choice(tuple(vs), cand.packet_type, f"{where}: {cand.label()}"))
        return out

    def heuristic(self, coll: str, n: int, nbytes: int) -> list[Choice]:
        """Every catalog variant of ``coll`` on ``n`` ranks whose size range holds ``nbytes``,
        except those that use port channels (opt-in through a tuning rule): LL plans first up
        to :data:`LL_THRESHOLD`, Simple plans first above; among them more instances first for
        large messages, fewer for small ones."""
        variants = [v for v in self.catalog.matching(coll, n)
                    if v.fits(nbytes) and not v.uses_port_channels()]
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


def select_fused(catalog: Catalog, ranks: int, shape: FusedShape) -> Optional[PlanVariant]:
    """The catalog's fused plan for ``shape`` on ``ranks`` ranks, or None: a two-shot above
    :data:`FUSED_ONESHOT_MAX_BYTES`, else a one-shot (both run any row count: the two-shot's
    chunks are whole rows, ``ceil(rows / ranks)`` per rank). Variants must match in place, FP8
    (their norms' ``quant``) and ranks, and hold the size in their range (the shipped one-shot:
    up to 1 MiB; the two-shot: any size); a two-shot whose chunks are not rows runs only when the
    rows split evenly into chunks of whole rows."""
    from mscclang.plan.collectives import collective
    from mscclang.sim.fused import plan_quantises

    found: dict[str, PlanVariant] = {}
    for v in catalog:
        if not collective(v.collective).fused or v.ranks != ranks or v.inplace != shape.inplace or not v.fits(shape.nbytes):
            continue
        kind = "twoshot" if "twoshot" in v.algorithm else "oneshot"
        if kind not in found and plan_quantises(v.load()) == shape.quant:
            found[kind] = v
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
