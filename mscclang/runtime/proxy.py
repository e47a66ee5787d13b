"""The port-channel proxy: the GPU's stream front end, driven by stream memory operations.

No host thread serves port channels. For every launch of a plan with port channels, the launching
thread enqueues, next to the kernel:

* on the caller's stream, before the kernel: a memset that zeroes the device plan's port area
  (every channel's trigger and done words), then a fork event;
* on one side stream per port channel (forked from the caller's stream), for each trigger ``t``
  the kernel will post, in order: ``cuStreamWaitValue32(trigger >= t)``, the put's copies
  (``cuMemcpyDtoDAsync`` into the peer's IPC mapping: the copy engine moves the bytes, no SM), for
  a signal the 8-byte copy of the slot the kernel wrote (its sent count) into the peer's inbound
  counter, then ``cuStreamWriteValue32(done = t)`` (which ``flush`` and ``pwsf`` wait for);
* for a peer on another node, the copies are NCCL point-to-point sends on the channel's own
  two-rank communicator (:mod:`mscclang.runtime.engine`), and the peer posts the matching receives
  (its data, then the 8-byte sent count into its inbound counter) on a receive stream of its own;
* after the kernel, the caller's stream waits for every side stream (join events).

Everything is an ordinary stream operation, so a CUDA graph captures the whole launch (kernel,
waits, copies, NCCL calls) and replays it with no host work. ``cuStreamWaitValue32`` has no
timeout: the kernel sets every trigger word to its final count when a block exits, on every path
(abort included), so no wait outlives the kernel, which itself is bounded by the timeout.

:func:`launch_ops` computes a launch's operations as data (tested on the CPU);
:class:`PortProxy` issues them through the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from mscclang.errors import PlanError, RuntimeUnavailable
from mscclang.plan.models import BufferKind
from mscclang.runtime import cuda as cu
from mscclang.runtime.ports import ChannelScript, PortScript


@dataclass(frozen=True)
class StreamOp:
    """One operation on a side stream. ``kind``: 'wait' (``a`` >= ``n``, u32), 'copy' (``n`` bytes
    from ``b`` to ``a``), 'done' (write ``n`` to u32 ``a``), 'send' (``n`` bytes at ``b`` on
    communicator ``comm``), 'recv' (``n`` bytes into ``a`` on ``comm``)."""

    kind: str
    a: int = 0
    b: int = 0
    n: int = 0
    comm: Any = None


@dataclass
class Incoming:
    """A peer's port channel that reaches this rank through the engine: the peer's script for it
    (its triggers' copies land in this rank's buffers) and where its signals land."""

    script: ChannelScript
    inbound: int        # this rank's inbound counter for that channel (device address)
    dst_kinds: Sequence[BufferKind] = ()   # per remote buffer index of the peer: which buffer of this rank
    comm: Any = None    # the channel's engine communicator


@dataclass
class Resolved:
    """Addresses of one launch: this rank's buffers and, per remote buffer index, the peer's base
    (already including the call's delta for input/output; None when the peer is on another node).
    With ``sizes`` (bytes of this rank's input, output and scratch) and ``remote_bytes`` (bytes
    from each remote base), every copy is checked to stay inside both buffers before anything is
    enqueued: a copy engine writing past a peer's buffer would corrupt whatever lies there."""

    input: int
    output: int
    scratch: int
    remote: Sequence[Optional[int]]
    sizes: Optional[tuple[int, int, int]] = None
    remote_bytes: Optional[Sequence[int]] = None


_KIND_NAME = {BufferKind.input: "input", BufferKind.output: "output", BufferKind.scratch: "scratch"}


def _local_bytes(kind: BufferKind, r: Resolved) -> Optional[int]:
    if r.sizes is None:
        return None
    return r.sizes[0] if kind == BufferKind.input else r.sizes[1] if kind == BufferKind.output else r.sizes[2]


def _check_copy(trig: Any, k: int, c: Any, r: Resolved) -> None:
    """PlanError when copy ``c`` of trigger ``trig`` (port channel ``k``) leaves this rank's source
    buffer or the peer's destination buffer."""
    have = _local_bytes(c.src, r)
    if have is not None and (c.src_off < 0 or c.src_off + c.length > have):
        raise PlanError(f"{trig.op}: port channel {k} copies {c.length} B from offset {c.src_off} of this rank's "
                        f"{_KIND_NAME.get(c.src, c.src)} buffer of {have} B: past its end")
    if r.remote_bytes is not None and 0 <= c.dst < len(r.remote_bytes):
        lim = r.remote_bytes[c.dst]
        if c.dst_off < 0 or c.dst_off + c.length > lim:
            raise PlanError(f"{trig.op}: port channel {k} copies {c.length} B to offset {c.dst_off} of the peer's "
                            f"remote buffer {c.dst} of {lim} B: past its end")


def _local(kind: BufferKind, r: Resolved) -> int:
    if kind == BufferKind.input:
        return r.input
    if kind == BufferKind.output:
        return r.output
    return r.scratch


def launch_ops(script: PortScript, area: int, r: Resolved, peer_inbound: Sequence[Optional[int]], comms: Sequence[Any],
               incoming: Sequence[Incoming]) -> list[list[StreamOp]]:
    """The side streams' operations for one launch: one list per port channel of this rank (index
    order), then one per incoming engine channel. ``area``: the device plan's port area;
    ``kinds[j]``: the buffer kind of remote buffer j as the peer sees it; ``peer_inbound[k]``:
    the peer's inbound counter of channel k (IPC mapped; None through the engine); ``comms[k]``:
    channel k's engine communicator (None on one node)."""
    streams: list[list[StreamOp]] = []
    for k, ch in enumerate(script.channels):
        blk = area + script.block_offset(k)
        ops: list[StreamOp] = []
        engine = comms[k] is not None
        for trig in ch.triggers:
            ops.append(StreamOp("wait", blk, 0, trig.t))
            for c in trig.copies:
                _check_copy(trig, k, c, r)
                src = _local(c.src, r) + c.src_off
                if engine:
                    ops.append(StreamOp("send", 0, src, c.length, comms[k]))
                else:
                    base = r.remote[c.dst]
                    if base is None:
                        raise RuntimeUnavailable(f"{trig.op}: remote buffer {c.dst} of port channel {k} has no mapping")
                    ops.append(StreamOp("copy", base + c.dst_off, src, c.length))
            if trig.slot is not None:
                slot = blk + 8 + 8 * trig.slot
                if engine:
                    ops.append(StreamOp("send", 0, slot, 8, comms[k]))
                else:
                    dst = peer_inbound[k]
                    if dst is None:
                        raise RuntimeUnavailable(f"{trig.op}: port channel {k} has no inbound counter mapped")
                    ops.append(StreamOp("copy", dst, slot, 8))
            ops.append(StreamOp("done", blk + 4, 0, trig.t))
        streams.append(ops)
    for inc in incoming:
        ops = []
        for trig in inc.script.triggers:
            for c in trig.copies:
                kind = kinds_of(inc, c.dst)
                have = _local_bytes(kind, r)
                if have is not None and (c.dst_off < 0 or c.dst_off + c.length > have):
                    raise PlanError(f"{trig.op}: rank {inc.script.peer}'s port channel sends {c.length} B to offset "
                                    f"{c.dst_off} of this rank's {_KIND_NAME.get(kind, kind)} buffer of {have} B: "
                                    "past its end")
                ops.append(StreamOp("recv", _local(kind, r) + c.dst_off, 0, c.length, inc.comm))
            if trig.slot is not None:
                ops.append(StreamOp("recv", inc.inbound, 0, 8, inc.comm))
        streams.append(ops)
    return streams


def kinds_of(inc: Incoming, dst: int) -> BufferKind:
    """The kind of this rank's buffer that the peer's remote buffer ``dst`` names."""
    kinds = inc.dst_kinds
    if not 0 <= dst < len(kinds):
        raise RuntimeUnavailable(f"internal: incoming port channel from rank {inc.script.peer} names remote buffer "
                                 f"{dst} without its kind")
    return kinds[dst]


@dataclass
class PortLaunch:
    """What a launch entry of a port plan keeps: the script, the port area, and how to resolve
    addresses per call."""

    script: PortScript
    area: int
    remote_base: Sequence[Optional[int]]  # per remote buffer: peer base (None: other node)
    remote_kind: Sequence[BufferKind]
    scratch: int
    peer_inbound: Sequence[Optional[int]]
    comms: Sequence[Any]
    incoming: Sequence[Incoming] = field(default_factory=list)
    #: (input, output, scratch) bytes of every rank at this size (None: copies are not checked)
    bounds: Optional[tuple[int, int, int]] = None
    #: this rank's abort word (a failed launch sets it, so the peers stop waiting for it)
    abort_word: int = 0
    _last: Any = field(default=None, repr=False)

    def ops(self, in_ptr: int, out_ptr: int, in_delta: int, out_delta: int) -> list[list[StreamOp]]:
        """The launch's stream operations (:func:`launch_ops`), kept for the last buffers: a
        repeated eager call on the same tensors computes nothing."""
        key = (in_ptr, out_ptr, in_delta, out_delta)
        if self._last is None or self._last[0] != key:
            self._last = (key, launch_ops(self.script, self.area, self.resolve(*key), self.peer_inbound,
                                          self.comms, self.incoming))
        return self._last[1]

    def resolve(self, in_ptr: int, out_ptr: int, in_delta: int, out_delta: int) -> Resolved:
        rem: list[Optional[int]] = []
        for base, kind in zip(self.remote_base, self.remote_kind):
            if base is None:
                rem.append(None)
            elif kind == BufferKind.input:
                rem.append(base + in_delta)
            elif kind == BufferKind.output:
                rem.append(base + out_delta)
            else:
                rem.append(base)
        if self.bounds is None:
            return Resolved(in_ptr, out_ptr, self.scratch, rem)
        nin, nout, nscr = self.bounds
        lim = [nin if k == BufferKind.input else nout if k == BufferKind.output else nscr for k in self.remote_kind]
        return Resolved(in_ptr, out_ptr, self.scratch, rem, self.bounds, lim)


class PortProxy:
    """Issues port launches through the driver: side streams and events of one executor.
    ``send``/``recv``: the engine's point-to-point calls ``f(ptr, nbytes, comm, stream)``."""

    def __init__(self, send: Optional[Callable] = None, recv: Optional[Callable] = None) -> None:
        self._streams: list[Any] = []
        self._joins: list[Any] = []
        self._fork: Any = None
        self._send = send
        self._recv = recv
        self.enqueued = 0     # stream operations issued so far (for tests and the notes)

    def _ensure(self, n: int) -> None:
        drv = cu.driver()
        if self._fork is None:
            self._fork = cu.check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        while len(self._streams) < n:
            s = cu.check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
            e = cu.check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            self._streams.append(s)
            self._joins.append(e)

    def prepare(self, n_streams: int) -> None:
        """Create the side streams and events up front (never inside a graph capture)."""
        self._ensure(n_streams)

    def before(self, pl: PortLaunch, stream: int, in_ptr: int, out_ptr: int, in_delta: int,
               out_delta: int) -> int:
        """Zero the port area, fork and fill the side streams; returns how many streams to join."""
        drv = cu.driver()
        ops = pl.ops(in_ptr, out_ptr, in_delta, out_delta)
        if len(self._streams) < len(ops):
            raise RuntimeUnavailable("internal: port side streams were not prepared before the launch")
        cu.check(drv.cuMemsetD32Async(pl.area, 0, pl.script.area_bytes // 4, stream), "cuMemsetD32Async")
        cu.check(drv.cuEventRecord(self._fork, stream), "cuEventRecord")
        geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        wdef = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        n = 0
        for i, lst in enumerate(ops):
            s = self._streams[i]
            cu.check(drv.cuStreamWaitEvent(s, self._fork, 0), "cuStreamWaitEvent")
            for o in lst:
                if o.kind == "wait":
                    cu.check(drv.cuStreamWaitValue32(s, o.a, o.n, geq), "cuStreamWaitValue32")
                elif o.kind == "copy":
                    cu.check(drv.cuMemcpyDtoDAsync(o.a, o.b, o.n, s), "cuMemcpyDtoDAsync")
                elif o.kind == "done":
                    cu.check(drv.cuStreamWriteValue32(s, o.a, o.n, wdef), "cuStreamWriteValue32")
                elif o.kind == "send":
                    if self._send is None:
                        raise RuntimeUnavailable("a port channel to another node needs the engine (nccl4py)")
                    self._send(o.b, o.n, o.comm, cu.ptr(s))
                elif o.kind == "recv":
                    if self._recv is None:
                        raise RuntimeUnavailable("a port channel from another node needs the engine (nccl4py)")
                    self._recv(o.a, o.n, o.comm, cu.ptr(s))
            self.enqueued += len(lst)
            n = i + 1
        return n

    def side_streams(self) -> list[Any]:
        """The side streams (for a bounded wait on them)."""
        return list(self._streams)

    def release(self, pl: PortLaunch, stream: int) -> None:
        """After a launch that failed on the host (an error while enqueuing, or the kernel's launch
        itself): do on ``stream`` what an aborting kernel does at exit, so that no side-stream
        wait of this launch outlives it (``cuStreamWaitValue32`` has no timeout): every channel's
        trigger word gets its final count, and this rank's abort word is set, so the peers' kernels
        stop waiting for this one (the executor then needs the collective reset, as after a
        timeout). Best effort: errors here are not raised over the original one."""
        drv = cu.driver()
        wdef = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        for k, ch in enumerate(pl.script.channels):
            final = max((t.t for t in ch.triggers), default=0)
            if final:
                drv.cuStreamWriteValue32(stream, pl.area + pl.script.block_offset(k), final, wdef)
        if pl.abort_word:
            drv.cuStreamWriteValue32(stream, pl.abort_word, 1, wdef)

    def after(self, stream: int, n: int) -> None:
        """Join the side streams back into the caller's stream."""
        drv = cu.driver()
        for i in range(n):
            cu.check(drv.cuEventRecord(self._joins[i], self._streams[i]), "cuEventRecord")
            cu.check(drv.cuStreamWaitEvent(stream, self._joins[i], 0), "cuStreamWaitEvent")

    def close(self) -> None:
        """Destroy the side streams and events (after the GPU finished with them)."""
        drv = cu.driver()
        for s in self._streams:
            drv.cuStreamDestroy(s)
        for e in self._joins:
            drv.cuEventDestroy(e)
        if self._fork is not None:
            drv.cuEventDestroy(self._fork)
        self._streams.clear()
        self._joins.clear()
        self._fork = None
