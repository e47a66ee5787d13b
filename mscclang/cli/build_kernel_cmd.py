"""``mscclang build-kernel``: compile every kernel variant with NVRTC for one arch, no GPU needed
(CI runs it), and compile the device-plan layout checks."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path


def add_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("build-kernel", help="compile all interpreter-kernel variants with NVRTC (no GPU needed)")
    p.add_argument("--arch", default="sm_90", help="target arch, e.g. sm_90 (default)")
    p.add_argument("--dtype", action="append", choices=["f16", "bf16", "f32", "i32"],
                   help="only these dtypes (repeatable; default all)")
    p.add_argument("--out", help="also copy the cubins here, named for MSCCLANG_CUBIN_DIR")
    p.add_argument("--no-cache", action="store_true", help="ignore the disk cache")
    p.add_argument("--jobs", type=int, default=1, help="parallel compiler processes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mscclang.runtime import build
    from mscclang.runtime.structs import layout_asserts

    t0 = time.time()
    build.compile_source(layout_asserts(), args.arch, name="layout_asserts.cu")
    print(f"layout static_asserts: ok ({args.arch})")
    dtypes = args.dtype or list(build.DTYPES)
    mods = build.build_all(args.arch, dtypes, use_cache=not args.no_cache, jobs=args.jobs)
    maj, mnr = build.nvrtc_version()
    for m in mods:
        print(f"{m.dtype}: {len(m.cubin)} bytes {'(cached) ' if m.cached else ''}{m.path}")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(m.path, out / build.prebuilt_name(m.dtype, args.arch))
    n = len(mods) * len(build.PACKET_TYPES) * len(build.REDUCE_OPS)
    print(f"{n} kernels for {args.arch} with NVRTC {maj}.{mnr} in {time.time() - t0:.1f}s")
    return 0
