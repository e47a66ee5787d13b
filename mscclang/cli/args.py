"""Argument types and options shared by every ``mscclang`` command: message sizes, size lists and
ranges, dtype names, bounded numbers, output paths, and the ``--progress`` switch.

One grammar everywhere:

* ``--sizes`` (alias ``--size``) is repeatable and takes one size list per use (below), never a
  space-separated list, so it cannot swallow a plan file after it: the values of every use are
  merged (:func:`add_sizes_option`); list options of ``verify`` (``--dtype``, ``--reduce-op``,
  ``--packet-type``) are comma lists too, repeatable;
* an option that writes a file or folder is spelled ``-o``, ``--out`` or ``--output``
  (:func:`add_output_option`);
* choices (``--protocol ll``, ``--packet-type ll16``, ``--reduce-op SUM``) are
  case-insensitive (the parser of :mod:`mscclang.cli.main` maps them);

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
  ``e5m2``); a prefix of the names before ``_`` (``fp8``, ``float8``) is accepted when it names
  one dtype the command takes, and refused as ambiguous, naming the candidates, otherwise. Each
  command's list is a subset of :data:`mscclang.plan.dtypes.DTYPES`: ``GPU_DTYPES`` where GPU
  kernels run the data, ``SIM_DTYPES`` where the simulator does.

The size-list grammar is :mod:`mscclang.bench.sizes`'s (reused, not copied); this module turns its
errors into argparse errors, which name the option (``argument --size: ...``) and the accepted
forms, and refuses zero and negative sizes. Each ``*_arg`` function returns a callable for
``add_argument(type=...)``.
"""

from __future__ import annotations

import argparse
import functools
from typing import Callable, Optional, Sequence

from mscclang.plan.dtypes import DTYPE_ALIASES, DTYPES, GPU_DTYPES, SIM_DTYPES, find_dtype, kernel_codes

__all__ = [
    "SIZE_FORMS", "SIZES_FORMS", "MESSAGE_SIZE", "GPU_DTYPES", "SIM_DTYPES", "DTYPE_ALIASES", "BUILD_DTYPE",
    "MAX_SCHEDULES", "MAX_LAUNCHES", "parse_size", "parse_sizes", "parse_dtype",
    "sizes_arg", "dtype_arg", "list_arg", "dtype_list_arg", "choice_list_arg", "int_range_arg", "positive_float_arg",
    "add_progress_flag", "add_sizes_option", "add_output_option", "writable_dir", "MergeLists", "register_names", "suffix_arg",
]

#: the accepted spellings of one size, for error messages and help texts
SIZE_FORMS = "a positive byte count with an optional K, M, G or T suffix (4096, 4K, 4KB, 4KiB, 1.5M, 1G)"
#: the accepted spellings of a size list
SIZES_FORMS = (SIZE_FORMS + ", a comma list of them (1K,64K), or a range LO:HI in x4 steps (1K:4M) "
               "or LO:HI:FACTOR (1K:4M:2)")

#: what a size of ``run`` and ``verify`` measures (one text, so their help pages agree): the
#: plan's message size (:func:`mscclang.sim.runner.message_to_bytes`)
MESSAGE_SIZE = "each rank's input bytes; allgather: the output bytes, ranks x the input"

#: canonical dtype name -> the codes of its kernel modules (``mscclang build-kernel``; fp8: one
#: per accumulation dtype)
BUILD_DTYPE: dict[str, tuple[str, ...]] = {d.name: kernel_codes(d) for d in DTYPES if d.gpu}

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
    if info is None:  # a prefix naming a family (fp8 -> fp8_e4m3, fp8_e5m2)
        family = [c for c in allowed if any(s.startswith(name + "_") for s in (c, *_aliases(c)))]
        if len(family) == 1:
            return family[0]
        if family:
            raise ValueError(f"dtype {text!r} is ambiguous: use {' or '.join(_spellings(c) for c in family)}")
    if name not in allowed:
        raise ValueError(f"unknown dtype {text!r}; use one of: {'; '.join(_spellings(c) for c in allowed)}")
    return name


def _aliases(canon: str) -> list[str]:
    return [a for a, c in DTYPE_ALIASES.items() if c == canon]


def _spellings(canon: str) -> str:
    """``float16 (fp16, half, f16)``."""
    aliases = _aliases(canon)
    return canon + (f" ({', '.join(aliases)})" if aliases else "")


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


def sizes_arg() -> Callable[[str], object]:
    """argparse ``type`` of a size list or range: returns a sorted list of ints."""
    return _argtype(parse_sizes, "sizes")


def dtype_arg(allowed: Sequence[str] = SIM_DTYPES) -> Callable[[str], object]:
    """argparse ``type`` of a dtype: returns the canonical name, one of ``allowed``."""
    return _argtype(lambda t: parse_dtype(t, allowed), "dtype")


