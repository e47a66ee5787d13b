"""CUDA-graph capture sessions of the registry: zero-copy calls captured on ordinary tensors that
are not registered yet are recorded while capturing, and their buffers are registered together
when the session ends (one exchange of every rank's list, in capture order, then one to agree that
every mapping opened), after which each call writes its device plan. The ranks' lists must match:
otherwise every rank raises and the captured calls keep their aborting plans."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from mscclang.errors import CallMismatch, MscclangError, RegistrationError
from mscclang.runtime.regwire import ABSENT, OK, REC, read_rows

if TYPE_CHECKING:  # pragma: no cover
    from mscclang.runtime.registration import Region, Registry


@dataclass
class Deferred:
    """A zero-copy call captured before its buffers were registered: ``buffers`` are this rank's
    (address, bytes) of the regions it needs (one when the call's input lies inside its output or
    the reverse), ``finish(input region, output region)`` writes its device plan."""

    desc: str
    buffers: tuple
    shared: int
    finish: Callable[[Region, Region], None]


@dataclass
class CaptureSession:
    """One ``graph_capture`` session: ``enabled`` when deferring registration is allowed (every
    rank runs the same allocator configuration), ``calls`` the description of every call captured
    (compared across ranks at the end), ``deferred`` the zero-copy calls waiting for registration."""

    enabled: bool
    calls: list[str] = field(default_factory=list)
    deferred: list[Deferred] = field(default_factory=list)



def deferred_buffers(in_ptr: int, in_bytes: int, out_ptr: int,
                      out_bytes: int) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """(regions to register, sharing, (input delta, output delta)) of a captured call: the input
    inside the output (``shared`` 1) or the output inside the input (2) registers one region."""
    if out_ptr <= in_ptr and in_ptr + in_bytes <= out_ptr + out_bytes:
        return [(out_ptr, out_bytes)], 1, (in_ptr - out_ptr, 0)
    if in_ptr <= out_ptr and out_ptr + out_bytes <= in_ptr + in_bytes:
        return [(in_ptr, in_bytes)], 2, (0, out_ptr - in_ptr)
    return [(in_ptr, in_bytes), (out_ptr, out_bytes)], 0, (0, 0)


class CaptureSessions:
    """The capture sessions of one :class:`~mscclang.runtime.registration.Registry` (at most one
    open at a time: ``session``)."""

    def __init__(self, registry: "Registry") -> None:
        self.reg = registry
        self.session: Optional[CaptureSession] = None

    def can_defer(self, in_ptr: int, in_bytes: int, out_ptr: int, out_bytes: int) -> bool:
        """Whether a zero-copy call on these buffers, made while capturing inside a capture session,
        is captured with registration at the session's end."""
        s = self.session
        if s is None or not s.enabled:
            return False
        return all(self.reg.exportable(p, n) for p, n in deferred_buffers(in_ptr, in_bytes, out_ptr, out_bytes)[0])

    def begin(self, config: str) -> CaptureSession:
        """Collective, outside any capture: open a capture session. Deferring registration is
        enabled when every rank runs the same allocator configuration ``config`` (else every rank
        stages instead, logged once)."""
        reg = self.reg
        if self.session is not None:
            raise RegistrationError(f"rank {reg.rank}: a graph capture session is already open; end it "
                                    "(register_graph_buffers) before starting another")
        reg.prune()
        datas = reg.comm.exchange(config.encode("utf-8", "replace"), "begin graph capture")
        same = len(set(datas)) == 1
        if not same:
            cfg = "; ".join(f"rank {q}: {d.decode('utf-8', 'replace')}" for q, d in enumerate(datas))
            reg.note("allocconf", f"mscclang rank {reg.rank}: the ranks' torch allocator settings differ ({cfg}); "
                       "calls captured in this session stage ordinary tensors instead of registering them")
        self.session = CaptureSession(enabled=same and reg.mode != "off")
        return self.session

    def note_call(self, desc: str) -> None:
        """Record a call captured in the open session (the ranks compare the lists at its end)."""
        if self.session is not None:
            self.session.calls.append(desc)

    def defer(self, in_ptr: int, in_bytes: int, out_ptr: int, out_bytes: int, desc: str,
              finish: Callable[[Region, Region], None]) -> Optional[tuple[int, int]]:
        """While capturing in an enabled session: record a zero-copy call whose buffers are
        registered at the session's end, when ``finish(input region, output region)`` is called
        to write its device plan. Returns the call's (input, output) deltas, or None when the
        buffers cannot be exported (the call must be staged)."""
        if not self.can_defer(in_ptr, in_bytes, out_ptr, out_bytes):
            return None
        bufs, shared, deltas = deferred_buffers(in_ptr, in_bytes, out_ptr, out_bytes)
        s = self.session
        if s is None:   # pragma: no cover - can_defer checked it
            return None
        s.deferred.append(Deferred(desc, tuple(bufs), shared, finish))
        s.calls.append(f"{desc} deferred{shared}")
        return deltas

    def finish(self, failed: bool = False) -> int:
        """Collective, after the capture ended: register every deferred call's buffers (one
        exchange of every rank's list, in capture order, then one to agree that every mapping
        opened) and let each call write its device plan. ``failed``: this rank's capture did not
        complete (the others are told; nothing is registered). Raises CallMismatch or
        RegistrationError (on every rank) when the ranks captured different calls or a rank could
        not export or map a buffer: those calls' slots keep their aborting plan. Returns the number
        of calls registered."""
        reg = self.reg
        s = self.session
        self.session = None
        if s is None:
            raise RegistrationError(f"rank {reg.rank}: no graph capture session is open")
        ok = not failed
        recs = bytearray()
        for d in s.deferred:
            for i in range(2):
                if i < len(d.buffers):
                    p, nb = d.buffers[i]
                    rec = reg.record(p, nb, -1)
                    ok = ok and bool(rec[0] & OK)
                else:
                    rec = REC.pack(ABSENT, 0, 0, 0, 0, 0, -1, b"")
                recs += rec
        digest = hashlib.sha1("\n".join(s.calls).encode("utf-8", "replace")).digest()
        head = struct.pack("<B7xII20s", int(ok), len(s.calls), len(s.deferred), digest)
        nd = len(s.deferred)
        try:
            datas = reg.comm.exchange(bytes(head) + bytes(recs), f"end of graph capture ({nd} call(s) to register)")
        except CallMismatch as e:
            raise CallMismatch(f"graph capture: the ranks captured different numbers of zero-copy calls; the "
                               f"captured calls abort on replay (CollectiveTimeout). {e}") from None
        hs = struct.calcsize("<B7xII20s")
        heads = [struct.unpack_from("<B7xII20s", d, 0) for d in datas]
        if not all(h[0] for h in heads):
            bad = [q for q, h in enumerate(heads) if not h[0]]
            raise RegistrationError(f"graph capture: rank(s) {bad} could not register their captured buffers (or "
                                    "their capture failed); the captured zero-copy calls abort on replay "
                                    "(CollectiveTimeout)")
        if len({(h[1], h[3]) for h in heads}) > 1:
            what = ", ".join(f"rank {q}: {h[1]} call(s)" for q, h in enumerate(heads))
            raise CallMismatch(f"graph capture: the ranks captured different calls ({what}); the captured zero-copy "
                               "calls abort on replay (CollectiveTimeout)")
        if nd == 0:
            return 0
        rows = [read_rows(d[hs:], 2 * nd, q) for q, d in enumerate(datas)]
        made: list[tuple[Region, Region]] = []
        created: list[Region] = []
        first = reg.reserve(2 * nd)   # numbers for every position, alike on every rank whatever fails here
        flag = 1
        try:
            for j, d in enumerate(s.deferred):
                regs = []
                for i in range(len(d.buffers)):
                    col = [rows[q][2 * j + i] for q in range(reg.world_size)]
                    region = reg.map_region(first + 2 * j + i, col, d.buffers[i][0], None)
                    region.graph = region.pinned = True
                    created.append(region)
                    regs.append(region)
                made.append((regs[0], regs[-1]))
        except MscclangError as e:
            reg.note("gopen", f"mscclang rank {reg.rank}: mapping a peer's captured buffer failed ({e})")
            flag = 0
        try:
            agree = reg.comm.exchange(bytes([flag]), f"end of graph capture ({nd} call(s)): mappings")
        except BaseException:
            for region in created:
                reg.unmap(region)
            raise
        if not all(a[:1] == b"\x01" for a in agree):
            for region in created:
                reg.unmap(region)
            bad = [q for q, a in enumerate(agree) if a[:1] != b"\x01"]
            raise RegistrationError(f"graph capture: rank(s) {bad} could not map their peers' captured buffers; the "
                                    "captured zero-copy calls abort on replay (CollectiveTimeout)")
        for d, (rin, rout) in zip(s.deferred, made):
            reg.kept.append(rin)
            if rout is not rin:
                reg.kept.append(rout)
            if d.shared == 1:      # the input lies in the output's region
                d.finish(rout, rout)
            elif d.shared == 2:    # the output lies in the input's region
                d.finish(rin, rin)
            else:
                d.finish(rin, rout)
        reg.stats["graph_registered"] += nd
        return nd

    def check_call(self, desc: str) -> None:
        """``MSCCLANG_CHECK_REGISTRATION``: every rank describes how it resolved the call's
        buffers; CallMismatch on every rank when they differ (one store round trip)."""
        reg = self.reg
        datas = reg.comm.exchange(desc.encode("utf-8", "replace"), "registration check")
        if len(set(datas)) > 1:
            what = ", ".join(f"rank {q}: {d.decode('utf-8', 'replace')}" for q, d in enumerate(datas))
            raise CallMismatch(f"the ranks resolved a zero-copy call's buffers differently ({what}): they did not "
                               "pass corresponding tensors")
