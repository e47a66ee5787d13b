"""The shipped library plans of this checkout (``plans/*.json``, without the index): one list,
for the ``shipped_plans`` fixture of ``tests/conftest.py`` and for parametrised tests."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLANS_DIR = ROOT / "plans"


def shipped_plan_files(folder: Path = PLANS_DIR) -> list[Path]:
    """Every plan file of ``folder`` in name order (``index.json`` left out); empty when the
    folder is absent (a checkout before ``mscclang generate-plans``)."""
    if not folder.is_dir():
        return []
    return [p for p in sorted(folder.glob("*.json")) if p.name != "index.json"]


def one_per_algorithm(folder: Path = PLANS_DIR) -> list[Path]:
    """The first plan file (in name order) of each shipped algorithm (the name before the first
    ``.``: ``allgather_ll``, ``broadcast_simple``...): every collective and algorithm once."""
    seen: dict[str, Path] = {}
    for p in shipped_plan_files(folder):
        seen.setdefault(p.name.split(".")[0], p)
    return list(seen.values())
