"""Every op of a compiled plan records the DSL source line that made it (the plan op's optional
``src``, ``"program.py:42"``), through every compiler pass, deterministically; MSCCL++ export
drops it, diagnoses and ``mscclang show`` print it."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from mscclang import (
    AllReduce,
    Buffer,
    CollectiveProgram,
    LoopIterationContext,
    MemoryChannel,
    Rank,
    SyncType,
)
from mscclang.cli.compile_cmd import compile_file
from mscclang.cli.show_cmd import format_plan
from mscclang.plan import from_mscclpp, load_plan, plan_to_dict, to_mscclpp
from mscclang.plan.io import plan_to_json
from mscclang.plan.models import OpName

HERE = Path(__file__).name
SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> str:
    """``test_source_lines.py:N`` of the line of this file ending with ``# <marker>``."""
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, (marker, hits)
    return f"{HERE}:{hits[0]}"


def two_rank_program() -> CollectiveProgram:
    with CollectiveProgram("src", AllReduce(2, 2, False), 2) as prog:
        scratch = [Buffer(r, 2) for r in range(2)]
        for r in range(2):
            q = 1 - r
            ch = MemoryChannel(q, r)
            rank = Rank(r)
            ch.signal(tb=0, data_sync=SyncType.none, relaxed=True)  # L-ready-signal
            ch.wait(tb=0, data_sync=SyncType.none, relaxed=True)  # L-ready-wait
            ch.put(scratch[q][0:1], rank.get_input_buffer()[0:1], tb=0)  # L-put-a
            ch.put(scratch[q][1:2], rank.get_input_buffer()[1:2], tb=0)  # L-put-b
            ch.signal(tb=0, data_sync=SyncType.before)  # L-signal
            ch.wait(tb=0, data_sync=SyncType.after)  # L-wait
            rank.reduce(rank.get_input_buffer()[0:2], [scratch[r][0:2]], tb=0,
                        dst_chunk=rank.get_output_buffer()[0:2])  # (continuation line)
    return prog


def test_every_op_names_the_dsl_call_that_made_it():
    plan = two_rank_program().to_plan()
    for g in plan.gpus:
        ops = g.threadblocks[0].ops
        got = [(o.name, o.src) for o in ops]
        red = line_of("(continuation line)")
        red = f"{HERE}:{int(red.split(':')[1]) - 1}"  # a call over two lines: its first line
        assert got == [
            (OpName.rlxsignal, line_of("L-ready-signal")),
            (OpName.rlxwait, line_of("L-ready-wait")),
            # two puts fused into one multi put: the first constituent's line
            (OpName.put, line_of("L-put-a")),
            # the data-sync nop inserted before the signal: the signal's line
            (OpName.nop, line_of("L-signal")),
            (OpName.signal, line_of("L-signal")),
            (OpName.wait, line_of("L-wait")),
            (OpName.nop, line_of("L-wait")),
            (OpName.re, red),
        ], got


def test_pipelines_hazard_nops_and_replicas_keep_lines():
    with CollectiveProgram("pipe", AllReduce(2, 1, False), 2, instances=2) as prog:
        for r in range(2):
            s = Buffer(r, 1)
            with LoopIterationContext(1024, 1):  # L-loop
                Rank(r).copy(s[0:1], Rank(r).get_input_buffer()[0:1], tb=0)  # L-copy
                Rank(r).copy(Rank(r).get_output_buffer()[0:1], s[0:1], tb=0)  # L-copy-back
    plan = prog.to_plan()
    for g in plan.gpus:
        assert len(g.threadblocks) == 2  # two instances, both keep the lines
        for tb in g.threadblocks:
            (pipe,) = tb.ops
            assert pipe.name == OpName.pipeline and pipe.src == line_of("L-loop")
            assert [(o.name, o.src) for o in pipe.ops] == [
                (OpName.copy, line_of("L-copy")),
                (OpName.nop, line_of("L-copy-back")),  # hazard nop: the op it protects
                (OpName.copy, line_of("L-copy-back")),
            ]


def test_src_is_deterministic_and_independent_of_the_directory(tmp_path):
    prog_text = textwrap.dedent('''
        from mscclang import *

        with CollectiveProgram("d", AllReduce(2, 1, False), 2):
            a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
            a.signal(tb=0)
            b.wait(tb=0)
            print(JSON())
    ''')
    first = tmp_path / "one" / "prog.py"
    second = tmp_path / "two" / "deeper" / "prog.py"
    for p in (first, second):
        p.parent.mkdir(parents=True)
        p.write_text(prog_text)
    a, b = compile_file(first), compile_file(second)
    assert plan_to_json(a) == plan_to_json(b)
    assert a.gpus[0].threadblocks[0].ops[1].src == "prog.py:6"
    assert a.gpus[1].threadblocks[0].ops[0].src == "prog.py:7"
    assert two_rank_program().to_json() == two_rank_program().to_json()


