"""Execution parameters of the simulator's entry points (``run``, ``run_fused``, ``verify``,
``verify_fused``) are checked before anything is allocated, a plan none of whose cases runs is
refused rather than reported OK, and fused cases are sized per dtype inside the plan's message
size range."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from mscclang.algorithms.allreduce import build_oneshot_ll
from mscclang.algorithms.fused import build_fused_oneshot_ll
from mscclang.errors import VerificationError
from mscclang.plan.io import plan_from_dict, plan_to_dict
from mscclang.plan.models import Plan
from mscclang.sim import VerifyOptions, run, verify
from mscclang.sim.epilogue import EpilogueParams
from mscclang.sim.fused import estimate_fused, run_fused, verify_fused

ROOT = Path(__file__).resolve().parent.parent


def _sized(plan: Plan, lo: int, hi: int) -> Plan:
    """``plan`` with message sizes ``[lo, hi]``."""
    d = plan_to_dict(plan)
    d["min_message_size"], d["max_message_size"] = lo, hi
    return plan_from_dict(d)


def _fused(lo: int = 0, hi: int = 1 << 20) -> Plan:
    return _sized(build_fused_oneshot_ll(2), lo, hi)


# ------------------------------------------------------------------ nothing verified is no OK


@pytest.mark.parametrize("lo, hi", [(0, 0), (3, 3)])
def test_a_fused_plan_whose_range_holds_no_case_is_refused(lo: int, hi: int) -> None:
    with pytest.raises(VerificationError, match=rf"nothing to verify.*\[{lo}, {hi}\]"):
        verify(_fused(lo, hi), schedules=1)


def test_a_plain_plan_whose_range_holds_no_size_is_refused() -> None:
    with pytest.raises(VerificationError, match=r"nothing to verify.*\[0, 0\]"):
        verify(_sized(build_oneshot_ll(2), 0, 0), schedules=1)


@pytest.mark.parametrize("kw", [{"sizes": []}, {"max_problems": 0}, {"max_problems": -1}])
def test_arguments_that_leave_nothing_to_run_are_refused(kw: dict) -> None:
    for plan in (build_oneshot_ll(2), _fused()):
        with pytest.raises(VerificationError):
            verify(plan, schedules=1, **kw)


def test_verify_cli_says_nothing_verified_and_exits_nonzero(tmp_path: Path) -> None:
    f = tmp_path / "empty.json"
    f.write_text(__import__("json").dumps(plan_to_dict(_fused(0, 0))))
    for extra in ([], ["--strict"]):
        p = subprocess.run([sys.executable, "-m", "mscclang", "verify", str(f), "--schedules", "1", *extra],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert p.returncode != 0 and "OK" not in p.stdout, (p.stdout, p.stderr)
        assert "nothing to verify" in p.stderr and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


# ------------------------------------------------------------------ cases sized per dtype


def test_a_byte_size_is_that_many_bytes_in_every_dtype() -> None:
    """1 MiB on a plan whose maximum is 1 MiB: fp16 cases and fp32 cases both of 1 MiB."""
    est = estimate_fused(_fused(0, 1 << 20), sizes=[1 << 20], schedules=1, dtypes=("float16", "float32"))
    assert est.seconds > 0
    rep = verify(_fused(0, 64), sizes=[64], schedules=1, dtypes=("float16", "float32"), packet_types=("LL16",))
    assert rep.ok and rep.sizes == [64] and set(rep.dtypes) == {"float16", "float32"}, str(rep)


def test_a_16_byte_maximum_runs_its_default_case_in_the_dtypes_that_fit() -> None:
    rep = verify(_fused(0, 16), schedules=1, packet_types=("LL16",))
    assert rep.ok and rep.sizes == [16] and set(rep.dtypes) == {"float16", "bfloat16"}, str(rep)


def test_a_one_size_range_runs_every_dtype_at_that_size() -> None:
    """min = max = 64 B: 4 rows of 8 in float16 and bfloat16, 2 rows of 8 in float32."""
    from mscclang.sim.fused import default_cases

    plan = _fused(64, 64)
    assert [(c.rows, c.hidden, len(c.dtypes)) for c in default_cases(plan)] == [(4, 8, 2), (2, 8, 1)]
    rep = verify(plan, schedules=1, packet_types=("LL16",))
    assert rep.ok and rep.sizes == [64] and set(rep.dtypes) == {"float16", "bfloat16", "float32"}, str(rep)


def test_an_explicit_size_outside_the_range_is_refused() -> None:
    with pytest.raises(VerificationError, match=r"128 bytes.*outside the plan's message sizes \[0, 64\]"):
        verify(_fused(0, 64), sizes=[128], schedules=1, dtypes=("float16",))


# ------------------------------------------------------------------ checked before allocating


def test_a_huge_hidden_size_is_refused_before_its_weight_is_built() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(Exception, match="hidden size"):
            verify_fused(_fused(), cases=[(1, 1 << 24)], schedules=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak   # a 2^24 weight is 64 MiB


def test_run_fused_refuses_a_message_outside_the_plan_s_range() -> None:
    xs = [np.ones(32, np.float32)] * 2   # 128 bytes
    with pytest.raises(VerificationError, match=r"128 bytes.*outside the plan's message sizes \[0, 64\]"):
        run_fused(_fused(0, 64), xs, xs, EpilogueParams(8, np.ones(8, np.float32)))


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling a plan for the simulator or starting a simulation fails the test: the argument
    checks must come first."""
    def refuse(*args: object, **kw: object) -> None:
        raise AssertionError("a program was compiled or a simulation started before the arguments were checked")

    for name in ("runner", "fused", "verify"):
        mod = importlib.import_module(f"mscclang.sim.{name}")
        monkeypatch.setattr(mod, "sim_program", refuse)
        monkeypatch.setattr(mod, "Simulation", refuse)


