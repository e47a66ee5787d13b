"""Semantic plan checks: every rule of mscclang.plan.check rejects a broken plan with the JSON
path of the offending field, and accepts the valid sample plans."""

from __future__ import annotations

import json
import re

import pytest

from tests.harness.plan_samples import L, R, W, allpairs_allreduce, kitchen_sink, op
from mscclang.errors import PlanError
from mscclang.plan import validate_plan, load_plan, plan_from_dict
from mscclang.plan.check import OP_RULES
from mscclang.plan.models import EPILOGUE_OPS, OpName


def tb(d: dict, r: int, t: int) -> dict:
    return d["gpus"][r]["threadblocks"][t]


def tb0op(d: dict, i: int, r: int = 0) -> dict:
    return tb(d, r, 0)["ops"][i]


def test_valid_samples_pass():
    for doc in (kitchen_sink(), kitchen_sink(with_glre=True), allpairs_allreduce(2),
                allpairs_allreduce(8)):
        validate_plan(plan_from_dict(doc))


def test_kitchen_sink_covers_every_op_kind():
    names = set()
    for g in kitchen_sink(with_glre=True)["gpus"]:
        for t in g["threadblocks"]:
            for o in t["ops"]:
                names.add(o["name"])
                names.update(i["name"] for i in o.get("ops", []))
    # the epilogue ops are plan/2 only: tests/test_plan_epilogue.py covers them
    assert names == {n.value for n in OpName} - {n.value for n in EPILOGUE_OPS}
    assert set(OP_RULES) == set(OpName)


def _set(path, value):
    """A mutation that sets a nested key given as a tuple path."""
    def mutate(d):
        x = d
        for k in path[:-1]:
            x = x[k]
        x[path[-1]] = value
    return mutate


G0 = ("gpus", 0)
TB0 = G0 + ("threadblocks", 0)
TB1 = G0 + ("threadblocks", 1)


def _append_op(t, new_op):
    def mutate(d):
        tb(d, 0, t)["ops"].append(new_op)
    return mutate


