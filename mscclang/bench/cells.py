"""One benchmark cell (the buffers and the call of one collective, implementation and size) and
the inputs the cells are filled with, shared by the worker and the fused case."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional


def gen_input(seed: int, rank: int, numel: int, dtype: Any, device: Any) -> Any:
    """Rank ``rank``'s input for a cell (every process can regenerate every rank's)."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed * 1000003 + rank)
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, (numel,), generator=g, device=device, dtype=dtype)
    return torch.randn(numel, generator=g, device=device, dtype=torch.float32).to(dtype)


class Cell:
    """Buffers and the call of one (collective, impl, size). ``capture``, when set, returns the
    context manager a CUDA-graph capture of the call runs inside (``comm.graph_capture()`` for
    ordinary tensors)."""

    def __init__(self, op: Callable[[], Any], inp: Any, out: Any, numel_in: int, plan: str = "",
                 capture: Optional[Callable[[], ContextManager[Any]]] = None) -> None:
        self.op = op
        self.inp = inp
        self.out = out
        self.numel_in = numel_in
        self.plan = plan
        self.capture = capture
        self.keep: list[Any] = []
