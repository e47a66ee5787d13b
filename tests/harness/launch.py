"""Running an example as a user does: under torchrun on the CPU (gloo ranks, no CUDA), with this
checkout's mscclang first on the path."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nothing listens on now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_cpu(script: Path, *args: str, nprocs: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nprocs script args...`` without CUDA (a launcher's rank
    variables of the calling process removed), its output captured."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")   # this checkout's mscclang
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
                           "--master-port", str(free_port()), str(script), *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
