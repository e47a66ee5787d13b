"""The plan fuzzer (tools.fuzz: load_plan, show, verify, import-mscclpp): a fixed-seed sample in CI, the 10,000-file campaign
under ``-m slow``. Every run must end ``ok`` or ``clear`` (exit status 0, or 1 with a message):
no traceback, hang, memory blow-up or crash."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tools.fuzz import (
    BAD_CLASSES,
    Case,
    campaign,
    generate_cases,
    run_case,
    run_target,
    seed_documents,
)

SMALL = 30_000  # bytes: the CI sample fuzzes the small seeds (golden ops, 2-rank plans, samples)


@pytest.fixture(scope="module")
def small_seeds():
    return seed_documents(max_bytes=SMALL)


def test_generation_is_deterministic(small_seeds):
    a = [(c.data, c.runs, c.mutations) for c in generate_cases(40, 7, small_seeds)]
    b = [(c.data, c.runs, c.mutations) for c in generate_cases(40, 7, small_seeds)]
    assert a == b
    assert len({x[0] for x in a}) > 30  # and the files differ


def test_fixed_seed_sample(small_seeds, tmp_path, monkeypatch):
    monkeypatch.setenv("MSCCLANG_SIM_MAX_SECONDS", "5")
    monkeypatch.setenv("MSCCLANG_SIM_MAX_MEMORY", "1G")
    counts: Counter = Counter()
    bad = []
    for case in generate_cases(400, 2024, small_seeds):
        for o in run_case(case, tmp_path, timeout=30):
            counts[o.cls] += 1
            if o.cls in BAD_CLASSES:
                bad.append((case.id, case.seed, case.mutations, o.target, o.argv, o.cls, o.message))
    assert not bad, "\n".join(map(str, bad))
    # the sample reaches both outcomes of every target
    assert counts["ok"] > 50 and counts["clear"] > 300, counts


@pytest.mark.parametrize("data,cls", [
    (b"\xff\xfe{}", "clear"),                                  # not UTF-8
    (b"[" * 100_000 + b"]" * 100_000, "clear"),                # nesting too deep to parse
    (b'{"format": "mscclang.plan/1", "name": ' + b"9" * 5000 + b"}", "clear"),
    (b"null", "clear"),
])
def test_classification_of_known_inputs(data, cls, tmp_path):
    case = Case(0, "inline", ["inline"], data, [("load", []), ("show", []), ("verify", []), ("import", [])])
    assert [o.cls for o in run_case(case, tmp_path, timeout=30)] == [cls] * 4


def test_a_traceback_is_classified_as_one(tmp_path, monkeypatch):
    import mscclang.plan.io as io_mod

    def broken(*a, **k):
        raise KeyError("boom")

    monkeypatch.setattr(io_mod, "parse_plan_json", broken)
    f = tmp_path / "p.json"
    f.write_text("{}")
    cls, rc, msg = run_target("load", str(f), [], 30)
    assert cls == "traceback" and "KeyError" in msg


def test_a_hang_is_classified_as_one(tmp_path, monkeypatch):
    import time

    import mscclang.plan.io as io_mod

    monkeypatch.setattr(io_mod, "parse_plan_json", lambda *a, **k: time.sleep(10))
    f = tmp_path / "p.json"
    f.write_text("{}")
    cls, _, _ = run_target("load", str(f), [], 0.3)
    assert cls == "hang"


def test_batched_workers_with_a_memory_limit(tmp_path, small_seeds):
    """The campaign machinery itself: worker processes under RLIMIT_AS, results and summary."""
    s = campaign(12, tmp_path / "out", seed=3, mem_limit="3G", timeout=60, batch_size=6, sim_seconds=5)
    assert s["files"] == 12 and s["runs"] == 48
    assert sum(s["totals"][c] for c in BAD_CLASSES) == 0, s
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 48 and all(json.loads(x)["cls"] in ("ok", "clear") for x in lines)


@pytest.mark.slow
def test_campaign_of_ten_thousand_files(tmp_path):
    """The reliability figure of notes/reliability_fuzz.md (about 11 minutes on 2 shared cores)."""
    s = campaign(10_000, tmp_path / "out", seed=1, mem_limit="4G", timeout=60, batch_size=250)
    assert s["files"] >= 10_000
    bad = {c: s["totals"][c] for c in BAD_CLASSES}
    assert sum(bad.values()) == 0, (bad, sorted(p.name for p in (tmp_path / "out" / "findings").iterdir())[:20])


def test_findings_are_kept(tmp_path, monkeypatch):
    """A run that goes wrong keeps its file and a description under findings/."""
    import tools.fuzz as fz

    real = fz._run_batch

    def one_bad(batch, cases, mem_limit, timeout, env):
        outs = real(batch, cases, mem_limit, timeout, env)
        outs[0].cls = "traceback"
        return outs

    monkeypatch.setattr(fz, "_run_batch", one_bad)
    s = campaign(2, tmp_path / "out", seed=4, batch_size=2, sim_seconds=5)
    assert s["totals"]["traceback"] == 1 and s["files_with_findings"] == 1
    kept = sorted(p.suffix for p in (tmp_path / "out" / "findings").iterdir())
    assert kept == [".json", ".txt"]
