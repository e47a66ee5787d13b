"""The tuning file: per (collective, world size, dtype) size thresholds naming plan variants.

Format ``mscclang.tuning/1`` (JSON)::

    {
      "format": "mscclang.tuning/1",
      "machine": "2x NVIDIA H200 (NV18 NVLink)",
      "source": "defaults" | "mscclang tune ..." ,
      "rules": [
        {"collective": "allreduce", "world_size": 2, "dtypes": ["*"], "max_bytes": 262144,
         "candidates": [{"plan": "allreduce_oneshot_ll", "instances": 2, "threads": 512},
                        {"plan": "nccl"}]},
        ...
      ]
    }

A rule applies to a call when the collective and world size agree (``world_size`` null: any),
the call's dtype is listed (``"*"``: any; rules naming the dtype exactly win over ``"*"`` rules)
and the message is at most ``max_bytes`` (null: no limit). Rules naming the world size win over
rules for any world size (so a tuned machine's thresholds are never cut by a generic rule's);
among the remaining rules the one with the smallest ``max_bytes`` wins. The message size of allgather is its output size, of every other
collective its input size (the same convention as the plans' size range).

``candidates`` are tried in order: ``plan`` names an algorithm (``allreduce_oneshot_ll``) or one
shipped variant (the file stem in ``plans/``, e.g. ``allreduce_oneshot_ll.r2.i2``); ``instances``,
``threads`` and ``packet_type`` narrow the variant. ``"nccl"`` means torch.distributed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from mscclang.comm.errors import TuningError
from mscclang.config import Settings, settings
from mscclang.plan.collectives import plan_collective
from mscclang.plan.dtypes import GPU_DTYPES

TUNING_FORMAT = "mscclang.tuning/1"
NCCL = "nccl"

#: The defaults shipped with the package (2x H200).
DEFAULT_TUNING_FILE = Path(__file__).with_name("tuning_2xh200.json")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Candidate(_Strict):
    """One plan variant to try (or ``"nccl"``)."""

    plan: str = Field(min_length=1)
    instances: Optional[int] = Field(default=None, ge=1)
    threads: Optional[int] = Field(default=None, ge=32, le=1024)
    packet_type: Optional[Literal["LL8", "LL16"]] = None
    # measured time (us) when the tuner wrote this file; informative only
    us: Optional[float] = None

    @property
    def is_nccl(self) -> bool:
        return self.plan == NCCL

    def label(self) -> str:
        """Short human label, e.g. ``allreduce_oneshot_ll i2 t512``."""
        if self.is_nccl:
            return NCCL
        marks = (("i", self.instances), ("t", self.threads), ("", self.packet_type))
        return " ".join([self.plan] + [f"{c}{v}" for c, v in marks if v is not None])


class Rule(_Strict):
    """Candidates for one collective, world size, dtype set and size range."""

    collective: str
    world_size: Optional[int] = Field(default=None, ge=1)
    dtypes: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    max_bytes: Optional[int] = Field(default=None, ge=0)
    candidates: list[Candidate] = Field(min_length=1)

    @field_validator("collective")
    @classmethod
    def _coll(cls, v: str) -> str:
        try:
            return plan_collective(v, counted=True)
        except Exception as e:  # CommError -> a validation message
            raise ValueError(str(e)) from None

    @field_validator("dtypes")
    @classmethod
    def _dtypes(cls, v: list[str]) -> list[str]:
        for d in v:
            if d != "*" and d not in GPU_DTYPES:
                raise ValueError(f"unknown dtype {d!r}; use one of {', '.join(GPU_DTYPES)} or '*'")
        return v

    def applies(self, collective: str, world_size: int, dtype: str) -> bool:
        return (self.collective == collective
                and (self.world_size is None or self.world_size == world_size)
                and (dtype in self.dtypes or "*" in self.dtypes))

    def exact_dtype(self, dtype: str) -> bool:
        return dtype in self.dtypes


class TuningTable(_Strict):
    """A whole tuning file."""

    format: Literal["mscclang.tuning/1"] = TUNING_FORMAT
    machine: Optional[str] = None
    source: Optional[str] = None
    notes: Optional[str] = None
    # folder of extra plans (compiled by the tuner), relative to the tuning file
    plans_dir: Optional[str] = None
    rules: list[Rule] = Field(default_factory=list)
    _base: Optional[Path] = PrivateAttr(default=None)

    def extra_plans_dir(self) -> Optional[Path]:
        """Absolute folder of the extra plans named by ``plans_dir``, if any; TuningError (JSON
        path ``plans_dir``) when it is not a folder: the rules may name plans only it holds."""
        if not self.plans_dir:
            return None
        p = (self._base or Path()) / self.plans_dir   # an absolute plans_dir stays as it is
        if not p.is_dir():
            raise TuningError(f"no such folder {p} (of the plans compiled for this table)", "plans_dir")
        return p

    def rule_for(self, collective: str, world_size: int, dtype: str, nbytes: int) -> Optional[Rule]:
        """The rule that applies to a call, or ``None`` (see the module docstring)."""
        coll = plan_collective(collective, counted=True)
        rules = [r for r in self.rules if r.applies(coll, world_size, dtype)]
        for by_dtype in ([r for r in rules if r.exact_dtype(dtype)], [r for r in rules if "*" in r.dtypes]):
            for group in ([r for r in by_dtype if r.world_size is not None],
                          [r for r in by_dtype if r.world_size is None]):
                fitting = [r for r in group if r.max_bytes is None or nbytes <= r.max_bytes]
                if fitting:
                    return min(fitting, key=lambda r: (r.max_bytes is None, r.max_bytes or 0))
        return None

    def check(self) -> None:
        """Reject ambiguous tables: two rules with the same collective, world size, dtype and
        ``max_bytes``."""
        seen: dict[tuple, int] = {}
        for i, r in enumerate(self.rules):
            for d in r.dtypes:
                key = (r.collective, r.world_size, d, r.max_bytes)
                if key in seen:
                    raise TuningError(
                        f"rule duplicates rules[{seen[key]}] (collective {r.collective}, world size "
                        f"{r.world_size}, dtype {d}, max_bytes {r.max_bytes})", f"rules[{i}]")
                seen[key] = i


def _json_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or "$"


def tuning_from_dict(data: object, file: Optional[str] = None) -> TuningTable:
    """Validate a parsed tuning document; errors name the JSON path of the bad field."""
    if not isinstance(data, dict):
        raise TuningError("a tuning file must be a JSON object", "$", file)
    if data.get("format") != TUNING_FORMAT:
        raise TuningError(f"expected format {TUNING_FORMAT!r}, got {data.get('format')!r}", "format", file)
    try:
        table = TuningTable.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise TuningError(err["msg"], _json_path(tuple(err["loc"])), file) from None
    try:
        table.check()
    except TuningError as e:
        raise TuningError(e.message, e.path, file) from None
    return table


def load_tuning(source: Union[str, Path, dict, TuningTable, None] = None) -> TuningTable:
    """Load a tuning table from a path, a JSON string, a dict, or (None) ``$MSCCLANG_TUNING``
    when it is set, else the shipped defaults (an empty table, every call to NCCL, where the
    package was built without them); TuningError naming the file (or the text's JSON path) when
    the table cannot be read or is invalid (JSON text from ``MSCCLANG_TUNING``: naming the variable).
    The one reader of ``MSCCLANG_TUNING``."""
    if isinstance(source, TuningTable):
        return source
    label = Settings.tuning.name if source is None else None   # who gave a JSON text: the variable
    if source is None:
        source = settings.tuning or DEFAULT_TUNING_FILE
        if source == DEFAULT_TUNING_FILE and not DEFAULT_TUNING_FILE.is_file():
            return TuningTable()
    if isinstance(source, dict):
        return tuning_from_dict(source)
    if isinstance(source, Path) or not str(source).lstrip().startswith("{"):
        p = Path(source)
        try:
            text = p.read_text()
        except OSError as e:
            raise TuningError(f"cannot read tuning file: {e.strerror}", None, str(p)) from None
        name: Optional[str] = str(p)
    else:
        text, name = str(source), None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TuningError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", None, name or label) from None
    table = tuning_from_dict(data, name or label)
    if name is not None:
        table._base = Path(name).resolve().parent
    try:
        table.extra_plans_dir()   # its folder is there
    except TuningError as e:
        raise TuningError(e.message, e.path, name or label) from None
    return table


def tuning_to_json(table: TuningTable) -> str:
    """Deterministic JSON text of a table (no unset optional fields)."""
    return json.dumps(table.model_dump(mode="json", exclude_none=True), indent=1) + "\n"


def save_tuning(table: TuningTable, path: Union[str, Path]) -> None:
    Path(path).write_text(tuning_to_json(table))
