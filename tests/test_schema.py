"""docs/plan.schema.json is generated from the plan models and must match them."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mscclang.plan.models import OpName, PLAN_FORMATS
from mscclang.cli.main import main as cli_main
from mscclang.plan.schema import DEFAULT_PATH, plan_schema, schema_text

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "plan.schema.json"
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.json"))


def test_default_path_is_the_docs_file():
    assert DEFAULT_PATH == COMMITTED


def test_committed_schema_matches_the_models():
    committed = json.loads(COMMITTED.read_text())
    assert committed == plan_schema(), (
        "docs/plan.schema.json is out of date: run `mscclang schema`")


def test_schema_text_is_deterministic_and_parses():
    a, b = schema_text(), schema_text()
    assert a == b and a.endswith("\n")
    assert json.loads(a) == plan_schema()


def test_schema_content_follows_the_models():
    s = plan_schema()
    assert s["$schema"].startswith("https://json-schema.org/")
    assert sorted(s["properties"]["format"]["enum"]) == sorted(PLAN_FORMATS)
    assert {"name", "collective", "gpus"} <= set(s["required"])
    assert sorted(s["$defs"]["OpName"]["enum"]) == sorted(o.value for o in OpName)
    assert s["additionalProperties"] is False


def test_check_mode(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert cli_main(["schema", "-o", str(out)]) == 0
    assert cli_main(["schema", "-o", str(out), "--check"]) == 0
    stale = json.loads(out.read_text())
    stale["$defs"]["OpName"]["enum"].remove("glre")
    out.write_text(json.dumps(stale))
    assert cli_main(["schema", "-o", str(out), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert cli_main(["schema", "-o", str(tmp_path / "missing.json"), "--check"]) == 1


def test_schema_subcommand_runs_as_a_command(tmp_path):
    out = tmp_path / "plan.schema.json"
    r = subprocess.run([sys.executable, "-m", "mscclang", "schema", "-o", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text()) == json.loads(COMMITTED.read_text())


def _validator():
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft202012Validator(plan_schema())


@pytest.mark.parametrize("path", GOLDEN[:8] + GOLDEN[-6:], ids=lambda p: p.stem)
def test_schema_accepts_golden_plans(path):
    validator = _validator()
    errors = [e.message for e in validator.iter_errors(json.loads(path.read_text()))]
    assert not errors


def test_schema_rejects_what_the_models_reject():
    validator = _validator()
    good = json.loads(GOLDEN[0].read_text())
    assert validator.is_valid(good)
    for mutate in (
        lambda d: d.update(format="msccl/0"),
        lambda d: d.update(unknown_key=1),
        lambda d: d["gpus"][0]["threadblocks"][0]["ops"][0].update(name="bogus"),
        lambda d: d.update(num_threads_per_block=4096),
        lambda d: d.pop("gpus"),
    ):
        bad = copy.deepcopy(good)
        mutate(bad)
        assert not validator.is_valid(bad)