CASES = [
    # rank channels
    ("peer is self", _set(G0 + ("channels", 0, "connected_to"), [0, 1]), r"gpus\[0\]\.channels\[0\]\.connected_to\[0\]", "itself"),
    ("peer out of range", _set(G0 + ("channels", 1, "connected_to"), [5]), r"gpus\[0\]\.channels\[1\]\.connected_to\[0\]", "not a rank"),
    ("switch group without owner", _set(("gpus", 1, "channels", 2, "rank_groups"), [{"size": 1, "ranks": [0]}]),
     r"gpus\[1\]\.channels\[2\]\.rank_groups\[0\]\.ranks", "without being a member"),
    ("switch group size", _set(G0 + ("channels", 2, "rank_groups"), [{"size": 3, "ranks": [0, 1]}]),
     r"gpus\[0\]\.channels\[2\]\.rank_groups\[0\]\.size", "size"),
    ("memory channel with buffer_type", _set(G0 + ("channels", 0, "buffer_type"), "s"), r"gpus\[0\]\.channels\[0\]\.buffer_type", "no buffer_type"),
    # remote buffers
    ("remote buffer of self", _set(G0 + ("remote_buffers", 0, "rank"), 0), r"gpus\[0\]\.remote_buffers\[0\]\.rank", "itself"),
    ("remote buffer through switch", _set(G0 + ("remote_buffers", 2, "access_channel_types"), ["switch"]),
     r"remote_buffers\[2\]\.access_channel_types\[0\]", "memory or port"),
    # thread block lists
    ("tb channel beyond rank's", _set(TB0 + ("channels", 0, "channel_ids"), [0, 2]), r"threadblocks\[0\]\.channels\[0\]\.channel_ids\[1\]", "does not exist"),
    ("tb switch channel beyond rank's", _set(TB1 + ("channels", 0, "channel_ids"), [0, 2]), r"threadblocks\[1\]\.channels\[0\]\.channel_ids\[1\]", "does not exist"),
    ("two memory lists", _set(TB0 + ("channels",), [{"channel_type": "memory", "channel_ids": [0]},
                                                     {"channel_type": "memory", "channel_ids": [1]}]),
     r"threadblocks\[0\]\.channels\[1\]\.channel_type", "second"),
    ("tb remote ref beyond rank's", _set(TB0 + ("remote_buffer_refs", 0, "remote_buffer_ids"), [0, 1, 3]),
     r"remote_buffer_refs\[0\]\.remote_buffer_ids\[2\]", "does not exist"),
    ("tb port ref to memory-only buffer", _set(TB0 + ("remote_buffer_refs", 1, "remote_buffer_ids"), [0, 2]),
     r"remote_buffer_refs\[1\]\.remote_buffer_ids\[1\]", "not accessible through port"),
    # op channels
    ("op channel id beyond tb list", _set(TB0 + ("ops", 8, "channel_ids"), [0, 2]), r"threadblocks\[0\]\.ops\[8\]\.channel_ids\[1\]", "outside"),
    ("signal without channels", _set(TB0 + ("ops", 8, "channel_ids"), []), r"ops\[8\]\.channel_ids", "at least one channel"),
    ("signal lists channel twice", _set(TB0 + ("ops", 8, "channel_ids"), [1, 1]), r"ops\[8\]\.channel_ids", "twice"),
    ("relaxed over port", _set(TB0 + ("ops", 1, "channel_type"), "port"), r"ops\[1\]\.channel_type", "memory"),
    ("flush over memory", _set(TB0 + ("ops", 7, "channel_type"), "memory"), r"ops\[7\]\.channel_type", "port"),
    ("copy with a channel type", _set(TB0 + ("ops", 11, "channel_type"), "memory"), r"ops\[11\]\.channel_type", "none"),
    ("copy with channel ids", _set(TB0 + ("ops", 11, "channel_ids"), [0]), r"ops\[11\]\.channel_ids", "no channel_ids"),
    ("port put without channels", _set(TB0 + ("ops", 4, "channel_ids"), []), r"ops\[4\]\.channel_ids", "needs channel_ids"),
    ("pws over memory", _set(TB0 + ("ops", 5, "channel_type"), "memory"), r"ops\[5\]\.channel_type", "port"),
    ("get with one channel per two remotes", _set(TB0 + ("ops", 10, "channel_ids"), [0, 1]), r"ops\[10\]\.channel_ids", "one channel per remote"),
    # operand counts and kinds
    ("copy with two sources", _set(TB0 + ("ops", 11, "src_buff"), [L("i", 0), L("i", 1)]), r"ops\[11\]\.src_buff", "exactly 1"),
    ("copy into remote", _set(TB0 + ("ops", 11, "dst_buff"), [R(0, 0)]), r"ops\[11\]\.dst_buff\[0\]", "local buffer"),
    ("res with one destination", _set(TB0 + ("ops", 18, "dst_buff"), [L("o", 0)]), r"ops\[18\]\.dst_buff", "at least 2"),
    ("re with one source", _set(TB0 + ("ops", 17, "src_buff"), [L("i", 0)]), r"ops\[17\]\.src_buff", "at least 2"),
    ("rre with local second source", _set(TB0 + ("ops", 19, "src_buff"), [L("i", 0), L("o", 0)]), r"ops\[19\]\.src_buff\[1\]", "remote buffer"),
    ("put to local", _set(TB0 + ("ops", 3, "dst_buff"), [L("o", 0, 2)]), r"ops\[3\]\.dst_buff\[0\]", "remote buffer"),
    ("put pairs mismatch", _set(TB0 + ("ops", 3, "dst_buff"), [R(0, 0, 2), R(0, 2, 2)]), r"ops\[3\]\.dst_buff", "pairs"),
    ("glres with local src", _set(TB1 + ("ops", 1, "src_buff"), [L("o", 0, 2)]), r"threadblocks\[1\]\.ops\[1\]\.src_buff\[0\]", "switch reference"),
    # packets in scratch
    ("cpkt into output", _set(TB0 + ("ops", 12, "dst_buff"), [L("o", 0)]), r"ops\[12\]\.dst_buff\[0\]\.type", "scratch"),
    ("upkt from input", _set(TB0 + ("ops", 13, "src_buff"), [L("i", 0)]), r"ops\[13\]\.src_buff\[0\]\.type", "scratch"),
    ("repkt packet source in output", _set(TB0 + ("ops", 21, "src_buff"), [L("i", 0), L("o", 1)]), r"ops\[21\]\.src_buff\[1\]\.type", "scratch"),
    ("recpkt copy not scratch", _set(TB0 + ("ops", 23, "dst_buff"), [L("o", 0), L("o", 1)]), r"ops\[23\]\.dst_buff\[1\]\.type", "scratch"),
    ("ppkt into remote output", _set(TB0 + ("ops", 14, "dst_buff"), [R(0, 2)]), r"ops\[14\]\.dst_buff\[0\]\.buffer_id", "scratch"),
    ("respkt into remote output", _set(TB0 + ("ops", 22, "dst_buff"), [L("o", 0), R(0, 1)]), r"ops\[22\]\.dst_buff\[1\]\.buffer_id", "scratch"),
    ("gstorepkt to output switch", _set(TB1 + ("ops", 3, "dst_buff"), [W(0, 0)]), r"ops\[3\]\.dst_buff\[0\]\.switch_channel_id", "scratch"),
    # ranges
    ("local chunk out of range", _set(TB0 + ("ops", 11, "src_buff"), [L("i", 4)]), r"ops\[11\]\.src_buff\[0\]\.index", "outside rank 0's input"),
    ("scratch out of range", _set(TB0 + ("ops", 12, "dst_buff"), [L("s", 7, 2)]), r"ops\[12\]\.dst_buff\[0\]\.index", "scratch buffer of 8"),
    ("buffer id beyond tb refs", _set(TB0 + ("ops", 3, "dst_buff"), [R(3, 0, 2)]), r"ops\[3\]\.dst_buff\[0\]\.buffer_id", "outside"),
    ("switch id beyond tb list", _set(TB1 + ("ops", 2, "dst_buff"), [W(2, 2, 2)]), r"ops\[2\]\.dst_buff\[0\]\.switch_channel_id", "outside"),
    ("switch range beyond member buffer", _set(TB1 + ("ops", 2, "dst_buff"), [W(0, 3, 2)]), r"ops\[2\]\.dst_buff\[0\]\.index", "switch member"),
    # sizes
    ("reduce size mismatch", _set(TB0 + ("ops", 17, "src_buff"), [L("i", 0), L("s", 1, 2), L("o", 2)]), r"ops\[17\]\.src_buff\[1\]\.size", "same number of chunks"),
    ("copy size mismatch", _set(TB0 + ("ops", 11, "dst_buff"), [L("o", 0, 2)]), r"ops\[11\]\.dst_buff\[0\]\.size", "copies 1 chunk"),
    # semaphores, barriers, misplaced fields
    ("semaphore out of range", _set(TB0 + ("ops", 25, "semaphore_ids"), [2]), r"ops\[25\]\.semaphore_ids\[0\]", "semaphore 2"),
    ("semaphores on a copy", _set(TB0 + ("ops", 11, "semaphore_ids"), [0]), r"ops\[11\]\.semaphore_ids", "does not take"),
    ("reduce_op on a put", _set(TB0 + ("ops", 3, "reduce_op"), "sum"), r"ops\[3\]\.reduce_op", "not a reduction"),
    ("reductions disagree with the plan", _set(TB0 + ("ops", 19, "reduce_op"), "min"), r"threadblocks\[0\]\.ops\[19\]\.reduce_op", "one reduce op"),
    ("reductions disagree", lambda d: [d.pop("reduce_op"), tb(d, 1, 1)["ops"][1].update(reduce_op="sum")],
     r"gpus\[1\]\.threadblocks\[1\]\.ops\[1\]\.reduce_op", "gpus[0].threadblocks[0].ops[17].reduce_op says max"),
    ("barrier count disagrees with its tbs", _set(TB1 + ("ops", 0, "num_threadblocks"), 3), r"threadblocks\[1\]\.ops\[0\]\.barrier_tbs", "num_threadblocks is 3"),
    ("barrier count disagrees", lambda d: [tb(d, 0, 1)["ops"][0].pop("barrier_tbs"), tb(d, 0, 0)["ops"][27].pop("barrier_tbs"),
                                           tb(d, 0, 1)["ops"][0].update(num_threadblocks=3)],
     r"threadblocks\[1\]\.ops\[0\]\.num_threadblocks", "has num_threadblocks 3 here but 2"),
    ("res over port", _set(TB0 + ("ops", 18, "channel_type"), "port"), r"ops\[18\]\.channel_type", "memory"),
    ("barrier_tbs leave member out", _set(TB1 + ("ops", 0, "barrier_tbs"), [0, 2]), r"barrier_tbs", "barrier"),
    ("barrier_tbs length", _set(TB0 + ("ops", 27, "barrier_tbs"), [0]), r"ops\[27\]\.barrier_tbs", "num_threadblocks"),
    ("barrier_id on a nop", _set(TB0 + ("ops", 0, "barrier_id"), 0), r"ops\[0\]\.barrier_id", "does not take"),
    # thread-block groups
    ("tbg member missing", _set(G0 + ("threadblocks", 3, "ops", 0, "tbg_info"), {"tb_id": 0, "tbg_size": 2}),
     r"tbg_info", "position 1"),
    ("tbg size disagrees", _set(G0 + ("threadblocks", 3, "ops", 0, "tbg_info"), {"tb_id": 1, "tbg_size": 3}),
     r"tbg_info\.tbg_size", "disagree"),
    ("tbg on a signal", _set(TB0 + ("ops", 8, "tbg_info"), {"tb_id": 0, "tbg_size": 1}), r"ops\[8\]\.tbg_info", "thread-block group"),
    # pipelines: inner ops are checked with their own path
    ("inner op out of range", _set(TB1 + ("ops", 4, "ops", 1, "src_buff"), [L("i", 3, 2)]), r"threadblocks\[1\]\.ops\[4\]\.ops\[1\]\.src_buff\[0\]\.index", "outside"),
    ("inner semaphore out of range", _set(TB1 + ("ops", 4, "ops", 0, "semaphore_ids"), [9]), r"ops\[4\]\.ops\[0\]\.semaphore_ids\[0\]", "semaphore 9"),
    # collective
    ("input chunks vs collective", _set(("gpus", 1, "input_chunks"), 6), r"gpus\[1\]\.input_chunks", "needs 4"),
    ("output chunks vs collective", _set(("gpus", 1, "output_chunks"), 2), r"gpus\[1\]\.output_chunks", "needs 4"),
    ("root on allreduce", _set(("root",), 0), r"^root", "broadcast"),
]


