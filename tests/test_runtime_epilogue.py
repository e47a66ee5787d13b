"""The runtime side of the fused epilogue (issue 22) on the CPU: the device header compiles with
NVRTC; the simulator's numerics equal a straightforward scalar implementation of the spec's
order bit for bit; packing of radd / rmsnorm; the EpiArgs parameter and every refusal of a bad
call; the specialised kernel and the load checks refuse what they do not run; the executor and
the launcher pass the call's EpiArgs to the epilogue kernels (interpreter and specialised)."""

from __future__ import annotations

import ctypes
import types

import ml_dtypes
import numpy as np
import pytest
import torch

from mscclang.errors import InvalidCall, PlanError
from mscclang.plan.check import validate_plan
from mscclang.plan.io import plan_from_dict
from mscclang.runtime import build
from mscclang.runtime.cuda import PointerArgs
from mscclang.runtime.device_plan import DOP_RADD, DOP_RMSNORM, SLOT_RESIDUAL, check_runnable
from mscclang.runtime.epilogue import Epilogue, EpiPlan, epi_plan, pack_args
from mscclang.runtime.packing import pack_blocks
from mscclang.runtime.spec_source import SpecUnsupported, generate, parse_region
from mscclang.runtime.structs import EPI_ARGS
from mscclang.sim.epilogue import fp8_max, rms_norm_rows
from tests.harness.epilogue_fakes import FakeCudaTensor
from tests.harness.recording_driver import LAUNCH_KERNEL, no_argtypes
from tests.harness.fused_plans import fused_oneshot_dict, fused_oneshot_plan
from tests.harness.nvrtc import needs_nvrtc


