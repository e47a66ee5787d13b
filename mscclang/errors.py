"""Exceptions of mscclang. Every user-facing failure is one of these, with a message that names
what is wrong (rank, thread block, op index, JSON path)."""

from __future__ import annotations

from typing import Any, Optional, Sequence


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


class InvalidCall(MscclangError, ValueError):
    """A call's arguments cannot run: a tensor on the wrong device, an unsupported dtype, a
    non-contiguous tensor, sizes that do not fit the plan, buffers that overlap wrongly. Raised
    before anything reaches the GPU; the executor stays usable."""


class CommError(InvalidCall):
    """A collective call that cannot be done as asked (wrong sizes, dtype, device, rank)."""


class CountsError(InvalidCall):
    """A count matrix a plan with segments cannot run (docs/semantics.md, "Data-dependent
    counts"): a negative count, a buffer's segments past its rows, a scratch segment past its
    slot, counts that disagree across ranks. The message names the rank, the buffer and the
    entry; the GPU kernel checks the same rule and every rank raises it."""


class SettingError(MscclangError, ValueError):
    """An ``MSCCLANG_*`` environment variable holds a value its setting does not accept (see
    :mod:`mscclang.config`); the message names the variable, the value and what is accepted."""


class CallMismatch(MscclangError):
    """The ranks disagree on a collective call (different collective, size, dtype or plan); the
    message lists what each rank called."""


class RegistrationError(MscclangError):
    """Registering ordinary tensors for zero-copy plans failed on some rank, or the ranks'
    registrations disagree (e.g. the calls captured in a CUDA graph differ between ranks). Raised on
    every rank; nothing registered in that step is used (captured calls that depended on it abort
    on replay instead of touching a wrong address)."""


class SpecUnsupported(MscclangError):
    """The generator of plan-specialised kernels does not specialise this plan (or size, or
    setting); the interpreter runs it instead."""


class WorkerError(MscclangError):
    """A command failed on a GPU worker of :mod:`mscclang.runtime.workers`: the message gives each
    failing rank's error (the traceback only where the error is not an mscclang error);
    ``failures`` holds them as ``RankFailure`` records (empty when the pool itself failed: a worker
    that did not start or answer, or a bad ``MSCCLANG_RANKS_PER_GPU``)."""

    def __init__(self, message: str, failures: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.failures = list(failures)


class NotPrepared(RuntimeUnavailable):
    """A call inside CUDA graph capture needs first-time set-up (allocation, registration, a
    kernel build) that cannot be captured: prepare the call, or run it once, before capturing."""


class MscclangWarning(UserWarning):
    """Base class of every warning mscclang issues (through Python's :mod:`warnings`)."""


class DSLWarning(MscclangWarning):
    """A DSL program that compiles but is probably wrong, e.g. a signal/wait imbalance on one
    channel (the plan is emitted and ``mscclang verify`` reports the deadlock; compile with
    ``strict=True`` / ``mscclang compile --strict`` to make it an error)."""