def test_helper_modules_are_skipped(tmp_path, monkeypatch):
    """A module marked ``__mscclang_helper__ = True`` is skipped: ops name its caller's line."""
    (tmp_path / "my_helpers.py").write_text(textwrap.dedent('''
        __mscclang_helper__ = True

        def handshake(ch, tb):
            ch.signal(tb=tb)

        def wait(ch, tb):
            ch.wait(tb=tb)
    '''))
    (tmp_path / "plain_helpers.py").write_text(textwrap.dedent('''
        def handshake(ch, tb):
            ch.signal(tb=tb)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_helpers
    import plain_helpers

    with CollectiveProgram("h", AllReduce(2, 1, False), 2) as prog:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        my_helpers.handshake(a, 0)  # L-helper
        plain_helpers.handshake(b, 0)
        my_helpers.wait(b, 1)  # L-helper-wait
        my_helpers.wait(a, 1)
    plan = prog.to_plan()
    assert plan.gpus[0].threadblocks[0].ops[1].src == line_of("L-helper")
    assert plan.gpus[1].threadblocks[0].ops[1].src == "plain_helpers.py:3"
    assert plan.gpus[1].threadblocks[1].ops[0].src == line_of("L-helper-wait")
    for mod in ("my_helpers", "plain_helpers"):
        sys.modules.pop(mod, None)


def test_library_plans_point_at_the_algorithm_files():
    from mscclang.algorithms import build

    plan = build("allreduce_rsag_simple", 2)
    srcs = {o.src for g in plan.gpus for tb in g.threadblocks for o in tb.ops}
    assert None not in srcs
    assert {s.split(":")[0] for s in srcs} == {"allreduce.py"}  # not common.py, the shared helpers
    shipped = json.loads((Path(__file__).parents[1] / "plans" / "allreduce_rsag_simple.r2.i16.json").read_text())
    assert all("src" in op and op["src"].startswith("allreduce.py:")
               for g in shipped["gpus"] for tb in g["threadblocks"] for op in tb["ops"])


def test_mscclpp_export_drops_src_and_import_has_none():
    plan = two_rank_program().to_plan()
    doc = to_mscclpp(plan)
    assert '"src":' not in json.dumps(doc)
    back = from_mscclpp(doc)
    assert all(o.src is None for g in back.gpus for tb in g.threadblocks for o in tb.ops)
    # a plan without src loads, and its JSON has no src key
    assert '"src":' not in plan_to_json(back)


def test_plan_json_carries_src_and_loads_it_back():
    text = two_rank_program().to_json()
    assert f'"src": "{line_of("L-put-a")}"' in text
    plan = load_plan(text)
    assert plan.gpus[0].threadblocks[0].ops[0].src == line_of("L-ready-signal")
    assert plan_to_json(plan) == text
    d = plan_to_dict(plan)
    d["gpus"][0]["threadblocks"][0]["ops"][0]["src"] = 42
    with pytest.raises(Exception, match=r"gpus\[0\]\.threadblocks\[0\]\.ops\[0\]\.src"):
        load_plan(d)


def test_schema_has_optional_src():
    from mscclang.plan.schema import plan_schema

    op = plan_schema()["$defs"]["Op"]
    assert "src" in op["properties"] and "src" not in op.get("required", [])


def test_show_prints_the_source_line():
    text = format_plan(two_rank_program().to_plan(), rank=0)
    line = next(x for x in text.splitlines() if " put " in x)
    assert line.endswith(f"  # {line_of('L-put-a')}")
    pipe = two_rank_program().to_plan()
    for g in pipe.gpus:
        for tb in g.threadblocks:
            for o in tb.ops:
                o.src = None
    assert "  # " not in format_plan(pipe)


def test_compile_errors_name_the_source_line():
    from mscclang import CompileError

    with CollectiveProgram("dl", AllReduce(2, 1, False), 2) as p:
        a, b = MemoryChannel(1, 0), MemoryChannel(0, 1)
        a.wait(0)  # L-deadlock-wait
        a.signal(0)
        b.wait(0)
        b.signal(0)
    with pytest.raises(CompileError) as e:
        p.to_plan()
    assert f"rank 0 tb 0 op 1 (wait, {line_of('L-deadlock-wait')})" in str(e.value)  # op 0: its sync nop


def test_examples_compile_with_their_own_file_name(tmp_path):
    root = Path(__file__).parents[1]
    copy = tmp_path / "renamed_example.py"
    shutil.copy(root / "examples" / "oneshot_allreduce.py", copy)
    plan = compile_file(copy)
    srcs = {o.src.split(":")[0] for g in plan.gpus for tb in g.threadblocks for o in tb.ops}
    assert srcs == {"renamed_example.py"}
