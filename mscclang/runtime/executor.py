"""The GPU executor: runs a plan on the caller's current torch stream through the interpreter
kernel or, for small messages, a kernel specialised to the plan (design §5, §7;
:mod:`mscclang.runtime.spec_source`). Both kernels keep the same flags, scratch halves, counters
and abort protocol, so they can take turns on one context launch by launch.

Per loaded plan a *context* holds the scratch, the sync area (abort word, flags, channel counters,
semaphores, barrier counters) and the peers' IPC mappings of both; device plans are cached per
message size. Every cache decision depends only on (plan, sizes, dtype, packet type, reduce op),
which all ranks share, so every rank takes the same collective steps in the same order.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

from mscclang.errors import CollectiveTimeout, InvalidCall, NotPrepared, PlanError, RuntimeUnavailable
from mscclang.plan.models import BufferKind, ChannelType, Plan, REDUCE_OPS
from mscclang.runtime import cuda as cu
from mscclang.runtime.build import block_variant, build_module, find_prebuilt, kernel_name
from mscclang.runtime.comm import Communicator
from mscclang.runtime.device_plan import (
    KIND_CODE, MAX_FLAGS, SYNC_ABORT_OFF, SYNC_FLAGS_OFF, Addresses, SyncLayout, check_runnable,
    group_scratch_bytes, inbound_slots, mapped_peers, memory_channel_ordinals, pack_blob, pack_blocks, sync_layout,
)
from mscclang.runtime.registration import (
    ARENA_STRIDE, Region, allocator_config, graph_arena_bytes, staging_cap_bytes, zero_copy_operands,
)
from mscclang.runtime.spec_build import SpecBuilder, pack_args, spec_hot_calls, spec_mode, when
from mscclang.runtime.spec_source import SpecUnsupported, generate
from mscclang.runtime.structs import CONSTANTS, ERROR_RECORD, PLAN_HEADER
from mscclang.runtime.engine import Engine, bindings as engine_bindings
from mscclang.runtime.ports import port_inbound_slots, port_peers
from mscclang.runtime.proxy import Incoming, PortLaunch, PortProxy
from mscclang.runtime.topology import topology_from_env
from mscclang.runtime.watchdog import AbortWatchdog

log = logging.getLogger("mscclang.runtime")

DEFAULT_TIMEOUT_S = 30.0
_WHAT = {1: "a signal", 2: "LL packets", 3: "a barrier", 4: "a semaphore", 5: "nothing (a peer or another "
         "block aborted)", 6: "a port channel's proxy to finish its copies (flush)"}


def torch_dtype_code(dtype: Any) -> str:
    import torch

    m = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.int32: "i32"}
    if dtype not in m:
        raise InvalidCall(f"dtype {dtype} is not supported; use float16, bfloat16, float32 or int32")
    return m[dtype]


def plan_reduce_op(plan: Plan) -> str:
    """The plan's reduce op: ``plan.reduce_op``, else the ops' (they must agree), else sum."""
    if plan.reduce_op is not None:
        return plan.reduce_op.value
    seen: set[str] = set()
    for g in plan.gpus:
        for tb in g.threadblocks:
            for op in tb.ops:
                for o in (op.ops or [op]):
                    if o.name in REDUCE_OPS and o.reduce_op is not None:
                        seen.add(o.reduce_op.value)
    if len(seen) > 1:
        raise PlanError(f"the plan's reductions disagree on the reduce op ({sorted(seen)}); set plan.reduce_op "
                        "or pass reduce_op= at launch")
    return seen.pop() if seen else "sum"


def _packet_code(p: Any) -> str:
    if p is None:
        return "ll16"
    s = getattr(p, "value", p)
    s = str(s).lower()
    if s not in ("ll16", "ll8"):
        raise RuntimeUnavailable(f"unknown packet type {p!r}; use 'LL16' or 'LL8'")
    return s


def _reduce_code(r: Any) -> str:
    s = str(getattr(r, "value", r)).lower()
    if s not in ("sum", "min", "max"):
        raise RuntimeUnavailable(f"unknown reduce op {r!r}; use sum, min or max")
    return s


@dataclass
class _DevPlan:
    blob: int
    nbytes: int
    n_blocks: int
    smem: int
    packet_align: int
    uses_packets: bool
    packed: Any = None       # PackedRank (the specialised kernel's source comes from it)
    addr: Any = None         # Addresses (the specialised kernel's parameters)
    port_area: int = 0       # device port area (port channels: triggers, done words, signal slots)


@dataclass
class _Spec:
    """A loaded specialised kernel of one (plan, sizes, dtype, packet type, reduce op)."""

    func: Any
    fh: int
    n_blocks: int
    nthreads: int
    steps: int
    origin: str          # 'prebuilt', 'cache' or 'nvrtc'
    name: str
    layout: Any          # spec_source.ArgsLayout


@dataclass
class _SpecLaunch:
    """What one launch of a specialised kernel needs: the function and its parameter struct (the
    first five u64 words are written per launch)."""

    spec: _Spec
    args: Any
    param_addr: int
    keep: Any


@dataclass
class _Context:
    """Scratch + sync area of one loaded plan on this rank, with peers' mappings."""

    sync: SyncLayout
    sync_base: int
    scratch_base: int
    scratch_bytes: int
    peer_sync: dict[int, int]
    peer_scratch: dict[int, int]
    plans: dict[tuple, _DevPlan] = field(default_factory=dict)
    serial: int = 0          # engine channel keys of this context's plan


@dataclass
class LoadedPlan:
    """A plan accepted by this executor (load-time checks passed)."""

    plan: Plan
    zero_copy: bool
    default_packet: str
    default_op: str
    nthreads: int
    n_blocks: int
    ctx: Optional[_Context] = None
    retired: list = field(default_factory=list)   # outgrown contexts: prepared entries and graphs still use them
    staging: tuple = (None, None)                 # (input, output) SymAlloc for ordinary tensors
    fast: dict[tuple, tuple] = field(default_factory=dict)
    spec: dict[tuple, Any] = field(default_factory=dict)   # key -> _Spec, or the reason it is not used
    has_port: bool = False   # port channels on some rank: the interpreter runs it, with the proxy
    engine_keys: list = field(default_factory=list)   # (src, dst, ordinal) of port channels between nodes
    serial: int = -1         # engine communicators' namespace (assigned collectively at first context)
    group_scratch: dict[tuple[int, int], int] = field(default_factory=dict)   # (in, out bytes) -> scratch


@dataclass
class _RegState:
    """The executor's side of registration (:mod:`mscclang.runtime.registration`) and of the
    staging cap: capture arenas (``[base, bytes, bytes used]``; slots hold device plans of calls
    captured before their buffers were registered, and an aborting plan until then), the sync area
    that aborting plan points at, staging above the cap kept by prepare (by plan and sizes), and
    the cap itself (read once)."""

    cap: int
    arenas: list = field(default_factory=list)
    poison: int = 0
    poison_bytes: int = 0
    big: dict = field(default_factory=dict)
    hooked: bool = False


