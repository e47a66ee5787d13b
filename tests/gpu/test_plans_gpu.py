"""Every shipped plan of the pool's world size on the GPU (``pytest -m gpu tests/gpu``): one
launch per plan on random fp16 data at 64 KiB (inside the plan's size range), bit for bit against
the simulator and the collective's reference, and one at about 1 MiB in bf16 against the
reference (exact where the order does not matter, else within the any-order summation bound).
Plans that need symmetric buffers run on the communicator's symmetric memory, the others on
ordinary tensors, as the library calls them. Plans the executor refuses here (switch channels
while NVLink multicast is off) are listed with the executor's reason, never failed.

With ``MSCCLANG_RANKS_PER_GPU=4`` or ``8`` on one GPU this runs the 4- and 8-rank plans on real
kernels with every rank in its own process (functional only: the ranks time-share the GPU).
The fused plans (plan/2) need a residual and a weight: ``test_fused_gpu.py`` runs them."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.harness.shipped import PLANS_DIR, shipped_plan_files

pytestmark = pytest.mark.gpu

C = "tests.harness.runtime_checks"


def _size(plan, want: int) -> int:
    """Input bytes of a call whose message (allgather: the output, else the input; the size the
    plan's range is checked against) is about ``want``, inside the plan's range, the input a
    multiple of the plan's alignment times the world size (so every rank's block is whole)."""
    from mscclang.plan.collectives import collective

    message = min(max(want, plan.min_message_size), plan.max_message_size)
    nbytes = collective(plan.collective).call_bytes(plan.world_size, message)[0]
    a = max(plan.buffer_alignment, 2) * plan.world_size
    return max(nbytes // a * a, a)


def _plans_of(world: int) -> list:
    """(plan, its JSON, symmetric) for every shipped plan/1 plan of ``world`` ranks, the
    algorithms taken in turns (first variant of each, then the second, ...), so a run cut short
    by its time limit has still covered every algorithm."""
    from mscclang.plan.io import load_plan

    modes = {e["file"]: e["buffer_mode"] for e in json.loads((PLANS_DIR / "index.json").read_text())["plans"]}
    out = []
    for f in shipped_plan_files():
        text = f.read_text()
        if "\"format\":\"mscclang.plan/1\"" not in text[:60].replace(" ", ""):
            continue
        plan = load_plan(text)
        if plan.world_size == world:
            out.append((plan, text, modes.get(f.name) == "symmetric"))
    turn: dict = {}
    keyed = []
    for p in out:
        algo = p[0].name.split(".")[0]
        turn[algo] = turn.get(algo, -1) + 1
        keyed.append((turn[algo], p[0].name, p))
    return [p for _, _, p in sorted(keyed, key=lambda k: k[:2])]


def test_every_shipped_plan_of_the_pools_world_size(pool):
    """``MSCCLANG_TEST_BUDGET_S`` bounds the time spent (eight ranks time-sharing one GPU are
    slow): plans not reached are listed and the test, if nothing failed, is skipped as incomplete."""
    plans = _plans_of(pool.world_size)
    if not plans:
        pytest.skip(f"no shipped plan for {pool.world_size} ranks")
    budget = float(os.environ.get("MSCCLANG_TEST_BUDGET_S") or "inf")
    t0 = time.monotonic()
    failures, refused, ran, cut = [], {}, 0, []
    for plan, text, symmetric in plans:
        if time.monotonic() - t0 > budget:
            cut.append(plan.name)
            continue
        t1 = time.monotonic()
        why = pool.run("tests.harness.port_checks:runnable_reason", text)[0]
        if why:
            refused[plan.name] = why
            continue
        before = len(failures)
        for nbytes, dtype in ((_size(plan, 64 << 10), "float16"), (_size(plan, (1 << 20) + 4096), "bfloat16")):
            try:
                res = pool.run(f"{C}:run_plan_check", text, nbytes, dtype, None, "sum", 11, False, symmetric)
            except Exception as e:  # noqa: BLE001 - every plan is tried; failures listed at the end
                failures.append(f"{plan.name} @ {nbytes} {dtype}: {type(e).__name__}: {str(e)[-400:]}")
                continue
            bad = [r for r in res if r["bad"]]
            if bad:
                r = bad[0]
                failures.append(f"{plan.name} @ {nbytes} {dtype}: rank {r['rank']}: {r['bad']} wrong "
                                f"(reference {r['ref_bad']}, simulator {r['sim_bad']}, {r['ref_mode']}), "
                                f"first {r['first_bad']}, kernel {r['kernel']}")
        ran += 1
        print(f"{'ok  ' if len(failures) == before else 'BAD '} {plan.name} ({time.monotonic() - t1:.1f} s)", flush=True)
    print(f"\nran {ran} shipped {pool.world_size}-rank plans, {len(failures)} failures, {len(refused)} refused")
    for name, why in refused.items():
        print(f"  refused {name}: {why[:160]}")
    assert ran > 0 and not failures, "\n".join(failures[:30])
    if cut:
        pytest.skip(f"time budget of {budget:.0f} s: {ran} of {len(plans)} plans run, {len(cut)} not "
                    f"reached (first: {cut[0]})")
