"""Tuning file format: parsing, errors with JSON paths, rule matching, round trip."""

import json

import pytest

from mscclang.comm.errors import TuningError
from mscclang.comm.tuning import (DEFAULT_TUNING_FILE, TuningTable, load_tuning, save_tuning,
                                  tuning_from_dict, tuning_to_json)
from mscclang.plan.call import message_call


def table(rules):
    return {"format": "mscclang.tuning/1", "rules": rules}


def rule(max_bytes, plan, coll="allreduce", n=2, dtypes=("*",), **cand):
    return {"collective": coll, "world_size": n, "dtypes": list(dtypes), "max_bytes": max_bytes,
            "candidates": [dict(plan=plan, **cand)]}


def test_rule_for_picks_smallest_fitting_threshold():
    t = tuning_from_dict(table([rule(None, "big"), rule(4096, "small"), rule(65536, "mid")]))
    pick = lambda b: t.rule_for("allreduce", 2, "float16", b).candidates[0].plan
    assert pick(1) == "small"
    assert pick(4096) == "small"
    assert pick(4097) == "mid"
    assert pick(65536) == "mid"
    assert pick(65537) == "big"
    assert pick(1 << 40) == "big"


def test_exact_dtype_rules_win_and_world_size_filters():
    t = tuning_from_dict(table([rule(None, "any16"), rule(None, "bf", dtypes=["bfloat16"]),
                                rule(None, "four", n=4)]))
    assert t.rule_for("all_reduce", 2, "bfloat16", 10).candidates[0].plan == "bf"
    assert t.rule_for("allreduce", 2, "float16", 10).candidates[0].plan == "any16"
    assert t.rule_for("allreduce", 4, "float16", 10).candidates[0].plan == "four"
    assert t.rule_for("allreduce", 8, "float16", 10) is None
    assert t.rule_for("allgather", 2, "float16", 10) is None


def test_exact_dtype_rule_too_small_falls_to_wildcard():
    t = tuning_from_dict(table([rule(1024, "bf_small", dtypes=["bfloat16"]), rule(None, "wild")]))
    assert t.rule_for("allreduce", 2, "bfloat16", 100).candidates[0].plan == "bf_small"
    assert t.rule_for("allreduce", 2, "bfloat16", 2048).candidates[0].plan == "wild"


@pytest.mark.parametrize("doc,path,msg", [
    ({"format": "nope", "rules": []}, "format", "expected format"),
    (table([{"collective": "allreduce", "candidates": []}]), "rules[0].candidates", "at least 1"),
    (table([rule(10, "x", coll="allfoo")]), "rules[0].collective", "unknown collective"),
    (table([rule(10, "x", dtypes=["float64"])]), "rules[0].dtypes", "unknown dtype"),
    (table([rule(-1, "x")]), "rules[0].max_bytes", "greater than or equal"),
    (table([rule(10, "x", threads=7)]), "rules[0].candidates[0].threads", "greater than"),
    (table([rule(10, "x"), rule(10, "y")]), "rules[1]", "duplicates rules[0]"),
    (table([dict(rule(10, "x"), bogus=1)]), "rules[0].bogus", "Extra inputs"),
])
def test_errors_name_json_path(doc, path, msg):
    with pytest.raises(TuningError) as ei:
        tuning_from_dict(doc)
    assert ei.value.path == path
    assert msg in str(ei.value)


def test_file_round_trip_and_file_errors(tmp_path):
    t = tuning_from_dict(table([rule(4096, "a", instances=2, threads=512, packet_type="LL8"),
                                rule(None, "nccl")]))
    p = tmp_path / "t.json"
    save_tuning(t, p)
    t2 = load_tuning(p)
    assert tuning_to_json(t2) == tuning_to_json(t)
    assert t2.rules[0].candidates[0].label() == "a i2 t512 LL8"
    assert t2.rules[1].candidates[0].is_nccl
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TuningError, match="bad.json.*not valid JSON"):
        load_tuning(bad)
    with pytest.raises(TuningError, match="cannot read"):
        load_tuning(tmp_path / "missing.json")


def _communicator():
    from mscclang.comm import Communicator
    from mscclang.comm.sim_backend import SimWorld

    return Communicator(backend=SimWorld(1).backend(0), fallback=False)


