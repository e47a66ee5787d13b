"""``mscclang compile PROGRAM.py [-o plan.json] [-- PROGRAM_ARGS...]``: run a DSL program and
write the plan it builds.

Two kinds of program are accepted.

1. **Scripts** (the MSCCL++ example style). The file is run as ``__main__`` with
   ``sys.argv = [PROGRAM.py, *PROGRAM_ARGS]`` (everything after ``--``, unchanged, so the script
   parses its own ``--num_gpus``, ``--instances``, ``--num_threads_per_block``...) and prints
   ``JSON()``. Its standard output is captured; the JSON plan in it is the result and any other
   text it prints is passed on to standard error. An MSCCL++ plan (no ``format`` key) is
   converted.

2. **Functions.** With ``--function NAME`` or any of ``--ranks/--instances/--protocol``, the file
   is imported (``__name__`` is not ``"__main__"``, so its script part does not run) and
   ``NAME`` (default ``program``) is called with keyword arguments::

       def program(ranks: int, instances: int = 1, protocol: str = "Simple") -> CollectiveProgram:
           ...

   ``ranks`` may also be spelled ``num_ranks``, ``num_gpus`` or ``nranks``; parameters the
   function does not declare are not passed (unless it takes ``**kwargs``). ``--ranks`` is
   required, ``--instances`` defaults to 1 and ``--protocol`` to ``Simple``. The function may
   return a ``CollectiveProgram`` (its ``to_json()`` is used), a ``Plan``, a plan dict, JSON text,
   or ``None`` after printing ``JSON()`` itself.

The plan is validated (``--no-check`` skips the semantic checks) and written to ``-o`` or to
standard output (``-o -`` too), as an mscclang plan or, with ``--format mscclpp``, as an MSCCL++
plan. A plan over ``MSCCLANG_MAX_PLAN_BYTES`` (the size ``verify``, ``show`` and ``predict`` read)
is never written; a program whose plan would be far over that or ``MSCCLANG_MAX_PLAN_OPS`` is
refused before the compiler's passes, with the estimate (:mod:`mscclang.compiler.budget`). With
``--progress`` (or on a terminal) the bar counts the ops recorded, then thousandths of the work
the estimate expects, pass by pass and rank by rank (:mod:`mscclang.compiler.meter`). What was written (plan name, collective, ranks, thread blocks, ops, where) is reported on
standard error (``-q`` silences it), so standard output holds nothing but the plan.

Warnings of the DSL (:class:`~mscclang.DSLWarning`, e.g. a signal/wait imbalance on one channel,
which MSCCL++'s DSL compiles and ``mscclang verify`` reports as a deadlock, or a program that
builds no op at all) are printed on
standard error as ``PROGRAM.py:LINE: warning: ...``; ``--strict`` makes them errors (exit 1, no
plan written).

Given a JSON plan instead of a program, the command says so (and suggests ``verify`` and
``show``) instead of running it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import io
import json
import runpy
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from mscclang.cli.args import add_progress_flag
from mscclang.cli.progress import Progress
from mscclang.compiler.budget import check_ranks
from mscclang.compiler.driver import collector_paused
from mscclang.compiler.meter import advance, reporting
from mscclang.compiler.validate import MAX_THREADBLOCKS
from mscclang.config import Settings, settings
from mscclang.errors import CompileError, DSLError, DSLWarning, LimitError, MscclangError, MscclangWarning, PlanError
from mscclang.plan.io import load_plan, plan_to_dict, plan_to_json
from mscclang.plan.models import Plan
from mscclang.units import format_bytes

__all__ = ["add_parser", "run", "compile_file", "describe_output", "ProgramError"]

RANK_NAMES = ("ranks", "num_ranks", "num_gpus", "nranks")
#: the progress bar's steps: the compile's expected work (mscclang.compiler.meter), in thousandths
PROGRESS_STEPS = 1000


class ProgramError(MscclangError):
    """The user's program failed (raised, exited with an error, or printed no plan)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compile", help="run a DSL program and write the plan it builds",
        description="Run a DSL program and write its plan. A script prints JSON() and gets the "
                    "arguments after '--'; a program that defines a function is called with "
                    "--ranks/--instances/--protocol (see --function).",
        epilog="example: mscclang compile examples/allreduce_8rank.py -o plan.json -- --num_gpus 8")
    p.add_argument("program", metavar="PROGRAM.py", help="the DSL program")
    p.add_argument("-o", "--output", metavar="PLAN.json", default=None,
                   help="where to write the plan (default, or '-': standard output)")
    p.add_argument("--function", metavar="NAME", default=None,
                   help="call this function of the program instead of running it as a script "
                        "(default name with --ranks: 'program')")
    p.add_argument("--ranks", type=int, default=None, help="number of ranks (function programs)")
    p.add_argument("--instances", type=int, default=None, help="instances (function programs; default 1)")
    p.add_argument("--protocol", choices=("Simple", "LL"), default=None,
                   help="protocol (function programs; default Simple)")
    p.add_argument("--format", choices=("mscclang", "mscclpp"), default="mscclang",
                   help="write an mscclang plan (default) or an MSCCL++ 0.9 plan")
    p.add_argument("--no-check", action="store_true",
                   help="skip the semantic plan checks (the plan's fields are still validated)")
    p.add_argument("--strict", action="store_true",
                   help="treat DSL warnings (e.g. a signal/wait imbalance on one channel) as errors")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="do not report what was written (warnings and errors are still printed)")
    add_progress_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    function = args.function
    if function is None and (args.ranks is not None or args.instances is not None
                             or args.protocol is not None):
        function = "program"
    with (warnings.catch_warnings(record=True) as caught,
          Progress(None, f"compile {Path(args.program).name}", unit="step", enabled=args.progress) as bar):
        warnings.simplefilter("always", MscclangWarning)

        def step(done: int, total: Optional[int], note: str) -> None:
            if total is None:  # recording: the ops so far
                bar.set_note(f"{note}: {done:,} ops")
                return
            bar.set_total(PROGRESS_STEPS)
            if note != bar.note:
                bar.set_note(note)
            bar.update(max(0, PROGRESS_STEPS * done // max(1, total) - bar.n))

        try:
            with reporting(step), collector_paused():
                plan = compile_file(args.program, getattr(args, "passthrough", []), function=function,
                                    ranks=args.ranks, instances=args.instances, protocol=args.protocol,
                                    check=not args.no_check, strict=args.strict)
                advance("writing the plan", 0.62)
                text = _plan_text(plan, args.format)
        finally:
            bar.close()
            _print_warnings(caught)
    to_stdout = args.output in (None, "-")
    if to_stdout:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            Path(args.output).write_text(text)
        except OSError as e:
            raise ProgramError(f"cannot write {args.output}: {e.strerror}") from None
    if not args.quiet:
        where = "standard output" if to_stdout else args.output
        print(f"mscclang compile: {describe_output(plan, args.format)}, to {where}", file=sys.stderr)
    return 0


def _plan_text(plan: Plan, fmt: str) -> str:
    """The plan's JSON text in ``fmt``; LimitError when it is more than plans are read with."""
    if fmt == "mscclpp":
        from mscclang.plan.mscclpp import to_mscclpp

        text = json.dumps(to_mscclpp(plan), indent=2) + "\n"
    else:
        text = plan_to_json(plan)
    size, limit = len(text.encode()), settings.max_plan_bytes
    if size > limit:
        raise LimitError(f"the plan is {format_bytes(size)}, over the {format_bytes(limit)} limit on plans (set "
                         f"{Settings.max_plan_bytes.name} to raise it), which verify, show and predict enforce; nothing "
                         "was written")
    return text


def describe_output(plan: Plan, fmt: str = "mscclang") -> str:
    """``wrote allreduce plan 'name' (format): R ranks, T thread blocks per rank, N ops`` (ops
    counts every op record of every rank and thread block, inner ops of pipelines included)."""
    per_rank = [len(g.threadblocks) for g in plan.gpus]
    lo, hi = min(per_rank, default=0), max(per_rank, default=0)
    tbs = f"{hi}" if lo == hi else f"{lo}-{hi}"
    n_ops = 0
    for g in plan.gpus:
        for tb in g.threadblocks:
            for op in tb.ops:
                n_ops += 1 + len(op.ops or [])
    n = len(plan.gpus)
    form = "MSCCL++ 0.9 format" if fmt == "mscclpp" else plan.format
    return (f"wrote {plan.collective} plan {plan.name!r} ({form}): {n} rank{'s' if n != 1 else ''}, "
            f"{tbs} thread block{'s' if hi != 1 else ''} per rank ({sum(per_rank)} in all), {n_ops} ops")


def _print_warnings(caught: list[warnings.WarningMessage]) -> None:
    """Print recorded warnings on stderr: ``FILE:LINE: warning: message``."""
    for w in caught:
        where = f"{Path(w.filename).name}:{w.lineno}: " if w.filename else ""
        kind = "warning" if issubclass(w.category, MscclangWarning) else w.category.__name__
        print(f"{where}{kind}: {w.message}", file=sys.stderr)


def compile_file(program: str | Path, argv: Sequence[str] = (), function: Optional[str] = None,
                    ranks: Optional[int] = None, instances: Optional[int] = None,
                    protocol: Optional[str] = None, check: bool = True, strict: bool = False) -> Plan:
    """Run a DSL program (see the module docstring) and return the validated plan it builds.

    The DSL's warnings (:class:`~mscclang.MscclangWarning`) reach the caller through
    :mod:`warnings` as usual; with ``strict`` the first one raises :class:`~mscclang.DSLError`
    instead (naming how many there were)."""
    path = Path(program)
    if not path.is_file():
        raise ProgramError(f"program {path} does not exist" if not path.exists()
                           else f"program {path} is not a file")
    _refuse_plan_file(path)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", MscclangWarning)
            plan = _compile(path, argv, function, ranks, instances, protocol, check)
            if not any(tb.ops for g in plan.gpus for tb in g.threadblocks):
                warnings.warn_explicit(f"the program built no ops: plan {plan.name!r} moves no data", DSLWarning,
                                       str(path), 1)
    finally:
        ours = [w for w in caught if issubclass(w.category, MscclangWarning)]
        for w in caught:  # hand them on (the CLI prints them; a library caller sees them as usual)
            if not (strict and w in ours):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if strict and ours:
        more = f" (and {len(ours) - 1} more warnings)" if len(ours) > 1 else ""
        first = ours[0]
        raise DSLError(f"{Path(first.filename).name}:{first.lineno}: {first.message}{more} "
                       "[strict: warnings are errors]")
    return plan


def _refuse_plan_file(path: Path) -> None:
    """A JSON file (a plan, most likely) given where a Python program is expected."""
    try:
        head = path.read_bytes()[:4096].lstrip()
    except OSError as e:
        raise ProgramError(f"cannot read {path}: {e.strerror}") from None
    if path.suffix.lower() != ".json" and not head.startswith((b"{", b"[")):
        return
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        if path.suffix.lower() == ".json":
            raise ProgramError(f"{path} ends in .json, so it is not a DSL program: `mscclang compile` runs a "
                               "Python program that builds a plan (plan files are read by `mscclang verify` "
                               "and `mscclang show`)") from None
        return
    hint = f"`mscclang verify {path}` checks it in the simulator and `mscclang show {path}` prints it"
    if isinstance(doc, dict) and "gpus" in doc:
        kind = "an MSCCL++ execution plan" if "format" not in doc else "an execution plan"
        raise ProgramError(f"{path} is {kind}, not a DSL program: `mscclang compile` runs a Python program "
                           f"that builds a plan; {hint}")
    raise ProgramError(f"{path} is a JSON file, not a DSL program: `mscclang compile` runs a Python program "
                       "that builds a plan")


def _compile(path: Path, argv: Sequence[str], function: Optional[str], ranks: Optional[int],
             instances: Optional[int], protocol: Optional[str], check: bool) -> Plan:
    if function is None:
        printed, _ = _run_file(path, argv, "__main__")
        doc = _find_plan(printed, path)
        if doc is None:
            raise ProgramError(
                f"{path} printed no plan: a script must print JSON() (to compile a function of "
                f"the program instead, pass --function NAME or --ranks N)")
    else:
        if ranks is None:
            raise ProgramError(f"calling {function}() of {path} needs --ranks")
        if ranks < 1:
            raise ProgramError(f"--ranks must be at least 1, got {ranks}")
        if instances is not None and instances < 1:
            raise ProgramError(f"--instances must be at least 1, got {instances}")
        if instances is not None and instances > MAX_THREADBLOCKS:
            raise ProgramError(f"--instances {instances}: {instances} instances is too many (each instance "
                               f"of a thread block is a thread block, and a rank has at most {MAX_THREADBLOCKS})")
        check_ranks(ranks, f"--ranks {ranks}: the program")
        if not _binds(path, function):
            raise ProgramError(_no_function(path, function))
        printed, namespace = _run_file(path, argv, "__mscclang_program__")
        fn = namespace.get(function)
        if not callable(fn):
            raise ProgramError(_no_function(path, function, printed))
        _echo(printed)
        kwargs = _arguments(fn, function, ranks, instances if instances is not None else 1,
                            protocol or "Simple")
        buf = io.StringIO()
        with _program_context(path, argv), contextlib.redirect_stdout(buf):
            try:
                result = fn(**kwargs)
                doc = _result_to_doc(result)
            except MscclangError as e:
                _locate(e, path)
                raise
            except SystemExit as e:
                raise ProgramError(f"{function}() of {path} exited with status {e.code}") from None
            except Exception as e:  # a bug in the user's program: say where, without a traceback
                raise ProgramError(_describe(e, path, f"{function}()")) from None
        printed = buf.getvalue()
        if doc is None:
            doc = _find_plan(printed, path)
            if doc is None:
                raise ProgramError(f"{function}() of {path} returned no plan (return the "
                                   "CollectiveProgram, or print JSON())")
        else:
            _echo(printed)
    advance("checking the plan", 0.45)
    return _to_plan(doc, check)


# ----------------------------------------------------------------------------------- helpers

@contextlib.contextmanager
def _program_context(path: Path, argv: Sequence[str]):
    """sys.argv and sys.path as ``python PROGRAM.py ARGS`` would have them."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        yield
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def _run_file(path: Path, argv: Sequence[str], run_name: str) -> tuple[str, dict]:
    buf = io.StringIO()
    namespace: dict = {}
    with _program_context(path, argv), contextlib.redirect_stdout(buf):
        try:
            namespace = runpy.run_path(str(path), run_name=run_name)
        except MscclangError as e:
            _echo(buf.getvalue())
            _locate(e, path)
            raise
        except SystemExit as e:
            code = e.code
            if code not in (None, 0):
                _echo(buf.getvalue())
                detail = f": {code}" if isinstance(code, str) else f" with status {code}"
                raise ProgramError(f"{path} exited{detail}") from None
        except Exception as e:
            _echo(buf.getvalue())
            raise ProgramError(_describe(e, path)) from None
    return buf.getvalue(), namespace


def _binds(path: Path, name: str) -> bool:
    """Whether the program's top level may bind ``name`` (a def, class, assignment or import of
    it, or a star import), read from its source without running it."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return True  # running it reports the problem
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                a.name == "*" or (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return True
    return False


def _no_function(path: Path, function: str, printed: str = "") -> str:
    """Why a program without ``function`` cannot take --ranks/--instances/--protocol."""
    script = " (it is a script: it printed a plan when run)" if '"gpus"' in printed else ""
    return (f"{path} defines no function {function!r}{script}: --ranks/--instances/--protocol call a "
            f"function {function}(ranks, instances, protocol); a script that reads its own arguments "
            f"takes them after '--' (mscclang compile {path} -- --num_gpus N)")


def _user_line(e: BaseException, path: Path) -> Optional[int]:
    """The line of the innermost traceback frame in the user's program file, if any."""
    target = str(path.resolve())
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        try:
            if str(Path(frame.filename).resolve()) == target:
                return frame.lineno
        except OSError:
            continue
    return None


def _locate(e: MscclangError, path: Path) -> None:
    """Prefix a DSL or compile error raised by the user's program with ``PROGRAM.py line N:``
    (the DSL call that failed), so the CLI's one-line message points at the program."""
    if not isinstance(e, (DSLError, CompileError)) or len(e.args) != 1 or not isinstance(e.args[0], str):
        return
    line = _user_line(e, path)
    if line is not None and not e.args[0].startswith(path.name):
        e.args = (f"{path.name} line {line}: {e.args[0]}",)


def _describe(e: BaseException, path: Path, what: Optional[str] = None) -> str:
    """``PROGRAM.py line N: TypeError: message`` from the innermost frame in the user's file."""
    where = ""
    if isinstance(e, SyntaxError) and e.lineno is not None:
        where = f" line {e.lineno}"
    else:
        line = _user_line(e, path)
        if line is not None:
            where = f" line {line}"
    msg = str(e) if not isinstance(e, SyntaxError) else (e.msg or str(e))
    subject = f"{what} of {path}" if what else str(path)
    return f"{subject} failed at{where or ' an unknown line'}: {type(e).__name__}: {msg}"


def _echo(text: str) -> None:
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")


def _find_plan(text: str, path: Path) -> Optional[dict]:
    """The last JSON object with a ``gpus`` key in ``text``; the rest goes to stderr."""
    stripped = text.strip()
    if not stripped:
        return None
    try:
        doc = json.loads(stripped)
        if isinstance(doc, dict) and "gpus" in doc:
            return doc
    except json.JSONDecodeError:
        pass
    decoder = json.JSONDecoder()
    found: Optional[tuple[int, int, dict]] = None
    pos = 0
    while True:
        start = text.find("{", pos)
        if start < 0:
            break
        if start == 0 or text[start - 1] == "\n":
            try:
                doc, end = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                pos = start + 1
                continue
            if isinstance(doc, dict) and "gpus" in doc:
                found = (start, end, doc)
            pos = end
        else:
            pos = start + 1
    if found is None:
        _echo(text)
        return None
    start, end, doc = found
    _echo((text[:start] + text[end:]).strip("\n"))
    return doc


def _arguments(fn: Any, name: str, ranks: int, instances: int, protocol: str) -> dict:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {"ranks": ranks, "instances": instances, "protocol": protocol}
    var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict = {}
    rank_name = next((n for n in RANK_NAMES if n in params), None)
    if rank_name is None:
        if not var_kw:
            raise ProgramError(f"function {name}() must take the number of ranks as one of "
                               f"{', '.join(RANK_NAMES)}")
        rank_name = "ranks"
    kwargs[rank_name] = ranks
    for key, value in (("instances", instances), ("protocol", protocol)):
        if key in params or var_kw:
            kwargs[key] = value
    return kwargs


def _result_to_doc(result: Any) -> Optional[dict]:
    if result is None:
        return None
    if hasattr(result, "to_plan") and callable(result.to_plan):  # a CollectiveProgram: no JSON text round trip
        result = result.to_plan()
    if isinstance(result, Plan):
        return plan_to_dict(result)
    if isinstance(result, dict):
        return result
    if hasattr(result, "to_json") and callable(result.to_json):
        result = result.to_json()
    if isinstance(result, (bytes, bytearray)):
        result = result.decode()
    if isinstance(result, str):
        try:
            doc = json.loads(result)
        except json.JSONDecodeError as e:
            raise ProgramError(f"the program's plan is not valid JSON: {e.msg} at line {e.lineno}") from None
        if not isinstance(doc, dict):
            raise ProgramError("the program's plan is not a JSON object")
        return doc
    raise ProgramError(f"the program returned a {type(result).__name__}, not a plan "
                       "(CollectiveProgram, Plan, dict or JSON text)")


def _to_plan(doc: dict, check: bool) -> Plan:
    from mscclang.plan.mscclpp import from_mscclpp, is_mscclpp_plan

    if is_mscclpp_plan(doc):
        return from_mscclpp(doc, check=check)
    try:
        return load_plan(doc, check=check)
    except PlanError as e:
        raise PlanError(f"the program built an invalid plan: {e.message}", e.path) from None
