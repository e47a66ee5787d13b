"""The index of shipped plans (``plans/index.json``) and where the plans live.

The index is a JSON object ``{"format": "mscclang.plan-index/1", "plans": [entry, ...]}``; each
entry describes one plan file::

    {"file": "allreduce_oneshot_ll.r2.i1.json", "name": ..., "algorithm": ..., "collective": ...,
     "ranks": 2, "protocol": "LL", "buffer_mode": "any", "inplace": false,
     "min_message_size": 0, "max_message_size": 262144, "size_of": "input",
     "instances": 1, "num_threads_per_block": 512, "threadblocks": 2,
     "use_double_scratch_buffer": true, "root": null, "pipeline_unit": null,
     "port_channels": false, "gpus_per_node": null}

``size_of`` says which buffer the size range applies to (``"output"`` for allgather, else
``"input"``), ``threadblocks`` is the grid size of the plan, ``port_channels`` whether it uses
port channels (such plans are never a default choice: the selector runs them only where a tuning
rule names them), ``gpus_per_node`` the node layout a hierarchical plan was written for (null:
one node).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from mscclang.errors import PlanError

INDEX_FORMAT = "mscclang.plan-index/1"
INDEX_FILE = "index.json"

__all__ = ["INDEX_FILE", "INDEX_FORMAT", "default_plans_dir", "load_index", "select"]


def default_plans_dir() -> Path:
    """``plans/`` at the root of the source checkout this package was imported from."""
    return Path(__file__).resolve().parents[2] / "plans"


def load_index(plans_dir: Optional[Union[str, Path]] = None) -> list[dict[str, Any]]:
    """The entries of ``plans_dir/index.json`` (default: :func:`default_plans_dir`)."""
    d = Path(plans_dir) if plans_dir is not None else default_plans_dir()
    path = d / INDEX_FILE
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise PlanError(f"cannot read the plan index {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise PlanError(f"{path} is not a plan index (expected format {INDEX_FORMAT!r})", "format")
    plans = data.get("plans")
    if not isinstance(plans, list):
        raise PlanError(f"{path}: 'plans' must be a list", "plans")
    return plans


def select(entries: list[dict[str, Any]], collective: str, ranks: int, message_size: int,
           buffer_mode: Optional[str] = None, inplace: Optional[bool] = None) -> list[dict[str, Any]]:
    """The entries for ``collective`` on ``ranks`` ranks whose size range holds
    ``message_size`` (input bytes; output bytes for allgather), optionally restricted to a
    buffer mode ("any" excludes zero-copy plans; "symmetric" allows both) and in-place setting."""
    out = []
    for e in entries:
        if e.get("collective") != collective or e.get("ranks") != ranks:
            continue
        if not e.get("min_message_size", 0) <= message_size <= e.get("max_message_size", 0):
            continue
        if buffer_mode == "any" and e.get("buffer_mode") != "any":
            continue
        if inplace is not None and bool(e.get("inplace")) != inplace:
            continue
        out.append(e)
    return out
