"""MSCCL++'s signal/wait fusion unit tests (rewritten in tests/programs_unbalanced/) are balanced per rank
pair but not per channel. MSCCL++'s DSL compiles them, so ours must too: the plan is emitted with
a DSLWarning per unbalanced channel, strict mode refuses it, and the verifier reports the
deadlock the imbalance causes."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
import warnings
from pathlib import Path

import pytest

from mscclang import DSLError, DSLWarning
from mscclang.plan import load_plan
from mscclang.plan.models import OpName
from mscclang.sim import verify

# not in tests/programs/: those are correct collectives, compiled and verified by other tests
PROGRAMS = Path(__file__).parent / "programs_unbalanced"
CASES = {"signal_wait_fuse": (OpName.signal, OpName.wait),
         "relaxed_signal_wait_fuse": (OpName.rlxsignal, OpName.rlxwait)}


def run_script(name: str, *args: str) -> tuple[str, list[warnings.WarningMessage]]:
    """Run tests/programs/<name>.py as a script; return what it printed and the warnings."""
    path = PROGRAMS / f"{name}.py"
    buf = io.StringIO()
    old = sys.argv
    sys.argv = [str(path), *args]
    try:
        with warnings.catch_warnings(record=True) as record, contextlib.redirect_stdout(buf):
            warnings.simplefilter("always")
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = old
    return buf.getvalue(), list(record)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_with_one_warning_per_unbalanced_channel(name):
    text, record = run_script(name)
    plan = load_plan(text)
    sig, wait = CASES[name]
    for rank in (0, 1):
        ops = [(o.name, o.channel_ids) for o in plan.gpus[rank].threadblocks[0].ops if o.name != OpName.nop]
        # the fusion this unit test exists for: one signal over channels 0 and 1, one wait over 2 and 3
        assert ops == [(sig, [0, 1]), (wait, [2, 3])]
    msgs = sorted(str(w.message) for w in record if issubclass(w.category, DSLWarning))
    assert len(msgs) == 8, msgs  # 2 ranks x 4 channels, each unbalanced
    assert any(m.startswith("unbalanced signal/wait: rank 0 signals 1 times on its memory channel 0 to rank 1, "
                            "but rank 1 waits 0 times on the paired memory channel 0") for m in msgs)
    assert any("rank 1 signals 0 times on its memory channel 3 to rank 0, but rank 0 waits 1 times on the "
               "paired memory channel 3" in m for m in msgs)
    assert all(Path(w.filename).name == f"{name}.py" for w in record if issubclass(w.category, DSLWarning))


def test_strict_mode_refuses_it():
    with pytest.raises(DSLError, match=r"unbalanced signal/wait: rank 0 signals 1 times on its memory channel 0 "
                                       r".*\(and 7 more unbalanced channels\) \[strict mode\]"):
        run_script("signal_wait_fuse", "--strict")


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify_reports_the_deadlock(name):
    text, _ = run_script(name)
    report = verify(load_plan(text), schedules=2, sizes=[16], dtypes=["float32"])
    assert not report.ok
    assert any(p.kind == "deadlock" for p in report.problems), str(report)
    shown = str(report)
    assert "deadlock" in shown and "memory channel 2" in shown


def _six_signals_five_waits():
    """Rank 0 signals 6 times on its memory channel to rank 1, which waits 5 times: no hang (the
    extra signal is never consumed), an unbalanced channel."""
    from mscclang.dsl import CollectiveProgram, MemoryChannel, TestCollective

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with CollectiveProgram("six_five", TestCollective(2, 0, 0), 2, protocol="Simple") as prog:
            a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
            for _ in range(6):
                a.signal(tb=0)   # L-six-signals
            for _ in range(5):
                b.wait(tb=0)
        plan = prog.to_plan()
    return plan, [str(w.message) for w in record if issubclass(w.category, DSLWarning)]


def test_verify_s_unbalanced_channel_has_its_line_and_the_compile_warning_s_counts():
    plan, warned = _six_signals_five_waits()
    assert len(warned) == 1 and "signals 6 times" in warned[0] and "waits 5 times" in warned[0]
    src = Path(__file__).read_text().splitlines()
    line = next(i + 1 for i, t in enumerate(src) if t.rstrip().endswith("# L-six-signals"))
    report = verify(plan, schedules=1, sizes=[16], dtypes=["float32"], launches=2)
    found = [p for p in report.problems if p.kind == "unbalanced-channel"]
    assert len(found) == 1 and not report.ok, str(report)
    msg = found[0].message
    assert "received 6 signals per launch from rank 0" in msg and "waited for 5 per launch" in msg, msg
    assert f"first signal: rank 0 tb 0 op " in msg and f"test_dsl_unbalanced.py:{line}" in msg, msg
