"""The MoE cases of the benchmark: one expert-parallel layer's dispatch, a stand-in expert and the
combine, as a serving engine runs them at every decode or prefill step.

Two cases, by their routing: ``moe`` (each token's ``k`` experts drawn uniformly, without
repetition) and ``moe_skewed`` (drawn with weights ``1 / sqrt(1 + e)``, so the first experts, and
rank 0, take a large share). ``32 x world`` experts (256 at 8 ranks, DeepSeek-V3's count), top-8,
rows of ``--hidden`` elements (default 7168). A size is the bytes of one rank's tokens (``T x
hidden``), 1 to 4096 tokens per rank. The routing is fixed per cell (every rank draws every rank's
from the cell's seed, so each knows the whole load and the capacity: the busiest expert's rows);
the tokens are fresh random data at every check. The stand-in expert multiplies expert ``e``'s
rows by ``2^-(e mod 3)`` (exact), so a row that reached the wrong expert shows.

Columns, each checked before it is timed (the dispatched rows of every local expert against the
senders' tokens, in (source rank, token) order; the combined rows bit for bit against a plain torch
reference: the ``k`` weighted rows summed in slot order in fp32):

* ``mscclang``: ``comm.moe_dispatch`` (routing, count exchange and all-to-all-v on the device, no
  host synchronisation), the expert, ``comm.moe_combine``;
* ``nccl``: the usual torch layer: per-expert counts exchanged with ``all_to_all_single``, read on
  the host (one synchronisation), the rows sorted by expert, ``all_to_all_single`` with splits,
  a stable sort into expert order; combine the reverse, then the same fp32 sum;
* ``deepep``: DeepEP's intranode ``Buffer.dispatch`` / ``Buffer.combine`` when ``deep_ep`` is
  installed (its own semantics: a token goes once to each rank holding one of its experts and comes
  back summed over ranks, so the check is its own), else recorded as skipped.

Modes: ``fresh`` (one dispatch -> expert -> combine from an idle GPU, all ranks started together:
what a request that arrives alone sees), ``chain`` (128 such pairs back to back with no host
synchronisation, a CUDA event between two pairs: the period of each, p50 in ``us`` and p99 in the
record's ``extra``) and ``graph`` (the same calls captured in one CUDA graph: the mean period).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional

from mscclang.bench.alltoallv import fill  # fresh random rows per rank, a poisoned output: the same here
from mscclang.bench.cells import Cell, gen_input

if TYPE_CHECKING:
    from mscclang.bench.worker import BenchWorker

__all__ = ["CASES", "IMPLS", "MODES", "DEFAULT_HIDDEN", "TOKENS", "CHAIN", "sizes", "routing", "make_cell", "fill",
           "compare", "measure"]

#: case name -> routing
CASES = {"moe": "uniform", "moe_skewed": "skewed"}
#: the columns, in table order
IMPLS = ("mscclang", "nccl", "deepep")
#: the modes a MoE cell is timed in
MODES = ("fresh", "chain", "graph")
DEFAULT_HIDDEN = 7168
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
#: dispatch -> combine pairs of one ``chain`` block
CHAIN = 128
TOP_K = 8
EXPERTS_PER_RANK = 32


def sizes(cfg: Any, esz: int, n: int) -> list[int]:
    """The byte sizes (one rank's tokens): ``cfg.extra["moe_sizes"]`` when given, else
    :data:`TOKENS` tokens of ``cfg.extra["hidden"]`` elements."""
    row = int(cfg.extra.get("hidden", DEFAULT_HIDDEN)) * esz
    return list(cfg.extra.get("moe_sizes") or [t * row for t in TOKENS])


def routing(kind: str, seed: int, rank: int, tokens: int, experts: int, k: int) -> tuple[Any, Any]:
    """Rank ``rank``'s routing on the CPU: ``topk_idx`` ``[tokens, k]`` (int64, distinct experts
    per token) and ``topk_weights`` ``[tokens, k]`` (float32, a softmax), from ``seed``."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed * 7919 + rank)
    w = torch.ones(experts) if kind == "uniform" else 1.0 / torch.sqrt(1.0 + torch.arange(experts, dtype=torch.float32))
    idx = torch.multinomial(w.expand(max(tokens, 1), experts), k, replacement=False, generator=g)[:tokens]
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=1)
    return idx, weights


