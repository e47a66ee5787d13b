"""A fuzz of the ``mscclang`` torch.distributed backend's arguments against gloo's behaviour, on
the CPU with 2 spawned ranks: every case (an op, its list lengths, its tensors' shapes, dtypes,
contiguity) runs on a gloo group and on a ``mscclang`` group in the same processes, from the same
tensors. Either both raise, or both run and every tensor of the call ends equal; where gloo
refuses a single-tensor form that torch documents for NCCL (an all-gather output stacked rather
than concatenated, say), the mscclang result must equal gloo's on the flattened tensors. No case
may give a silent wrong result (seen: ``dist.all_gather`` with a one-tensor output list on 2
ranks returned rank 0's tensor where gloo raises "invalid output tensor list")."""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tests.harness.dist_ranks import spawn_ranks

WORLD = 2
DTYPES = (torch.float32, torch.bfloat16, torch.int32, torch.float64)
REDUCE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT)


@dataclass
class Case:
    """One fuzzed call: ``run(group, tensors)`` issues it on ``group``; ``tensors`` are every
    tensor the call is given (each run gets copies); ``expect(everyone)`` is, from every rank's
    ``tensors`` (flattened to float64), what this rank's tensors must hold after the call (None:
    unchanged), by the collective's definition; ``single``: a single-tensor form (or list
    ``all_to_all``), whose shapes NCCL reads by element count."""

    name: str
    tensors: list
    run: Callable[[Any, list], None]
    expect: Callable[[list], list]
    single: bool = False
    gloo_refuses: bool = False


class _Draw:
    """Random structure (alike on every rank: one seed) and rank-dependent values."""

    def __init__(self, seed: int, rank: int) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed * 7 + rank)

    def pick(self, *choices: Any) -> Any:
        return self.rng.choice(choices)

    def sometimes(self) -> bool:
        """A perturbation, about one time in three it is asked for."""
        return self.rng.random() < 0.3

    def tensor(self, shape: tuple, dtype: torch.dtype, contiguous: bool = True, fill: Optional[int] = None) -> Any:
        """Small integers (every sum, product, min and max is exact in every dtype here)."""
        n = math.prod(shape)
        flat = (torch.randint(-4, 5, (n,), generator=self.gen) if fill is None else torch.full((n,), fill)).to(dtype)
        return flat.view(shape) if contiguous else _strided(flat.view(shape))

    def like(self, shape: tuple, dtype: torch.dtype, fill: Optional[int] = None,
             hows: tuple = ("numel", "shape", "dtype", "strided")) -> Any:
        """A tensor of ``shape`` and ``dtype``, or (sometimes) one perturbed in one of ``hows``:
        its element count, its shape (same count), its dtype or its contiguity."""
        if not self.sometimes():
            return self.tensor(shape, dtype, fill=fill)
        how, n = self.pick(*hows), math.prod(shape)
        if how == "numel":
            return self.tensor((n + self.pick(1, -1 if n > 1 else 1, n),), dtype, fill=fill)
        if how == "shape":
            return self.tensor((n, 1) if len(shape) == 1 else (n,), dtype, fill=fill)
        if how == "dtype":
            return self.tensor(shape, self.pick(*[d for d in DTYPES if d != dtype]), fill=fill)
        return self.tensor(shape, dtype, contiguous=False, fill=fill)

    def count(self, n: int) -> int:
        """``n``, or (sometimes) a wrong list length."""
        return self.pick(n - 1, n + 1, 0) if self.sometimes() else n


