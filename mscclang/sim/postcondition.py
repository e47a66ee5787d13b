"""Postcondition checks: numeric (against a float64 reference with an error bound derived from
the reduction order) and symbolic (which input chunks reached each output element, how often)."""

from __future__ import annotations


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


def _fmt(x: object) -> str:
    try:
        return f"{float(x):.6g}"  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(x)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for every (s, l), vectorised."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    rep = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
    return rep + np.arange(total)


class _Gather:
    """Element index arrays of every constrained output chunk and its sources, per rank."""

    def __init__(self, table: "_Table", isz: int) -> None:
        self.nin = [b // isz for b in table.in_bytes]
        base = np.cumsum([0] + self.nin)[:-1]
        self.bad_lengths = table.bad_lengths
        self.per_rank: list[dict] = []
        for r, groups in enumerate(table.per_rank):
            d = {}
            for key, (chunks, out_off, lens, src_rank, src_off) in groups.items():
                k = lens // isz
                oi = _ranges(out_off // isz, k)
                si = np.stack([_ranges(base[src_rank[:, j]] + src_off[:, j] // isz, k)
                               for j in range(src_rank.shape[1])])
                ch = np.repeat(chunks, k)
                d[key] = (oi, si, ch)
            self.per_rank.append(d)


class _Table:
    """Byte offsets of every constrained output chunk and its sources (dtype independent)."""

    def __init__(self, spec: CollectiveSpec, layouts: list[Layout]) -> None:
        self.in_bytes = [lay.input_bytes for lay in layouts]
        self.bad_lengths: list[tuple[int, int]] = []
        acc: list[dict] = [dict() for _ in range(spec.num_ranks)]
        for (r, c), exp in _postcondition(spec).items():
            off, ln = layouts[r].span(BufferKind.output, c)
            if ln == 0:
                continue
            rows = []
            for (p, j) in exp.sources:
                soff, sln = layouts[p].span(BufferKind.input, j)
                if sln != ln:
                    self.bad_lengths.append((r, c))
                    break
                rows.append((p, soff))
            else:
                d = acc[r].setdefault((exp.reduced, len(rows)), ([], [], [], [], []))
                d[0].append(c); d[1].append(off); d[2].append(ln)
                d[3].append([p for p, _ in rows]); d[4].append([o for _, o in rows])
        self.per_rank = [{k: tuple(np.array(x, dtype=np.int64) for x in v) for k, v in a.items()} for a in acc]


_POST: dict = {}
_TABLES: dict = {}
_GATHERS: dict = {}


def _postcondition(spec: CollectiveSpec) -> dict:
    pc = _POST.get(spec)
    if pc is None:
        if len(_POST) > 32:
            _POST.clear()
        pc = _POST[spec] = spec.postcondition()
    return pc


def _gather(spec: CollectiveSpec, layouts: list[Layout], isz: int) -> _Gather:
    lkey = (spec, tuple((l.input_bytes, l.output_bytes, l.chunk_bytes, l.input, l.output) for l in layouts))
    g = _GATHERS.get((lkey, isz))
    if g is None:
        t = _TABLES.get(lkey)
        if t is None:
            if len(_TABLES) > 32:
                _TABLES.clear()
                _GATHERS.clear()
            t = _TABLES[lkey] = _Table(spec, layouts)
        g = _GATHERS[(lkey, isz)] = _Gather(t, isz)
    return g


#: outputs of more elements than this (on some rank) are checked chunk by chunk, with no index
#: arrays (which take 8 bytes per element and source, and are cached per layout)
CHUNKWISE_ELEMENTS = 1 << 16


def _bad_reduction(vals: list[np.ndarray], got: np.ndarray, dt: np.dtype, op: str,
                   m: int) -> tuple[np.ndarray, np.ndarray]:
    """(mask of wrong elements, reference) of a reduction of ``vals`` (equal-length arrays)."""
    u = unit_roundoff(dt)
    if is_float(dt):
        v64 = np.stack([v.astype(np.float64) for v in vals])
        if op == "sum":
            ref = v64.sum(axis=0)
            bound = m * u * np.abs(v64).sum(axis=0) + 1e-30
        else:
            ref = v64.min(axis=0) if op == "min" else v64.max(axis=0)
            bound = np.zeros_like(ref)
        with np.errstate(invalid="ignore"):
            return ~(np.abs(got.astype(np.float64) - ref) <= bound), ref
    v64 = np.stack([v.astype(np.int64) for v in vals])
    ref = (v64.sum(axis=0) if op == "sum" else v64.min(axis=0) if op == "min" else v64.max(axis=0)).astype(dt)
    return got != ref, ref


def _check_numeric_chunkwise(spec: CollectiveSpec, layouts: list[Layout], inputs: list[np.ndarray],
                             outputs: list[np.ndarray], dt: np.dtype, op: str, launch: int,
                             limit: int) -> list[Problem]:
    """:func:`check_numeric` for large outputs: one output chunk at a time, on slices."""
    probs: list[Problem] = []
    isz = dt.itemsize
    ut = _UINT[isz]
    ins = [np.ascontiguousarray(x).view(dt)[: lay.input_bytes // isz] for x, lay in zip(inputs, layouts)]
    outs = [np.ascontiguousarray(o[: (o.shape[0] // isz) * isz]).view(dt) for o in outputs]
    for (r, c), exp in _postcondition(spec).items():
        off, ln = layouts[r].span(BufferKind.output, c)
        if ln == 0:
            continue
        k = ln // isz
        vals = []
        for (p, j) in exp.sources:
            soff, sln = layouts[p].span(BufferKind.input, j)
            if sln != ln:
                probs.append(Problem("postcondition", f"rank {r} output chunk {c}: source chunks have other lengths than the output chunk"))
                vals = []
                break
            vals.append(ins[p][soff // isz: soff // isz + k])
        if vals:
            o0 = off // isz
            got = outs[r][o0: o0 + k]
            if not exp.reduced:
                bad = got.view(ut) != vals[0].view(ut)
                if bad.any():
                    i = int(np.argmax(bad))
                    p, j = exp.sources[0]
                    probs.append(Problem("postcondition",
                                         f"rank {r} output chunk {c} (launch {launch}) should be a copy of rank {p} "
                                         f"input chunk {j} but differs (element {o0 + i} of the output is "
                                         f"{_fmt(got[i])}, expected {_fmt(vals[0][i])})"))
            else:
                bad, ref = _bad_reduction(vals, got, dt, op, len(vals))
                if bad.any():
                    i = int(np.argmax(bad))
                    probs.append(Problem("postcondition",
                                         f"rank {r} output chunk {c} (launch {launch}) is not the {op} of "
                                         f"{len(vals)} input chunks {list(exp.sources)[:8]}: output element {o0 + i} "
                                         f"is {_fmt(got[i])}, expected {_fmt(ref[i])}"))
        if len(probs) >= limit:
            return probs[:limit]
    return probs


def check_numeric(spec: CollectiveSpec, layouts: list[Layout], inputs: list[np.ndarray],
                  outputs: list[np.ndarray], dt: np.dtype, op: str, launch: int,
                  limit: int = 4) -> list[Problem]:
    """Compare every constrained output chunk with the collective's definition: copies bit for
    bit, reductions within ``m * u * sum(|x|)`` of a float64 reference (u: the dtype's unit
    roundoff, m: the number of reduced chunks), min/max and integers exactly."""
    probs: list[Problem] = []
    isz = dt.itemsize
    if max((lay.output_bytes for lay in layouts), default=0) // isz > CHUNKWISE_ELEMENTS:
        return _check_numeric_chunkwise(spec, layouts, inputs, outputs, dt, op, launch, limit)
    g = _gather(spec, layouts, isz)
    for (r, c) in g.bad_lengths[:limit]:
        probs.append(Problem("postcondition", f"rank {r} output chunk {c}: source chunks have other lengths than the output chunk"))
    u = unit_roundoff(dt)
    flat = np.concatenate([np.ascontiguousarray(x).view(dt)[: g.nin[p]] for p, x in enumerate(inputs)])
    ut = _UINT[isz]
    flat_u = flat.view(ut)
    for r in range(spec.num_ranks):
        out = np.ascontiguousarray(outputs[r][: (outputs[r].shape[0] // isz) * isz]).view(dt)
        for (reduced, m), (oi, si, ch) in g.per_rank[r].items():
            got = out[oi]
            if not reduced:
                bad = got.view(ut) != flat_u[si[0]]
                if bad.any():
                    i = int(np.argmax(bad))
                    c = int(ch[i])
                    exp = spec.expect(r, c)
                    p, k = exp.sources[0]  # type: ignore[union-attr]
                    probs.append(Problem("postcondition",
                                         f"rank {r} output chunk {c} (launch {launch}) should be a copy of rank {p} "
                                         f"input chunk {k} but differs (element {int(oi[i])} of the output is "
                                         f"{_fmt(got[i])}, expected {_fmt(flat[si[0][i]])})"))
            else:
                vals = flat[si]
                if is_float(dt):
                    v64 = vals.astype(np.float64)
                    if op == "sum":
                        ref = v64.sum(axis=0)
                        bound = m * u * np.abs(v64).sum(axis=0) + 1e-30
                    else:
                        ref = v64.min(axis=0) if op == "min" else v64.max(axis=0)
                        bound = np.zeros_like(ref)
                    with np.errstate(invalid="ignore"):
                        bad = ~(np.abs(got.astype(np.float64) - ref) <= bound)
                else:
                    v64 = vals.astype(np.int64)
                    ref = (v64.sum(axis=0) if op == "sum" else v64.min(axis=0) if op == "min" else v64.max(axis=0)).astype(dt)
                    bad = got != ref
                if bad.any():
                    i = int(np.argmax(bad))
                    c = int(ch[i])
                    exp = spec.expect(r, c)
                    probs.append(Problem("postcondition",
                                         f"rank {r} output chunk {c} (launch {launch}) is not the {op} of "
                                         f"{m} input chunks {list(exp.sources)[:8]}: output element {int(oi[i])} "  # type: ignore[union-attr]
                                         f"is {_fmt(got[i])}, expected {_fmt(ref[i])}"))
            if len(probs) >= limit:
                return probs
    return probs


def check_symbolic(spec: CollectiveSpec, layouts: list[Layout], shadows: list[np.ndarray],
                   input_chunks: int, launch: int, limit: int = 4,
                   granule: int = 4) -> list[Problem]:
    """Each output word's multiset of (rank, input chunk) contributions against the spec
    (``shadows`` hold one row per ``granule`` bytes of each rank's output)."""
    probs: list[Problem] = []
    for (r, c), exp in _postcondition(spec).items():
        off, ln = layouts[r].span(BufferKind.output, c)
        if ln == 0:
            continue
        rows = shadows[r][off // granule: (off + ln) // granule]
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
                             f"rank {r} output chunk {c} (launch {launch}, byte {off + granule * int(badrows[0])}) "
                             f"should hold the {kind} {list(exp.sources)[:8]}{'...' if len(exp.sources) > 8 else ''}: "
                             + "; ".join(parts),
                             details={"rank": r, "chunk": c, "missing": missing,
                                      "extra": [pk for pk, _ in extra]}))
        if len(probs) >= limit:
            break
    return probs
