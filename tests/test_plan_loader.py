"""The loader is as strict as docs/plan.schema.json and turns every bad file into a PlanError
(with the JSON path where there is one); the CLI turns those into exit status 1, never a
traceback. Each case here was a traceback or a silently accepted value before (issue 11)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from mscclang.cli.main import main
from mscclang.errors import LimitError, PlanError
from mscclang.plan import load_plan
from mscclang.plan.io import parse_plan_json, plan_from_dict, read_plan_document

ROOT = Path(__file__).resolve().parents[1]
LL_PLAN = ROOT / "plans" / "allreduce_oneshot_ll.r2.i1.json"
COPY_PLAN = ROOT / "tests" / "golden" / "op_copy.json"
PIPE_PLAN = ROOT / "tests" / "golden" / "op_pipeline.json"


def _doc(path: Path = COPY_PLAN) -> dict:
    return json.loads(path.read_text())


def _error(source) -> PlanError:
    with pytest.raises(PlanError) as ei:
        load_plan(source)
    return ei.value


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


# ------------------------------------------------------------------ types as strict as the schema
@pytest.mark.parametrize("value", ["16", True, 16.0, None, [16]])
def test_buffer_alignment_must_be_a_json_integer(value):
    d = _doc()
    d["buffer_alignment"] = value
    assert _error(d).path == "buffer_alignment"


@pytest.mark.parametrize("value", ["1", True, 1.0])
def test_chunk_fields_must_be_json_integers(value):
    d = _doc()
    d["gpus"][1]["threadblocks"][0]["ops"][0]["src_buff"][0]["index"] = value
    assert _error(d).path == "gpus[1].threadblocks[0].ops[0].src_buff[0].index"
    d = _doc()
    d["gpus"][0]["input_chunks"] = value
    assert _error(d).path == "gpus[0].input_chunks"


@pytest.mark.parametrize("field,value", [("inplace", "true"), ("inplace", 1),
                                         ("use_double_scratch_buffer", 0), ("name", 5)])
def test_booleans_and_strings_are_strict(field, value):
    d = _doc()
    d[field] = value
    assert _error(d).path == field


@pytest.mark.parametrize("field,value", [
    ("max_message_size", 2**200), ("max_message_size", 2**64), ("min_message_size", -1),
    ("buffer_alignment", 2**63), ("buffer_alignment", 2**21), ("buffer_alignment", 3),
    ("buffer_alignment", 0), ("num_threads_per_block", 2**40), ("chunk_factor", 2**200),
])
def test_sizes_are_bounded(field, value):
    d = _doc()
    d[field] = value
    assert _error(d).path == field


def test_chunk_counts_and_indexes_are_bounded():
    d = _doc()
    d["gpus"][0]["scratch_chunks"] = 2**200
    assert _error(d).path == "gpus[0].scratch_chunks"
    d = _doc()
    d["gpus"][1]["threadblocks"][0]["ops"][0]["dst_buff"][0]["size"] = 2**31
    assert _error(d).path == "gpus[1].threadblocks[0].ops[0].dst_buff[0].size"


def test_extreme_message_sizes_within_range_load():
    d = _doc()
    d["min_message_size"] = d["max_message_size"] = 2**64 - 1
    assert load_plan(d).min_message_size == 2**64 - 1


def test_lone_surrogate_in_a_name_is_refused(capsys, tmp_path):
    d = _doc()
    d["name"] = "bad\ud800name"
    assert _error(d).path == "name"
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))  # ensure_ascii: the file holds the escape \ud800
    for cmd in ("show", "verify"):
        rc, err = _cli([cmd, str(f)], capsys)
        assert rc == 1 and "name" in err


# ------------------------------------------------------------------ packets and alignment
@pytest.mark.parametrize("alignment", [1, 2, 4])
def test_packet_plan_needs_alignment_8(alignment, capsys, tmp_path):
    d = _doc(LL_PLAN)
    d["buffer_alignment"] = alignment
    e = _error(d)
    assert e.path == "buffer_alignment" and "at least 8" in str(e)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    rc, err = _cli(["verify", str(f), "--schedules", "1"], capsys)
    assert rc == 1 and "buffer_alignment" in err


def test_packet_plan_with_alignment_8_loads():
    d = _doc(LL_PLAN)
    d["buffer_alignment"] = 8
    assert load_plan(d).buffer_alignment == 8


def test_packet_pipeline_unit_size_divisible_by_8():
    d = _doc(PIPE_PLAN)
    pipes = [(r, t, i, op) for r, g in enumerate(d["gpus"]) for t, tb in enumerate(g["threadblocks"])
             for i, op in enumerate(tb["ops"]) if op["name"] == "pipeline"]
    r, t, i, op = pipes[0]
    # turn the pipeline's copy into a packet copy into scratch
    inner = op["ops"][0]
    inner.update(name="cpkt", channel_type="none", channel_ids=[])
    d["gpus"][r]["scratch_chunks"] = max(d["gpus"][r]["scratch_chunks"], 64)
    inner["dst_buff"] = [{"type": "s", "index": 0, "size": inner["src_buff"][0]["size"]}]
    op["iter_context"]["unit_size"] = 4100
    e = _error(d)
    assert e.path == f"gpus[{r}].threadblocks[{t}].ops[{i}].iter_context.unit_size"
    op["iter_context"]["unit_size"] = 4096
    load_plan(d)


# ------------------------------------------------------------------ files that are not JSON plans
def test_not_utf8_file(tmp_path, capsys):
    f = tmp_path / "p.json"
    f.write_bytes(b'{"format": "mscclang.plan/1", "name": "\xff\xfe"}')
    e = _error(f)
    assert "not UTF-8" in str(e) and "offset 39" in str(e)
    for cmd in ("show", "verify"):
        rc, err = _cli([cmd, str(f)], capsys)
        assert rc == 1 and "not UTF-8" in err


def test_byte_order_mark_is_accepted(tmp_path):
    f = tmp_path / "p.json"
    f.write_bytes(b"\xef\xbb\xbf" + COPY_PLAN.read_bytes())
    assert load_plan(f).name == "op_copy"


@pytest.mark.parametrize("text,words", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"format": "mscclang.plan/1", "name": ' + "9" * 5000 + "}", "digits"),
    ('{"format": "mscclang.plan/1", "buffer_alignment": NaN}', "NaN"),
    ('{"format": "mscclang.plan/1", "buffer_alignment": -Infinity}', "Infinity"),
    ('{"format": ', "not valid JSON"),
], ids=["deep", "digits", "nan", "infinity", "truncated"])
def test_json_that_python_cannot_take(text, words, tmp_path, capsys):
    with pytest.raises(PlanError, match=words):
        parse_plan_json(text)
    f = tmp_path / "p.json"
    f.write_text(text)
    for cmd in ("show", "verify"):
        rc, err = _cli([cmd, str(f)], capsys)
        assert rc == 1 and words in err


@pytest.mark.parametrize("text,what", [("null", "null"), ("[1, 2]", "an array"), ("5", "a number"),
                                       ('"plan"', "a string")])
def test_top_level_must_be_an_object(text, what, tmp_path, capsys):
    with pytest.raises(PlanError, match=f"a plan must be a JSON object, not {what}$"):
        plan_from_dict(json.loads(text))
    f = tmp_path / "p.json"
    f.write_text(text)
    for cmd in ("show", "verify"):
        rc, err = _cli([cmd, str(f)], capsys)
        assert rc == 1 and f"not {what}" in err


def test_nested_pipelines_are_refused_before_validation():
    d = _doc()
    op = d["gpus"][1]["threadblocks"][0]["ops"][0]
    nest = {"name": "pipeline", "iter_context": {"unit_size": 16, "num_chunks": 1}, "ops": [op]}
    for _ in range(3000):  # deeper than any recursion limit
        nest = {"name": "pipeline", "iter_context": {"unit_size": 16, "num_chunks": 1}, "ops": [nest]}
    d["gpus"][1]["threadblocks"][0]["ops"] = [nest]
    e = _error(d)
    assert "cannot be nested" in str(e) and e.path == "gpus[1].threadblocks[0].ops[0].ops[0].ops"


def test_path_with_a_nul_byte():
    assert "cannot read plan file" in str(_error("bad\0name.json"))


# ------------------------------------------------------------------ size limits before parsing
def test_file_size_limit(tmp_path, monkeypatch, capsys):
    f = tmp_path / "p.json"
    f.write_text(COPY_PLAN.read_text())
    monkeypatch.setenv("MSCCLANG_MAX_PLAN_BYTES", "1K")
    e = _error(f)
    assert "MSCCLANG_MAX_PLAN_BYTES" in str(e) and "1 KiB" in str(e)
    rc, err = _cli(["show", str(f)], capsys)
    assert rc == 1 and "MSCCLANG_MAX_PLAN_BYTES" in err
    with pytest.raises(PlanError, match="MSCCLANG_MAX_PLAN_BYTES"):
        load_plan(COPY_PLAN.read_text())  # JSON text is bounded too
    monkeypatch.setenv("MSCCLANG_MAX_PLAN_BYTES", "1M")
    assert load_plan(f).name == "op_copy"


def test_op_count_limit(monkeypatch):
    d = _doc()
    tb = d["gpus"][1]["threadblocks"][0]
    tb["ops"] = tb["ops"] * 50
    monkeypatch.setenv("MSCCLANG_MAX_PLAN_OPS", "20")
    e = _error(copy.deepcopy(d))
    assert "more than 20 ops" in str(e) and "MSCCLANG_MAX_PLAN_OPS" in str(e)
    assert e.path == "gpus[1].threadblocks[0].ops"
    monkeypatch.setenv("MSCCLANG_MAX_PLAN_OPS", "100")
    load_plan(d)


def test_malformed_limit_variable(monkeypatch):
    monkeypatch.setenv("MSCCLANG_MAX_PLAN_OPS", "lots")
    with pytest.raises(LimitError, match="MSCCLANG_MAX_PLAN_OPS"):
        load_plan(_doc())


def test_standard_input_is_bounded(monkeypatch):
    import io
    import sys

    class _Stdin:
        buffer = io.BytesIO(b"x" * 5000)

    monkeypatch.setattr(sys, "stdin", _Stdin())
    monkeypatch.setenv("MSCCLANG_MAX_PLAN_BYTES", "4K")
    with pytest.raises(PlanError, match="standard input is more than"):
        read_plan_document("-")


def test_default_op_limit_refuses_a_700k_op_plan_before_validating():
    import time

    d = _doc()
    tb = d["gpus"][1]["threadblocks"][0]
    tb["ops"] = tb["ops"] * 700_000  # one dict shared 700k times: cheap to build, slow to validate
    t = time.perf_counter()
    e = _error(d)
    assert "more than 100,000 ops" in str(e) and "MSCCLANG_MAX_PLAN_OPS" in str(e)
    assert time.perf_counter() - t < 2


def test_default_file_limit_is_checked_before_reading(tmp_path):
    f = tmp_path / "big.json"
    with open(f, "wb") as fh:
        fh.truncate(40 << 20)  # a sparse 40 MiB file: only its size is looked at
    e = _error(f)
    assert "40 MiB" in str(e) and "32 MiB limit" in str(e)


@pytest.mark.parametrize("data,words", [(b"\xff{}", "not UTF-8"), (b"null", "expected a JSON object"),
                                        (b"[" * 100_000, "nested too deeply"), (b"{", "not valid JSON")])
def test_import_mscclpp_reads_through_the_loader(data, words, tmp_path, capsys):
    f = tmp_path / "p.json"
    f.write_bytes(data)
    rc, err = _cli(["import-mscclpp", str(f)], capsys)
    assert rc == 1 and words in err


def test_json_text_with_a_byte_order_mark_or_lines_is_not_a_path():
    text = "\ufeff" + COPY_PLAN.read_text()
    assert load_plan(text).name == "op_copy"  # as read_text() returns a file with a BOM
    assert load_plan("\n" + COPY_PLAN.read_text()).name == "op_copy"
    e = _error("x" * 5000)  # not a path either: reported as JSON, not echoed as a file name
    assert "not valid JSON" in str(e) and len(str(e)) < 200