def _strided(t: Any) -> Any:
    """A non-contiguous copy of ``t`` (every other element of a buffer twice its size)."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype) if t.dim() else torch.zeros(2, dtype=t.dtype)
    out = wide[..., ::2] if t.dim() else wide[0]
    out.copy_(t)
    return out


def _opts(kind: Any, **kw: Any) -> Any:
    o = kind()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def _red(ts: list, op: Any) -> Any:
    """The reduction of same-sized float64 tensors by ``op``."""
    st = torch.stack(ts)
    return {dist.ReduceOp.SUM: st.sum(0), dist.ReduceOp.MIN: st.min(0).values, dist.ReduceOp.MAX: st.max(0).values,
            dist.ReduceOp.PRODUCT: st.prod(0)}[op]


def make_case(seed: int, rank: int) -> Case:
    """Case ``seed`` as rank ``rank`` makes it (its structure is the same on every rank)."""
    d = _Draw(seed, rank)
    n = d.pick(1, 2, 4, 6, 8)
    dtype = d.pick(*DTYPES[:3])
    op = d.pick(*REDUCE_OPS)
    r, W = rank, WORLD  # noqa: N806
    kind = d.pick("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                  "all_to_all_single", "all_reduce", "broadcast", "all_reduce_coalesced", "all_gather_coalesced_t",
                  "reduce_scatter_coalesced_t", "all_to_all", "gather", "scatter", "pg_allgather", "pg_allreduce",
                  "pg_broadcast")
    x = d.tensor((n,), dtype)
    if kind == "all_gather":
        outs = [d.like((n,), dtype, fill=-77) for _ in range(d.count(W))]
        return Case(kind, [d.like((n,), dtype), *outs], lambda g, t: dist.all_gather(t[1:], t[0], group=g),
                    lambda a: [None, *[a[q][0] for q in range(W)]])
    if kind == "all_gather_into_tensor":
        out = d.like(d.pick((W * n,), (W, n)), dtype, fill=-77)
        return Case(kind, [out, d.like((n,), dtype)], lambda g, t: dist.all_gather_into_tensor(t[0], t[1], group=g),
                    lambda a: [torch.cat([a[q][1] for q in range(W)]), None], single=True)
    if kind == "reduce_scatter":
        out = d.like((n,), dtype, fill=-77)
        ins = [d.like((n,), dtype) for _ in range(d.count(W))]
        # gloo checks one block per rank: with blocks of different sizes one rank refuses the
        # call and the other waits out the timeout in it (and gloo's group is then out of step),
        # so gloo is not asked: its answer is a refusal
        odd = len({(tuple(t.shape), t.dtype) for t in ins}) > 1
        return Case(kind, [out, *ins], lambda g, t: dist.reduce_scatter(t[0], t[1:], op=op, group=g),
                    lambda a: [_red([a[q][1 + r] for q in range(W)], op)] + [None] * len(ins), gloo_refuses=odd)
    if kind == "reduce_scatter_tensor":
        out = d.like((n,), dtype, fill=-77)
        inp = d.like(d.pick((W * n,), (W, n)), dtype)
        return Case(kind, [out, inp], lambda g, t: dist.reduce_scatter_tensor(t[0], t[1], op=op, group=g),
                    lambda a: [_red([a[q][1].chunk(W)[r] for q in range(W)], op), None], single=True)
    if kind == "all_to_all_single":
        inp = d.like((W * n,), dtype)
        out = d.like((W * n,), dtype, fill=-77)
        return Case(kind, [out, inp], lambda g, t: dist.all_to_all_single(t[0], t[1], group=g),
                    lambda a: [torch.cat([a[q][1].chunk(W)[r] for q in range(W)]), None], single=True)
    if kind == "all_reduce":
        return Case(kind, [d.like((n,), dtype)], lambda g, t: dist.all_reduce(t[0], op=op, group=g),
                    lambda a: [_red([a[q][0] for q in range(W)], op)])
    if kind == "broadcast":
        root = d.pick(0, 1)
        return Case(kind, [d.like((n,), dtype)], lambda g, t: dist.broadcast(t[0], src=root, group=g),
                    lambda a: [a[root][0]])
    if kind == "all_reduce_coalesced":
        ts = [d.like((d.pick(1, n),), dtype) for _ in range(d.pick(1, 2, 3))]
        return Case(kind, ts, lambda g, t: _pg(g).allreduce_coalesced(
            t, _opts(dist.AllreduceCoalescedOptions, reduceOp=op)).wait(),
                    lambda a: [_red([a[q][i] for q in range(W)], op) for i in range(len(ts))])
    if kind in ("all_gather_coalesced_t", "reduce_scatter_coalesced_t"):
        gather = kind == "all_gather_coalesced_t"
        ins = [d.like((n,) if gather else (W * n,), dtype) for _ in range(d.pick(1, 2))]
        outs = [d.like((W * n,) if gather else (n,), dtype, fill=-77) for _ in range(d.count(len(ins)))]
        k = len(outs)
        if gather:
            return Case(kind, [*outs, *ins], lambda g, t: _pg(g).allgather_into_tensor_coalesced(
                t[:k], t[k:], _c10d().AllgatherOptions()).wait(),
                        lambda a: [torch.cat([a[q][k + i] for q in range(W)]) for i in range(k)] + [None] * len(ins),
                        single=True)
        return Case(kind, [*outs, *ins], lambda g, t: _pg(g).reduce_scatter_tensor_coalesced(
            t[:k], t[k:], _opts(dist.ReduceScatterOptions, reduceOp=op)).wait(),
                    lambda a: [_red([a[q][k + i].chunk(W)[r] for q in range(W)], op) for i in range(k)]
                    + [None] * len(ins), single=True)
    if kind == "all_to_all":
        ins = [d.like((n,), dtype) for _ in range(W)]
        outs = [d.like((n,), dtype, fill=-77) for _ in range(d.count(W))]
        k = len(outs)
        # NCCL reads the list's tensors by element count (gloo wants one shape): as a single form
        return Case(kind, [*outs, *ins], lambda g, t: dist.all_to_all(t[:k], t[k:], group=g),
                    lambda a: [a[j][k + r] for j in range(W)] + [None] * W, single=True)
    if kind == "gather":
        # only the root checks the call (gloo alike): nothing but contiguity is perturbed, or
        # the other rank would wait out the timeout in a gather the root refused
        lst = [d.tensor((n,), dtype, fill=-77) for _ in range(W)] if r == 0 else []
        return Case(kind, [d.like((n,), dtype, hows=("strided",)), *lst],
                    lambda g, t: dist.gather(t[0], t[1:] if r == 0 else None, dst=0, group=g),
                    lambda a: [None] + ([a[q][0] for q in range(W)] if r == 0 else []))
    if kind == "scatter":
        lst = [d.tensor((n,), dtype) for _ in range(W)] if r == 0 else []
        return Case(kind, [d.like((n,), dtype, fill=-77, hows=("strided",)), *lst],
                    lambda g, t: dist.scatter(t[0], t[1:] if r == 0 else None, src=0, group=g),
                    lambda a: [a[0][1 + r]] + [None] * len(lst))
    if kind == "pg_allgather":
        lists, k = d.count(1), d.pick(W, W + 1) if d.sometimes() else W
        outs = [d.tensor((n,), dtype, fill=-77) for _ in range(lists * k)]
        return Case(kind, [x, *outs], lambda g, t: _pg(g).allgather(
            [t[1 + i * k:1 + (i + 1) * k] for i in range(lists)], [t[0]], _c10d().AllgatherOptions()).wait(),
                    lambda a: [None] + [a[q][0] for _ in range(lists) for q in range(W)])
    if kind == "pg_allreduce":   # several tensors: gloo reduces over them too
        ts = [d.like((n,), dtype) for _ in range(d.count(1))]
        return Case(kind, ts, lambda g, t: _pg(g).allreduce(t, _opts(dist.AllreduceOptions, reduceOp=op)).wait(),
                    lambda a: [_red([a[q][i] for q in range(W) for i in range(len(ts))], op)] * len(ts))
    # pg_broadcast: a root tensor index into the list
    ts = [d.tensor((n,), dtype) for _ in range(d.pick(1, 1, 2))]
    root_tensor = d.pick(1, 2) if d.sometimes() else 0
    return Case(kind, ts, lambda g, t: _pg(g).broadcast(
        t, _opts(dist.BroadcastOptions, rootRank=0, rootTensor=root_tensor)).wait(),
                lambda a: [a[0][root_tensor]] * len(ts))


def _pg(group: Any) -> Any:
    """The process group object torch's functions would reach for ``group``."""
    return group if group is not None else dist.group.WORLD


