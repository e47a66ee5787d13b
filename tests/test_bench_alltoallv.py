"""The bench's all-to-all-v cases on the CPU: the routings' count matrices, the cells' check
(every row received compared with its sender's, a wrong row fails it), and the command line."""

from __future__ import annotations

import types

import pytest
import torch

from mscclang.bench import alltoallv as a2av
from mscclang.bench.worker import BenchConfig


class _Comm:
    """A one-rank stand-in: all_to_all_v of one rank copies its rows (``wrong``: one row off)."""

    def __init__(self, wrong: bool = False) -> None:
        self.wrong = wrong
        self.last_all_to_all_v = "alltoallv_stub"

    def all_to_all_v(self, x, send, out=None):
        k = int(send.sum())
        out[:k].copy_(x[:k])
        if self.wrong and k:
            out[0].add_(1)
        return out, send.clone()


def _worker(comm, hidden=16):
    cfg = BenchConfig(colls=["all_to_all_v"], sizes=[], impls=["mscclang"], modes=["graph"], dtype="bfloat16",
                      extra={"hidden": hidden})
    return types.SimpleNamespace(cfg=cfg, world=1, rank=0, esz=2, dtype=torch.bfloat16, device=torch.device("cpu"),
                                 comm=comm, comm_error=None, seed=1)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_routings_send_the_same_rows_and_skew_them(n):
    for rows in (1, 4, 4096):
        u, s = a2av.counts_for("uniform", n, rows), a2av.counts_for("skewed", n, rows)
        assert all(sum(r) == n * rows for r in u + s)
        assert all(v >= 0 for r in s for v in r)
        assert max(max(r) for r in s) > rows                 # one receiver per sender takes most
        if rows == 1:
            assert any(v == 0 for r in s for v in r)         # zeros among the counts


def test_the_check_compares_every_row_bit_for_bit():
    w = _worker(_Comm())
    cell = a2av.make_cell(w, "all_to_all_v", "mscclang", 3 * 16 * 2)
    seed = a2av.fill(w, cell)
    cell.op()
    assert a2av.compare(w, cell, seed) == (True, "")
    assert cell.plan == "alltoallv_stub"
    w = _worker(_Comm(wrong=True))
    cell = a2av.make_cell(w, "all_to_all_v_skewed", "mscclang", 3 * 16 * 2)
    seed = a2av.fill(w, cell)
    cell.op()
    ok, why = a2av.compare(w, cell, seed)
    assert not ok and "the 3 rows from rank 0" in why


def test_sizes_that_are_not_whole_rows_are_skipped():
    with pytest.raises(RuntimeError, match="skipped: 40 bytes are not whole rows of 16 bfloat16"):
        a2av.make_cell(_worker(_Comm()), "all_to_all_v", "mscclang", 40)


def test_command_line_makes_the_cases_configuration():
    from mscclang.cli.bench_cmd import bench_config
    from mscclang.cli.main import build_parser

    parse_args = build_parser().parse_args

    cfg = bench_config(parse_args(["bench", "--collectives", "all_to_all_v,all_to_all_v_skewed", "--hidden", "4096"]))
    assert cfg.colls == ["all_to_all_v", "all_to_all_v_skewed"] and cfg.extra["hidden"] == 4096
    assert a2av.sizes(cfg, 2, 8)[0] == 8 * 4096 * 2
    cfg = bench_config(parse_args(["bench", "--collectives", "all_to_all_v"]))
    assert cfg.extra["hidden"] == a2av.DEFAULT_HIDDEN == 7168
    assert len(a2av.sizes(cfg, 2, 2)) == len(a2av.ROWS_PER_PEER)
