"""A new message size packs only what depends on the size: the device records of sync ops
(memory-channel signals and waits, barriers, semaphores, nops) and the operand descriptors of data
ops are kept per plan and rank between sizes. Packed that way, every shipped plan gives the same
bytes as packed from scratch. The channel tables (pairing slots, sync layout) are computed once
per loaded plan and agree with the plan's own rules."""

from __future__ import annotations

from mscclang.errors import PlanError
from mscclang.plan.io import load_plan
from mscclang.plan.models import ChannelType
from mscclang.runtime.device_plan import inbound_slots
from mscclang.runtime.packing import pack_blocks
from mscclang.runtime.ports import port_inbound_slots
from mscclang.runtime.state import LoadedPlan


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
                assert [b.n_records for b in got.blocks] == [b.n_records for b in want.blocks]
                assert got.uses_packets == want.uses_packets
                compared += 1
    assert compared > 100


def test_rank_tables_are_the_plans_pairing_rule(shipped_plans):
    for f in shipped_plans[::5]:
        plan = load_plan(f)
        lp = LoadedPlan(plan, False, "ll16", "sum", plan.num_threads_per_block, 1)
        for r in range(plan.world_size):
            t = lp.table(r)
            assert lp.table(r) is t   # computed once
            assert list(t.memory) == plan.channel_ordinals(r, ChannelType.memory)
            assert list(t.port) == plan.channel_ordinals(r, ChannelType.port)
            assert t.memory_slots == inbound_slots(plan, r) and t.port_slots == port_inbound_slots(plan, r)
            # every channel of r to q has a slot on q for (r, ordinal): the peer's counter it signals
            for c in t.memory:
                assert (r, c.ordinal) in lp.table(c.peer).memory_slots
            assert t.sync.size % 256 == 0 and t.sync.n_inbound == len(t.memory_slots)


def test_the_linear_pairing_table_is_the_pairing_rule(shipped_plans):
    """plan.models.paired_indices (used by the compiler and the simulator, linear in the
    channels) gives what paired_index gives channel by channel, on every shipped plan and on
    lopsided channel lists (unpaired channels, several channels to one peer)."""
    import random

    from mscclang.plan.models import paired_index, paired_indices

    def check(peers_by_rank):
        table = paired_indices(peers_by_rank)
        for a, peers in enumerate(peers_by_rank):
            for j, b in enumerate(peers):
                assert table[a][j] == paired_index(a, peers, j, peers_by_rank[b]), (a, j)

    for f in shipped_plans[::4]:
        plan = load_plan(f)
        for ct in (ChannelType.memory, ChannelType.port):
            check([g.peers(ct) for g in plan.gpus])
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(2, 6)
        check([[rng.choice([q for q in range(n) if q != a]) for _ in range(rng.randint(0, 8))] for a in range(n)])
