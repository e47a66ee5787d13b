"""The ``mscclang`` command. Each subcommand lives in its own module of this package, named in
``COMMANDS``; a module provides ``add_parser(subparsers)`` (registering one subparser whose
default ``func`` is its runner) and the runner ``run(args) -> int``. User mistakes are reported
on stderr with exit code 1, never with a traceback; Ctrl-C ends any command with the one line
``mscclang COMMAND: interrupted`` and exit code 130 (128 + SIGINT, as shells report it)."""

from __future__ import annotations

import argparse
import atexit
import difflib
import importlib
import os
import re
import signal
import sys
import textwrap
import threading
import time
from typing import Iterable, NoReturn, Optional, Sequence

from mscclang.errors import MscclangError

# subcommand name -> module under mscclang.cli
COMMANDS: dict[str, str] = {
    "compile": "compile_cmd",
    "import-mscclpp": "import_cmd",
    "export-mscclpp": "export_cmd",
    "show": "show_cmd",
    "verify": "verify_cmd",
    "predict": "predict_cmd",
    "run": "run_cmd",
    "build-kernel": "build_kernel_cmd",
    "bench": "bench_cmd",
    "tune": "tune_cmd",
    "demo": "demo_cmd",
    "env": "env_cmd",
    "generate-plans": "generate_cmd",
    "schema": "schema_cmd",
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors exit with status 1 (like every other user mistake),
    not argparse's 2, and whose string choices are case-insensitive (``--protocol ll`` is
    ``LL``). It knows the names of :func:`mscclang.cli.args.register_names`. Subcommand parsers
    inherit the class."""

    def __init__(self, *args: object, **kw: object) -> None:
        from mscclang.cli.args import register_names

        super().__init__(*args, **kw)  # type: ignore[arg-type]
        register_names(self)

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")

    def _check_value(self, action: argparse.Action, value: object) -> None:
        near = isinstance(action, argparse._SubParsersAction) and value not in action.choices and did_you_mean(
            str(value), action.choices)
        if near:
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (did you mean {near}?)")
        super()._check_value(action, value)  # type: ignore[misc]

    def _get_value(self, action: argparse.Action, arg_string: str) -> object:
        value = super()._get_value(action, arg_string)  # type: ignore[misc]
        choices = action.choices
        if (choices is not None and isinstance(value, str) and value not in choices
                and not isinstance(action, argparse._SubParsersAction)):
            same = [c for c in choices if isinstance(c, str) and c.lower() == value.lower()]
            if len(same) == 1:
                return same[0]
        return value


#: reST roles (``:mod:`x```, ``:func:`~a.b```) and literals (````x````) of the docstrings
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_ITEM = re.compile(r"\s*(?:(?:\*|\d+\.) )?")


def plain_text(text: str) -> str:
    """A docstring's reST as terminal text: ``:mod:`a.b``` is ``a.b`` (``~a.b``: ``b``), a
    ````literal```` loses its backquotes, ``**bold**`` its stars."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return text.replace("``", "").replace("**", "")


