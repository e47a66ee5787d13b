"""Expert-parallel dispatch and combine on all-to-all-v: :meth:`Communicator.moe_dispatch` and
:meth:`Communicator.moe_combine`.

Experts are spread over the ranks in order: expert ``e`` lives on rank ``e // L``, ``L =
num_experts // world``. Each (token, slot) of ``topk_idx`` whose expert is not ``-1`` (a dropped
slot) sends the token's row to its expert's rank, once per slot (two slots on one rank send it
twice: every expert gets its own row). Everything runs on the device with static shapes, so a
CUDA graph captures a layer and replays it with new routing:

1. **Routing.** Each slot's expert count is a one-hot sum (no atomics), the slots are sorted
   stably by (rank, local expert), so each rank's rows leave in (local expert, token, slot) order.
2. **Counts.** An all-gather of every rank's per-expert counts gives every rank the ``[world,
   num_experts]`` matrix; the rows each rank sends are its sums per rank.
3. **The exchange**: :meth:`Communicator.all_to_all_v` into ``L * capacity`` rows.
4. **Layout.** Rank ``r``'s rows arrive by source rank, then local expert, then token: each row's
   place in the expert-major ``[L, capacity, H]`` output (local expert, then source rank, then
   token) comes from prefix sums of the matrix and one ``searchsorted``; rows move with
   ``index_copy_`` onto distinct places.

With ``layout="rank"`` step 4 is skipped: the rows stay as they arrived (``[L * capacity, H]``,
by source rank, then local expert, then token), and the counts come as the ``[world, L]`` matrix of
rows from each rank for each local expert; combine then sends the rows back as they are.

Combine gathers the experts' outputs back into the order they arrived, sends them back with the
reverse all-to-all-v, un-sorts them into (token, slot) order and sums each token's ``k`` rows
with the router's weights **in slot order, in fp32**, then casts: no atomics and no
``index_add_``, so a token's output has the same bits whatever else is in the batch.

Checks: the shapes at once (InvalidCall); expert ids and capacities from the exchanged counts
read on the host once per dispatch when not capturing a CUDA graph (``check=True``; every rank
reads the same matrix, so every rank raises alike). Inside a capture nothing is read on the host:
an id outside ``-1 .. num_experts - 1`` counts as dropped, and an expert's rows past ``capacity``
are not written (``expert_counts`` still says how many came, so a caller can see it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mscclang.errors import InvalidCall

__all__ = ["MoEHandle", "MoECalls", "LAYOUTS"]

#: the dispatch's output layouts: by local expert (``[L, capacity, H]``, for a grouped GEMM) or as
#: the rows arrived (``[L * capacity, H]``, by source rank, then local expert, then token)
LAYOUTS = ("expert", "rank")


@dataclass
class MoEHandle:
    """What combine needs from its dispatch: the slots' sorted order ``order`` (indexes into the
    flattened ``[T * k]`` slots), the rows each rank sent and received (``send`` / ``recv``,
    device tensors of ``world`` entries), each received row's place in the expert-major buffer
    (``place``, ``L * capacity`` entries; rows not received point past it), the token count,
    ``k``, the slots that were sent (``valid``) and the ``layout`` the rows were returned in."""

    order: Any
    send: Any
    recv: Any
    place: Any
    tokens: int
    k: int
    valid: Any
    local_experts: int
    capacity: int
    layout: str = "expert"


class MoECalls:
    """Dispatch and combine of one rank (see the module docstring): ``rank`` of ``world`` on
    ``device``, the communicator's ``all_gather(inp, out)`` and ``all_to_all_v(x, counts, out,
    capacity)``."""

    def __init__(self, rank: int, world: int, device: Any, all_gather: Callable[..., Any],
                 all_to_all_v: Callable[..., Any]) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.all_gather = all_gather
        self.all_to_all_v = all_to_all_v

    def _shapes(self, tokens: Any, topk_idx: Any, num_experts: Any, capacity: Any) -> tuple[int, int, int]:
        r, n = self.rank, self.world
        what = f"rank {r}: moe_dispatch"
        if getattr(tokens, "dim", lambda: 0)() != 2:
            raise InvalidCall(f"{what}: tokens must be [T, H], got shape {tuple(getattr(tokens, 'shape', ()))}")
        if getattr(topk_idx, "dim", lambda: 0)() != 2 or topk_idx.shape[0] != tokens.shape[0]:
            raise InvalidCall(f"{what}: topk_idx must be [T, k] with T = {tokens.shape[0]} (the tokens' rows), got "
                              f"shape {tuple(getattr(topk_idx, 'shape', ()))}")
        if topk_idx.dtype.is_floating_point:
            raise InvalidCall(f"{what}: topk_idx must hold integer expert ids, got {topk_idx.dtype}")
        for name, v in (("num_experts", num_experts), ("capacity", capacity)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidCall(f"{what}: {name} must be a positive int, got {v!r}")
        if num_experts % n:
            raise InvalidCall(f"{what}: {num_experts} experts do not spread evenly over {n} ranks")
        k = int(topk_idx.shape[1])
        if k > num_experts:
            raise InvalidCall(f"{what}: k = {k} experts per token is more than the {num_experts} experts")
        return k, num_experts // n, num_experts

    def dispatch(self, tokens: Any, topk_idx: Any, num_experts: int, capacity: int,
                 check: bool = True, fp8: bool = False, layout: str = "expert") -> tuple[Any, Any, MoEHandle]:
        """See :meth:`mscclang.comm.communicator.Communicator.moe_dispatch`."""
        import torch

        n, r = self.world, self.rank
        k, L, E = self._shapes(tokens, topk_idx, num_experts, capacity)
        if layout not in LAYOUTS:
            raise InvalidCall(f"rank {r}: moe_dispatch: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        T, H = int(tokens.shape[0]), int(tokens.shape[1])
        if fp8:
            if H % 4:
                raise InvalidCall(f"rank {r}: moe_dispatch: an FP8 row ({H} bytes) and its 4-byte scale travel "
                                  "as one row of whole 4-byte words: H must be a multiple of 4")
            tokens = quantize_rows(tokens).view(torch.int32)   # moved as 4-byte words
            H = (H + 4) // 4
        dev = tokens.device
        e = topk_idx.reshape(-1).to(torch.int64)
        valid = (e >= 0) & (e < E)
        # the rank of each slot, and a key sorting the slots by (rank, local expert), dropped ones last
        key = torch.where(valid, e, torch.full_like(e, E))
        order = torch.argsort(key, stable=True)
        onehot = key.unsqueeze(1) == torch.arange(E + 1, device=dev)
        counts = onehot.sum(0, dtype=torch.int32)                   # [E + 1]: the last bin, dropped or bad
        bad = ((e < -1) | (e >= E)).sum(dtype=torch.int32).reshape(1)
        row = torch.cat([counts[:E], bad])
        table = torch.empty(n, E + 1, dtype=torch.int32, device=dev)
        self.all_gather(row, table.view(-1))
        if check and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _check(table.cpu().tolist(), n, L, E, capacity)
        per_rank = counts[:E].view(n, L)
        send = per_rank.sum(1)                                      # rows to each rank
        local = table[:, r * L: (r + 1) * L]                        # [n, L]: rows rank p sends my experts
        recv = local.sum(1)
        x = tokens[order // k]                                      # the rows, in send order (dropped last)
        out = tokens.new_empty((L * capacity, H))
        self.all_to_all_v(x, send, out, L * capacity)
        shape: tuple[int, ...] = (L * capacity,)
        if layout == "rank":   # the rows as they arrived, and how many came from each rank for each expert
            handle = MoEHandle(order, send, recv, None, T, k, valid, L, capacity, layout)
            rows, expert_counts = out, local
        else:
            place = _places(local, L, capacity, n)
            expert = tokens.new_zeros((L * capacity + 1, H))
            expert.index_copy_(0, place, out)
            expert_counts = local.sum(0)
            handle = MoEHandle(order, send, recv, place, T, k, valid, L, capacity)
            rows, shape = expert[: L * capacity], (L, capacity)
        if fp8:   # each row: the bytes of float8_e4m3fn, then its float32 scale
            b = rows.view(torch.uint8)
            q = b[:, :-4].contiguous().view(torch.float8_e4m3fn).view(*shape, -1)
            return (q, b[:, -4:].contiguous().view(torch.float32).view(shape)), expert_counts, handle
        return rows.view(*shape, H), expert_counts, handle

    def combine(self, expert_out: Any, topk_weights: Any, handle: MoEHandle) -> Any:
        """See :meth:`mscclang.comm.communicator.Communicator.moe_combine`."""
        import torch

        h = handle
        L, C = h.local_experts, h.capacity
        what = f"rank {self.rank}: moe_combine"
        lead = (L * C,) if h.layout == "rank" else (L, C)
        dims = len(lead) + 1
        if getattr(expert_out, "dim", lambda: 0)() != dims or tuple(expert_out.shape[:dims - 1]) != lead:
            want = ", ".join(str(d) for d in lead)
            raise InvalidCall(f"{what}: expert_out must be [{want}, H] (the dispatch's {h.layout}-major layout), "
                              f"got shape {tuple(getattr(expert_out, 'shape', ()))}")
        if getattr(topk_weights, "shape", None) is None or tuple(topk_weights.shape) != (h.tokens, h.k):
            raise InvalidCall(f"{what}: topk_weights must be [{h.tokens}, {h.k}] (the dispatch's tokens and k), got "
                              f"shape {tuple(getattr(topk_weights, 'shape', ()))}")
        H = int(expert_out.shape[-1])
        if h.layout == "rank":
            back = expert_out                                       # already in the order they arrived
        else:
            flat = torch.cat([expert_out.reshape(L * C, H), expert_out.new_zeros((1, H))])
            back = flat[h.place]                                    # rows in the order they arrived
        rows = expert_out.new_zeros((h.tokens * h.k, H))            # in send order, then un-sorted below
        self.all_to_all_v(back, h.recv, rows, L * C)               # a slot: what one expert rank sent
        slots = torch.empty_like(rows)
        slots.index_copy_(0, h.order, rows)                         # slot s = t * k + j
        slots = slots.view(h.tokens, h.k, H)
        w = torch.where(h.valid.view(h.tokens, h.k), topk_weights.float(), torch.zeros((), device=rows.device))
        acc = torch.zeros((h.tokens, H), dtype=torch.float32, device=rows.device)
        for j in range(h.k):                                        # slot order, fp32: the same bits at any T
            acc = acc + torch.where(w[:, j:j + 1] != 0, w[:, j:j + 1] * slots[:, j].float(), 0.0)
        return acc.to(expert_out.dtype)


#: the largest finite float8_e4m3fn: a row's scale maps its largest magnitude onto it
FP8_MAX = 448.0


def quantize_rows(x: Any) -> Any:
    """The FP8 payload of rows ``x`` (``[T, H]``): per row ``scale = max|x| / 448`` (1 for a zero
    row), ``q = (x / scale)`` as float8_e4m3fn (round to nearest even, in range by construction),
    laid out as one uint8 row of ``H`` bytes of ``q`` then the 4 bytes of ``scale`` (float32):
    ``x`` is about ``q.float() * scale``. Both divisions are IEEE float32 divisions of two tensors,
    so the bytes are the same on every device: torch's CUDA division by a Python number multiplies
    by its reciprocal instead, and ``1/448`` is not a float32, so a CUDA rank's scales would differ
    in the last bit from a CPU rank's (and from the reference)."""
    import torch

    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (xf / scale).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8).view(-1, 4)], dim=1)


