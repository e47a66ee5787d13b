"""A new message size packs only what depends on the size: the device records of sync ops
(memory-channel signals and waits, barriers, semaphores, nops) are kept per plan and rank between
sizes. Packed that way, every shipped plan gives the same bytes as packed from scratch."""

from __future__ import annotations

from mscclang.errors import PlanError
from mscclang.plan.io import load_plan
from mscclang.runtime.device_plan import pack_blocks


def _sizes(plan, nbytes):
    n = plan.world_size
    ib = nbytes * n
    ob = ib * n if plan.collective == "allgather" else (ib // n if plan.collective == "reducescatter" else ib)
    return ib, ob


def test_kept_sync_records_pack_the_same_bytes_at_every_size(shipped_plans):
    compared = 0
    for f in shipped_plans[::3]:
        plan = load_plan(f)
        for r in range(plan.world_size):
            static: dict = {}
            for nbytes in (4096, 65536 + 96, 3 * (1 << 20) + 4096):
                ib, ob = _sizes(plan, nbytes)
                try:
                    want = pack_blocks(plan, r, ib, ob)
                except PlanError:
                    continue
                got = pack_blocks(plan, r, ib, ob, static)
                assert [b.region for b in got.blocks] == [b.region for b in want.blocks], (f.name, r, nbytes)
                assert got.packet_align == want.packet_align and got.scratch_bytes == want.scratch_bytes
                compared += 1
    assert compared > 100
