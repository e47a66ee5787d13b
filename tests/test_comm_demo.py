"""The main job's CPU path: the Communicator over the shipped plans on the simulator."""

import pytest

from mscclang.cli.main import main
from mscclang.comm.catalog import default_plans_dir
from tests.harness.cli import cli_inproc


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


def _demo_help() -> str:
    import argparse

    from mscclang.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["demo"].format_help()


def test_demo_runs_every_dtype_it_lists_and_refuses_the_others(capsys):
    """Seen: `demo --dtype fp8_e4m3` (the main job's own command) raised AttributeError (torch has
    no float8_e4m3), and the help listed four dtypes while the parser took six."""
    import re

    from mscclang.cli.args import parse_dtype
    from mscclang.plan.dtypes import DTYPES, GPU_DTYPES

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    help_text = " ".join(_demo_help().split())
    listed = [d.name for d in DTYPES if re.search(rf"\b{d.name}\b", help_text.split("--dtype DTYPE", 1)[1])]
    assert listed == list(GPU_DTYPES)
    for d in DTYPES:
        spelling = d.aliases[0]
        if d.name in listed:
            assert parse_dtype(spelling, GPU_DTYPES) == d.name
            assert main(["demo", "--cpu", "--dtype", spelling, "--sizes", "64,1K"]) == 0, d.name
            out = capsys.readouterr().out
            assert f"2 ranks, {d.name}," in out
            lines = [ln for ln in out.splitlines() if ln.startswith(("all_reduce", "all_gather"))]
            assert len(lines) == 4 and all(" ok " in ln for ln in lines), (d.name, out)
        else:
            res = cli_inproc(capsys, "demo", "--cpu", "--dtype", spelling)
            assert res.returncode == 1 and "mscclang demo: error: argument --dtype" in res.stderr, d.name


@pytest.mark.parametrize("size,dtype", [("1", "bf16"), ("3", "bf16"), ("6", "bf16"), ("2", "fp32"),
                                        ("4", "fp32"), ("1", "fp8_e4m3")])
def test_demo_refuses_a_size_it_cannot_split_in_one_line(capsys, size, dtype):
    """Seen: `demo --sizes 3` and `--sizes 1` raised AttributeError ('NoneType' object has no
    attribute 'label': an empty allgather ran no plan); 6 bytes of bf16 ran an allgather of 4."""
    rc = main(["demo", "--cpu", "--sizes", size, "--dtype", dtype])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith(f"mscclang demo: error: --sizes {size}: ") and "multiple of" in err, err
    assert len(err.strip().splitlines()) == 1


def test_readme_demo_sample_names_the_number_of_shipped_plans():
    """The README said "307 shipped plans" while the demo printed 325: the count is part of the
    sample and must be what the demo counts (`mscclang generate-plans` changes it)."""
    import re

    from mscclang.comm.catalog import Catalog

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    readme = (folder.parent / "README.md").read_text()
    said = re.findall(r"\(2 ranks, bfloat16, (\d+) shipped plans\)", readme)
    assert said and {int(n) for n in said} == {len(Catalog.from_dir(folder))}, (
        f"README.md says {said} shipped plans, the catalog holds {len(Catalog.from_dir(folder))}: update the demo sample")