def expert_scale(e: Any) -> Any:
    """The stand-in expert's factor for expert id(s) ``e``: ``2^-(e mod 3)``."""
    return 2.0 ** -(e % 3)


class MoECell(Cell):
    """A MoE cell: ``inp`` this rank's tokens, ``out`` the combined rows, ``idx`` / ``weights``
    every rank's routing (CPU tensors, indexed by rank), ``experts``, ``dispatched()`` this rank's
    local experts' received rows (a list of ``[rows, H]``, read after a checked call)."""

    def __init__(self, op: Callable[[], Any], x: Any, out: Any, idx: list, weights: list, experts: int,
                 dispatched: Callable[[], list], plan: str = "", own_check: Optional[Callable[..., Any]] = None) -> None:
        super().__init__(op, x, out, x.numel(), plan=plan)
        self.idx, self.weights, self.experts = idx, weights, experts
        self.dispatched = dispatched
        self.own_check = own_check


def make_cell(w: "BenchWorker", case: str, impl: str, nbytes: int) -> MoECell:
    """The buffers and the call of a MoE case for ``impl`` (RuntimeError naming what is missing)."""
    import torch

    hidden = int(w.cfg.extra.get("hidden", DEFAULT_HIDDEN))
    row = hidden * w.esz
    if nbytes % row:
        raise RuntimeError(f"skipped: {nbytes} bytes are not whole rows of {hidden} {w.cfg.dtype}")
    n, r, dev = w.world, w.rank, w.device
    T, E = nbytes // row, EXPERTS_PER_RANK * n
    k = min(TOP_K, E)
    w.seed += 1
    routes = [routing(CASES[case], w.seed, p, T, E, k) for p in range(n)]
    idx = [i for i, _ in routes]
    weights = [x for _, x in routes]
    load = torch.bincount(torch.cat(idx).view(-1), minlength=E)
    capacity = max(1, int(load.max()))
    x = torch.empty(T, hidden, dtype=w.dtype, device=dev)
    out = torch.empty(T, hidden, dtype=w.dtype, device=dev)
    my_idx, my_w = idx[r].to(dev), weights[r].to(dev)
    L = E // n
    scale = expert_scale(torch.arange(r * L, (r + 1) * L, device=dev)).to(w.dtype).view(L, 1, 1)
    if impl == "mscclang":
        if w.comm is None:
            raise RuntimeError(f"no mscclang communicator: {w.comm_error}")
        comm = w.comm
        last: dict = {}

        def op() -> None:
            rows, counts, handle = comm.moe_dispatch(x, my_idx, E, capacity=capacity, check=False)
            last["rows"], last["counts"] = rows, counts
            out.copy_(comm.moe_combine(rows * scale, my_w, handle))

        def dispatched() -> list:
            c = last["counts"].tolist()
            return [last["rows"][lx, : c[lx]] for lx in range(L)]
        op()   # sets the plans up, as before a capture
        return MoECell(op, x, out, idx, weights, E, dispatched, plan=f"moe on {comm.last_all_to_all_v or 'fallback'}")
    if impl == "nccl":
        return _torch_cell(w, x, out, idx, weights, E, my_idx, my_w, scale)
    if impl == "deepep":
        return _deepep_cell(w, x, out, idx, weights, E, my_idx, my_w)
    raise RuntimeError(f"no {impl} implementation of {case}")