def _c10d() -> Any:
    from torch._C import _distributed_c10d

    return _distributed_c10d


def _attempt(fn: Callable[[Any, list], None], group: Any, tensors: list) -> tuple[Optional[str], list]:
    """Run ``fn`` on copies of ``tensors`` (non-contiguous ones alike): (None or the error's type
    and first line, the copies after the call)."""
    mine = [t.clone() if t.is_contiguous() else _strided(t) for t in tensors]
    try:
        fn(group, mine)
    except Exception as e:  # noqa: BLE001 - an outcome of the case
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}", mine
    return None, mine


def _wrong(case: Case, everyone: list, after: list) -> Optional[str]:
    """How ``after`` (this rank's tensors after the call) differs from the definition (from
    ``everyone``'s cases), or None."""
    want = case.expect([[t.reshape(-1).double() for t in c.tensors] for c in everyone])
    for i, (t, w) in enumerate(zip(after, want)):
        w = case.tensors[i].reshape(-1).double() if w is None else w
        if t.numel() != w.numel() or not torch.equal(t.reshape(-1).double(), w):
            return f"tensor {i} is {t.reshape(-1).tolist()}, expected {w.tolist()}"
    return None


def _stuck(err: Optional[str]) -> bool:
    """Whether an error says the ranks are out of step (gloo's timeout, or a peer that left)."""
    return err is not None and ("Timed out" in err or "Connection closed" in err)