@pytest.mark.parametrize("what,mutate,path_re,msg", CASES, ids=[c[0] for c in CASES])
def test_broken_plan_rejected_with_path(what, mutate, path_re, msg):
    doc = kitchen_sink()
    mutate(doc)
    plan = plan_from_dict(doc)
    with pytest.raises(PlanError) as ei:
        validate_plan(plan)
    err = ei.value
    assert err.path is not None
    assert re.search(path_re, err.path), f"{what}: path {err.path!r} (message {err.message!r})"
    assert msg in err.message, f"{what}: message {err.message!r}"


def test_port_channel_must_lead_to_the_buffer_owner():
    # three ranks: rank 0's port channel 0 goes to rank 1 while the put writes rank 2's output
    doc = allpairs_allreduce(3)
    g = doc["gpus"][0]
    g["channels"].append({"channel_type": "port", "connected_to": [1, 2]})
    g["remote_buffers"].append({"rank": 2, "type": "o", "access_channel_types": ["port"]})
    t = g["threadblocks"][0]
    t["channels"].append({"channel_type": "port", "channel_ids": [0, 1]})
    t["remote_buffer_refs"].append({"access_channel_type": "port", "remote_buffer_ids": [4]})
    t["ops"].append(op("put", [L("o", 0)], [R(0, 0)], "port", [1]))
    validate_plan(plan_from_dict(doc))  # channel 1 leads to rank 2: fine
    t["ops"][-1]["channel_ids"] = [0]
    with pytest.raises(PlanError) as ei:
        validate_plan(plan_from_dict(doc))
    assert ei.value.path == "gpus[0].threadblocks[0].ops[16].channel_ids[0]"
    assert "rank 1" in ei.value.message and "rank 2" in ei.value.message


