"""The registration of ordinary tensors (mscclang.runtime.registration) on the CPU, with fake
allocations and IPC, one thread per rank: peer addresses are exactly where the peers' tensors
are, mappings are cached and closed by buffer id (not address), a dead storage never matches,
every rank decides alike (refusals, failures, eviction, capture sessions), and nothing is left
mapped."""

from __future__ import annotations

import logging

import pytest

from mscclang.config import Settings, settings
from mscclang.errors import CallMismatch, InvalidCall, RegistrationError
from mscclang.runtime import registration as regmod
from mscclang.runtime.registration import (
    Region, Registry, ZeroCopy, zero_copy_operands,
)
from tests.harness.registration_fakes import FakeCluster, FakeRef, RankErrors

MiB = 1 << 20



@pytest.fixture(autouse=True)
def _designed_defaults(monkeypatch):
    """These tests cover the designed behaviour (auto registration, 128 MiB staging cap), which
    the release keeps off until GPU tests have run on it."""
    monkeypatch.setenv("MSCCLANG_REGISTER", "auto")
    monkeypatch.setenv("MSCCLANG_STAGING_CAP_BYTES", str(128 << 20))

def _peer_targets(cl: FakeCluster, r: int, reg: Region) -> dict[int, int]:
    """Where rank r's registration ``reg`` reaches each peer: the peer's real address."""
    out = {}
    for q, addr in reg.peer_bases.items():
        if q == r:
            continue
        owner, _, real = cl.ipcs[r].resolve(addr)
        assert owner == q
        out[q] = real
    return out


def test_peer_addresses_are_the_peers_tensors_and_each_allocation_is_mapped_once():
    cl = FakeCluster(3)
    allocs = [cl.devices[r].alloc(64 * MiB) for r in range(3)]
    # two tensors per rank in one allocation, at offsets that differ between ranks
    offs = [(0, 8 * MiB), (4096, 16 * MiB), (1 * MiB, 2 * MiB)]
    ptrs = [[allocs[r].base + o for o in offs[r]] for r in range(3)]

    def body(r):
        reg = cl.registry(r)
        got = reg.register([(ptrs[r][0], MiB, FakeRef()), (ptrs[r][1], 2 * MiB, FakeRef())])
        return got

    res = cl.run(body)
    for r in range(3):
        a, b = res[r]
        assert a is not None and b is not None and a.seq == 0 and b.seq == 1 and a.index == ("reg", 0)
        assert a.base == ptrs[r][0] and a.size == MiB
        for k, reg in enumerate((a, b)):
            assert _peer_targets(cl, r, reg) == {q: ptrs[q][k] for q in range(3) if q != r}
        # one mapping per peer allocation, shared by both registrations
        assert sorted(cl.ipcs[r].opened) == sorted((q, allocs[q].buffer_id) for q in range(3) if q != r)
        assert cl.registry(r).lookup(ptrs[r][1], 2 * MiB) is b
        assert cl.registry(r).memory()["peer_mappings"] == 2


def test_lookup_needs_the_registered_start_a_fitting_size_and_a_live_storage():
    cl = FakeCluster(2)
    refs = [FakeRef(), FakeRef()]
    al = [cl.devices[r].alloc(8 * MiB) for r in range(2)]
    res = cl.run(lambda r: cl.registry(r).register([(al[r].base, 4 * MiB, refs[r])])[0])
    reg = cl.registry(0)
    p = al[0].base
    assert reg.lookup(p, 4 * MiB) is res[0]
    assert reg.lookup(p, 1024) is res[0]            # a view from the start
    assert reg.lookup(p, 4 * MiB + 2) is None        # larger than registered
    assert reg.lookup(p + 256, 1024) is None         # starts elsewhere
    refs[0].dead = True                              # the storage died: never matches again
    assert reg.lookup(p, 4 * MiB) is None
    assert cl.registry(1).lookup(al[1].base, 4 * MiB) is res[1]


def test_same_tensors_again_keep_their_registration_without_new_mappings():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(8 * MiB) for r in range(2)]
    refs = [FakeRef(), FakeRef()]
    first = cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, refs[r])])[0])
    again = cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, refs[r])])[0])
    for r in range(2):
        assert again[r] is first[r]
        assert len(cl.ipcs[r].opened) == 1
        assert cl.registry(r).stats["reused"] == 1


