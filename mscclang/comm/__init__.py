"""The collective API (``Communicator``), the plan selector, tuning files and back ends.

``Communicator`` runs allreduce, allgather, reduce-scatter, all-to-all, broadcast and send/recv
on the plans of the library (chosen by the selector from a tuning file) and falls back to
torch.distributed for what the library cannot do.
"""

from mscclang.comm.backend import Engine, RuntimeBackend
from mscclang.comm.catalog import Catalog, PlanVariant, infer_buffer_mode
from mscclang.comm.communicator import CallPlan, Communicator
from mscclang.comm.errors import BatchInvariantError, CommError, TuningError
from mscclang.comm.selector import Choice, Selector
from mscclang.comm.tuning import (DEFAULT_TUNING_FILE, Candidate, Rule, TuningTable, load_tuning,
                                  save_tuning, tuning_to_json)

__all__ = [
    "BatchInvariantError", "CallPlan", "Candidate", "Catalog", "Choice", "CommError", "Communicator",
    "DEFAULT_TUNING_FILE", "Engine", "PlanVariant", "Rule", "RuntimeBackend", "Selector", "TuningError",
    "TuningTable", "infer_buffer_mode", "load_tuning", "save_tuning", "tuning_to_json",
]