F = np.float32
A_TYPES = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
Q_TYPES = {"e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "e5m2": np.dtype(ml_dtypes.float8_e5m2)}


# --------------------------------------------------------------------------------------------
# the device code compiles


@needs_nvrtc
def test_epilogue_header_compiles_for_every_activation_dtype():
    src = '#include "epilogue.cuh"\n' + "".join(
        f'extern "C" __global__ void t_{n}(const u8* r, u8* o, const u64* pc, u32 np, const __grid_constant__ '
        f"EpiArgs e) {{ epi_rmsnorm<{dt}>(r, o, e, pc, np); }}\n"
        for n, dt in (("f16", "DT_F16"), ("bf16", "DT_BF16"), ("f32", "DT_F32")))
    cubin = build.compile_source(src, "sm_90", name="epilogue_test.cu")
    assert len(cubin) > 1000
    # the epilogue kernels are in the interpreter's module source of each activation dtype only
    assert "MSCCLANG_EPI_KERNELS_DT(bf16" in build.module_source("bf16")
    assert "EPI" not in build.module_source("i32") and "EPI" not in build.module_source("bf16", traced=True)
    assert build.kernel_name("f16", "ll8", "sum", 512, epi=True) == "mscclang_f16_ll8_sum_t512_epi"


# --------------------------------------------------------------------------------------------
# the simulator's numerics against a straightforward scalar implementation of the spec


def _fp8_rne(x: F, q: np.dtype) -> int:
    """The FP8 code of a finite fp32 value already clamped to the type's range: the nearest
    representable value, ties to the even code (decoding the 256 codes is exact)."""
    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(q).astype(np.float64)
    ok = np.isfinite(vals)
    d = np.abs(vals - float(x))
    d[~ok] = np.inf
    best = d.min()
    cands = [int(c) for c in codes[d == best]]
    if vals[cands[0]] == 0.0:   # rounds to zero: the sign stays
        return 0x80 if np.signbit(x) else 0
    even = [c for c in cands if c % 2 == 0]
    return (even or cands)[0]


def _scalar_norm(row: np.ndarray, w: np.ndarray, eps: float, act: np.dtype, q: np.dtype = None,
                 scale: float = None) -> np.ndarray:
    """The spec, one fp32 operation at a time (numpy float32 scalars are correctly rounded)."""
    h = len(row)
    v = [F(x) for x in row.astype(np.float32)]
    g_n = h // 8
    part = []
    for g in range(g_n):
        p = F(0.0)
        for i in range(8 * g, 8 * g + 8):
            p = F(p + F(v[i] * v[i]))
        part.append(p)
    width = 1
    while width < g_n:
        width *= 2
    part += [F(0.0)] * (width - g_n)
    stride = width // 2
    while stride >= 1:
        for j in range(stride):
            part[j] = F(part[j] + part[j + stride])
        stride //= 2
    mean = F(part[0] / F(h))
    inv = F(F(1.0) / F(np.sqrt(F(mean + F(eps)))))
    wf = [F(x) for x in w.astype(np.float32)]
    y = np.array([F(F(v[i] * inv) * wf[i]) for i in range(h)], dtype=np.float32).astype(act)
    if q is None:
        return y
    sinv = F(F(1.0) / F(scale))
    m = F(fp8_max(q))
    out = []
    for x in y.astype(np.float32):
        z = F(x * sinv)
        z = m if z > m else (-m if z < -m else z)
        out.append(_fp8_rne(z, q))
    return np.array(out, dtype=np.uint8).view(q)


@pytest.mark.parametrize("h,rows", [(8, 3), (24, 2), (40, 2), (4096, 1), (8200, 1), (16384, 1)])
@pytest.mark.parametrize("act", ["f16", "bf16"])
@pytest.mark.parametrize("wdt", ["f32", "act"])
@pytest.mark.parametrize("quant", [None, "e4m3", "e5m2"])
def test_simulator_numerics_equal_the_scalar_spec(h, rows, act, wdt, quant):
    rng = np.random.default_rng(h * 7 + rows)
    a = A_TYPES[act]
    x = (rng.standard_normal((rows, h)) * rng.choice([0.01, 1.0, 30.0], size=(rows, 1))).astype(a)
    w = (rng.standard_normal(h) * 2).astype(np.float32 if wdt == "f32" else a)
    q = Q_TYPES[quant] if quant else None
    scale = 0.004 if quant else None    # small: many values saturate
    got = rms_norm_rows(x, w, 1e-6, q if q is not None else a, scale=scale,
                        fp8_max_value=fp8_max(q) if q is not None else 0.0)
    for k in range(rows):
        want = _scalar_norm(x[k], w, 1e-6, a, q, scale)
        assert got[k].tobytes() == want.tobytes(), f"row {k}"


# --------------------------------------------------------------------------------------------
# packing and load checks


def test_radd_and_rmsnorm_pack_as_epilogue_records_on_the_residual():
    plan = fused_oneshot_plan()
    nbytes = 7 * 4096 * 2
    pk = pack_blocks(plan, 1, nbytes, nbytes)
    recs = parse_region(pk.blocks[0].region)
    radd, norm = recs[3], recs[5]
    assert radd.kind == DOP_RADD and radd.n_src == 2 and [d & 0xFF for d in radd.operands] == [2, SLOT_RESIDUAL,
                                                                                            SLOT_RESIDUAL]
    assert norm.kind == DOP_RMSNORM and [d & 0xFF for d in norm.operands] == [SLOT_RESIDUAL, 1]
    # the residual has the input's grid; the norm's rows cover the whole residual, in one piece
    assert [(ln, offs) for ln, _, offs in norm.pieces] == [(nbytes, (0, 0))]
    assert radd.pieces[0][2][1:] == (0, 0) and radd.total == nbytes
    assert pk.norms == [("gpus[1].threadblocks[0].ops[5]", [(0, nbytes)], (0, nbytes))]
    assert epi_plan(plan) == EpiPlan(norm=True, quant=False)
    assert epi_plan(fused_oneshot_plan(quant=True)) == EpiPlan(norm=True, quant=True)


def test_every_shipped_fused_plan_loads_and_packs_on_whole_rows(shipped_plans):
    from mscclang.plan.io import load_plan

    fused = [f for f in shipped_plans if f.name.startswith("allreduce_add_rms_norm")]
    if not fused:
        pytest.skip("no shipped fused plans")
    for f in fused:
        plan = load_plan(f)
        check_runnable(plan)   # e.g. the 8-rank two-shot's ppkt of 14 pairs: one record per pair
        ep = epi_plan(plan)
        n, h = plan.world_size, 4096
        for rows in (8 * n, 8 * n + 3, 1):   # row-chunked two-shots take any row count
            if plan.chunk_unit != "row" and rows % n and "twoshot" in f.name:
                continue
            nbytes = rows * h * 2
            for r in range(n):
                pk = pack_blocks(plan, r, nbytes, nbytes // (2 if ep.quant else 1), row_bytes=h * 2)
                assert pk.norms, f.name
                for _, spans, got in pk.norms:
                    if not spans:
                        continue   # a rank with no rows (fewer rows than ranks)
                    a, b = spans[0][0], spans[-1][0] + spans[-1][1]
                    assert a % (h * 2) == 0 and b % (h * 2) == 0
                    assert got == ((a // 2, b // 2) if ep.quant else (a, b)), f.name


def test_ordinary_plans_have_no_epilogue(shipped_plans):
    from mscclang.plan.io import load_plan

    assert shipped_plans, "no shipped plans"
    assert epi_plan(load_plan(shipped_plans[0])) is None


def test_rmsnorms_that_disagree_on_quant_are_refused():
    d = fused_oneshot_dict(quant=True)
    d["gpus"][1]["threadblocks"][0]["ops"][5].pop("quant")
    with pytest.raises(PlanError, match="rmsnorm ops of one plan must all quantise"):
        epi_plan(plan_from_dict(d))


def test_a_remote_residual_is_refused_at_load():
    """The plan's own rule: the simulator (verify) and the runtime both refuse it when loading."""
    d = fused_oneshot_dict()
    d["gpus"][0]["remote_buffers"].append({"rank": 1, "type": "r", "access_channel_types": ["memory"]})
    for load in (lambda p: validate_plan(p), check_runnable):   # verify's loader, the runtime's
        with pytest.raises(PlanError, match="a rank's residual is its own") as e:
            load(plan_from_dict(d))
        assert e.value.path == "gpus[0].remote_buffers[1].type"


def test_the_specialised_kernel_holds_the_epiargs_and_refuses_what_the_epilogue_does_not_run():
    plan = fused_oneshot_plan(quant=True)
    pk = pack_blocks(plan, 0, 7 * 64 * 2, 7 * 64)
    src = generate(plan, pk, "bf16", "ll16", "sum")
    assert src.args.epi and src.args.peer_abort == src.args.epi_args + EPI_ARGS.size
    assert "EpiArgs epi;" in src.source and "epi_rmsnorm<DT>(res, a.out, a.epi, pc, 1u)" in src.source
    assert "res + 0ull, res + 0ull" in src.source   # radd: a sum of (src, residual) into the residual
    assert src.nthreads == plan.num_threads_per_block   # rows of any H: the plan's threads
    for dt, op in (("bf16", "max"), ("i32", "sum")):
        with pytest.raises(SpecUnsupported, match="epilogue ops run sum"):
            generate(plan, pk, dt, "ll16", op)
    plain = generate(load_shipped("allreduce_oneshot_ll.r2.i1"), pack_blocks(load_shipped(
        "allreduce_oneshot_ll.r2.i1"), 0, 4096, 4096), "bf16", "ll16", "sum")
    assert not plain.args.epi and "EpiArgs" not in plain.source


@needs_nvrtc
@pytest.mark.parametrize("name", ["allreduce_add_rms_norm_oneshot_ll.r2.i1.quantTrue",
                                  "allreduce_add_rms_norm_twoshot_ll.r2.i1.inplace"])
def test_specialised_kernels_of_the_shipped_fused_plans_build_for_sm90(name):
    plan = load_shipped(name)
    quant = "quant" in name
    rows = 65   # not a multiple of the ranks: the row-chunked two-shot's chunks are 33 and 32 rows
    pk = pack_blocks(plan, 1, rows * 4096 * 2, rows * 4096 * (1 if quant else 2), row_bytes=4096 * 2)
    src = generate(plan, pk, "bf16", "ll16", "sum")
    assert len(build.compile_source(src.source, "sm_90", options=("-DMSCCLANG_CHECK_LAYOUT",), name="spec.cu")) > 1000


def load_shipped(name: str):
    from pathlib import Path

    from mscclang.plan.io import load_plan

    f = Path(__file__).resolve().parent.parent / "plans" / f"{name}.json"
    if not f.is_file():
        pytest.skip(f"{name} is not shipped")
    return load_plan(f)


# --------------------------------------------------------------------------------------------
# the call's checks and its EpiArgs

BF, N, H = torch.bfloat16, 7 * 64, 64


def _call(**kw):
    """A good bf16 call of 7 rows of 64 on device 0, fields overridable: checked as the executor
    checks it (Executor.call), then packed; returns pack_args' bytes."""
    from mscclang.runtime.executor import Executor
    from mscclang.runtime.state import LoadedPlan

    quant = kw.pop("quant", False)
    args = dict(inp=FakeCudaTensor(BF, N, 0x10000), out=FakeCudaTensor(torch.float8_e4m3fn if quant else BF, N,
                                                                         0x20000),
                res=FakeCudaTensor(BF, N, 0x30000), w=FakeCudaTensor(torch.float32, H, 0x40000),
                params=Epilogue(H, 1e-5, 0.5 if quant else None), arch="sm_90",
                norms=[("gpus[0].threadblocks[0].ops[5]", [(0, N * 2)], (0, N * (1 if quant else 2)))])
    args.update(kw)
    plan = fused_oneshot_plan(quant)
    ep = epi_plan(plan)
    ex = object.__new__(Executor)
    ex.comm = types.SimpleNamespace(rank=0, world_size=plan.world_size, device=0)
    lp = LoadedPlan(plan, False, "ll16", "sum", 512, 1, epi=ep)
    call = ex.call(lp, args["inp"], args["out"], residual=args["res"], weight=args["w"], epilogue=args["params"])
    return pack_args(ep, plan, call, args["arch"], lambda: args["norms"])


def test_a_good_call_packs_its_epiargs():
    got = EPI_ARGS.unpack(_call())
    assert got["residual"] == 0x30000 and got["weight"] == 0x40000 and got["hidden"] == H
    assert got["wdt"] == 0 and got["quant"] == 0 and got["eps"] == float(np.float32(1e-5))
    got = EPI_ARGS.unpack(_call(quant=True, w=FakeCudaTensor(BF, H, 0x40000)))
    assert got["wdt"] == 1 and got["quant"] == 1 and got["scale"] == 0.5
    e5 = _call(quant=True, out=FakeCudaTensor(torch.float8_e5m2, N, 0x20000),
               params=Epilogue(H, 1e-5, 0.25, torch.float8_e5m2))
    assert EPI_ARGS.unpack(e5)["quant"] == 2


@pytest.mark.parametrize("kw,err,match", [
    (dict(params=Epilogue(60), w=FakeCudaTensor(torch.float32, 60, 0x40000)), InvalidCall, "multiple of 8"),
    (dict(params=Epilogue(48), w=FakeCudaTensor(torch.float32, 48, 0x40000)), InvalidCall, "does not divide"),
    (dict(params=Epilogue(70000), w=FakeCudaTensor(torch.float32, 70000, 0x40000)), InvalidCall,
     "multiple of 8 from 8 to 65536"),
    (dict(params=None), InvalidCall, "pass epilogue="),
    (dict(params=Epilogue(H, float("nan"))), InvalidCall, "eps"),
    (dict(w=FakeCudaTensor(torch.float32, H - 8, 0x40000)), InvalidCall, "weight has 56 elements"),
    (dict(w=FakeCudaTensor(torch.float16, H, 0x40000)), InvalidCall, "weight has dtype torch.float16; use float32"),
    (dict(w=None), InvalidCall, "pass weight="),
    (dict(res=None), InvalidCall, "pass the residual"),
    (dict(res=FakeCudaTensor(torch.float16, N, 0x30000)), InvalidCall, "residual has dtype torch.float16, x torch.bfloat16"),
    (dict(res=FakeCudaTensor(BF, N, 0x30000, device=1)), InvalidCall, "residual is on cuda:1"),
    (dict(res=FakeCudaTensor(BF, N, 0x10010)), InvalidCall, "residual overlaps x"),
    (dict(params=Epilogue(H, 1e-5, 0.5)), InvalidCall, "with fp8_scale it must be float8"),
    (dict(quant=True, params=Epilogue(H, 1e-5, 0.0)), InvalidCall, "fp8_scale must be a finite number > 0"),
    (dict(quant=True, params=Epilogue(H, 1e-5, None)), InvalidCall, "without fp8_scale it must be x's"),
    (dict(quant=True, params=Epilogue(H, 1e-5, 1.0, torch.float8_e5m2)), InvalidCall, "differs from the output"),
    (dict(quant=True, arch="sm_80"), InvalidCall, "needs sm_89"),
    (dict(out=FakeCudaTensor(torch.float16, N, 0x20000)), InvalidCall, "out has dtype torch.float16; without fp8_scale"),
    (dict(out=FakeCudaTensor(BF, N - 8, 0x20000)), InvalidCall, r"out has shape \(440,\), x \(448,\)"),
    (dict(quant=True, out=FakeCudaTensor(BF, N, 0x20000)), InvalidCall, "must be float8_e4m3fn or float8_e5m2"),
    (dict(inp=FakeCudaTensor(torch.int32, N, 0x10000), res=FakeCudaTensor(torch.int32, N, 0x30000)), InvalidCall,
     "x has dtype torch.int32; use float16, bfloat16 or float32"),
    (dict(norms=[("gpus[0].threadblocks[0].ops[5]", [(64, N * 2 - 64)], (64, N * 2))]), PlanError, "not whole rows"),
    (dict(quant=True, norms=[("gpus[0].threadblocks[0].ops[5]", [(0, 256)], (0, 256))]), PlanError,
     r"output chunks are bytes \[0, 256\) but its rows belong at \[0, 128\)"),
])
def test_bad_calls_are_refused_naming_what_is_wrong(kw, err, match):
    with pytest.raises(err, match=match):
        _call(**kw)


# --------------------------------------------------------------------------------------------
# the executor and the launcher pass the EpiArgs to the epilogue kernel


def test_execute_passes_the_epiargs_to_the_launch_and_refuses_them_for_other_plans(monkeypatch):
    from mscclang.runtime import executor as exmod
    from mscclang.runtime.executor import Executor
    from mscclang.runtime.state import LaunchEntry, LoadedPlan, Operands

    ex = object.__new__(Executor)
    launched = []
    ex.comm = types.SimpleNamespace(rank=0, world_size=2, device=0)
    ex.arch = "sm_90"
    ex.timeout_ns = 1
    ex.abort = types.SimpleNamespace(aborted=False, state=lambda: 0, user_thread=None)
    ex.launcher = types.SimpleNamespace(current_stream=lambda: 5, stream_capturing=lambda s: False,
                                        launch=lambda *a: launched.append(a))
    plan = fused_oneshot_plan()
    lp = LoadedPlan(plan, False, "ll16", "sum", 512, 1, epi=epi_plan(plan))
    pk = pack_blocks(plan, 0, N * 2, N * 2)
    ex.contexts = types.SimpleNamespace(packed=lambda lp_, a, b, row=0: pk)
    ent = LaunchEntry("F", 0xB10B, 1, 512, 1024, 0xF)
    ex.entries = types.SimpleNamespace(resolve=lambda *a, **k: (ent, Operands()), last_key=None)
    ex.capture = types.SimpleNamespace(registry=None)
    inp, out = FakeCudaTensor(BF, N, 0x10000), FakeCudaTensor(BF, N, 0x20000)
    res, w = FakeCudaTensor(BF, N, 0x30000), FakeCudaTensor(BF, H, 0x40000)
    ex.execute(lp, inp, out, residual=res, weight=w, epilogue=Epilogue(H))
    (e, i, o, di, do, s, t, epi), = launched
    assert (e, i, o, s) == (ent, 0x10000, 0x20000, 5)
    assert EPI_ARGS.unpack(epi)["residual"] == 0x30000 and EPI_ARGS.unpack(epi)["wdt"] == 1
    with pytest.raises(InvalidCall, match="pass the residual"):
        ex.execute(lp, inp, out, weight=w, epilogue=Epilogue(H))
    with pytest.raises(InvalidCall, match="reduces with sum, not max"):
        ex.execute(lp, inp, out, reduce_op="max", residual=res, weight=w, epilogue=Epilogue(H))
    other = LoadedPlan(plan, False, "ll16", "sum", 512, 1)   # as a plan without epilogue ops loads
    with pytest.raises(InvalidCall, match="has no epilogue ops"):
        ex.execute(other, inp, out, residual=res)
    assert len(launched) == 1


def _launcher(seen: list):
    """A real Launcher without a driver: its raw launch records (handle, grid, block, smem,
    stream, the six u64 parameters, the seventh parameter's EpiArgs bytes or None)."""
    from mscclang.runtime.launcher import Launcher

    la = object.__new__(Launcher)
    la.cooperative = False
    la.last_stream = 3
    la.stream_capturing = lambda s: False
    la.trace_ptr = 0
    la._params = (ctypes.c_uint64 * 6)()
    la._param_ptrs = (ctypes.c_void_p * 6)(*[ctypes.addressof(la._params) + 8 * i for i in range(6)])
    la._param_addr = ctypes.addressof(la._param_ptrs)
    la._eargs = ctypes.create_string_buffer(EPI_ARGS.size)
    la._eparams = (ctypes.c_uint64 * 6)()
    la._eparam_ptrs = (ctypes.c_void_p * 7)(*[ctypes.addressof(la._eparams) + 8 * i for i in range(6)],
                                            ctypes.addressof(la._eargs))

    def raw(handle, gx, gy, gz, bx, by, bz, smem, s, params, extra):
        ptrs = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        if handle == 0x5:   # a specialised kernel: one parameter, its SpecArgs
            seen.append((handle, ctypes.string_at(ptrs[0], 48)))
            return 0
        words = [ctypes.c_uint64.from_address(ptrs[i]).value for i in range(6)]
        seen.append((handle, gx, bx, smem, s, words))
        if handle == 0xF:
            seen[-1] += (ctypes.string_at(ptrs[6], EPI_ARGS.size),)
        return 0

    la._raw, la._keep = no_argtypes(raw, LAUNCH_KERNEL)   # as libcuda's, through C
    la._ptr = PointerArgs()
    return la


def test_the_specialised_launch_writes_the_epiargs_into_its_parameters():
    from mscclang.runtime.spec_source import ArgsLayout

    seen = []
    la = _launcher(seen)
    lay = ArgsLayout(1, 1, 1, epi=True)
    args = (ctypes.c_uint64 * (lay.size // 8))()
    ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    sp = types.SimpleNamespace(func="S", fh=0x5, n_blocks=2, nthreads=256, layout=lay)
    ent = types.SimpleNamespace(blob=0xB10B, func="F", handle=0xF, n_blocks=2, nthreads=512, smem=4096,
                                spec=types.SimpleNamespace(args=args, spec=sp, param_addr=ctypes.addressof(ptrs)))
    epi = EPI_ARGS.pack(residual=0x30000, weight=0x40000, hidden=64, wdt=0, quant=0, eps=1e-6)
    la.launch(ent, 0x10, 0x20, 0, 0, 3, 99, epi)
    assert la.last_kernel == "spec" and seen[0][0] == 0x5 and seen[0][1][:16] == (0x10).to_bytes(8, "little") + \
        (0x20).to_bytes(8, "little")
    assert ctypes.string_at(ctypes.addressof(args) + lay.epi_args, EPI_ARGS.size) == epi
    assert list(args)[:5] == [0x10, 0x20, 0, 0, 99]
    # a residual not 16-byte aligned: the interpreter's epilogue kernel runs it
    odd = EPI_ARGS.pack(residual=0x30008, weight=0x40000, hidden=64)
    la.launch(ent, 0x10, 0x20, 0, 0, 3, 99, odd)
    assert la.last_kernel == "interpreter" and seen[1][0] == 0xF and seen[1][-1] == odd


def test_the_raw_launch_passes_64_bit_handles_streams_and_parameter_blocks():
    """cuLaunchKernel has no argtypes: the launcher hands its pointers as c_void_p (a plain int
    would go as a 32-bit C int), made once per value."""
    seen = []
    la = _launcher(seen)
    la.last_stream = s = 0x7F00_DEAD_BEEF
    ent = types.SimpleNamespace(blob=0xB10B, func="F", handle=0x7EEE_0000_1230, n_blocks=3, nthreads=256,
                                smem=70000, spec=None)
    for _ in range(2):
        la.launch(ent, 0x7D00_0000_0010, 0x20, 0, 0, s, 99)
    assert seen == [(0x7EEE_0000_1230, 3, 256, 70000, s, [0xB10B, 0x7D00_0000_0010, 0x20, 0, 0, 99])] * 2
    assert {0x7EEE_0000_1230, s, la._param_addr} <= set(la._ptr.known)


def test_the_launcher_hands_the_epiargs_by_value_as_the_seventh_parameter():
    seen = []
    la = _launcher(seen)
    ent = types.SimpleNamespace(blob=0xB10B, func="F", handle=0xF, n_blocks=2, nthreads=512, smem=4096,
                                spec=None)
    epi = EPI_ARGS.pack(residual=0x30000, weight=0x40000, hidden=64, wdt=0, quant=1, eps=1e-6, scale=0.5)
    la.launch(ent, 0x10, 0x20, 0, 0, 3, 99, epi)
    (h, gx, bx, smem, s, words, got), = seen
    assert (h, gx, bx, smem, s) == (0xF, 2, 512, 4096, 3)
    assert words == [0xB10B, 0x10, 0x20, 0, 0, 99] and got == epi and la.last_kernel == "interpreter"


# --------------------------------------------------------------------------------------------
# what the GPU tests compare with: the simulator's run of each 2-rank fused plan equals the
# postcondition (mscclang.sim.epilogue.fused_reference) at 2 ranks, bit for bit, for a residual
# replicated on every rank (the two-shot gathers each rank's updated residual rows, so it needs
# that)


def _fused_plans_r2() -> list:
    from pathlib import Path

    from mscclang.plan.io import load_plan

    root = Path(__file__).resolve().parent.parent / "plans"
    return [fused_oneshot_plan(False), fused_oneshot_plan(True)] + [
        load_plan(f) for f in sorted(root.glob("allreduce_add_rms_norm*.r2.*json"))]


@pytest.mark.parametrize("i", range(8))
def test_the_simulator_runs_each_fused_plan_to_the_reference(i):
    from mscclang.sim.epilogue import EpilogueParams, fused_reference
    from mscclang.sim.fused import plan_quantises, run_fused

    plans = _fused_plans_r2()
    if i >= len(plans):
        pytest.skip("fewer shipped fused plans")
    plan = plans[i]
    quant = plan_quantises(plan)
    rng = np.random.default_rng(i)
    a = A_TYPES["bf16"]
    h, t = 64, 4
    xs = [(rng.standard_normal(t * h) * 2).astype(a) for _ in range(2)]
    rs = [rng.standard_normal(t * h).astype(a)] * 2   # replicated, as tensor parallelism has it
    params = EpilogueParams(h, (rng.standard_normal(h) + 1).astype(np.float32), 1e-6, 0.05 if quant else None)
    run = run_fused(plan, xs, rs, params)
    assert not run.problems, run.problems
    for r in range(2):
        want_res, want_out = fused_reference(xs, rs[r], params, quant)
        assert run.residuals[r].tobytes() == want_res.tobytes()
        assert run.outputs[r].tobytes() == want_out.tobytes()


# --------------------------------------------------------------------------------------------
# the GPU tests' worker command, run here on the simulator back end (two ranks in threads), so a
# fault of the check itself shows before a GPU run


class _SimFusedExecutor:
    """The few Executor calls the check makes, on a rank's simulator back end."""

    last_kernel = "interpreter"

    def __init__(self, backend) -> None:
        self.b = backend

    def runnable(self, plan):
        return None

    def prepare(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def execute(self, plan, x, out, *, residual, weight, epilogue) -> None:
        from mscclang.plan.call import FusedArgs, make_call

        b = self.b
        call = make_call(plan.collective, b.rank, plan.world_size, x.device, x, out, "sum", None,
                         FusedArgs(residual, weight, epilogue.eps, epilogue.scale, epilogue.hidden))
        b.launch.run_call(plan, call)


@pytest.mark.parametrize("i,fp8", [(0, None), (1, "float8_e5m2"), (2, None), (4, "float8_e4m3fn"), (6, None),
                                   (7, "float8_e5m2")])
def test_the_gpu_check_passes_on_the_simulator(i, fp8):
    import threading

    from mscclang.comm.sim_backend import SimWorld
    from mscclang.plan.io import plan_to_json
    from tests.harness.epilogue_checks import fused_check

    plans = _fused_plans_r2()
    if i >= len(plans):
        pytest.skip("fewer shipped fused plans")
    j = plan_to_json(plans[i])
    world = SimWorld(2, engine="sim", timeout=60.0)
    out: list = [None, None]

    def body(r: int) -> None:
        w = types.SimpleNamespace(rank=r, device=torch.device("cpu"), executor=_SimFusedExecutor(world.backend(r)),
                                  comm=types.SimpleNamespace(barrier=lambda: None))
        out[r] = fused_check(w, j, [2, 7], [8, 64], "bfloat16", "float32", fp8)

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for r in out:
        assert r is not None and not r["bad"], r
        assert r["ran"] and all(t in (2, 7) for t, _ in r["ran"])
