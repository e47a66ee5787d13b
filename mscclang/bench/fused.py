"""The fused case of the benchmark, ``all_reduce_add_rms_norm``: a tensor-parallel layer's
allreduce followed by the residual add and the RMSNorm, as serving engines run it.

Columns (implementations), each checked on fresh random data before it is timed:

* ``mscclang``: the fused call ``comm.all_reduce_add_rms_norm(x, residual, weight, eps)`` (one
  plan whose ops include the epilogue), prepared first;
* ``unfused``: mscclang's ``all_reduce`` then torch's add and RMSNorm (in fp32, cast back);
* ``nccl``: NCCL's allreduce (torch.distributed) then the same torch epilogue;
* ``flashinfer``: FlashInfer's ``allreduce_fusion`` (TensorRT-LLM's one-shot/two-shot kernels,
  pattern ``kARResidualRMSNorm``), when ``flashinfer`` is installed; else recorded as skipped.

Sizes are the bytes of ``x``: ``tokens x hidden`` elements (default hidden 8192, 1 to 512 tokens).
Every column updates its residual in place at each call; the fused ones read the same ``x``
again, the unfused ones reduce ``x`` in place (as a layer does), so its values grow over the
timed calls, which does not change the GPU's time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from mscclang.bench.cells import Cell, gen_input

if TYPE_CHECKING:
    from mscclang.bench.worker import BenchWorker

__all__ = ["FUSED", "FUSED_IMPLS", "compare", "fill", "fused_sizes", "make_cell"]

#: the fused case's collective name
FUSED = "all_reduce_add_rms_norm"
#: the fused case's columns, in table order
FUSED_IMPLS = ("mscclang", "unfused", "nccl", "flashinfer")
DEFAULT_HIDDEN = 8192
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
EPS = 1e-6


def fused_sizes(cfg: Any, esz: int) -> list[int]:
    """The byte sizes of the fused case: ``cfg.extra["fused_sizes"]`` when given, else the
    default token counts at ``cfg.extra["hidden"]`` (default 8192) elements per row."""
    hidden = int(cfg.extra.get("hidden", DEFAULT_HIDDEN))
    return list(cfg.extra.get("fused_sizes") or [t * hidden * esz for t in DEFAULT_TOKENS])


def torch_epilogue(s: Any, residual: Any, weight: Any, eps: float, out: Any) -> None:
    """``residual += s`` (in fp32, rounded once), then ``out = RMSNorm(residual) * weight`` in fp32
    and cast: what an application runs after a plain allreduce."""
    import torch

    r = residual.float().add_(s.float())
    residual.copy_(r)
    r = residual.float()
    inv = torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    out.copy_(r.mul_(inv).mul_(weight.float()))


class FusedCell(Cell):
    """A fused-case cell: ``inp`` is x, ``out`` where the norm lands, ``residual`` the residual
    the call updates in place, ``residual_out`` where the updated residual lands (the residual
    itself, but for FlashInfer) and ``weight`` the norm's weight."""

    def __init__(self, op: Any, x: Any, out: Any, residual: Any, weight: Any, residual_out: Optional[Any] = None,
                 plan: str = "") -> None:
        super().__init__(op, x, out, x.numel(), plan=plan)
        self.residual = residual
        self.weight = weight
        self.residual_out = residual if residual_out is None else residual_out


def make_cell(w: "BenchWorker", impl: str, nbytes: int) -> FusedCell:
    """The buffers and the call of the fused case for ``impl`` at ``nbytes`` of x (RuntimeError
    naming what is missing: a size not made of whole rows, no communicator, no FlashInfer)."""
    import torch
    import torch.distributed as dist

    hidden = int(w.cfg.extra.get("hidden", DEFAULT_HIDDEN))
    row = hidden * w.esz
    if nbytes % row:
        raise RuntimeError(f"skipped: {nbytes} bytes are not whole rows of {hidden} {w.cfg.dtype}")
    tokens, dt, dev = nbytes // row, w.dtype, w.device
    x = torch.empty(tokens, hidden, dtype=dt, device=dev)
    residual = torch.empty_like(x)
    weight = torch.empty(hidden, dtype=dt, device=dev)
    if impl in ("mscclang", "unfused") and w.comm is None:
        raise RuntimeError(f"no mscclang communicator: {w.comm_error}")
    if impl == "mscclang":
        comm = w.comm
        out = torch.empty_like(x)
        plan = comm.prepare_all_reduce_add_rms_norm(x, residual, weight, EPS, out=out) or "fallback"
        return FusedCell(lambda: comm.all_reduce_add_rms_norm(x, residual, weight, EPS, out=out), x, out,
                         residual, weight, plan=plan)
    if impl in ("unfused", "nccl"):
        # the allreduce in place on x, as a layer runs it on its GEMM's output (x then grows
        # call after call; the GPU's time does not depend on the values)
        out = torch.empty_like(x)
        if impl == "unfused":
            comm = w.comm
            comm.prepare("all_reduce", x.view(-1))

            def reduce() -> None:
                comm.all_reduce(x.view(-1))
        else:
            def reduce() -> None:
                dist.all_reduce(x)

        def op() -> None:
            reduce()
            torch_epilogue(x, residual, weight, EPS, out)
        return FusedCell(op, x, out, residual, weight, plan="allreduce + torch epilogue")
    if impl == "flashinfer":
        return _flashinfer_cell(w, x, residual, weight, tokens, hidden)
    raise RuntimeError(f"no {impl} implementation of {FUSED}")