def test_mscclang_tuning_reaches_the_communicator_through_load_tuning(monkeypatch, tmp_path):
    """One home for the variable: what load_tuning(None) honours or refuses, the Communicator does."""
    p = tmp_path / "t.json"
    p.write_text(json.dumps(table([rule(None, "nccl")])))
    monkeypatch.setenv("MSCCLANG_TUNING", str(p))
    assert tuning_to_json(_communicator().tuning) == tuning_to_json(load_tuning(None)) == tuning_to_json(load_tuning(p))
    monkeypatch.setenv("MSCCLANG_TUNING", "{not json")
    with pytest.raises(TuningError, match="not valid JSON"):
        _communicator()
    monkeypatch.setenv("MSCCLANG_TUNING", str(tmp_path / "missing.json"))
    with pytest.raises(TuningError, match="missing.json.*cannot read"):
        _communicator()


@pytest.mark.parametrize("text,path", [("{not json", None), ('{"format": "mscclang.tuning/1", "rules": 3}', "rules")])
def test_a_table_given_as_text_in_mscclang_tuning_is_named_by_the_variable(monkeypatch, text, path):
    """Seen: `MSCCLANG_TUNING='{...' mscclang demo` said only "not valid JSON", naming nothing."""
    monkeypatch.setenv("MSCCLANG_TUNING", text)
    with pytest.raises(TuningError, match=f"^MSCCLANG_TUNING{':' + path if path else ''}: ") as ei:
        load_tuning(None)
    assert ei.value.path == path
    with pytest.raises(TuningError, match="^MSCCLANG_TUNING"):
        _communicator()


def test_without_the_shipped_table_the_default_is_an_empty_one(monkeypatch, tmp_path):
    """A package built without the shipped table: no rule (every call to NCCL), not an error;
    a MSCCLANG_TUNING is still read."""
    import mscclang.comm.tuning as tuning

    monkeypatch.setattr(tuning, "DEFAULT_TUNING_FILE", tmp_path / "absent.json")
    monkeypatch.delenv("MSCCLANG_TUNING", raising=False)
    assert load_tuning(None).rules == [] and _communicator().tuning.rules == []
    monkeypatch.setenv("MSCCLANG_TUNING", "{not json")
    with pytest.raises(TuningError, match="not valid JSON"):
        load_tuning(None)


def test_plans_dir_is_relative_to_the_file(tmp_path):
    doc = table([rule(None, "a")])
    doc["plans_dir"] = "extra"
    p = tmp_path / "sub" / "t.json"
    (tmp_path / "sub" / "extra").mkdir(parents=True)
    p.write_text(json.dumps(doc))
    assert load_tuning(p).extra_plans_dir() == (tmp_path / "sub" / "extra").resolve()


def test_a_table_whose_plans_folder_is_gone_is_refused(monkeypatch, tmp_path):
    """A tuning file copied without the plans the tuner compiled for it: refused naming the
    folder, not read as if its rules named no such plans (their calls would go elsewhere)."""
    doc = table([rule(None, "a")])
    doc["plans_dir"] = "t.plans"
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(TuningError, match=f"{p}:plans_dir: no such folder {tmp_path / 't.plans'}"):
        load_tuning(p)
    monkeypatch.setenv("MSCCLANG_TUNING", str(p))
    with pytest.raises(TuningError, match="plans_dir: no such folder"):
        _communicator()
    from mscclang.config import describe

    assert "plans_dir: no such folder" in next(r.problem for r in describe() if r.name == "MSCCLANG_TUNING")


def test_shipped_defaults_parse_and_cover_2_ranks():
    t = load_tuning(DEFAULT_TUNING_FILE)
    assert isinstance(t, TuningTable)
    for coll in ("allreduce", "allgather", "reducescatter", "alltoall"):
        for nbytes in (1024, 1 << 20, 1 << 30):
            assert t.rule_for(coll, 2, "bfloat16", nbytes) is not None, (coll, nbytes)


def test_shipped_defaults_name_shipped_plans():
    """Every 2-rank candidate of the defaults exists in plans/index.json (when plans/ ships)."""
    from mscclang.comm.catalog import Catalog, default_plans_dir

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/index.json in this checkout")
    cat = Catalog.from_dir(folder)
    t = load_tuning(DEFAULT_TUNING_FILE)
    missing = []
    for i, r in enumerate(t.rules):
        if r.world_size != 2:
            continue
        for c in r.candidates:
            if not c.is_nccl and not cat.find_all(c.plan, r.collective, 2, c.instances, c.threads):
                missing.append(f"rules[{i}] {c.label()}")
    assert not missing, missing


