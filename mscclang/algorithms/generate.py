"""Generate the shipped plans: ``mscclang generate-plans [--check] [--out DIR]``.

Builds every shipped variant of every algorithm in :data:`mscclang.algorithms.ALGORITHMS`, proves
that each keeps its promise that every rank gets the same bits (:func:`inconsistent_plans`), and
writes ``<out>/<stem>.json`` (compact JSON, one line) plus the index ``<out>/index.json`` (see
:mod:`mscclang.algorithms.index`). The output is deterministic: regenerating gives byte-identical
files. ``--check`` writes nothing; it exits with status 1 and lists every plan that is missing,
differs (with the first differing JSON path) or is stale (a ``.json`` file no variant produces).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from mscclang.algorithms import ALGORITHMS
from mscclang.algorithms.index import INDEX_FILE, INDEX_FORMAT
from mscclang.algorithms.registry import AlgorithmInfo, Variant
from mscclang.errors import MscclangError
from mscclang.plan.collectives import collective
from mscclang.plan.io import plan_to_dict
from mscclang.plan.models import OpName, Plan

__all__ = ["variant_stem", "shipped", "render_plan", "index_entry", "generate_files", "check_files",
           "write_files", "inconsistent_plans", "broken_invariance_promises"]


def variant_stem(info: AlgorithmInfo, v: Variant) -> str:
    """File stem (and plan name) of a variant: ``<algorithm>.r<ranks>.i<instances>`` then
    ``.t<threads>`` when not the algorithm's default, ``.<key><value>`` per extra parameter and
    ``.inplace`` for in-place plans."""
    stem = f"{info.name}.r{v.ranks}.i{v.instances}"
    if v.num_threads_per_block is not None and v.num_threads_per_block != info.default_threads:
        stem += f".t{v.num_threads_per_block}"
    for key, value in v.params:
        stem += f".{key}{value}"
    if v.inplace:
        stem += ".inplace"
    return stem


def shipped(only: Optional[Sequence[str]] = None) -> list[tuple[AlgorithmInfo, Variant]]:
    """Every shipped (algorithm, variant), in registry order (optionally only some algorithms)."""
    if only:
        unknown = [n for n in only if n not in ALGORITHMS]
        if unknown:
            raise MscclangError(f"unknown algorithm(s) {', '.join(unknown)}; known: {', '.join(ALGORITHMS)}")
    return [(info, v) for name, info in ALGORITHMS.items() if not only or name in only for v in info.variants]


def build_variant(info: AlgorithmInfo, v: Variant) -> Plan:
    """The plan of one variant, named after its file stem."""
    return info.build(v.ranks, instances=v.instances, name=variant_stem(info, v), **v.kwargs())


def render_plan(plan: Plan) -> str:
    """A plan as compact, deterministic JSON text (one line and a newline)."""
    return json.dumps(plan_to_dict(plan), separators=(",", ":")) + "\n"


def _pipeline_unit(plan: Plan) -> Optional[int]:
    return next((op.iter_context.unit_size for op in plan.all_ops()
                 if op.name == OpName.pipeline and op.iter_context is not None), None)


def index_entry(info: AlgorithmInfo, v: Variant, plan: Plan, filename: str) -> dict[str, Any]:
    """The index entry of one shipped plan."""
    return {
        "file": filename,
        "name": plan.name,
        "algorithm": info.name,
        "collective": plan.collective,
        "ranks": plan.world_size,
        "protocol": plan.protocol,
        "buffer_mode": info.buffer_mode,
        "inplace": plan.inplace,
        "min_message_size": plan.min_message_size,
        "max_message_size": plan.max_message_size,
        "size_of": collective(plan.collective).message,
        "instances": v.instances,
        "num_threads_per_block": plan.num_threads_per_block,
        "threadblocks": plan.max_threadblocks(),
        "use_double_scratch_buffer": plan.use_double_scratch_buffer,
        "root": plan.root,
        "pipeline_unit": _pipeline_unit(plan),
        "port_channels": plan.uses_port_channels(),
        "gpus_per_node": dict(v.params).get("gpus_per_node"),
    }


def render_index(entries: list[dict[str, Any]]) -> str:
    doc = {"format": INDEX_FORMAT, "generator": "mscclang generate-plans",
           "plans": sorted(entries, key=lambda e: e["file"])}
    return json.dumps(doc, indent=2) + "\n"


def generate_files(only: Optional[Sequence[str]] = None) -> dict[str, str]:
    """``{file name: text}`` of every shipped plan and the index."""
    files: dict[str, str] = {}
    entries: list[dict[str, Any]] = []
    for info, v in shipped(only):
        plan = build_variant(info, v)
        fname = variant_stem(info, v) + ".json"
        if fname in files:
            raise MscclangError(f"two variants of {info.name} produce {fname}")
        files[fname] = render_plan(plan)
        entries.append(index_entry(info, v, plan, fname))
    files[INDEX_FILE] = render_index(entries)
    return files


def _first_difference(a: Any, b: Any, path: str = "$") -> Optional[str]:
    """JSON path of the first difference between two parsed documents (None if equal)."""
    if type(a) is not type(b):
        return path
    if isinstance(a, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}.{k}"
            d = _first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None if len(a) == len(b) else f"{path}[{min(len(a), len(b))}]"
    return None if a == b else path


def check_files(out_dir: Path, files: dict[str, str]) -> list[str]:
    """Differences between ``files`` and ``out_dir``: one line per missing, differing or stale
    file (empty when the directory is up to date)."""
    problems: list[str] = []
    for fname, text in sorted(files.items()):
        path = out_dir / fname
        if not path.exists():
            problems.append(f"missing: {path}")
            continue
        old = path.read_text()
        if old != text:
            try:
                where = _first_difference(json.loads(old), json.loads(text)) or "formatting"
            except json.JSONDecodeError:
                where = "not valid JSON"
            problems.append(f"differs: {path} (first difference at {where})")
    if out_dir.is_dir():
        for path in sorted(out_dir.glob("*.json")):
            if path.name not in files:
                problems.append(f"stale: {path} (no shipped variant produces it)")
    return problems


def inconsistent_plans(files: dict[str, str]) -> list[str]:
    """One line per generated plan that breaks its promise that every rank gets the same bits
    (the library's plans all promise it: ``consistent``), from one symbolic run of each
    (:func:`mscclang.sim.verify.prove_consistent`); empty when every plan keeps it."""
    from mscclang.plan.io import plan_from_dict
    from mscclang.sim.verify import prove_consistent

    out = []
    for fname, text in sorted(files.items()):
        if fname == INDEX_FILE:
            continue
        probs = prove_consistent(plan_from_dict(json.loads(text)))
        if probs:
            out.append(f"{fname}: {probs[0].message}" + (f" (and {len(probs) - 1} more)" if len(probs) > 1 else ""))
    return out


def broken_invariance_promises(files: dict[str, str]) -> list[str]:
    """One line per generated plan that promises batch invariance (``batch_invariant: true``) and
    breaks it, from :func:`mscclang.sim.verify.prove_batch_invariant` (every dtype, at the sizes
    covering the plan's chunk grids); empty when every promise holds."""
    from mscclang.plan.io import plan_from_dict
    from mscclang.sim.verify import prove_batch_invariant

    out = []
    for fname, text in sorted(files.items()):
        plan = plan_from_dict(json.loads(text)) if fname != INDEX_FILE else None
        probs = prove_batch_invariant(plan).problems if plan is not None and plan.batch_invariant else []
        if probs:
            out.append(f"{fname}: {probs[0].message}" + (f" (and {len(probs) - 1} more)" if len(probs) > 1 else ""))
    return out


def write_files(out_dir: Path, files: dict[str, str], prune: bool = True) -> list[str]:
    """Write ``files`` into ``out_dir`` (only those whose text changed) and, with ``prune``,
    delete ``.json`` files no variant produces. Returns the names written or deleted."""
    out_dir.mkdir(parents=True, exist_ok=True)
    changed: list[str] = []
    for fname, text in sorted(files.items()):
        path = out_dir / fname
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(fname)
    if prune:
        for path in sorted(out_dir.glob("*.json")):
            if path.name not in files:
                path.unlink()
                changed.append(f"{path.name} (deleted)")
    return changed
