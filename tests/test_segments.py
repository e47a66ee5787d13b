"""Data-dependent counts (plan/3 segmented buffers): the DSL, the compiler's and the plan's rules,
the count checks, the simulator's counted run and postcondition, the verifier over count matrices
with its capacity proof and budget, and the CLI views. The library's all-to-all-v plans are
verified in tests/test_algorithms.py with every other shipped plan."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from mscclang import AllToAllV, AllGatherV, Buffer, CollectiveProgram, CountsError, DSLError, PlanError, Rank
from mscclang.algorithms.alltoallv import (build_alltoallv_ll, build_alltoallv_port, build_alltoallv_simple,
                                          build_alltoallv_zero_copy)
from mscclang.algorithms.common import input_of, mesh_program, output_of, peers, port_mesh, ready_handshake
from mscclang.errors import LimitError, VerificationError
from mscclang.plan.io import load_plan, plan_from_dict, plan_to_dict
from mscclang.plan.segments import CountedCall, check_counts, count_cases, counted_call, prove_capacity, segment_span
from mscclang.plan.models import BufferKind
from mscclang.sim.budget import Limits
from mscclang.sim.counted import POISON, check_counted, run_counted
from mscclang.sim.verify import verify

BUILDERS = (build_alltoallv_ll, build_alltoallv_simple, build_alltoallv_zero_copy, build_alltoallv_port)


def _reference(counts: list[list[int]], inputs: list[np.ndarray], row: int) -> list[np.ndarray]:
    """all-to-all-v in plain numpy: rank r's output is, for p in order, the rows p sent r."""
    n = len(counts)
    out = []
    for r in range(n):
        parts = []
        for p in range(n):
            start = sum(counts[p][:r])
            parts.append(inputs[p].reshape(-1, row)[start: start + counts[p][r]].reshape(-1))
        out.append(np.concatenate(parts))
    return out


# -- the DSL and the compiler -----------------------------------------------------------------

def test_alltoallv_buffers_are_segments_and_the_plan_says_plan3() -> None:
    plan = build_alltoallv_ll(4)
    assert plan.format == "mscclang.plan/3" and plan.has_segments()
    g = plan.gpus[1]
    assert g.segmented(BufferKind.input).entries() == [(1, p) for p in range(4)]
    assert g.segmented(BufferKind.output).entries() == [(p, 1) for p in range(4)]
    assert g.segmented(BufferKind.scratch).entries() == [(p, 1) for p in range(4)]
    assert (g.input_chunks, g.output_chunks, g.scratch_chunks) == (4, 4, 4)
    again = plan_from_dict(json.loads(json.dumps(plan_to_dict(plan))))
    assert again == plan


def _put_to_each_peer(ch, r: int, n: int, src) -> None:
    """Block j of rank r: ready handshake with its peer p, put ``src(p)`` into p's output segment
    r, then a data handshake."""
    for j, p in enumerate(peers(r, n)):
        ch[(r, p)].signal(tb=j, relaxed=True)
        ch[(r, p)].wait(tb=j, relaxed=True)
        ch[(r, p)].put(output_of(p)[r], src(p), tb=j)
        ch[(r, p)].signal(tb=j)
        ch[(r, p)].wait(tb=j)


def test_allgatherv_segments() -> None:
    n = 3
    with mesh_program("agv", AllGatherV, n, 1, False, "Simple", 256, None, 0, 2**64 - 1) as (prog, ch):
        for r in range(n):
            _put_to_each_peer(ch, r, n, lambda p: input_of(r)[0])
            Rank(r).copy(output_of(r)[r], input_of(r)[0], tb=0)
    plan = prog.to_plan()
    assert plan.gpus[2].segmented(BufferKind.input).entries() == [(2, 2)]
    rep = verify(plan, schedules=2)
    assert rep.ok, rep
    counts = [[2, 0, 0], [0, 0, 0], [0, 0, 5]]
    ins = [np.arange(counts[r][r] * 8, dtype=np.uint8) + 40 * r for r in range(n)]
    outs = run_counted(plan, ins, counts, 8)
    for o in outs:
        assert np.array_equal(o, np.concatenate(ins))