def test_address_reused_by_a_new_allocation_is_mapped_anew_and_the_old_mapping_closed():
    """Rank 1 frees its allocation (its tensor died) and a new one lands at the same address with
    a new buffer id: registering again maps the new one; the stale mapping is closed."""
    cl = FakeCluster(2)
    a0 = cl.devices[0].alloc(8 * MiB)
    a1 = cl.devices[1].alloc(8 * MiB)
    refs = [FakeRef(), FakeRef()]
    cl.run(lambda r: cl.registry(r).register([((a0, a1)[r].base, MiB, refs[r])]))
    refs[1].dead = True
    cl.devices[1].free(a1.base)
    b1 = cl.devices[1].alloc(8 * MiB, base=a1.base)          # same address, new id
    assert b1.buffer_id != a1.buffer_id
    refs1b = FakeRef()
    res = cl.run(lambda r: cl.registry(r).register([((a0, b1)[r].base, MiB, (refs[0], refs1b)[r])])[0])
    r0 = res[0]
    assert r0.seq == 1                                        # rank 1 had nothing to reuse: new number
    assert cl.ipcs[0].resolve(r0.peer_bases[1]) == (1, b1.buffer_id, b1.base)
    assert cl.ipcs[0].closed == [(1, a1.buffer_id)]           # the old allocation's mapping, by id
    assert cl.ipcs[0].opened == [(1, a1.buffer_id), (1, b1.buffer_id)]
    # the first registration was dropped on every rank
    for r in range(2):
        assert 0 not in cl.registry(r)._table
    assert cl.registry(0).lookup(a0.base, MiB) is r0


def test_a_rank_that_cannot_export_makes_every_rank_stage_and_it_is_logged_once(caplog):
    cl = FakeCluster(3)
    al = [cl.devices[r].alloc(8 * MiB, capable=(r != 1)) for r in range(3)]
    with caplog.at_level(logging.WARNING, logger="mscclang.runtime"):
        for _ in range(2):
            res = cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, FakeRef())]))
            assert res == [[None], [None], [None]]
    for r in range(3):
        assert cl.ipcs[r].opened == [] and cl.registry(r).lookup(al[r].base, MiB) is None
        assert cl.registry(r).stats["refused"] == 2
    why = [m for m in caplog.messages if "rank 1" in m and "cannot be registered" in m]
    assert len(why) == 1 and "fake cuMem allocation" in why[0]
    assert sum("cannot export theirs" in m for m in caplog.messages) == 2   # ranks 0 and 2, once each


def test_a_rank_whose_mapping_fails_makes_every_rank_stage_without_leaking_mappings():
    cl = FakeCluster(3)
    al = [cl.devices[r].alloc(8 * MiB) for r in range(3)]
    cl.ipcs[2].fail_open = True
    res = cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, FakeRef())]))
    assert res == [[None]] * 3
    for r in range(3):
        assert cl.ipcs[r].maps == {}
        assert sorted(cl.ipcs[r].opened) == sorted(cl.ipcs[r].closed)
        assert cl.registry(r).memory()["registrations"] == 0
    # the number was used up alike: the next registration is number 1 on every rank
    cl.ipcs[2].fail_open = False
    res = cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, FakeRef())])[0].seq)
    assert res == [1, 1, 1]


@pytest.mark.parametrize("sizes", [[(1, MiB)], [(2, MiB)]])
def test_ranks_that_register_different_things_get_call_mismatch_on_every_rank(sizes):
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(8 * MiB) for r in range(2)]

    def body(r):
        n, size = (1, MiB) if r == 0 else sizes[0]
        if r == 1 and size == MiB and n == 1:
            size = 2 * MiB
        return cl.registry(r).register([(al[r].base + k * size, size, FakeRef()) for k in range(n)])

    with pytest.raises(RankErrors) as ei:
        cl.run(body)
    assert all(isinstance(e, CallMismatch) for e in ei.value.errors)
    for r in range(2):
        assert cl.ipcs[r].maps == {}


