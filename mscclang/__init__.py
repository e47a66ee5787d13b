"""mscclang: GPU collective communication programmed in Python.

``from mscclang import *`` gives the whole DSL (compatible with the MSCCL++ DSL)."""

from mscclang.errors import (  # noqa: F401
    CollectiveTimeout,
    CompileError,
    DSLError,
    MscclangError,
    PlanError,
    VerificationError,
)

__version__ = "0.1.0"

__all__ = ["CollectiveTimeout", "CompileError", "DSLError", "MscclangError", "PlanError",
           "VerificationError"]
# The DSL helper adds the DSL's public names here, imported explicitly (no star imports).
