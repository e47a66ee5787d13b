"""Communicator.moe_dispatch and moe_combine on the library's all-to-all-v plans, run by the
simulator (one thread per rank), against a one-process reference in plain torch: every rank's
expert rows and counts, and every rank's combined tokens bit for bit, at 2, 4 and 8 ranks, for
routings with an expert that gets no token, one expert that gets every token, T = 1 and T up to
the capacity; a token's combined bits do not depend on the batch; bad input is refused on every
rank."""

from __future__ import annotations

import pytest
import torch

from mscclang.comm.sim_ranks import run_ranks
from mscclang.errors import InvalidCall
from tests.harness.sim_plans import library_plans

from tests.harness.moe_ref import H, expert_fn as _expert_fn, ref_combine as _ref_combine
from tests.harness.moe_ref import ref_dispatch as _ref_dispatch, routing as _routing, tokens as _tokens


def _plans(n: int) -> list:
    return library_plans(["alltoallv_ll", "alltoallv_simple", "allgather_ll"], n)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind,T", [("random", 5), ("an expert gets nothing", 3), ("one expert takes all", 4),
                                    ("random", 1)])
def test_dispatch_and_combine_match_plain_torch(n: int, kind: str, T: int) -> None:
    E, k = 2 * n, 2
    C = n * T * k                                              # up to every token of every rank
    idxs = _routing(kind, n, T, k, E, n + T)
    toks = _tokens(n, T, n)
    ws = [torch.rand(T, k, generator=torch.Generator().manual_seed(50 + r)) for r in range(n)]

    def body(comm):
        r = comm.rank
        ex, counts, h = comm.moe_dispatch(toks[r], idxs[r], E, capacity=C)
        y = comm.moe_combine(_expert_fn(ex, r), ws[r], h)
        return ex.clone(), counts.clone(), y

    res, _, fb = run_ranks(n, body, plans=_plans(n), engine="sim")
    for r, (ex, counts, y) in enumerate(res):
        want, want_counts = _ref_dispatch(toks, idxs, E, n, C, r)
        assert counts.tolist() == want_counts, r
        for l, c in enumerate(want_counts):
            assert torch.equal(ex[l, :c].view(torch.int16), want[l, :c].view(torch.int16)), (r, l)
        assert torch.equal(y.view(torch.int16), _ref_combine(toks, idxs, ws, n, E, r).view(torch.int16)), r
    assert fb.calls == []


def test_a_tokens_combined_bits_do_not_depend_on_the_batch() -> None:
    n, E, k = 2, 4, 2
    first = {}
    for T in (1, 5, 33, 512):
        idxs = _routing("random", n, T, k, E, 9)
        for idx in idxs:
            idx[0] = torch.tensor([1, 3])                      # token 0: the same experts every time
        toks = _tokens(n, T, 3)
        base = _tokens(n, 1, 3)
        for r in range(n):
            toks[r][0] = base[r][0]
        ws = [torch.rand(T, k, generator=torch.Generator().manual_seed(T)) for _ in range(n)]
        for r in range(n):
            ws[r][0] = torch.tensor([0.3, 0.7])

        def body(comm):
            ex, _, h = comm.moe_dispatch(toks[comm.rank], idxs[comm.rank], E, capacity=n * T * k)
            return comm.moe_combine(_expert_fn(ex, comm.rank), ws[comm.rank], h)[0]

        res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
        for r, y0 in enumerate(res):
            first.setdefault(r, y0)
            assert torch.equal(y0.view(torch.int16), first[r].view(torch.int16)), (T, r)


def test_bad_input_is_refused_on_every_rank() -> None:
    n, E = 2, 4

    def body(comm):
        msgs = []
        x = torch.ones(3, H, dtype=torch.bfloat16)
        for args, kw in (((x, torch.tensor([[0, 1], [2, 4], [1, 1]]), E), {"capacity": 8}),      # id 4 out of range
                         ((x, torch.tensor([[0, 1], [0, 2], [0, 1]]), E), {"capacity": 2}),      # expert 0 gets 6 rows
                         ((x, torch.zeros(3, 5, dtype=torch.int64), E), {"capacity": 8}),       # k > experts
                         ((x, torch.zeros(2, 2, dtype=torch.int64), E), {"capacity": 8}),       # T mismatch
                         ((x, torch.zeros(3, 2, dtype=torch.int64), 3), {"capacity": 8})):      # 3 experts, 2 ranks
            try:
                comm.moe_dispatch(*args, **kw)
            except InvalidCall as e:
                msgs.append(str(e))
        return msgs

    res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
    assert res[0][:2] == res[1][:2] and len(res[0]) == 5
    assert "rank 0: moe_dispatch: 1 expert id(s) outside -1 .. 3" in res[0][0]
    assert "expert 0 (rank 0) gets 6 rows, more than its capacity of 2" in res[0][1]
    assert "k = 5 experts per token is more than the 4 experts" in res[0][2]
    assert "topk_idx must be [T, k] with T = 3" in res[0][3]
    assert "3 experts do not spread evenly over 2 ranks" in res[0][4]


