"""What ``verify`` says it ran and where it says it (issue 34, items 6, 13 and 17): the summary
line lists the dtypes, reduce ops and packet types of the runs made (no reduce ops for a plan
nothing reduces in, no packets for a plan without packet ops); the report goes to standard output
whether the plan passes or fails, the one-line verdict to standard error; a plan that declares
the LL protocol but has no packet op is a ``protocol`` warning (an error under ``--strict``)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from mscclang.plan.io import load_plan, plan_to_dict
from mscclang.sim import verify
from mscclang.sim.diagnosis import plan_uses

from tests.harness.cli import ROOT, cli_inproc
from tests.harness.shipped import PLANS_DIR, one_per_algorithm
from tests.harness.sim_plans import simple_allgather

verify_module = importlib.import_module("mscclang.sim.verify")   # the package's `verify` is the function

LL_AR = PLANS_DIR / "allreduce_oneshot_ll.r2.i1.inplace.json"      # packets, reductions
SIMPLE_RS = PLANS_DIR / "reducescatter_simple.r2.i16.json"          # reductions, no packets
LL_AG = PLANS_DIR / "allgather_ll.r2.i1.json"                       # packets, no reductions


def _ran(line: str) -> dict[str, list[str]]:
    """``dtypes a, b; reduce ops c; packets d`` of a summary line -> {"dtypes": [a, b], ...}."""
    out = {}
    for part in line.split(": ", 1)[1].split("; "):
        for key in ("dtypes", "reduce ops", "packets"):
            if part.startswith(key + " "):
                out[key] = part[len(key) + 1:].split(", ")
    return out


@pytest.fixture
def recorded(monkeypatch):
    """Every numeric run verify starts: (dtype, reduce op, packet type)."""
    runs: list[tuple[str, str, str]] = []
    real = verify_module.Simulation

    def spy(prog, inputs, **kw):
        if kw.get("nsym") is None:   # the symbolic run checks where bytes go, not values
            runs.append((str(kw["dtype"]), kw["reduce_op"], kw["packet_type"]))
        return real(prog, inputs, **kw)

    monkeypatch.setattr(verify_module, "Simulation", spy)
    return runs


@pytest.mark.parametrize("path", [LL_AR, SIMPLE_RS, LL_AG], ids=lambda p: p.name.split(".")[0])
@pytest.mark.parametrize("schedules", [1, 2, 5])
@pytest.mark.parametrize("dtypes", [None, ["fp16", "fp32"]])
def test_the_summary_lists_what_ran(path, schedules, dtypes, recorded):
    from mscclang.sim.dtypes import dtype_name, parse_dtype

    plan = load_plan(path)
    kw = {"dtypes": dtypes} if dtypes else {}
    rep = verify(plan, schedules=schedules, **kw)
    reduces, packets = plan_uses(plan)
    ran = _ran(str(rep).splitlines()[1])
    assert ran["dtypes"] == list(dict.fromkeys(dtype_name(parse_dtype(d)) for d, _, _ in recorded))
    assert ran.get("reduce ops") == (list(dict.fromkeys(r for _, r, _ in recorded)) if reduces else None)
    assert ran.get("packets") == (list(dict.fromkeys(p for _, _, p in recorded)) if packets else None)


def test_one_schedule_lists_one_of_each(capsys):
    # the case: --schedules 1 listed four dtypes, three reduce ops and two packet types
    res = cli_inproc(capsys, "verify", str(LL_AR), "--schedules", "1")
    assert res.returncode == 0, res.stderr
    assert "dtypes float16; reduce ops sum; packets LL16; 1 schedules" in res.stdout, res.stdout
    res = cli_inproc(capsys, "verify", str(SIMPLE_RS), "--schedules", "10")
    assert "dtypes float16, bfloat16, float32, int32; reduce ops sum, min, max; 10 schedules" in res.stdout
    assert "packets" not in res.stdout.splitlines()[1]


def test_a_failed_report_goes_to_standard_output(tmp_path):
    plan = tmp_path / "missing_wait.json"
    plan.write_text(json.dumps(plan_to_dict(simple_allgather(final_wait=False))))
    report = tmp_path / "report.txt"
    with report.open("w") as out:
        p = subprocess.run([sys.executable, "-m", "mscclang", "verify", str(plan), "--all"], cwd=ROOT,
                           stdout=out, stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 1
    text = report.read_text()
    assert text.startswith("verify simple_allgather: FAILED (") and len(text.splitlines()) > 20, text
    assert p.stderr == text.splitlines()[0].replace("verify ", "mscclang verify: ", 1) + "\n", p.stderr


def test_a_passing_report_goes_to_standard_output_and_the_verdict_to_standard_error(capsys):
    res = cli_inproc(capsys, "verify", str(LL_AR), "--schedules", "2")
    assert res.returncode == 0 and res.stdout.startswith("verify allreduce_oneshot_ll.r2.i1.inplace: OK\n")
    assert res.stderr == "mscclang verify: allreduce_oneshot_ll.r2.i1.inplace: OK\n"


def _declared_ll(tmp_path, source):
    doc = json.loads(source.read_text())
    doc["protocol"] = "LL"
    f = tmp_path / "declared_ll.json"
    f.write_text(json.dumps(doc))
    return f


def test_an_ll_plan_without_packet_ops_is_a_warning_and_fails_strict(tmp_path, capsys):
    f = _declared_ll(tmp_path, SIMPLE_RS)
    rep = verify(load_plan(f), schedules=2)
    assert rep.ok and [p.kind for p in rep.problems] == ["protocol"] and rep.exit_code(strict=True) == 1
    assert "warning: protocol: the plan declares protocol LL but has no packet op" in str(rep)
    assert cli_inproc(capsys, "verify", str(f), "--schedules", "2").returncode == 0
    res = cli_inproc(capsys, "verify", str(f), "--schedules", "2", "--strict")
    assert res.returncode == 1 and "warning: protocol" in res.stdout
    assert res.stderr.count("\n") == 1 and "--strict: OK with 1 warning(s) is not a proof" in res.stderr
    # the same plan declared Simple, and an LL plan with packets: no warning
    assert verify(load_plan(SIMPLE_RS), schedules=2).exit_code(strict=True) == 0
    assert verify(load_plan(LL_AR), schedules=2).exit_code(strict=True) == 0


def test_every_shipped_ll_algorithm_has_packet_ops():
    declared = [p for p in map(load_plan, one_per_algorithm()) if p.protocol == "LL"]
    assert declared and [p.name for p in declared if not plan_uses(p)[1]] == []
