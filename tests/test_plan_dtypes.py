"""The one dtype table (mscclang.plan.dtypes) and the one list of collective names
(mscclang.plan.collectives), and the views derived from them."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from mscclang.errors import CommError, InvalidCall
from mscclang.plan import collectives as pc
from mscclang.plan import dtypes as pd


def test_table_facts():
    by_name = {d.name: d for d in pd.DTYPES}
    assert pd.GPU_DTYPES == ("float16", "bfloat16", "float32", "int32", "float8_e4m3", "float8_e5m2")
    assert [by_name[n].code for n in pd.GPU_DTYPES] == ["f16", "bf16", "f32", "i32", "f8e4m3", "f8e5m2"]
    assert pd.KERNEL_CODES == ("f16", "bf16", "f32", "i32", "f8e4m3_a32", "f8e4m3_a16", "f8e5m2_a32", "f8e5m2_a16")
    assert [d.name for d in pd.DTYPES if d.accumulates] == ["float8_e4m3", "float8_e5m2"]
    assert by_name["bfloat16"].numpy == np.dtype(ml_dtypes.bfloat16)
    assert by_name["float8_e4m3"].numpy == np.dtype(ml_dtypes.float8_e4m3fn)
    for d in pd.DTYPES:
        assert d.numpy.itemsize == d.itemsize, d.name
        assert pd.find_dtype(d.code) is d and pd.find_dtype(d.name.upper()) is d
        assert pd.numpy_dtype_info(d.numpy) is d
        for a in d.aliases:
            assert pd.find_dtype(a) is d
    assert pd.find_dtype("torch.bfloat16").name == "bfloat16"
    assert pd.find_dtype("np.float32").name == "float32"
    assert pd.find_dtype("float64") is None
    assert pd.numpy_dtype_info(np.float64) is None
    with pytest.raises(ValueError, match=r"unknown dtype 'fp64'; known: float16, bfloat16"):
        pd.dtype_info("fp64")
    with pytest.raises(ValueError, match=r"unknown dtype code 'f64'"):
        pd.dtype_by_code("f64")


def test_torch_codes_both_ways():
    import torch

    assert [pd.torch_dtype_code(pd.torch_dtype(n)) for n in pd.GPU_DTYPES] == \
        ["f16", "bf16", "f32", "i32", "f8e4m3", "f8e5m2"]
    assert pd.torch_dtype("bf16") is torch.bfloat16 and pd.torch_dtype("fp8_e5m2") is torch.float8_e5m2
    for bad in (torch.float64, torch.uint8, "float16"):
        with pytest.raises(InvalidCall, match=r"is not supported; use float16, bfloat16, float32, int32, "
                                              r"float8_e4m3 or float8_e5m2"):
            pd.torch_dtype_code(bad)
    assert pd.torch_dtype_info(torch.float8_e4m3fn).name == "float8_e4m3"


def test_torch_stays_an_optional_import():
    code = "import sys, mscclang.plan.dtypes, mscclang.plan.collectives; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_views_derive_from_the_table():
    from mscclang.cli import args
    from mscclang.sim.dtypes import dtype_name, parse_dtype

    assert args.GPU_DTYPES == pd.GPU_DTYPES
    assert args.SIM_DTYPES == pd.SIM_DTYPES
    assert args.BUILD_DTYPE == {"float16": ("f16",), "bfloat16": ("bf16",), "float32": ("f32",), "int32": ("i32",),
                                "float8_e4m3": ("f8e4m3_a32", "f8e4m3_a16"), "float8_e5m2": ("f8e5m2_a32", "f8e5m2_a16")}
    assert {d.name: d.itemsize for d in pd.DTYPES if d.gpu} == {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4,
                                                                 "float8_e4m3": 1, "float8_e5m2": 1}
    for d in pd.DTYPES:
        assert parse_dtype(d.name) == d.numpy and dtype_name(d.numpy) == d.name


def test_collective_names():
    assert set(pc.PLAN_TO_API) <= set(pc.COLLECTIVES) == set(pc.TABLE)
    assert [c.name for c in pc.TABLE.values() if c.multi_block] == ["allgather", "reducescatter", "alltoall",
                                                                    "alltoallv", "allgatherv"]
    assert [c.name for c in pc.TABLE.values() if c.counted] == ["alltoallv", "allgatherv"]
    assert not set(pc.API_TO_PLAN.values()) & {"alltoallv", "allgatherv"}
    assert [c.name for c in pc.TABLE.values() if c.inplace_copy] == ["allreduce", "allgather", "alltoall", "sendrecv",
                                                                     "broadcast"]
    for api, plan in pc.API_TO_PLAN.items():
        assert pc.PLAN_TO_API[plan] == api
        assert pc.plan_collective(api) == plan == pc.plan_collective(plan)
    assert pc.plan_collective(" All-Reduce ") == "allreduce"
    assert pc.find_plan_collective("custom") is None
    with pytest.raises(InvalidCall, match=r"unknown collective 'all_foo'; known: all_reduce, all_gather"):
        pc.plan_collective("all_foo")


def test_the_fused_row_has_its_api_name():
    row = pc.TABLE[pc.FUSED_NORM]
    assert row.api == "all_reduce_add_rms_norm" and row.fused
    assert pc.collective("all_reduce_add_rms_norm") is row
    # the names a one-tensor call takes (prepare, select, tuning rules) leave the fused one out
    assert pc.FUSED_NORM not in pc.API_TO_PLAN.values()
    with pytest.raises(InvalidCall, match=r"unknown collective 'all_reduce_add_rms_norm'"):
        pc.plan_collective("all_reduce_add_rms_norm")


def test_the_communicators_name_lookups_raise_its_error():
    assert pc.plan_collective("send_recv") == "sendrecv"
    with pytest.raises(CommError, match=r"unknown collective 'all_foo'"):
        pc.plan_collective("all_foo")
    assert pd.gpu_dtype("bf16").name == "bfloat16" and pd.gpu_dtype(np.dtype(np.float32)).name == "float32"
    with pytest.raises(CommError, match=r"unsupported dtype uint8; supported: float16, bfloat16, float32, int32"):
        pd.gpu_dtype("uint8")


def test_a_call_carries_its_root():
    import torch

    from mscclang.plan.call import make_call, sized_call

    x, cpu = torch.ones(8), torch.device("cpu")
    assert make_call("broadcast", 0, 4, cpu, x, x, root=3).root == 3
    assert make_call("allreduce", 0, 4, cpu, x, x, root=3).root == 0   # a root means nothing there
    assert sized_call("broadcast", 0, 4, pd.dtype_info("float32"), 32, 32, root=2).root == 2
    for bad in (4, -1, True, "1"):
        with pytest.raises(InvalidCall, match=rf"rank 0: broadcast root {bad!r} is not a rank of 4"):
            make_call("broadcast", 0, 4, cpu, x, x, root=bad)


def test_a_call_of_a_message_size():
    from mscclang.plan.call import message_call

    ag = message_call("all_gather", 4, 4096, "bf16", rank=2)
    assert (ag.collective.name, ag.rank, ag.world, ag.in_bytes, ag.out_bytes) == ("allgather", 2, 4, 1024, 4096)
    assert ag.message_bytes == 4096 and ag.dtype.name == "bfloat16"
    assert message_call("reduce_scatter", 4, 4096, "float32").out_bytes == 1024
    with pytest.raises(CommError, match="unsupported dtype uint8"):
        message_call("all_reduce", 4, 4096, "uint8")
