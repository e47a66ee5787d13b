"""The bench's fused case (``--collectives all_reduce_add_rms_norm``) on the CPU: its cells
check the residual and the norm against torch's reference, a wrong norm fails the check, sizes
that are not whole rows and a missing FlashInfer are skipped with their reason, and the command
line makes the case's configuration."""

from __future__ import annotations

import types

import pytest
import torch

from mscclang.bench import fused
from mscclang.bench.worker import BenchConfig


class _Comm:
    """A one-rank stand-in: the allreduce of one rank is the identity; the fused call is the
    allreduce then the torch epilogue."""

    def prepare_all_reduce_add_rms_norm(self, x, residual, weight, eps, out=None, fp8_scale=None):
        return "fused_plan"

    def all_reduce_add_rms_norm(self, x, residual, weight, eps, out=None, fp8_scale=None):
        fused.torch_epilogue(x, residual, weight, eps, out)
        return out

    def prepare(self, *a, **k):
        return None

    def all_reduce(self, t, op="sum", out=None):
        return t


def _worker(hidden=64):
    cfg = BenchConfig(colls=[fused.FUSED], sizes=[], impls=["mscclang"], modes=["graph"], dtype="bfloat16",
                      extra={"hidden": hidden})
    return types.SimpleNamespace(cfg=cfg, world=1, rank=0, esz=2, dtype=torch.bfloat16, device=torch.device("cpu"),
                                 comm=_Comm(), comm_error=None, seed=1)


@pytest.mark.parametrize("impl", ["mscclang", "unfused"])
def test_a_fused_cell_is_checked_against_torch(impl):
    w = _worker()
    cell = fused.make_cell(w, impl, 3 * 64 * 2)
    seed = fused.fill(w, cell)
    cell.op()
    assert fused.compare(w, cell, seed) == (True, "")
    # a wrong norm is caught
    seed = fused.fill(w, cell)
    cell.op()
    cell.out[1, 5] += 1.0
    ok, err = fused.compare(w, cell, seed)
    assert not ok and err.startswith("norm: 1 of 192 elements wrong")


def test_sizes_that_are_not_rows_and_a_missing_flashinfer_are_skipped(monkeypatch):
    import sys

    w = _worker()
    with pytest.raises(RuntimeError, match="skipped: 100 bytes are not whole rows of 64"):
        fused.make_cell(w, "mscclang", 100)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.comm", None)
    with pytest.raises(RuntimeError, match="skipped: flashinfer is not available"):
        fused.make_cell(w, "flashinfer", 128)


def test_default_sizes_are_tokens_of_the_hidden_size():
    w = _worker(8192)
    assert fused.fused_sizes(w.cfg, 2) == [t * 8192 * 2 for t in fused.DEFAULT_TOKENS]


def test_the_command_line_makes_the_fused_case():
    from mscclang.cli.bench_cmd import bench_config
    from mscclang.cli.main import build_parser

    ap = build_parser()
    cfg = bench_config(ap.parse_args(["bench", "--collectives", "all_reduce_add_rms_norm", "--hidden", "4096",
                                      "--out", "x"]))
    assert cfg.colls == ["all_reduce_add_rms_norm"] and cfg.extra == {"hidden": 4096}
    cfg = bench_config(ap.parse_args(["bench", "--collectives", "all_reduce_add_rms_norm", "--sizes", "16K,32K",
                                      "--out", "x"]))
    assert cfg.extra["fused_sizes"] == [16384, 32768]
