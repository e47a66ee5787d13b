"""``mscclang export-mscclpp`` and the MSCCL++ round trip of every shipped plan: each plan
exports and imports back to itself up to the documented normalisation, or is refused for a
reason MSCCL++ states (a broadcast, an epilogue op, a local source at place 2 or later); one
exported plan per algorithm is verified after the round trip (every one: ``-m slow``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

import pytest

from mscclang.errors import PlanError
from mscclang.plan import from_mscclpp, load_plan, plan_to_dict, to_mscclpp
from mscclang.plan.models import Plan
from tests.harness.cli import cli, cli_inproc, user_error
from tests.harness.shipped import PLANS_DIR, one_per_algorithm, shipped_plan_files
from tests.harness.trust_checks import library_inplace_mscclpp

#: the refusal reasons a shipped plan may meet, by a phrase of the message
REASONS = {"epilogue": "no epilogue ops", "broadcast": "no broadcast collective",
           "place": "adds its local source at place", "segments": "not mscclang.plan/3"}


def _normalised(doc: dict) -> dict:
    """A plan document as the MSCCL++ round trip gives it back (``mscclang.plan.mscclpp``'s
    docstring): no ``consistent`` or ``batch_invariant``, no ops' ``src``, ``src0_position`` 1
    dropped (local first)."""
    doc = json.loads(json.dumps(doc))
    doc.pop("consistent", None)
    doc.pop("batch_invariant", None)
    for g in doc["gpus"]:
        for tb in g["threadblocks"]:
            for op in tb["ops"]:
                for o in [op, *op.get("ops", [])]:
                    o.pop("src", None)
                    if o.get("src0_position") == 1:
                        del o["src0_position"]
    return doc


def _round_trip(plan: Plan) -> Plan:
    """Export, through JSON text, and import back (unchecked: the result is compared field by
    field with a plan that passed the checks)."""
    return from_mscclpp(json.loads(json.dumps(to_mscclpp(plan))), check=False)


def _reason(plan: Plan, e: PlanError) -> str:
    """Which of :data:`REASONS` ``e`` states, checked against the plan itself."""
    kind = next((k for k, phrase in REASONS.items() if phrase in e.message), None)
    assert kind is not None, f"{plan.name}: refused for an unexpected reason: {e}"
    if kind == "epilogue":
        assert plan.format == "mscclang.plan/2" and plan.epilogue_ops(), plan.name
    elif kind == "segments":   # MSCCL++ plans scale every size with the message: no data-dependent counts
        assert plan.has_segments(), plan.name
    elif kind == "broadcast":
        assert plan.collective == "broadcast", plan.name
    else:
        assert e.path is not None and e.path.endswith(".src0_position"), e.path
        op: object = plan
        for part in e.path.removesuffix(".src0_position").split("."):
            name, _, index = part.partition("[")
            op = getattr(op, name)[int(index.rstrip("]"))]
        place = getattr(op, "src0_position")
        assert place is not None and place >= 2 and f"place {place}" in e.message, (plan.name, e)
    return kind


def _export_or_reason(f: Path) -> tuple[dict, Plan, Optional[Plan], Optional[str]]:
    """The shipped plan of ``f`` as JSON and as a plan (unchecked: test_algorithms checks them),
    its round trip or None, and the reason it was refused or None."""
    doc = json.loads(f.read_text())
    plan = load_plan(doc, check=False)
    try:
        return doc, plan, _round_trip(plan), None
    except PlanError as e:
        return doc, plan, None, _reason(plan, e)


def test_every_shipped_plan_round_trips_or_is_refused_for_a_stated_reason(shipped_plans):
    counts: Counter = Counter()
    for f in shipped_plans:
        doc, _, back, reason = _export_or_reason(f)
        counts[reason or "exported"] += 1
        if back is not None:
            assert plan_to_dict(back) == _normalised(doc), f.name
    print(f"\nMSCCL++ export of {len(shipped_plans)} shipped plans: {dict(counts)}")
    assert counts["exported"] > 0 and set(counts) <= {"exported", *REASONS}, counts


def _verify_round_trip(plan: Plan, back: Plan) -> None:
    from mscclang.sim import verify
    from mscclang.sim.verify import default_sizes

    back.consistent = plan.consistent  # the promises MSCCL++ has no field for: they must still hold
    back.batch_invariant = plan.batch_invariant
    report = verify(back, sizes=[min(default_sizes(back))], schedules=1)
    assert report.ok, f"{plan.name}:\n{report}"


ALGORITHMS = [f.name.split(".")[0] for f in one_per_algorithm()]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_exported_plan_of_each_algorithm_verifies_after_import(algorithm):
    """The first exportable plan of the algorithm (name order), exported and imported back,
    still proves correct and rank-consistent (a local source written first at place 1 is the
    same sum). A broadcast or epilogue refusal holds for the whole algorithm."""
    for f in shipped_plan_files():
        if f.name.split(".")[0] == algorithm:
            _, plan, back, reason = _export_or_reason(f)
            if back is not None:
                return _verify_round_trip(plan, back)
            if reason != "place":
                pytest.skip(f"MSCCL++ cannot express {algorithm} ({reason})")
    pytest.fail(f"no plan of {algorithm} is exportable")


@pytest.mark.slow
@pytest.mark.parametrize("f", shipped_plan_files(), ids=lambda f: f.stem)
def test_every_exported_plan_verifies_after_import(f):
    _, plan, back, reason = _export_or_reason(f)
    if back is None:
        pytest.skip(f"MSCCL++ cannot express this plan ({reason})")
    _verify_round_trip(plan, back)


# ------------------------------------------------------------------------- the command

TWO_RANK = PLANS_DIR / "allreduce_twostep_ll.r2.i2.inplace.json"
FOUR_RANK = PLANS_DIR / "allreduce_twostep_ll.r4.i1.json"


def test_export_command_writes_what_import_reads_back(tmp_path):
    out = tmp_path / "x.mscclpp.json"
    res = cli("export-mscclpp", str(TWO_RANK), "-o", str(out))
    assert res.returncode == 0 and res.stdout == "", res.stderr
    assert json.loads(out.read_text()) == to_mscclpp(load_plan(TWO_RANK))
    back = tmp_path / "back.json"
    res = cli("import-mscclpp", str(out), "-o", str(back))
    assert res.returncode == 0, res.stderr
    assert plan_to_dict(load_plan(back)) == _normalised(json.loads(TWO_RANK.read_text()))


def test_export_command_refuses_in_one_line(tmp_path):
    res = cli("export-mscclpp", str(FOUR_RANK), "-o", str(tmp_path / "x.json"))
    user_error(res, "mscclang export-mscclpp: error: gpus[2].threadblocks[0].ops[1].src0_position: "
                    "respkt adds its local source at place 2", "commute")
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()


def test_export_command_stdin_stdout_and_bad_inputs(tmp_path, capsys):
    res = cli_inproc(capsys, "export-mscclpp", str(TWO_RANK))
    assert res.returncode == 0 and json.loads(res.stdout) == to_mscclpp(load_plan(TWO_RANK)), res.stderr
    res = cli("export-mscclpp", "-", stdin=TWO_RANK.read_text())
    assert res.returncode == 0 and json.loads(res.stdout) == to_mscclpp(load_plan(TWO_RANK)), res.stderr
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    ext = tmp_path / "ext.json"
    ext.write_text(json.dumps(to_mscclpp(load_plan(TWO_RANK))))
    bad = json.loads(TWO_RANK.read_text())
    bad["gpus"][1]["threadblocks"][0]["ops"][1]["src_buff"][0]["index"] = 99
    badf = tmp_path / "bad.json"
    badf.write_text(json.dumps(bad))
    for argv, needle in [([str(tmp_path / "nope.json")], "nope.json"), ([str(junk)], "not valid JSON"),
                         ([str(ext)], "already an MSCCL++ plan"),
                         ([str(badf)], "gpus[1].threadblocks[0].ops[1].src_buff[0].index"),
                         ([str(TWO_RANK), "-o", str(tmp_path / "no" / "dir.json")], "cannot write"),
                         ([str(PLANS_DIR / "broadcast_ll.r2.i1.root0.json")], "no broadcast collective")]:
        res = cli_inproc(capsys, "export-mscclpp", *argv)
        user_error(res, "mscclang export-mscclpp: error: ", needle)
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


# ------------------------------------------------ the GPU trust test, up to the launch

def test_library_inplace_plans_export_import_and_run_on_the_simulator(tmp_path, capsys):
    """tests/gpu/test_trust_gpu.py::test_inplace_plans_imported_from_mscclpp_run_exact up to the
    launch: the three in-place plans export, import back through the command, and run (here: on
    the simulator, what ``mscclang run`` does without GPUs)."""
    files = library_inplace_mscclpp(tmp_path)
    assert len(files) == 3
    for f in files:
        ours = tmp_path / (f.stem + ".ours.json")
        res = cli_inproc(capsys, "import-mscclpp", str(f), "-o", str(ours))
        assert res.returncode == 0, res.stderr
        assert load_plan(ours).inplace
        res = cli_inproc(capsys, "run", str(ours), "--size", "1K")
        assert res.returncode == 0 and "BAD" not in res.stdout, res.stdout + res.stderr
