"""Conversion to and from MSCCL++ 0.9 execution plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.plan_samples import allpairs_allreduce, clone, kitchen_sink, mscclpp_packet_allreduce
from mscclang.errors import PlanError
from mscclang.plan import from_mscclpp, plan_from_dict, plan_to_dict, to_mscclpp
from mscclang.plan.mscclpp import is_mscclpp_plan

TOP_KEYS = ["name", "collective", "protocol", "inplace", "reuse_resources", "gpus",
            "num_threads_per_block", "use_double_scratch_buffer", "buffer_alignment",
            "min_message_size", "max_message_size"]
GPU_KEYS = ["id", "input_chunks", "output_chunks", "scratch_chunks", "threadblocks", "channels",
            "remote_buffers", "semaphores"]
OP_KEYS = {"name", "src_buff", "dst_buff", "channel_ids", "channel_type", "tbg_info", "reduce_op",
           "barrier_id", "num_threadblocks", "semaphore_ids", "iter_context", "ops"}


def _walk_ops(d: dict):
    for g in d["gpus"]:
        for t in g["threadblocks"]:
            for o in t["ops"]:
                yield o
                yield from o.get("ops", [])


@pytest.mark.parametrize("doc", [kitchen_sink(), allpairs_allreduce(2), allpairs_allreduce(8)],
                         ids=["kitchen_sink", "allpairs2", "allpairs8"])
def test_round_trip_ours_mscclpp_ours(doc):
    plan = plan_from_dict(doc)
    exported = to_mscclpp(plan)
    text = json.dumps(exported)  # JSON-ready
    back = from_mscclpp(json.loads(text))
    assert plan_to_dict(back) == plan_to_dict(plan)
    assert is_mscclpp_plan(exported) and not is_mscclpp_plan(plan_to_dict(plan))


def test_exported_layout_follows_mscclpp_keys():
    d = to_mscclpp(plan_from_dict(kitchen_sink()))
    assert list(d) == TOP_KEYS
    assert d["max_message_size"] == 2**64 - 1 and d["buffer_alignment"] == 16
    g = d["gpus"][0]
    assert list(g) == GPU_KEYS
    assert list(g["threadblocks"][0]) == ["id", "ops", "channels", "remote_buffer_refs"]
    assert g["channels"][2] == {"channel_type": "switch", "buffer_type": "o",
                                "rank_groups": [{"size": 2, "ranks": [0, 1]}]}
    assert g["channels"][0] == {"channel_type": "memory", "connected_to": [1, 1]}
    assert g["remote_buffers"][0] == {"rank": 1, "type": "o", "access_channel_types": ["memory", "port"]}
    assert g["semaphores"] == [{"init_value": 0}, {"init_value": 1}]
    assert g["threadblocks"][0]["remote_buffer_refs"][1] == {"access_channel_type": "port",
                                                              "remote_buffer_ids": [0, 1]}
    for o in _walk_ops(d):
        assert set(o) <= OP_KEYS, o
    ops0 = g["threadblocks"][0]["ops"]
    assert ops0[0] == {"name": "nop"}  # no empty fields
    assert ops0[11] == {"name": "copy", "src_buff": [{"type": "i", "index": 0, "size": 1}],
                        "dst_buff": [{"type": "o", "index": 0, "size": 1}]}
    assert "channel_ids" not in ops0[3] and ops0[3]["channel_type"] == "memory"  # memory put
    assert ops0[4]["channel_ids"] == [0]  # port put names its channel
    assert ops0[27] == {"name": "barrier", "barrier_id": 0, "num_threadblocks": 2}  # no barrier_tbs
    pipe = g["threadblocks"][1]["ops"][4]
    assert pipe["iter_context"] == {"unit_size": 4096, "num_chunks": 2}
    assert [o["name"] for o in pipe["ops"]] == ["sem_acquire", "copy", "sem_release"]
    assert g["threadblocks"][2]["ops"][0]["tbg_info"] == {"tb_id": 0, "tbg_size": 2}
    assert g["threadblocks"][1]["ops"][1]["src_buff"] == [{"switch_channel_id": 0, "index": 0, "size": 2}]


def _normalise_legacy(d: dict) -> dict:
    """What to_mscclpp should give back for mscclpp_packet_allreduce(): current spellings."""
    d = clone(d)
    for g in d["gpus"]:
        for c in g["channels"]:
            if "buff" in c:
                c["buffer_type"] = c.pop("buff")
        for t in g["threadblocks"]:
            for o in t["ops"]:
                if "tbg" in o:
                    o["tbg_info"] = o.pop("tbg")
                for ref in o.get("src_buff", []) + o.get("dst_buff", []):
                    ref.pop("rank", None)
    return d


def _canonical(d: dict) -> str:
    return json.dumps(d, sort_keys=True)


def test_round_trip_mscclpp_ours_mscclpp_with_legacy_spellings():
    src = mscclpp_packet_allreduce()
    plan = from_mscclpp(src)
    assert plan.gpus[0].channels[1].buffer_type.value == "i"
    assert plan.gpus[0].threadblocks[1].ops[0].tbg_info.tb_id == 1
    assert plan.gpus[0].input_chunks == 4 and plan.gpus[0].output_chunks == 0  # in place
    out = to_mscclpp(plan)
    assert _canonical(out) == _canonical(_normalise_legacy(src))
    # and the modern spelling is a fixed point
    assert _canonical(to_mscclpp(from_mscclpp(out))) == _canonical(out)


def test_import_fills_barrier_members():
    d = to_mscclpp(plan_from_dict(kitchen_sink()))
    plan = from_mscclpp(d)
    b = plan.gpus[1].threadblocks[1].ops[0]
    assert b.name.value == "barrier" and b.barrier_tbs == [0, 1]


def test_import_infers_chunk_factor_and_reduce_op():
    doc = allpairs_allreduce(4)
    del doc["chunk_factor"], doc["reduce_op"]
    plan = from_mscclpp(to_mscclpp(plan_from_dict(doc)))
    assert plan.chunk_factor == 1 and plan.reduce_op.value == "sum"
    # reductions that name no reduce op leave the plan's unset (a launch then sums)
    for g in doc["gpus"]:
        for o in g["threadblocks"][0]["ops"]:
            o.pop("reduce_op", None)
    plan = from_mscclpp(to_mscclpp(plan_from_dict(doc)))
    assert plan.reduce_op is None and plan.chunk_factor == 1
    # allgather: the chunk factor is the input chunk count
    d = to_mscclpp(plan_from_dict(doc))
    d["collective"] = "allgather"
    for g in d["gpus"]:
        g["input_chunks"] = 1
    assert from_mscclpp(d, check=False).chunk_factor == 1


def test_plan_wide_reduce_op_moves_into_reductions():
    doc = allpairs_allreduce(2)
    doc["reduce_op"] = "max"
    for g in doc["gpus"]:
        for o in g["threadblocks"][0]["ops"]:
            o.pop("reduce_op", None)
    d = to_mscclpp(plan_from_dict(doc))
    reds = [o for o in _walk_ops(d) if o["name"] == "re"]
    assert reds and all(o["reduce_op"] == "max" for o in reds)
    assert all("reduce_op" not in o for o in _walk_ops(d) if o["name"] != "re")
    # an op that disagrees with the plan-wide op cannot be expressed
    doc["gpus"][1]["threadblocks"][0]["ops"][9]["reduce_op"] = "min"
    with pytest.raises(PlanError) as ei:
        to_mscclpp(plan_from_dict(doc))
    assert ei.value.path == "gpus[1].threadblocks[0].ops[9].reduce_op"


@pytest.mark.parametrize("mutate,path,msg", [
    (lambda d: d.update(collective="broadcast", root=0), "root", "root"),
    (lambda d: d.update(collective="broadcast"), "collective", "broadcast"),
    (lambda d: d.update(collective="myreduce"), "collective", "myreduce"),
    (lambda d: d.update(packet_type="LL8"), "packet_type", "LL8"),
    (lambda d: d.update(chunk_factor=2), "chunk_factor", "chunk_factor"),
], ids=["root", "broadcast", "unknown-collective", "LL8", "chunk-factor"])
def test_export_refuses_what_mscclpp_lacks(mutate, path, msg):
    doc = allpairs_allreduce(2)
    mutate(doc)
    plan = plan_from_dict(doc)
    with pytest.raises(PlanError) as ei:
        to_mscclpp(plan)
    assert ei.value.path == path
    assert msg in ei.value.message


def test_export_accepts_ll16_and_consistent_chunk_factor():
    doc = allpairs_allreduce(2)
    doc.update(packet_type="LL16", chunk_factor=1)
    d = to_mscclpp(plan_from_dict(doc))
    assert "packet_type" not in d and "chunk_factor" not in d


def test_export_refuses_lone_glre():
    with pytest.raises(PlanError) as ei:
        to_mscclpp(plan_from_dict(kitchen_sink(with_glre=True)))
    assert ei.value.path == "gpus[0].threadblocks[1].ops[5].name"
    assert "glres" in ei.value.message


@pytest.mark.parametrize("mutate,path,msg", [
    (lambda d: d.update(extra=1), "extra", "unknown key"),
    (lambda d: d["gpus"][1].update(nranks=2), "gpus[1].nranks", "unknown key"),
    (lambda d: d["gpus"][0]["threadblocks"][1]["ops"][2].update(foo=1),
     "gpus[0].threadblocks[1].ops[2].foo", "unknown key"),
    (lambda d: d["gpus"][0]["threadblocks"][0]["ops"][0]["src_buff"][0].update(offset=3),
     "gpus[0].threadblocks[0].ops[0].src_buff[0].offset", "unknown key"),
    (lambda d: d["gpus"][0]["threadblocks"][0]["ops"][1].update(name="frobnicate"),
     "gpus[0].threadblocks[0].ops[1].name", "Input should be"),
    (lambda d: d["gpus"][0]["threadblocks"][0]["ops"][1]["src_buff"][0].update(index=-1),
     "gpus[0].threadblocks[0].ops[1].src_buff[0].index", "greater than or equal"),
    (lambda d: d.pop("name"), "name", "needs 'name'"),
    (lambda d: d.update(format="mscclang.plan/1"), "format", "already an mscclang plan"),
    (lambda d: d["gpus"][0].update(inputChunks=4), None, "pre-0.9"),
    # semantic checks run on import: chunk 9 of a 4-chunk input
    (lambda d: d["gpus"][0]["threadblocks"][0]["ops"][2]["dst_buff"][0].update(index=9),
     "gpus[0].threadblocks[0].ops[2].dst_buff[0].index", "outside"),
    (lambda d: d["gpus"][0]["channels"][1].update(buffer_type="s"), "gpus[0].channels[1].buff", "both"),
], ids=["top", "gpu", "op", "ref", "op-name", "negative-index", "missing-name", "ours", "old-format",
        "check", "buff-and-buffer_type"])
def test_import_errors_name_the_path(mutate, path, msg):
    d = mscclpp_packet_allreduce()
    mutate(d)
    with pytest.raises(PlanError) as ei:
        from_mscclpp(d)
    assert ei.value.path == path
    assert msg in ei.value.message


def test_import_without_check_keeps_inconsistent_plan():
    d = mscclpp_packet_allreduce()
    d["gpus"][0]["threadblocks"][0]["ops"][2]["dst_buff"][0]["index"] = 9
    plan = from_mscclpp(d, check=False)
    assert plan.gpus[0].threadblocks[0].ops[2].dst_buff[0].index == 9


PROGRAMS = sorted((Path(__file__).resolve().parent / "programs").glob("*.py")) + [
    Path(__file__).resolve().parent.parent / "examples" / "allreduce_8rank.py"]


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.stem for p in PROGRAMS])
def test_dsl_plans_round_trip_exactly(program):
    """Plans built by the DSL carry what import infers, so they survive MSCCL++ and back."""
    from mscclang.cli.compile_cmd import compile_file

    for argv in (["--num_gpus", "4"], ["--num_gpus", "2", "--instances", "2"]):
        plan = compile_file(program, argv)
        back = from_mscclpp(json.loads(json.dumps(to_mscclpp(plan))))
        # everything but the ops' source lines (our debug info; MSCCL++ plans have none)
        for g in plan.gpus:
            for tb in g.threadblocks:
                for op in tb.ops:
                    assert op.src is not None
                    op.src = None
                    for inner in op.ops or []:
                        inner.src = None
        assert plan_to_dict(back) == plan_to_dict(plan)


# ----------------------------------------------------------------- the local source's place

def _positioned(place: int) -> dict:
    """allpairs_allreduce(4) with rank 1's reductions of tb 0 adding its own chunk at ``place``."""
    doc = allpairs_allreduce(4)
    reds = [o for o in doc["gpus"][1]["threadblocks"][0]["ops"] if o["name"] == "re"]
    assert reds and all(len(o["src_buff"]) == 4 for o in reds)
    for o in reds:
        o["src0_position"] = place
    return doc