def test_least_recently_used_registration_is_dropped_alike_on_every_rank():
    cl = FakeCluster(2, max_regions=2)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    t = lambda r, k: (al[r].base + k * MiB, MiB, FakeRef())  # noqa: E731
    cl.run(lambda r: cl.registry(r).register([t(r, 0)]))
    cl.run(lambda r: cl.registry(r).register([t(r, 1)]))
    for r in range(2):   # tensor 0 used again: tensor 1 is now the least recently used
        assert cl.registry(r).lookup(al[r].base, MiB) is not None
    res = cl.run(lambda r: cl.registry(r).register([t(r, 2)])[0].seq)
    assert res == [2, 2]
    for r in range(2):
        assert sorted(cl.registry(r)._table) == [0, 2]
        assert cl.registry(r).lookup(al[r].base + MiB, MiB) is None
    # the shared mapping stays open while registrations 0 and 2 use it
    assert cl.ipcs[0].closed == [] and len(cl.ipcs[0].maps) == 1


def test_a_dead_storage_releases_its_resources_here_at_the_next_collective_point():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    refs = [FakeRef(), FakeRef()]
    released = {0: [], 1: []}
    for r in range(2):
        cl.registry(r).on_release.append(lambda regs, r=r: released[r].extend(x.seq for x in regs))
    cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, refs[r])]))
    refs[0].dead = True
    cl.run(lambda r: cl.registry(r).register([(al[r].base + 8 * MiB, MiB, FakeRef())]))
    assert released == {0: [0], 1: []}
    m0, m1 = cl.registry(0).memory(), cl.registry(1).memory()
    assert (m0["registrations"], m0["registrations_released"]) == (1, 1)
    assert (m1["registrations"], m1["registrations_released"]) == (2, 0)
    # the slot stays until dropped collectively: both ranks still count two
    assert len(cl.registry(0)._table) == len(cl.registry(1)._table) == 2
    assert cl.ipcs[0].syncs >= 1     # released only after the device was idle


def test_deregister_drops_on_every_rank_and_closes_mappings():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(8 * MiB) for r in range(2)]
    cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, FakeRef())]))
    n = cl.run(lambda r: cl.registry(r).deregister([(al[r].base, MiB)]))
    assert n == [1, 1]
    for r in range(2):
        assert cl.registry(r).lookup(al[r].base, MiB) is None and cl.ipcs[r].maps == {}


def test_a_registration_a_graph_uses_is_kept_until_close():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(8 * MiB) for r in range(2)]
    res = cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, FakeRef())])[0])
    for r in range(2):
        cl.registry(r).pin(res[r])
    cl.run(lambda r: cl.registry(r).deregister([(al[r].base, MiB)]))
    for r in range(2):
        assert cl.registry(r).lookup(al[r].base, MiB) is None   # no longer matches eager calls
        assert len(cl.ipcs[r].maps) == 1                        # but the graph's mapping stays
        assert cl.registry(r).memory()["pinned_registrations"] == 1
        cl.registry(r).close()
        assert cl.ipcs[r].maps == {}


def test_mode_off_registers_nothing_and_exchanges_nothing():
    cl = FakeCluster(2, mode="off")
    al = [cl.devices[r].alloc(8 * MiB) for r in range(2)]
    assert cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, FakeRef())])) == [[None], [None]]
    assert cl.comms[0].exchanges == []


def test_positions_without_a_local_tensor_register_nowhere():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(8 * MiB) for r in range(2)]
    res = cl.run(lambda r: cl.registry(r).register([(None, MiB, None), (al[r].base, MiB, FakeRef())]))
    for r in range(2):
        assert res[r][0] is None and res[r][1] is not None


# ------------------------------------------------------------------------------------------
# capture sessions


def _capture(cl, calls_of, fail=None, configs=None):
    """Every rank: open a session, defer ``calls_of(r)`` (in ptr, in bytes, out ptr, out bytes),
    end it; returns per rank the finish calls [(input region, output region)] and the deltas."""
    def body(r):
        reg = cl.registry(r)
        sess = reg.begin_capture(configs[r] if configs else "same")
        done, deltas = [], []
        for k, (a, na, b, nb) in enumerate(calls_of(r)):
            d = reg.defer(a, na, b, nb, f"call {k}", lambda i, o, k=k: done.append((k, i, o)))
            deltas.append(d)
        n = reg.finish_capture(failed=bool(fail and fail(r)))
        return sess.enabled, deltas, done, n

    return cl.run(body)


