"""Exceptions of mscclang. Every user-facing failure is one of these, with a message that names
what is wrong (rank, thread block, op index, JSON path)."""

from __future__ import annotations

from typing import Optional


class MscclangError(Exception):
    """Base class of every mscclang error."""


class DSLError(MscclangError):
    """Misuse of the DSL, raised while a program is recorded or compiled."""


class CompileError(MscclangError):
    """A compiler pass found the program invalid (e.g. a dependency cycle)."""


class PlanError(MscclangError):
    """An execution plan is invalid; ``path`` is the JSON path of the offending field."""

    def __init__(self, message: str, path: Optional[str] = None) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class LimitError(MscclangError):
    """An input or a requested run exceeds a documented limit (plan file size, op count, the
    simulator's memory or time budget); the message names the limit and the environment variable
    that raises it."""


class VerificationError(MscclangError):
    """The simulator found a plan incorrect (deadlock, race or wrong output)."""


class CollectiveTimeout(MscclangError):
    """A bounded GPU spin expired; the message names rank, thread block, op index and what was
    awaited."""


class RuntimeUnavailable(MscclangError):
    """No usable GPU runtime (no CUDA device, or a feature this machine cannot run)."""