def test_scratch_segments_checks() -> None:
    with CollectiveProgram("s", AllToAllV(2), 2):
        with pytest.raises(DSLError, match=r"segments\[1\] = \(0, 2\) is not an entry"):
            Buffer(0, segments=[(0, 1), (0, 2)])
        with pytest.raises(DSLError, match="size 3 but 2 segments"):
            Buffer(0, 3, segments=[(0, 1), (1, 0)])
        Buffer(0, segments=[(0, 1)])
        with pytest.raises(DSLError, match="all chunks or all segments"):
            Buffer(0, 2)
        Buffer(1, 2)
        with pytest.raises(DSLError, match="all chunks or all segments"):
            Buffer(1, segments=[(1, 0)])


def test_an_op_moves_one_count_in_every_operand() -> None:
    with CollectiveProgram("bad", AllToAllV(2), 2) as prog:
        Rank(0).copy(Rank(0).get_output_buffer()[1], Rank(0).get_input_buffer()[1], tb=0)
    with pytest.raises(DSLError, match=r"rank 0, tb 0, op 0 .*output\[1:2\] holds the counts \[\[1, 0\]\] but input\[1:2\] holds \[\[0, 1\]\]"):
        prog.to_plan()


def test_an_op_moves_segments_or_chunks_not_both() -> None:
    with CollectiveProgram("mix", AllToAllV(2), 2) as prog:
        s = Buffer(0, 1)
        Rank(0).copy(s[0], Rank(0).get_input_buffer()[0], tb=0)
    with pytest.raises(DSLError, match="a segment of rank 0 but .* is a chunk range"):
        prog.to_plan()


def test_segments_take_no_instances() -> None:
    with CollectiveProgram("inst", AllToAllV(2), 2, instances=2) as prog:
        Rank(0).copy(Rank(0).get_output_buffer()[0], Rank(0).get_input_buffer()[0], tb=0)
    with pytest.raises(DSLError, match="runs one instance"):
        prog.to_plan()


def test_counted_collectives_take_one_segment_per_entry() -> None:
    with pytest.raises(DSLError, match="chunk_factor=1, inplace=False"):
        AllToAllV(2, 2)
    with pytest.raises(DSLError, match="chunk_factor=1, inplace=False"):
        AllToAllV(2, 1, True)


# -- the plan's rules -------------------------------------------------------------------------

def _doc(plan) -> dict:
    return json.loads(json.dumps(plan_to_dict(plan)))


def test_plan_format_rules() -> None:
    d = _doc(build_alltoallv_simple(2))
    d["format"] = "mscclang.plan/1"
    with pytest.raises(PlanError, match=r"gpus\[0\]\.segments: rank 0 has segmented buffers: a plan with them must say "
                                        r"format 'mscclang.plan/3'"):
        plan_from_dict(d)
    with pytest.raises(PlanError):
        load_plan(json.dumps(d))


def test_plan_check_refuses_mismatched_entries_with_the_json_path() -> None:
    d = _doc(build_alltoallv_simple(2))
    d["gpus"][0]["segments"][1]["counts"][0] = [1, 1]      # output segment 0 is no longer (0, 0)
    with pytest.raises(PlanError, match=r"gpus\[0\]\.segments: alltoallv cuts rank 0's output"):
        load_plan(json.dumps(d))
    d = _doc(build_alltoallv_simple(2))
    d["gpus"][0]["segments"][1]["counts"].append([0, 0])
    with pytest.raises(PlanError, match=r"3 segments, but the rank's output_chunks is 2"):
        plan_from_dict(d)
    d = _doc(build_alltoallv_simple(2))
    d["gpus"][1]["segments"][0]["counts"][0] = [1, 2]
    with pytest.raises(PlanError, match=r"entry \[1, 2\] is outside the 2 x 2 count matrix"):
        plan_from_dict(d)