def test_capture_session_registers_each_captured_call_with_the_peers_buffers_of_that_call():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    base = [a.base + (r + 1) * 4096 for r, a in enumerate(al)]   # offsets differ between ranks

    def calls(r):
        b = base[r]
        return [(b, MiB, b, MiB),                      # in place
                (b + 2 * MiB, MiB, b + 4 * MiB, MiB),  # out of place
                (b + 8 * MiB + r * 512, 512, b + 8 * MiB, 1024)]   # allgather in place: input in output

    res = _capture(cl, calls)
    for r in range(2):
        enabled, deltas, done, n = res[r]
        assert enabled and n == 3
        assert deltas == [(0, 0), (0, 0), (r * 512, 0)]
        assert [k for k, _, _ in done] == [0, 1, 2]
        q = 1 - r
        for k, i, o in done:
            qa, _, qb, _ = calls(q)[k]
            assert i.graph and i.pinned and o.graph
            want_in = qb if k == 2 else qa           # allgather: the output's region
            assert _peer_targets(cl, r, i) == {q: want_in}
            assert _peer_targets(cl, r, o) == {q: qb}
        assert cl.registry(r).memory()["graph_registrations"] == 4   # calls 0 and 2 share one region
        assert cl.registry(r).lookup(base[r], MiB) is None            # graph regions never match eager calls


def test_capture_sessions_whose_calls_differ_raise_everywhere_and_complete_nothing():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]

    def calls(r):
        b = al[r].base
        return [(b, MiB, b, MiB)] * (2 if r == 0 else 1)

    with pytest.raises(RankErrors) as ei:
        _capture(cl, calls)
    assert all(isinstance(e, CallMismatch) and "abort on replay" in str(e) for e in ei.value.errors)
    for r in range(2):
        assert cl.ipcs[r].maps == {} and cl.registry(r).sessions.session is None


def test_capture_with_same_count_but_different_calls_raises():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]

    def body(r):
        reg = cl.registry(r)
        reg.begin_capture("same")
        reg.note_call("allreduce of 1024 B" if r == 0 else "allreduce of 2048 B")
        reg.defer(al[r].base, MiB, al[r].base, MiB, "x", lambda i, o: None)
        return reg.finish_capture()

    with pytest.raises(RankErrors) as ei:
        cl.run(body)
    assert all(isinstance(e, CallMismatch) for e in ei.value.errors)


def test_a_failed_capture_on_one_rank_registers_nothing_anywhere():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    with pytest.raises(RankErrors) as ei:
        _capture(cl, lambda r: [(al[r].base, MiB, al[r].base, MiB)], fail=lambda r: r == 1)
    assert all(isinstance(e, RegistrationError) for e in ei.value.errors)
    assert all(cl.ipcs[r].maps == {} for r in range(2))


def test_different_allocator_settings_disable_deferral_on_every_rank(caplog):
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    with caplog.at_level(logging.WARNING, logger="mscclang.runtime"):
        res = _capture(cl, lambda r: [(al[r].base, MiB, al[r].base, MiB)],
                       configs=["expandable_segments:True", ""])
    for r in range(2):
        enabled, deltas, done, n = res[r]
        assert not enabled and deltas == [None] and done == [] and n == 0
    assert any("allocator settings differ" in m for m in caplog.messages)


def test_unexportable_buffers_are_not_deferred():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(64 * MiB, capable=False) for r in range(2)]
    res = _capture(cl, lambda r: [(al[r].base, MiB, al[r].base, MiB)])
    assert all(x[1] == [None] and x[3] == 0 for x in res)


def test_session_misuse_is_refused():
    cl = FakeCluster(1)
    reg = cl.registry(0)
    with pytest.raises(RegistrationError, match="no graph capture session"):
        reg.finish_capture()
    reg.begin_capture("x")
    with pytest.raises(RegistrationError, match="already open"):
        reg.begin_capture("x")


def test_check_call_raises_when_ranks_resolved_buffers_differently():
    cl = FakeCluster(2)
    cl.run(lambda r: cl.registry(r).check_call("zero-copy ('reg', 0) ('reg', 0)"))
    with pytest.raises(RankErrors) as ei:
        cl.run(lambda r: cl.registry(r).check_call("staged" if r else "zero-copy ('reg', 0) ('reg', 0)"))
    assert all(isinstance(e, CallMismatch) and "corresponding tensors" in str(e) for e in ei.value.errors)


# ------------------------------------------------------------------------------------------
# the operand rule shared by the executor and the CPU back end


class _Sym:
    def __init__(self, index, base, size, internal=False):
        self.index, self.base, self.size, self.internal = index, base, size, internal
        self.peer_bases = {}