def test_remote_range_checked_against_peer_counts():
    # a custom collective where rank 1 has fewer scratch chunks than rank 0 writes into
    doc = kitchen_sink()
    doc["gpus"][1]["scratch_chunks"] = 4  # rank 0's ppkt writes peer scratch chunk 4.. (rppkt)
    plan = plan_from_dict(doc)
    with pytest.raises(PlanError) as ei:
        validate_plan(plan)
    assert "rank 1 (remote)" in ei.value.message
    assert ei.value.path.startswith("gpus[0].threadblocks[0].ops[")
    assert ei.value.path.endswith(".index")


def test_barrier_needs_as_many_users_as_it_counts():
    doc = kitchen_sink()
    for t in (0, 1):
        for o in tb(doc, 0, t)["ops"]:
            if o["name"] == "barrier":
                o["num_threadblocks"] = 3
                o["barrier_tbs"] = [0, 1, 2]
    with pytest.raises(PlanError) as ei:
        validate_plan(plan_from_dict(doc))
    assert "expects 3 thread blocks" in ei.value.message
    assert ei.value.path.startswith("gpus[0].threadblocks[0].ops[27]")


def test_inplace_full_alias_may_omit_output_chunks():
    doc = allpairs_allreduce(2)
    doc["inplace"] = True
    for g in doc["gpus"]:
        g["output_chunks"] = 0
        for o in g["threadblocks"][0]["ops"]:
            for ref in o.get("src_buff", []) + o.get("dst_buff", []):
                if ref.get("type") == "o":
                    ref["type"] = "i"
        g["remote_buffers"] = [dict(b, type="i") if b["type"] == "o" else b for b in g["remote_buffers"]]
    validate_plan(plan_from_dict(doc))
    doc["inplace"] = False
    with pytest.raises(PlanError) as ei:
        validate_plan(plan_from_dict(doc))
    assert ei.value.path == "gpus[0].output_chunks"


