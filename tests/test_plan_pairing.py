"""The channel pairing rule (mscclang.plan.models): the j-th channel of one type from A to B is
bound to the j-th channel of the same type from B to A."""

from __future__ import annotations

import pytest

from mscclang.errors import PlanError
from mscclang.plan.models import (
    ChannelDesc, ChannelOrdinal, ChannelType, Gpu, PairedEnd, Plan, channel_ordinals, paired_index,
)

M, P = ChannelType.memory, ChannelType.port


def _plan(memory: list[list[int]], port: list[list[int]]) -> Plan:
    gpus = []
    for r, (mem, prt) in enumerate(zip(memory, port)):
        chans = [ChannelDesc(channel_type=M, connected_to=mem)] if mem else []
        chans += [ChannelDesc(channel_type=P, connected_to=prt)] if prt else []
        gpus.append(Gpu(id=r, input_chunks=1, output_chunks=1, scratch_chunks=0, channels=chans))
    return Plan(name="pairing", collective="custom", gpus=gpus)


# rank 0: memory channels to 1, 2, 1 and port channels to 1, 1
# rank 1: memory channels to 0, 0 (in another order of creation) and one port channel to 0
# rank 2: no channel back to rank 0: rank 0's memory channel 1 is unpaired
PLAN = _plan(memory=[[1, 2, 1], [0, 0], []], port=[[1, 1], [0], []])


def test_ordinals_count_per_peer_and_restart_per_type():
    assert channel_ordinals([1, 2, 1, 1]) == [ChannelOrdinal(1, 0), ChannelOrdinal(2, 0), ChannelOrdinal(1, 1),
                                              ChannelOrdinal(1, 2)]
    assert channel_ordinals([]) == []
    assert PLAN.channel_ordinals(0, M) == [ChannelOrdinal(1, 0), ChannelOrdinal(2, 0), ChannelOrdinal(1, 1)]
    assert PLAN.channel_ordinals(0, P) == [ChannelOrdinal(1, 0), ChannelOrdinal(1, 1)]
    assert PLAN.channel_ordinals(2, M) == []


def test_paired_end_matches_the_same_ordinal():
    assert PLAN.paired_end(0, M, 0) == PairedEnd(1, 0)
    assert PLAN.paired_end(0, M, 2) == PairedEnd(1, 1)
    assert PLAN.paired_end(1, M, 1) == PairedEnd(0, 2)
    # port channels are numbered on their own: port channel 0 of rank 0 is not memory channel 0
    assert PLAN.paired_end(1, P, 0) == PairedEnd(0, 0)
    # the rule is symmetric wherever both ends exist
    for ct in (M, P):
        for r in range(PLAN.world_size):
            for i, c in enumerate(PLAN.channel_ordinals(r, ct)):
                peer_peers = PLAN.gpus[c.peer].peers(ct)
                j = paired_index(r, PLAN.gpus[r].peers(ct), i, peer_peers)
                if j is not None:
                    assert paired_index(c.peer, peer_peers, j, PLAN.gpus[r].peers(ct)) == i


def test_unpaired_channel():
    # rank 0's memory channel 1 leads to rank 2, which has no memory channel to rank 0
    assert paired_index(0, [1, 2, 1], 1, []) is None
    with pytest.raises(PlanError, match=r"rank 0: memory channel 1 is its channel 0 to rank 2, but rank 2 has "
                                        r"only 0 memory channel\(s\) to rank 0") as e:
        PLAN.paired_end(0, M, 1)
    assert e.value.path == "gpus[2].channels"
    # rank 0's second port channel to rank 1 has no partner: rank 1 has one port channel to rank 0
    with pytest.raises(PlanError, match=r"rank 0: port channel 1 is its channel 1 to rank 1, but rank 1 has only 1"):
        PLAN.paired_end(0, P, 1)


def test_bad_channel_or_rank():
    with pytest.raises(PlanError, match=r"rank 1: memory channel 2 does not exist"):
        PLAN.paired_end(1, M, 2)
    with pytest.raises(PlanError, match=r"rank 2: port channel 0 does not exist"):
        PLAN.paired_end(2, P, 0)
    with pytest.raises(PlanError, match=r"rank 3 is not in the plan \(it has 3 ranks\)"):
        PLAN.paired_end(3, M, 0)
    with pytest.raises(PlanError, match=r"rank 3 is not in the plan"):
        PLAN.channel_ordinals(3, M)
    with pytest.raises(IndexError, match=r"channel 3 does not exist \(the rank has 3\)"):
        paired_index(0, [1, 2, 1], 3, [0])
    far = _plan(memory=[[5], []], port=[[], []])
    with pytest.raises(PlanError, match=r"rank 0: memory channel 0 leads to rank 5, which is not in the plan"):
        far.paired_end(0, M, 0)


def test_compiler_twin_uses_the_same_rule():
    from mscclang.compiler.ir import IRProgram, IRRank
    from mscclang.compiler.validate import paired_channel
    from mscclang.plan.collectives import CollectiveSpec

    ranks = [IRRank(r, 1, 1, memory=list(g.peers(M)), port=list(g.peers(P))) for r, g in enumerate(PLAN.gpus)]
    ir = IRProgram("pairing", CollectiveSpec("custom", 3, 1), ranks)
    for ct in (M, P):
        for r, g in enumerate(PLAN.gpus):
            for i, peer in enumerate(g.peers(ct)):
                try:
                    want = PLAN.paired_end(r, ct, i).index
                except PlanError:
                    want = None
                assert paired_channel(ir, r, ct, i) == want
    assert paired_channel(ir, 0, M, 1) is None
    assert paired_channel(ir, 0, M, 2) == 1
