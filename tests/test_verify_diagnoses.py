"""What ``verify`` says and how it exits (issue 11 defect 5, issue 14 items 2, 4, 5 and
"diagnoses a person can act on"): unknown collectives, NO POSTCONDITION, vacuous passes,
send/recv senders taken from the plan, MSCCL++ plans, grouped problems with true counts, cycles
from the author's first op, never-written outputs, and DSL source lines next to ops."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mscclang.dsl import CollectiveProgram, PortChannel, Rank, SendRecv, SyncType
from mscclang.errors import PlanError
from mscclang.plan import load_plan, plan_to_dict, to_mscclpp
from mscclang.plan.collectives import CollectiveSpec
from mscclang.plan.io import plan_from_dict
from mscclang.sim import verify
from mscclang.sim.planbuilder import L, PlanBuilder, R
from mscclang.sim.report import SHOW_PROBLEMS

from tests.harness.plan_samples import mscclpp_packet_allreduce
from tests.harness.cli import cli_inproc
from tests.harness.sim_plans import simple_allgather, switch_allreduce, wait_cycle, zero_copy_allreduce


DOCS_VERIFY = Path(__file__).resolve().parent.parent / "docs" / "verify.md"


def _write(tmp_path: Path, plan, name: str = "plan.json") -> Path:
    f = tmp_path / name
    f.write_text(json.dumps(plan if isinstance(plan, dict) else plan_to_dict(plan)))
    return f


def _set_src(plan, rank: int, tb: int, op: int, src: str) -> None:
    """Record a DSL source line on an op (the optional ``src`` field, or a plain attribute
    while the plan model has no such field)."""
    o = plan.gpus[rank].threadblocks[tb].ops[op]
    try:
        o.src = src
    except (ValueError, AttributeError):
        object.__setattr__(o, "src", src)


# ---------------------------------------------------------------- unknown collective names
def test_misspelled_collective_is_a_load_error_naming_the_valid_ones(tmp_path, capsys) -> None:
    doc = plan_to_dict(simple_allgather(wrong_chunk=True))
    doc["collective"] = "allgathr"
    with pytest.raises(PlanError) as ei:
        load_plan(doc)
    assert ei.value.path == "collective"
    assert "'allgathr'" in str(ei.value) and "did you mean 'allgather'" in str(ei.value)
    assert ("allreduce, allgather, reducescatter, alltoall, sendrecv, broadcast, allreduce_add_rms_norm, alltoallv, "
            "allgatherv, test, custom") in str(ei.value)
    # a Plan object made without the checks is refused by verify too (no silent skip)
    with pytest.raises(PlanError):
        verify(plan_from_dict(doc), schedules=1)
    res = cli_inproc(capsys, "verify", str(_write(tmp_path, doc)))
    assert res.returncode == 1 and "collective: unknown collective 'allgathr'" in res.stderr
    assert "Traceback" not in res.stderr and "OK" not in res.stdout


def test_collective_spec_refuses_unknown_names() -> None:
    with pytest.raises(PlanError, match="did you mean 'allreduce'"):
        CollectiveSpec("allreduc", 2, 1)


# ---------------------------------------------------------------- NO POSTCONDITION and --strict
def _test_plan(collective: str = "test", deadlock: bool = False, race: bool = False):
    """2 ranks of a collective without a postcondition: put the input into the peer's output
    and publish it (``race``: no final wait; ``deadlock``: both wait first)."""
    b = PlanBuilder(f"unit_{collective}", collective, 2, 1, 1)
    for r in range(2):
        p = 1 - r
        b.nop(r, 0)
        if deadlock:
            b.op(r, 0, "wait", channels=[p])
        b.op(r, 0, "rlxsignal", channels=[p])
        if not deadlock:
            b.op(r, 0, "rlxwait", channels=[p])
        b.nop(r, 0)
        b.op(r, 0, "put", src=[L("i", 0, 1)], dst=[R(p, "o", 0, 1)])
        b.nop(r, 0)
        b.op(r, 0, "signal", channels=[p])
        if not race:
            b.op(r, 0, "wait", channels=[p])
        b.nop(r, 0)
    return b.build()


@pytest.mark.parametrize("collective", ["test", "custom"])
def test_no_postcondition_is_neither_ok_nor_failed(collective: str) -> None:
    rep = verify(_test_plan(collective), schedules=3)
    assert rep.status == "NO POSTCONDITION" and not rep.ok and not rep.failed, str(rep)
    assert str(rep).startswith(f"verify unit_{collective}: NO POSTCONDITION (deadlocks and races checked)")
    assert rep.passed() and not rep.passed(strict=True)
    assert rep.exit_code() == 0 and rep.exit_code(strict=True) == 1


def test_no_postcondition_still_fails_on_deadlock_and_race() -> None:
    dl = verify(_test_plan(deadlock=True), schedules=2)
    assert dl.status == "FAILED" and "deadlock" in dl.kinds() and dl.exit_code() == 1
    race = verify(_test_plan(race=True), schedules=2)
    assert race.status == "FAILED" and "race" in race.kinds() and race.exit_code() == 1


def test_cli_exit_codes_no_postcondition_and_strict(tmp_path, capsys) -> None:
    good = _write(tmp_path, _test_plan(), "good.json")
    res = cli_inproc(capsys, "verify", str(good), "--schedules", "2")
    assert res.returncode == 0 and "NO POSTCONDITION (deadlocks and races checked)" in res.stdout
    res = cli_inproc(capsys, "verify", str(good), "--schedules", "2", "--strict")
    assert res.returncode == 1 and "NO POSTCONDITION" in res.stderr and "--strict" in res.stderr
    bad = _write(tmp_path, _test_plan(deadlock=True), "bad.json")
    res = cli_inproc(capsys, "verify", str(bad), "--schedules", "2")
    assert res.returncode == 1 and "FAILED" in res.stderr and "wait-for cycle" in res.stdout


# ---------------------------------------------------------------- vacuous passes
def test_a_plan_that_moves_no_bytes_passes_only_vacuously(tmp_path, capsys) -> None:
    b = PlanBuilder("empty_unit", "test", 2, 0, 0)
    for r in range(2):
        b.op(r, 0, "rlxsignal", channels=[1 - r])
        b.op(r, 0, "rlxwait", channels=[1 - r])
    rep = verify(b.build(), schedules=2)
    assert rep.vacuous and rep.status == "NO POSTCONDITION" and "vacuous" in str(rep).splitlines()[0]
    one = PlanBuilder("identity", "allreduce", 1, 1, 1, inplace=True)
    one.nop(0, 0)
    rep = verify(one.build(), schedules=2)
    assert rep.ok and rep.vacuous, str(rep)
    assert str(rep).splitlines()[0] == "verify identity: OK (vacuous: no op moves any byte at any size checked)"
    assert rep.passed() and not rep.passed(strict=True)
    assert not verify(simple_allgather(), schedules=2).vacuous
    f = _write(tmp_path, one.build())
    assert cli_inproc(capsys, "verify", str(f), "--schedules", "2").returncode == 0
    assert cli_inproc(capsys, "verify", str(f), "--schedules", "2", "--strict").returncode == 1


# ---------------------------------------------------------------- multimem-relaxed warnings
def test_relaxed_multimem_publication_is_a_warning_not_a_race(tmp_path, capsys) -> None:
    rep = verify(switch_allreduce("relaxed"), schedules=3)
    assert rep.kinds() == {"multimem-relaxed"} and rep.ok and not rep.failed, str(rep)
    assert all(p.severity == "warning" for p in rep.problems)
    assert str(rep).splitlines()[0].endswith(f"OK ({len(rep.warnings)} warnings)")
    assert "warning: multimem-relaxed: rank" in str(rep)
    f = _write(tmp_path, switch_allreduce("relaxed"))
    assert cli_inproc(capsys, "verify", str(f), "--schedules", "2").returncode == 0
    res = cli_inproc(capsys, "verify", str(f), "--schedules", "2", "--strict")
    assert res.returncode == 1 and "multimem-relaxed" in res.stdout and "--strict" in res.stderr


def test_missing_synchronisation_after_multimem_stores_stays_a_race() -> None:
    rep = verify(switch_allreduce("none"), schedules=3)
    assert rep.failed and "race" in rep.kinds(), str(rep)
    assert verify(switch_allreduce("strong"), schedules=3).kinds() == set()


# ---------------------------------------------------------------- send/recv senders
def split_mask_sendrecv(n: int, split_mask: int):
    """MSCCL++'s multi-node send/recv shape: ranks form groups of ``split_mask + 1``; rank
    ``r`` sends its input to the rank at the same position of the next group, over port
    channels (ready signal to the previous rank, wait for the next rank's, put with signal and
    flush, wait for the previous rank's data)."""
    group = split_mask + 1
    groups = n // group
    with CollectiveProgram(f"sendrecv_mask{split_mask}", SendRecv(n, 1, False), n) as prog:
        nxt_ch, prv_ch, peers = {}, {}, {}
        for r in range(n):
            pos, g = r & split_mask, r // group
            nxt = ((g + 1) % groups) * group + pos
            prv = ((g - 1) % groups) * group + pos
            if prv == nxt and r > prv:  # the same peer both ways: create in crossed order
                prv_ch[r] = PortChannel(prv, r)
                nxt_ch[r] = PortChannel(nxt, r)
            else:
                nxt_ch[r] = PortChannel(nxt, r)
                prv_ch[r] = PortChannel(prv, r)
            peers[r] = nxt
        for r in range(n):
            prv_ch[r].signal(tb=0, data_sync=SyncType.none)
            nxt_ch[r].wait(tb=0, data_sync=SyncType.after)
            nxt_ch[r].put_with_signal_and_flush(Rank(peers[r]).get_output_buffer()[:],
                                                Rank(r).get_input_buffer()[:], tb=0)
            prv_ch[r].wait(tb=0, data_sync=SyncType.after)
    return prog.to_plan()


@pytest.mark.parametrize("n,mask", [(4, 0), (4, 1), (8, 3)])
def test_sendrecv_senders_come_from_the_plan(n: int, mask: int) -> None:
    rep = verify(split_mask_sendrecv(n, mask), schedules=3)
    assert rep.ok, str(rep)
    if mask:  # not the r-1 ring: the note says who sends to whom
        group = mask + 1
        want = ", ".join(f"{r}<-{(r - group) % n}" for r in range(n))
        assert f"send/recv senders taken from the plan: {want}" in rep.notes


def test_sendrecv_explicit_senders() -> None:
    plan = split_mask_sendrecv(4, 1)
    assert verify(plan, schedules=2, senders=[2, 3, 0, 1]).ok
    rep = verify(plan, schedules=2, senders=[3, 0, 1, 2])
    assert rep.failed and "postcondition" in rep.kinds()
    assert "should be a copy of rank 3 input chunk 0" in rep.first("postcondition").message
    with pytest.raises(PlanError, match="both receive from rank 0"):
        verify(plan, schedules=1, senders=[0, 0, 1, 2])


def test_sendrecv_that_is_not_a_permutation_fails() -> None:
    b = PlanBuilder("fanout", "sendrecv", 3, 1, 1)
    for r, dsts in ((0, [1, 2]), (1, [0]), (2, [])):
        for p in dsts:
            b.op(r, 0, "put", src=[L("i", 0, 1)], dst=[R(p, "o", 0, 1)])
    rep = verify(b.build(), schedules=1, symbolic=False)
    assert any("ranks 1 and 2 both receive rank 0's input" in p.message for p in rep.errors), str(rep)


def test_sendrecv_cli_senders(tmp_path, capsys) -> None:
    f = _write(tmp_path, split_mask_sendrecv(4, 1))
    assert cli_inproc(capsys, "verify", str(f), "--schedules", "2").returncode == 0
    assert cli_inproc(capsys, "verify", str(f), "--schedules", "2", "--senders", "3,0,1,2").returncode == 1
    res = cli_inproc(capsys, "verify", str(f), "--senders", "a,b")
    assert res.returncode == 1 and "--senders" in res.stderr and "Traceback" not in res.stderr


# ---------------------------------------------------------------- MSCCL++ plans
def test_verify_imports_an_mscclpp_plan_with_a_note(tmp_path, capsys) -> None:
    f = _write(tmp_path, to_mscclpp(simple_allgather()), "mscclpp.json")
    res = cli_inproc(capsys, "verify", str(f), "--schedules", "2")
    assert res.returncode == 0, res.stderr
    assert "is an MSCCL++ plan; verifying it as imported" in res.stderr
    assert ": OK" in res.stdout
    # an imported plan is diagnosed like any other (this sample races at an odd size)
    g = _write(tmp_path, mscclpp_packet_allreduce(), "sample.json")
    res = cli_inproc(capsys, "verify", str(g), "--schedules", "2")
    assert "is an MSCCL++ plan; verifying it as imported" in res.stderr
    assert "must be converted" not in res.stderr and "FAILED" in res.stderr


# ---------------------------------------------------------------- grouping and true counts
def test_one_bug_at_many_sizes_is_reported_once_with_its_count() -> None:
    rep = verify(simple_allgather(wrong_chunk=True), schedules=4)
    keys = [(p.kind, p.details.get("rank"), p.details.get("chunk")) for p in rep.problems
            if p.kind in ("postcondition", "symbolic")]
    assert len(keys) == len(set(keys)), keys
    post = [p for p in rep.problems if p.kind == "postcondition"]
    assert post and all(p.count >= 1 for p in post)
    p = max(post, key=lambda x: x.count)
    sizes = {c.split(",")[0] for c in p.cases}
    assert len(sizes) == len(rep.sizes) and p.count >= 4 * len(rep.sizes), (p.count, p.cases)
    assert f"seen {p.count} times in {p.ncases} cases" in str(p)
    races = [x for x in rep.problems if x.kind == "race"]
    pairs = [(str(x.details["first"]).split(" (launch")[0], str(x.details["second"]).split(" (launch")[0],
              x.details["storage"]) for x in races]
    assert len(pairs) == len(set(pairs)), pairs


def test_failed_count_is_a_count_not_a_cap() -> None:
    """8 ranks x 4 chunks each: every rank keeps its own chunk and never exchanges; all 28
    foreign output chunks of every rank stay unwritten: 224 postcondition and 224 symbolic
    problems, counted, with a bounded printout."""
    n, f = 8, 4
    b = PlanBuilder("lonely_allgather", "allgather", n, f, n * f)
    for r in range(n):
        b.op(r, 0, "copy", src=[L("i", 0, f)], dst=[L("o", r * f, f)])
    rep = verify(b.build(), schedules=2)
    want = n * (n - 1) * f
    assert len([p for p in rep.problems if p.kind == "postcondition"]) == want
    assert len([p for p in rep.problems if p.kind == "symbolic"]) == want
    text = str(rep)
    assert text.splitlines()[0] == f"verify lonely_allgather: FAILED ({2 * want} problems)"
    assert len(text.splitlines()) <= SHOW_PROBLEMS * 3 + 8
    assert f"... and {2 * want - SHOW_PROBLEMS} more: " in text
    assert f"note: output chunks never written ({want}): rank 0 chunks 4-31; rank 1 chunks 0-3, 8-31;" in text


# ---------------------------------------------------------------- never-written output
def test_postcondition_failure_names_the_chunks_never_written() -> None:
    b = PlanBuilder("forgot_local_copy", "allgather", 2, 1, 2)
    for r in range(2):
        p = 1 - r
        if r == 1:
            b.op(r, 0, "copy", src=[L("i", 0, 1)], dst=[L("o", r, 1)])
        b.nop(r, 0)
        b.op(r, 0, "rlxsignal", channels=[p])
        b.op(r, 0, "rlxwait", channels=[p])
        b.nop(r, 0)
        b.op(r, 0, "put", src=[L("i", 0, 1)], dst=[R(p, "o", r, 1)])
        b.nop(r, 0)
        b.op(r, 0, "signal", channels=[p])
        b.op(r, 0, "wait", channels=[p])
        b.nop(r, 0)
    rep = verify(b.build(), schedules=2)
    post = rep.first("postcondition")
    assert post is not None and post.details["unwritten"], str(rep)
    assert post.message.startswith("rank 0 output chunk 0 (launch 1) was never written")
    assert "it should be a copy of rank 0 input chunk 0" in post.message
    sym = rep.first("symbolic")
    assert sym is not None and "rank 0 output chunk 0 (launch 1) was never written" in sym.message
    assert "output chunks never written (1): rank 0 chunk 0" in rep.notes
    # a chunk written with the wrong data is not called unwritten
    wrong = verify(simple_allgather(wrong_chunk=True), schedules=2)
    assert all(not p.details.get("unwritten") or p.details["chunk"] == 0 for p in wrong.problems
               if p.kind == "postcondition")
    assert any("differs" in p.message for p in wrong.problems if p.kind == "postcondition")


def test_a_chunk_written_too_late_or_too_early_is_not_called_never_written() -> None:
    """Issue 34 item 14: without its final wait, the missing-wait allgather's puts write every
    foreign output chunk, after the launch's outputs were read (or before the launch began, so
    that its start overwrote them): no line and no note may say "never written", and the late
    ones take docs/verify.md's wording."""
    rep = verify(simple_allgather(final_wait=False))
    poisoned = [p for p in rep.problems if p.kind in ("postcondition", "symbolic") and "0xFF" in p.message]
    assert poisoned, str(rep)
    assert not any("never written" in n for n in rep.notes), rep.notes
    assert not any("never written" in p.message for p in rep.problems), str(rep)
    for p in poisoned:
        assert re.match(r"rank \d+ output chunk \d+ \(launch \d+\) was written by rank \d+ tb \d+ op 4 put"
                        r"( from rank \d+ input chunk 0)?, but not (before the launch's outputs were read|between "
                        r"the launch's start and the read of its outputs): it still holds the 0xFF bytes", p.message), p.message
    late = [p for p in poisoned if p.details.get("written_late")]
    assert late and all("but not before the launch's outputs were read" in p.message for p in late)
    assert any(n.startswith(f"output chunks written, but not before the launch's outputs were read ({len(late)}): ")
               for n in rep.notes), rep.notes
    assert "written by ..., but not before the launch's outputs were read" in " ".join(DOCS_VERIFY.read_text().split())
    # without its handshake, a zero-copy allreduce writes a peer's output before that peer's launch
    # begins (whose start then overwrites it): written, early, never "never written"
    early = verify(zero_copy_allreduce(handshake=False), schedules=4)
    assert early.notes == ["output chunks written, but not between the launch's start and the read of its outputs (2): "
                           "rank 0 chunk 1; rank 1 chunk 0"], early.notes
    for p in early.problems:
        if p.kind == "postcondition":
            assert re.match(r"rank (\d) output chunk (\d) \(launch 2\) was written by rank (?!\1)\d tb 0 op 0 rres, "
                            r"but not between the launch's start and the read of its outputs: ", p.message), p.message


# ---------------------------------------------------------------- cycles and source lines
def three_rank_deadlock():
    """Rank 0 waits for rank 2; ranks 1 and 2 each wait for the other before signalling. The
    cycle is found from rank 0, so it is entered at rank 2."""
    b = PlanBuilder("dl3", "test", 3, 1, 1)
    b.op(0, 0, "wait", channels=[2])
    b.op(1, 0, "wait", channels=[2])
    b.op(1, 0, "signal", channels=[2])
    b.op(2, 0, "wait", channels=[1])
    b.op(2, 0, "signal", channels=[1])
    b.op(2, 0, "signal", channels=[0])
    return b.build()


def test_cycle_starts_at_the_lowest_rank_without_source_lines() -> None:
    dl = verify(three_rank_deadlock(), schedules=2).first("deadlock")
    assert dl is not None
    lines = dl.message.splitlines()
    assert lines[0] == "all 3 live blocks wait; first rank 1 tb 0 op 0 wait"
    assert lines[1] == "wait-for cycle: (rank 1, tb 0, op 0) -> (rank 2, tb 0, op 0) -> (rank 1, tb 0, op 0)"
    assert lines[2].lstrip().startswith("rank 1 tb 0 op 0 wait") and lines[3].lstrip().startswith("rank 2 tb 0 op 0 wait")
    assert [e[0] for e in dl.details["cycle"]] == [1, 2]


def test_cycle_starts_at_the_op_written_first_and_ops_show_their_source_line() -> None:
    plan = three_rank_deadlock()
    _set_src(plan, 1, 0, 0, "prog.py:20")
    _set_src(plan, 2, 0, 0, "prog.py:12")
    dl = verify(plan, schedules=2).first("deadlock")
    assert dl is not None
    lines = dl.message.splitlines()
    assert lines[0] == "all 3 live blocks wait; first rank 2 tb 0 op 0 (prog.py:12) wait"
    assert lines[1] == ("wait-for cycle: (rank 2, tb 0, op 0, prog.py:12) -> (rank 1, tb 0, op 0, prog.py:20)"
                        " -> (rank 2, tb 0, op 0, prog.py:12)")
    assert lines[2].lstrip().startswith("rank 2 tb 0 op 0 (prog.py:12) wait (launch 1)")
    assert [e[0] for e in dl.details["cycle"]] == [2, 1]
    assert dl.details["src"][(2, 0, "0")] == "prog.py:12"


def test_two_rank_wait_cycle_rotates_to_the_first_written_op() -> None:
    plan = wait_cycle()
    _set_src(plan, 1, 0, 2, "prog.py:7")
    _set_src(plan, 0, 0, 2, "prog.py:9")
    dl = verify(plan, schedules=1).first("deadlock")
    assert dl is not None and dl.details["cycle"][0][0] == 1, dl.message


def test_race_messages_show_source_lines() -> None:
    plan = simple_allgather(final_wait=False)
    for r in range(3):
        for tb in (1, 2):
            _set_src(plan, r, tb, 4, f"ag.py:{30 + r}")
    rep = verify(plan, schedules=2)
    race = next(p for p in rep.problems if p.kind == "race" and "put" in p.message)
    assert "op 4 (ag.py:3" in race.message and ") put (launch" in race.message, race.message


def test_run_on_the_simulator_exits_0_for_a_plan_without_postcondition(tmp_path, capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    f = _write(tmp_path, _test_plan())
    res = cli_inproc(capsys, "run", str(f), "--size", "1K")
    assert res.returncode == 0 and "NO POSTCONDITION" in res.stdout, (res.stdout, res.stderr)