def test_plan_check_refuses_an_op_over_different_counts() -> None:
    d = _doc(build_alltoallv_simple(2))
    ops = d["gpus"][0]["threadblocks"][0]["ops"]
    copy = next(i for i, op in enumerate(ops) if op["name"] == "copy" and op["src_buff"][0]["type"] == "i")
    ops[copy]["dst_buff"][0]["index"] = 1 - ops[copy]["dst_buff"][0]["index"]
    with pytest.raises(PlanError, match=rf"gpus\[0\]\.threadblocks\[0\]\.ops\[{copy}\]\.dst_buff\[0\]: the operands' "
                                        "segments hold different counts"):
        load_plan(json.dumps(d))


# -- counts -----------------------------------------------------------------------------------

def test_counts_are_checked_naming_rank_buffer_and_entry() -> None:
    plan = build_alltoallv_ll(3)
    with pytest.raises(CountsError, match=r"rank 0: count \[0\]\[2\] is -1"):
        counted_call(plan, [[0, 0, -1], [0, 0, 0], [0, 0, 0]], 8)
    with pytest.raises(CountsError, match=r"rank 1: its input segments hold 5 rows .* more than its input's 4 rows"):
        counted_call(plan, [[0, 0, 0], [1, 2, 2], [0, 0, 0]], 8, in_rows=[0, 4, 0])
    with pytest.raises(CountsError, match=r"rank 2: its output segments hold 3 rows .* more than its output's 2 rows"):
        counted_call(plan, [[0, 0, 1], [0, 0, 1], [0, 0, 1]], 8, out_rows=[0, 0, 2])
    with pytest.raises(CountsError, match=r"count \[1\]\[0\] = 4 rows passes the capacity of 3 rows"):
        counted_call(plan, [[0, 0, 0], [4, 0, 0], [0, 0, 0]], 8, capacity=3)
    with pytest.raises(CountsError, match="must be 3 x 3"):
        counted_call(plan, [[0, 0], [0, 0]], 8)
    with pytest.raises(CountsError, match="in_rows has 2 entries"):
        counted_call(plan, [[0] * 3] * 3, 8, in_rows=[1, 1])


def test_segment_spans_are_packed_and_slotted() -> None:
    plan = build_alltoallv_ll(3)
    call = CountedCall(((1, 2, 3), (4, 5, 6), (7, 8, 9)), 16, (6, 15, 24), (12, 15, 18), 9)
    check_counts(plan, call)
    assert segment_span(plan, call, 1, BufferKind.input, 2).start == 4 + 5
    assert segment_span(plan, call, 1, BufferKind.output, 2).start == 2 + 5
    assert segment_span(plan, call, 1, BufferKind.scratch, 2).start == 2 * 9
    assert segment_span(plan, call, 1, BufferKind.scratch, 2).rows == 8


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_run_counted_matches_a_numpy_reference(builder, n: int) -> None:
    plan = builder(n)
    rng = np.random.default_rng(n)
    for case in count_cases(n, seed=n)[1:]:
        counts = [list(r) for r in case.counts]
        row = 24
        ins = [rng.integers(0, 256, size=sum(counts[r]) * row, dtype=np.uint8) for r in range(n)]
        for pt in ("LL16", "LL8"):
            outs = run_counted(plan, ins, counts, row, packet_type=pt, launches=2, schedule="random", seed=3)
            for got, want in zip(outs, _reference(counts, ins, row)):
                assert np.array_equal(got, want), (case.name, pt)