def _torch_cell(w: "BenchWorker", x: Any, out: Any, idx: list, weights: list, E: int, my_idx: Any, my_w: Any,
                scale: Any) -> MoECell:
    """The torch layer on NCCL (see the module docstring)."""
    import torch
    import torch.distributed as dist

    n, dev = w.world, w.device
    L = E // n
    T, k = my_idx.shape
    last: dict = {}

    def op() -> None:
        key = my_idx.reshape(-1)
        order = torch.argsort(key, stable=True)
        per_expert = torch.bincount(key, minlength=E)
        got = torch.empty_like(per_expert)
        dist.all_to_all_single(got, per_expert)                  # [p * L + l]: rows p sends my expert l
        send = per_expert.view(n, L).sum(1).tolist()              # the host synchronisation
        got_l = got.tolist()
        recv = [sum(got_l[p * L: (p + 1) * L]) for p in range(n)]
        rows = x[order // k]
        arrived = rows.new_empty((sum(recv), rows.shape[1]))
        dist.all_to_all_single(arrived, rows, recv, send)
        expert_of = torch.arange(L, device=dev).repeat(n).repeat_interleave(got)
        perm = torch.argsort(expert_of, stable=True)              # expert-major: (expert, source rank, token)
        packed = arrived[perm]
        last["packed"], last["counts"] = packed, got.view(n, L).sum(0)
        y = packed * scale.view(L, 1)[expert_of[perm]]
        back = torch.empty_like(y)
        back[perm] = y                                            # arrival order again
        returned = rows.new_empty(rows.shape)
        dist.all_to_all_single(returned, back, send, recv)
        slots = torch.empty_like(returned)
        slots[order] = returned
        out.copy_(weighted_sum(slots.view(T, k, -1), my_w))

    def dispatched() -> list:
        c = last["counts"].tolist()
        starts = [sum(c[:lx]) for lx in range(L)]
        return [last["packed"][starts[lx]: starts[lx] + c[lx]] for lx in range(L)]
    return MoECell(op, x, out, idx, weights, E, dispatched, plan="all_to_all_single with splits + torch permutes")


def weighted_sum(slots: Any, weights: Any) -> Any:
    """Each token's ``k`` rows (``slots`` ``[T, k, H]``) times their weights (``[T, k]``), summed
    in slot order in fp32 and cast back: the combine's definition."""
    import torch

    acc = torch.zeros(slots.shape[0], slots.shape[2], dtype=torch.float32, device=slots.device)
    wf = weights.float()
    for j in range(slots.shape[1]):
        acc = acc + torch.where(wf[:, j:j + 1] != 0, wf[:, j:j + 1] * slots[:, j].float(), 0.0)
    return acc.to(slots.dtype)


def _deepep_cell(w: "BenchWorker", x: Any, out: Any, idx: list, weights: list, E: int, my_idx: Any,
                 my_w: Any) -> MoECell:
    """DeepEP's intranode dispatch and combine, when installed. A token goes once to each rank
    holding one of its experts and combine sums what comes back over ranks: the check is that every
    rank got each of its tokens and that the identity expert's combine gives ``x`` times the number
    of ranks it went to."""
    import torch
    import torch.distributed as dist

    try:
        import deep_ep
    except Exception as e:  # noqa: BLE001 - not installed, or it fails to import here
        raise RuntimeError(f"skipped: deep_ep is not available ({type(e).__name__}: {e})") from None
    if w.world > 8:
        raise RuntimeError("skipped: DeepEP's intranode mode serves at most 8 ranks")
    nbytes = max(int(x.numel() * x.element_size() * w.world * 2), 1 << 24)
    buf = w.__dict__.get("_deepep_buffer")
    if buf is None or getattr(buf, "_mscclang_bytes", 0) < nbytes:
        buf = deep_ep.Buffer(dist.group.WORLD, nbytes, 0)
        buf._mscclang_bytes = nbytes
        w._deepep_buffer = buf
    topk = my_idx.to(torch.int64)
    last: dict = {}

    def op() -> None:
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        recv_x, _, _, counts, handle, _ = buf.dispatch(x, topk_idx=topk, topk_weights=my_w,
                                                       num_tokens_per_rank=per_rank,
                                                       num_tokens_per_rdma_rank=per_rdma,
                                                       is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        last["recv"] = recv_x
        combined, _, _ = buf.combine(recv_x, handle)
        out.copy_(combined)

    def own_check(seed: int) -> tuple[bool, str]:
        L = E // w.world
        ranks = (topk // L)
        hits = torch.zeros(topk.shape[0], w.world, dtype=torch.bool, device=topk.device)
        hits.scatter_(1, ranks, True)
        want = (x.float() * hits.sum(1, keepdim=True).float())
        bad = (out.float() - want).abs() > 1e-2 * (want.abs() + 1)
        if bool(bad.any()):
            return False, f"deepep combine: {int(bad.sum())} elements differ from x times its ranks"
        return True, ""
    return MoECell(op, x, out, idx, weights, E, lambda: [], plan="deep_ep intranode", own_check=own_check)


def compare(w: "BenchWorker", cell: MoECell, seed: int) -> tuple[bool, str]:
    """The dispatched rows of every local expert (the senders' tokens, by source rank then token)
    and the combined rows (bit for bit: the plain torch reference of the module docstring)."""
    import torch

    if cell.own_check is not None:
        return cell.own_check(seed)
    n, r, dev = w.world, w.rank, w.device
    T, H = cell.inp.shape
    L = cell.experts // n
    xs = [gen_input(seed, p, T * H, w.dtype, dev).view(T, H) for p in range(n)]
    got = cell.dispatched()
    for lx in range(L):
        e = r * L + lx
        want = torch.cat([xs[p][(cell.idx[p] == e).any(1).to(dev)] for p in range(n)])
        if got[lx].shape != want.shape or not torch.equal(got[lx].view(torch.uint8), want.view(torch.uint8)):
            return False, (f"expert {e}: {tuple(got[lx].shape)} rows dispatched, want {tuple(want.shape)} "
                           "(the senders' tokens by source rank, then token)")
    idx = cell.idx[r].to(dev)
    scale = expert_scale(idx).to(w.dtype)
    slots = xs[r].unsqueeze(1) * scale.unsqueeze(2)             # [T, k, H]: expert e's output of the token
    want = weighted_sum(slots, cell.weights[r].to(dev))
    if not torch.equal(cell.out.view(torch.uint8), want.view(torch.uint8)):
        bad = int((cell.out != want).sum())
        return False, f"combine: {bad} of {want.numel()} elements differ from the fp32 slot-order reference"
    return True, ""


def measure(w: "BenchWorker", cell: MoECell, mode: str, iters: int) -> list[float]:
    """Sorted microsecond samples of ``cell`` in ``mode`` (see the module docstring): ``fresh``
    one per timed call, ``chain`` one per pair period of :data:`CHAIN`-pair blocks, ``graph``
    the worker's graph timing."""
    import torch

    if mode == "graph":
        return w.measure(cell, "graph", iters)
    for _ in range(w.cfg.warmup):
        cell.op()
    torch.cuda.synchronize()
    times: list[float] = []
    for _ in range(w.cfg.blocks):
        pairs = CHAIN if mode == "chain" else max(1, min(iters, 20))
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(pairs + 1)]
        if mode == "chain":
            w.barrier()
            torch.cuda.synchronize()
            ev[0].record()
            for i in range(pairs):
                cell.op()
                ev[i + 1].record()
            ev[-1].synchronize()
            times += [ev[i].elapsed_time(ev[i + 1]) * 1000.0 for i in range(pairs)]
        else:
            for _ in range(pairs):
                w.barrier()
                torch.cuda.synchronize()
                ev[0].record()
                cell.op()
                ev[1].record()
                ev[1].synchronize()
                times.append(ev[0].elapsed_time(ev[1]) * 1000.0)
    if not all(math.isfinite(t) for t in times):
        raise RuntimeError("a timing event gave a non-finite time")
    return sorted(times)
