"""Registration of ordinary tensors for zero-copy plans (the contract: "The consistency rule" below;
settings: docs/settings.md).

Zero-copy plans read and write the peers' input and output buffers directly. Symmetric buffers
(``Communicator.empty``) satisfy them by construction. Any other tensor (torch's caching
allocator, a CUDA-graph pool) can be *registered*: the allocation holding it (the
``cuMemGetAddressRange`` base) is exported through legacy CUDA IPC, every peer maps it once
(mappings are cached by (peer, ``CU_POINTER_ATTRIBUTE_BUFFER_ID``), never by address: torch reuses
addresses after ``empty_cache``, and a new allocation at an old address has a new id), and every
rank learns where each peer's tensor lies in that mapping. A registration (:class:`Region`) then
plays the part of a symmetric allocation: a kernel reaches peer ``q``'s buffer at
``peer_bases[q] + delta``, ``delta`` being the call's offset inside this rank's registered tensor
(0 unless the call's input lies inside its output, as in an in-place allgather).

The consistency rule
--------------------
Every rank must take the same path for a call (zero-copy or not; exchange or not), and no rank
may ever use a peer address where the peer's buffer does not live now. Hence:

1. **Registration happens only at collective points**: :meth:`Registry.register` (called by
   ``Communicator.register``, ``Communicator.prepare`` and the automatic eager schedule of
   :mod:`mscclang.comm.communicator`) and the end of a graph-capture session
   (:meth:`Registry.finish_capture`). Each is one store exchange in which every rank describes its
   tensor at each position; a position becomes registration number ``seq`` (one counter, advanced
   alike on every rank) only when every rank's tensor can be exported, and a second exchange
   confirms that every rank mapped every peer's. Otherwise the position is registered nowhere
   (and a one-time log line says why, e.g. an expandable-segments allocation).
2. **A registration belongs to a tensor's storage, not to an address.** It holds a weak
   reference to the storage and matches a call's tensor only while that storage is alive and the
   tensor starts at the registered address (no larger than registered). While a storage lives no
   other tensor can occupy its bytes, so a match means "the very tensor this rank registered at
   step ``seq``". An address that comes back for a new tensor after the old one died
   (caching-allocator reuse) never matches, on any rank.
3. Therefore a call runs zero-copy on registration ``seq`` on a rank exactly when it passes the
   tensor it registered at ``seq``: in an SPMD program (each rank passes its corresponding tensor,
   the assumption every collective library makes, and the one symmetric buffers already rely on)
   that holds on all ranks or on none. ``MSCCLANG_CHECK_REGISTRATION=1`` verifies it on every
   call through the store (a debugging aid: one store round trip per call).
4. Registrations are dropped collectively: ``deregister``, and the least recently used beyond
   ``MSCCLANG_MAX_REGISTRATIONS`` (use is stamped per registration step, alike on every rank).
   A rank whose registered storage died releases that registration's local resources early (its
   mappings of the peers' allocations, its device plans): it can never match there again. IPC
   mappings are reference-counted per (peer, buffer id) and closed with the last registration
   that uses them.
5. **CUDA graphs**: nothing here allocates or calls an IPC API inside a capture. Inside a capture
   session (``Communicator.graph_capture()``), a zero-copy call on exportable, unregistered tensors
   is captured with a device plan in a slot of an arena allocated before the capture; the slot's
   peer addresses are written when the session ends, after one exchange of every rank's buffers in
   capture order. Until then, and for good when the ranks captured different calls or a mapping
   failed, the slot holds a plan that aborts at once (the replay raises ``CollectiveTimeout``,
   never touching a peer). Whether a tensor is exportable is decided per rank from its allocation;
   the session's start checks that every rank runs the same allocator configuration, and its end
   compares the captured calls, so ranks that decided differently are caught before any replay.
   Registrations and staging used by a captured graph are kept until ``close()``.

Environment: ``MSCCLANG_REGISTER`` (``auto``: the collective API registers on its own schedule,
the designed default; ``off`` is the default of this release until registration has run on GPUs;
``explicit``: only ``register``/``prepare``/graph capture; ``off``: never, ordinary
tensors are staged), ``MSCCLANG_MAX_REGISTRATIONS`` (default 64), ``MSCCLANG_STAGING_CAP_BYTES``
(staging kept between calls; designed default 128 MiB, no cap in this release until validated on
GPUs: larger staging is released after its call),
``MSCCLANG_GRAPH_ARENA_BYTES`` (device-plan arena per capture session, default 4 MiB),
``MSCCLANG_CHECK_REGISTRATION``. Every rank must use the same settings.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Sequence

from mscclang.config import Settings, settings
from mscclang.errors import InvalidCall, MscclangError, RegistrationError
from mscclang.runtime.cuda import AllocInfo, CudaIpc  # noqa: F401 - AllocInfo: the registry's fakes use it
from mscclang.runtime.regwire import OK, REC, Row, read_rows
from mscclang.runtime.sessions import CaptureSession, CaptureSessions

log = logging.getLogger("mscclang.runtime")

#: bytes per device-plan slot of a capture arena: every slot starts with an aborting plan header
#: and room for the block table of the largest grid (16 KiB holds 2000 block entries)
ARENA_STRIDE = 16 << 10


def allocator_config() -> str:
    """torch's allocator settings of this process, as the ranks compare them before a capture
    session (a rank with expandable segments cannot export what its peers can)."""
    return (f"PYTORCH_CUDA_ALLOC_CONF={settings.pytorch_cuda_alloc_conf or ''}|"
            f"PYTORCH_ALLOC_CONF={settings.pytorch_alloc_conf or ''}")


# ------------------------------------------------------------------------------------------
# registrations


class BufferName(NamedTuple):
    """What a buffer is to zero-copy plans (``CaptureGlue.classify``, the executor's cache keys):
    ``kind`` 'sym' (a caller's symmetric allocation), 'internal' (the runtime's staging) or 'reg'
    (a registration), and ``index``: the allocation's index or the registration's ``seq``. A
    NamedTuple, not a dataclass: it is hashed in every memo and launch-entry lookup, and a
    tuple's hash is the interpreter's own (no Python-level ``__hash__`` call)."""

    kind: str
    index: int


@dataclass(eq=False)
class Region:
    """One registered tensor, as this rank sees it: ``base``/``size`` of its bytes here, the
    ``buffer_id`` of the allocation holding them, and ``peer_bases[q]``: where peer ``q``'s
    corresponding tensor starts in this process (this rank's own base for itself). ``seq`` is the
    registration's number, the same on every rank; :attr:`index` names it in the executor's caches
    (never equal to a symmetric allocation's integer index). ``ref``: weak reference to the
    tensor's storage (None for graph registrations, which a captured graph owns); ``graph``:
    registered at the end of a capture session; ``pinned``: used by a captured graph, so kept until
    close; ``last``: when it was last used, counted in registration steps (twice the step when
    registered or named again there, plus one when a call used it after that step): the eviction
    order, alike on every rank; ``uses``: launches that ran on it (the automatic schedule registers
    more eagerly for a call signature whose registrations get reused)."""

    seq: int
    base: int
    size: int
    buffer_id: int
    peer_bases: dict[int, int]
    ref: Any = None
    graph: bool = False
    pinned: bool = False
    last: int = 0
    released: bool = False
    keys: list = field(default_factory=list)
    uses: int = 0
    internal: ClassVar[bool] = False

    @cached_property
    def index(self) -> BufferName:
        """This registration's name in the executor's caches (made once: ``seq`` never changes)."""
        return BufferName("reg", self.seq)

    def alive(self) -> bool:
        """Whether the registered storage still lives here and the registration is not released."""
        ref = self.ref
        return not self.released and (ref is None or not ref.expired())


@dataclass
class _Mapping:
    addr: int
    size: int
    refs: int = 0


def _inside(p: int, n: int, obj: Any) -> bool:
    return obj.base <= p and p + n <= obj.base + obj.size


@dataclass(frozen=True, slots=True)
class ZeroCopy:
    """How a zero-copy plan reaches a call's buffers: each a symmetric allocation (never the
    runtime's internal staging) or a live :class:`Region`, the call's tensor at ``in_delta`` /
    ``out_delta`` bytes from its base."""

    in_buf: Any
    in_delta: int
    out_buf: Any
    out_delta: int


def zero_copy_operands(sym_of: Callable[[int], Any], registry: Optional["Registry"],
                       in_ptr: int, out_ptr: int, in_bytes: int, out_bytes: int) -> Optional[ZeroCopy]:
    """How a zero-copy plan reaches the buffers of a call (:class:`ZeroCopy`); None when either
    operand is neither symmetric nor registered (the call must be staged). ``sym_of(p)`` is
    :meth:`mscclang.runtime.bootstrap.Communicator.symmetric_of`. A registered tensor matches when the
    call's tensor starts at its base (no larger); an input inside the output's registered tensor
    (in-place allgather), or an output inside the input's (in-place reduce-scatter), uses that one.
    Shared by the executor and the CPU test back end, so both decide alike."""

    def one(p: int, n: int) -> Any:
        s = sym_of(p)
        if s is not None:
            return None if getattr(s, "internal", False) else s
        return None if registry is None else registry.lookup(p, n)

    a = one(in_ptr, in_bytes)
    b = a if (out_ptr == in_ptr and out_bytes == in_bytes) else one(out_ptr, out_bytes)
    if a is None and b is not None and _inside(in_ptr, in_bytes, b):
        a = b
    if b is None and a is not None and _inside(out_ptr, out_bytes, a):
        b = a
    if a is None or b is None:
        return None
    return ZeroCopy(a, in_ptr - a.base, b, out_ptr - b.base)


class Registry:
    """This rank's registrations of ordinary tensors (see the module docstring for the rule).

    ``comm`` needs ``rank``, ``world_size`` and ``exchange(data, tag) -> [bytes by rank]`` (a
    :class:`mscclang.runtime.bootstrap.Communicator`); ``ipc`` the methods of :class:`CudaIpc`.
    ``on_release`` callbacks get the regions about to be released (after the device finished its
    work), so the executor can drop its device plans for them first."""

    def __init__(self, comm: Any, ipc: Any = None, *, mode: Optional[str] = None,
                 max_regions: Optional[int] = None, verify: Optional[bool] = None) -> None:
        self.comm = comm
        self.ipc = ipc if ipc is not None else CudaIpc()
        self.mode = Settings.register.or_env(mode)
        self.max_regions = settings.max_registrations if max_regions is None else int(max_regions)
        if self.max_regions < 1:
            raise InvalidCall(f"max_regions must be positive, got {self.max_regions}")
        self.verify = settings.check_registration if verify is None else bool(verify)
        self.on_release: list[Callable[[list[Region]], None]] = []
        self.sessions = CaptureSessions(self)
        self._table: dict[int, Region] = {}     # eager registrations by seq: the same seqs on every rank
        #: usable eager registrations by base address (this rank); others only test it (empty: no
        #: registration can match, the memo hit's cheap test) and read it through :meth:`lookup`
        self.by_base: dict[int, Region] = {}
        self.kept: list[Region] = []           # graph registrations, and evicted ones a graph pins
        self._maps: dict[tuple[int, int], _Mapping] = {}   # (peer, peer's buffer id) -> mapping here
        self._seq = 0
        self._epoch = 0
        self._logged: set[str] = set()
        self.stats = {"registered": 0, "reused": 0, "refused": 0, "evicted": 0, "released": 0,
                      "graph_registered": 0}

    # -------------------------------------------------------------------------------- queries
    @property
    def rank(self) -> int:
        return int(self.comm.rank)

    @property
    def world_size(self) -> int:
        return int(self.comm.world_size)

    def lookup(self, ptr: int, nbytes: int) -> Optional[Region]:
        """The live registration of the tensor at ``ptr`` (``nbytes`` long), or None. The hot path:
        a dict look-up and a weak-reference check."""
        r = self.by_base.get(ptr)
        if r is None or nbytes > r.size:
            return None
        ref = r.ref
        if ref is not None and ref.expired():
            return None
        r.last = 2 * self._epoch + 1   # used after the latest registration step
        return r

    def exportable(self, ptr: int, nbytes: int) -> bool:
        """Whether the tensor at ``ptr`` could be registered (its allocation can be exported)."""
        try:
            info = self.ipc.describe(ptr)
        except MscclangError as e:
            self.note("describe", f"mscclang rank {self.rank}: a tensor at {ptr:#x} cannot be registered ({e}); "
                       "zero-copy plans stage it")
            return False
        if not info.ipc_capable:
            self._note_unexportable(info)
            return False
        return info.base <= ptr and ptr + nbytes <= info.base + info.size

    def register(self, items: Sequence[tuple[Optional[int], int, Any]],
                 what: str = "register") -> list[Optional[Region]]:
        """Collective: register ``items`` (``(address, bytes, storage weak reference)``; address
        None for a position this rank cannot register, e.g. a symmetric buffer). Every rank passes
        the same number of items with the same sizes (else CallMismatch on every rank). Returns the
        registration of each position, or None where it is not registered (on every rank alike).
        A position whose tensors are already registered under one number on every rank keeps it;
        otherwise a new number is given and every earlier registration any rank named there is
        dropped. Never call it inside a CUDA graph capture."""
        n = len(items)
        if n == 0 or self.mode == "off":
            return [None] * n
        self.prune()
        recs = []
        for ptr, nbytes, _ in items:
            old = self._existing(ptr, nbytes) if ptr is not None else None
            recs.append(self.record(ptr, nbytes, old.seq if old is not None else -1))
        sizes = ", ".join(str(int(b)) for _, b, _ in items)
        tag = f"{what} of {n} buffer(s) ({sizes} B)"
        datas = self.comm.exchange(b"".join(recs), tag)
        table = [read_rows(d, n, q) for q, d in enumerate(datas)]
        self._epoch += 1
        out: list[Optional[Region]] = [None] * n
        evict: set[int] = set()
        new: list[tuple[int, int, list[Row]]] = []
        for k in range(n):
            col = [table[q][k] for q in range(self.world_size)]
            seen = {c.existing for c in col}
            if all(c.ok for c in col) and len(seen) == 1 and -1 not in seen:
                reg = self._table.get(seen.pop())
                if reg is None:
                    raise RegistrationError(f"rank {self.rank}: registration {col[0].existing} is unknown here")
                reg.last = 2 * self._epoch
                out[k] = reg
                self.stats["reused"] += 1
                continue
            evict.update(e for e in seen if e >= 0)
            if not all(c.ok for c in col):
                bad = [q for q, c in enumerate(col) if not c.ok]
                self.stats["refused"] += 1
                if self.rank not in bad:   # a rank that cannot export logged why already
                    self.note(f"refused{bad}", f"mscclang rank {self.rank}: a {col[self.rank].nbytes}-byte tensor is "
                               f"not registered: rank(s) {bad} cannot export theirs (see their log); zero-copy plans "
                               "stage it")
                continue
            new.append((k, self._seq, col))
            self._seq += 1
        if evict:
            for k in range(n):   # a registration named at one position and dropped at another
                if out[k] is not None and out[k].seq in evict:
                    out[k] = None
            self._evict(evict)
        made: dict[int, Region] = {}
        flags = bytearray()
        for k, seq, col in new:
            try:
                made[k] = self.map_region(seq, col, items[k][0], items[k][2])
                flags.append(1)
            except MscclangError as e:
                self.note("open", f"mscclang rank {self.rank}: mapping a peer's registered tensor failed ({e}); "
                           "zero-copy plans stage it")
                flags.append(0)
        if new:
            try:
                agree = self.comm.exchange(bytes(flags), tag + ": mappings")
            except BaseException:
                for reg in made.values():
                    self.unmap(reg)
                raise
            for j, (k, seq, col) in enumerate(new):
                reg = made.get(k)
                if reg is not None and all(len(a) > j and a[j] == 1 for a in agree):
                    reg.last = 2 * self._epoch
                    self._table[seq] = reg
                    out[k] = reg
                    self.stats["registered"] += 1
                elif reg is not None:
                    self.unmap(reg)
        self._enforce_cap()
        self._rebuild()
        return out

    def deregister(self, items: Sequence[tuple[Optional[int], int]]) -> int:
        """Collective: drop the registrations of these tensors (every rank passes its
        corresponding ones, the same count). Returns how many registrations were dropped."""
        n = len(items)
        if n == 0 or self.mode == "off":
            return 0
        mine = []
        for ptr, nbytes in items:
            r = self._existing(ptr, nbytes, alive=False) if ptr is not None else None
            mine.append(r.seq if r is not None else -1)
        datas = self.comm.exchange(struct.pack(f"<{n}q", *mine), f"deregister {n} buffer(s)")
        seqs = set()
        for d in datas:
            seqs.update(s for s in struct.unpack(f"<{n}q", d[:8 * n]) if s >= 0)
        before = len(self._table)
        self._evict(seqs)
        self._rebuild()
        return before - len(self._table)

    def prune(self) -> int:
        """Release the local resources of registrations whose storage died here (not collective:
        such a registration can never match on this rank again). Returns how many."""
        dead = [r for r in self._table.values()
                if not r.released and not r.pinned and r.ref is not None and r.ref.expired()]
        self._release(dead)
        if dead:
            self._rebuild()
        return len(dead)

    def uses(self, seq: int) -> int:
        """Launches that ran on registration ``seq`` (0 once it is dropped)."""
        r = self._table.get(seq)
        return r.uses if r is not None and not r.released else 0

    def pin(self, *regions: Region) -> None:
        """Keep ``regions`` until close (a captured graph uses them)."""
        for r in regions:
            if isinstance(r, Region):
                r.pinned = True

    # -------------------------------------------------------------------------------- graph capture
    def begin_capture(self, config: str) -> CaptureSession:
        """Collective: open a capture session (:meth:`CaptureSessions.begin`)."""
        return self.sessions.begin(config)

    def note_call(self, desc: str) -> None:
        """Record a call captured in the open session."""
        self.sessions.note_call(desc)

    def can_defer(self, in_ptr: int, in_bytes: int, out_ptr: int, out_bytes: int) -> bool:
        """Whether a zero-copy call on these buffers is captured with registration at the end."""
        return self.sessions.can_defer(in_ptr, in_bytes, out_ptr, out_bytes)

    def defer(self, in_ptr: int, in_bytes: int, out_ptr: int, out_bytes: int, desc: str,
              finish: Callable[[Region, Region], None]) -> Optional[tuple[int, int]]:
        """Record a zero-copy call whose buffers are registered at the session's end."""
        return self.sessions.defer(in_ptr, in_bytes, out_ptr, out_bytes, desc, finish)

    def finish_capture(self, failed: bool = False) -> int:
        """Collective, after the capture: register the session's buffers (:meth:`CaptureSessions.finish`)."""
        return self.sessions.finish(failed)

    def check_call(self, desc: str) -> None:
        """``MSCCLANG_CHECK_REGISTRATION``: compare how the ranks resolved a call's buffers."""
        self.sessions.check_call(desc)

    def reserve(self, n: int) -> int:
        """``n`` registration numbers, alike on every rank; the first."""
        first = self._seq
        self._seq += n
        return first

    # -------------------------------------------------------------------------------- report, close
    def memory(self) -> dict[str, int]:
        """``registrations`` (usable eager ones), ``registrations_released`` (storage died here,
        slot kept until dropped collectively), ``graph_registrations``, ``pinned_registrations``
        (kept for captured graphs), ``peer_mappings`` and ``peer_mapped_bytes`` (the peers'
        allocations mapped here: the peers' memory, which these mappings keep alive)."""
        regs = list(self._table.values())
        return {
            "registrations": sum(1 for r in regs if not r.released),
            "registrations_released": sum(1 for r in regs if r.released),
            "graph_registrations": sum(1 for r in self.kept if r.graph),
            "pinned_registrations": sum(1 for r in regs + self.kept if r.pinned),
            "peer_mappings": len(self._maps),
            "peer_mapped_bytes": sum(m.size for m in self._maps.values()),
        }

    def close(self) -> None:
        """Close every mapping (the device must be idle) and forget every registration."""
        for m in self._maps.values():
            try:
                self.ipc.close(m.addr)
            except MscclangError:
                pass
        self._maps.clear()
        for r in list(self._table.values()) + self.kept:
            r.released = True
            r.keys = []
        self._table.clear()
        self.by_base.clear()
        self.kept.clear()
        self.sessions.session = None

    # -------------------------------------------------------------------------------- internals
    def _existing(self, ptr: int, nbytes: int, alive: bool = True) -> Optional[Region]:
        r = self.by_base.get(ptr)
        if r is None or r.size != nbytes or (alive and not r.alive()):
            return None
        return r

    def record(self, ptr: Optional[int], nbytes: int, existing: int) -> bytes:
        """This rank's packed description of the tensor at ``ptr`` (not ok when it cannot be
        exported, the reason logged once)."""
        if ptr is None:
            return REC.pack(0, 0, 0, 0, 0, int(nbytes), existing, b"")
        try:
            info = self.ipc.describe(ptr)
        except MscclangError as e:
            self.note("describe", f"mscclang rank {self.rank}: a tensor at {ptr:#x} cannot be registered ({e}); "
                       "zero-copy plans stage it")
            return REC.pack(0, 0, 0, 0, 0, int(nbytes), existing, b"")
        if not info.ipc_capable:
            self._note_unexportable(info)
            return REC.pack(0, info.buffer_id, info.base, info.size, 0, int(nbytes), existing, b"")
        if not _inside(ptr, nbytes, info):
            return REC.pack(0, info.buffer_id, info.base, info.size, 0, int(nbytes), existing, b"")
        try:
            handle = self.ipc.export(info.base)
        except MscclangError as e:
            self.note("export", f"mscclang rank {self.rank}: exporting an allocation failed ({e}); zero-copy "
                       "plans stage its tensors")
            return REC.pack(0, info.buffer_id, info.base, info.size, 0, int(nbytes), existing, b"")
        return REC.pack(OK, info.buffer_id, info.base, info.size, ptr - info.base, int(nbytes), existing,
                         bytes(handle)[:64])

    def map_region(self, seq: int, col: list[Row], ptr: Optional[int], ref: Any) -> Region:
        """A region for position ``col`` (every rank's row), mapping each peer's allocation (once
        per (peer, buffer id)). Undoes its own mappings when one fails."""
        me = col[self.rank]
        if ptr is None:
            raise RegistrationError(f"rank {self.rank}: internal: no local tensor at a registered position")
        reg = Region(seq, ptr, me.nbytes, me.buffer_id, {self.rank: ptr}, ref=ref)
        try:
            for q, row in enumerate(col):
                if q == self.rank:
                    continue
                key = (q, row.buffer_id)
                m = self._maps.get(key)
                if m is None:
                    m = _Mapping(self.ipc.open(row.handle), row.alloc_size)
                    self._maps[key] = m
                m.refs += 1
                reg.keys.append(key)
                reg.peer_bases[q] = m.addr + row.offset
        except BaseException:
            self.unmap(reg)
            raise
        return reg

    def unmap(self, reg: Region) -> None:
        for key in reg.keys:
            m = self._maps.get(key)
            if m is None:
                continue
            m.refs -= 1
            if m.refs <= 0:
                del self._maps[key]
                self.ipc.close(m.addr)
        reg.keys = []

    def _release(self, regs: list[Region]) -> None:
        """Release the local resources of ``regs`` once the device is idle: the executor's device
        plans for them (``on_release``), then their mappings."""
        regs = [r for r in regs if not r.released]
        if not regs:
            return
        self.ipc.synchronize()
        for cb in list(self.on_release):
            cb(regs)
        for r in regs:
            self.unmap(r)
            r.released = True
        self.stats["released"] += len(regs)

    def _evict(self, seqs: set[int]) -> None:
        """Collectively decided: drop registrations ``seqs`` from the table (a pinned one keeps its
        resources until close)."""
        gone = []
        for s in sorted(seqs):
            reg = self._table.pop(s, None)
            if reg is None:
                continue
            self.stats["evicted"] += 1
            if reg.pinned:
                self.kept.append(reg)
            else:
                gone.append(reg)
        self._release(gone)
        self._rebuild()

    def _enforce_cap(self) -> None:
        while len(self._table) > self.max_regions:
            victim = min(self._table.values(), key=lambda r: (r.last, r.seq))
            self._evict({victim.seq})

    def _rebuild(self) -> None:
        """``by_base`` from the table: the newest usable registration at each base."""
        self.by_base = {}
        for s in sorted(self._table):
            r = self._table[s]
            if not r.released:
                self.by_base[r.base] = r

    def note(self, key: str, message: str) -> None:
        if key in self._logged:
            return
        self._logged.add(key)
        log.warning("%s", message)

    def _note_unexportable(self, info: AllocInfo) -> None:
        self.note("unexportable", f"mscclang rank {self.rank}: ordinary tensors in {info.why or 'this allocation'} "
                   "cannot be registered; zero-copy plans stage them through the communicator's scratch "
                   "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False registers them)")
