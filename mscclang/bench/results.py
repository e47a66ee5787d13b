"""Benchmark results: one :class:`Record` per (collective, implementation, mode, size), the JSON
document ``{"meta": {...}, "results": [...]}`` and helpers to look records up."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Optional, TypeVar, Union

from mscclang.comm.errors import CommError

BENCH_FORMAT = "mscclang.bench/1"
_R = TypeVar("_R")
_L = TypeVar("_L", bound="LineRecord")
#: the implementation name of mscclang on ordinary (``torch.empty``) tensors
ORDINARY = "ordinary"
IMPLS = ("mscclang", ORDINARY, "nccl", "symm")
IMPL_LABELS = {"mscclang": "mscclang", ORDINARY: "mscclang ordinary tensor", "nccl": "NCCL",
               "symm": "torch symm two-shot", "unfused": "mscclang allreduce + torch norm",
               "flashinfer": "FlashInfer allreduce_fusion"}
MODES = ("graph", "eager")
#: collectives in the API spelling used by the baselines (nccl_bench.py)
COLLS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


class LineRecord:
    """The JSON side of a dataclass record that the workers stream one a line (:func:`read_jsonl`):
    :meth:`to_dict` leaves out the fields that are None and :meth:`from_dict` is its inverse,
    with ``DEFAULTS`` for fields older files lack, ignoring keys it does not know and raising
    :class:`CommError` (naming the record ``KIND``) when a ``REQUIRED`` field is missing."""

    KIND: ClassVar[str] = "record"
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    DEFAULTS: ClassVar[dict[str, Any]] = {}

    def to_dict(self) -> dict:
        """A JSON-ready dict (without the fields that are None)."""
        return {k: v for k, v in asdict(self).items() if v is not None}  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[_L], d: dict) -> _L:
        """The inverse of :meth:`to_dict`."""
        missing = [k for k in cls.REQUIRED if k not in d]
        if missing:
            raise CommError(f"{cls.KIND} lacks {', '.join(missing)}: {d}")
        return cls(**{**cls.DEFAULTS, **{k: v for k, v in d.items() if k in cls.__dataclass_fields__}})  # type: ignore[attr-defined]


@dataclass
class Record:
    """One measured (or failed, or skipped) cell. ``bytes`` is the message size (allgather:
    output; others: input); ``us`` the median time per call; ``busbw`` in GB/s."""

    coll: str
    impl: str
    mode: str
    bytes: int
    dtype: str
    us: Optional[float] = None
    busbw: Optional[float] = None
    ok: bool = False
    error: Optional[str] = None
    plan: Optional[str] = None
    iters: Optional[int] = None
    us_min: Optional[float] = None
    us_max: Optional[float] = None
    extra: dict = field(default_factory=dict)

    @property
    def measured(self) -> bool:
        return self.ok and self.us is not None

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["extra"]:
            del d["extra"]
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        known = {f for f in cls.__dataclass_fields__}
        missing = [k for k in ("coll", "impl", "mode", "bytes") if k not in d]
        if missing:
            raise CommError(f"bench record lacks {', '.join(missing)}: {d}")
        kw = {k: v for k, v in d.items() if k in known}
        kw.setdefault("dtype", "bfloat16")
        if "ok" not in d:
            kw["ok"] = d.get("us") is not None and not d.get("error")
        return cls(**kw)


@dataclass
class BenchResult:
    meta: dict
    records: list[Record]

    def find(self, coll: str, impl: str, mode: str, nbytes: int) -> Optional[Record]:
        for r in self.records:
            if r.coll == coll and r.impl == impl and r.mode == mode and r.bytes == nbytes:
                return r
        return None

    def colls(self) -> list[str]:
        seen = {r.coll for r in self.records}
        return [c for c in COLLS if c in seen] + sorted(seen - set(COLLS))

    def impls(self) -> list[str]:
        seen = {r.impl for r in self.records}
        return [i for i in IMPLS if i in seen] + sorted(seen - set(IMPLS))

    def modes(self) -> list[str]:
        seen = {r.mode for r in self.records}
        return [m for m in MODES if m in seen] + sorted(seen - set(MODES))

    def sizes(self, coll: str) -> list[int]:
        return sorted({r.bytes for r in self.records if r.coll == coll})

    def to_dict(self) -> dict:
        return {"format": BENCH_FORMAT, "meta": self.meta,
                "results": [r.to_dict() for r in self.records]}


def load_result(source: Union[str, Path, dict, list]) -> BenchResult:
    """Read a bench JSON (ours, or a bare list of records like the baselines')."""
    data: Any = source
    if isinstance(source, (str, Path)):
        p = Path(source)
        try:
            data = json.loads(p.read_text())
        except OSError as e:
            raise CommError(f"cannot read {p}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise CommError(f"{p}: not valid JSON: {e.msg} at line {e.lineno}") from None
    if isinstance(data, list):
        return BenchResult({}, [Record.from_dict(_baseline_record(d)) for d in data])
    if not isinstance(data, dict) or "results" not in data:
        raise CommError("a bench result is a JSON object with 'results' (or a list of records)")
    return BenchResult(dict(data.get("meta", {})), [Record.from_dict(d) for d in data["results"]])


def _baseline_record(d: dict) -> dict:
    """Map a baseline record (nccl_bench.py / symm_bench.py) to ours."""
    out = dict(d)
    if "mode" not in out:
        out["mode"] = "graph" if out.pop("graph", True) else "eager"
    else:
        out.pop("graph", None)
    if "impl" not in out:
        out["impl"] = "nccl"
    elif out["impl"] == "two_shot":
        out["impl"] = "symm"
    elif out["impl"] == "one_shot":
        out["impl"] = "symm_one_shot"
    out.setdefault("ok", out.get("ok", True))
    return out


def save_result(res: BenchResult, path: Union[str, Path]) -> None:
    Path(path).write_text(json.dumps(res.to_dict(), indent=1) + "\n")


def read_jsonl(path: Union[str, Path],
               parse: Callable[[dict], _R] = Record.from_dict) -> list[_R]:  # type: ignore[assignment]
    """Records streamed by the workers, one JSON object a line, each made by ``parse`` (a
    record class's ``from_dict``, which raises :class:`CommError` on a bad one); a torn or bad
    line is ignored."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(parse(json.loads(line)))
        except (json.JSONDecodeError, CommError):
            continue
    return out


def merge(records: Iterable[Record]) -> list[Record]:
    """Keep the last record of each (coll, impl, mode, bytes) in first-seen order."""
    order: dict[tuple, Record] = {}
    for r in records:
        order[(r.coll, r.impl, r.mode, r.bytes)] = r
    return list(order.values())
