"""Byte counts: the one grammar every mscclang setting, command-line option and script reads, and
the two ways they are printed.

A byte count is a non-negative number (an integer or a decimal, ``_`` allowed between digits)
with an optional binary unit, case-insensitive, optionally separated by spaces: ``4096``,
``512B``, ``64K``, ``64KB``, ``64KiB``, ``1M``, ``1MiB``, ``1.5G``, ``2T`` (K = 1024 bytes,
M = 1024 K, G = 1024 M, T = 1024 G). The value must come out as a whole number of bytes
(``1.5K`` is 1536; ``0.3`` is refused).
"""

from __future__ import annotations

import re
from typing import Optional, Union

__all__ = ["UNITS", "BYTE_COUNT_EXAMPLES", "parse_bytes", "format_bytes", "format_size"]

#: unit (lower case) -> bytes; the only unit table of the package
UNITS: dict[str, int] = {"": 1, "b": 1, **{letter + suffix: 1 << (10 * power)
                                           for power, letter in enumerate("kmgt", start=1)
                                           for suffix in ("", "b", "ib")}}

#: examples of the grammar, for error messages
BYTE_COUNT_EXAMPLES = "4096, 512B, 64K, 64KiB, 1MB, 1.5G"

_BYTES = re.compile(r"^\s*(\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)\s*([a-z]*)\s*$")


def parse_bytes(text: Union[str, int], what: Optional[str] = None) -> int:
    """The number of bytes ``text`` spells (see the module docstring); an ``int`` is returned as
    it is when it is not negative. Raises ``ValueError`` for anything else, naming ``what`` (for
    instance an environment variable: ``X='lots': not a byte count ...``) when it is given."""
    if isinstance(text, bool):
        raise TypeError(f"a byte count is a string or an int, not {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(_bad(text, what, "a byte count is not negative"))
        return text
    m = _BYTES.match(str(text).lower())
    if not m or m.group(2) not in UNITS or m.group(1).endswith("_"):
        raise ValueError(_bad(text, what, f"not a byte count (e.g. {BYTE_COUNT_EXAMPLES})"))
    number = m.group(1).replace("_", "")
    scale = UNITS[m.group(2)]
    if "." not in number:
        return int(number) * scale
    whole, _, frac = number.partition(".")
    # exact decimal arithmetic: int(whole.frac * scale) without floating-point rounding
    numerator = int((whole or "0") + frac) * scale
    denominator = 10 ** len(frac)
    if numerator % denominator:
        raise ValueError(_bad(text, what, "not a whole number of bytes"))
    return numerator // denominator


def _bad(text: object, what: Optional[str], why: str) -> str:
    return f"{what}={text!r}: {why}" if what else f"{text!r}: {why}"


def format_bytes(n: float) -> str:
    """``n`` bytes for people to read, in the largest binary unit that keeps it at least 1, with
    one decimal where it is not whole: ``"1.5 GiB"``, ``"64 MiB"``, ``"12 B"``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def format_size(nbytes: int) -> str:
    """``nbytes`` exactly, in the compact form tables and option values use, which
    :func:`parse_bytes` reads back: ``4096`` -> ``4K``, ``3 << 20`` -> ``3M``, ``1536`` ->
    ``1536`` (the largest of K, M, G, T that divides it)."""
    for unit in ("T", "G", "M", "K"):
        mult = UNITS[unit.lower()]
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return str(nbytes)
