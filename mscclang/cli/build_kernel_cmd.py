"""``mscclang build-kernel``: compile every kernel variant with NVRTC for one arch, no GPU needed
(CI runs it), and compile the device-plan layout checks.

``--traced`` also builds the traced variants (``comm.trace()``, ``mscclang trace``), which a GPU
run would otherwise build with NVRTC at its first traced launch (about a minute per dtype).
``--arch`` takes ``sm_90``, ``90`` or ``sm_90a``; an architecture the installed NVRTC cannot
target is refused before anything is compiled, with the list of those it can. A progress bar with
an ETA is drawn on stderr when it is a terminal (or with ``--progress``).

With ``--plan FILE`` or ``--sample NAME`` (both repeatable) it prebuilds the plan-specialised
kernels of those plans instead (:func:`mscclang.runtime.spec_build.prebuild`) into ``--out``, the
directory ``$MSCCLANG_CUBIN_DIR`` names on the GPU machine: every rank, ``--sizes`` (input bytes),
dtype (``--dtype``, default bfloat16), ``--packet`` and ``--op``; ``--sample`` names a plan of
:data:`mscclang.plan.samples.SAMPLES` built for ``--ranks`` ranks."""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

from mscclang.cli.args import (BUILD_DTYPE, GPU_DTYPES, add_output_option, add_progress_flag, add_sizes_option,
                               dtype_arg, int_range_arg)
from mscclang.errors import MscclangError, RuntimeUnavailable
from mscclang.plan.dtypes import kernel_dtype

_ARCH = re.compile(r"^(?:sm_|compute_)?(\d{2,3})([af]?)$")


def add_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("build-kernel", help="compile all interpreter-kernel variants with NVRTC (no GPU needed)")
    p.add_argument("--arch", default="sm_90", help="target arch, e.g. sm_90 (default), sm_90a, sm_100")
    p.add_argument("--dtype", action="append", type=dtype_arg(GPU_DTYPES),
                   help="only these dtypes (repeatable; float16/f16, bfloat16/bf16, float32/f32, int32/i32, "
                        "fp8_e4m3, fp8_e5m2 (one module per accumulation dtype, sm_89 or newer); default all)")
    add_output_option(p, metavar="DIR", help="also copy the cubins here, named for MSCCLANG_CUBIN_DIR")
    p.add_argument("--no-cache", action="store_true", help="ignore the disk cache")
    p.add_argument("--jobs", type=int_range_arg(1, 256), default=1, help="parallel compiler processes")
    p.add_argument("--traced", action="store_true",
                   help="also the traced variants (comm.trace(), mscclang trace), so a GPU run does not build them")
    add_progress_flag(p)
    g = p.add_argument_group("plan-specialised kernels (prebuilt for MSCCLANG_CUBIN_DIR)")
    g.add_argument("--plan", action="append", default=[], metavar="FILE", help="plan JSON file (repeatable)")
    g.add_argument("--sample", action="append", default=[], metavar="NAME",
                   help="a sample plan of mscclang.plan.samples (repeatable)")
    g.add_argument("--ranks", type=int_range_arg(1, 1024), default=2, help="world size of the --sample plans (default 2)")
    add_sizes_option(g, "input bytes", "1K")
    g.add_argument("--packet", default="ll16", help="comma list of packet types (default ll16)")
    g.add_argument("--op", default="sum", help="comma list of reduce ops (default sum)")
    p.set_defaults(func=run)


def supported_archs() -> Optional[list[int]]:
    """The compute capabilities (``90`` for sm_90) the installed NVRTC can target; None when
    NVRTC cannot tell (then the compiler itself judges ``--arch``)."""
    from mscclang.runtime import build

    build._ensure_nvrtc()  # raises RuntimeUnavailable without NVRTC
    try:
        from cuda.bindings import nvrtc

        err, archs = nvrtc.nvrtcGetSupportedArchs()
    except (ImportError, AttributeError, RuntimeError):
        return None
    if int(err) != 0:
        return None
    return sorted(int(a) for a in archs)


def check_arch(text: str, supported: Optional[list[int]]) -> str:
    """``text`` as ``sm_NN[a|f]``; RuntimeUnavailable listing the valid ones when it is not one
    of ``supported``."""
    listing = ", ".join(f"sm_{a}" for a in supported) if supported else "sm_75, sm_80, sm_90, ..."
    m = _ARCH.match(text.strip())
    if not m or (supported is not None and int(m.group(1)) not in supported):
        raise RuntimeUnavailable(f"--arch {text}: not an architecture this NVRTC can compile for; "
                                 f"valid: {listing} (an 'a' or 'f' suffix, e.g. sm_90a, selects the "
                                 "arch-specific features)")
    return f"sm_{m.group(1)}{m.group(2)}"


