"""Loading and saving plans. Errors name the JSON path of the offending field.

Every way a file can be wrong is a :class:`~mscclang.errors.PlanError`, never another exception:
too large (``settings.max_plan_bytes``), not UTF-8, not JSON (including ``NaN``, integers of
thousands of digits, nesting too deep to parse), not an object, too many ops, or not a plan
(the models' and :func:`~mscclang.plan.check.validate_plan`'s findings, with the JSON path)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Union

from pydantic import ValidationError

from mscclang.config import Settings, settings
from mscclang.errors import PlanError
from mscclang.units import format_bytes
from mscclang.plan.check import check_format, validate_plan
from mscclang.plan.models import PLAN_FORMAT, PLAN_FORMATS, Plan


def json_path(loc: tuple[Any, ...]) -> str:
    """Render a pydantic error location as a JSON path like ``gpus[0].threadblocks[1].ops[2]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "$"


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a fuzzed value can be huge)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # deep nesting; ints past the digit limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def count_ops(data: dict) -> None:
    """Bound the plan's size before any validation work: count its ops (pipeline inner ops
    included) against ``settings.max_plan_ops``, and refuse pipelines nested
    in pipelines here, where nesting costs nothing to find (validating an arbitrarily deep
    nest would recurse). Shapes that are not lists or objects are left to the models."""
    limit = settings.max_plan_ops
    gpus = data.get("gpus")
    if not isinstance(gpus, list):
        return
    total = 0
    for r, g in enumerate(gpus):
        tbs = g.get("threadblocks") if isinstance(g, dict) else None
        if not isinstance(tbs, list):
            continue
        for t, tb in enumerate(tbs):
            ops = tb.get("ops") if isinstance(tb, dict) else None
            if not isinstance(ops, list):
                continue
            total += len(ops)
            for i, op in enumerate(ops):
                inner = op.get("ops") if isinstance(op, dict) else None
                if not isinstance(inner, list):
                    continue
                total += len(inner)
                for j, x in enumerate(inner):
                    if isinstance(x, dict) and x.get("ops") is not None:
                        raise PlanError("pipelines cannot be nested",
                                        f"gpus[{r}].threadblocks[{t}].ops[{i}].ops[{j}].ops")
            if total > limit:
                raise PlanError(f"the plan has more than {limit:,} ops (the limit; set "
                                f"{Settings.max_plan_ops.name} to raise it)", f"gpus[{r}].threadblocks[{t}].ops")


def validation_error(e: ValidationError) -> PlanError:
    """The first error of a pydantic validation as a PlanError with its JSON path."""
    errs = e.errors(include_url=False, include_input=False)
    err = errs[0]
    more = f" (and {len(errs) - 1} more errors)" if len(errs) > 1 else ""
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))  # union branch tags
    return PlanError(err["msg"] + more, json_path(loc))


def plan_from_dict(data: Any) -> Plan:
    """Validate a parsed JSON document as a plan; raise PlanError with the JSON path on failure."""
    if not isinstance(data, dict):
        raise PlanError(f"a plan must be a JSON object, not {_json_type(data)}", "$")
    fmt = data.get("format")
    if fmt is None:
        raise PlanError(
            f"missing 'format' (expected {PLAN_FORMAT!r}); an MSCCL++ plan must be converted with "
            "mscclang.plan.from_mscclpp() or `mscclang import-mscclpp`", "format")
    if fmt not in PLAN_FORMATS:
        raise PlanError(f"unsupported format {_short(fmt)}, expected one of "
                        f"{', '.join(map(repr, PLAN_FORMATS))}", "format")
    count_ops(data)
    try:
        plan = Plan.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise PlanError("the document is nested too deeply to validate") from None
    check_format(plan)
    return plan


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _reject_constant(name: str) -> Any:
    raise PlanError(f"not valid JSON: {name} is not a JSON number")


def read_plan_text(source: Union[str, Path]) -> str:
    """The text of a plan file, bounded and decoded: a file larger than
    ``settings.max_plan_bytes`` is refused before it is read, and a file that is
    not UTF-8 (a leading byte-order mark is allowed) is a PlanError naming the offending byte."""
    p = Path(source)
    limit = settings.max_plan_bytes
    try:
        with p.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise PlanError(f"plan file {p} is {format_bytes(size)}, more than the "
                                f"{format_bytes(limit)} limit (set {Settings.max_plan_bytes.name} to raise it)")
            raw = f.read(limit + 1)  # a file that grows (or a pipe) cannot exceed the limit either
    except OSError as e:
        raise PlanError(f"cannot read plan file {p}: {e.strerror or e}") from None
    except ValueError as e:  # e.g. an embedded NUL in the path
        raise PlanError(f"cannot read plan file {source!r}: {e}") from None
    if len(raw) > limit:
        raise PlanError(f"plan file {p} is more than the {format_bytes(limit)} limit "
                        f"(set {Settings.max_plan_bytes.name} to raise it)")
    return decode_plan_bytes(raw, str(p))