def fuzz_rank(rank: int, seed: int, cases: int) -> dict:
    """The fuzz on one rank: a gloo default group, a ``mscclang`` group beside it. Per case,
    gloo runs the call as given (a single-tensor form it refuses: flattened, as NCCL reads it):
    where gloo runs it right, mscclang must run it right too; where gloo refuses it, mscclang
    must raise; where gloo runs it to a wrong result (``gloo_wrong``: it reads non-contiguous
    tensors as dense in all_reduce, broadcast, reduce, list reduce_scatter, all_to_all_single
    and scatter), mscclang must run it right or raise. Returns what went wrong and the count of
    each outcome."""
    warnings.simplefilter("ignore")
    ours = dist.new_group(backend="mscclang")
    problems: list[str] = []
    outcomes: dict[str, int] = {}
    for i in range(cases):
        everyone = [make_case(seed * 100003 + i, q) for q in range(WORLD)]
        case = everyone[rank]
        shapes = [(tuple(t.shape), str(t.dtype)[6:], t.is_contiguous()) for t in case.tensors]
        what = f"case {i} ({case.name}, {shapes})"
        g_err, g_out = ("refused on one rank", []) if case.gloo_refuses else _attempt(case.run, None, case.tensors)
        if g_err is not None and case.single:   # the form NCCL reads by element count
            g_err, g_out = _attempt(case.run, None, [t.reshape(-1) if t.is_contiguous() else t for t in case.tensors])
        gloo_wrong = g_err is None and _wrong(case, everyone, g_out) is not None
        m_err, m_out = (None, []) if _stuck(g_err) else _attempt(case.run, ours, case.tensors)
        if _stuck(g_err) or _stuck(m_err):   # out of step: every later case would wait out the timeout
            problems.append(f"{what}: the ranks went out of step: {g_err if _stuck(g_err) else m_err}")
            return {"problems": problems, "outcomes": outcomes}
        key = "gloo_wrong" if gloo_wrong else "valid" if g_err is None else "invalid"
        key += "/raise" if m_err else "/run"
        outcomes[key] = outcomes.get(key, 0) + 1
        if m_err is None and g_err is not None:
            problems.append(f"{what}: mscclang ran a call gloo refuses ({g_err})")
        elif m_err is not None and g_err is None and not gloo_wrong:
            problems.append(f"{what}: mscclang refused a valid call: {m_err}")
        elif m_err is None and _wrong(case, everyone, m_out):
            problems.append(f"{what}: silent wrong result: {_wrong(case, everyone, m_out)}")
    t = torch.ones(4)   # both groups still work
    dist.all_reduce(t, group=ours)
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((4,), 4.0)):
        problems.append(f"after the fuzz: all_reduce gave {t.tolist()}")
    dist.destroy_process_group(ours)
    return {"problems": problems, "outcomes": outcomes}


def test_backend_list_arguments_against_gloo(tmp_path):
    """300 fuzzed calls (about two in three with a wrong list length, element count, shape, dtype
    or contiguity somewhere): 0 silent wrong results, and mscclang raises exactly where gloo does
    (a single-tensor form NCCL accepts runs right)."""
    res = spawn_ranks(tmp_path, "tests.test_distributed_fuzz:fuzz_rank", 1, 300, timeout_s=5, wait_s=120)
    assert all(r.ok for r in res), [r.error or f"exit {r.exitcode}" for r in res]
    for r in res:
        assert r.value["problems"] == [], "\n".join(r.value["problems"][:20]) + f"\n{r.value['outcomes']}"
        assert r.value["outcomes"].get("invalid/raise", 0) > 50 and r.value["outcomes"].get("valid/run", 0) > 50
