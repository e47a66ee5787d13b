"""Postcondition checks: numeric (against a float64 reference with an error bound derived from
the reduction order) and symbolic (which input chunks reached each output element, how often)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.layout import Layout
from mscclang.plan.models import BufferKind
from mscclang.sim.dtypes import is_float, unit_roundoff
from mscclang.sim.program import Program
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
        for (r, c), exp in postcondition_of(spec).items():
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


def postcondition_of(spec: CollectiveSpec) -> dict:
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


#: the byte the simulator fills every output with before each launch (``poison_outputs``)
POISON = 0xFF


def _never_written(out_bytes: np.ndarray, off: int, ln: int, dt: np.dtype) -> bool:
    """Whether output bytes [off, off+ln) still hold only the poison: for float dtypes all-0xFF
    is a NaN no finite input makes; for others a chunk of 16 bytes or more is required."""
    if ln <= 0 or off + ln > out_bytes.shape[0]:
        return False
    if not is_float(dt) and ln < 16:
        return False
    return bool((out_bytes[off: off + ln] == POISON).all())


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


def _wrong_chunk(r: int, c: int, launch: int, exp: Any, op: str, unwritten: bool, element: int,
                 got: Any, ref: Any) -> Problem:
    """The ``postcondition`` problem of rank ``r``'s wrong output chunk ``c`` (``exp``: what it
    should hold): never written, or its first wrong ``element`` (``got`` instead of ``ref``)."""
    m = len(exp.sources)
    if exp.reduced:
        should = f"the {op} of {m} input chunks {list(exp.sources)[:8]}"
    else:
        should = f"a copy of rank {exp.sources[0][0]} input chunk {exp.sources[0][1]}"
    if unwritten:
        msg = (f"was never written: it still holds the 0x{POISON:02X} bytes the simulator fills "
               f"outputs with before each launch; it should be {should}")
    elif exp.reduced:
        msg = f"is not {should}: output element {element} is {_fmt(got)}, expected {_fmt(ref)}"
    else:
        msg = (f"should be {should} but differs (element {element} of the output is {_fmt(got)}, "
               f"expected {_fmt(ref)})")
    return Problem("postcondition", f"rank {r} output chunk {c} (launch {launch}) {msg}",
                   details={"rank": r, "chunk": c, "unwritten": unwritten})


def _check_numeric_chunkwise(spec: CollectiveSpec, layouts: list[Layout], inputs: list[np.ndarray],
                             outputs: list[np.ndarray], dt: np.dtype, op: str, launch: int,
                             limit: Optional[int]) -> list[Problem]:
    """:func:`check_numeric` for large outputs: one output chunk at a time, on slices (the
    same problems, with the same messages)."""
    probs: list[Problem] = []
    isz = dt.itemsize
    ut = _UINT[isz]
    ins = [np.ascontiguousarray(x).view(dt)[: lay.input_bytes // isz] for x, lay in zip(inputs, layouts)]
    raws = [np.ascontiguousarray(o) for o in outputs]
    outs = [raw[: (raw.shape[0] // isz) * isz].view(dt) for raw in raws]
    todo = []
    for (r, c), exp in sorted(postcondition_of(spec).items()):
        off, ln = layouts[r].span(BufferKind.output, c)
        if ln == 0:
            continue
        spans = [layouts[p].span(BufferKind.input, j) for (p, j) in exp.sources]
        if any(sln != ln for _, sln in spans):
            probs.append(Problem("postcondition", f"rank {r} output chunk {c}: source chunks have other "
                                 "lengths than the output chunk", details={"rank": r, "chunk": c}))
            continue
        todo.append((r, c, exp, off, ln, spans))
    for r, c, exp, off, ln, spans in todo:
        k = ln // isz
        o0 = off // isz
        vals = [ins[p][soff // isz: soff // isz + k] for (p, _), (soff, _) in zip(exp.sources, spans)]
        got = outs[r][o0: o0 + k]
        m = len(vals)
        if not exp.reduced:
            bad = got.view(ut) != vals[0].view(ut)
            ref = vals[0]
        else:
            bad, ref = _bad_reduction(vals, got, dt, op, m)
        if not bad.any():
            continue
        i = int(np.argmax(bad))
        probs.append(_wrong_chunk(r, c, launch, exp, op, _never_written(raws[r], off, ln, dt),
                                  o0 + i, got[i], ref[i]))
        if limit is not None and len(probs) >= limit:
            return probs
    return probs


def check_numeric(spec: CollectiveSpec, layouts: list[Layout], inputs: list[np.ndarray],
                  outputs: list[np.ndarray], dt: np.dtype, op: str, launch: int,
                  limit: Optional[int] = None) -> list[Problem]:
    """Compare every constrained output chunk with the collective's definition: copies bit for
    bit, reductions within ``m * u * sum(|x|)`` of a float64 reference (u: the dtype's unit
    roundoff, m: the number of reduced chunks), min/max and integers exactly.

    One problem per wrong (rank, output chunk), all of them unless ``limit`` is given; a chunk
    that still holds the poison the outputs are filled with before the launch is reported as
    never written. Each problem's details carry ``rank``, ``chunk`` and ``unwritten``."""
    isz = dt.itemsize
    if max((lay.output_bytes for lay in layouts), default=0) // isz > CHUNKWISE_ELEMENTS:
        return _check_numeric_chunkwise(spec, layouts, inputs, outputs, dt, op, launch, limit)
    g = _gather(spec, layouts, isz)
    probs = [Problem("postcondition", f"rank {r} output chunk {c}: source chunks have other lengths than the "
                     "output chunk", details={"rank": r, "chunk": c}) for (r, c) in g.bad_lengths]
    flat = np.concatenate([np.ascontiguousarray(x).view(dt)[: g.nin[p]] for p, x in enumerate(inputs)])
    ut = _UINT[isz]
    flat_u = flat.view(ut)
    for r in range(spec.num_ranks):
        raw = np.ascontiguousarray(outputs[r])
        out = raw[: (raw.shape[0] // isz) * isz].view(dt)
        for (reduced, m), (oi, si, ch) in g.per_rank[r].items():
            got = out[oi]
            if not reduced:
                bad = got.view(ut) != flat_u[si[0]]
                ref = flat[si[0]]
            else:
                bad, ref = _bad_reduction(list(flat[si]), got, dt, op, m)
            if not bad.any():
                continue
            idx = np.nonzero(bad)[0]
            chunks, firsts = np.unique(ch[idx], return_index=True)
            for c, fi in zip(chunks.tolist(), firsts.tolist()):
                i = int(idx[fi])
                off, ln = layouts[r].span(BufferKind.output, c)
                probs.append(_wrong_chunk(r, c, launch, spec.expect(r, c), op,  # type: ignore[arg-type]
                                          _never_written(raw, off, ln, dt), int(oi[i]), got[i], ref[i]))
                if limit is not None and len(probs) >= limit:
                    return probs
    return probs


def check_symbolic(spec: CollectiveSpec, layouts: list[Layout], shadows: list[np.ndarray],
                   input_chunks: int, launch: int, limit: Optional[int] = None,
                   granule: int = 4) -> list[Problem]:
    """Each output word's multiset of (rank, input chunk) contributions against the spec; one
    problem per wrong (rank, output chunk), all of them unless ``limit`` is given. A chunk no
    word of which received any contribution (out-of-place outputs start empty) is reported as
    never written. ``shadows`` hold one row per ``granule`` bytes of each rank's output."""
    probs: list[Problem] = []
    for (r, c), exp in postcondition_of(spec).items():
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
        kind = "reduction of" if exp.reduced else "copy of"
        srcs = f"{list(exp.sources)[:8]}{'...' if len(exp.sources) > 8 else ''}"
        unwritten = bool(rows.shape[0]) and not rows.any()
        parts = []
        if missing:
            parts.append("missing " + ", ".join(f"(rank {p}, chunk {k})" for p, k in missing[:6]))
        doubled = [(pk, cnt) for pk, cnt in extra if want[pk[0] * input_chunks + pk[1]] > 0]
        foreign = [(pk, cnt) for pk, cnt in extra if want[pk[0] * input_chunks + pk[1]] == 0]
        if doubled:
            parts.append("counted more than once " + ", ".join(f"(rank {p}, chunk {k}) x{n}" for (p, k), n in doubled[:6]))
        if foreign:
            parts.append("unexpected " + ", ".join(f"(rank {p}, chunk {k}) x{n}" for (p, k), n in foreign[:6]))
        if unwritten:
            msg = (f"rank {r} output chunk {c} (launch {launch}) was never written (no byte of it "
                   f"received any input): it should hold the {kind} {srcs}: " + "; ".join(parts))
        else:
            msg = (f"rank {r} output chunk {c} (launch {launch}, byte {off + granule * int(badrows[0])}) "
                   f"should hold the {kind} {srcs}: " + "; ".join(parts))
        probs.append(Problem("symbolic", msg,
                             details={"rank": r, "chunk": c, "missing": missing,
                                      "extra": [pk for pk, _ in extra], "unwritten": unwritten}))
        if limit is not None and len(probs) >= limit:
            break
    return probs


def derive_senders(program: Program) -> list[set[int]]:
    """For a send/recv plan: per rank, the other ranks whose input can reach its output.

    Data flow is followed at buffer granularity over every data op of every thread block
    (pipelines included): a rank's input starts with its own rank as origin; each op adds the
    origins of its sources' buffers to its destinations' buffers, until nothing changes. So a
    put into the peer's output, a put into its scratch that it copies out, and a relay through
    a third rank's scratch all name the rank whose input it was. Order is not considered:
    this says who sends to whom, the simulation checks what arrives."""
    n = len(program.plan.gpus)
    inplace = program.plan.inplace
    origin: dict[tuple[int, BufferKind], set[int]] = {(r, BufferKind.input): {r} for r in range(n)}
    flows = {(tuple((o.rank, o.kind) for o in grp.srcs), tuple((o.rank, o.kind) for o in grp.dsts))
             for grp in program.groups() if grp.stream_length() > 0}
    changed = True
    while changed:
        changed = False
        for srcs, dsts in flows:
            got: set[int] = set().union(*(origin.get(s, ()) for s in srcs))
            if not got:
                continue
            for d in dsts:
                if d[1] == BufferKind.input:
                    if not inplace:
                        continue  # an input's origin is its own rank
                    d = (d[0], BufferKind.output)  # in place: the input is the output
                cur = origin.setdefault(d, set())
                if not got <= cur:
                    cur |= got
                    changed = True
    return [origin.get((r, BufferKind.output), set()) - {r} for r in range(n)]


def check_fused(inputs: list[np.ndarray], residuals: list[np.ndarray], res_out: list[np.ndarray],
                outputs: list[np.ndarray], params: Any, quant: bool, launch: int) -> list[Problem]:
    """The postcondition of ``allreduce_add_rms_norm`` (arrays of the activation dtype, the
    outputs of the FP8 type with ``quant``): every rank's residual is within ``(n + 1) * u *
    (sum |x_p| + |residual_r|)`` of the float64 ``residual_r + sum of inputs``, rank ``r``'s own
    ``residuals[r]`` (u: the activation's unit roundoff), and every output is bit for bit
    :func:`mscclang.sim.epilogue.norm` of that rank's residual."""
    from mscclang.sim.epilogue import norm

    probs: list[Problem] = []
    dt = residuals[0].dtype
    n = len(inputs)
    u = unit_roundoff(dt) if is_float(dt) else 0.0
    x64 = [x.astype(np.float64) for x in inputs]
    total = np.sum(x64, axis=0)
    mags = np.sum(np.abs(x64), axis=0)
    tiny = float(np.finfo(np.float32).tiny) if is_float(dt) else 0.0
    h = params.hidden
    for r in range(n):
        ref = total + residuals[r].astype(np.float64)
        bound = (n + 1) * u * (mags + np.abs(residuals[r].astype(np.float64))) + tiny
        got = res_out[r].astype(np.float64)
        bad = ~(np.abs(got - ref) <= bound)
        if bad.any():
            i = int(np.argmax(bad))
            probs.append(Problem("postcondition", f"rank {r} residual element {i} (row {i // h}, launch {launch}) "
                                 f"is {_fmt(got[i])}, expected residual + allreduce = {_fmt(ref[i])} "
                                 f"(bound {bound[i]:.3g})", details={"rank": r, "row": i // h}))
            continue
        want = norm(res_out[r].reshape(-1, h), params, quant).reshape(-1)
        ob = outputs[r].view(np.uint8)
        wb = want.view(np.uint8)
        if ob.shape != wb.shape or not np.array_equal(ob, wb):
            isz = want.dtype.itemsize
            neq = ob.reshape(-1, isz) != wb.reshape(-1, isz) if ob.shape == wb.shape else np.ones((1, 1), bool)
            i = int(np.argmax(neq.any(axis=1)))
            probs.append(Problem("postcondition", f"rank {r} output element {i} (row {i // h}, launch {launch}) is "
                                 f"not the norm of the residual row: expected {_fmt(want[i])}",
                                 details={"rank": r, "row": i // h}))
    return probs
