"""Message sizes: parsing ``1K``/``4M``/``1G`` lists and ranges (one size is a byte count in
:func:`mscclang.units.parse_bytes`'s grammar), and printing them back
(:func:`mscclang.units.format_size`)."""

from __future__ import annotations

from mscclang.comm.errors import CommError
from mscclang.units import format_size, parse_bytes

__all__ = ["DEFAULT_SIZES", "QUICK_SIZES", "FIRST_CALL_SIZES", "parse_size", "parse_sizes", "format_size", "log_spaced"]

#: 1 KiB .. 1 GiB in x4 steps (the issue's sweep)
DEFAULT_SIZES: tuple[int, ...] = tuple(1 << k for k in range(10, 31, 2))
#: a short sweep for --quick
QUICK_SIZES: tuple[int, ...] = (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 28)


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096 (see :func:`mscclang.units.parse_bytes`); CommError otherwise."""
    try:
        return parse_bytes(text)
    except ValueError:
        raise CommError(f"bad size {text!r}: use a number with an optional K, M, G or T suffix "
                        "(e.g. 64K, 1.5M)") from None


def parse_sizes(text: str) -> list[int]:
    """A comma list of sizes and ranges: ``1K,64K`` or ``1K:1G`` (x4 steps) or ``1K:1M:2``
    (x2 steps). Sorted, without duplicates."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            bits = part.split(":")
            if len(bits) not in (2, 3):
                raise CommError(f"bad size range {part!r}: use LO:HI or LO:HI:FACTOR")
            lo, hi = parse_size(bits[0]), parse_size(bits[1])
            factor = int(bits[2]) if len(bits) == 3 else 4
            if lo <= 0 or hi < lo or factor < 2:
                raise CommError(f"bad size range {part!r}: need 0 < LO <= HI and FACTOR >= 2")
            s = lo
            while s <= hi:
                out.add(s)
                s *= factor
        else:
            v = parse_size(part)
            if v <= 0:
                raise CommError(f"bad size {part!r}: must be positive")
            out.add(v)
    if not out:
        raise CommError("no sizes given")
    return sorted(out)


def log_spaced(lo: int, hi: int, count: int, multiple: int = 1) -> list[int]:
    """``count`` sizes from ``lo`` to ``hi`` (both kept) evenly spaced on a log scale, each
    rounded to a multiple of ``multiple``; ``lo`` and ``hi`` must be multiples already."""
    if count < 2 or lo <= 0 or hi <= lo or lo % multiple or hi % multiple:
        raise CommError(f"bad log-spaced range {lo}..{hi} x{count} (multiples of {multiple})")
    ratio = hi / lo
    out = [lo] + [int(round(lo * ratio ** (i / (count - 1)) / multiple)) * multiple
                  for i in range(1, count - 1)] + [hi]
    return sorted(set(out))


#: ``mscclang bench --first-calls``: sizes a model's activations have (bytes of bf16, a multiple of
#: 4 so that they split into 2 ranks' blocks), none a power of two
FIRST_CALL_SIZES: tuple[int, ...] = (49_164, 278_596, *log_spaced(475_252, 16_371_612, 10, 4))