def test_allgather_counts():
    doc = allpairs_allreduce(2)
    doc["collective"] = "allgather"
    with pytest.raises(PlanError) as ei:
        validate_plan(plan_from_dict(doc))
    assert ei.value.path == "gpus[0].input_chunks"  # chunk factor 1: one input chunk
    del doc["chunk_factor"]
    with pytest.raises(PlanError) as ei:
        validate_plan(plan_from_dict(doc))
    assert ei.value.path == "gpus[0].output_chunks"  # allgather of 2 chunks needs 4 outputs


def test_load_plan_checks_by_default(tmp_path):
    doc = kitchen_sink()
    tb0op(doc, 11)["src_buff"] = [L("i", 9)]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(PlanError) as ei:
        load_plan(f)
    assert ei.value.path == "gpus[0].threadblocks[0].ops[11].src_buff[0].index"
    assert str(ei.value).startswith("gpus[0].threadblocks[0].ops[11].src_buff[0].index: ")
    # the caller may skip the semantic checks (the models still validate)
    assert load_plan(f, check=False).name == "kitchen_sink"
    with pytest.raises(PlanError):
        load_plan(json.dumps(doc))
    with pytest.raises(PlanError):
        load_plan(doc)


def test_double_scratch_needs_equal_scratch_counts():
    from mscclang.errors import PlanError
    from mscclang.plan import validate_plan
    from mscclang.plan.models import Plan

    gpus = [{"id": r, "input_chunks": 2, "output_chunks": 2, "scratch_chunks": 2 * (r + 1)} for r in range(2)]
    plan = Plan.model_validate({"name": "x", "collective": "allreduce", "protocol": "LL",
                                "use_double_scratch_buffer": True, "gpus": gpus})
    with pytest.raises(PlanError) as e:
        validate_plan(plan)
    assert e.value.path == "gpus[1].scratch_chunks" and "same scratch_chunks" in str(e.value)