def test_zero_copy_operands_rule():
    cl = FakeCluster(1)
    reg = cl.registry(0)
    a = cl.devices[0].alloc(64 * MiB)
    sym = _Sym(3, 1 << 30, MiB)
    internal = _Sym(4, 2 << 30, MiB, internal=True)

    def sym_of(p):
        for s in (sym, internal):
            if s.base <= p < s.base + s.size:
                return s
        return None

    # nothing registered: symmetric operands only
    assert zero_copy_operands(sym_of, reg, sym.base, sym.base + 512, 256, 256) == ZeroCopy(sym, 0, sym, 512)
    assert zero_copy_operands(sym_of, reg, internal.base, internal.base, 256, 256) is None
    assert zero_copy_operands(sym_of, None, a.base, a.base, 256, 256) is None
    g = reg.register([(a.base, 4 * MiB, FakeRef())])[0]
    assert zero_copy_operands(sym_of, reg, a.base, a.base, 256, 256) == ZeroCopy(g, 0, g, 0)
    # registered output, input inside it (in-place allgather) and the reverse
    assert zero_copy_operands(sym_of, reg, a.base + MiB, a.base, MiB, 4 * MiB) == ZeroCopy(g, MiB, g, 0)
    assert zero_copy_operands(sym_of, reg, a.base, a.base + MiB, 4 * MiB, MiB) == ZeroCopy(g, 0, g, MiB)
    # one symmetric, one registered
    assert zero_copy_operands(sym_of, reg, sym.base, a.base, 256, 256) == ZeroCopy(sym, 0, g, 0)
    # an unregistered output beside a registered input
    assert zero_copy_operands(sym_of, reg, a.base, a.base + 8 * MiB, 256, 256) is None


# ------------------------------------------------------------------------------------------
# settings


def test_byte_counts_and_settings(monkeypatch):
    from mscclang.units import parse_bytes

    assert parse_bytes("1048576", "X") == MiB
    assert parse_bytes("64M", "X") == 64 * MiB
    assert parse_bytes("1GiB", "X") == 1 << 30
    assert parse_bytes("1.5k", "X") == 1536
    for bad in ("", "lots", "-1", "5 parsecs"):
        with pytest.raises(ValueError, match="X="):
            parse_bytes(bad, "X")
    monkeypatch.setenv("MSCCLANG_STAGING_CAP_BYTES", "8M")
    assert settings.staging_cap_bytes == 8 * MiB
    monkeypatch.delenv("MSCCLANG_STAGING_CAP_BYTES")
    assert settings.staging_cap_bytes == Settings.staging_cap_bytes.default
    monkeypatch.setenv("MSCCLANG_REGISTER", "sometimes")
    with pytest.raises(InvalidCall, match="MSCCLANG_REGISTER"):
        settings.register
    monkeypatch.setenv("MSCCLANG_MAX_REGISTRATIONS", "0")
    with pytest.raises(InvalidCall, match="MSCCLANG_MAX_REGISTRATIONS"):
        settings.max_registrations
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments:True" in regmod.allocator_config()


def test_record_layout_round_trips():
    from mscclang.runtime import regwire

    rec = regwire.REC.pack(1, 7, 0x1000, 4096, 64, 128, -1, b"h" * 64)
    row = regwire.read_rows(rec, 1, 0)[0]
    assert row.ok and row.buffer_id == 7 and row.offset == 64 and row.existing == -1 and row.handle == b"h" * 64
    with pytest.raises(RegistrationError):
        regwire.read_rows(rec[:-1], 1, 3)


def test_close_closes_every_mapping_once():
    cl = FakeCluster(2)
    al = [cl.devices[r].alloc(64 * MiB) for r in range(2)]
    cl.run(lambda r: cl.registry(r).register([(al[r].base, MiB, FakeRef()), (al[r].base + MiB, MiB, FakeRef())]))
    for r in range(2):
        cl.registry(r).close()
        assert cl.ipcs[r].maps == {} and len(cl.ipcs[r].closed) == 1
        assert cl.registry(r).memory() == {"registrations": 0, "registrations_released": 0, "graph_registrations": 0,
                                           "pinned_registrations": 0, "peer_mappings": 0, "peer_mapped_bytes": 0}


def test_registry_rejects_a_bad_cap():
    cl = FakeCluster(1)
    with pytest.raises(InvalidCall):
        Registry(cl.comms[0], cl.ipcs[0], max_regions=0)