def _flashinfer_cell(w: "BenchWorker", x: Any, residual: Any, weight: Any, tokens: int, hidden: int) -> FusedCell:
    import torch

    try:
        import flashinfer.comm as fic
    except Exception as e:  # noqa: BLE001 - not installed, or it fails to import here
        raise RuntimeError(f"skipped: flashinfer is not available ({type(e).__name__}: {e})") from None
    if not hasattr(fic, "allreduce_fusion") or not hasattr(fic, "create_allreduce_fusion_workspace"):
        raise RuntimeError("skipped: this flashinfer has no allreduce_fusion API")
    key = ("flashinfer", tokens, hidden)
    ws = w.__dict__.setdefault("_fi_workspaces", {}).get(key)
    if ws is None:
        ws = fic.create_allreduce_fusion_workspace(backend="trtllm", world_size=w.world, rank=w.rank,
                                                   max_token_num=tokens, hidden_dim=hidden, dtype=w.dtype)
        w._fi_workspaces[key] = ws
    norm_out, res_out = torch.empty_like(x), torch.empty_like(x)
    pattern = fic.AllReduceFusionPattern.kARResidualRMSNorm

    def op() -> None:
        fic.allreduce_fusion(input=x, workspace=ws, pattern=pattern, launch_with_pdl=False,
                             residual_out=res_out, norm_out=norm_out, residual_in=residual, rms_gamma=weight,
                             rms_eps=EPS)
    return FusedCell(op, x, norm_out, residual, weight, residual_out=res_out, plan="trtllm allreduce_fusion")


def fill(w: "BenchWorker", cell: FusedCell) -> int:
    """Fresh random x (per rank), residual and weight (the same on every rank, as tensor
    parallelism has them), poisoned outputs; the seed :func:`compare` needs."""
    w.seed += 1
    n, dt, dev, k = w.world, w.dtype, w.device, cell.inp.numel()
    cell.inp.view(-1).copy_(gen_input(w.seed, w.rank, k, dt, dev))
    cell.residual.view(-1).copy_(gen_input(w.seed, n, k, dt, dev))
    cell.weight.copy_(gen_input(w.seed, n + 1, cell.weight.numel(), dt, dev))
    cell.out.fill_(float("nan"))
    if cell.residual_out is not cell.residual:
        cell.residual_out.fill_(float("nan"))
    return w.seed


def compare(w: "BenchWorker", cell: FusedCell, seed: int) -> tuple[bool, str]:
    """Whether the residual and the norm are torch's reference (the sum of every rank's x in
    fp32, rounded; the residual added in fp32; the norm in fp32), within a few units in the last
    place of the activation dtype scaled by the row's magnitude (the exact definition is checked
    by the tests, not here)."""
    import torch

    from mscclang.plan.dtypes import dtype_info

    n, dt, dev, k = w.world, w.dtype, w.device, cell.inp.numel()
    shape = cell.inp.shape
    acc = sum(gen_input(seed, p, k, dt, dev).float() for p in range(n)).to(dt)
    res_ref = torch.empty(shape, dtype=dt, device=dev).view(-1).copy_(gen_input(seed, n, k, dt, dev)).view(shape)
    out_ref = torch.empty_like(res_ref)
    torch_epilogue(acc.view(shape), res_ref, gen_input(seed, n + 1, shape[-1], dt, dev), EPS, out_ref)
    u = dtype_info(w.cfg.dtype).unit_roundoff
    for name, got, ref in (("residual", cell.residual_out, res_ref), ("norm", cell.out, out_ref)):
        g, r = got.float(), ref.float()
        if not bool(torch.isfinite(g).all()):
            return False, f"non-finite values in the {name} (unwritten or wrong)"
        bound = 8 * (n + 1) * u * (r.abs() + r.abs().mean(-1, keepdim=True))
        bad = (g - r).abs() > bound
        nbad = int(bad.sum())
        if nbad:
            i = int(bad.view(-1).nonzero()[0])
            return False, (f"{name}: {nbad} of {r.numel()} elements wrong; first at {i}: got "
                           f"{float(g.view(-1)[i])}, want {float(r.view(-1)[i])}")
    return True, ""
