"""The all-to-all-v cases of the benchmark: expert parallelism's exchange of rows whose per-peer
counts come from a router.

Two cases, by their routing: ``all_to_all_v`` (every rank sends every rank the same rows) and
``all_to_all_v_skewed`` (a Zipf-like routing: rank ``i`` sends rank ``j`` a share falling with
``(j - i) mod n``, so one receiver per sender takes most rows; zeros among the counts). A size is
the rows each rank sends, times its row's bytes (``--hidden`` elements, default 7168, the
DeepSeek-V3 hidden size): 1 to 4096 rows per peer. Columns, each checked on fresh random rows
before it is timed (every received row compared bit for bit with its sender's):

* ``mscclang``: ``comm.all_to_all_v(x, send_counts, out=out)`` (the counts a device tensor; the
  count exchange and the plan, no host synchronisation, so a CUDA graph captures it);
* ``nccl``: torch.distributed's ``all_to_all_single`` with the splits as lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mscclang.bench.cells import Cell, gen_input

if TYPE_CHECKING:
    from mscclang.bench.worker import BenchWorker

__all__ = ["CASES", "IMPLS", "DEFAULT_HIDDEN", "ROWS_PER_PEER", "counts_for", "sizes", "make_cell", "fill", "compare"]

#: case name -> routing
CASES = {"all_to_all_v": "uniform", "all_to_all_v_skewed": "skewed"}
#: the columns, in table order
IMPLS = ("mscclang", "nccl")
DEFAULT_HIDDEN = 7168
ROWS_PER_PEER = (1, 4, 16, 64, 256, 1024, 4096)


def counts_for(routing: str, n: int, rows_per_peer: int) -> list[list[int]]:
    """The count matrix of a case (``[i][j]``: rows rank ``i`` sends rank ``j``): each rank sends
    ``n * rows_per_peer`` rows; uniform, or skewed (weights ``1 / (1 + d)^2`` for the distance
    ``d = (j - i) mod n``, rounded down, the remainder to ``d = 0``)."""
    total = n * rows_per_peer
    if routing == "uniform":
        return [[rows_per_peer] * n for _ in range(n)]
    w = [1.0 / (1 + d) ** 2 for d in range(n)]
    share = [int(total * x / sum(w)) for x in w]
    share[0] += total - sum(share)
    return [[share[(j - i) % n] for j in range(n)] for i in range(n)]


def sizes(cfg: Any, esz: int, n: int) -> list[int]:
    """The byte sizes of the cases (the rows a rank sends times a row's bytes):
    ``cfg.extra["a2av_sizes"]`` when given, else :data:`ROWS_PER_PEER` rows per peer."""
    row = int(cfg.extra.get("hidden", DEFAULT_HIDDEN)) * esz
    return list(cfg.extra.get("a2av_sizes") or [k * n * row for k in ROWS_PER_PEER])


class CountedCell(Cell):
    """An all-to-all-v cell: ``inp`` the rows sent, ``out`` the rows received (capacity rows),
    ``counts`` the case's matrix, ``row`` the elements of a row."""

    def __init__(self, op: Any, x: Any, out: Any, counts: list[list[int]], row: int, plan: str = "") -> None:
        super().__init__(op, x, out, x.numel(), plan=plan)
        self.counts = counts
        self.row = row


def make_cell(w: "BenchWorker", coll: str, impl: str, nbytes: int) -> CountedCell:
    """The buffers and the call of a case for ``impl`` (RuntimeError naming what is missing)."""
    import torch
    import torch.distributed as dist

    hidden = int(w.cfg.extra.get("hidden", DEFAULT_HIDDEN))
    n, r, dev = w.world, w.rank, w.device
    row = hidden * w.esz
    if nbytes % (row * n):
        raise RuntimeError(f"skipped: {nbytes} bytes are not whole rows of {hidden} {w.cfg.dtype} for each of {n} ranks")
    counts = counts_for(CASES[coll], n, nbytes // row // n)
    sends = counts[r]
    recvs = [counts[p][r] for p in range(n)]
    cap = max(sum(counts[p][q] for p in range(n)) for q in range(n))
    x = torch.empty(sum(sends), hidden, dtype=w.dtype, device=dev)
    out = torch.empty(cap, hidden, dtype=w.dtype, device=dev)
    if impl == "mscclang":
        if w.comm is None:
            raise RuntimeError(f"no mscclang communicator: {w.comm_error}")
        comm = w.comm
        send = torch.tensor(sends, dtype=torch.int32, device=dev)
        comm.all_to_all_v(x, send, out=out)   # sets the plan up, as before a capture
        return CountedCell(lambda: comm.all_to_all_v(x, send, out=out), x, out, counts, hidden,
                           plan=comm.last_all_to_all_v or "fallback")
    if impl == "nccl":
        o = out[: sum(recvs)]
        return CountedCell(lambda: dist.all_to_all_single(o, x, recvs, sends), x, out, counts, hidden,
                           plan="all_to_all_single with splits")
    raise RuntimeError(f"no {impl} implementation of {coll}")


def fill(w: "BenchWorker", cell: CountedCell) -> int:
    """Fresh random rows (per rank) and a poisoned output; the seed :func:`compare` needs."""
    w.seed += 1
    cell.inp.view(-1).copy_(gen_input(w.seed, w.rank, cell.inp.numel(), w.dtype, w.device))
    cell.out.fill_(float("nan"))
    return w.seed


def compare(w: "BenchWorker", cell: CountedCell, seed: int) -> tuple[bool, str]:
    """Whether every row received is its sender's, bit for bit, rank by rank in order."""
    import torch

    n, r, h = w.world, w.rank, cell.row
    at = 0
    for p in range(n):
        k = cell.counts[p][r]
        start = sum(cell.counts[p][:r])
        sent = gen_input(seed, p, sum(cell.counts[p]) * h, w.dtype, w.device).view(-1, h)[start: start + k]
        got = cell.out[at: at + k]
        if not torch.equal(got.view(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8)):
            return False, f"the {k} rows from rank {p} (received at row {at}) differ from what it sent"
        at += k
    return True, ""
