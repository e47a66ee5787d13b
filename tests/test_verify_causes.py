"""Diagnoses lead with their cause: root causes ranked before the races they imply, every problem
on ``--all``, the relaxed signal/wait that alone publishes data named, wrong output chunks
attributed to the op (and DSL line) that wrote them, and ``verify prog.py`` told to compile."""

from __future__ import annotations

import re

from mscclang.plan import plan_to_dict
from mscclang.plan.models import Plan
from mscclang.sim import verify
from mscclang.sim.planbuilder import L, PlanBuilder
from mscclang.sim.report import KINDS

import json

from tests.harness.cli import EXAMPLE, cli, cli_inproc, user_error
from tests.harness.sim_plans import simple_allgather, zero_copy_allreduce


def _problem_lines(text: str) -> list[str]:
    kinds = "|".join(re.escape(k) for k in KINDS)
    return [ln.strip() for ln in text.splitlines() if re.match(rf"\s+(warning: )?({kinds}): ", ln)]


def _tag_sources(plan: Plan) -> Plan:
    """Give every op the DSL line ``prog.py:<100 * rank + 10 * tb + index>``."""
    for r, g in enumerate(plan.gpus):
        for tb in g.threadblocks:
            for i, op in enumerate(tb.ops):
                op.src = f"prog.py:{100 * r + 10 * tb.id + i + 1}"
    return plan


def test_unbalanced_channels_are_ranked_before_the_races_they_imply() -> None:
    rep = verify(simple_allgather(final_wait=False), schedules=3)
    kinds = [p.kind for p in rep.problems]
    assert "unbalanced-channel" in kinds and "race" in kinds
    assert kinds.index("race") > max(i for i, k in enumerate(kinds) if k == "unbalanced-channel")
    shown = _problem_lines(str(rep))
    assert shown[0].startswith("unbalanced-channel: "), shown
    assert "--all" in str(rep)  # the "... and N more" line says how to see them


def test_deadlock_is_ranked_before_races() -> None:
    order = list(KINDS)
    for cause in ("plan", "deadlock", "unbalanced-channel", "unbalanced-semaphore", "unsynced-signal"):
        assert order.index(cause) < order.index("race") < order.index("postcondition")


def test_all_prints_every_problem(tmp_path) -> None:
    path = tmp_path / "missing_wait.json"
    path.write_text(json.dumps(plan_to_dict(simple_allgather(final_wait=False))))
    rep = verify(simple_allgather(final_wait=False))
    assert len(rep.problems) > 8
    res = cli("verify", str(path), "--all")
    assert res.returncode == 1, res.stderr
    assert "... and" not in res.stdout
    assert len(_problem_lines(res.stdout)) == len(rep.problems)
    short = cli("verify", str(path))
    assert len(_problem_lines(short.stdout)) == 8 and "... and" in short.stdout


def test_relaxed_publish_names_the_relaxed_signal_and_wait() -> None:
    rep = verify(_tag_sources(simple_allgather(relaxed_publish=True)), schedules=3)
    races = [p.message for p in rep.problems if p.kind == "race"]
    assert races
    for m in races:
        assert re.search(r"rank \d+ tb \d+ op \d+ \(prog\.py:\d+\) rlxsignal", m), m
        assert re.search(r"rank \d+ tb \d+ op \d+ \(prog\.py:\d+\) rlxwait", m), m
    # rank 1's put (tb 1 op 4) is published by its rlxsignal (op 6) and rank 0's rlxwait
    m = next(m for m in races if m.startswith("rank 1 tb 1 op 4"))
    assert "rank 1 tb 1 op 6 (prog.py:117) rlxsignal" in m, m
    assert "rank 0 tb 1 op 7 (prog.py:18) rlxwait" in m, m


def test_wrong_chunk_in_a_reduce_names_the_op_and_its_source_line() -> None:
    plan = zero_copy_allreduce()
    rres = plan.gpus[0].threadblocks[0].ops[4]
    assert rres.name.value == "rres"
    rres.src_buff[1].index = 1  # reduces the peer's chunk 1 instead of chunk 0
    rep = verify(_tag_sources(plan), schedules=3)
    bad = [p for p in rep.problems if p.kind in ("postcondition", "symbolic")
           and p.details.get("rank") == 0 and p.details.get("chunk") == 0]
    assert bad, str(rep)
    for p in bad:
        assert "rank 0 tb 0 op 4 (prog.py:5) rres" in p.message, p.message
        assert "rank 1 input chunk 1" in p.message, p.message


def _unwritten_source_allgather() -> Plan:
    """2-rank allgather: rank r copies its input into output chunk r, and a never-written
    scratch chunk into output chunk 1 - r; rank 1 writes nothing into output chunk 0."""
    b = PlanBuilder("unwritten_source", "allgather", 2, 1, 2, 1)
    for r in range(2):
        b.op(r, 0, "copy", src=[L("i", 0, 1)], dst=[L("o", r, 1)])
        b.nop(r, 0)
        if r == 0:
            b.op(r, 0, "copy", src=[L("s", 0, 1)], dst=[L("o", 1, 1)])
            b.nop(r, 0)
    return b.build()


def test_written_from_never_written_source_is_not_never_written() -> None:
    rep = verify(_unwritten_source_allgather(), schedules=2)
    by = {(p.kind, p.details["rank"], p.details["chunk"]): p for p in rep.problems if "chunk" in p.details}
    for kind in ("postcondition", "symbolic"):
        written = by[(kind, 0, 1)].message
        assert "was never written" not in written, written
        assert "was written only from sources never written" in written, written
        assert "rank 0 tb 0 op 2 copy" in written and "rank 0 scratch chunk 0" in written, written
        assert "which no op wrote" in written, written
        assert "was never written" in by[(kind, 1, 0)].message
    note = next(n for n in rep.notes if n.startswith("output chunks never written"))
    assert "rank 1 chunk 0" in note and "rank 0" not in note, note
    assert any("written only from sources never written" in n and "rank 0 chunk 1" in n for n in rep.notes)


def test_verify_of_a_dsl_program_says_to_compile_it(capsys) -> None:
    res = cli_inproc(capsys, "verify", str(EXAMPLE))
    user_error(res, "DSL program", f"mscclang compile {EXAMPLE} -o plan.json")
    assert "not valid JSON" not in res.stderr