class Executor:
    """Runs plans on this rank's GPU. ``comm`` defaults to a Communicator over torch.distributed's
    default store; ``timeout_s`` bounds every GPU spin (default 30 s, env MSCCLANG_TIMEOUT_S).
    Co-residency of all blocks is checked with the occupancy API before the first launch of a
    size; ``cooperative=True`` also launches through cuLaunchCooperativeKernel. ``specialize``:
    'auto' (default, env MSCCLANG_SPECIALIZE: plan-specialised kernels up to 256 KiB at first use,
    up to 64 MiB once a size is prepared or called a third time), 'always' or 'never' (see
    :mod:`mscclang.runtime.spec_build`). ``watchdog``: what to do when a launch gives up while
    no host call would notice (CUDA graph replays): 'raise' (default, env MSCCLANG_ASYNC_ERROR),
    'abort' or 'log' (see :mod:`mscclang.runtime.watchdog`)."""

    def __init__(self, comm: Optional[Communicator] = None, timeout_s: Optional[float] = None,
                 cooperative: bool = False, specialize: Optional[str] = None,
                 watchdog: Optional[str] = None) -> None:
        self.comm = comm or Communicator()
        if timeout_s is None:
            timeout_s = float(os.environ.get("MSCCLANG_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        self.timeout_ns = int(timeout_s * 1e9)
        self.cooperative = cooperative
        self._loaded: dict[int, LoadedPlan] = {}
        self._modules: dict[str, Any] = {}
        self._funcs: dict[tuple[str, str, str, int], Any] = {}
        self._err_host, self._err_dev = cu.host_alloc_mapped(256)
        self._err_state = ctypes.c_uint32.from_address(self._err_host)
        self._aborted = False
        self._last_stream: Optional[int] = None
        drv = cu.driver()
        self._event = cu.check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self._params = (ctypes.c_uint64 * 6)()
        self._param_ptrs = (ctypes.c_void_p * 6)(
            *[ctypes.addressof(self._params) + 8 * i for i in range(6)])
        self._param_addr = ctypes.addressof(self._param_ptrs)
        self._raw_launch = cu.raw_launch_kernel()   # ctypes cuLaunchKernel (None: use cuda.bindings)
        self._raw_stream = cu.raw_current_stream()  # torch's current raw stream getter (or None)
        self._stream_capturing = cu.raw_stream_is_capturing()
        self._user_thread: Optional[int] = threading.get_ident()   # the thread launching collectives
        self._last_call: Optional[tuple] = None
        self._reported = False   # the current abort was raised to the caller by a host call
        self._abort_msg: Optional[str] = None   # its message, built once
        self._abort_gen = 0      # resets so far (the same on every rank): names store keys
        self._sm_count = cu.device_attribute(self.comm.device, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
        cc = (cu.device_attribute(self.comm.device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
              cu.device_attribute(self.comm.device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"))
        self.arch = f"sm_{cc[0]}{cc[1]}"
        self._first_launch_done = False
        self._engine = Engine(self.comm.rank)
        self._engine_serial = 0
        self._proxy = PortProxy(self._engine.send, self._engine.recv)
        self._sync_event: Any = None
        #: which ranks share a node (launcher's LOCAL_WORLD_SIZE, MSCCLANG_GPUS_PER_NODE overrides)
        self.topology = topology_from_env(self.comm.world_size)
        self.specialize = spec_mode(specialize)
        self._spec_builder = SpecBuilder(self.arch)
        self._spec_mods: dict[str, tuple[Any, Any]] = {}   # cubin name -> (module, function)
        self.last_kernel = ""   # 'spec' or 'interpreter': the kernel of the latest launch
        self._watchdog: Optional[AbortWatchdog] = AbortWatchdog(
            state=lambda: self._err_state.value if self._err_host else 0, describe=self._abort_text,
            reported=lambda: self._reported, target=lambda: self._user_thread,
            mode=watchdog, poll_s=float(os.environ.get("MSCCLANG_WATCHDOG_POLL_S", "0.05")))

    def set_specialize(self, mode: str) -> None:
        """Switch the kernel policy ('auto', 'always', 'never'); later calls re-pick their kernel."""
        self.specialize = spec_mode(mode)
        for lp in self._loaded.values():
            lp.fast.clear()

    # ------------------------------------------------------------------------------------------
    # loading
    def runnable(self, plan: Plan) -> Optional[str]:
        """Why this executor cannot run ``plan`` (None when it can): the load-time checks, without
        keeping the plan."""
        try:
            if plan.world_size != self.comm.world_size:
                return f"the plan has {plan.world_size} ranks but the communicator has {self.comm.world_size}"
            check_runnable(plan, allow_switch=os.environ.get("MSCCLANG_ENABLE_NVLS") == "1",
                           topology=self.topology)
        except PlanError as e:
            return str(e)
        return None

    def load(self, plan: Plan) -> LoadedPlan:
        """Check ``plan`` once (refusing what this executor cannot run) and remember it."""
        lp = self._loaded.get(id(plan))
        if lp is not None and lp.plan is plan:
            return lp
        if plan.world_size != self.comm.world_size:
            raise PlanError(f"the plan has {plan.world_size} ranks but the communicator has "
                            f"{self.comm.world_size}", "gpus")
        allow_switch = os.environ.get("MSCCLANG_ENABLE_NVLS") == "1"
        check_runnable(plan, allow_switch=allow_switch, topology=self.topology)
        nb = len(plan.gpus[self.comm.rank].threadblocks)
        if nb > MAX_FLAGS:
            raise PlanError(f"rank {self.comm.rank} has {nb} thread blocks; the kernel supports {MAX_FLAGS}",
                            f"gpus[{self.comm.rank}].threadblocks")
        if nb > self._sm_count:
            raise PlanError(f"rank {self.comm.rank} has {nb} thread blocks but the device has {self._sm_count} "
                            "multiprocessors; the kernel runs one block per multiprocessor and needs all blocks "
                            "co-resident", f"gpus[{self.comm.rank}].threadblocks")
        default_packet = _packet_code(plan.packet_type.value if plan.packet_type else None)
        # zero-copy: a rank maps a peer's input/output (peers on other nodes are reached through the
        # engine, which receives into the caller's own tensors: no symmetric buffers needed)
        zero_copy = any(rb.type != BufferKind.scratch and self.topology.same_node(g.id, rb.rank)
                        for g in plan.gpus for rb in g.remote_buffers)
        lp = LoadedPlan(plan, zero_copy, default_packet, plan_reduce_op(plan),
                        plan.num_threads_per_block, nb)
        lp.has_port = any(g.peers(ChannelType.port) for g in plan.gpus)
        lp.engine_keys = [(g.id, q, o) for g in plan.gpus for q, o in port_peers(plan, g.id)
                          if not self.topology.same_node(g.id, q)]
        if lp.engine_keys:
            engine_bindings()   # RuntimeUnavailable now, naming nccl4py, rather than at the first call
        self._loaded[id(plan)] = lp
        return lp

    def _function(self, dtype: str, packet: str, op: str, nthreads: int = 1024) -> Any:
        key = (dtype, packet, op, block_variant(nthreads))
        f = self._funcs.get(key)
        if f is not None:
            return f
        drv = cu.driver()
        mod = self._modules.get(dtype)
        if mod is None:
            pre = find_prebuilt(dtype, self.arch)
            if pre is not None:
                err, m = drv.cuModuleLoadData(pre.read_bytes())
                mod = m if int(err) == 0 else None
            if mod is None:
                built = build_module(dtype, self.arch)
                mod = cu.check(drv.cuModuleLoadData(built.cubin), f"cuModuleLoadData({built.path.name})")
            self._modules[dtype] = mod
        f = cu.check(drv.cuModuleGetFunction(mod, kernel_name(dtype, packet, op, nthreads).encode()),
                     "cuModuleGetFunction")
        self._funcs[key] = f
        return f

    # ------------------------------------------------------------------------------------------
    # contexts (collective)
    def _make_context(self, lp: LoadedPlan, scratch_bytes: int) -> _Context:
        comm = self.comm
        plan = lp.plan
        r = comm.rank
        sync = sync_layout(plan, r)
        scratch_bytes = max(int(scratch_bytes), 256)
        sync_base = cu.mem_alloc(sync.size)
        scratch_base = cu.mem_alloc(scratch_bytes)
        peer_sync: dict[int, int] = {}
        peer_scratch: dict[int, int] = {}
        try:
            self._init_sync(plan, sync, sync_base)
            cu.memset_d8(scratch_base, 0, scratch_bytes, 0)
            drv = cu.driver()
            cu.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
            mine = cu.ipc_handle(sync_base) + cu.ipc_handle(scratch_base)
            allh = comm.allgather_bytes(mine, f"context of plan {plan.name}")   # scratch sizes may differ by rank
            if lp.engine_keys and lp.serial < 0:
                lp.serial = self._engine_serial
                self._engine_serial += 1
                self._engine.connect([(lp.serial, *k) for k in lp.engine_keys], comm.allgather_bytes)
            for q in mapped_peers(plan, r, self.topology):
                peer_sync[q] = cu.ipc_open(allh[q][:64])
                peer_scratch[q] = cu.ipc_open(allh[q][64:128])
        except BaseException:
            # e.g. CallMismatch: the ranks disagreed; leave nothing behind, the next call retries
            for p in list(peer_sync.values()) + list(peer_scratch.values()):
                cu.ipc_close(p)
            cu.mem_free(sync_base)
            cu.mem_free(scratch_base)
            raise
        return _Context(sync, sync_base, scratch_base, scratch_bytes, peer_sync, peer_scratch)

    def _init_sync(self, plan: Plan, sync: SyncLayout, base: int) -> None:
        cu.memset_d8(base, 0, sync.size, 0)
        cu.memset_d32(base + SYNC_FLAGS_OFF, 1, MAX_FLAGS, 0)
        sems = plan.gpus[self.comm.rank].semaphores
        if sems:
            data = b"".join(int(s.init_value).to_bytes(8, "little", signed=True) for s in sems)
            cu.htod(base + sync.semaphores, data, 0)

    def _free_context(self, ctx: _Context) -> None:
        for p in list(ctx.peer_sync.values()) + list(ctx.peer_scratch.values()):
            cu.ipc_close(p)
        for dp in ctx.plans.values():
            cu.mem_free(dp.blob)
            if dp.port_area:
                cu.mem_free(dp.port_area)
        cu.mem_free(ctx.sync_base)
        cu.mem_free(ctx.scratch_base)

    def _group_scratch(self, lp: LoadedPlan, in_bytes: int, out_bytes: int) -> int:
        """:func:`group_scratch_bytes` of the plan at this size (cached per size)."""
        key = (in_bytes, out_bytes)
        v = lp.group_scratch.get(key)
        if v is None:
            if len(lp.group_scratch) >= 1024:
                lp.group_scratch.clear()
            v = lp.group_scratch[key] = group_scratch_bytes(lp.plan, in_bytes, out_bytes)
        return v

    def _ensure_context(self, lp: LoadedPlan, in_bytes: int, out_bytes: int) -> _Context:
        """The plan's context, made or grown (collective: every rank reaches this at the same
        call, and decides alike: the size is the scratch of the rank that needs the most, see
        :func:`group_scratch_bytes`). An outgrown context is retired, not freed, and the launch
        entries made on it stay: a prepared call, or a CUDA graph that captured one, keeps running
        on its scratch, flags and device plans (every rank's entry for a size lives on the same
        generation of context, so peers always meet on matching ones). Retired contexts are freed
        by close()."""
        ctx = lp.ctx
        need = self._group_scratch(lp, in_bytes, out_bytes)
        if ctx is not None and ctx.scratch_bytes >= need:
            return ctx
        if self._capturing():
            raise NotPrepared(f"rank {self.comm.rank}: plan {lp.plan.name} needs {need} B of "
                              "scratch; first-time set-up cannot happen inside CUDA graph capture: prepare the "
                              "call (or run it once) before capturing")
        drv = cu.driver()
        cu.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        size = need
        if ctx is not None:
            self.comm.barrier("grow context")
            size = max(size, 2 * ctx.scratch_bytes)   # geometric: few contexts per plan, at most 2x held
            lp.retired.append(ctx)
        lp.ctx = self._make_context(lp, size)
        # a peer still compiling or setting up must not look like a hang: meet before launching
        self.comm.barrier("context ready")
        return lp.ctx

    def _capturing(self) -> bool:
        import torch

        return bool(torch.cuda.is_current_stream_capturing())

    # ------------------------------------------------------------------------------------------
    # device plans
    def _device_plan(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, sym_in: Any, sym_out: Any) -> _DevPlan:
        plan = lp.plan
        r = self.comm.rank
        packed = pack_blocks(plan, r, in_bytes, out_bytes)
        ctx = self._ensure_context(lp, in_bytes, out_bytes)
        key = (in_bytes, out_bytes, getattr(sym_in, "index", None), getattr(sym_out, "index", None))
        dp = ctx.plans.get(key)
        if dp is not None:
            return dp
        area = 0
        if packed.port is not None:
            area = cu.mem_alloc(packed.port.area_bytes)
            cu.memset_d8(area, 0, packed.port.area_bytes, 0)
        addr = self._addresses(lp, ctx, sym_in, sym_out, packed, area)
        blob = pack_blob(plan, packed, addr, ctx.sync)
        p = cu.mem_alloc(len(blob))
        cu.htod(p, blob, 0)
        drv = cu.driver()
        cu.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        smem = max((len(b.region) for b in packed.blocks), default=16)
        dp = _DevPlan(p, len(blob), len(packed.blocks), smem, packed.packet_align, packed.uses_packets,
                      packed, addr, area)
        ctx.plans[key] = dp
        return dp

    def _addresses(self, lp: LoadedPlan, ctx: _Context, sym_in: Any, sym_out: Any, packed: Any = None,
                   area: int = 0) -> Addresses:
        """The device addresses of a device plan on ``ctx``: sync area, scratch, channels, and the
        peers' buffers (scratch mappings, or ``sym_in``/``sym_out``'s peer bases: a symmetric
        allocation or a registration)."""
        plan = lp.plan
        r = self.comm.rank
        g = plan.gpus[r]
        remote = []
        for rb in g.remote_buffers:
            if not self.topology.same_node(r, rb.rank):
                remote.append((0, KIND_CODE[rb.type]))   # reached only through the engine
                continue
            if rb.type == BufferKind.scratch:
                base = ctx.peer_scratch[rb.rank]
            else:
                sa = sym_in if rb.type == BufferKind.input else sym_out
                if sa is None:
                    raise RuntimeUnavailable("internal: zero-copy plan without symmetric buffers")
                base = sa.peer_bases[rb.rank]
            remote.append((base, KIND_CODE[rb.type]))
        slots_me = inbound_slots(plan, r)
        chans = []
        for j, (q, o) in enumerate(memory_channel_ordinals(plan, r)):
            slots_q = inbound_slots(plan, q)
            chans.append((ctx.sync_base + ctx.sync.inbound + 8 * slots_me[(q, o)],
                          ctx.peer_sync[q] + sync_layout(plan, q).inbound + 8 * slots_q[(r, o)],
                          ctx.sync_base + ctx.sync.expected + 8 * j))
        if packed is not None and packed.port is not None:
            pin = port_inbound_slots(plan, r)
            for k, (q, o) in enumerate(port_peers(plan, r)):
                chans.append((ctx.sync_base + ctx.sync.port_inbound + 8 * pin[(q, o)],
                              area + packed.port.block_offset(k),
                              ctx.sync_base + ctx.sync.port_counters + 16 * k))
        peers = mapped_peers(plan, r, self.topology)
        # one half size per context: launches of different sizes must never overlap halves
        half = (ctx.scratch_bytes // 2) // 16 * 16 if plan.use_double_scratch_buffer else 0
        return Addresses(ctx.sync_base, ctx.scratch_base, half, self._err_dev,
                         [ctx.peer_sync[q] + SYNC_ABORT_OFF for q in peers], remote, chans)

    def prepare(self, plan: Plan, input: Any, output: Any = None, dtype: Any = None,
                packet_type: Any = None, reduce_op: Any = None) -> None:
        """Do every first-time step of a call outside CUDA graph capture, so the same call can
        then be captured: build and load the kernel (the specialised one too, at any size the
        policy allows), create the context (scratch, sync area, IPC mappings, store barrier),
        staging and the device plan. ``input``/``output``: the tensors of the call to come (the
        same ones: a zero-copy plan's entry depends on whether they are symmetric), checked as
        :meth:`execute` checks them; or byte counts (``output`` defaults from the collective), which
        prepare calls on ordinary tensors of ``dtype`` (default float16). Collective: every rank
        calls it with the same arguments."""
        import torch

        lp = self.load(plan)
        pkt = _packet_code(packet_type) if packet_type is not None else lp.default_packet
        op = _reduce_code(reduce_op) if reduce_op is not None else lp.default_op
        if hasattr(input, "data_ptr"):
            if output is None:
                output = input
            in_bytes, out_bytes = self._check_call(lp, input, output)
            self._resolve(lp, input.dtype, input.data_ptr(), output.data_ptr(), in_bytes, out_bytes, pkt, op, True)
            return
        in_bytes = int(input)
        if output is None:
            n = plan.world_size
            output = in_bytes * n if plan.collective == "allgather" else (
                in_bytes // n if plan.collective == "reducescatter" else in_bytes)
        dt = dtype or torch.float16
        torch_dtype_code(dt)
        # ordinary tensors: their addresses play no part in the entry (zero-copy plans stage)
        self._resolve(lp, dt, 0, 1, in_bytes, int(output), pkt, op, True)

    # ------------------------------------------------------------------------------------------
    # plan-specialised kernels
    def _spec_kernel(self, lp: LoadedPlan, dt: str, in_bytes: int, out_bytes: int, pkt: str, op: str,
                     dp: _DevPlan, force: bool = False) -> Optional[_Spec]:
        """The specialised kernel for these sizes, built (or found) now; None when the policy or
        the generator says no, the build failed (the reason is kept in ``lp.spec``), or the size
        is one the policy builds only when hot and ``force`` (``prepare``, a hot call) is not set.
        Never builds inside a CUDA graph capture."""
        w = when(self.specialize, in_bytes, out_bytes)
        if w == "never":
            return None
        key = (in_bytes, out_bytes, dt, pkt, op)
        got = lp.spec.get(key)
        if got is not None:   # built earlier (e.g. by prepare) or refused earlier
            return got if isinstance(got, _Spec) else None
        if w == "hot" and not force:
            return None
        if self._capturing():
            return None
        try:
            src = generate(lp.plan, dp.packed, dt, pkt, op)
            name = self._spec_builder.name(src)
            loaded = self._spec_mods.get(name)
            origin = "loaded"
            if loaded is None:
                built = self._spec_builder.get(src)
                origin = built.origin
                drv = cu.driver()
                mod = cu.check(drv.cuModuleLoadData(built.cubin), f"cuModuleLoadData({name})")
                func = cu.check(drv.cuModuleGetFunction(mod, src.kernel.encode()), "cuModuleGetFunction")
                loaded = (mod, func)
                self._spec_mods[name] = loaded
            func = loaded[1]
            drv = cu.driver()
            nblk = cu.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, src.nthreads, 0),
                            "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            if int(nblk) * self._sm_count < src.n_blocks:
                raise SpecUnsupported(f"{src.n_blocks} blocks of the specialised kernel cannot be co-resident")
            sp = _Spec(func, cu.ptr(func), src.n_blocks, src.nthreads, src.steps, origin, name, src.args)
        except (SpecUnsupported, RuntimeUnavailable, PlanError, OSError) as e:
            lp.spec[key] = f"{type(e).__name__}: {e}"
            return None
        lp.spec[key] = sp
        return sp

    def memory(self) -> dict[str, int]:
        """GPU memory this executor holds, in bytes (device allocations it made; symmetric buffers
        are the communicator's, see :meth:`mscclang.runtime.comm.Communicator.memory`):
        ``scratch`` and ``sync`` of live contexts, ``retired_scratch`` / ``retired_sync`` of
        outgrown ones (kept for prepared calls and captured graphs), ``device_plans``, ``graph_arena``
        (device-plan slots of capture sessions, kept until close), and the counts ``contexts``,
        ``retired_contexts``, ``launch_entries``, ``kernels`` (modules loaded)."""
        rs = getattr(self, "_reg_state", None)
        arena = (sum(a[1] for a in rs.arenas) + rs.poison_bytes) if rs is not None else 0
        out = dict(scratch=0, sync=0, retired_scratch=0, retired_sync=0, device_plans=0, contexts=0,
                   retired_contexts=0, launch_entries=0, kernels=len(self._modules) + len(self._spec_mods),
                   graph_arena=arena)
        for lp in self._loaded.values():
            out["launch_entries"] += len(lp.fast)
            for ctx, live in [(lp.ctx, True)] + [(c, False) for c in lp.retired]:
                if ctx is None:
                    continue
                pre = "" if live else "retired_"
                out[pre + "scratch"] += ctx.scratch_bytes
                out[pre + "sync"] += ctx.sync.size
                out["contexts" if live else "retired_contexts"] += 1
                out["device_plans"] += sum(dp.nbytes for dp in ctx.plans.values())
        return out

    def spec_status(self, plan: Plan) -> dict[tuple, str]:
        """Per (input bytes, output bytes, dtype, packet, reduce op) seen so far: how the
        specialised kernel was obtained ('spec NT threads, origin') or why the interpreter runs."""
        lp = self._loaded.get(id(plan))
        if lp is None:
            return {}
        return {k: (f"spec {v.nthreads} threads x {v.n_blocks} blocks, {v.steps} steps, {v.origin}"
                    if isinstance(v, _Spec) else v) for k, v in lp.spec.items()}

    def _staging(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, keep: bool = False) -> tuple[Any, Any]:
        """The plan's symmetric staging buffers for ordinary tensors (collective). Up to the staging
        cap (``MSCCLANG_STAGING_CAP_BYTES``) they are kept between calls and grown by size only, in
        powers of two (at most to the cap); an outgrown buffer is released, unless a captured graph
        uses it (then it stays until close). A call that needs more than the cap gets staging of
        its own, released once its work is done (:meth:`execute`), or kept when ``keep``
        (prepare: a capture of the call will use it). In-place plans stage input and output in
        one buffer."""
        if lp.ctx is None:
            self._ensure_context(lp, in_bytes, out_bytes)
        need_in = 0 if lp.plan.inplace else in_bytes
        cap = self._regs().cap
        if max(need_in, out_bytes) > cap:
            return self._staging_above_cap(lp, in_bytes, out_bytes, keep)
        si, so = lp.staging
        if so is None or so.size < out_bytes or (si is not None and si.size < need_in) or (si is None and need_in):
            if self._capturing():
                raise NotPrepared(f"rank {self.comm.rank}: staging for {in_bytes} B on plan {lp.plan.name} cannot "
                                  "be allocated inside CUDA graph capture: prepare the call (or run it once) first")
            size = lambda n: max(min(1 << max(n - 1, 0).bit_length(), cap), n, 256)  # noqa: E731
            grow = lambda cur, n: self.comm._sym_alloc(size(n), internal=True) \
                if cur is None or cur.size < n else cur  # noqa: E731
            old = [x for x in (si, so) if x is not None]
            so = grow(so, out_bytes)
            si = so if lp.plan.inplace else grow(si, in_bytes)
            lp.staging = (si, so)
            self.comm.barrier("staging")
            stale: list = []
            for x in old:
                if x is not si and x is not so and not x.pinned and all(x is not y for y in stale):
                    stale.append(x)
            self.release_symmetric(stale, "outgrown staging")
        return si, so

    def _staging_above_cap(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, keep: bool) -> tuple[Any, Any]:
        """Staging of a call above the cap: found again if prepare kept it, else allocated now
        (collective) and marked ``temp`` (released after the call) or, with ``keep``, pinned."""
        rs = self._regs()
        k = (id(lp), in_bytes, out_bytes)
        got = rs.big.get(k)
        if got is not None:
            return got
        if self._capturing():
            raise NotPrepared(f"rank {self.comm.rank}: {lp.plan.name} needs {max(in_bytes, out_bytes)} B of staging, "
                              f"above the staging cap ({rs.cap} B, MSCCLANG_STAGING_CAP_BYTES), which cannot be "
                              "allocated inside CUDA graph capture: prepare the call before capturing (prepare "
                              "keeps its staging), or register the tensors")
        so = self.comm._sym_alloc(out_bytes, internal=True)
        si = so if lp.plan.inplace else self.comm._sym_alloc(in_bytes, internal=True)
        for x in (si, so):
            if keep:
                x.pinned = True
            else:
                x.temp = True
        if keep:
            rs.big[k] = (si, so)
        self.comm.barrier("staging")
        return si, so

    def release_symmetric(self, allocs: list, why: str = "staging") -> None:
        """Collective: free symmetric allocations (staging) and everything built on them (launch
        entries, device plans), after every rank's GPU finished its work and the ranks met (so no
        peer still reads or writes them). Pinned ones (captured graphs, prepare) are skipped; every
        rank passes the corresponding allocations."""
        todo: list = []
        for a in allocs:
            if not a.pinned and all(a is not b for b in todo):
                todo.append(a)
        if not todo:
            return
        if self._capturing():
            raise NotPrepared(f"rank {self.comm.rank}: {why} cannot be released inside CUDA graph capture")
        cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        self.comm.barrier(f"release {why}")
        self._drop_indices({a.index for a in todo})
        self.comm._sym_release(todo)

    def release_tensors(self, tensors: list) -> None:
        """Collective: release the symmetric allocations holding ``tensors`` (the collective API's
        staging above the cap, or outgrown), see :meth:`release_symmetric`."""
        allocs = []
        for t in tensors:
            got = self.comm.symmetric_of(t.data_ptr())
            if got is not None:
                allocs.append(got[0])
        self.release_symmetric(allocs, "staging")

    def _drop_indices(self, idx: set) -> None:
        """Forget launch entries and free device plans built on the buffers named by ``idx``
        (symmetric allocation indices, registrations' ``("reg", seq)``); the device is idle."""
        for lp in self._loaded.values():
            for k in [k for k in lp.fast if any(x in idx for x in k[5:])]:
                del lp.fast[k]
            for ctx in [lp.ctx, *lp.retired]:
                if ctx is None:
                    continue
                for k in [k for k in ctx.plans if k[2] in idx or k[3] in idx]:
                    cu.mem_free(ctx.plans.pop(k).blob)

    def _drop_regions(self, regions: list) -> None:
        """Registry callback: registrations about to be released (device idle)."""
        self._drop_indices({r.index for r in regions})

    # ------------------------------------------------------------------------------------------
    # registration of ordinary tensors (mscclang.runtime.registration)
    def _regs(self) -> _RegState:
        st = getattr(self, "_reg_state", None)
        if st is None:
            st = _RegState(staging_cap_bytes())
            self._reg_state = st
        if not st.hooked:
            reg = getattr(self.comm, "registry", None)
            if reg is not None:
                reg.on_release.append(self._drop_regions)
                st.hooked = True
        return st

    def _registry(self) -> Any:
        reg = getattr(self.comm, "registry", None)
        if reg is None:
            raise RuntimeUnavailable(f"rank {self.comm.rank}: this communicator cannot register tensors")
        return reg

    def _capturing_now(self) -> bool:
        """Whether the current stream is capturing (the ctypes check when available)."""
        fn = getattr(self, "_stream_capturing", None)
        if fn is None:
            return self._capturing()
        return bool(fn(self._current_stream()))

    def _registered(self, si: Any, so: Any, in_ptr: int, out_ptr: int, in_bytes: int,
                    out_bytes: int) -> Optional[tuple]:
        """``(input buffer, input delta, output buffer, output delta)`` when the call's tensors are
        registered (or one symmetric and one registered), else None. A registration used inside a
        capture is pinned (kept until close)."""
        reg = getattr(self.comm, "registry", None)
        if reg is None or not reg.active:
            return None
        got = zero_copy_operands({in_ptr: si, out_ptr: so}.get, reg, in_ptr, out_ptr, in_bytes, out_bytes)
        if got is None:
            return None
        rin, rout = got[0], got[2]
        if isinstance(rin, Region):
            rin.uses += 1
        if isinstance(rout, Region) and rout is not rin:
            rout.uses += 1
        if ((isinstance(rin, Region) and not rin.pinned) or (isinstance(rout, Region) and not rout.pinned)) \
                and self._capturing_now():
            reg.pin(rin, rout)
        rs = getattr(self, "_reg_state", None)
        if rs is None or not rs.hooked:
            self._regs()   # its device plans must be dropped when a registration is released
        return got

    def _deferred(self, lp: LoadedPlan, dtype: Any, in_ptr: int, out_ptr: int, in_bytes: int, out_bytes: int,
                  pkt: str, op: str) -> Optional[tuple[tuple, tuple]]:
        """Inside a capture session, while capturing: the launch entry of a zero-copy call on
        unregistered, exportable tensors, whose device plan sits in an arena slot that holds an
        aborting plan until the session's end registers the buffers and writes the real one. None
        outside a session (or when the buffers cannot be exported: the call is staged). Needs the
        kernel loaded and a context large enough: the same sizes run or prepared before (on any
        tensors). Only host queries here: no allocation, no IPC call."""
        reg = getattr(self.comm, "registry", None)
        if reg is None or reg.session is None or not reg.session.enabled or not self._capturing():
            return None
        if lp.has_port:   # the proxy's copies need the peers' addresses at capture: staged instead
            return None
        if not reg.can_defer(in_ptr, in_bytes, out_ptr, out_bytes):
            return None
        plan = lp.plan
        dt = torch_dtype_code(dtype)
        desc = self._describe_call(lp, in_bytes, out_bytes, dt, pkt, op)
        ctx = lp.ctx
        packed = pack_blocks(plan, self.comm.rank, in_bytes, out_bytes)
        fkey = (dt, pkt, op, block_variant(lp.nthreads))
        if (fkey not in self._funcs or ctx is None
                or ctx.scratch_bytes < self._group_scratch(lp, in_bytes, out_bytes)):
            raise NotPrepared(f"rank {self.comm.rank}: {desc} was not prepared: run it once or prepare it (any "
                              "tensors of these sizes) before capturing it")
        f = self._function(dt, pkt, op, lp.nthreads)
        need = 8 if pkt == "ll16" else 4
        if packed.uses_packets and packed.packet_align < need:
            raise PlanError(f"rank {self.comm.rank}: packet offsets at this size are only {packed.packet_align}-byte "
                            f"aligned; {pkt.upper()} needs {need} (raise buffer_alignment or use LL8)")
        nb = len(packed.blocks)
        smem = max((len(b.region) for b in packed.blocks), default=16)
        drv = cu.driver()
        if smem > 48 * 1024:
            cu.check(drv.cuFuncSetAttribute(
                f, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                "cuFuncSetAttribute")
        nblk = cu.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, lp.nthreads, smem),
                        "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        if int(nblk) * self._sm_count < nb:
            raise PlanError(f"rank {self.comm.rank}: {nb} thread blocks of {lp.nthreads} threads cannot all be "
                            f"co-resident (at most {int(nblk) * self._sm_count})")
        import collections
        import types

        anyb = types.SimpleNamespace(peer_bases=collections.defaultdict(int))
        nbytes = len(pack_blob(plan, packed, self._addresses(lp, ctx, anyb, anyb), ctx.sync))
        slot = self._arena_slot(nbytes, desc)

        def finish(rin: Any, rout: Any) -> None:
            cu.htod(slot, pack_blob(plan, packed, self._addresses(lp, ctx, rin, rout), ctx.sync), 0)

        deltas = reg.defer(in_ptr, in_bytes, out_ptr, out_bytes, desc, finish)
        if deltas is None:
            return None
        return (f, slot, nb, lp.nthreads, smem, cu.ptr(f), None, None, ctx, None), ("sym", deltas[0], deltas[1])

    def _arena_slot(self, nbytes: int, desc: str) -> int:
        """A slot of ``nbytes`` (rounded up to whole strides) in the first arena with room."""
        rs = self._regs()
        need = -(-int(nbytes) // ARENA_STRIDE) * ARENA_STRIDE
        for a in rs.arenas:
            if a[2] + need <= a[1]:
                p = a[0] + a[2]
                a[2] += need
                return p
        free = sum(a[1] - a[2] for a in rs.arenas)
        raise NotPrepared(f"rank {self.comm.rank}: the graph-capture arena ({free} B free) has no room for the "
                          f"device plan of {desc} ({need} B): pass a larger arena_bytes to graph_capture() "
                          "(or MSCCLANG_GRAPH_ARENA_BYTES)")

    def _poison_image(self) -> bytes:
        """One arena slot's initial content: a device plan whose blocks find the abort word set and
        leave at once (recording an error), so a slot replayed before its buffers were registered,
        or whose registration failed, never touches a peer."""
        rs = self._regs()
        if not rs.poison:
            n = SYNC_FLAGS_OFF + 4 * MAX_FLAGS
            p = cu.mem_alloc(n)
            cu.memset_d32(p, 1, n // 4, 0)   # abort word 1, every flag 1
            rs.poison, rs.poison_bytes = p, n
        sb = rs.poison
        h = PLAN_HEADER.size
        head = PLAN_HEADER.pack(
            magic=CONSTANTS["MSCCLANG_PLAN_MAGIC"], version=CONSTANTS["MSCCLANG_PLAN_VERSION"], n_blocks=0,
            rank=self.comm.rank, sync_base=sb, flags=sb + SYNC_FLAGS_OFF, abort_word=sb + SYNC_ABORT_OFF,
            error_record=self._err_dev, semaphores=sb, barriers=sb, peer_abort_table=h, remote_table=h,
            channel_table=h, block_table=h)
        return head + b"\0" * (ARENA_STRIDE - len(head))

    def _registration_checks(self, reg: Any, lp: LoadedPlan, key: tuple, in_bytes: int, out_bytes: int,
                             dtype: Any, pkt: str, op: str) -> None:
        """Inside a capture session: record the captured call (the ranks compare their lists at
        the session's end). With ``MSCCLANG_CHECK_REGISTRATION``: compare every zero-copy call's
        buffers across ranks (outside captures)."""
        capturing = self._capturing()
        if reg.session is not None and capturing:
            how = "any" if len(key) == 5 else ("staged" if key[5] == "staged" else f"zero-copy {key[5]} {key[6]}")
            reg.note_call(f"{self._describe_call(lp, in_bytes, out_bytes, torch_dtype_code(dtype), pkt, op)} {how}")
        if reg.verify and lp.zero_copy and not capturing:
            how = "staged" if key[5] == "staged" else f"zero-copy {key[5]} {key[6]}"
            reg.check_call(f"{lp.plan.name} {in_bytes} {out_bytes} {how}")

    def register(self, tensors: list) -> list[bool]:
        """Collective: register ordinary CUDA tensors for zero-copy plans (every rank passes its
        corresponding tensors, in the same order). Returns, per tensor, whether zero-copy plans now
        run on it directly (symmetric tensors: always). See :mod:`mscclang.runtime.registration`
        for the rule. Not inside a CUDA graph capture (use :meth:`begin_graph_capture`)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        reg = self._registry()
        self._regs()
        if self._capturing():
            raise NotPrepared(f"rank {self.comm.rank}: registration cannot happen inside CUDA graph capture: "
                              "register before capturing, or capture inside a graph-capture session")
        items: list = []
        sym: list[bool] = []
        for i, t in enumerate(tensors):
            self._check_tensor(t, f"tensor {i}")
            n = t.numel() * t.element_size()
            got = self.comm.symmetric_of(t.data_ptr())
            if got is not None or n == 0:
                items.append((None, n, None))
                sym.append(got is not None and not got[0].internal)
            else:
                items.append((t.data_ptr(), n, StorageWeakRef(t.untyped_storage())))
                sym.append(False)
        res = reg.register(items)
        return [s or g is not None for s, g in zip(sym, res)]

    def deregister(self, tensors: list) -> int:
        """Collective: drop the registrations of ``tensors`` (releasing their mappings and device
        plans unless a captured graph uses them). Returns how many were dropped."""
        reg = self._registry()
        items = []
        for i, t in enumerate(tensors):
            self._check_tensor(t, f"tensor {i}")
            items.append((t.data_ptr(), t.numel() * t.element_size()))
        return reg.deregister(items)

    def _check_tensor(self, t: Any, what: str) -> None:
        r, dev = self.comm.rank, self.comm.device
        if not hasattr(t, "data_ptr") or not hasattr(t, "is_cuda"):
            raise InvalidCall(f"rank {r}: {what} must be a torch tensor, got {type(t).__name__}")
        if not t.is_cuda or t.get_device() != dev:
            raise InvalidCall(f"rank {r}: {what} is on {t.device}, but this executor runs on cuda:{dev}")
        if not t.is_contiguous():
            raise InvalidCall(f"rank {r}: {what} must be contiguous")

    def zero_copy_ok(self, input: Any, output: Any) -> bool:
        """Whether a zero-copy plan runs on these tensors without staging: both symmetric,
        registered (or one of each, or one inside the other's registration), or, while capturing in
        a capture session, exportable (registered at the session's end)."""
        esz = input.element_size()
        p, q = input.data_ptr(), output.data_ptr()
        a, b = input.numel() * esz, output.numel() * esz
        comm = self.comm
        si, so = comm.symmetric_of(p), comm.symmetric_of(q)
        if si is not None and so is not None and not si[0].internal and not so[0].internal:
            return True
        reg = getattr(comm, "registry", None)
        if reg is None:
            return False
        if reg.active and zero_copy_operands({p: si, q: so}.get, reg, p, q, a, b) is not None:
            return True
        s = reg.session
        return bool(s is not None and s.enabled and self._capturing() and reg.can_defer(p, a, q, b))

    def buffer_class(self, t: Any) -> Any:
        """What a tensor is to zero-copy plans (part of the collective API's memo key): a symmetric
        allocation's ``("sym", index)``, a registration's ``("reg", seq)``, ``"defer"`` (capturing
        in a capture session, exportable), or None."""
        p = t.data_ptr()
        got = self.comm.symmetric_of(p)
        if got is not None:
            return ("internal" if got[0].internal else "sym", got[0].index)
        reg = getattr(self.comm, "registry", None)
        if reg is None:
            return None
        n = t.numel() * t.element_size()
        if reg.active:
            g = reg.lookup(p, n)
            if g is not None:
                return g.index
        s = reg.session
        if s is not None and s.enabled and self._capturing():
            return "defer" if reg.exportable(p, n) else None
        return None

    def begin_graph_capture(self, arena_bytes: Optional[int] = None) -> bool:
        """Collective, before ``torch.cuda.graph`` starts: open a capture session. Zero-copy calls
        captured in it on ordinary tensors that are not registered are captured anyway, with their
        device plans in arena slots, and registered by :meth:`end_graph_capture`. The session may
        use ``arena_bytes`` (default ``MSCCLANG_GRAPH_ARENA_BYTES``) of arena: what earlier sessions
        left, plus a new arena allocated now when that is less (arenas are kept until close: captured
        graphs use them). Returns whether deferring is enabled (every rank runs the same torch
        allocator settings)."""
        reg = self._registry()
        rs = self._regs()
        if self._capturing():
            raise InvalidCall(f"rank {self.comm.rank}: open the graph-capture session before torch.cuda.graph "
                              "starts capturing")
        size = graph_arena_bytes() if arena_bytes is None else max(int(arena_bytes), ARENA_STRIDE)
        size = -(-size // ARENA_STRIDE) * ARENA_STRIDE
        config = allocator_config()
        free = sum(a[1] - a[2] for a in rs.arenas)
        if free < size:
            # the session may use ``size`` bytes: what earlier arenas have left, plus a new one
            more = max(size - free, min(size, 64 * ARENA_STRIDE))
            try:
                image = self._poison_image()
                p = cu.mem_alloc(more)
                cu.htod(p, image * (more // ARENA_STRIDE), 0)
                cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
                rs.arenas.append([p, more, 0])
            except RuntimeUnavailable as e:
                # every rank then disables deferring (the settings compared differ): staging instead
                config += f"|arena failed on rank {self.comm.rank}: {e}"
        return reg.begin_capture(config).enabled

    def end_graph_capture(self, failed: bool = False) -> int:
        """Collective, after the capture ended: register the buffers of the calls captured in the
        session and write their device plans (see
        :meth:`mscclang.runtime.registration.Registry.finish_capture`). ``failed``: this rank's
        capture raised. Returns the number of calls registered."""
        reg = self._registry()
        if self._capturing():
            raise InvalidCall(f"rank {self.comm.rank}: end the graph-capture session after the capture ended "
                              "(leave torch.cuda.graph first)")
        try:
            return reg.finish_capture(failed)
        finally:
            cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")   # the device plans are written

    def _close_registration(self) -> None:
        """Free the capture arenas and the aborting sync area (at close: the device is idle)."""
        rs = getattr(self, "_reg_state", None)
        if rs is None:
            return
        for a in rs.arenas:
            cu.mem_free(a[0])
        rs.arenas.clear()
        if rs.poison:
            cu.mem_free(rs.poison)
            rs.poison = rs.poison_bytes = 0
        rs.big.clear()

    # ------------------------------------------------------------------------------------------
    # launching
    def check(self) -> None:
        """Raise CollectiveTimeout if a launch of this executor gave up (until reset())."""
        st = ctypes.c_uint32.from_address(self._err_host).value
        if st == 0 and not self._aborted:
            return
        if st == 1:
            cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        self._aborted = True
        self._reported = True
        msg = self._abort_text()
        if self._watchdog is not None and self._watchdog.fired:
            msg += " (reported earlier by the watchdog)"
        raise CollectiveTimeout(msg)

    def _abort_text(self) -> str:
        """The current abort's message, built once (the watchdog's thread or the caller's)."""
        if self._abort_msg is None:
            self._abort_msg = self._abort_message()
        return self._abort_msg

    def _abort_message(self) -> str:
        """The error record as a sentence, with what this rank called last and, when the other
        ranks can be heard within a second, what they called."""
        rec = ERROR_RECORD.unpack(ctypes.string_at(self._err_host, ERROR_RECORD.size))
        what = _WHAT.get(rec["what"], f"kind {rec['what']}")
        chan = f" on channel {rec['channel']}" if rec["channel"] >= 0 and rec["what"] in (1, 3, 4, 6) else ""
        msg = (f"rank {rec['rank']} thread block {rec['block']} op {rec['op_index']} gave up waiting for {what}"
               f"{chan} (expected {rec['expected']}, saw {rec['seen']}) after {rec['elapsed_ns'] / 1e9:.3f} s; "
               "the collective was aborted on every rank: call Executor.reset() on all ranks to continue")
        calls = self._calls_of_ranks()
        if calls:
            msg += "; last calls: " + ", ".join(calls)
        return msg

    def _calls_of_ranks(self) -> list[str]:
        """``rank R: <its last call>`` for this rank and the ranks that publish theirs within a
        second (a dead or hung rank does not: it is named as silent)."""
        last = self._last_call
        mine = self._describe_call(*last[:3], torch_dtype_code(last[3]), *last[4:]) if last else "nothing yet"
        out = {self.comm.rank: mine}
        store = getattr(self.comm, "store", None)
        prefix = getattr(self.comm, "prefix", None)
        if store is not None and prefix is not None:
            import datetime

            try:
                store.set(f"{prefix}/lastcall/{self._abort_gen}/{self.comm.rank}", mine.encode())
            except Exception:  # noqa: BLE001 - the store may be gone with a dead rank 0
                return [f"rank {self.comm.rank}: {mine}"]
            for q in range(self.comm.world_size):
                if q == self.comm.rank:
                    continue
                try:
                    key = f"{prefix}/lastcall/{self._abort_gen}/{q}"
                    store.wait([key], datetime.timedelta(seconds=1))
                    out[q] = bytes(store.get(key)).decode("utf-8", "replace")
                except Exception:  # noqa: BLE001 - silent rank
                    out[q] = "no answer (dead or hung?)"
        return [f"rank {q}: {out[q]}" for q in sorted(out)]

    def synchronize(self) -> None:
        """Wait for this executor's launches and raise CollectiveTimeout if one gave up. With
        engine channels (port channels between nodes) the wait is bounded: an engine receive for
        a dead peer never completes, so once a kernel gave up (or twice the timeout passed) the
        engine's communicators are aborted, which ends their calls, and CollectiveTimeout is
        raised."""
        if not self._engine.comms:
            self._sync_ports("synchronize")
            cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
            self.check()
            return
        self._sync_engine()

    def _sync_ports(self, what: str) -> None:
        """Bounded wait for the port proxy's side streams (when port plans ran here): their
        ``cuStreamWaitValue32`` has no timeout, and every path is meant to release it (the kernel's
        exit, :meth:`PortProxy.release` after a failed launch); should one still wait, this raises
        CollectiveTimeout instead of hanging in ``cuCtxSynchronize``."""
        if not self._proxy.enqueued:
            return
        streams = self._port_streams()
        limit = 2 * self.timeout_ns / 1e9 + 5.0
        if self._drained(streams, limit):
            return
        self._aborted = True
        if self._engine.comms:
            # an engine receive for a dead peer never completes: aborting the communicators ends
            # it (the collective reset reconnects them)
            self._engine.close(abort=True)
            if self._drained(streams, 10.0 + self.timeout_ns / 1e9):
                return
        raise CollectiveTimeout(f"rank {self.comm.rank}: {what}: the port-channel proxy's stream operations "
                                f"did not finish within {limit:.0f} s (a wait for a trigger that no kernel "
                                "posts); this process cannot recover: restart it")

    def _port_streams(self) -> list:
        """The streams a bounded wait covers: the proxy's side streams (joined into the caller's
        stream only after a successful launch), the current stream and the last launch's."""
        streams = list(self._proxy.side_streams()) + [self._current_stream()]
        if self._last_stream is not None:
            streams.append(self._last_stream)
        return streams

    def _sync_engine(self) -> None:
        streams = self._port_streams()
        limit = 2 * self.timeout_ns / 1e9 + 5.0

        def gave_up() -> bool:
            return ctypes.c_uint32.from_address(self._err_host).value != 0

        if not self._drained(streams, limit, gave_up):
            kernel_gave_up = gave_up()
            self._engine.close(abort=True)   # ends engine calls waiting for a dead peer
            self._aborted = True
            if not self._drained(streams, 10.0 + self.timeout_ns / 1e9):
                raise CollectiveTimeout(f"rank {self.comm.rank}: GPU work still runs after the engine's "
                                        "communicators were aborted (a transfer to or from a dead peer did "
                                        "not end); this process cannot recover: restart it")
            if not kernel_gave_up:
                raise CollectiveTimeout(f"rank {self.comm.rank}: the engine's transfers (NCCL point-to-point "
                                        f"of port channels between nodes) did not finish in {limit:.0f} s; "
                                        "its communicators were aborted")
        self.check()

    def _drained(self, streams: list, limit_s: float, stop: Optional[Callable[[], bool]] = None) -> bool:
        """Whether the work enqueued so far on ``streams`` (proxy side streams and engine
        streams join them) finishes within ``limit_s`` and before ``stop()`` says to stop
        waiting: a bounded cuCtxSynchronize."""
        import time

        drv = cu.driver()
        ev = self._sync_event
        if ev is None:
            ev = self._sync_event = cu.check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                                             "cuEventCreate")
        t0 = time.monotonic()
        for s in streams:
            cu.check(drv.cuEventRecord(ev, s), "cuEventRecord")
            while True:
                err, = drv.cuEventQuery(ev)
                if int(err) == 0:
                    break
                if int(err) != int(drv.CUresult.CUDA_ERROR_NOT_READY):
                    cu.check(err, "cuEventQuery")
                if time.monotonic() - t0 > limit_s or (stop is not None and stop()):
                    return False
                time.sleep(0.0005)
        return True

    def execute(self, plan: Union[Plan, LoadedPlan], input: Any, output: Any, packet_type: Any = None,
                reduce_op: Any = None, stream: Any = None) -> None:
        """Run ``plan`` on this rank with torch tensors ``input``/``output`` on the current torch
        stream (or ``stream``). ``packet_type``: 'LL16' (default) or 'LL8'; ``reduce_op``: overrides
        the plan's sum/min/max. An in-place plan (``plan.inplace``) runs only on the in-place layout
        (the same tensor; allgather: the input is this rank's block of the output; reduce-scatter:
        the output is this rank's block of the input), an out-of-place plan only on buffers that do
        not overlap. The tensors are checked (CUDA on this executor's device, dtype, contiguity,
        sizes, layout) before anything reaches the GPU: :class:`~mscclang.errors.InvalidCall`.
        Collective: every rank calls it in the same order."""
        if self._aborted or self._err_state.value:
            self.check()
        lp = plan if isinstance(plan, LoadedPlan) else self._loaded.get(id(plan))
        if lp is None or (not isinstance(plan, LoadedPlan) and lp.plan is not plan):
            lp = self.load(plan)
        pkt = _packet_code(packet_type) if packet_type is not None else lp.default_packet
        op = _reduce_code(reduce_op) if reduce_op is not None else lp.default_op
        in_bytes, out_bytes = self._check_call(lp, input, output)
        s = self._current_stream() if stream is None else int(getattr(stream, "cuda_stream", stream))
        self._user_thread = threading.get_ident()
        self._last_call = (lp, in_bytes, out_bytes, input.dtype, pkt, op)
        ent, st = self._resolve(lp, input.dtype, input.data_ptr(), output.data_ptr(), in_bytes, out_bytes,
                                pkt, op, False)
        if st is None:
            self._launch(ent, input.data_ptr(), output.data_ptr(), 0, 0, s)
        elif st[0] == "sym":
            self._launch(ent, input.data_ptr(), output.data_ptr(), st[1], st[2], s)
        else:
            st_in, st_out = st[1], st[2]
            if lp.plan.inplace:
                # the input lies in the output (in-place layout): stage the whole output
                cu.dtod(st_out.base, output.data_ptr(), out_bytes, s)
                delta = input.data_ptr() - output.data_ptr()
                self._launch(ent, st_out.base + delta, st_out.base, delta, 0, s)
            else:
                cu.dtod(st_in.base, input.data_ptr(), in_bytes, s)
                self._launch(ent, st_in.base, st_out.base, 0, 0, s)
            cu.dtod(output.data_ptr(), st_out.base, out_bytes, s)
            if st_in.temp or st_out.temp:   # staging above the cap: released once this call is done
                self.release_symmetric([st_in, st_out], "staging above the cap")

    def _check_call(self, lp: LoadedPlan, input: Any, output: Any) -> tuple[int, int]:
        """(input bytes, output bytes) of a call, after checking every argument; raises
        InvalidCall before anything reaches the GPU."""
        r = self.comm.rank
        dev = self.comm.device
        for what, t in (("input", input), ("output", output)):
            if not hasattr(t, "data_ptr") or not hasattr(t, "is_cuda"):
                raise InvalidCall(f"rank {r}: {what} must be a torch tensor, got {type(t).__name__}")
            if not t.is_cuda or t.get_device() != dev:
                raise InvalidCall(f"rank {r}: {what} is on {t.device}, but this executor runs on cuda:{dev}; "
                                  "move the tensor to that GPU")
            if not t.is_contiguous():
                raise InvalidCall(f"rank {r}: {what} must be contiguous")
        if input.dtype != output.dtype:
            raise InvalidCall(f"rank {r}: input dtype {input.dtype} differs from output dtype {output.dtype}")
        torch_dtype_code(input.dtype)
        esz = input.element_size()
        in_bytes, out_bytes = input.numel() * esz, output.numel() * esz
        plan = lp.plan
        coll, n = plan.collective, plan.world_size
        if coll == "allgather" and out_bytes != in_bytes * n:
            raise InvalidCall(f"rank {r}: allgather output has {out_bytes} bytes; it must be {n} x the "
                              f"input's {in_bytes}")
        if coll == "reducescatter" and in_bytes != out_bytes * n:
            raise InvalidCall(f"rank {r}: reducescatter input has {in_bytes} bytes; it must be {n} x the "
                              f"output's {out_bytes}")
        if coll in ("allreduce", "alltoall", "sendrecv", "broadcast") and in_bytes != out_bytes:
            raise InvalidCall(f"rank {r}: {coll} input has {in_bytes} bytes and output {out_bytes}; they must "
                              "be equal")
        if in_bytes == 0 and out_bytes == 0:
            raise InvalidCall(f"rank {r}: {coll} on empty tensors")
        a0, b0 = input.data_ptr(), output.data_ptr()
        overlap = a0 < b0 + out_bytes and b0 < a0 + in_bytes
        if plan.inplace:
            if coll == "allgather":
                ok, where = a0 == b0 + r * in_bytes, "the input must be this rank's block of the output"
            elif coll == "reducescatter":
                ok, where = b0 == a0 + r * out_bytes, "the output must be this rank's block of the input"
            else:
                ok, where = a0 == b0, "input and output must be the same tensor"
            if not ok:
                raise InvalidCall(f"rank {r}: plan {plan.name!r} is in place: {where} (got input at "
                                  f"{a0:#x}, output at {b0:#x}); use an out-of-place plan for separate buffers")
        elif overlap:
            raise InvalidCall(f"rank {r}: plan {plan.name!r} is out of place but its input and output overlap")
        return in_bytes, out_bytes

    def _resolve(self, lp: LoadedPlan, dtype: Any, in_ptr: int, out_ptr: int, in_bytes: int, out_bytes: int,
                 pkt: str, op: str, prepare: bool) -> tuple[tuple, Optional[tuple]]:
        """The launch entry of a call and how its buffers map: None (the caller's tensors),
        ``("sym", in offset, out offset)`` (symmetric buffers) or ``("staged", in, out)`` (the
        context's staging buffers). ``prepare``: do every first-time step now, specialised kernel
        included. Shared by :meth:`execute` and :meth:`prepare`, so a prepared call finds its
        entry when captured."""
        st: Optional[tuple] = None
        sym_in = sym_out = None
        if lp.zero_copy:
            comm = self.comm
            si = comm.symmetric_of(in_ptr)
            so = comm.symmetric_of(out_ptr)
            zc = None
            if si is not None and so is not None and not si[0].internal and not so[0].internal:
                key = (in_bytes, out_bytes, dtype, pkt, op, si[0].index, so[0].index)
                st = ("sym", si[1], so[1])
                sym_in, sym_out = si[0], so[0]
            elif (zc := self._registered(si, so, in_ptr, out_ptr, in_bytes, out_bytes)) is not None:
                # registered ordinary tensors (mscclang.runtime.registration): like symmetric
                # buffers, the peers' corresponding tensors at the registration's mapped bases
                sym_in, din, sym_out, dout = zc
                key = (in_bytes, out_bytes, dtype, pkt, op, sym_in.index, sym_out.index)
                st = ("sym", din, dout)
            else:
                dfr = self._deferred(lp, dtype, in_ptr, out_ptr, in_bytes, out_bytes, pkt, op)
                if dfr is not None:
                    return dfr
                # not symmetric: the context's registered, pre-zeroed staging buffers; the key
                # names them, so an entry never runs on staging other than its device plan's
                st_in, st_out = self._staging(lp, in_bytes, out_bytes, keep=prepare)
                key = (in_bytes, out_bytes, dtype, pkt, op, "staged", st_in.index, st_out.index)
                st = ("staged", st_in, st_out)
                sym_in, sym_out = (st_out if lp.plan.inplace else st_in), st_out
                if not (st_in.pinned and st_out.pinned) and (prepare or self._capturing()):
                    # a prepared call or a captured graph uses them: never released before close
                    st_in.pinned = st_out.pinned = True
        else:
            key = (in_bytes, out_bytes, dtype, pkt, op)
        reg = getattr(self.comm, "registry", None)
        if reg is not None and (reg.session is not None or reg.verify):
            self._registration_checks(reg, lp, key, in_bytes, out_bytes, dtype, pkt, op)
        ent = lp.fast.get(key)
        if ent is None:
            ent = self._entry(lp, dtype, in_bytes, out_bytes, pkt, op, sym_in, sym_out, force=prepare)
            lp.fast[key] = ent
        elif ent[7] is not None:
            ent = self._promote(lp, key, ent, prepare)
        return ent, st

    def _entry(self, lp: LoadedPlan, dtype: Any, in_bytes: int, out_bytes: int, pkt: str, op: str,
               sym_in: Any, sym_out: Any, force: bool = False) -> tuple:
        """The launch entry of one (sizes, dtype, packet, op, buffers): interpreter function,
        device plan, launch shape, the specialised launch (or None), for a size the policy
        specialises once hot a pending record ``[calls left, arguments]`` (else None), and the
        context. First-time set-up: refused inside a CUDA graph capture (NotPrepared)."""
        plan = lp.plan
        ref = in_bytes if plan.collective != "allgather" else out_bytes
        if not plan.min_message_size <= ref <= plan.max_message_size:
            raise PlanError(f"message size {ref} bytes is outside the plan's range "
                            f"[{plan.min_message_size}, {plan.max_message_size}]")
        dt = torch_dtype_code(dtype)
        desc = self._describe_call(lp, in_bytes, out_bytes, dt, pkt, op)
        if self._capturing():
            raise NotPrepared(f"rank {self.comm.rank}: {desc} was not prepared: its first-time set-up "
                              "(device plan, scratch, kernel) cannot happen inside CUDA graph capture; call "
                              "prepare with the same tensors (or run the call once) before capturing")
        with self._calling(desc):
            f = self._function(dt, pkt, op, lp.nthreads)
            dp = self._device_plan(lp, in_bytes, out_bytes, sym_in, sym_out)
            need = 8 if pkt == "ll16" else 4
            if dp.uses_packets and dp.packet_align < need:
                raise PlanError(f"rank {self.comm.rank}: packet offsets at this size are only {dp.packet_align}-byte "
                                f"aligned; {pkt.upper()} needs {need} (raise buffer_alignment or use LL8)")
            drv = cu.driver()
            if dp.smem > 48 * 1024:
                cu.check(drv.cuFuncSetAttribute(
                    f, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dp.smem),
                    "cuFuncSetAttribute")
            nblk = cu.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, lp.nthreads, dp.smem),
                            "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            if int(nblk) * self._sm_count < dp.n_blocks:
                raise PlanError(f"rank {self.comm.rank}: {dp.n_blocks} thread blocks of {lp.nthreads} threads cannot "
                                f"all be co-resident (at most {int(nblk) * self._sm_count})")
            launch = None
            port = self._port_launch(lp, dp, in_bytes, out_bytes) if lp.has_port else None
            # port plans run on the interpreter (the specialised kernel has no port ops)
            sp = None if lp.has_port else self._spec_kernel(lp, dt, in_bytes, out_bytes, pkt, op, dp, force)
            if sp is not None and lp.ctx is not None:
                args = pack_args(sp.layout, dp.addr, lp.ctx.sync, self.comm.rank)
                ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(args))
                launch = _SpecLaunch(sp, args, ctypes.addressof(ptrs), ptrs)
            pending = None
            if launch is None and not force and (in_bytes, out_bytes, dt, pkt, op) not in lp.spec \
                    and when(self.specialize, in_bytes, out_bytes) == "hot":
                pending = [spec_hot_calls() - 1, (lp, dtype, in_bytes, out_bytes, pkt, op, sym_in, sym_out)]
        return (f, dp.blob, dp.n_blocks, lp.nthreads, dp.smem, cu.ptr(f), launch, pending, lp.ctx, port)

    def _port_launch(self, lp: LoadedPlan, dp: _DevPlan, in_bytes: int, out_bytes: int) -> Optional[PortLaunch]:
        """What the proxy needs for every launch of this entry (None: no port work on this rank)."""
        plan = lp.plan
        r = self.comm.rank
        ctx = lp.ctx
        script = dp.packed.port
        incoming: list[Incoming] = []
        pin = port_inbound_slots(plan, r)
        for g in plan.gpus:
            if g.id == r or self.topology.same_node(g.id, r):
                continue
            theirs = None
            for kq, (q, o) in enumerate(port_peers(plan, g.id)):
                if q != r:
                    continue
                if theirs is None:
                    theirs = pack_blocks(plan, g.id, in_bytes, out_bytes).port
                incoming.append(Incoming(theirs.channels[kq], ctx.sync_base + ctx.sync.port_inbound + 8 * pin[(g.id, o)],
                                         [rb.type for rb in g.remote_buffers],
                                         self._engine.comm((lp.serial, g.id, r, o))))
        if script is None and not incoming:
            return None
        if script is None:
            from mscclang.runtime.ports import PortScript
            script = PortScript([])
        g = plan.gpus[r]
        remote_base: list[Optional[int]] = []
        for j, rb in enumerate(g.remote_buffers):
            remote_base.append(dp.addr.remote[j][0] if self.topology.same_node(r, rb.rank) else None)
        peer_inbound: list[Optional[int]] = []
        comms: list = []
        for k, (q, o) in enumerate(port_peers(plan, r)):
            if self.topology.same_node(r, q):
                peer_inbound.append(ctx.peer_sync[q] + sync_layout(plan, q).port_inbound
                                    + 8 * port_inbound_slots(plan, q)[(r, o)])
                comms.append(None)
            else:
                peer_inbound.append(None)
                comms.append(self._engine.comm((lp.serial, r, q, o)))
        pl = PortLaunch(script, dp.port_area, remote_base,
                        [rb.type for rb in g.remote_buffers], ctx.scratch_base, peer_inbound, comms, incoming,
                        bounds=(in_bytes, out_bytes, ctx.scratch_bytes), abort_word=ctx.sync_base + SYNC_ABORT_OFF)
        self._proxy.prepare(len(script.channels) + len(incoming))
        return pl

    def _promote(self, lp: LoadedPlan, key: tuple, ent: tuple, now: bool = False) -> tuple:
        """Count one more call of a pending entry; at the policy's call count (or ``now``, for
        prepare), outside a graph capture, build its specialised kernel and replace the entry."""
        pend = ent[7]
        pend[0] -= 1
        if (pend[0] > 0 and not now) or self._capturing():
            return ent
        new = self._entry(*pend[1], force=True)
        new = new[:7] + (None,) + new[8:]
        lp.fast[key] = new
        return new

    def _describe_call(self, lp: LoadedPlan, in_bytes: int, out_bytes: int, dt: str, pkt: str, op: str) -> str:
        """What a call is, as the ranks compare it: collective, sizes, dtype, plan, packet and op."""
        plan = lp.plan
        size = f"{in_bytes} B" if in_bytes == out_bytes else f"{in_bytes} B in, {out_bytes} B out"
        extra = f" {pkt.upper()}" if plan.protocol == "LL" else ""
        red = f" {op}" if plan.collective in ("allreduce", "reducescatter") else ""
        return f"{plan.collective} of {size} {dt} on plan {plan.name}{extra}{red}"

    @contextlib.contextmanager
    def _calling(self, desc: str) -> Iterator[None]:
        """Name the call being set up in every store exchange it makes (CallMismatch otherwise)."""
        prev = getattr(self.comm, "call", "")
        try:
            self.comm.call = desc
        except AttributeError:  # a communicator without the attribute (tests' fakes)
            yield
            return
        try:
            yield
        finally:
            self.comm.call = prev

    def _current_stream(self) -> int:
        """The caller's current torch stream (raw handle), without building a Stream object."""
        if self._raw_stream is not None:
            return self._raw_stream(self.comm.device)
        import torch

        return torch.cuda.current_stream().cuda_stream

    def _launch(self, ent: tuple, in_ptr: int, out_ptr: int, in_delta: int, out_delta: int, s: int,
                proxied: bool = False) -> None:
        if ent[9] is not None and not proxied:   # port plan: the proxy's operations around the kernel
            self._launch_port(ent, ent[9], in_ptr, out_ptr, in_delta, out_delta, s)
            return
        f, blob, nb, nt, smem, fh, spec = ent[:7]
        if s != self._last_stream:
            self._order_streams(s)
        if spec is not None and not (in_ptr | out_ptr | in_delta | out_delta) & 15:
            # the specialised kernel assumes 16-byte aligned buffers; others take the interpreter
            a = spec.args
            a[0] = in_ptr
            a[1] = out_ptr
            a[2] = in_delta
            a[3] = out_delta
            a[4] = self.timeout_ns
            sp = spec.spec
            self.last_kernel = "spec"
            raw = self._raw_launch
            if raw is not None and not self.cooperative:
                err = raw(sp.fh, sp.n_blocks, 1, 1, sp.nthreads, 1, 1, 0, s, spec.param_addr, None)
                if err:
                    cu.check(err, "cuLaunchKernel")
                return
            drv = cu.driver()
            launch = drv.cuLaunchCooperativeKernel if self.cooperative else None
            if launch is not None:
                err, = launch(sp.func, sp.n_blocks, 1, 1, sp.nthreads, 1, 1, 0, s, spec.param_addr)
                if int(err) == 0:
                    return
            cu.check(drv.cuLaunchKernel(sp.func, sp.n_blocks, 1, 1, sp.nthreads, 1, 1, 0, s, spec.param_addr, 0),
                     "cuLaunchKernel")
            return
        self.last_kernel = "interpreter"
        p = self._params
        p[0] = blob
        p[1] = in_ptr
        p[2] = out_ptr
        p[3] = in_delta
        p[4] = out_delta
        p[5] = self.timeout_ns
        raw = self._raw_launch
        if raw is not None and not self.cooperative:
            err = raw(fh, nb, 1, 1, nt, 1, 1, smem, s, self._param_addr, None)
            if err:
                cu.check(err, "cuLaunchKernel")
            return
        drv = cu.driver()
        if self.cooperative:
            err, = drv.cuLaunchCooperativeKernel(f, nb, 1, 1, nt, 1, 1, smem, s, self._param_addr)
            if int(err) != 0:
                self.cooperative = False
                cu.check(drv.cuLaunchKernel(f, nb, 1, 1, nt, 1, 1, smem, s, self._param_addr, 0), "cuLaunchKernel")
        else:
            cu.check(drv.cuLaunchKernel(f, nb, 1, 1, nt, 1, 1, smem, s, self._param_addr, 0), "cuLaunchKernel")

    def _launch_port(self, ent: tuple, port: PortLaunch, in_ptr: int, out_ptr: int, in_delta: int, out_delta: int,
                     s: int) -> None:
        """A launch of a port plan: the proxy's stream operations around the kernel."""
        if s != self._last_stream:
            self._order_streams(s)
        try:
            n = self._proxy.before(port, s, in_ptr, out_ptr, in_delta, out_delta)
            self._launch(ent, in_ptr, out_ptr, in_delta, out_delta, s, True)
        except BaseException:
            # side streams may already wait for triggers no kernel will post: release them as an
            # aborting kernel would (nothing to release in a capture: the graph is never made)
            try:
                if not self._stream_capturing(s):
                    self._proxy.release(port, s)
            except Exception:  # noqa: BLE001 - never hide the launch's own error
                log.exception("rank %d: releasing the port side streams after a failed launch failed",
                              self.comm.rank)
            raise
        self._proxy.after(s, n)

    def _order_streams(self, s: int) -> None:
        if self._last_stream is not None and not self._stream_capturing(s):
            # launches sharing a scratch are ordered on the GPU, whatever stream the caller uses
            drv = cu.driver()
            cu.check(drv.cuEventRecord(self._event, self._last_stream), "cuEventRecord")
            cu.check(drv.cuStreamWaitEvent(s, self._event, 0), "cuStreamWaitEvent")
        self._last_stream = s

    # ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Collective reset after a CollectiveTimeout: wait for the GPU, clear flags, counters,
        semaphores, abort words, scratch and the error record on every rank, then meet again."""
        drv = cu.driver()
        self._sync_ports("reset")
        cu.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        self.comm.barrier("reset")
        for lp in self._loaded.values():
            for ctx in [lp.ctx, *lp.retired]:
                if ctx is None:
                    continue
                self._init_sync(lp.plan, ctx.sync, ctx.sync_base)
                cu.memset_d8(ctx.scratch_base, 0, ctx.scratch_bytes, 0)
        cu.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        engine_plans = [lp for lp in self._loaded.values() if lp.engine_keys and lp.serial >= 0]
        if engine_plans:
            # a rank that aborted its communicators (it gave up on a dead or late peer) makes every
            # rank reconnect, the peer that never aborted included; entries are rebuilt on them
            keys = [(lp.serial, *k) for lp in engine_plans for k in lp.engine_keys]
            if self._engine.resync(keys, self.comm.allgather_bytes):
                for lp in engine_plans:
                    lp.fast.clear()
        self._engine.aborted = False
        ctypes.memset(self._err_host, 0, 256)
        self._aborted = False
        self._reported = False
        self._abort_msg = None
        self._abort_gen += 1
        if self._watchdog is not None:
            self._watchdog.rearm()
        self.comm.barrier("reset done")

    def close(self) -> None:
        """Free contexts (retired ones too), device plans and kernels, after the GPU finished with
        them, and stop the watchdog."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        drv = cu.driver()
        if self._engine.comms and self._aborted:
            self._engine.close(abort=True)   # unblocks engine calls waiting for a dead peer
        drv.cuCtxSynchronize()
        self._engine.close()
        self._proxy.close()
        for lp in self._loaded.values():
            for ctx in [lp.ctx, *lp.retired]:
                if ctx is not None:
                    self._free_context(ctx)
            lp.ctx = None
            lp.retired.clear()
        self._loaded.clear()
        self._close_registration()
        for m in self._modules.values():
            drv.cuModuleUnload(m)
        self._modules.clear()
        for m, _ in self._spec_mods.values():
            drv.cuModuleUnload(m)
        self._spec_mods.clear()
        self._funcs.clear()
        if self._err_host:
            cu.host_free(self._err_host)
            self._err_host = 0
