"""The GPU trust checks' case logic (:class:`tests.harness.trust_checks._Case`) on the CPU
simulator: buffers of every collective and layout, fresh inputs, the call and the exact
comparison. A harness that cannot fail would hide the GPU results it reports, so a corrupted
result must be reported too."""

from __future__ import annotations

import pytest

from mscclang.comm.catalog import Catalog
from mscclang.comm.sim_ranks import run_ranks
from tests.harness.trust_checks import COLLECTIVES, _Case

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("coll", COLLECTIVES)
@pytest.mark.parametrize("inplace", [False, True])
def test_case_checks_every_collective_and_layout(coll, inplace):
    if coll == "broadcast" and not inplace:
        pytest.skip("broadcast is in place only")

    def body(comm):
        c = _Case(comm, coll, 2 * 96, "bfloat16", "sum", False, inplace, 3)
        return c.check(11), c.label()

    res, _, _ = run_ranks(2, body, catalog=Catalog.from_dir(ROOT / "plans"), engine="sim")
    for bad, label in res:
        assert bad is None, (label, bad)


def test_case_reports_a_wrong_result():
    def body(comm):
        c = _Case(comm, "all_reduce", 64, "float32", "sum", False, True, 3)

        def wrong() -> None:
            c.call()
            c.result[5] += 1.0

        return c.check(4, wrong)

    res, _, _ = run_ranks(2, body, catalog=Catalog.from_dir(ROOT / "plans"), engine="sim")
    assert all(r is not None and "first at 5" in r for r in res), res
