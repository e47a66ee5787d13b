"""The warm-up call: every plan the selector can pick, loaded before the first real call.

A plan's first call pays for loading it (its JSON, the device plan, the kernel module, the peers'
channels); a new size of a loaded plan pays for its packing. :func:`warm_up` pays both up front:
for each collective asked for, on ordinary and (where the runtime has them) symmetric tensors,
it runs one real call at every message size where the selector's choice can change (each tuning
rule's and each catalog variant's size bounds, and every power of two between), up to
``max_bytes``. It is a collective: every rank makes the same calls in the same order, the
selector being the same on every rank. The calls run on zeroed scratch tensors, which are dropped
afterwards; staging above the cap is released as after any call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from mscclang.comm.errors import CommError
from mscclang.comm.selector import LL_THRESHOLD
from mscclang.plan.collectives import collective, plan_collective

if TYPE_CHECKING:
    from mscclang.comm.launch import Launch
    from mscclang.comm.planner import Planner

#: the collectives warmed when none are named
DEFAULT_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
#: the largest message warmed by default (bytes)
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class WarmedCall:
    """One call the warm-up ran: its collective (plan name), message bytes, tensor kind
    (``ordinary`` or ``symmetric``), the plan that ran it (None: the torch.distributed fallback),
    how (``direct``, ``copy_in``, ``staged``, ``nccl``) and its host milliseconds."""

    collective: str
    nbytes: int
    buffers: str
    plan: Optional[str]
    mode: str
    ms: float


def message_sizes(planner: "Planner", coll: str, esz: int, max_bytes: int) -> list[int]:
    """The message sizes where the selector's choice for ``coll`` can change, in bytes, ascending:
    the heuristic's LL threshold, each rule's ``max_bytes`` and the byte after it, each catalog variant's ``min_bytes`` and
    ``max_bytes`` and the byte after it (in the batch-invariant mode the generated variants' too),
    and the powers of two, from one element per block up to ``max_bytes``; each rounded up to
    whole elements in every block."""
    n = planner.world_size
    unit = esz * max(collective(coll).blocks(n))
    bounds: set[int] = {LL_THRESHOLD, LL_THRESHOLD + 1}   # the heuristic's LL/Simple switch
    p = unit
    while p <= max_bytes:
        bounds.add(p)
        p *= 2
    sel = planner.selector
    for r in sel.table.rules:
        if r.max_bytes is not None:
            bounds.update((r.max_bytes, r.max_bytes + 1))
    for v in sel.catalog.matching(coll, n) + (sel.generated(coll, n).matching(coll, n) if sel.batch_invariant else []):
        bounds.update((v.min_bytes, v.max_bytes, v.max_bytes + 1))
    sizes = {-(-b // unit) * unit for b in bounds if 0 < b <= max_bytes}
    return sorted(s for s in sizes if s <= max_bytes)


def warm_up(runs: "Launch", collectives: Optional[Iterable[str]] = None, dtype: Any = None,
            max_bytes: int = DEFAULT_MAX_BYTES, symmetric: bool = True) -> list[WarmedCall]:
    """Run the warm-up calls (see the module docstring) through ``runs`` (a communicator's
    :class:`~mscclang.comm.launch.Launch`) and return them, one record
    per call. ``collectives``: API or plan names (default :data:`DEFAULT_COLLECTIVES`);
    ``dtype``: the tensors' dtype (default bfloat16); ``symmetric``: also on symmetric tensors
    (ignored without a runtime that has them). Bad arguments raise
    :class:`~mscclang.errors.CommError` on every rank alike, before any call."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise CommError(f"warm_up: dtype must be a torch.dtype, got {dtype!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise CommError(f"warm_up: max_bytes must be a positive int, got {max_bytes!r}")
    names = list(DEFAULT_COLLECTIVES if collectives is None else
                 ([collectives] if isinstance(collectives, str) else collectives))
    colls = [plan_collective(c) for c in names]
    for c, name in zip(colls, names):
        row = collective(c)
        if row.api is None or row.rooted or row.fused or not row.sized:
            raise CommError(f"warm_up: {name!r} cannot be warmed (it takes a root, a peer or "
                            "more than one tensor); warm it with a call of its own")
    esz = torch.empty((), dtype=dtype).element_size()
    planner, be = runs.planner, runs.engine
    world = planner.world_size
    device = planner.device if planner.device is not None else "cpu"
    kinds = ["ordinary"] + (["symmetric"] if symmetric and be is not None else [])
    plans = {c: message_sizes(planner, c, esz, max_bytes) for c in colls}
    # one pair of scratch tensors per kind, as large as the largest call's sides
    ib = max((collective(c).call_bytes(world, s[-1])[0] for c, s in plans.items() if s), default=0)
    ob = max((collective(c).call_bytes(world, s[-1])[1] for c, s in plans.items() if s), default=0)
    done: list[WarmedCall] = []
    before = set(planner.memo)
    for kind in kinds:
        if kind == "symmetric":   # symmetric staging memory, released (collectively) below
            big_in = be.memory.empty(ib // esz, dtype, staging=True)
            big_out = be.memory.empty(ob // esz, dtype, staging=True)
        else:
            big_in = torch.zeros(ib // esz, dtype=dtype, device=device)
            big_out = torch.zeros(ob // esz, dtype=dtype, device=device)
        for c, sizes in plans.items():
            row = collective(c)
            for nbytes in sizes:
                i, o = row.call_bytes(world, nbytes)
                inp = big_in[:i // esz]
                out = inp if i == o else big_out[:o // esz]   # in place where the API's default is
                t0 = time.perf_counter()
                runs.call(c, inp, out, "sum")
                ms = (time.perf_counter() - t0) * 1e3
                cp = runs.last
                plan = cp.plan.name if cp is not None and cp.plan is not None else None
                done.append(WarmedCall(c, nbytes, kind, plan, cp.mode if cp is not None else "nccl", ms))
        if be is not None:
            be.synchronize()
        # keyed by the scratch's addresses: no later call finds them
        planner.forget([k for k in planner.memo if k not in before])
        if kind == "symmetric":
            be.memory.release([big_in, big_out])
        del big_in, big_out
    return done
