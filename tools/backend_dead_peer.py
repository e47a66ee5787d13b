"""A rank of a DDP training on the mscclang backend dies mid-training; the survivor must get an
error within the group's timeout (the runtime's CollectiveTimeout, or the torch fallback's error
on a machine without the GPU runtime), never a hang, and ``destroy_process_group()`` must then
return.

Run under torchrun with 2 processes (GPUs when there are, else the CPU)::

    torchrun --nproc-per-node 2 tools/backend_dead_peer.py --out dead.json [--timeout 10]

Rank 1 leaves at step 5 without a word (``os._exit``). Rank 0 writes one JSON object to
``--out``: ``raised`` (the exception's type, None when nothing was raised), ``message``, the
``step``, ``seconds`` from the start of the failing step to the error, and ``destroyed``
(whether ``destroy_process_group()`` returned within the timeout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time


def main(argv: object = None) -> int:
    ap = argparse.ArgumentParser(prog="backend_dead_peer.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="FILE", help="rank 0's JSON result")
    ap.add_argument("--timeout", type=float, default=10.0, help="the group's timeout, seconds (default 10)")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        print("backend_dead_peer: run under torchrun --nproc-per-node 2", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import mscclang.distributed  # noqa: F401 - registers the backend

    rank = int(os.environ["RANK"])
    cuda = torch.cuda.is_available()
    dev = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()) if cuda
           else torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("mscclang", timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    result: dict = {"raised": None}
    for step in range(20):
        if rank == 1 and step == 5:
            os._exit(0)   # dies mid-training, telling nobody
        t0 = time.monotonic()
        try:
            x = torch.randn(16, 64, device=dev)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - what the survivor sees is the result
            result = {"raised": type(e).__name__, "message": str(e)[:400], "step": step,
                      "seconds": round(time.monotonic() - t0, 2)}
            break
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=destroy, daemon=True).start()
    result["destroyed"] = done.wait(args.timeout + 30)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
