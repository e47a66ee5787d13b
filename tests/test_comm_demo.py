"""The main job's CPU path: the Communicator over the shipped plans on the simulator."""

import pytest

from mscclang.cli.main import main
from mscclang.comm.catalog import default_plans_dir


def test_demo_on_simulator(capsys):
    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    assert main(["demo", "--cpu", "--sizes", "1K"]) == 0
    out = capsys.readouterr().out
    assert "CPU simulator" in out
    lines = [line for line in out.splitlines() if line.startswith(("all_reduce", "all_gather"))]
    assert len(lines) == 2 and all(" ok " in line for line in lines)
    assert "allreduce_oneshot_ll" in lines[0]
