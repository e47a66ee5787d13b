"""torch.distributed (NCCL) for what the library cannot do, logged once per reason."""

from __future__ import annotations

import logging
from typing import Any, Optional

from mscclang.comm.errors import CommError

log = logging.getLogger("mscclang.comm")


def _torch_op(op: str) -> Any:
    import torch.distributed as dist

    return {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]


class TorchFallback:
    """Collectives through torch.distributed on ``group`` (None: the default group).

    With ``store``/``rank``/``world_size`` and no initialised default group, the first call
    creates an NCCL (CUDA) or gloo (CPU) group from that store (under a key prefix of its own).
    """

    def __init__(self, group: Any = None, *, store: Any = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, device: Any = None) -> None:
        self._group = group
        self._store = store
        self._rank = rank
        self._world = world_size
        self._device = device
        self._ready = group is not None

    @property
    def group(self) -> Any:
        if not self._ready:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._group = None  # the default group
            elif self._store is not None:
                backend = "nccl" if getattr(self._device, "type", "cpu") == "cuda" else "gloo"
                prefix = dist.PrefixStore("mscclang_fallback/", self._store)
                kw: dict[str, Any] = {}
                if backend == "nccl" and self._device is not None:
                    kw["device_id"] = self._device
                dist.init_process_group(backend, store=prefix, rank=self._rank,
                                        world_size=self._world, **kw)
                self._group = None
            else:
                raise CommError("torch.distributed fallback needs an initialised process group "
                                "or a store")
            self._ready = True
        return self._group

    def all_reduce(self, inp: Any, out: Any, op: str) -> None:
        import torch.distributed as dist

        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        dist.all_reduce(out, op=_torch_op(op), group=self.group)

    def all_gather(self, inp: Any, out: Any) -> None:
        import torch.distributed as dist

        dist.all_gather_into_tensor(out, inp, group=self.group)

    def reduce_scatter(self, inp: Any, out: Any, op: str) -> None:
        import torch.distributed as dist

        dist.reduce_scatter_tensor(out, inp, op=_torch_op(op), group=self.group)

    def all_to_all(self, inp: Any, out: Any) -> None:
        import torch.distributed as dist

        if out.data_ptr() == inp.data_ptr():
            tmp = inp.clone()
            dist.all_to_all_single(out, tmp, group=self.group)
        else:
            dist.all_to_all_single(out, inp, group=self.group)

    def broadcast(self, tensor: Any, root: int) -> None:
        import torch.distributed as dist

        g = self.group
        src = root if g is None else dist.get_global_rank(g, root)
        dist.broadcast(tensor, src=src, group=g)

    def send(self, tensor: Any, dst: int) -> None:
        import torch.distributed as dist

        g = self.group
        dist.send(tensor, dst if g is None else dist.get_global_rank(g, dst), group=g)

    def recv(self, tensor: Any, src: int) -> None:
        import torch.distributed as dist

        g = self.group
        dist.recv(tensor, src if g is None else dist.get_global_rank(g, src), group=g)

    def send_recv(self, inp: Any, out: Any, rank: int, world_size: int) -> None:
        """Ring shift: send to rank+1, receive from rank-1."""
        import torch.distributed as dist

        g = self.group
        nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
        if g is not None:
            nxt, prv = dist.get_global_rank(g, nxt), dist.get_global_rank(g, prv)
        src = inp.clone() if out.data_ptr() == inp.data_ptr() else inp
        ops = [dist.P2POp(dist.isend, src, nxt, g), dist.P2POp(dist.irecv, out, prv, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
