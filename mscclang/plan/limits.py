"""Limits on what mscclang reads and simulates, each with the environment variable that raises it.

Loading a plan is bounded before any validation work: the file size
(``MSCCLANG_MAX_PLAN_BYTES``, default 32 MiB) and the number of ops, pipeline inner ops included
(``MSCCLANG_MAX_PLAN_OPS``, default 100,000). The simulator's limits (memory and time of a run)
live in :mod:`mscclang.sim.budget`.

Values are read from the environment when a limit is needed, never cached, so a program (or a
test) can change them between calls; the settings are declared in :mod:`mscclang.config` (byte
counts in :func:`mscclang.units.parse_bytes`'s grammar: ``64K``, ``1.5G``, ...).
"""

from __future__ import annotations

from mscclang.config import Settings, settings
from mscclang.units import format_bytes

__all__ = ["max_plan_bytes", "max_plan_ops", "MAX_PLAN_BYTES_ENV", "MAX_PLAN_OPS_ENV",
           "DEFAULT_MAX_PLAN_BYTES", "DEFAULT_MAX_PLAN_OPS", "format_bytes"]

MAX_PLAN_BYTES_ENV: str = Settings.max_plan_bytes.name
MAX_PLAN_OPS_ENV: str = Settings.max_plan_ops.name
DEFAULT_MAX_PLAN_BYTES: int = Settings.max_plan_bytes.default
DEFAULT_MAX_PLAN_OPS: int = Settings.max_plan_ops.default


def max_plan_bytes() -> int:
    """Largest plan file (or JSON text) :func:`mscclang.plan.load_plan` reads, in bytes."""
    return settings.max_plan_bytes


def max_plan_ops() -> int:
    """Most ops (pipeline inner ops included) a plan may hold."""
    return settings.max_plan_ops