def test_a_port_put_moves_scratch_segments_only() -> None:
    """A port put's copy has its length fixed on the host, so it cannot move a packed segment
    (whose place and length are counts): the DSL refuses it naming the op, and so does the plan
    check of a JSON plan, naming the operand's JSON path."""
    n = 2
    with mesh_program("port_direct", AllToAllV, n, 1, False, "Simple", 256, None, 0, 2**64 - 1) as (prog, ch):
        port = port_mesh([(0, 1), (1, 0)])
        for r in range(n):
            ready_handshake(ch, r, [1 - r], [1 - r], tb=0)
            port[(r, 1 - r)].put_with_signal(output_of(1 - r)[r], input_of(r)[1 - r], tb=0)
            port[(r, 1 - r)].wait(tb=0)
            port[(r, 1 - r)].flush(tb=0)
            Rank(r).copy(output_of(r)[r], input_of(r)[r], tb=1)
    with pytest.raises(DSLError, match=r"rank 0, tb 0, op \d .*put_with_signal.*: a port put copies each segment as its "
                                        r"whole scratch slot .* rank 0's input\[1:2\] lies where the counts put it"):
        prog.to_plan()
    d = _doc(build_alltoallv_port(2))
    ops = d["gpus"][0]["threadblocks"][0]["ops"]
    i = next(i for i, op in enumerate(ops) if op["name"] == "pws")
    ops[i]["src_buff"][0] = {"type": "i", "index": 1, "size": 1}   # the same entry (0, 1), but packed
    with pytest.raises(PlanError, match=rf"gpus\[0\]\.threadblocks\[0\]\.ops\[{i}\]\.src_buff\[0\]: a port put copies "
                                        r"each segment as its whole scratch slot .* rank 0's input segments lie where "
                                        r"the counts put them"):
        load_plan(json.dumps(d))


def test_a_port_put_copies_the_whole_slot_in_the_simulator_and_the_proxy_script() -> None:
    """The simulator and the runtime's proxy script agree that a port put over a segment copies
    its slot's capacity rows, whatever the count (the copy engine cannot read it), at the slots'
    places: send slot p of the sender, receive slot n + r of the receiver."""
    from mscclang.plan.layout import Piece
    from mscclang.runtime.counted import CountedLaunch, pack_counted
    from mscclang.sim.program import sim_program

    n, row, cap = 2, 24, 5
    plan = build_alltoallv_port(n)
    call = counted_call(plan, [[2, 1], [0, 3]], row, capacity=cap)
    prog = sim_program(plan, 3 * row, 0, counted=call)
    port_groups = [g for g in prog.groups() if g.channel is not None]
    assert len(port_groups) == n and all(g.pieces == [Piece((1 * cap * row, (n + 0) * cap * row) if g.srcs[0].rank == 0
                                                            else (0, (n + 1) * cap * row), cap * row)]
                                          for g in port_groups), [(g.srcs, g.pieces) for g in port_groups]
    for r in range(n):
        script = pack_counted(plan, r, CountedLaunch(0, row, cap, 3, 3)).port
        copies = [c for ch in script.channels for t in ch.triggers for c in t.copies]
        assert [(c.src, c.src_off, c.dst_off, c.length) for c in copies] == [
            (BufferKind.scratch, (1 - r) * cap * row, (n + r) * cap * row, cap * row)]


def test_run_counted_refuses_rows_that_split_a_packet() -> None:
    with pytest.raises(VerificationError, match="a row must be a positive multiple of 8 bytes .it moves LL packets"):
        run_counted(build_alltoallv_ll(2), [np.zeros(12, np.uint8)] * 2, [[1, 0], [0, 1]], 12)


# -- the verifier -----------------------------------------------------------------------------

def test_a_zero_count_orders_nothing_and_verify_finds_the_race() -> None:
    """Without the ready handshake, an LL all-to-all-v whose receiver gets no rows from a peer
    lets that peer run two launches ahead and overwrite packets not yet read."""
    n = 4
    with mesh_program("no_handshake", AllToAllV, n, 1, False, "LL", 256, None, 0, 2**64 - 1,
                      double_scratch=True) as (prog, ch):
        scratch = [Buffer(r, segments=[(s, r) for s in range(n)]) for r in range(n)]
        for r in range(n):
            inp, out = input_of(r), output_of(r)
            for j, p in enumerate(peers(r, n)):
                ch[(r, p)].put_packets(scratch[p][r], inp[p], tb=j)
            Rank(r).copy(out[r], inp[r], tb=0)
            for j, p in enumerate(peers(r, n)):
                Rank(r).unpack_packets(out[p], scratch[r][p], tb=j)
    rep = verify(prog.to_plan(), schedules=4)
    assert not rep.ok and any(p.kind == "race" for p in rep.problems), rep
    assert any("one receiver takes everything" in c for p in rep.problems for c in p.cases)


