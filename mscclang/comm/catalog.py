"""The catalog of plan variants the communicator can run: the shipped ``plans/`` (through its
``index.json``), extra plans the tuner compiled, and plans handed over in memory.

Index entries are read tolerantly (the index belongs to the algorithm library): a list, or an
object with a ``plans`` list, of objects with at least a file name (``file``/``path``) and
preferably ``name``/``algorithm``, ``collective``, ``ranks``, ``protocol``, ``buffer_mode``,
``inplace``, ``min_message_size``/``max_message_size`` (or ``size_range``), ``instances`` and
``threads``/``num_threads_per_block``, ``port_channels`` and ``batch_invariant``. Whatever an entry lacks is read from
the plan file itself when first needed. Without an index every ``*.json`` in the folder is read.

Variants that use port channels (:meth:`PlanVariant.uses_port_channels`) are opt-in: the
selector's heuristic skips them, so they run only where a tuning rule names them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from mscclang.comm.errors import TuningError
from mscclang.config import Settings, settings
from mscclang.plan.models import MAX_MESSAGE_SIZE, BufferKind, Plan

SYMMETRIC = "symmetric"
ANY = "any"


def infer_buffer_mode(plan: Plan) -> str:
    """``symmetric`` when some rank touches a peer's input or output buffer (zero-copy), else
    ``any`` (only peers' scratch is touched remotely)."""
    return SYMMETRIC if any(rb.type in (BufferKind.input, BufferKind.output)
                            for g in plan.gpus for rb in g.remote_buffers) else ANY


@dataclass
class PlanVariant:
    """One runnable plan: an algorithm compiled for one world size, instances and threads."""

    key: str
    algorithm: str
    collective: str
    ranks: int
    protocol: str = "Simple"
    buffer_mode: str = ANY
    inplace: bool = False
    min_bytes: int = 0
    max_bytes: int = MAX_MESSAGE_SIZE
    instances: Optional[int] = None
    threads: Optional[int] = None
    root: Optional[int] = None
    path: Optional[Path] = None
    #: uses port channels (``None``: not said by the index; read from the plan when asked)
    port_channels: Optional[bool] = None
    #: the plan's batch-invariance promise (``None``: not said by the index; read from the plan)
    batch_invariant: Optional[bool] = None
    _plan: Optional[Plan] = field(default=None, repr=False, compare=False)

    @property
    def symmetric(self) -> bool:
        return self.buffer_mode == SYMMETRIC

    def fits(self, nbytes: int) -> bool:
        """Whether the message size is inside the plan's size range."""
        return self.min_bytes <= nbytes <= self.max_bytes

    def load(self) -> Plan:
        """The plan (loaded from its file once, then cached)."""
        if self._plan is None:
            from mscclang.plan.io import load_plan

            if self.path is None:
                raise TuningError(f"plan variant {self.key} has neither a file nor a plan")
            self._plan = load_plan(self.path)
        return self._plan

    def uses_port_channels(self) -> bool:
        """Whether the plan uses port channels (from the index, else from the plan itself; a
        plan that cannot be loaded counts as not using them: it cannot run anyway)."""
        if self.port_channels is None:
            from mscclang.errors import MscclangError

            try:
                self.port_channels = self.load().uses_port_channels()
            except (MscclangError, OSError):
                return False
        return self.port_channels

    def label(self) -> str:
        return " ".join([self.algorithm] + [f"{c}{n}" for c, n in (("i", self.instances), ("t", self.threads))
                                            if n is not None])

    @classmethod
    def from_plan(cls, plan: Plan, key: Optional[str] = None, algorithm: Optional[str] = None,
                  instances: Optional[int] = None, path: Optional[Path] = None) -> "PlanVariant":
        """A variant described by the plan's own metadata."""
        name = plan.name
        if instances is None:
            m = re.search(r"[._]i(\d+)(?:[._]|$)", key or name)
            instances = int(m.group(1)) if m else None
        return cls(
            key=key or name, algorithm=algorithm or _algorithm_of(key or name),
            collective=plan.collective, ranks=plan.world_size, protocol=plan.protocol,
            buffer_mode=infer_buffer_mode(plan), inplace=plan.inplace,
            min_bytes=plan.min_message_size, max_bytes=plan.max_message_size,
            instances=instances, threads=plan.num_threads_per_block, root=plan.root, path=path,
            port_channels=plan.uses_port_channels(), batch_invariant=plan.batch_invariant, _plan=plan)


def _algorithm_of(key: str) -> str:
    """``allreduce_oneshot_ll.r2.i1`` -> ``allreduce_oneshot_ll``."""
    return key.split(".", 1)[0]


def _get(e: dict, *names: str, default: Any = None) -> Any:
    return next((e[n] for n in names if e.get(n) is not None), default)


def _variant_from_entry(e: dict, folder: Path, where: str) -> PlanVariant:
    if not isinstance(e, dict):
        raise TuningError("an index entry must be an object", where)
    nm = _get(e, "key", "name")
    fname = _get(e, "file", "path", "plan_file", default=None if nm is None else f"{nm}.json")
    if fname is None:
        raise TuningError("index entry names no plan file", where)
    path = folder / fname   # an absolute fname stays as it is
    key = path.name[:-5] if path.name.endswith(".json") else path.name
    algorithm = _get(e, "algorithm", "name", default=_algorithm_of(key))
    if algorithm == key:
        algorithm = _algorithm_of(key)
    size_range = _get(e, "size_range", "message_size_range")
    lo = _get(e, "min_message_size", "min_bytes")
    hi = _get(e, "max_message_size", "max_bytes")
    if isinstance(size_range, (list, tuple)) and len(size_range) == 2:
        lo = size_range[0] if lo is None else lo
        hi = size_range[1] if hi is None else hi
    ranks = _get(e, "ranks", "num_ranks", "world_size")
    coll = _get(e, "collective")
    v = PlanVariant(
        key=key, algorithm=str(algorithm), collective=str(coll) if coll else "",
        ranks=int(ranks) if ranks is not None else 0,
        protocol=str(_get(e, "protocol", default="Simple")),
        buffer_mode=str(_get(e, "buffer_mode", "mode", default="")),
        inplace=bool(_get(e, "inplace", "in_place", default=False)),
        min_bytes=int(lo) if lo is not None else 0,
        max_bytes=int(hi) if hi is not None else MAX_MESSAGE_SIZE,
        instances=_get(e, "instances"), threads=_get(e, "threads", "num_threads_per_block"),
        root=_get(e, "root"), path=path)
    for name in ("port_channels", "batch_invariant"):
        flag = _get(e, name)
        if flag is not None and not isinstance(flag, bool):
            raise TuningError(f"{name} must be true or false, got {flag!r}", where)
        setattr(v, name, flag)
    if not v.collective or not v.ranks or not v.buffer_mode:
        # fill the gaps from the plan itself
        p = v.load()
        v.collective = v.collective or p.collective
        v.ranks = v.ranks or p.world_size
        v.buffer_mode = v.buffer_mode or infer_buffer_mode(p)
        if v.threads is None:
            v.threads = p.num_threads_per_block
    if v.buffer_mode not in (ANY, SYMMETRIC):
        raise TuningError(f"buffer mode {v.buffer_mode!r} is neither 'any' nor 'symmetric'", where)
    return v


def installed_data_dirs() -> list[Path]:
    """Where a wheel's data files (``share/...``) may have been installed: ``sys.prefix``, the
    scheme's data path, the user scheme's base (``pip install --user``)."""
    import site
    import sys
    import sysconfig

    roots = [sys.prefix, sysconfig.get_path("data"), *[b for b in [getattr(site, "USER_BASE", None)] if b]]
    return list(dict.fromkeys(map(Path, roots)))   # each once, in this order


def _holds_plans(folder: Path) -> bool:
    return (folder / "index.json").is_file() or (folder.is_dir() and any(folder.glob("*.json")))


def _setting_folder(value: str) -> Path:
    """The folder ``MSCCLANG_PLANS_DIR=value`` names (a folder: the setting's own rule);
    SettingError when it holds no ``index.json`` and no ``*.json``."""
    if not _holds_plans(Path(value)):
        raise Settings.plans_dir.fail(value, "the folder holds no plan (no index.json, no *.json)")
    return Path(value)


def check_plans_dir(value: str) -> None:
    """Refuse ``MSCCLANG_PLANS_DIR=value`` as :meth:`Catalog.from_dir` refuses it when the variable
    holds it (SettingError naming the variable for a folder that is missing or holds no plan,
    TuningError for a broken ``index.json``); the check ``mscclang env`` runs."""
    Catalog.from_dir(_setting_folder(value), setting=value)


def default_plans_dir() -> Optional[Path]:
    """``$MSCCLANG_PLANS_DIR``, else ``plans/`` of the checkout, else the installed copy
    (``mscclang/plans``, ``mscclang/_plans`` or ``<data root>/share/mscclang/plans``, see
    :func:`installed_data_dirs`). A ``MSCCLANG_PLANS_DIR`` that is not a folder, or holds no
    ``index.json`` and no ``*.json``, raises :class:`~mscclang.errors.SettingError` naming the
    variable and the folder (every call would otherwise fall back to NCCL)."""
    env = settings.plans_dir
    if env:
        return _setting_folder(env)
    here = Path(__file__).resolve().parent.parent
    cands = [here.parent / "plans", here / "plans", here / "_plans"]
    cands += [root / "share" / "mscclang" / "plans" for root in installed_data_dirs()]
    return next((cand for cand in cands if _holds_plans(cand)), None)


class Catalog:
    """Plan variants by key, searchable by collective, world size and candidate description."""

    def __init__(self, variants: Iterable[PlanVariant] = ()) -> None:
        self._variants: dict[str, PlanVariant] = {}
        for v in variants:
            self.add(v)

    def add(self, v: PlanVariant) -> None:
        """Add (or replace) a variant."""
        self._variants[v.key] = v

    def __len__(self) -> int:
        return len(self._variants)

    def __iter__(self):
        return iter(self._variants.values())

    def get(self, key: str) -> Optional[PlanVariant]:
        return self._variants.get(key)

    @classmethod
    def from_dir(cls, folder: Union[str, Path, None] = None, setting: Optional[str] = None) -> "Catalog":
        """Read a plans folder (its ``index.json``, else every ``*.json``); an absent folder
        gives an empty catalog, except where ``MSCCLANG_PLANS_DIR`` names it (None:
        :func:`default_plans_dir`, which refuses it; ``setting``: the variable's value that named
        ``folder``): then a folder none of whose files is a plan is refused too."""
        folder, setting = (Path(folder), setting) if folder is not None else (default_plans_dir(), settings.plans_dir)
        cat = cls()
        if folder is None or not folder.is_dir():
            return cat
        index = folder / "index.json"
        if index.is_file():
            try:
                data = json.loads(index.read_text())
            except json.JSONDecodeError as e:
                raise TuningError(f"not valid JSON: {e.msg} at line {e.lineno}", None, str(index)) from None
            entries = data.get("plans", data.get("variants")) if isinstance(data, dict) else data
            if isinstance(entries, dict):
                entries = [dict(v, key=k) if isinstance(v, dict) and "file" not in v and "path" not in v
                           else v for k, v in entries.items()]
            if not isinstance(entries, list):
                raise TuningError("index must be a list of entries or have a 'plans' list", "$", str(index))
            for i, e in enumerate(entries):
                try:
                    cat.add(_variant_from_entry(e, folder, f"[{i}]"))
                except TuningError as err:
                    raise TuningError(err.message, err.path, str(index)) from None
            return cat
        from mscclang.plan.io import load_plan

        for p in sorted(folder.glob("*.json")):
            try:
                plan = load_plan(p)
            except Exception:  # not a plan (e.g. a tuning file): skip
                continue
            cat.add(PlanVariant.from_plan(plan, key=p.name[:-5], path=p))
        if not len(cat) and setting:
            raise Settings.plans_dir.fail(setting, "no file of the folder is a plan")
        return cat

    def matching(self, collective: str, world_size: int) -> list[PlanVariant]:
        """Variants of a collective for a world size, in a stable order."""
        out = [v for v in self._variants.values() if v.collective == collective and v.ranks == world_size]
        return sorted(out, key=lambda v: (v.algorithm, v.instances or 0, v.threads or 0, v.key))

    def find_all(self, plan: str, collective: str, world_size: int, instances: Optional[int] = None,
                 threads: Optional[int] = None) -> list[PlanVariant]:
        """The variants a tuning candidate names: one by key, or every variant of an algorithm
        narrowed by ``instances`` / ``threads`` (e.g. its in-place and out-of-place plans), in
        stable order (fewest instances first)."""
        def ok(v: PlanVariant) -> bool:
            return (v.ranks == world_size and v.collective == collective
                    and (instances is None or v.instances == instances)
                    and (threads is None or v.threads == threads))

        v = self._variants.get(plan)
        if v is not None:
            return [v] if ok(v) else []
        return [v for v in self.matching(collective, world_size) if v.algorithm == plan and ok(v)]

    def find(self, plan: str, collective: str, world_size: int, instances: Optional[int] = None,
             threads: Optional[int] = None) -> Optional[PlanVariant]:
        """The first of :meth:`find_all`, or ``None``."""
        found = self.find_all(plan, collective, world_size, instances, threads)
        return found[0] if found else None