@pytest.mark.parametrize("n", [2, 4])
def test_fp8_dispatch_carries_each_rows_scale(n: int) -> None:
    from mscclang.comm.moe import quantize_rows

    E, k, T = 2 * n, 2, 4
    C = n * T * k
    idxs = _routing("random", n, T, k, E, 11)
    toks = [t.float() * (r + 1) for r, t in enumerate(_tokens(n, T, 4))]

    def body(comm):
        (q, scale), counts, _ = comm.moe_dispatch(toks[comm.rank], idxs[comm.rank], E, capacity=C, fp8=True)
        return q.clone(), scale.clone(), counts.clone()

    res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
    payload = [quantize_rows(t) for t in toks]
    for r, (q, scale, counts) in enumerate(res):
        want, want_counts = _ref_dispatch(payload, idxs, E, n, C, r)   # the same rows, as bytes
        assert counts.tolist() == want_counts and q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        for l, c in enumerate(want_counts):
            assert torch.equal(q[l, :c].view(torch.uint8), want[l, :c, :H]), (r, l)
            assert torch.equal(scale[l, :c].view(torch.uint8).reshape(c, 4), want[l, :c, H:]), (r, l)
            deq = q[l, :c].float() * scale[l, :c, None]
            src = want[l, :c, :H].view(torch.float8_e4m3fn).float() * want[l, :c, H:].contiguous().view(torch.float32)
            assert torch.equal(deq, src)


def test_fp8_rows_must_be_whole_words() -> None:
    def body(comm):
        try:
            comm.moe_dispatch(torch.ones(2, 6), torch.zeros(2, 1, dtype=torch.int64), 2, capacity=4, fp8=True)
        except InvalidCall as e:
            return str(e)

    res, _, _ = run_ranks(2, body, plans=_plans(2), engine="sim")
    assert "H must be a multiple of 4" in res[0]


def test_ranks_with_different_token_counts() -> None:
    n, E, k = 4, 8, 2
    Ts = [1, 6, 0, 3]
    C = sum(Ts) * k
    idxs = [_routing("random", n, T, k, E, 20 + T)[r] if T else torch.zeros(0, k, dtype=torch.int64)
            for r, T in enumerate(Ts)]
    toks = [_tokens(n, max(T, 1), 5)[r][:T] for r, T in enumerate(Ts)]
    ws = [torch.rand(T, k, generator=torch.Generator().manual_seed(r)) for r, T in enumerate(Ts)]

    def body(comm):
        r = comm.rank
        ex, counts, h = comm.moe_dispatch(toks[r], idxs[r], E, capacity=C)
        return ex.clone(), counts.clone(), comm.moe_combine(_expert_fn(ex, r), ws[r], h)

    res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
    for r, (ex, counts, y) in enumerate(res):
        want, want_counts = _ref_dispatch(toks, idxs, E, n, C, r)
        assert counts.tolist() == want_counts
        for l, c in enumerate(want_counts):
            assert torch.equal(ex[l, :c].view(torch.int16), want[l, :c].view(torch.int16))
        assert y.shape == (Ts[r], H)
        assert torch.equal(y.view(torch.int16), _ref_combine(toks, idxs, ws, n, E, r).view(torch.int16))


@pytest.mark.parametrize("n", [2, 4])
def test_rank_major_layout_keeps_the_rows_as_they_arrived(n: int) -> None:
    E, k, T = 2 * n, 2, 5
    L, C = 2, n * T * k
    idxs = _routing("random", n, T, k, E, 31)
    toks = _tokens(n, T, 8)
    ws = [torch.rand(T, k, generator=torch.Generator().manual_seed(70 + r)) for r in range(n)]

    def body(comm):
        r = comm.rank
        rows, counts, h = comm.moe_dispatch(toks[r], idxs[r], E, capacity=C, layout="rank")
        y = comm.moe_combine(_expert_fn(rows, r), ws[r], h)
        try:
            comm.moe_combine(rows.view(L, C, H), ws[r], h)
        except InvalidCall as e:
            bad = str(e)
        try:
            comm.moe_dispatch(toks[r], idxs[r], E, capacity=C, layout="token")
        except InvalidCall as e:
            bad2 = str(e)
        return rows.clone(), counts.clone(), y, bad, bad2

    res, _, _ = run_ranks(n, body, plans=_plans(n), engine="sim")
    for r, (rows, counts, y, bad, bad2) in enumerate(res):
        assert rows.shape == (L * C, H) and counts.shape == (n, L)
        at = 0
        for p in range(n):                                    # by source rank, then local expert, then token
            for l in range(L):
                e = r * L + l
                want = [toks[p][t] for t in range(T) for j in range(k) if int(idxs[p][t, j]) == e]
                assert int(counts[p, l]) == len(want), (r, p, l)
                for i, row in enumerate(want):
                    assert torch.equal(rows[at + i].view(torch.int16), row.view(torch.int16)), (r, p, l, i)
                at += len(want)
        assert torch.equal(y.view(torch.int16), _ref_combine(toks, idxs, ws, n, E, r).view(torch.int16)), r
        assert f"expert_out must be [{L * C}, H] (the dispatch's rank-major layout)" in bad
        assert "layout must be one of expert, rank, got 'token'" in bad2
