"""The bench's MoE cases on the CPU: the routings, the mscclang cell run by the simulator at 2 and
4 ranks with its check (a wrong row, a wrong combine fail it), the case families' record and the
command line."""

from __future__ import annotations

import types

import pytest
import torch

from mscclang.bench import moe
from mscclang.bench.families import family_of
from mscclang.bench.worker import BenchConfig
from mscclang.comm.sim_ranks import run_ranks
from tests.harness.sim_plans import library_plans

H = 16


def _worker(comm, rank, world):
    cfg = BenchConfig(colls=["moe"], sizes=[], impls=["mscclang"], modes=["graph"], dtype="bfloat16",
                      extra={"hidden": H})
    return types.SimpleNamespace(cfg=cfg, world=world, rank=rank, esz=2, dtype=torch.bfloat16,
                                 device=torch.device("cpu"), comm=comm, comm_error=None, seed=1)


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_routings_pick_distinct_experts_and_skew_them(kind):
    idx, w = moe.routing(kind, 3, 1, 4096, 64, 8)
    assert idx.shape == (4096, 8) and w.shape == (4096, 8)
    assert all(len(set(row)) == 8 for row in idx[:64].tolist())
    assert torch.allclose(w.sum(1), torch.ones(4096))
    load = torch.bincount(idx.view(-1), minlength=64).float()
    if kind == "uniform":
        assert load.max() < 1.5 * load.mean()
    else:
        assert load[0] > 3 * load[32:].mean()
    again, _ = moe.routing(kind, 3, 1, 4096, 64, 8)
    assert torch.equal(idx, again)                     # every rank draws every rank's routing alike


class _Wrong:
    """A communicator whose dispatch (``what`` = "dispatch") or combine corrupts one row."""

    def __init__(self, comm, what):
        self.comm, self.what = comm, what
        self.last_all_to_all_v = comm.last_all_to_all_v

    def moe_dispatch(self, *a, **kw):
        rows, counts, h = self.comm.moe_dispatch(*a, **kw)
        if self.what == "dispatch" and int(counts[0]):
            rows = rows.clone()
            rows[0, 0, 0] += 1
        return rows, counts, h

    def moe_combine(self, *a, **kw):
        y = self.comm.moe_combine(*a, **kw)
        return y + 1 if self.what == "combine" else y


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", ["moe", "moe_skewed"])
def test_the_mscclang_cell_passes_its_check_and_a_wrong_row_fails_it(n, case):
    plans = library_plans(["alltoallv_ll", "alltoallv_simple", "allgather_ll"], n)

    def body(comm):
        out = []
        for what in (None, "dispatch", "combine"):
            w = _worker(comm if what is None else _Wrong(comm, what), comm.rank, n)
            cell = moe.make_cell(w, case, "mscclang", 5 * H * 2)
            seed = moe.fill(w, cell)
            cell.op()
            out.append(moe.compare(w, cell, seed))
        return out

    res, _, fb = run_ranks(n, body, plans=plans, engine="sim")
    assert fb.calls == []
    for r in range(n):
        assert res[r][0] == (True, ""), r
        assert not res[r][2][0] and "combine:" in res[r][2][1]
    assert any(not res[r][1][0] and "rows dispatched" in res[r][1][1] for r in range(n))


def test_weighted_sum_is_the_slot_order_fp32_definition():
    slots = torch.randn(3, 4, 8).to(torch.bfloat16)
    w = torch.rand(3, 4)
    acc = torch.zeros(3, 8)
    for j in range(4):
        acc = acc + w[:, j:j + 1] * slots[:, j].float()
    assert torch.equal(moe.weighted_sum(slots, w), acc.to(torch.bfloat16))


def test_the_families_answer_for_every_case():
    assert family_of("moe").modes == moe.MODES and family_of("moe_skewed").impls == moe.IMPLS
    assert family_of("all_to_all_v").modes is None and family_of("all_reduce_add_rms_norm") is not None
    assert family_of("all_reduce") is None


def test_command_line_makes_the_cases_configuration():
    from mscclang.cli.bench_cmd import bench_config
    from mscclang.cli.main import build_parser

    parse_args = build_parser().parse_args
    cfg = bench_config(parse_args(["bench", "--collectives", "moe,moe_skewed", "--hidden", "4096"]))
    assert cfg.colls == ["moe", "moe_skewed"] and cfg.extra["hidden"] == 4096
    assert moe.sizes(cfg, 2, 8) == [t * 4096 * 2 for t in moe.TOKENS]
    cfg = bench_config(parse_args(["bench", "--collectives", "moe", "--sizes", "14K"]))
    assert cfg.extra["moe_sizes"] == [14 * 1024] and cfg.extra["hidden"] == 7168


def test_sizes_that_are_not_whole_rows_are_skipped():
    with pytest.raises(RuntimeError, match="skipped: 40 bytes are not whole rows of 16 bfloat16"):
        moe.make_cell(_worker(None, 0, 1), "moe", "mscclang", 40)