def _ignore_sigint() -> None:
    """Compiler processes leave Ctrl-C to the parent (no traceback from each child)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _build_one(job: tuple[str, str, bool, bool]) -> "object":
    from mscclang.runtime import build

    dtype, arch, use_cache, traced = job
    return build.build_module(dtype, arch, use_cache=use_cache, traced=traced)


def prebuild_plans(args: argparse.Namespace, arch: str) -> int:
    """The ``--plan`` / ``--sample`` mode: prebuild the specialised kernels of those plans into
    ``--out`` and print one line per kernel (its file, or why it is not specialised)."""
    from mscclang.plan.io import load_plan, plan_to_json
    from mscclang.plan.samples import SAMPLES
    from mscclang.plan.collectives import collective
    from mscclang.runtime.spec_build import prebuild

    if not args.out:
        raise RuntimeUnavailable("--plan/--sample: --out DIR is required (the cubin directory)")
    unknown = [n for n in args.sample if n not in SAMPLES]
    if unknown:
        raise RuntimeUnavailable(f"--sample {', '.join(unknown)}: no such sample plan; known: "
                                 f"{', '.join(sorted(SAMPLES))}")
    plans = [load_plan(Path(f).read_text()) for f in args.plan]
    plans += [load_plan(plan_to_json(SAMPLES[n](args.ranks))) for n in args.sample]
    dtypes = [c for d in dict.fromkeys(args.dtype or ["bfloat16"]) for c in BUILD_DTYPE[d]]
    for plan in plans:
        sizes = [(n, collective(plan.collective).output_elems(plan.world_size, n)) for n in args.sizes or [1024]]
        try:
            res = prebuild(plan, sizes, dtypes, args.packet.split(","), args.op.split(","), Path(args.out), arch)
        except MscclangError as e:
            raise MscclangError(f"{plan.name}: {e}") from e
        for label, what in res:
            print(f"{label}: {what}")
    return 0


def run(args: argparse.Namespace) -> int:
    from mscclang.cli.progress import Progress
    from mscclang.runtime import build
    from mscclang.runtime.structs import layout_asserts

    arch = check_arch(args.arch, supported_archs())
    if args.plan or args.sample:
        return prebuild_plans(args, arch)
    t0 = time.time()
    dtypes = [c for d in dict.fromkeys(args.dtype or GPU_DTYPES) for c in BUILD_DTYPE[d]]
    if int(re.sub(r"\D", "", arch)) < build.FP8_MIN_ARCH:
        fp8 = [c for c in dtypes if kernel_dtype(c).accumulates]
        if args.dtype and fp8:
            raise RuntimeUnavailable(f"--arch {arch}: the fp8 kernels need sm_{build.FP8_MIN_ARCH} or newer "
                                     "(hardware fp8 conversions)")
        dtypes = [c for c in dtypes if c not in fp8]
    jobs = [(d, False) for d in dtypes] + ([(d, True) for d in dtypes] if args.traced else [])
    mods = []
    # the ETA counts kernels (an fp8 module holds a third of the others'); the layout checks, a
    # fraction of a second, are no step of it (counted as one, they made every ETA the elapsed time)
    with Progress(len(jobs), f"build kernels for {arch}", unit="module", enabled=args.progress,
                  work=sum(build.module_kernels(d) for d, _ in jobs)) as bar:
        bar.set_note("layout checks")
        build.compile_source(layout_asserts(), arch, name="layout_asserts.cu")
        if args.jobs <= 1 or len(jobs) <= 1:
            for d, traced in jobs:
                bar.set_note(d + (" traced" if traced else ""))
                mods.append(build.build_module(d, arch, use_cache=not args.no_cache, traced=traced))
                bar.update(work=build.module_kernels(d))
        else:
            import multiprocessing as mp

            bar.set_note(f"{len(jobs)} modules on {min(args.jobs, len(jobs))} processes")

            # a Pool, not a ProcessPoolExecutor: on Ctrl-C it can be terminated at once
            pool = mp.get_context("spawn").Pool(min(args.jobs, len(jobs)), initializer=_ignore_sigint)
            try:
                done = {}
                for m in pool.imap_unordered(_build_one, [(d, arch, not args.no_cache, t) for d, t in jobs]):
                    done[(m.dtype, m.traced)] = m
                    bar.update(work=build.module_kernels(m.dtype))
                mods = [done[j] for j in jobs]
                pool.close()
            finally:
                pool.terminate()
                pool.join()
    maj, mnr = build.nvrtc_version()
    print(f"layout static_asserts: ok ({arch})")
    for m in mods:
        print(f"{m.dtype}{' traced' if m.traced else ''}: {len(m.cubin)} bytes {'(cached) ' if m.cached else ''}{m.path}")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(m.path, out / build.prebuilt_name(m.dtype, arch, m.traced))
    n = sum(build.module_kernels(m.dtype) for m in mods)
    print(f"{n} kernels for {arch} with NVRTC {maj}.{mnr} in {time.time() - t0:.1f}s")
    return 0
