"""Who a :class:`~mscclang.comm.communicator.Communicator` is among its ranks, and what it falls
back on: its rank, world size, device and stores, resolved from torch.distributed, an explicit
store or an injected engine (:func:`membership`); its torch.distributed fallback and the gloo
fallback's call check (:func:`make_fallback`).

Two stores matter. The *runtime store* is what the GPU runtime bootstraps over: the explicit one,
or a prefix of torch.distributed's default store named after the group. The *fallback store* is
what the fallback may build a group of its own from: the explicit store, or an injected engine's
(its GPU runtime's); None when the communicator was built from torch.distributed, whose group the
fallback then uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from mscclang.comm.errors import CommError
from mscclang.comm.fallback import FallbackCalls, TorchFallback
from mscclang.config import settings

__all__ = ["Membership", "membership", "make_fallback"]


@dataclass(frozen=True)
class Membership:
    """One rank's place: ``rank`` of ``world_size`` on ``device``; ``store`` the runtime store and
    ``fallback_store`` the fallback's (see the module docstring)."""

    rank: int
    world_size: int
    device: Any
    store: Any
    fallback_store: Any


def membership(group: Any, store: Any, rank: Optional[int], world_size: Optional[int], device: Any,
               engine: Any) -> Membership:
    """The :class:`Membership` of a communicator built with these arguments: an injected
    ``engine``'s rank, world and device; else ``store`` with ``rank`` and ``world_size``; else
    torch.distributed's (``group`` or the default group). CommError naming what is missing: an
    uninitialised torch.distributed, a store without rank or world size, a rank outside the
    world."""
    import torch

    if engine is not None:
        got = Membership(engine.rank, engine.world_size, engine.device, store,
                         store if store is not None or group is not None else engine.store)
    else:
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        elif not isinstance(device, torch.device):
            device = torch.device(device)
        if store is not None:
            if rank is None or world_size is None:
                raise CommError("a communicator built from a store needs rank and world_size")
            got = Membership(rank, world_size, device, store, store)
        else:
            got = _from_torch(group, rank, world_size, device)
    if not 0 <= got.rank < got.world_size:
        raise CommError(f"rank {got.rank} is not in a world of {got.world_size}")
    return got


def _from_torch(group: Any, rank: Optional[int], world_size: Optional[int], device: Any) -> Membership:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise CommError("torch.distributed is not initialised: call "
                        "torch.distributed.init_process_group first, or pass store, rank "
                        "and world_size")
    r = dist.get_rank(group) if rank is None else rank
    n = dist.get_world_size(group) if world_size is None else world_size
    from torch.distributed import distributed_c10d as c10d

    base = c10d._get_default_store()
    gname = "default" if group is None else getattr(group, "group_name", str(id(group)))
    return Membership(r, n, device, dist.PrefixStore(f"mscclang/{gname}/", base), None)


def make_fallback(fallback: Union[bool, Any], group: Any, m: Membership,
                  runtime_options: dict) -> tuple[Any, Optional[FallbackCalls]]:
    """The fallback a communicator asked for (``True``: a :class:`TorchFallback` on ``group``,
    else on a group of its own over the fallback store; ``False``/None: none; anything else: that
    object) and, for a gloo :class:`TorchFallback` with a store to agree over, its call check. A fallback group
    made here is bounded like the runtime's spins: a dead or hung peer ends in torch's watchdog
    within the same timeout (a caller's group keeps its own)."""
    if fallback is False or fallback is None:
        return None, None
    fb = fallback
    if fallback is True:
        t = runtime_options.get("timeout_s") or (settings.timeout_s if settings.is_set("timeout_s") else None)
        fb = TorchFallback(group, store=m.fallback_store, rank=m.rank, world_size=m.world_size, device=m.device,
                           **({"timeout_s": float(t)} if t else {}))
    check_store = m.store if m.store is not None else m.fallback_store
    if not isinstance(fb, TorchFallback) or fb.backend_name != "gloo" or check_store is None:
        return fb, None
    return fb, FallbackCalls(check_store, m.rank, m.world_size, fb.timeout_s)
