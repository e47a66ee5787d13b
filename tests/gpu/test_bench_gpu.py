"""``mscclang bench --host`` and ``mscclang bench --first-calls`` on the GPU as a user runs them,
two ranks sharing one GPU (``MSCCLANG_RANKS_PER_GPU=2``, however many GPUs there are: these two
modes run there): each exits 0, prints every row measured, checked, and its targets marked, and
writes its JSON. The figures are printed, not judged: the targets are benchmarks, not tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shared_env() -> dict:
    try:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no CUDA: skip
        have = 0
    if have < 1:
        pytest.skip("needs a CUDA GPU")
    if os.environ.get("MSCCLANG_ENABLE_NVLS"):
        pytest.skip("refusing to run GPU tests with MSCCLANG_ENABLE_NVLS set")
    env = dict(os.environ)
    env.update(MSCCLANG_RANKS_PER_GPU="2", NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _bench(env: dict, *args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "mscclang", "bench", *args, "--nprocs", "2", "--time-limit", "150"],
                       env=env, capture_output=True, text=True, timeout=330, cwd=ROOT)
    print(p.stdout[-8000:])
    print(p.stderr[-3000:], file=sys.stderr)
    return p


def test_host_mode_on_ranks_sharing_a_gpu(shared_env, tmp_path):
    from mscclang.bench.host import LABELS, UNCHECKED, host_config, host_rows

    p = _bench(shared_env, "--host", "--json", str(tmp_path / "h.json"), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "h.json").read_text())
    assert doc["meta"]["world_size"] == 2 and doc["meta"]["ranks_per_gpu"] == 2
    res = doc["results"]
    assert [(r["call"], r["elements"]) for r in res] == host_rows(host_config())
    bad = [r for r in res if not r["ok"] or not r["us"] > 0]
    assert not bad, bad
    for r in res:
        if r["call"] in UNCHECKED:   # torch's launches and the do-nothing group run no plan
            assert not r.get("plan"), r
        else:   # every mscclang row ran a plan of the library
            assert r.get("plan") and not r["plan"].startswith("nccl") and r["plan"] != "fallback", r
    assert [r["call"] for r in res].count("floor") == 1
    for label in LABELS.values():
        assert f"| {label} |" in p.stdout, label
    assert "## Targets (host time)" in p.stdout and "| not measured |" not in p.stdout
    assert "of 13 measured targets met." in p.stdout   # 3 + 3 + 1 + 3 rows and 3 kinds' growth


def test_first_calls_on_ranks_sharing_a_gpu(shared_env, tmp_path):
    sizes = [49164, 278596, 475252, 1000000]
    p = _bench(shared_env, "--first-calls", "--sizes", ",".join(map(str, sizes)), "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "first_calls.json").read_text())
    assert doc["meta"]["world_size"] == 2 and doc["meta"]["ranks_per_gpu"] == 2
    res = doc["results"]
    assert [r["bytes"] for r in res] == sizes
    assert all(r["ok"] and r["new_plan"] in (True, False) for r in res), res
    for b in sizes:
        assert f"| all_reduce | {b} | " in p.stdout, b
    assert "## Targets (a plan's first call, a new size of a loaded plan)" in p.stdout
    assert f"of {len(sizes)} measured targets met." in p.stdout
