"""The automatic registration schedule of ordinary tensors (``MSCCLANG_REGISTER=auto``).

A call whose tensors are not registered, when a zero-copy plan would have been chosen for
registered ones, registers them at the 1st, 2nd, 4th, 8th, ... such call of its signature
(collective, sizes, dtype, op, root); once a tensor this schedule registered for the signature
has been run on again (the program re-uses its tensors, one buffer per layer, say), at every such
call. The signature, the call count and the uses are the same on every rank, so every rank
registers at the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: signatures remembered; beyond, the record starts over (alike on every rank)
MAX_SIGNATURES = 4096


@dataclass
class Misses:
    """One signature's record: calls so far, whether a registration made for it was run on
    again, and the registrations made for it (their buffer classes, the latest 8)."""

    calls: int = 0
    reused: bool = False
    registrations: list = field(default_factory=list)


class AutoRegister:
    """The schedule of one communicator."""

    def __init__(self) -> None:
        self._misses: dict[tuple, Misses] = {}

    def call(self, registry: Any, signature: tuple, register: Callable[[], bool], tensors: tuple) -> bool:
        """One more call of ``signature`` whose tensors are not registered: ``register()`` them
        when the schedule says so (collective: every rank decides alike). Returns whether they
        were registered."""
        if len(self._misses) >= MAX_SIGNATURES and signature not in self._misses:
            self._misses.clear()
        rec = self._misses.setdefault(signature, Misses())
        rec.calls += 1
        n = rec.calls
        if not rec.reused:
            # a registration this schedule made, run on again after its first call: reuse
            rec.reused = any(registry.uses(c) >= 2 for c in rec.registrations)
        if not rec.reused and n & (n - 1):
            return False
        done = register()
        if done and not rec.reused:
            rec.registrations = (rec.registrations + [registry.classify(t) for t in tensors])[-8:]
        return done

    def clear(self) -> None:
        """Forget every record (close)."""
        self._misses.clear()