def _places(local: Any, L: int, C: int, n: int) -> Any:
    """Each received row's place in the expert-major buffer (``L * C`` rows; ``L * C`` for a row
    not received or past its expert's capacity): rows arrive by source rank ``p``, then local
    expert ``l``, then token; place ``l * C + (rows of l from ranks before p) + i``."""
    import torch

    dev = local.device
    sizes = local.reshape(-1).to(torch.int64)                   # segments in (p, l) order
    ends = torch.cumsum(sizes, 0)
    starts = ends - sizes
    rho = torch.arange(L * C, device=dev)
    seg = torch.searchsorted(ends, rho, right=True).clamp(max=n * L - 1)
    i = rho - starts[seg]
    p, l = seg // L, seg % L
    before = torch.cumsum(local.to(torch.int64), 0) - local.to(torch.int64)   # [n, L]: rows of l from ranks < p
    within = before[p, l] + i
    place = l * C + within
    ok = (rho < ends[-1]) & (within < C)
    return torch.where(ok, place, torch.full_like(place, L * C))


def _check(table: list[list[int]], n: int, L: int, E: int, capacity: int) -> None:
    """The exchanged counts read on the host: every rank's expert ids in range, no expert over
    its capacity (InvalidCall naming them; every rank reads the same table)."""
    for p in range(n):
        if table[p][E]:
            raise InvalidCall(f"rank {p}: moe_dispatch: {table[p][E]} expert id(s) outside -1 .. {E - 1} (-1: a dropped "
                              "slot)")
    for e in range(E):
        got = sum(table[p][e] for p in range(n))
        if got > capacity:
            raise InvalidCall(f"moe_dispatch: expert {e} (rank {e // L}) gets {got} rows, more than its capacity of "
                              f"{capacity}")
