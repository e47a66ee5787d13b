"""Argument types shared by every ``mscclang`` command: message sizes, size lists and ranges,
dtype names, bounded integers, and the ``--progress`` switch.

One grammar everywhere:

* a size is a positive byte count in :func:`mscclang.units.parse_bytes`'s grammar: a number
  with an optional binary suffix, case-insensitive: ``4096``, ``4K``, ``4KB``, ``4KiB``,
  ``4kb``, ``4M``, ``1.5M``, ``1G``, ``1T`` (K = 1024 bytes);
* a size list is a comma list of sizes and ranges: ``1K,64K``; ``LO:HI`` is every size from
  LO to HI in x4 steps (``1K:64K`` = 1K, 4K, 16K, 64K); ``LO:HI:F`` uses x F steps
  (``1K:8K:2`` = 1K, 2K, 4K, 8K). The list comes out sorted, without duplicates;
* a dtype is a canonical name or an alias: ``float16`` (``fp16``, ``half``, ``f16``),
  ``bfloat16`` (``bf16``), ``float32`` (``fp32``, ``float``, ``f32``), ``int32`` (``i32``,
  ``int``), and for the simulator also ``uint32`` (``u32``), ``uint8`` (``u8``),
  ``float8_e4m3`` (``fp8_e4m3``, ``float8_e4m3fn``, ``e4m3``) and ``float8_e5m2`` (``fp8_e5m2``,
  ``e5m2``).

The size-list grammar is :mod:`mscclang.bench.sizes`'s (reused, not copied); this module turns its
errors into argparse errors, which name the option (``argument --size: ...``) and the accepted
forms, and refuses zero and negative sizes. Each ``*_arg`` function returns a callable for
``add_argument(type=...)``.
"""

from __future__ import annotations

import argparse
from typing import Callable, Iterable, Optional, Sequence

from mscclang.plan.dtypes import DTYPE_ALIASES, DTYPES, GPU_DTYPES, SIM_DTYPES, find_dtype

__all__ = [
    "SIZE_FORMS", "SIZES_FORMS", "GPU_DTYPES", "SIM_DTYPES", "DTYPE_ALIASES", "BUILD_DTYPE",
    "MAX_SCHEDULES", "MAX_LAUNCHES", "parse_size", "parse_sizes", "parse_dtype",
    "size_arg", "sizes_arg", "dtype_arg", "dtype_list_arg", "int_range_arg", "add_progress_flag", "flatten_sizes",
]

#: the accepted spellings of one size, for error messages and help texts
SIZE_FORMS = "a positive byte count with an optional K, M, G or T suffix (4096, 4K, 4KB, 4KiB, 1.5M, 1G)"
#: the accepted spellings of a size list
SIZES_FORMS = (SIZE_FORMS + ", a comma list of them (1K,64K), or a range LO:HI in x4 steps (1K:4M) "
               "or LO:HI:FACTOR (1K:4M:2)")

#: canonical dtype name -> the short name of its kernel module (``mscclang build-kernel``)
BUILD_DTYPE: dict[str, str] = {d.name: d.code for d in DTYPES if d.gpu}

#: most schedules per size ``mscclang verify --schedules`` takes (each is a whole simulated run)
MAX_SCHEDULES = 1000
#: most consecutive launches ``mscclang verify --launches`` takes
MAX_LAUNCHES = 16


def parse_size(text: str) -> int:
    """One size (see the module docstring) in bytes; ValueError naming the accepted forms for
    anything else, zero and negative sizes included."""
    from mscclang.bench.sizes import parse_size as _grammar
    from mscclang.comm.errors import CommError

    try:
        value = _grammar(text)
    except CommError:
        raise ValueError(f"bad size {text!r}: use {SIZE_FORMS}") from None
    if value <= 0:
        raise ValueError(f"bad size {text!r}: sizes must be positive; use {SIZE_FORMS}")
    return value


def parse_sizes(text: str) -> list[int]:
    """A size list (see the module docstring), sorted and without duplicates; ValueError
    naming the accepted forms for anything else."""
    from mscclang.bench.sizes import parse_sizes as _grammar
    from mscclang.comm.errors import CommError

    for part in text.split(","):
        for bound in part.split(":")[:2]:
            if bound.strip():
                parse_size(bound)  # the precise message for a bad bound
    try:
        return _grammar(text)
    except (CommError, ValueError) as e:  # ValueError: a FACTOR that is not an integer
        msg = str(e) if isinstance(e, CommError) else f"bad size range {text!r}"
        raise ValueError(f"{msg}; use {SIZES_FORMS}") from None


def parse_dtype(text: str, allowed: Sequence[str] = SIM_DTYPES) -> str:
    """Canonical name of a dtype name or alias (``fp16`` -> ``float16``); ValueError listing
    the accepted names when it is unknown or not in ``allowed``."""
    info = find_dtype(text)
    name = info.name if info is not None else str(text).strip().lower()
    if name not in allowed:
        names = []
        for canon in allowed:
            aliases = [a for a, c in DTYPE_ALIASES.items() if c == canon]
            names.append(canon + (f" ({', '.join(aliases)})" if aliases else ""))
        raise ValueError(f"unknown dtype {text!r}; use one of: {'; '.join(names)}")
    return name


def _argtype(fn: Callable[[str], object], name: str) -> Callable[[str], object]:
    """Wrap ``fn`` so argparse reports its ValueError message (argparse would otherwise print
    ``invalid <function name> value``)."""

    def convert(text: str) -> object:
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = name
    return convert


def size_arg() -> Callable[[str], object]:
    """argparse ``type`` of one size: returns an int."""
    return _argtype(parse_size, "size")


def sizes_arg() -> Callable[[str], object]:
    """argparse ``type`` of a size list or range: returns a sorted list of ints."""
    return _argtype(parse_sizes, "sizes")


def dtype_arg(allowed: Sequence[str] = SIM_DTYPES) -> Callable[[str], object]:
    """argparse ``type`` of a dtype: returns the canonical name, one of ``allowed``."""
    return _argtype(lambda t: parse_dtype(t, allowed), "dtype")


def dtype_list_arg(allowed: Sequence[str] = SIM_DTYPES) -> Callable[[str], object]:
    """argparse ``type`` of a comma list of dtypes: returns their canonical names, in order,
    without duplicates."""

    def parse(text: str) -> list[str]:
        names = [parse_dtype(t, allowed) for t in text.split(",") if t.strip()]
        if not names:
            raise ValueError(f"no dtype in {text!r}")
        return list(dict.fromkeys(names))

    return _argtype(parse, "dtypes")


def int_range_arg(lo: int, hi: int) -> Callable[[str], object]:
    """argparse ``type`` of an integer in ``lo..hi``; the error names the range."""

    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer (use {lo}..{hi})") from None
        if not lo <= v <= hi:
            raise ValueError(f"{v} is out of range: use {lo}..{hi}")
        return v

    return _argtype(parse, "integer")


def flatten_sizes(groups: Optional[Iterable[Iterable[int]]]) -> Optional[list[int]]:
    """Sizes of an option given several lists (``--sizes 1K 4K:16K``) as one sorted list
    without duplicates; None when the option was not given."""
    if groups is None:
        return None
    return sorted({s for g in groups for s in g})


def add_progress_flag(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress``: the progress bar on stderr. By default it is shown
    only when stderr is a terminal, so pipes, logs and tests stay clean."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar with an ETA on stderr (default: only when stderr is a "
                        "terminal)")