def test_verify_finds_a_missing_segment() -> None:
    n = 3
    with mesh_program("no_own_rows", AllToAllV, n, 1, False, "Simple", 256, None, 0, 2**64 - 1) as (prog, ch):
        for r in range(n):
            _put_to_each_peer(ch, r, n, lambda p: input_of(r)[p])
    rep = verify(prog.to_plan(), schedules=1)
    assert not rep.ok
    assert any(p.kind == "postcondition" and "output segment" in p.message for p in rep.problems)


def test_the_postcondition_catches_a_write_past_the_received_rows() -> None:
    plan = build_alltoallv_simple(2)
    call = counted_call(plan, [[1, 1], [1, 0]], 8, out_rows=[4, 4])
    ins = [np.arange(16, dtype=np.uint8), np.arange(8, dtype=np.uint8) + 100]
    good = [np.full(32, POISON, np.uint8) for _ in range(2)]
    good[0][:16] = np.concatenate([ins[0][:8], ins[1][:8]])
    good[1][:8] = ins[0][8:]
    assert check_counted(plan, call, ins, good, 1) == []
    bad = [g.copy() for g in good]
    bad[1][20] = 7
    probs = check_counted(plan, call, ins, bad, 1)
    assert len(probs) == 1 and "rank 1 output byte 20 lies past the 1 rows received" in probs[0].message


def test_capacity_proof_counts_every_segment_reference() -> None:
    proof = prove_capacity(build_alltoallv_zero_copy(4))
    assert proof.problems == [] and proof.checked == 4 * 3 * 2 + 4 * 2
    plan = build_alltoallv_simple(2)
    bad = plan.model_copy(deep=True)
    op = next(op for op in bad.gpus[0].threadblocks[0].ops if op.name.value == "copy")
    op.dst_buff[0].index = 5   # past the rank's 2 segments (the plan check would refuse it)
    assert any("segments past the 2" in p for p in prove_capacity(bad).problems)


def test_verify_budget_covers_counted_plans() -> None:
    with pytest.raises(LimitError, match="would take about .* of memory, over the 10 MiB limit"):
        verify(build_alltoallv_ll(8), limits=Limits(10 << 20, 600))


def test_verify_refuses_message_sizes_for_a_counted_plan() -> None:
    with pytest.raises(VerificationError, match="its count matrices, not given message sizes"):
        verify(build_alltoallv_ll(2), sizes=[64])


# -- the CLI ----------------------------------------------------------------------------------

def test_cli_verify_and_show(tmp_path) -> None:
    path = tmp_path / "a2av.json"
    path.write_text(json.dumps(plan_to_dict(build_alltoallv_ll(2))))
    r = subprocess.run([sys.executable, "-m", "mscclang", "verify", str(path), "--schedules", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "count matrices in rows of 8, 24 bytes" in r.stdout and "capacity proof" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mscclang", "show", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "output segments (rows of counts[i][j]): 0=c[0][0] 1=c[1][0]" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mscclang", "export-mscclpp", str(path), "-o", str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "takes mscclang.plan/1 plans, not mscclang.plan/3" in r.stderr
    assert "Traceback" not in r.stderr
    path.write_text(json.dumps(plan_to_dict(build_alltoallv_port(2))))
    r = subprocess.run([sys.executable, "-m", "mscclang", "show", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "pws         s[1:2] -> s[2:3]@r1  [ch0->r1; whole slots]" in r.stdout, r.stdout


def test_cli_run_verifies_a_counted_plan_on_the_simulator(tmp_path) -> None:
    path = tmp_path / "a2av.json"
    path.write_text(json.dumps(plan_to_dict(build_alltoallv_simple(2))))
    r = subprocess.run([sys.executable, "-m", "mscclang", "run", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "verify alltoallv_simple.r2.i1: OK" in r.stdout, r.stderr
    assert "verifying it on the simulator over its count matrices" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mscclang", "run", str(path), "--sizes", "1K"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "--sizes: plan 'alltoallv_simple.r2.i1' moves segments" in r.stderr
    assert "Traceback" not in r.stderr
