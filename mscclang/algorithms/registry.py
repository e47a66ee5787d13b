"""The registry of library algorithms: what each one implements and which variants ship.

An :class:`AlgorithmInfo` describes one DSL program of the library (its collective, protocol,
buffer mode, the message sizes it is meant for) and the :class:`Variant` s that
``mscclang generate-plans`` writes to ``plans/``. Buffer modes:

* ``"any"``: peers touch only each other's scratch buffers (or only write LL packets into them),
  so the plan works with any user tensors;
* ``"symmetric"``: zero-copy, peers read or write each other's input/output buffers directly, so
  the runtime must use symmetric buffers (same offsets on every rank).

Algorithms with ``port_channels`` move data over port channels (copy engines within a node, an
existing engine between nodes). They are never a default choice: the selector's heuristic skips
them, so they run where a tuning rule names them (``mscclang tune`` measures them like every
other variant and names them where they were faster).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mscclang.errors import DSLError
from mscclang.plan.models import Plan

KiB = 1024
MiB = 1024 * 1024

BUFFER_MODES = ("any", "symmetric")


@dataclass(frozen=True)
class Variant:
    """One shipped plan of an algorithm: ``ranks``, ``instances``, threads per block, in-place
    or not, and extra keyword arguments of the builder (``params``, e.g. a broadcast root)."""

    ranks: int
    instances: int = 1
    num_threads_per_block: Optional[int] = None
    inplace: bool = False
    params: tuple[tuple[str, Any], ...] = ()

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :meth:`AlgorithmInfo.build`."""
        kw: dict[str, Any] = dict(self.params)
        kw["inplace"] = self.inplace
        if self.num_threads_per_block is not None:
            kw["num_threads_per_block"] = self.num_threads_per_block
        return kw


@dataclass(frozen=True)
class AlgorithmInfo:
    """One library algorithm.

    ``builder(ranks, instances=..., num_threads_per_block=..., inplace=..., name=..., **kw)``
    returns the compiled :class:`~mscclang.plan.models.Plan`. ``min_message_size`` /
    ``max_message_size`` are the suggested sizes in bytes (of the input, or of the output for
    allgather) and also go into the plans' size range. ``inplace_modes`` lists the in-place
    settings the program supports. ``port_channels``: the program uses port channels (never a
    default choice, see the module docstring).
    """

    name: str
    collective: str
    protocol: str
    buffer_mode: str
    inplace_modes: tuple[bool, ...]
    min_message_size: int
    max_message_size: int
    builder: Callable[..., Plan]
    description: str
    default_threads: int = 1024
    min_ranks: int = 2
    max_ranks: int = 8
    variants: tuple[Variant, ...] = field(default_factory=tuple)
    port_channels: bool = False

    def __post_init__(self) -> None:
        if self.buffer_mode not in BUFFER_MODES:
            raise DSLError(f"algorithm {self.name}: buffer mode must be one of {BUFFER_MODES}, got {self.buffer_mode!r}")
        if self.protocol not in ("LL", "Simple"):
            raise DSLError(f"algorithm {self.name}: protocol must be 'LL' or 'Simple', got {self.protocol!r}")
        if not self.inplace_modes or self.min_message_size > self.max_message_size:
            raise DSLError(f"algorithm {self.name}: needs in-place modes and a valid size range")

    def build(self, ranks: int, instances: int = 1, num_threads_per_block: Optional[int] = None,
              inplace: Optional[bool] = None, **kw: Any) -> Plan:
        """Build the plan for ``ranks`` ranks (see the algorithm's module for extra keywords)."""
        if not isinstance(ranks, int) or not self.min_ranks <= ranks <= self.max_ranks:
            raise DSLError(f"{self.name}: ranks must be an int in {self.min_ranks}..{self.max_ranks}, got {ranks!r}")
        if inplace is None:
            inplace = self.inplace_modes[0]
        if inplace not in self.inplace_modes:
            raise DSLError(f"{self.name}: inplace={inplace} is not supported "
                           f"(supported: {', '.join(str(m) for m in self.inplace_modes)})")
        kw.setdefault("min_message_size", self.min_message_size)
        kw.setdefault("max_message_size", self.max_message_size)
        return self.builder(ranks, instances=instances,
                            num_threads_per_block=num_threads_per_block or self.default_threads,
                            inplace=inplace, **kw)
