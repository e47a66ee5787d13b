"""Postcondition checks: numeric (against a float64 reference with an error bound derived from
the reduction order) and symbolic (which input chunks reached each output element, how often)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.layout import Layout
from mscclang.plan.models import BufferKind
from mscclang.sim.dtypes import is_float, unit_roundoff
from mscclang.sim.report import Problem


def random_inputs(n: int, nbytes: int, dt: np.dtype, seed: int) -> list[np.ndarray]:
    """Random inputs, one per rank: floats in [-1, 1) (exactly representable), small integers."""
    rng = np.random.default_rng(seed)
    ne = nbytes // dt.itemsize
    out = []
    for _ in range(n):
        if is_float(dt):
            x = rng.uniform(-1.0, 1.0, ne).astype(np.float32).astype(dt)
        elif dt == np.dtype(np.uint8):
            x = rng.integers(0, 256, ne).astype(dt)
        else:
            x = rng.integers(-1000, 1000, ne).astype(dt)
        out.append(x)
    return out


def _ref_reduce(vals: list[np.ndarray], op: str, dt: np.dtype) -> np.ndarray:
    if is_float(dt):
        arr = np.stack([v.astype(np.float64) for v in vals])
    else:
        arr = np.stack([v.astype(np.int64) for v in vals])
    if op == "sum":
        r = arr.sum(axis=0)
    elif op == "min":
        r = arr.min(axis=0)
    else:
        r = arr.max(axis=0)
    if not is_float(dt):
        r = r.astype(dt)  # wraps like the kernel
    return r


def check_numeric(spec: CollectiveSpec, layouts: list[Layout], inputs: list[np.ndarray],
                  outputs: list[np.ndarray], dt: np.dtype, op: str, launch: int,
                  limit: int = 4) -> list[Problem]:
    """Compare every constrained output chunk with the collective's definition."""
    probs: list[Problem] = []
    isz = dt.itemsize
    u = unit_roundoff(dt)
    for (r, c), exp in spec.postcondition().items():
        lay = layouts[r]
        off, ln = lay.span(BufferKind.output, c)
        if ln == 0:
            continue
        got_b = outputs[r][off: off + ln]
        srcs = []
        for (p, k) in exp.sources:
            soff, sln = layouts[p].span(BufferKind.input, k)
            srcs.append(inputs[p].view(np.uint8)[soff: soff + min(sln, ln)])
        if any(s.shape[0] != ln for s in srcs):
            probs.append(Problem("postcondition", f"rank {r} output chunk {c}: source chunks have other lengths than the output chunk ({ln} bytes)"))
            continue
        ne = ln // isz
        got = np.ascontiguousarray(got_b[: ne * isz]).view(dt)
        if not exp.reduced:
            if not np.array_equal(got_b, srcs[0]):
                bad = int(np.argmax(got_b != srcs[0]))
                p, k = exp.sources[0]
                probs.append(Problem("postcondition",
                                     f"rank {r} output chunk {c} (launch {launch}) should be a copy of rank {p} "
                                     f"input chunk {k} but differs first at byte {bad} of the chunk"))
        else:
            vals = [np.ascontiguousarray(s[: ne * isz]).view(dt) for s in srcs]
            ref = _ref_reduce(vals, op, dt)
            if is_float(dt):
                g = got.astype(np.float64)
                if op == "sum":
                    bound = len(vals) * u * np.sum(np.abs(np.stack([v.astype(np.float64) for v in vals])), axis=0) + 1e-30
                else:
                    bound = np.zeros_like(ref)
                with np.errstate(invalid="ignore"):
                    bad_mask = ~(np.abs(g - ref) <= bound)
            else:
                bad_mask = got != ref
            if bad_mask.any():
                i = int(np.argmax(bad_mask))
                probs.append(Problem("postcondition",
                                     f"rank {r} output chunk {c} (launch {launch}) is not the {op} of "
                                     f"{len(vals)} input chunks {list(exp.sources)}: element {i} is {got[i]!r}, "
                                     f"expected {ref[i]!r}"))
        if len(probs) >= limit:
            break
    return probs


def check_symbolic(spec: CollectiveSpec, layouts: list[Layout], shadows: list[np.ndarray],
                   input_chunks: int, launch: int, limit: int = 4) -> list[Problem]:
    """Each output word's multiset of (rank, input chunk) contributions against the spec."""
    probs: list[Problem] = []
    for (r, c), exp in spec.postcondition().items():
        off, ln = layouts[r].span(BufferKind.output, c)
        if ln == 0:
            continue
        rows = shadows[r][off // 4: (off + ln) // 4]
        want = np.zeros(rows.shape[1], dtype=np.int16)
        for (p, k) in exp.sources:
            want[p * input_chunks + k] += 1
        badrows = np.nonzero((rows != want).any(axis=1))[0]
        if badrows.size == 0:
            continue
        row = rows[badrows[0]]
        missing = [divmod(int(s), input_chunks) for s in np.nonzero((want > 0) & (row < want))[0]]
        extra = [(divmod(int(s), input_chunks), int(row[s])) for s in np.nonzero(row > want)[0]]
        parts = []
        if missing:
            parts.append("missing " + ", ".join(f"(rank {p}, chunk {k})" for p, k in missing[:6]))
        doubled = [(pk, cnt) for pk, cnt in extra if want[pk[0] * input_chunks + pk[1]] > 0]
        foreign = [(pk, cnt) for pk, cnt in extra if want[pk[0] * input_chunks + pk[1]] == 0]
        if doubled:
            parts.append("counted more than once " + ", ".join(f"(rank {p}, chunk {k}) x{n}" for (p, k), n in doubled[:6]))
        if foreign:
            parts.append("unexpected " + ", ".join(f"(rank {p}, chunk {k}) x{n}" for (p, k), n in foreign[:6]))
        kind = "reduction of" if exp.reduced else "copy of"
        probs.append(Problem("symbolic",
                             f"rank {r} output chunk {c} (launch {launch}, byte {off + 4 * int(badrows[0])}) "
                             f"should hold the {kind} {list(exp.sources)[:8]}{'...' if len(exp.sources) > 8 else ''}: "
                             + "; ".join(parts),
                             details={"rank": r, "chunk": c, "missing": missing,
                                      "extra": [pk for pk, _ in extra]}))
        if len(probs) >= limit:
            break
    return probs
