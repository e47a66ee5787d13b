"""A one-process reference of MoE dispatch and combine in plain torch, and the routings and
tokens the tests draw (every rank can compute every rank's, from seeds): shared by the simulator
tests and the GPU checks."""

from __future__ import annotations

import torch

H = 8


def routing(kind: str, n: int, T: int, k: int, E: int, seed: int) -> list[torch.Tensor]:
    """Each rank's topk_idx [T, k]."""
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(seed * 100 + r)
        if kind == "one expert takes all":
            idx = torch.zeros(T, k, dtype=torch.int64)
            idx[:, 1:] = -1                                   # the other slots dropped
        elif kind == "an expert gets nothing":
            idx = torch.stack([torch.randperm(E - 1, generator=g)[:k] + 1 for _ in range(T)])   # never expert 0
        else:
            idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            idx[torch.rand(T, k, generator=g) < 0.2] = -1     # dropped slots
        out.append(idx)
    return out


def tokens(n: int, T: int, seed: int, hidden: int = H) -> list[torch.Tensor]:
    return [torch.randn(T, hidden, generator=torch.Generator().manual_seed(seed * 7 + r)).to(torch.bfloat16)
            for r in range(n)]


def ref_dispatch(toks, idxs, E, n, C, r):
    """Rank r's expert rows: for each local expert, rows by (source rank, token, slot)."""
    L = E // n
    out = torch.zeros(L, C, toks[0].shape[1], dtype=toks[0].dtype)
    counts = [0] * L
    for l in range(L):
        e = r * L + l
        for p in range(n):
            for t in range(idxs[p].shape[0]):
                for j in range(idxs[p].shape[1]):
                    if int(idxs[p][t, j]) == e:
                        if counts[l] < C:
                            out[l, counts[l]] = toks[p][t]
                        counts[l] += 1
    return out, counts


def expert_fn(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x.float() * (r + 2) - 1).to(x.dtype)


def ref_combine(toks, idxs, ws, n, E, r):
    L = E // n
    T, k = idxs[r].shape
    acc = torch.zeros(T, toks[r].shape[1], dtype=torch.float32)
    for j in range(k):
        for t in range(T):
            e = int(idxs[r][t, j])
            if e >= 0 and float(ws[r][t, j]) != 0:
                acc[t] = acc[t] + ws[r][t, j].float() * expert_fn(toks[r][t:t + 1], e // L)[0].float()
    return acc.to(toks[0].dtype)
