"""torch.distributed (NCCL on CUDA, gloo on the CPU) for what the library cannot do.

Where the group comes from:

* a process group handed in (``group``): torch.distributed's collectives on that group;
* a store (the communicator was built from ``store``/``rank``/``world_size``, or its back end
  has a store, like the GPU test workers' runtime): a process-group back end of its own over
  that store, created on the first fallback call (every rank reaches it at the same call, since
  every rank selects the same way). It is not registered with torch.distributed, so it neither
  needs nor changes torch.distributed's default group, and it goes away with the communicator;
* neither: torch.distributed's default group, when it is initialised.

Before every gloo collective the ranks compare their calls (:class:`FallbackCalls`): ranks
making different calls get CallMismatch instead of gloo's abort. NVLink multicast (NVLS) stays
off: ``NCCL_NVLS_ENABLE=0`` is set before an NCCL group is made.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
from typing import Any, Optional

import numpy as np

from mscclang.comm.errors import CommError
from mscclang.config import nccl_env, settings
from mscclang.errors import InvalidCall
from mscclang.plan.call import Call, overlap
from mscclang.plan.collectives import collective as collective_row
from mscclang.plan.dtypes import ACCUM_DTYPES, gpu_dtype, torch_dtype_info
from mscclang.plan.reference import fp8_sum_arrays
from mscclang.runtime.store_group import StoreGroup

log = logging.getLogger("mscclang.comm")

#: Default time a fallback collective may wait for its peers.
DEFAULT_TIMEOUT_S = 300.0


def _torch_op(op: str) -> Any:
    import torch.distributed as dist

    return {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]


def torch_backend_for(device_type: str) -> str:
    """The torch.distributed backend that carries ``device_type`` tensors between ranks here:
    NCCL for CUDA, gloo otherwise, and gloo for CUDA too when ranks share a GPU
    (``MSCCLANG_RANKS_PER_GPU`` above 1), which NCCL refuses ("Duplicate GPU detected")."""
    from mscclang.runtime.workers import nccl_refusal

    return "nccl" if device_type == "cuda" and nccl_refusal() is None else "gloo"


@functools.cache
def _host_work_class() -> type:
    import torch.distributed as dist

    class HostWork(dist.Work):
        """The Work of a :class:`HostStaged` call: ``wait()`` waits for the host call, then
        copies the staged tensors of the call's outputs back into the caller's (once)."""

        def __init__(self, work: Any, pairs: list) -> None:
            super().__init__()
            self._work, self._pairs = work, pairs

        def wait(self, timeout: Any = None) -> bool:
            if self._work is not None and hasattr(self._work, "wait"):
                self._work.wait() if timeout is None else self._work.wait(timeout)
            for dev, h in self._pairs:
                dev.copy_(h)
            self._work, self._pairs = None, []
            return True

        def is_completed(self) -> bool:
            return self._work is None or bool(getattr(self._work, "is_completed", lambda: False)())

    return HostWork


def _host_copy(x: Any) -> Any:
    """What gloo is given instead of tensor ``x`` (None: ``x`` itself): a host copy of a CUDA
    tensor, a contiguous copy of a non-contiguous one (gloo's all_reduce, broadcast, reduce,
    list reduce_scatter, all_to_all_single and scatter read a strided tensor as if it were dense:
    wrong results, no error)."""
    if getattr(x, "is_cuda", False):
        return x.detach().cpu().contiguous()
    return x.contiguous() if hasattr(x, "is_contiguous") and not x.is_contiguous() else None


class HostStaged:
    """A gloo process group's back end that is only given host tensors gloo handles: each call
    replaces every tensor it is given (in lists too) that gloo cannot take as it is by a copy
    (:func:`_host_copy`: CUDA tensors, non-contiguous tensors) and runs on the copies; its Work's
    ``wait()`` copies those of the call's first argument (torch's process groups take the outputs
    first) back into the caller's tensors, so an input that lies in an output is never written
    back over the result. A call returns as soon as the host call is issued, so a send never
    waits for its receiver. Every gloo group of the fallback and of the torch.distributed backend
    runs through one (for CUDA tensors: ranks sharing a GPU, where NCCL cannot run and gloo has
    no CUDA path for most calls; its CUDA send aborts the process)."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._pg, name)
        if not callable(fn):
            return fn

        def call(*args: Any, **kw: Any) -> Any:
            pairs: list = []

            def host(x: Any, back: bool) -> Any:
                if isinstance(x, list):
                    return [host(y, back) for y in x]
                h = _host_copy(x)
                if h is None:
                    return x
                if back:
                    pairs.append((x, h))
                return h

            work = fn(*[host(a, i == 0) for i, a in enumerate(args)], **{k: host(v, False) for k, v in kw.items()})
            if not pairs or not hasattr(work, "wait"):
                return work
            return _host_work_class()(work, pairs)

        return call