def _shipped_catalog_and_grids():
    from mscclang.algorithms.index import load_index
    from mscclang.comm.catalog import Catalog, default_plans_dir

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/index.json in this checkout")
    grids = {e["file"][:-len(".json")]: e["threadblocks"] for e in load_index(folder)}
    return Catalog.from_dir(folder), grids


def _probe_sizes(t, coll):
    """Both ends of every 2-rank rule's size range for ``coll`` (and a huge size)."""
    bounds = sorted({r.max_bytes for r in t.rules
                     if r.collective == coll and r.world_size == 2 and r.max_bytes is not None})
    sizes = [1024] + [b for b in bounds] + [b + 1 for b in bounds] + [1 << 34]
    return sorted(set(sizes))


COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "sendrecv")


@pytest.mark.parametrize("coll", COLLECTIVES)
def test_shipped_defaults_keep_an_any_buffer_plan_before_nccl(coll):
    """Zero-copy plans need symmetric buffers, so at every 2-rank size of an estimated rule the
    selector lists a plan for any buffers (its size range holding the message) before
    torch.distributed. Measured rules (``mscclang tune``: candidates carry times) keep the
    measured order, NCCL included, where NCCL beat every any-buffer plan."""
    from mscclang.comm.selector import Selector

    cat, _ = _shipped_catalog_and_grids()
    t = load_tuning(DEFAULT_TUNING_FILE)
    sel = Selector(t, cat)
    for nbytes in _probe_sizes(t, coll):
        rule = t.rule_for(coll, 2, "bfloat16", nbytes)
        if rule is not None and any(c.us is not None for c in rule.candidates):
            nccl = next((c.us for c in rule.candidates if c.plan == "nccl"), None)
            anyb = [c.us for c in rule.candidates if c.us is not None and c.plan != "nccl"
                    and "zero_copy" not in c.plan]
            if nccl is not None and anyb and min(anyb) < nccl:
                names = [c.plan for c in rule.candidates]
                assert names.index("nccl") > min(i for i, c in enumerate(rule.candidates)
                                                 if c.us == min(anyb)), (coll, nbytes, names)
            continue
        choices = sel.choices(message_call(coll, 2, nbytes, "bfloat16"))
        assert choices, (coll, nbytes)
        upto = next((i for i, c in enumerate(choices) if c.is_nccl), len(choices))
        assert any(not v.symmetric and v.fits(nbytes) for c in choices[:upto] for v in c.variants), \
            (coll, nbytes, [c.label() for c in choices])


@pytest.mark.parametrize("coll", COLLECTIVES)
def test_shipped_defaults_use_the_bandwidth_variants(coll):
    """notes/perf.md: plain puts need >= 16 blocks for 220 GB/s and 32 for ~265 GB/s, LL plans
    scale to 32 blocks. At 2 ranks the first choice above 64 KiB runs >= 16 blocks, and above
    1 MiB every plan choice of an estimated rule runs 32 blocks (zero-copy first where the
    collective has one)."""
    from mscclang.comm.selector import Selector

    cat, grids = _shipped_catalog_and_grids()
    t = load_tuning(DEFAULT_TUNING_FILE)
    sel = Selector(t, cat)
    for nbytes in _probe_sizes(t, coll):
        plans = [c for c in sel.choices(message_call(coll, 2, nbytes, "bfloat16")) if not c.is_nccl]
        blocks = [grids[c.variant.key] for c in plans]
        if nbytes > 64 * 1024:
            assert blocks[0] >= 16, (coll, nbytes, [c.label() for c in plans])
        rule = t.rule_for(coll, 2, "bfloat16", nbytes)
        measured = rule is not None and any(c.us is not None for c in rule.candidates)
        if nbytes > 1 << 20 and measured:
            # measured order (mscclang tune): the fastest plan first, whatever its grid
            assert blocks[0] >= 16, (coll, nbytes, [c.label() for c in plans])
        elif nbytes > 1 << 20:
            assert set(blocks) == {32}, (coll, nbytes, [c.label() for c in plans])
            if coll != "broadcast":
                assert plans[0].variant.symmetric, (coll, nbytes, plans[0].label())
