"""Loading and saving plans. Errors name the JSON path of the offending field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from pydantic import ValidationError

from mscclang.errors import PlanError
from mscclang.plan.models import PLAN_FORMAT, Plan


def json_path(loc: tuple[Any, ...]) -> str:
    """Render a pydantic error location as a JSON path like ``gpus[0].threadblocks[1].ops[2]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "$"


def plan_from_dict(data: Any) -> Plan:
    """Validate a parsed JSON document as a plan; raise PlanError with the JSON path on failure."""
    if not isinstance(data, dict):
        raise PlanError("a plan must be a JSON object", "$")
    fmt = data.get("format")
    if fmt is None:
        raise PlanError(
            f"missing 'format' (expected {PLAN_FORMAT!r}); an MSCCL++ plan must be converted with "
            "mscclang.plan.from_mscclpp() or `mscclang import-mscclpp`", "format")
    if fmt != PLAN_FORMAT:
        raise PlanError(f"unsupported format {fmt!r}, expected {PLAN_FORMAT!r}", "format")
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        more = f" (and {len(e.errors()) - 1} more errors)" if len(e.errors()) > 1 else ""
        raise PlanError(err["msg"] + more, json_path(tuple(err["loc"]))) from None


def load_plan(source: Union[str, Path, dict], check: bool = True) -> Plan:
    """Load a plan from a file path, a JSON string or a parsed dict.

    With ``check`` (the default) the plan must also pass the semantic checks of
    :func:`mscclang.plan.check.validate_plan` (indexes in range, operands per op kind, chunk counts
    fitting the collective); failures raise PlanError with the JSON path.
    """
    if isinstance(source, dict):
        plan = plan_from_dict(source)
        if check:
            _check(plan)
        return plan
    text: str
    if isinstance(source, Path) or (isinstance(source, str) and not source.lstrip().startswith("{")):
        p = Path(source)
        try:
            text = p.read_text()
        except OSError as e:
            raise PlanError(f"cannot read plan file {p}: {e.strerror}") from None
    else:
        text = source
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    plan = plan_from_dict(data)
    if check:
        _check(plan)
    return plan


def _check(plan: Plan) -> None:
    from mscclang.plan.check import validate_plan  # late import: check imports this package

    validate_plan(plan)


def plan_to_dict(plan: Plan) -> dict:
    """The plan as a JSON-ready dict, without unset optional fields (deterministic key order)."""
    return plan.model_dump(mode="json", exclude_none=True)


def plan_to_json(plan: Plan, indent: int = 2) -> str:
    """Serialise deterministically: same plan -> byte-identical text."""
    return json.dumps(plan_to_dict(plan), indent=indent) + "\n"


def save_plan(plan: Plan, path: Union[str, Path]) -> None:
    Path(path).write_text(plan_to_json(plan))