def decode_plan_bytes(raw: bytes, what: str = "the plan") -> str:
    """``raw`` decoded as UTF-8 (an optional byte-order mark is dropped); PlanError otherwise."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise PlanError(f"{what} is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} "
                        f"(line {line}) {e.reason}") from None


def parse_plan_json(text: str) -> Any:
    """Parse JSON text with every failure a PlanError: syntax errors (with line and column),
    ``NaN``/``Infinity``, integers past Python's digit limit, nesting too deep to parse, and text
    longer than the plan size limit."""
    limit = settings.max_plan_bytes
    if len(text) > limit:  # characters: a cheap bound before encoding
        raise PlanError(f"the plan text is more than the {format_bytes(limit)} limit "
                        f"(set {Settings.max_plan_bytes.name} to raise it)")
    if text.startswith("\ufeff"):  # a byte-order mark, as a file read with read_text() keeps it
        text = text[1:]
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise PlanError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise PlanError("not a plan: the JSON is nested too deeply to parse") from None
    except ValueError as e:  # integer literals past sys.get_int_max_str_digits()
        raise PlanError(f"not valid JSON for a plan: {e}") from None


def read_plan_document(source: Union[str, Path]) -> Any:
    """Read and parse a plan file (``"-"``: standard input) into JSON data, bounded as
    :func:`read_plan_text` and :func:`parse_plan_json` say; the format is not checked."""
    if str(source) == "-":
        limit = settings.max_plan_bytes
        raw = sys.stdin.buffer.read(limit + 1)
        if len(raw) > limit:
            raise PlanError(f"the plan on standard input is more than the {format_bytes(limit)} "
                            f"limit (set {Settings.max_plan_bytes.name} to raise it)")
        text = decode_plan_bytes(raw, "standard input")
        if not text.strip():
            raise PlanError("no plan on standard input ('-' reads the plan JSON from stdin)")
        try:
            return parse_plan_json(text)
        except PlanError as e:
            raise PlanError(f"standard input is {e.message}", e.path) from None
    return parse_plan_json(read_plan_text(source))


def _looks_like_json(text: str) -> bool:
    """A string ``load_plan`` takes as JSON text rather than as a path: it starts (after
    whitespace or a byte-order mark) with ``{`` or ``[``, or no path is that long or has lines."""
    return text.lstrip(" \t\r\n\ufeff")[:1] in ("{", "[") or len(text) > 4096 or "\n" in text


def load_plan(source: Union[str, Path, dict, Any], check: bool = True) -> Plan:
    """Load a plan from a file path, a JSON string or parsed JSON (a dict).

    With ``check`` (the default) the plan must also pass the semantic checks of
    :func:`mscclang.plan.check.validate_plan` (indexes in range, operands per op kind, chunk counts
    fitting the collective); failures raise PlanError with the JSON path. Files are read within
    the limits of ``settings.max_plan_bytes`` and ``settings.max_plan_ops`` (size, op count), which raise PlanError too.
    """
    if isinstance(source, dict):
        data: Any = source
    elif isinstance(source, str) and _looks_like_json(source):
        data = parse_plan_json(source)
    elif isinstance(source, (str, Path)):
        data = parse_plan_json(read_plan_text(source))
    else:  # parsed JSON that is not an object: plan_from_dict says what it is
        data = source
    return plan_from_document(data, check)


def plan_from_document(data: Any, check: bool = True) -> Plan:
    """A plan from parsed JSON data (any JSON value: what is not a plan is a PlanError), with
    the semantic checks when ``check``."""
    plan = plan_from_dict(data)
    if check:
        validate_plan(plan)
    return plan


def plan_to_dict(plan: Plan) -> dict:
    """The plan as a JSON-ready dict, without unset optional fields (deterministic key order)."""
    return plan.model_dump(mode="json", exclude_none=True)


def plan_to_json(plan: Plan, indent: int = 2) -> str:
    """Serialise deterministically: same plan -> byte-identical text."""
    return json.dumps(plan_to_dict(plan), indent=indent) + "\n"


def save_plan(plan: Plan, path: Union[str, Path]) -> None:
    Path(path).write_text(plan_to_json(plan))