_BAD_RUN = [({"schedule": "bogus"}, "schedule"), ({"packet_type": "LL4"}, "packet type"),
            ({"launches": 0}, "launches"), ({"launches": True}, "launches"), ({"launches": 2.0}, "launches"),
            ({"seed": -1}, "seed"), ({"seed": "a"}, "seed")]


@pytest.mark.parametrize("kw, what", _BAD_RUN + [({"accum": "int8"}, "accum"), ({"output_bytes": -4}, "output_bytes"),
                                                ({"reduce_op": "prod"}, "reduce op")])
def test_run_checks_every_parameter_first(kw: dict, what: str, no_run: None) -> None:
    with pytest.raises(VerificationError, match=what):
        run(build_oneshot_ll(2), [np.ones(64, np.float32)] * 2, **kw)


@pytest.mark.parametrize("kw, what", _BAD_RUN)
def test_run_fused_checks_every_parameter_first(kw: dict, what: str, no_run: None) -> None:
    xs = [np.ones(16, np.float32)] * 2
    with pytest.raises(VerificationError, match=what):
        run_fused(_fused(), xs, xs, EpilogueParams(8, np.ones(8, np.float32)), **kw)


@pytest.mark.parametrize("kw, what", [({"packet_types": ["LL4"]}, "packet type"), ({"max_problems": 1.5}, "max_problems"),
                                      ({"reduce_ops": ["prod"]}, "reduce op"),
                                      ({"cases": [(1,)]}, "case"), ({"cases": [(1, 8, 2)]}, "case")])
def test_verify_checks_every_parameter_first(kw: dict, what: str, no_run: None) -> None:
    plans = [build_oneshot_ll(2), _fused()] if "cases" not in kw else [_fused()]
    for plan in plans:
        with pytest.raises(VerificationError, match=what):
            (verify_fused if "cases" in kw else verify)(plan, schedules=1, **kw)


# ------------------------------------------------------------------ plain plans: explicit sizes


def test_a_plain_plan_is_verified_at_a_size_given_outside_its_range() -> None:
    """A size given explicitly is verified even outside the plan's message range (the library's
    tests verify the large-message plans at small sizes); a fused plan's sizes must lie in it."""
    rep = verify(_sized(build_oneshot_ll(2), 0, 64), sizes=[128], schedules=1, dtypes=("float32",))
    assert rep.ok and rep.runs >= 1 and rep.sizes == [128], rep


# ------------------------------------------------------------------ the options record


def test_verify_takes_the_options_record_and_keywords_replace_its_fields() -> None:
    """``verify(plan, VerifyOptions(...), k=v)`` is ``verify(plan, ...)`` with that field
    replaced, for a plain and a fused plan (which gets the record whole); an unknown keyword is
    a TypeError naming it."""
    for plan in (build_oneshot_ll(2), _fused(0, 64)):
        base = VerifyOptions(schedules=2, seed=5, dtypes=("float32",), packet_types=("LL16",), symbolic=False)
        got = verify(plan, base, seed=3)
        want = verify(plan, schedules=2, seed=3, dtypes=("float32",), packet_types=("LL16",), symbolic=False)
        assert got.ok and (got.runs, got.sizes, got.schedules, got.dtypes) == (
            want.runs, want.sizes, want.schedules, want.dtypes), (got, want)
        assert base.seed == 5   # the record is not changed
        with pytest.raises(TypeError, match="shedules"):
            verify(plan, shedules=2)


def test_senders_are_refused_for_a_fused_plan_however_it_is_verified() -> None:
    for check in (verify, verify_fused):
        with pytest.raises(VerificationError, match="senders are only meaningful for sendrecv"):
            check(_fused(), schedules=1, senders=[1, 0])
