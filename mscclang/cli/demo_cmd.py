"""``mscclang demo``: the main job. With two or more GPUs, real collectives through the
Communicator, checked and timed against NCCL on this machine; without, the same calls on the CPU
simulator over the shipped plans."""

from __future__ import annotations

import argparse

from mscclang.cli.args import SIZES_FORMS, dtype_arg, sizes_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="allreduce/allgather through the Communicator vs NCCL "
                       "(CPU simulator without GPUs)", description=__doc__)
    p.add_argument("--sizes", default=None, type=sizes_arg(), metavar="SIZES",
                   help="message sizes: " + SIZES_FORMS + " (default 1K,64K,1M,16M on GPUs; 1K,16K on the CPU)")
    p.add_argument("--dtype", default="bfloat16", type=dtype_arg(("float16", "bfloat16", "float32")),
                   help="float16, bfloat16 (default) or float32, or an alias (fp16, bf16, fp32)")
    p.add_argument("--cpu", action="store_true", help="use the simulator even with GPUs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mscclang.comm.demo import main

    argv = ["--dtype", args.dtype]
    if args.sizes:
        argv += ["--sizes", ",".join(str(s) for s in args.sizes)]
    if args.cpu:
        argv.append("--cpu")
    return int(main(argv) or 0)
