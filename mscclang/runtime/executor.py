"""The GPU executor: runs a plan on the caller's current torch stream through the interpreter kernel
or a kernel specialised to the plan (:mod:`mscclang.runtime.spec_source`). Both kernels keep the
same flags, scratch halves, counters and abort protocol, so they take turns on one context launch by
launch.

The executor is a facade over modules that each own one concern (``docs/architecture.md``):
kernels (:mod:`~mscclang.runtime.kernels`), contexts and device plans
(:mod:`~mscclang.runtime.contexts`), staging (:mod:`~mscclang.runtime.staging`), registration and
capture sessions (:mod:`~mscclang.runtime.capture`), launch entries
(:mod:`~mscclang.runtime.entries`), the raw launcher (:mod:`~mscclang.runtime.launcher`) and the
abort record with the bounded waits (:mod:`~mscclang.runtime.abort`). Every cache decision
depends only on (plan, sizes, dtype, packet type, reduce op), which all ranks share, so every rank
takes the same collective steps in the same order.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Optional, Union, cast

from mscclang.config import Settings, settings
from mscclang.errors import CollectiveTimeout, InvalidCall, NotPrepared, PlanError, RuntimeUnavailable
from mscclang.plan.models import PACKET_OPS, BufferKind, ChannelType, PacketType, Plan
from mscclang.plan.call import Call, Copies, FusedArgs, check_tensor, make_call, sized_call
from mscclang.plan.collectives import collective
from mscclang.plan.dtypes import dtype_info, torch_dtype_code, torch_dtype_info
from mscclang.runtime import cuda as cu
from mscclang.runtime.abort import AbortState, Waits
from mscclang.runtime.capture import CaptureGlue
from mscclang.runtime.bootstrap import Bootstrap
from mscclang.runtime.contexts import ContextPool
from mscclang.runtime.counted import CountedLaunch, run_counted_call, run_counted_launch
from mscclang.runtime.device_plan import MAX_FLAGS, check_runnable, process_work_queues
from mscclang.runtime.engine import Engine, Key as EngineKey, bindings as engine_bindings
from mscclang.runtime.entries import Entries
from mscclang.runtime.epilogue import Epilogue, _fp8_name, epi_plan, pack_args
from mscclang.runtime.kernels import KernelCache
from mscclang.runtime.launcher import Launcher
from mscclang.runtime.proxy import PortLaunch, PortProxy
from mscclang.runtime.staging import StagingPool
from mscclang.runtime.state import (
    Bound, LaunchEntry, LoadedPlan, Operands, Spec, SpecKey, describe_call, packet_code, plan_reduce_op,
    runtime_granule,
)
from mscclang.runtime.topology import topology_from_env

if TYPE_CHECKING:
    from mscclang.runtime.trace import RankTrace

log = logging.getLogger("mscclang.runtime")

__all__ = ["Executor", "Epilogue", "LoadedPlan", "torch_dtype_code", "plan_reduce_op"]

#: distinct copy sets (a staged or copy-in call's) whose copy functions an executor keeps
COPIES_KEPT = 256


class Executor:
    """Runs plans on this rank's GPU. ``comm`` defaults to a Bootstrap over torch.distributed's
    default store; ``timeout_s`` bounds every GPU spin (default 30 s, env MSCCLANG_TIMEOUT_S).
    Co-residency of all blocks is checked with the occupancy API before the first launch of a
    size; ``cooperative=True`` also launches through cuLaunchCooperativeKernel. ``specialize``:
    'auto' (default, env MSCCLANG_SPECIALIZE), 'always' or 'never': when plan-specialised
    kernels are built (in the background; see :mod:`mscclang.runtime.entries`). ``watchdog``:
    what to do when a launch gives up while no host call would notice (CUDA graph replays):
    'raise' (default, env MSCCLANG_ASYNC_ERROR), 'abort' or 'log' (see
    :mod:`mscclang.runtime.abort`).

    It is the collective API's launch part (:class:`mscclang.comm.backend.LaunchPart`:
    :meth:`run_call`, :meth:`launch_bound`, :meth:`prepare_call`, :meth:`fits`, :meth:`granule`,
    :meth:`runnable`, :meth:`trace`), its :attr:`capture` the registry part.

    At about 410 code lines it is the package's one class over 400, on purpose: the launch part's
    entry points share one rank's state (its contexts, entries, kernel cache, staging, port proxy
    and watchdog) and the order in which a launch touches it; the work itself lives in those
    parts' own modules, and a split would pass that state between two objects on every call."""

    #: the interpreter has a traced variant (:meth:`trace`)
    traces = True

    def __init__(self, comm: Optional[Bootstrap] = None, timeout_s: Optional[float] = None,
                 cooperative: bool = False, specialize: Optional[str] = None,
                 watchdog: Optional[str] = None) -> None:
        comm = comm or Bootstrap()
        if timeout_s is None:
            timeout_s = float(settings.timeout_s)
        dev = comm.device
        cc = (cu.device_attribute(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
              cu.device_attribute(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"))
        self._last_call: Optional[str] = None
        abort = AbortState(comm, lambda: self._last_call, watchdog,
                           poll_s=float(settings.watchdog_poll_s))
        self._assemble(comm, f"sm_{cc[0]}{cc[1]}", cu.device_attribute(dev, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
                       int(timeout_s * 1e9), Settings.specialize.or_env(specialize), Launcher(dev, cooperative), abort)
        if self.specialize != "never":
            # NVRTC found and loaded now, on this thread, at set-up: done by the first background
            # build instead, its library search and import hold the GIL (and the import lock)
            # while a call runs on this thread (measured: a 145 ms second call of a small size)
            self.kernels.warm()

    def _assemble(self, comm: Any, arch: str, sm_count: int, timeout_ns: int, specialize: str, launcher: Any,
                  abort: Any, topology: Any = None) -> None:
        """Build the collaborators around ``comm``, the ``launcher`` and the ``abort`` record (the
        constructor's second half; tests assemble an executor on fakes with it)."""
        self.comm = comm
        self.timeout_ns = timeout_ns
        self._loaded: dict[int, LoadedPlan] = {}
        #: the copy functions of each Copies a call brought (:meth:`_copiers`), the latest COPIES_KEPT
        self._copies: dict[Copies, tuple[tuple, tuple]] = {}
        self._runnable: dict[int, tuple[Plan, Optional[str]]] = {}   # id(plan) -> (plan, reason or None)
        self._forced_granule = settings.comm_granule
        if not hasattr(self, "_last_call"):
            self._last_call = None
        self.arch = arch
        self._sm_count = sm_count
        #: which ranks share a node (launcher's LOCAL_WORLD_SIZE, MSCCLANG_GPUS_PER_NODE overrides)
        self.topology = topology if topology is not None else topology_from_env(comm.world_size)
        self.specialize = specialize
        self.launcher = launcher
        self.abort = abort
        self._engine = Engine(comm.rank)
        self._proxy = PortProxy(self._engine.send, self._engine.recv)
        self.waits = Waits(comm.rank, lambda: self.timeout_ns, abort, launcher, lambda: self._proxy,
                           lambda: self._engine)
        capturing = lambda: self._capturing()  # noqa: E731 - looked up per call (tests replace it)
        capturing_now = lambda: self.launcher.capturing_now()  # noqa: E731
        self.kernels = KernelCache(arch, sm_count)
        self.contexts = ContextPool(comm, self.topology, self._engine, abort.dev, capturing)
        # a plan's own staging is internal (its entries stage into it); the collective API's padded
        # staging is symmetric to the plans that run on it (reported as staging)
        alloc = lambda n, api: (comm._sym_alloc(n, label="staging") if api  # noqa: E731
                                else comm._sym_alloc(n, internal=True))
        self.staging = StagingPool(alloc, self._release, comm.barrier, settings.staging_cap_bytes, capturing, comm.rank,
                                   floor=settings.staging_min_bytes)
        self.capture = CaptureGlue(comm, self._forget, capturing, capturing_now, abort.dev, self._check_tensor)
        self.entries = Entries(comm, self.kernels, self.contexts, self.staging, self.capture, self.topology,
                               self._engine, self._proxy, lambda: self.specialize, capturing, capturing_now)

    @property
    def last_kernel(self) -> str:
        """'spec' or 'interpreter': the kernel of the latest launch."""
        return self.launcher.last_kernel

    @property
    def cooperative(self) -> bool:
        """Whether launches go through cuLaunchCooperativeKernel."""
        return self.launcher.cooperative

    @cooperative.setter
    def cooperative(self, value: bool) -> None:
        self.launcher.cooperative = bool(value)

    def set_specialize(self, mode: str) -> None:
        """Switch the kernel policy ('auto', 'always', 'never'); later calls re-pick their kernel."""
        self.specialize = Settings.specialize.or_env(mode)
        for lp in self._loaded.values():
            self.entries.clear(lp)

    # loading ----------------------------------------------------------------------------------
    def runnable(self, plan: Plan) -> Optional[str]:
        """Why this executor cannot run ``plan`` (None when it can): the load-time checks, without
        keeping the plan (their answer is kept)."""
        got = self._runnable.get(id(plan))
        if got is None or got[0] is not plan:
            try:
                self._accept(plan)
                got = (plan, None)
            except PlanError as e:
                got = (plan, str(e))
            self._runnable[id(plan)] = got
        return got[1]

    def granule(self, plan: Plan) -> int:
        """Bytes every block of a collective API call of ``plan`` must be a multiple of:
        :func:`~mscclang.runtime.state.runtime_granule`, or ``$MSCCLANG_COMM_GRANULE`` when set."""
        return self._forced_granule or runtime_granule(plan)

    def _accept(self, plan: Plan) -> int:
        r = self.comm.rank
        if plan.world_size != self.comm.world_size:
            raise PlanError(f"the plan has {plan.world_size} ranks but the communicator has "
                            f"{self.comm.world_size}", "gpus")
        check_runnable(plan, allow_switch=bool(settings.enable_nvls), topology=self.topology,
                       work_queues=process_work_queues())
        nb = len(plan.gpus[r].threadblocks)
        if nb > MAX_FLAGS:
            raise PlanError(f"rank {r} has {nb} thread blocks; the kernel supports {MAX_FLAGS}",
                            f"gpus[{r}].threadblocks")
        if nb > self._sm_count:
            raise PlanError(f"rank {r} has {nb} thread blocks but the device has {self._sm_count} "
                            "multiprocessors; the kernel runs one block per multiprocessor and needs all blocks "
                            "co-resident", f"gpus[{r}].threadblocks")
        return nb

    def load(self, plan: Plan) -> LoadedPlan:
        """Check ``plan`` once (refusing what this executor cannot run) and remember it."""
        lp = self._loaded.get(id(plan))
        if lp is not None and lp.plan is plan:
            return lp
        nb = self._accept(plan)
        # zero-copy: a rank maps a peer's input/output (peers on other nodes are reached through the
        # engine, which receives into the caller's own tensors: no symmetric buffers needed)
        zero_copy = any(rb.type != BufferKind.scratch and self.topology.same_node(g.id, rb.rank)
                        for g in plan.gpus for rb in g.remote_buffers)
        lp = LoadedPlan(plan, zero_copy, packet_code(plan.packet_type.value if plan.packet_type else None),
                        plan_reduce_op(plan), plan.num_threads_per_block, nb)
        lp.has_port = any(g.peers(ChannelType.port) for g in plan.gpus)
        lp.epi = epi_plan(plan)
        lp.packets = any(op.name in PACKET_OPS or any(i.name in PACKET_OPS for i in (op.ops or []))
                         for tb in plan.gpus[self.comm.rank].threadblocks for op in tb.ops)
        lp.engine_keys = [EngineKey(-1, g.id, c.peer, c.ordinal) for g in plan.gpus
                          for c in plan.channel_ordinals(g.id, ChannelType.port)
                          if not self.topology.same_node(g.id, c.peer)]
        if lp.engine_keys:
            engine_bindings()   # RuntimeUnavailable now, naming nccl4py, rather than at the first call
        self._loaded[id(plan)] = lp
        return lp

    def _loaded_plan(self, plan: Union[Plan, LoadedPlan]) -> LoadedPlan:
        if isinstance(plan, LoadedPlan):
            return plan
        lp = self._loaded.get(id(plan))
        if lp is None or lp.plan is not plan:
            lp = self.load(plan)
        return lp

    # calls ------------------------------------------------------------------------------------
    def fits(self, plan: Plan, in_bytes: int, out_bytes: int, packet_type: Any = None) -> bool:
        """Whether ``plan`` runs a call of these sizes as it is: its packet offsets allow the
        packet type (LL16 needs 8-byte alignment, LL8 4). Asked before a call, so the collective
        API pads and stages the sizes that do not fit instead of learning it from a refusal."""
        lp = self.load(plan)
        if not lp.packets:
            return True
        pkt = packet_code(packet_type) if packet_type is not None else lp.default_packet
        packed = self.contexts.packed(lp, in_bytes, out_bytes)
        return not (packed.uses_packets and packed.packet_align < PacketType.of(pkt).align)

    def prepare(self, plan: Plan, input: Any, output: Any = None, dtype: Any = None,
                packet_type: Any = None, reduce_op: Any = None, accum_dtype: Any = None,
                epilogue: Optional[Epilogue] = None) -> None:
        """Do every first-time step of a call outside CUDA graph capture, so the same call can
        then be captured: load the kernel and build the specialised one (at any size the policy
        allows), create the context, staging and the device plan. ``input``/``output``: the
        tensors of the call to come (the same ones: a zero-copy plan's entry depends on whether
        they are symmetric), checked as :meth:`execute` checks them; or byte counts (``output``
        defaults from the collective) of ordinary tensors of ``dtype`` (default float16).
        ``accum_dtype`` and ``epilogue`` (a fused plan's; its hidden size decides a row-chunked
        plan's chunks) as for :meth:`execute`. Collective: every rank calls it with the same
        arguments."""
        lp = self.load(plan)
        r, n = self.comm.rank, self.comm.world_size
        op = reduce_op if reduce_op is not None else lp.default_op
        hidden = epilogue.hidden if isinstance(epilogue, Epilogue) else 0
        if hasattr(input, "data_ptr"):
            output = input if output is None else output
            if lp.epi is None:
                call = self.call(lp, input, output, op, accum_dtype)
            else:   # the fused call's sizes and rows (its residual and weight come with each call)
                check_tensor(input, "input", r, self.comm.device)
                check_tensor(output, "output", r, self.comm.device)
                call = sized_call(plan.collective, r, n, torch_dtype_info(input.dtype), input.numel() * input.element_size(),
                                  output.numel() * output.element_size(), op, None, input.data_ptr(),
                                  output.data_ptr(), hidden)
        else:
            info = torch_dtype_info(dtype) if dtype is not None else dtype_info("float16")
            if info is None or not info.gpu:
                raise InvalidCall(f"rank {r}: dtype {dtype} is not one the GPU runs")
            in_bytes = int(input)
            out_bytes = collective(plan.collective).output_elems(n, in_bytes) if output is None else int(output)
            # ordinary tensors: their addresses play no part in the entry (zero-copy plans stage)
            call = sized_call(plan.collective, r, n, info, in_bytes, out_bytes, op, accum_dtype, hidden=hidden)
        self.prepare_call(lp, call, packet_type)

    def prepare_call(self, plan: Union[Plan, LoadedPlan], call: Call, packet_type: Any = None) -> None:
        """:meth:`prepare` of a checked ``call`` (the collective API's)."""
        lp = self._loaded_plan(plan)
        self.entries.resolve(lp, call, self._packet(lp, packet_type), self.launcher.current_stream(), prepare=True)

    def call(self, plan: Union[Plan, LoadedPlan], input: Any, output: Any, reduce_op: Any = None,
             accum_dtype: Any = None, residual: Any = None, weight: Any = None,
             epilogue: Optional[Epilogue] = None) -> Call:
        """The :class:`~mscclang.plan.call.Call` of running ``plan`` on these tensors, checked
        once (:func:`~mscclang.plan.call.make_call`: the tensors, sizes, layout and fused
        arguments) and against the plan (its in-place rule; a fused plan takes its residual,
        weight and ``epilogue``, the others none): InvalidCall naming what is wrong."""
        lp = self._loaded_plan(plan)
        r = self.comm.rank
        op = reduce_op if reduce_op is not None else lp.default_op
        epi = None
        if lp.epi is not None or residual is not None or weight is not None or epilogue is not None:
            if lp.epi is None:
                raise InvalidCall(f"rank {r}: plan {lp.plan.name} has no epilogue ops: it takes no residual, weight "
                                  "or epilogue")
            if not isinstance(epilogue, Epilogue):
                raise InvalidCall(f"rank {r}: plan {lp.plan.name} has epilogue ops: pass epilogue=Epilogue(hidden=..., "
                                  f"eps=...), got {type(epilogue).__name__}")
            epi = FusedArgs(residual, weight, epilogue.eps, epilogue.scale, epilogue.hidden)
        call = make_call(lp.plan.collective, r, self.comm.world_size, self.comm.device, input, output, op,
                         accum_dtype, epi, owner="executor")
        if call.empty:
            raise InvalidCall(f"rank {r}: {lp.plan.collective} on empty tensors")
        if epi is not None and epilogue.fp8 is not None and call.epi.fp8 != _fp8_name(epilogue.fp8):
            raise InvalidCall(f"rank {r}: the fp8 type {epilogue.fp8} differs from the output's dtype {output.dtype}")
        call.check_plan(lp.plan)
        return call

    def execute(self, plan: Union[Plan, LoadedPlan], input: Any, output: Any, packet_type: Any = None,
                reduce_op: Any = None, stream: Any = None, accum_dtype: Any = None, *, residual: Any = None,
                weight: Any = None, epilogue: Optional[Epilogue] = None) -> Optional[Bound]:
        """Run ``plan`` on this rank with torch tensors ``input``/``output`` on the current torch
        stream (or ``stream``). ``packet_type``: 'LL16' (default) or 'LL8'; ``reduce_op``: overrides
        the plan's sum/min/max. An in-place plan (``plan.inplace``) runs only on the in-place layout
        (the same tensor; allgather: the input is this rank's block of the output; reduce-scatter:
        the output is this rank's block of the input), an out-of-place plan only on buffers that do
        not overlap. The tensors are checked (CUDA on this executor's device, dtype, contiguity,
        sizes, layout) before anything reaches the GPU: :class:`~mscclang.errors.InvalidCall`.
        ``accum_dtype``: the accumulation dtype of an fp8 reduction (float32, the default, or
        float16; docs/semantics.md), InvalidCall for any other dtype. Collective: every rank
        calls it in the same order.

        A plan with epilogue ops (``allreduce_add_rms_norm``, plan/2) also takes this rank's
        ``residual`` (read and written), the norm ``weight`` and ``epilogue`` (H, eps, FP8 scale
        and type): :func:`~mscclang.plan.call.make_call` checks them and
        :func:`mscclang.runtime.epilogue.pack_args` matches them with the plan; other plans refuse
        them. Capturable in a CUDA graph after :meth:`prepare`. Returns what :meth:`run_call`
        returns (a :class:`Bound` to launch again with :meth:`launch_bound`, or None)."""
        ab = self.abort
        if ab.aborted or ab.state():
            ab.check()
        lp = self._loaded_plan(plan)
        call = self.call(lp, input, output, reduce_op, accum_dtype, residual, weight, epilogue)
        return self.run_call(lp, call, packet_type, stream=stream)

    def run_call(self, plan: Union[Plan, LoadedPlan], call: Call, packet_type: Any = None,
                 copies: Optional[Copies] = None, stream: Any = None) -> Optional[Bound]:
        """Launch a checked ``call`` of ``plan`` (:meth:`call`; the collective API hands its own,
        so a call is checked once) on the current stream (or ``stream``), with ``copies`` (the
        collective API's staging and copy-in) enqueued before and after it. Returns a :class:`Bound`
        when the same call may be launched again with :meth:`launch_bound`, checking and resolving
        nothing (None when it must be resolved at every launch: registered tensors, whose uses are
        counted; a capture session; a CUDA graph capture; the executor's own staging). A size
        whose specialised kernel is still wanted is bound too: :meth:`launch_bound` counts its
        calls and gives the binding up once the kernel is built."""
        if call.counted is not None:   # a plan with segments (mscclang.runtime.counted)
            run_counted_call(self, plan if isinstance(plan, Plan) else plan.plan, call, packet_type, stream)
            return None
        ab = self.abort
        if ab.aborted or ab.state():
            ab.check()
        lp = self._loaded_plan(plan)
        pkt = self._packet(lp, packet_type)
        s = self.launcher.current_stream() if stream is None else int(getattr(stream, "cuda_stream", stream))
        ab.user_thread = threading.get_ident()
        epi = None
        if lp.epi is not None:
            epi = pack_args(lp.epi, lp.plan, call, self.arch, lambda: self.contexts.packed(
                lp, call.in_bytes, call.out_bytes, self._row(lp, call)).norms)
        ent, opr = self.entries.resolve(lp, call, pkt, s)
        self._last_call = describe_call(lp.plan, call.in_bytes, call.out_bytes, call.kernel_code, pkt, call.op)
        before, after = self._copiers(copies)
        for f in before:
            f(s)
        self.run(lp, ent, opr, call.in_ptr, call.out_ptr, call.in_bytes, call.out_bytes, s, epi)
        for f in after:
            f(s)
        return self._bound(lp, call, ent, opr, pkt, epi, s, before, after)

    def _copiers(self, copies: Optional[Copies]) -> tuple[tuple, tuple]:
        """``copies`` as functions of the stream (:func:`mscclang.runtime.cuda.copier`), built once
        per distinct Copies: a call that is not bound (a specialised kernel still building, say)
        finds them again."""
        if copies is None:
            return (), ()
        got = self._copies.get(copies)
        if got is None:
            if len(self._copies) >= COPIES_KEPT:
                self._copies.pop(next(iter(self._copies)))
            got = self._copies[copies] = (tuple(map(cu.copier, copies.before)), tuple(map(cu.copier, copies.after)))
        return got

    def execute_counted(self, plan: Plan, input: Any, output: Any, launch: CountedLaunch, packet_type: Any = None,
                        stream: Any = None) -> None:
        """Run a plan with segments (data-dependent counts): see
        :func:`mscclang.runtime.counted.run_counted_launch`."""
        run_counted_launch(self, plan, input, output, launch, packet_type, stream)

    def _packet(self, lp: LoadedPlan, packet_type: Any) -> str:
        return packet_code(packet_type) if packet_type is not None else lp.default_packet

    @staticmethod
    def _row(lp: LoadedPlan, call: Call) -> int:
        """The input row bytes the layout of a row-chunked plan needs (0 for every other plan)."""
        return call.row_bytes if lp.plan.chunk_unit == "row" else 0

    def _bound(self, lp: LoadedPlan, call: Call, ent: LaunchEntry, opr: Operands, pkt: str, epi: Optional[bytes],
               s: int, before: tuple = (), after: tuple = ()) -> Optional[Bound]:
        """What :meth:`run_call` returns (see there)."""
        reg = self.capture.registry
        session = None if reg is None else reg.sessions.session
        if self.launcher.stream_capturing(s) or session is not None or (reg is not None and reg.verify):
            return None
        key = self.entries.last_key
        if (key is None or opr.mode == "staged"
                or not all(isinstance(b, int) for b in key.buffers())):
            return None   # registered tensors (not symmetric ones): their uses are counted at every call
        return Bound(lp, key, ent, opr, call, describe_call(lp.plan, call.in_bytes, call.out_bytes, call.kernel_code,
                                                            pkt, call.op), pkt, self.entries.epoch, epi, before, after,
                     (id(lp), key))

    def execute_traced(self, plan: Union[Plan, LoadedPlan], input: Any, output: Any, packet_type: Any = None,
                       reduce_op: Any = None, accum_dtype: Any = None) -> "RankTrace":
        """:meth:`execute` once through the interpreter's traced variant, then wait for it: this
        rank's :class:`~mscclang.runtime.trace.RankTrace` (Chrome trace events, one per plan op,
        in microseconds from the rank's first op, its global-timer start, and where the launch
        departed from the plan's op order). Untraced calls never run the traced kernel.
        Collective like :meth:`execute`; never inside a CUDA graph capture."""
        lp = self._loaded_plan(plan)
        self._traceable(lp)
        return self.trace(lp, self.call(lp, input, output, reduce_op, accum_dtype), packet_type)

    def _traceable(self, lp: LoadedPlan) -> None:
        """A traced launch of ``lp`` may start: no abort pending, no capture, no epilogue ops."""
        ab = self.abort
        if ab.aborted or ab.state():
            ab.check()
        if self._capturing():
            raise NotPrepared(f"rank {self.comm.rank}: a traced launch cannot be captured in a CUDA graph")
        if lp.epi is not None:
            raise InvalidCall(f"rank {self.comm.rank}: plan {lp.plan.name} has epilogue ops, which have no traced "
                              "kernel")

    def trace(self, plan: Union[Plan, LoadedPlan], call: Call, packet_type: Any = None,
              copies: Optional[Copies] = None) -> "RankTrace":
        """:meth:`execute_traced` of a checked ``call`` (:meth:`call`; the collective API's, with
        its ``copies`` around the traced kernel, untraced; a counted call's trace carries its
        segments' rows and bytes)."""
        import dataclasses

        if call.counted is not None:   # a plan with segments (mscclang.runtime.counted)
            got = run_counted_call(self, plan if isinstance(plan, Plan) else plan.plan, call, packet_type, traced=True)
            return cast("RankTrace", got)

        from mscclang.runtime.entries import device_plan_of
        from mscclang.runtime.trace import decode, run_traced

        lp = self._loaded_plan(plan)
        self._traceable(lp)
        pkt = self._packet(lp, packet_type)
        s = self.launcher.current_stream()
        ent, opr = self.entries.resolve(lp, call, pkt, s, count=False)
        self._last_call = describe_call(lp.plan, call.in_bytes, call.out_bytes, call.kernel_code, pkt, call.op) + " (traced)"
        dp = device_plan_of(lp, ent)
        if dp is None:
            raise RuntimeUnavailable(f"rank {self.comm.rank}: no device plan for the traced launch")
        f = self.kernels.interpreter(call.kernel_code, pkt, call.op, lp.nthreads, traced=True)
        self.kernels.fit(f, lp.nthreads, dp.smem, dp.n_blocks, f"rank {self.comm.rank}", dp.uses_packets,
                         dp.packet_align, pkt)
        before, after = self._copiers(copies)
        for c in before:
            c(s)
        words = run_traced(self.launcher, [b.n_records for b in dp.packed.blocks], s, lambda: self.run(
            lp, dataclasses.replace(ent, func=f, handle=cu.ptr(f), spec=None), opr, call.in_ptr, call.out_ptr,
            call.in_bytes, call.out_bytes, s))
        for c in after:
            c(s)
        return decode(lp.plan, self.comm.rank, [b.region for b in dp.packed.blocks], words)

    def launch_bound(self, b: Bound, stream: Any = None) -> bool:
        """Launch a call :meth:`run_call` returned as bound, on the current stream (or
        ``stream``), checking nothing again; False (nothing launched) when the binding is stale or
        the call must be resolved now (a capture, a capture session, its specialised kernel just
        built): call :meth:`execute` instead."""
        if b.epoch != self.entries.epoch:
            return False
        ab = self.abort
        if ab.aborted or ab.word.value:   # AbortState.state() without the call: the memo hit's path
            ab.check()
        s = self.launcher.current_stream() if stream is None else int(getattr(stream, "cuda_stream", stream))
        reg = self.capture.registry
        if self.launcher.stream_capturing(s) or (reg is not None and reg.sessions.session is not None):
            return False
        if (b.entry.pending is not None
                and self.entries.advance(b.lp, b.key, b.entry, capturing=False) is not b.entry):
            return False   # its specialised kernel is built (or given up): resolved and bound again
        ab.user_thread = threading.get_ident()
        self._last_call = b.desc
        self.entries.touch(b.recent)
        c = b.call
        for f in b.before:
            f(s)
        self.run(b.lp, b.entry, b.operands, c.in_ptr, c.out_ptr, c.in_bytes, c.out_bytes, s, b.epi)
        for f in b.after:
            f(s)
        return True

    def run(self, lp: LoadedPlan, ent: LaunchEntry, opr: Operands, in_ptr: int, out_ptr: int, in_bytes: int,
            out_bytes: int, s: int, epi: Optional[bytes] = None) -> None:
        """Launch a resolved call: on the caller's buffers, on symmetric or registered ones, or
        through the plan's staging (copied in and out on stream ``s``). ``epi``: the call's
        ``EpiArgs`` (an epilogue plan's entry)."""
        if opr.mode == "direct":
            self._launch(ent, in_ptr, out_ptr, 0, 0, s, epi)
        elif opr.mode == "sym":
            self._launch(ent, in_ptr, out_ptr, opr.in_delta, opr.out_delta, s, epi)
        else:
            st_in, st_out = opr.stage_in, opr.stage_out
            if lp.plan.inplace:
                # the input lies in the output (in-place layout): stage the whole output
                cu.dtod(st_out.base, out_ptr, out_bytes, s)
                delta = in_ptr - out_ptr
                self._launch(ent, st_out.base + delta, st_out.base, delta, 0, s, epi)
            else:
                cu.dtod(st_in.base, in_ptr, in_bytes, s)
                self._launch(ent, st_in.base, st_out.base, 0, 0, s, epi)
            cu.dtod(out_ptr, st_out.base, out_bytes, s)
            if st_in.temp or st_out.temp:   # staging above the cap: released once this call is done
                self.staging.release([st_in, st_out], "staging above the cap")

    def _launch(self, ent: LaunchEntry, in_ptr: int, out_ptr: int, in_delta: int, out_delta: int, s: int,
                epi: Optional[bytes] = None) -> None:
        if ent.port is None:
            self.launcher.launch(ent, in_ptr, out_ptr, in_delta, out_delta, s, self.timeout_ns, epi)
            return
        self._launch_port(ent, ent.port, in_ptr, out_ptr, in_delta, out_delta, s, epi)

    def _launch_port(self, ent: LaunchEntry, port: PortLaunch, in_ptr: int, out_ptr: int, in_delta: int,
                     out_delta: int, s: int, epi: Optional[bytes] = None) -> None:
        """A launch of a port plan: the proxy's stream operations around the kernel."""
        self.launcher.order(s)
        try:
            n = self._proxy.before(port, s, in_ptr, out_ptr, in_delta, out_delta)
            self.launcher.launch(ent, in_ptr, out_ptr, in_delta, out_delta, s, self.timeout_ns, epi)
        except BaseException:
            # side streams may already wait for triggers no kernel will post: release them as an
            # aborting kernel would (nothing to release in a capture: the graph is never made)
            try:
                if not self.launcher.stream_capturing(s):
                    self._proxy.release(port, s)
            except Exception:  # noqa: BLE001 - never hide the launch's own error
                log.exception("rank %d: releasing the port side streams after a failed launch failed",
                              self.comm.rank)
            raise
        self._proxy.after(s, n)

    def _check_tensor(self, t: Any, what: str) -> None:
        check_tensor(t, what, self.comm.rank, self.comm.device)

    def _capturing(self) -> bool:
        import torch

        return bool(torch.cuda.is_current_stream_capturing())

    # staging --------------------------------------------------------------------------------------
    def _release(self, allocs: list, why: str) -> None:
        """Free symmetric allocations and everything built on them, once every rank's GPU
        finished its work and the ranks met (so no peer still reads or writes them)."""
        cu.check(cu.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        self.comm.barrier(f"release {why}")
        self._forget({a.index for a in allocs})
        self.comm._sym_release(allocs)

    def _forget(self, idx: set) -> None:
        """What staging and registration call when buffers are released (device idle)."""
        self.entries.forget(list(self._loaded.values()), idx)

    # reports ------------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """GPU memory this executor holds, in bytes (device allocations it made; symmetric buffers
        are the communicator's): ``scratch`` and ``sync`` of live contexts, ``retired_scratch`` /
        ``retired_sync`` of outgrown ones, ``device_plans``, ``graph_arena`` (capture sessions),
        and the counts ``contexts``, ``retired_contexts``, ``launch_entries``, ``kernels``
        (modules loaded), ``evicted_entries``."""
        out = dict(scratch=0, sync=0, retired_scratch=0, retired_sync=0, device_plans=0, contexts=0,
                   retired_contexts=0, launch_entries=0, kernels=self.kernels.count(),
                   graph_arena=self.capture.arena_bytes(), evicted_entries=self.entries.evicted)
        for lp in self._loaded.values():
            out["launch_entries"] += len(lp.fast)
            self.contexts.memory(lp, out)
        return out

    def spec_status(self, plan: Plan) -> dict[SpecKey, str]:
        """Per specialised kernel (:class:`~mscclang.runtime.state.SpecKey`) seen so far: how the
        specialised kernel was obtained ('spec NT threads, origin') or why the interpreter runs."""
        lp = self._loaded.get(id(plan))
        if lp is None:
            return {}
        return {k: (f"spec {v.nthreads} threads x {v.n_blocks} blocks, {v.steps} steps, {v.origin}"
                    if isinstance(v, Spec) else v) for k, v in lp.spec.items()}

    # aborts and waits -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise CollectiveTimeout if a launch of this executor gave up (until reset())."""
        self.abort.check()

    def synchronize(self) -> None:
        """Wait for this executor's launches and raise CollectiveTimeout if one gave up; bounded
        (:meth:`mscclang.runtime.abort.Waits.synchronize`). The device is idle then: the mappings
        of registered tensors that died here are released (their peers' memory is freed once every
        rank has done so), without waiting for the next registration step."""
        self.waits.synchronize()
        reg = self.capture.registry
        if reg is not None:
            reg.prune()

    def describe_call(self, desc: str) -> None:
        """Name the call being set up (``""`` when done): the communicator's collective setup
        steps name it when the ranks disagree."""
        self.comm.call = desc

    # lifetime ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Collective reset after a CollectiveTimeout: wait for the GPU, clear flags, counters,
        semaphores, abort words, scratch and the error record on every rank, then meet again."""
        drv = cu.driver()
        self.abort.acknowledge()
        self.waits.ports("reset")
        cu.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        self.comm.barrier("reset")
        for lp in self._loaded.values():
            self.contexts.reset(lp)
        cu.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        engine_plans = [lp for lp in self._loaded.values() if lp.engine_keys and lp.serial >= 0]
        if engine_plans:
            # a rank that aborted its communicators makes every rank reconnect; entries are rebuilt
            keys = [k for lp in engine_plans for k in lp.engine_keys]
            if self._engine.resync(keys, self.comm.allgather_bytes):
                for lp in engine_plans:
                    self.entries.clear(lp)
        self._engine.aborted = False
        self.abort.rearm()
        self.comm.barrier("reset done")

    def close(self) -> None:
        """Free contexts (retired ones too), device plans and kernels, after the GPU finished with
        them, and stop the watchdog. Always returns: a pending abort is logged, not raised."""
        try:
            self.abort.close()   # held launches may end: nobody will read their results
            drv = cu.driver()
            if self._engine.comms and self.abort.pending():
                self._engine.close(abort=True)   # unblocks engine calls waiting for a dead peer
            drv.cuCtxSynchronize()
            self._engine.close()
            self._proxy.close()
            for lp in self._loaded.values():
                self.contexts.free(lp)
            self._loaded.clear()
            self.capture.close()
            self.staging.clear()
            self.kernels.close()
            self.abort.free()
        except CollectiveTimeout as e:   # e.g. delivered by the watchdog while closing
            log.warning("rank %d: close() after an abort: %s", self.comm.rank, e)