class TorchFallback:
    """Collectives through torch.distributed for one rank (see the module docstring for where
    the group comes from). ``timeout_s`` bounds each collective of a group made from a store."""

    def __init__(self, group: Any = None, *, store: Any = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, device: Any = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._group = group
        self._store = store
        self._rank = rank
        self._world = world_size
        self._device = device
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._pg: Any = None  # our own back end over the store
        self._ready = group is not None

    # ------------------------------------------------------------------ the group
    @property
    def timeout_s(self) -> float:
        """How long a fallback collective may wait for its peers: this fallback's bound for a
        group made here, else the torch.distributed group's own (torch's default where its back
        end does not say)."""
        import torch
        import torch.distributed as dist

        if self._store is not None and self._group is None:
            return self._timeout.total_seconds()
        try:
            pg = self._group if self._group is not None else dist.distributed_c10d._get_default_group()
            return float(pg._get_backend(torch.device(getattr(self._device, "type", "cpu"))).options._timeout
                         .total_seconds())
        except Exception:  # noqa: BLE001 - a group whose back end has no options (a Python group)
            return getattr(self._group, "_timeout", dist.default_pg_timeout).total_seconds()

    @property
    def backend_name(self) -> str:
        """:func:`torch_backend_for` the communicator's device."""
        return torch_backend_for(getattr(self._device, "type", "cpu"))

    def _setup(self) -> None:
        if self._ready:
            return
        import torch.distributed as dist

        if self._store is not None:
            if self._rank is None or self._world is None:
                raise CommError("the torch.distributed fallback over a store needs rank and world_size")
            try:
                self._pg = self._make_backend(dist)
            except CommError:
                raise
            except Exception as e:  # noqa: BLE001 - a torch whose back-end classes differ
                if dist.is_initialized():
                    raise
                # every rank fails alike: make torch.distributed's default group instead
                log.warning("mscclang rank %s: cannot make a private %s group (%s: %s); "
                            "initialising torch.distributed's default group from the store",
                            self._rank, self.backend_name, type(e).__name__, e)
                self._init_default_group(dist)
        elif not (dist.is_available() and dist.is_initialized()):
            raise CommError("torch.distributed fallback needs an initialised process group or a store")
        self._ready = True

    def _make_backend(self, dist: Any) -> Any:
        """A process-group back end of our own over the store (collective: every rank makes its
        fallback groups in the same order, so the generation numbers agree)."""
        # every rank arrives first, within MSCCLANG_TIMEOUT_S: a dead peer raises CallMismatch
        # naming it here, not after the torch group's own (store) timeout
        StoreGroup(self._store, self._rank, self._world, "fallback-group", settings.timeout_s).barrier("the fallback group")
        gen = int(self._store.add(f"mscclang/fallback/gen/{self._rank}", 1))
        prefix = dist.PrefixStore(f"mscclang/fallback/{gen}/", self._store)
        if self.backend_name == "nccl":
            if not dist.is_nccl_available():
                raise CommError(f"rank {self._rank}: the torch.distributed fallback on {self._device} "
                                "needs NCCL, which this torch build lacks")
            os.environ.update(nccl_env())
            opts = dist.ProcessGroupNCCL.Options()
            try:
                opts._timeout = self._timeout
            except AttributeError:  # pragma: no cover - older torch
                pass
            pg = dist.ProcessGroupNCCL(prefix, self._rank, self._world, opts)
        else:
            pg = HostStaged(dist.ProcessGroupGloo(prefix, self._rank, self._world, self._timeout))
        log.debug("mscclang rank %s: torch.distributed fallback: %s group %d over the store",
                  self._rank, self.backend_name, gen)
        return pg

    def _init_default_group(self, dist: Any) -> None:
        gen = int(self._store.add(f"mscclang/fallback/default/{self._rank}", 1))
        prefix = dist.PrefixStore(f"mscclang/fallback/default/{gen}/", self._store)
        if self.backend_name == "nccl":
            os.environ.update(nccl_env())
        dist.init_process_group(self.backend_name, store=prefix, rank=self._rank,
                                world_size=self._world, timeout=self._timeout)
        self._group = None

    @property
    def group(self) -> Any:
        """The torch.distributed group the public API runs on (``None``: the default group);
        ``None`` too when our own back end over a store is used (see :attr:`own_backend`)."""
        self._setup()
        return self._group

    @property
    def own_backend(self) -> Any:
        """The back end made from the store, or ``None``."""
        self._setup()
        return self._pg

    def _peer(self, g: Any, r: int) -> int:
        import torch.distributed as dist

        return r if g is None else dist.get_global_rank(g, r)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, inp: Any, out: Any, op: str) -> None:
        import torch.distributed as dist

        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        pg = self.own_backend
        if pg is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = _torch_op(op)
            pg.allreduce([out], opts).wait()
            return
        dist.all_reduce(out, op=_torch_op(op), group=self.group)

    def all_gather(self, inp: Any, out: Any) -> None:
        import torch.distributed as dist

        pg = self.own_backend
        if pg is not None:
            src = inp.clone() if overlap(inp.data_ptr(), inp.nbytes, out.data_ptr(), out.nbytes) else inp
            pg._allgather_base(out, src).wait()
            return
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, inp, group=self.group)   # torch 2.13

    def reduce_scatter(self, inp: Any, out: Any, op: str) -> None:
        import torch.distributed as dist

        pg = self.own_backend
        if pg is not None:
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = _torch_op(op)
            src = inp.clone() if overlap(inp.data_ptr(), inp.nbytes, out.data_ptr(), out.nbytes) else inp
            pg._reduce_scatter_base(out, src, opts).wait()
            return
        rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)   # torch 2.13's name first
        rs(out, inp, op=_torch_op(op), group=self.group)

    def all_to_all(self, inp: Any, out: Any) -> None:
        import torch.distributed as dist

        src = inp.clone() if overlap(inp.data_ptr(), inp.nbytes, out.data_ptr(), out.nbytes) else inp
        pg = self.own_backend
        if pg is not None:
            pg.alltoall_base(out, src, [], [], dist.AllToAllOptions()).wait()
            return
        dist.all_to_all_single(out, src, group=self.group)

    def all_to_all_v(self, inp: Any, out: Any, sends: list, recvs: list) -> None:
        """``all_to_all_single`` with splits: ``sends[q]`` rows of ``inp`` to rank ``q``, ``recvs[p]``
        rows of ``out`` from rank ``p`` (rows: the first dimension)."""
        import torch.distributed as dist

        pg = self.own_backend
        if pg is not None:
            pg.alltoall_base(out, inp, list(recvs), list(sends), dist.AllToAllOptions()).wait()
            return
        dist.all_to_all_single(out, inp, list(recvs), list(sends), group=self.group)

    def broadcast(self, tensor: Any, root: int) -> None:
        import torch.distributed as dist

        pg = self.own_backend
        if pg is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            pg.broadcast([tensor], opts).wait()
            return
        g = self.group
        dist.broadcast(tensor, src=self._peer(g, root), group=g)

    def send(self, tensor: Any, dst: int) -> None:
        import torch.distributed as dist

        pg = self.own_backend
        if pg is not None:
            pg.send([tensor], dst, 0).wait()
            return
        g = self.group
        dist.send(tensor, self._peer(g, dst), group=g)

    def recv(self, tensor: Any, src: int) -> None:
        import torch.distributed as dist

        pg = self.own_backend
        if pg is not None:
            pg.recv([tensor], src, 0).wait()
            return
        g = self.group
        dist.recv(tensor, self._peer(g, src), group=g)

    def send_recv(self, inp: Any, out: Any, rank: int, world_size: int) -> None:
        """Ring shift: send to rank+1, receive from rank-1."""
        import torch.distributed as dist

        nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
        src = inp.clone() if overlap(inp.data_ptr(), inp.nbytes, out.data_ptr(), out.nbytes) else inp
        pg = self.own_backend
        if pg is not None:
            # one all-to-all with uneven splits (everything to rank+1, from rank-1): a single
            # collective, so no send/recv ordering can deadlock
            m = src.numel()
            send_splits = [m if q == nxt else 0 for q in range(world_size)]
            recv_splits = [m if q == prv else 0 for q in range(world_size)]
            if nxt == prv == rank:  # one rank: a copy
                out.reshape(-1).copy_(src.reshape(-1))
                return
            pg.alltoall_base(out.reshape(-1), src.reshape(-1), recv_splits, send_splits,
                             dist.AllToAllOptions()).wait()
            return
        g = self.group
        ops = [dist.P2POp(dist.isend, src, self._peer(g, nxt), g),
               dist.P2POp(dist.irecv, out, self._peer(g, prv), g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def close(self) -> None:
        """Drop the back end made from the store (if any)."""
        self._pg = None
        if self._store is not None and self._group is None:
            self._ready = False


def call_text(collective: str, inp: Any, out: Any) -> str:
    """A call as the ranks compare it and errors name it, e.g. ``allgather of 8 x float32 into
    16`` (the plan collective, element counts, dtype; CommError for a dtype mscclang does not run)."""
    into = f" into {out.numel()}" if out.numel() != inp.numel() else ""
    return f"{collective} of {inp.numel()} x {gpu_dtype(inp.dtype).name}{into}"


class FallbackCalls:
    """The call check before every gloo fallback collective (the CPU path): the ranks first
    all-gather an 8-byte digest of their call's description (collective, element counts,
    dtype, reduce op, root) on the same group, and when the digests differ they compare the
    descriptions through the store (the GPU runtime's set-up exchange,
    :class:`~mscclang.runtime.store_group.StoreGroup`, with its record and its message):
    CallMismatch on every rank, naming what each rank called, before the collective, so the
    group stays usable. gloo given mismatched calls aborts the process (different sizes or
    dtypes) or waits out its timeout and is unusable after (different collectives). The check
    runs on every call, since whether a rank checks must not depend on its own call: one more
    small collective per call. :meth:`agree` is the comparison itself, for any call described
    by a text (the torch.distributed backend's agreement). Making one is collective (its store
    group)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, name: str = "fallback-calls") -> None:
        self._group = StoreGroup(store, rank, world_size, name, timeout_s)

    def check(self, fb: Any, call: Call, inp: Any, out: Any) -> None:
        """CallMismatch on every rank unless every rank makes ``call`` (on ``inp`` and ``out``) on
        ``fb`` (see the class)."""
        row = call.collective
        red = (f" {call.op}{f' accumulated in {call.accum}' if call.accum else ''}" if row.reduces
               else f" from rank {call.root}" if row.rooted else "")
        self.agree(call_text(row.name, inp, out) + red, fb=fb, tag="torch.distributed fallback")

    def agree(self, text: str, error: str = "", fb: Any = None, data: bytes = b"",
              tag: str = "torch.distributed backend") -> list[bytes]:
        """Every rank's call ``text`` compared before it runs, ``error`` being this rank's refusal
        of it (empty: none), which travels with the text: CallMismatch on every rank naming each
        rank's call when they differ, else InvalidCall on every rank when this rank (so every
        rank) refused it. With ``fb`` (and no ``data``) the ranks first all-gather a digest on
        its group and go to the store only when the digests differ; without, through the store,
        which also carries every rank's ``data``: returned by rank (empty when not exchanged)."""
        import hashlib

        import torch

        why = error.split(": ", 1)[-1] if error.startswith(f"rank {self._group.rank}: ") else error
        self._group.call = f"{text}, refused: {why}" if error else text
        same = fb is not None and not data
        if same:   # a digest all-gathered on fb's group first
            mine = int.from_bytes(hashlib.blake2b(self._group.call.encode(), digest_size=8).digest(), "little", signed=True)
            everyone = torch.empty(self._group.world_size, dtype=torch.int64)
            fb.all_gather(torch.tensor([mine], dtype=torch.int64), everyone)
            same = not bool((everyone != mine).any())
        datas = [] if same else self._group.exchange(data, tag)   # CallMismatch naming every rank's call
        if error:
            raise InvalidCall(error)
        return datas


def _fp8_reduction(fb: Any, collective: str, inp: Any, out: Any, rank: int, world_size: int,
                   accum: str) -> None:
    """An fp8 all-reduce or reduce-scatter through torch, which cannot reduce fp8: every rank's
    input is gathered (as bytes) and summed on the host in rank order by the definition
    (:func:`mscclang.plan.reference.fp8_sum_arrays`: the one-shot rule of docs/semantics.md)."""
    import torch

    flat = inp.reshape(-1)
    gathered = torch.empty(world_size * flat.numel(), dtype=torch.uint8, device=flat.device)
    fb.all_gather(flat.view(torch.uint8), gathered)
    dt = torch_dtype_info(inp.dtype).numpy  # type: ignore[union-attr]
    rows = gathered.cpu().numpy().view(dt).reshape(world_size, -1)
    total = fp8_sum_arrays(list(rows), dt, accum)
    if collective_row(collective).blocks(world_size)[0] > 1:   # reduce-scatter: this rank's block
        total = total.reshape(world_size, -1)[rank]
    out.reshape(-1).copy_(torch.from_numpy(total.view(np.uint8).copy()).view(inp.dtype))


def run_fallback(fb: Any, call: Call, inp: Any, out: Any) -> None:
    """Run ``call`` (on ``inp`` and ``out``) on a fallback: :class:`TorchFallback`, or any object
    with its methods (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
    ``broadcast``, ``send_recv``). fp8 tensors move as bytes; their reductions (sum, in the
    accumulation dtype, float32 when None) are gathered and reduced here (:func:`_fp8_reduction`)."""
    row = call.collective
    if row.api is None or row.fused:
        raise CommError(f"no torch.distributed fallback for collective {row.name!r}")
    info = torch_dtype_info(inp.dtype)
    if info is not None and info.accumulates:
        import torch

        if row.reduces:
            _fp8_reduction(fb, row.name, inp, out, call.rank, call.world, call.accum or ACCUM_DTYPES[0])
            return
        inp, out = inp.view(torch.uint8), out.view(torch.uint8)
    run = getattr(fb, row.api)   # the fallback's method of the collective's API name
    if row.rooted:
        run(out, call.root)
    elif row.has_senders:
        run(inp, out, call.rank, call.world)
    else:
        run(inp, out, *((call.op,) if row.reduces else ()))
