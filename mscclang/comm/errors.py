"""Errors of the collective API (all subclasses of :class:`mscclang.MscclangError`)."""

from __future__ import annotations

from typing import Optional

from mscclang.errors import CommError, MscclangError

__all__ = ["BatchInvariantError", "CommError", "TuningError"]


class TuningError(MscclangError):
    """A tuning file is invalid; ``path`` is the JSON path of the offending field."""

    def __init__(self, message: str, path: Optional[str] = None, file: Optional[str] = None) -> None:
        self.path = path
        self.file = file
        self.message = message
        where = ":".join(x for x in (file, path) if x)
        super().__init__(f"{where}: {message}" if where else message)


class BatchInvariantError(CommError):
    """A call of the batch-invariant mode that no plan keeping the contract can serve: one line
    naming the call (collective, world size, bytes, dtype) and why; nothing ran
    (:mod:`mscclang.comm.invariant`)."""