def list_arg(item: Callable[[str], str], what: str) -> Callable[[str], object]:
    """argparse ``type`` of a comma list of ``what``, each part read by ``item`` (a ValueError
    for a bad one): returns the items in order, without duplicates."""

    def parse(text: str) -> list[str]:
        names = [item(t) for t in text.split(",") if t.strip()]
        if not names:
            raise ValueError(f"no {what} in {text!r}")
        return list(dict.fromkeys(names))

    return _argtype(parse, "list")


def dtype_list_arg(allowed: Sequence[str] = SIM_DTYPES) -> Callable[[str], object]:
    """argparse ``type`` of a comma list of dtypes: their canonical names."""
    return list_arg(lambda t: parse_dtype(t, allowed), "dtype")


def choice_list_arg(choices: Sequence[str]) -> Callable[[str], object]:
    """argparse ``type`` of a comma list of ``choices`` (case-insensitive), spelled as there."""
    by_lower = {c.lower(): c for c in choices}

    def one(text: str) -> str:
        if text.strip().lower() not in by_lower:
            raise ValueError(f"{text.strip()!r}: use a comma list of {', '.join(choices)}")
        return by_lower[text.strip().lower()]

    return list_arg(one, "choice")


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


def positive_float_arg() -> Callable[[str], object]:
    """argparse ``type`` of a finite number above zero (seconds, say)."""

    def parse(text: str) -> float:
        try:
            v = float(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if not 0 < v < float("inf"):
            raise ValueError(f"{text!r}: must be a positive number")
        return v

    return _argtype(parse, "number")


class MergeLists(argparse.Action):
    """A repeatable option whose ``type`` returns a list: every use's items are kept, in order,
    without duplicates (sorted when ``sort``, as sizes are)."""

    def __init__(self, *args: object, sort: bool = False, **kw: object) -> None:
        self.sort = sort
        super().__init__(*args, **kw)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: object,
                 option_string: Optional[str] = None) -> None:
        items = list(dict.fromkeys([*(getattr(ns, self.dest, None) or []), *values]))  # type: ignore[misc]
        setattr(ns, self.dest, sorted(items) if self.sort else items)


def register_names(p: argparse.ArgumentParser) -> None:
    """Names the ``mscclang`` parsers know for ``add_argument``: ``action="sizes"`` (a
    repeatable size list, merged and sorted) and ``type="gpu_dtype"`` (a dtype the GPUs run)."""
    p.register("action", "sizes", functools.partial(MergeLists, sort=True))
    p.register("type", "gpu_dtype", dtype_arg(GPU_DTYPES))


def add_sizes_option(p: argparse.ArgumentParser, what: str, default: str) -> None:
    """``--sizes SIZES`` (alias ``--size``), repeatable: ``args.sizes`` is the sorted list of
    every size given, or None. ``what`` says what a size measures, ``default`` the default."""
    p.add_argument("--sizes", "--size", dest="sizes", action="sizes", type=sizes_arg(),
                   default=None, metavar="SIZES",
                   help=f"message sizes ({what}), repeatable: {SIZES_FORMS} (default {default})")


def suffix_arg(suffix: str) -> Callable[[str], object]:
    """argparse ``type`` of a file name ending in ``suffix`` (case-insensitive), as written."""

    def parse(text: str) -> str:
        if not text.lower().endswith(suffix):
            raise ValueError(f"{text!r}: the file is written as {suffix[1:].upper()}; name it NAME{suffix}")
        return text

    return _argtype(parse, "file name")


def add_output_option(p: argparse.ArgumentParser, dest: str = "out", **kw: object) -> None:
    """The option naming what a command writes: ``-o``, ``--out`` or ``--output``."""
    p.add_argument("-o", "--out", "--output", dest=dest, **kw)  # type: ignore[arg-type]


def writable_dir(path: str, option: str) -> None:
    """:class:`MscclangError` naming ``option``, ``path`` and why, when folder ``path`` cannot
    be made or written into (tried with a temporary folder in its nearest existing ancestor,
    then removed: a command fails before its work, and leaves nothing)."""
    import os
    import tempfile
    from pathlib import Path

    from mscclang.errors import MscclangError

    p = Path(path).absolute()
    there = next(q for q in (p, *p.parents) if q.exists())
    try:
        if not there.is_dir():
            raise NotADirectoryError(0, "not a folder")
        os.rmdir(tempfile.mkdtemp(dir=there, prefix=".mscclang-"))
    except OSError as e:
        why = f"{there}: {e.strerror or e}"
        if isinstance(e, FileNotFoundError):   # it exists: its file system takes no new entries (/proc)
            why = f"{there} exists, but its file system does not take new files or folders: {e.strerror}"
        raise MscclangError(f"{option} {path}: cannot write there ({why})") from None


def add_progress_flag(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress``: the progress bar on stderr. By default it is shown
    only when stderr is a terminal, so pipes, logs and tests stay clean."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar with an ETA on stderr (default: only when stderr is a "
                        "terminal)")

