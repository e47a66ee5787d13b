"""FlashInfer smoke test: TRT-LLM allreduce + residual add + RMSNorm, checked against torch.

Run it on the GPU machine from the repository root, after ``source .fi/prelude.sh`` (see
tools/flashinfer_carry.sh, which builds the carried FlashInfer)::

    python3 -m torch.distributed.run --nproc-per-node 2 tools/flashinfer_smoke.py --out /tmp/fi_smoke.json

It exercises exactly the path of ``_flashinfer_cell`` in mscclang/bench/fused.py:
``flashinfer.comm.create_allreduce_fusion_workspace(backend="trtllm", ...)`` then
``flashinfer.comm.allreduce_fusion(pattern=kARResidualRMSNorm, launch_with_pdl=False, ...)``.

* Each rank binds GPU ``LOCAL_RANK % torch.cuda.device_count()``; with one GPU both ranks share
  it (their kernels time-share the GPU, and the workspace maps the other process's buffers on the
  same device). The process group is gloo (NCCL refuses two ranks on one GPU); FlashInfer uses it
  to exchange the workspace's memory handles.
* First the JIT build of FlashInfer's ``trtllm_comm`` module (nvcc, once; rank 0 builds, then the
  others load it), timed and printed on its own, under its own time limit (``--jit-timeout``);
  where the carried site has the prebuilt module (flashinfer/data/aot), FlashInfer loads that
  instead, and the line says which (``prebuilt (AOT)``, ``jit-built`` or ``jit cache``).
* Then, for each token count (``--tokens``, default 1,16,128) at ``--hidden`` (4096), bf16: a
  workspace for that size, then ``--iters`` calls on fresh random data: x different on each rank,
  residual and RMSNorm weight the same on all ranks. Each call's ``residual_out`` and
  ``norm_out`` are compared with a float32 torch reference built from every rank's x gathered
  through the gloo group (sum of x, + residual; RMSNorm with eps 1e-6), within a few bf16 units
  of roundoff scaled by the magnitudes involved (``reference`` derives the bounds: about
  ``1.5 * (world + 1)`` roundings of ``sum |x_r| + |residual|`` for the residual). ``--twoshot``
  adds the two-shot kernel as extra cases (the default heuristic picks one-shot for every size
  here).
* NVLink multicast is never used: NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are
  set, and FLASHINFER_CONFIDENTIAL_COMPUTE=0 pins the trtllm workspace to FlashInfer's
  ``SymmDeviceMemory(enable_multicast=False)`` (unicast cuMem buffers, one mapping per peer);
  the test asserts that no workspace handle has a multicast object.

Prints one line per case and a last line ``flashinfer smoke: N ok, M failed``; rank 0 writes the
same as JSON to ``--out``. Everything after the JIT build is bounded by ``--timeout`` seconds
(default 240), the JIT build by ``--jit-timeout`` (default 540): on expiry the test writes what it
has (``"timeout"`` set), prints the last line and exits 124; faulthandler dumps the stacks and
kills the process 20 s later if even that cannot run. Exit status 0 when every case passed.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

# Before torch, NCCL or FlashInfer read them: no NVLink multicast anywhere.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ.setdefault("FLASHINFER_CONFIDENTIAL_COMPUTE", "0")

EPS = 1e-6
BF16_UNIT_ROUNDOFF = 2.0**-8


class Run:
    """The results so far, and the watchdog that writes them when time runs out."""

    def __init__(self, out: Path | None, rank: int, world: int) -> None:
        self.out, self.rank, self.world = out, rank, world
        self.report: dict[str, Any] = {"world": world, "cases": [], "timeout": None}
        self.timer: threading.Timer | None = None
        self.lock = threading.Lock()

    def arm(self, seconds: float, phase: str) -> None:
        """(Re)start the time limit for ``phase``."""
        if self.timer is not None:
            self.timer.cancel()
        faulthandler.cancel_dump_traceback_later()
        self.timer = threading.Timer(seconds, self._expire, args=(seconds, phase))
        self.timer.daemon = True
        self.timer.start()
        faulthandler.dump_traceback_later(seconds + 20, exit=True)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        faulthandler.cancel_dump_traceback_later()

    def _expire(self, seconds: float, phase: str) -> None:
        self.report["timeout"] = f"{phase}: over {seconds:.0f} s"
        print(f"[rank {self.rank}] TIMEOUT in {phase} after {seconds:.0f} s", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        self.finish(local_only=True)
        os._exit(124)

    def finish(self, local_only: bool = False) -> int:
        """Print the summary line, write the JSON (rank 0); the number of failed cases."""
        with self.lock:
            cases = self.report["cases"]
            ok = sum(1 for c in cases if c["ok"])
            failed = len(cases) - ok + (1 if self.report.get("error") or self.report["timeout"] else 0)
            self.report.update(ok=ok, failed=failed, partial=local_only)
            if self.rank == 0 and self.out is not None:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                self.out.write_text(json.dumps(self.report, indent=1) + "\n")
            if self.rank == 0:
                print(f"flashinfer smoke: {ok} ok, {failed} failed", flush=True)
            return failed


def log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


def randn(seed: int, shape: tuple[int, ...], scale: float = 1.0, shift: float = 0.0) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32) * scale + shift


def check(got: Any, ref: Any, bound: Any) -> tuple[bool, float, float]:
    """(passed, max |error|, max |error| / bound) of ``got`` (bf16, on the GPU) against ``ref``."""
    import torch

    g = got.float().cpu()
    if not bool(torch.isfinite(g).all()):
        return False, float("inf"), float("inf")
    err = (g - ref).abs()
    return bool((err <= bound).all()), float(err.max()), float((err / bound).max())


def reference(xs: list[Any], residual: Any, gamma: Any, world: int) -> tuple[Any, Any, Any, Any]:
    """fp32 residual and norm, and their error bounds, from every rank's x (CPU, bf16 values).

    The kernel rounds to bf16 after each of its ``world`` additions (unit roundoff u = 2**-8), so
    the residual is within ``world * u * (sum |x_r| + |residual|)`` of the exact sum; the norm
    inherits that error through its scale, plus its row's 1/rms error and its own rounding. Both
    bounds carry a factor 1.5 of slack on top.
    """
    import torch

    u = BF16_UNIT_ROUNDOFF
    xst = torch.stack(xs)
    s = xst.sum(0) + residual
    bound_res = 1.5 * (world + 1) * u * (xst.abs().sum(0) + residual.abs()) + 1e-30
    ms = s.pow(2).mean(-1, keepdim=True) + EPS
    rs = torch.rsqrt(ms)
    norm = s * rs * gamma
    row_rel = (s.abs() * bound_res).mean(-1, keepdim=True) / ms  # relative error of 1/rms
    bound_norm = 1.5 * (gamma.abs() * rs * bound_res + norm.abs() * (row_rel + 2 * u)) + 1e-30
    return s, bound_res, norm, bound_norm


def _device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def run_case(args: argparse.Namespace, fic: Any, rank: int, world: int, tokens: int,
             twoshot: bool, ws_cache: dict[int, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    hidden, dev = args.hidden, _device()
    case: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "kernel": "twoshot" if twoshot else "default",
                            "ok": False, "iters": []}
    t0 = time.perf_counter()
    ws = ws_cache.get(tokens)
    if ws is None:
        ws = fic.create_allreduce_fusion_workspace(backend="trtllm", world_size=world, rank=rank,
                                                   max_token_num=tokens, hidden_dim=hidden,
                                                   dtype=torch.bfloat16)
        ws_cache[tokens] = ws
    case["workspace_s"] = round(time.perf_counter() - t0, 3)
    case["workspace"] = type(ws).__name__
    handles = list(getattr(ws, "mem_handles", []) or [])
    case["handles"] = [type(h).__name__ for h in handles]
    for h in handles:  # no multicast object may exist behind the workspace
        if getattr(h, "_enable_multicast", False) or getattr(h, "mc_handle", 0) or getattr(h, "mc_ptr", 0):
            raise RuntimeError(f"workspace handle {type(h).__name__} has a multicast object")
    ex = getattr(handles[0], "_exchanger", None) if handles else None
    case["handle_type"] = str(getattr(ex, "handle_type", "n/a"))

    pattern = fic.AllReduceFusionPattern.kARResidualRMSNorm
    ok_all = True
    for it in range(args.iters):
        seed = args.seed * 1_000_003 + tokens * 1009 + it * 17 + (500 if twoshot else 0)
        x_cpu = randn(seed * 64 + rank, (tokens, hidden))
        res_cpu = randn(seed * 64 + 63, (tokens, hidden))
        gamma_cpu = randn(seed * 64 + 62, (hidden,), scale=0.1, shift=1.0)
        x = x_cpu.to(torch.bfloat16).to(dev)
        residual = res_cpu.to(torch.bfloat16).to(dev)
        gamma = gamma_cpu.to(torch.bfloat16).to(dev)
        res_out = torch.full_like(x, float("nan"))
        norm_out = torch.full_like(x, float("nan"))
        # every rank's x, as the GPU sees it (bf16 values), through the gloo group
        xs = [torch.empty(tokens, hidden) for _ in range(world)]
        dist.all_gather(xs, x.float().cpu())
        kw: dict[str, Any] = {"use_oneshot": False} if twoshot else {}
        t1 = time.perf_counter()
        fic.allreduce_fusion(input=x, workspace=ws, pattern=pattern, launch_with_pdl=False,
                             residual_out=res_out, norm_out=norm_out, residual_in=residual,
                             rms_gamma=gamma, rms_eps=EPS, **kw)
        torch.cuda.synchronize()
        call_ms = (time.perf_counter() - t1) * 1e3
        ref_res, bound_res, ref_norm, bound_norm = reference(xs, residual.float().cpu(), gamma.float().cpu(), world)
        ok_r, err_r, q_r = check(res_out, ref_res, bound_res)
        ok_n, err_n, q_n = check(norm_out, ref_norm, bound_norm)
        case["iters"].append({"ok": ok_r and ok_n, "residual_max_err": err_r, "residual_err_over_bound": q_r,
                              "norm_max_err": err_n, "norm_err_over_bound": q_n, "call_ms": round(call_ms, 3)})
        ok_all = ok_all and ok_r and ok_n
    case["ok"] = ok_all
    # a rough per-call time on the same inputs (meaningless when the ranks share one GPU)
    torch.cuda.synchronize()
    dist.barrier()
    t2 = time.perf_counter()
    for _ in range(args.time_calls):
        fic.allreduce_fusion(input=x, workspace=ws, pattern=pattern, launch_with_pdl=False,
                             residual_out=res_out, norm_out=norm_out, residual_in=residual,
                             rms_gamma=gamma, rms_eps=EPS, **kw)
    torch.cuda.synchronize()
    case["ms_per_call"] = round((time.perf_counter() - t2) * 1e3 / max(1, args.time_calls), 4)
    return case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON report (written by rank 0)")
    ap.add_argument("--tokens", default="1,16,128", help="comma-separated token counts")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=3, help="checked calls per case, fresh data each")
    ap.add_argument("--time-calls", type=int, default=10, help="unchecked calls timed per case")
    ap.add_argument("--twoshot", action="store_true", help="also force the two-shot kernel")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds for everything after the JIT build")
    ap.add_argument("--jit-timeout", type=float, default=540.0, help="seconds for import + JIT build")
    args = ap.parse_args()
    args.iters = max(1, args.iters)

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    run = Run(args.out, rank, world)
    rep = run.report
    run.arm(args.jit_timeout, "import and JIT build")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        import torch
        import torch.distributed as dist

        ndev = torch.cuda.device_count()
        if ndev == 0:
            raise RuntimeError("no CUDA device")
        dev = local % ndev
        torch.cuda.set_device(dev)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.jit_timeout + args.timeout))
        rep.update(devices=ndev, device=dev, device_name=torch.cuda.get_device_name(dev),
                   shared_gpu=ndev < world, torch=torch.__version__,
                   env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                      "FLASHINFER_CONFIDENTIAL_COMPUTE", "FLASHINFER_CUDA_ARCH_LIST",
                                                      "FLASHINFER_WORKSPACE_BASE", "MAX_JOBS", "CUDA_HOME")})
        log(rank, f"world {world}, GPU {dev} of {ndev} ({rep['device_name']}), torch {torch.__version__}")

        t0 = time.perf_counter()
        import flashinfer
        import flashinfer.comm as fic
        from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

        rep.update(import_s=round(time.perf_counter() - t0, 2), flashinfer=flashinfer.__version__,
                   flashinfer_path=os.path.dirname(flashinfer.__file__))
        log(rank, f"import flashinfer.comm {rep['import_s']} s ({flashinfer.__version__}, {rep['flashinfer_path']})")

        # JIT: rank 0 builds, the others load what it built.
        status: dict[str, Any] = {}
        if rank == 0:
            t1 = time.perf_counter()
            try:
                from flashinfer.jit.comm import gen_trtllm_comm_module

                spec = gen_trtllm_comm_module()
                aot = [str(a.path) for a in spec.aot_artifacts]  # a prebuilt module FlashInfer loads first
                jit_so = spec.jit_library_path
                before = jit_so.stat().st_mtime if jit_so.exists() else None
                get_trtllm_comm_module()
                built = jit_so.exists() and jit_so.stat().st_mtime != before
                source = "jit-built" if built else ("prebuilt (AOT)" if aot else "jit cache")
                status = {"ok": True, "s": round(time.perf_counter() - t1, 1), "source": source,
                          "aot": aot, "jit_so": str(jit_so)}
            except Exception as e:  # noqa: BLE001 - reported, then every rank stops
                status = {"ok": False, "error": f"{type(e).__name__}: {e}"[-4000:]}
                traceback.print_exc()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, status)
        status = gathered[0]
        if not status["ok"]:
            rep["error"] = "JIT build failed: " + status["error"]
            rep["jit_build_s"] = None
            return 1 if run.finish() else 0
        rep.update(jit_build_s=status["s"], module_source=status["source"], aot=status["aot"])
        if rank == 0:
            print(f"flashinfer JIT build (trtllm_comm): {status['s']} s, module {status['source']}", flush=True)
        t1 = time.perf_counter()
        get_trtllm_comm_module()
        if rank != 0:
            log(rank, f"JIT module loaded in {time.perf_counter() - t1:.1f} s")

        run.arm(args.timeout, "cases")
        tokens_list = [int(t) for t in args.tokens.split(",") if t.strip()]
        todo = [(False, t) for t in tokens_list]
        if args.twoshot:  # the two-shot kernel needs more tokens than ranks
            todo += [(True, t) for t in tokens_list if t > world]
        ws_cache: dict[int, Any] = {}
        for twoshot, tokens in todo:
            try:
                case = run_case(args, fic, rank, world, tokens, twoshot, ws_cache)
            except Exception as e:  # noqa: BLE001 - a failed case, reported
                traceback.print_exc()
                case = {"tokens": tokens, "hidden": args.hidden, "kernel": "twoshot" if twoshot else "default",
                        "ok": False, "error": f"{type(e).__name__}: {e}"[-2000:]}
            per_rank: list[Any] = [None] * world
            dist.all_gather_object(per_rank, case)
            merged = dict(per_rank[0])
            merged["ok"] = all(c["ok"] for c in per_rank)
            merged["ranks"] = per_rank
            with run.lock:
                rep["cases"].append(merged)
            if rank == 0:
                worst = [(max(i["residual_err_over_bound"] for i in c["iters"]),
                          max(i["norm_err_over_bound"] for i in c["iters"])) for c in per_rank if c.get("iters")]
                detail = (f"err/bound residual {max(w[0] for w in worst):.3f} norm {max(w[1] for w in worst):.3f}, "
                          f"{merged.get('ms_per_call', float('nan')):.3f} ms/call, "
                          f"workspace {merged.get('workspace_s')} s, handles {merged.get('handle_type')}"
                          if worst else "")
                errs = "; ".join(f"rank {i}: {c['error']}" for i, c in enumerate(per_rank) if c.get("error"))
                print(f"case tokens={tokens:<4} hidden={args.hidden} {merged['kernel']:<7} "
                      f"{'ok' if merged['ok'] else 'FAILED'}  {detail}{errs}", flush=True)
            if any(c.get("error") for c in per_rank):
                break  # the ranks may no longer agree on the collectives that follow
        dist.barrier()
        run.disarm()
        failed = run.finish()
        dist.destroy_process_group()
        return 0 if failed == 0 else 1
    except Exception as e:  # noqa: BLE001 - reported in the JSON and the last line
        traceback.print_exc()
        rep["error"] = f"{type(e).__name__}: {e}"[-4000:]
        run.disarm()
        run.finish(local_only=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