class _HelpFormatter(argparse.HelpFormatter):
    """Help texts as plain text (:func:`plain_text`); a description's paragraphs (blank-line
    separated) and list items (``* ``, ``1. ``) are refilled to the terminal one by one."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        parts = re.split(r"(\n\s*\n|\n(?=\s*(?:\*|\d+\.) ))", plain_text(text).strip())  # paragraphs, list items
        return "".join(("\n\n" if p.count("\n") > 1 else "\n") if i % 2 else textwrap.fill(
            " ".join(p.split()), width, initial_indent=indent, break_on_hyphens=False,
            subsequent_indent=indent + " " * len(_ITEM.match(p)[0])) for i, p in enumerate(parts))

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(plain_text(text), width)


def build_parser() -> argparse.ArgumentParser:
    """The ``mscclang`` parser: every subcommand of :data:`COMMANDS`, described by its module's
    docstring unless it gives a description, all help shown as plain text."""
    parser = _Parser(
        prog="mscclang",
        description="Compile, verify, show and run mscclang collective plans.", formatter_class=_HelpFormatter,
    )
    from mscclang import __version__

    parser.add_argument("--version", action="version", version=f"mscclang {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"mscclang.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name == f"mscclang.cli.{module}":
                continue  # not built yet
            raise
        mod.add_parser(sub)
        p = sub.choices[name]
        p.description, p.formatter_class = p.description or mod.__doc__, _HelpFormatter
    return parser


def did_you_mean(word: str, known: Iterable[str]) -> Optional[str]:
    """The one of ``known`` (option or command names) closest to the mistyped ``word``, or None
    when none is close: the hint of an unknown flag and of an unknown command."""
    return next(iter(difflib.get_close_matches(word, list(known), n=1)), None)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, with arguments no option takes reported by the subcommand's parser
    (``mscclang run: error: unrecognized arguments: ...``), as its other usage errors are."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        target = sub.choices.get(getattr(args, "command", None) or "", parser)
        known = [o for a in target._actions for o in a.option_strings]
        typos = [(x, did_you_mean(x, known)) for x in (y.split("=")[0] for y in extra)
                 if x.startswith("-") and not _NEGATIVE.match(x)]
        hint = "; ".join(f"{x}: did you mean {near}?" for x, near in typos if near)
        hint = (f" ({hint})" if hint else "" if all(x.startswith("-") for x in extra)
                else " (a list is one comma list per option: --sizes 1K,4M)")
        target.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


#: options whose value may look like a negative number (``--size -4K``): joined to their option
#: (``--size=-4K``) so the size parser, not argparse's "expected one argument", reports it
_VALUE_OPTIONS = frozenset({"--size", "--sizes"})
_NEGATIVE = re.compile(r"^-\d")

#: exit status after Ctrl-C
INTERRUPTED = 130


def _join_negative_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    for a in argv:
        if out and out[-1] in _VALUE_OPTIONS and _NEGATIVE.match(a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


#: seconds the interrupt path waits for what the command started to end (a library thread asleep in
#: a wait, such as tqdm's monitor, sees the interrupt only when it wakes)
STOP_WAIT_S = 3.0


def _stop_started(threads: Optional[set[int]], children: set[int], wait_s: float = STOP_WAIT_S) -> None:
    """After Ctrl-C: terminate (then kill) the child processes the command started (those not in
    ``children``, by ``id``), raise KeyboardInterrupt in each thread it started (not in
    ``threads``, by ident: the simulator's rank threads, a progress ticker; None: leave them), and
    wait at most ``wait_s`` in all for them to end. Until they have, a thread ended by the
    interrupt prints no traceback, and one whose interrupt Python could only report as unraisable
    (it landed in a gc callback) reports nothing."""
    import ctypes
    import multiprocessing

    end = time.monotonic() + wait_s
    procs = [p for p in multiprocessing.active_children() if id(p) not in children]
    started = [t for t in threading.enumerate() if threads is not None and t.ident not in threads]
    hook, unraisable = threading.excepthook, sys.unraisablehook
    threading.excepthook = lambda a: None if a.exc_type is KeyboardInterrupt else hook(a)
    # a thread interrupted inside a gc callback (or a __del__) can only report it as unraisable
    sys.unraisablehook = lambda a: None if a.exc_type is KeyboardInterrupt else unraisable(a)
    for p in procs:
        p.terminate()
    for t in started:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident or 0), ctypes.py_object(KeyboardInterrupt))
    for w in [*procs, *started]:
        w.join(max(0.0, end - time.monotonic()))
    for p in procs:
        p.kill()   # no-op when it ended
    if not any(t.is_alive() for t in started):
        threading.excepthook, sys.unraisablehook = hook, unraisable


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``mscclang ARGV`` (None: ``sys.argv[1:]``, this process is the command) and return its
    exit status. On Ctrl-C (or an error a SIGINT turned into, such as a C extension's failed
    import), what the command started is stopped (:func:`_stop_started`; a second Ctrl-C does not
    cut that short), one line ``mscclang COMMAND: interrupted`` goes to stderr and the status is
    130; when this process is the command, it then ends at once (its ``atexit`` functions run,
    the interpreter's finalization does not: the C++ destructors it runs abort under threads a
    library such as torch still has busy, ``terminate called without an active exception``)."""
    import multiprocessing

    from mscclang.cli.progress import progress_wanted

    whole = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    threads, children = {t.ident or 0 for t in threading.enumerate()}, set(map(id, multiprocessing.active_children()))
    got: list[int] = []   # SIGINTs seen, whatever error the first turned into (a C extension's import fails)

    def on_sigint(signum: int, frame: object) -> None:
        got.append(signum)
        if len(got) == 1:
            raise KeyboardInterrupt

    if ours := (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, on_sigint)
    try:
        return _main(argv)
    except BaseException as e:
        if not (isinstance(e, KeyboardInterrupt) or got):
            raise
        got.append(signal.SIGINT)
        _stop_started(None if whole else threads, children)   # whole: os._exit ends the threads
        # on a terminal, start a fresh line after the echoed ^C (or a progress bar)
        fresh = "\n" if progress_wanted(None) else ""
        print(f"{fresh}mscclang{' ' + command if command in COMMANDS else ''}: interrupted", file=sys.stderr, flush=True)
        if whole:   # no interpreter exit: C++ destructors under a library's busy threads abort (torch's)
            atexit._run_exitfuncs()
            sys.stdout.flush()
            os._exit(INTERRUPTED)
        return INTERRUPTED
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _main(argv: list[str]) -> int:
    # everything after a bare "--" belongs to the user's program (mscclang compile P.py -- ARGS)
    passthrough: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    parser = build_parser()
    args = _parse(parser, _join_negative_values(argv))
    args.passthrough = passthrough
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 1
    try:
        return int(args.func(args) or 0)
    except MscclangError as e:
        print(f"mscclang {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a file or folder the user named: its name and why, not "[Errno 13] ..."
        where = f"{e.filename}: " if e.filename else ""
        print(f"mscclang {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