def test_local_source_at_place_1_exports_local_first():
    """x1 + x0 == x0 + x1 bit for bit: MSCCL++'s local-first order is the same sum."""
    doc = _positioned(1)
    plan = plan_from_dict(doc)
    d = to_mscclpp(plan)
    ops = d["gpus"][1]["threadblocks"][0]["ops"]
    want = [o for o in doc["gpus"][1]["threadblocks"][0]["ops"] if o["name"] == "re"]
    got = [o for o in ops if o["name"] == "re"]
    assert [o["src_buff"] for o in got] == [o["src_buff"] for o in want]  # the local source stays first
    assert all("src0_position" not in o for o in _walk_ops(d))
    back = from_mscclpp(json.loads(json.dumps(d)))
    for o, p in zip(back.gpus[1].threadblocks[0].ops, plan.gpus[1].threadblocks[0].ops):
        if p.src0_position == 1:
            assert o.src0_position is None and o.reduction_order()[2:] == p.reduction_order()[2:]
            assert sorted(o.reduction_order()[:2]) == sorted(p.reduction_order()[:2])


@pytest.mark.parametrize("place", [2, 3])
def test_local_source_at_place_2_or_later_is_refused_naming_op_and_place(place):
    with pytest.raises(PlanError) as ei:
        to_mscclpp(plan_from_dict(_positioned(place)))
    first = next(i for i, o in enumerate(allpairs_allreduce(4)["gpus"][1]["threadblocks"][0]["ops"])
                 if o["name"] == "re")
    assert ei.value.path == f"gpus[1].threadblocks[0].ops[{first}].src0_position"
    msg = ei.value.message
    assert f"re adds its local source at place {place}" in msg and "commute" in msg, msg
    assert "\n" not in str(ei.value)


def test_library_two_rank_plans_with_a_moved_local_source_export(shipped_plans):
    """Every 2-rank shipped plan that reduces through a positioned source exports (the
    library's rank-order plans put rank 1's own chunk at place 1)."""
    from mscclang.plan import load_plan

    moved = 0
    for f in shipped_plans:
        plan = load_plan(f)
        if len(plan.gpus) != 2 or plan.format != "mscclang.plan/1":
            continue
        if any(o.src0_position for g in plan.gpus for tb in g.threadblocks for op in tb.ops
               for o in [op, *(op.ops or [])]):
            moved += 1
            to_mscclpp(plan)
    assert moved > 0
