"""FP8 collectives on the CPU (docs/semantics.md, "FP8 reductions"): the simulator's reduction
rule against a float64 reference with the documented bound, saturation, the accumulation dtype,
the communicator on the simulator back end and on its torch fallback for all four collectives,
and bad input raising InvalidCall."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mscclang.comm.sim_ranks import catalog_of, run_ranks
from mscclang.comm.tuning import tuning_from_dict
from mscclang.errors import InvalidCall
from mscclang.plan.dtypes import KERNEL_CODES, dtype_info, reduction_code
from mscclang.sim.dtypes import reduce_bytes
from tests.harness.nvrtc import nvrtc_ok
from tests.harness.sim_plans import library_plans

algorithms = pytest.importorskip("mscclang.algorithms")

FP8 = {"float8_e4m3": (torch.float8_e4m3fn, np.dtype(ml_dtypes.float8_e4m3fn), 448.0),
       "float8_e5m2": (torch.float8_e5m2, np.dtype(ml_dtypes.float8_e5m2), 57344.0)}
ACCUMS = ("float32", "float16")


def _reduce(vals: list[np.ndarray], dt: np.dtype, accum: str) -> np.ndarray:
    return reduce_bytes([v.view(np.uint8) for v in vals], dt, "sum", accum).view(dt)


def _exact_rounded(vals: list[np.ndarray], dt: np.dtype, m: float) -> np.ndarray:
    """The float64 sum (exact for a few fp8 values) rounded once to fp8, saturating."""
    s = np.sum([v.astype(np.float64) for v in vals], axis=0)
    return np.clip(s, -m, m).astype(dt)


def _random_fp8(rng: np.random.Generator, n: int, dt: np.dtype, scale: float) -> np.ndarray:
    return (rng.standard_normal(n) * scale).astype(np.float32).astype(dt)


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("accum", ACCUMS)
@pytest.mark.parametrize("nsrc", [2, 3, 8])
def test_simulator_sum_within_the_documented_bound(name, accum, nsrc):
    """Rounded once to fp8: |got - exact| <= u8 |exact| + (nsrc - 1) u_acc sum|v| + half the
    smallest subnormal; two sources (and any fp32 sum of e4m3 values, exact in fp32) round the
    exact sum."""
    _, dt, m = FP8[name]
    rng = np.random.default_rng(nsrc)
    vals = [_random_fp8(rng, 4096, dt, 8.0) for _ in range(nsrc)]
    got = _reduce(vals, dt, accum).astype(np.float64)
    v64 = np.stack([v.astype(np.float64) for v in vals])
    exact = v64.sum(axis=0)
    u8, uacc = dtype_info(name).unit_roundoff, dtype_info(accum).unit_roundoff
    tiny = float(np.finfo(dt).smallest_subnormal)
    bound = u8 * np.minimum(np.abs(exact), m) + (nsrc - 1) * uacc * np.abs(v64).sum(axis=0) + tiny / 2
    assert np.all(np.abs(got - np.clip(exact, -m, m)) <= bound)
    if nsrc == 2 or (accum == "float32" and name == "float8_e4m3"):
        want = _exact_rounded(vals, dt, m)
        assert np.array_equal(got, want.astype(np.float64))


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("accum", ACCUMS)
def test_overflow_saturates_and_nan_stays_nan(name, accum):
    _, dt, m = FP8[name]
    a = np.array([m, -m, m, np.nan, 1.0, m / 2], dtype=np.float32).astype(dt)
    b = np.array([m, -m, -m, 1.0, np.nan, m / 2], dtype=np.float32).astype(dt)
    got = _reduce([a, b], dt, accum).astype(np.float32)
    assert list(got[[0, 1, 2, 5]]) == [m, -m, 0.0, m]
    assert np.isnan(got[3]) and np.isnan(got[4])
    # many overflowing sources (fp16 accumulation reaches infinity on e5m2): still the max
    got = _reduce([np.full(4, m, np.float32).astype(dt)] * 5, dt, accum).astype(np.float32)
    assert list(got) == [m] * 4


def test_e5m2_infinity_saturates_in_a_sum_and_is_copied_alone():
    dt = FP8["float8_e5m2"][1]
    inf = np.array([np.inf, -np.inf], dtype=np.float32).astype(dt)
    one = np.ones(2, np.float32).astype(dt)
    assert list(_reduce([inf, one], dt, "float32").astype(np.float32)) == [57344.0, -57344.0]
    assert np.array_equal(reduce_bytes([inf.view(np.uint8)], dt, "sum"), inf.view(np.uint8))


def test_accumulation_dtype_changes_a_three_source_sum():
    """1024 + 128 + 0.5: fp32 keeps 1152.5 (above the e5m2 midpoint 1152, so 1280); fp16 rounds it
    to 1152 (a tie, to even 1024)."""
    dt = FP8["float8_e5m2"][1]
    vals = [np.array([x], np.float32).astype(dt) for x in (1024.0, 128.0, 0.5)]
    assert float(_reduce(vals, dt, "float32")[0]) == 1280.0
    assert float(_reduce(vals, dt, "float16")[0]) == 1024.0


def test_kernel_codes_and_reduction_codes():
    assert {"f8e4m3_a32", "f8e4m3_a16", "f8e5m2_a32", "f8e5m2_a16"} <= set(KERNEL_CODES)
    assert reduction_code(torch.float8_e4m3fn) == "f8e4m3_a32"
    assert reduction_code(torch.float8_e5m2, "sum", torch.float16) == "f8e5m2_a16"
    assert reduction_code(torch.bfloat16, "max") == "bf16"


@pytest.mark.parametrize("dtype,op,accum,says", [
    (torch.float16, "sum", "float32", "accum_dtype"),
    (torch.float8_e4m3fn, "max", None, "reduce op max"),
    (torch.float8_e5m2, "min", "float16", "reduce op min"),
    (torch.float8_e4m3fn, "sum", torch.bfloat16, "not an accumulation dtype"),
])
def test_bad_reductions_raise_invalid_call(dtype, op, accum, says):
    with pytest.raises(InvalidCall, match=says):
        reduction_code(dtype, op, accum)


# ------------------------------------------------------------------------------ communicator
N = 2


def _only(coll: str, name: str):
    return tuning_from_dict({"format": "mscclang.tuning/1", "rules": [
        {"collective": coll, "candidates": [{"plan": name}]}]})


def _inputs(numel: int, tdt, m: float, big: bool) -> list[torch.Tensor]:
    """Per-rank fp8 inputs; ``big``: near the largest finite value, so that sums overflow."""
    xs = []
    for r in range(N):
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn(numel, generator=g) * (m / 4)
        if big:
            x[::3] = m * 0.9
        xs.append(x.to(tdt))
    return xs


def _want_sum(xs: list[torch.Tensor], dt: np.dtype, m: float) -> torch.Tensor:
    """The exact (float64) sum rounded once to fp8 with saturation: two sources per op."""
    vals = [x.view(torch.uint8).numpy().view(dt) for x in xs]
    got = _exact_rounded(vals, dt, m)
    return torch.from_numpy(got.view(np.uint8).copy()).view(xs[0].dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


CASES = [("allreduce", "allreduce_oneshot_ll"), ("allreduce", "allreduce_twostep_ll"),
         ("allreduce", "allreduce_rsag_simple"), ("allreduce", "allreduce_rsag_zero_copy"),
         ("reducescatter", "reducescatter_ll"), ("reducescatter", "reducescatter_simple"),
         ("allgather", "allgather_ll"), ("allgather", "allgather_zero_copy"),
         ("alltoall", "alltoall_ll"), ("alltoall", "alltoall_zero_copy")]


def _body(coll: str, numel: int, tdt, m: float, accum, big: bool):
    def body(comm):
        x = _inputs(numel, tdt, m, big)[comm.rank]
        k = numel // N
        if coll == "allreduce":
            return comm.all_reduce(x.clone(), out=torch.empty_like(x), accum_dtype=accum)
        if coll == "reducescatter":
            return comm.reduce_scatter(x.clone(), accum_dtype=accum)
        if coll == "allgather":
            return comm.all_gather(x[:k].clone())
        return comm.all_to_all(x.clone(), out=torch.empty_like(x))
    return body


def _want(coll: str, r: int, numel: int, tdt, dt, m: float, big: bool) -> torch.Tensor:
    xs = _inputs(numel, tdt, m, big)
    k = numel // N
    if coll == "allreduce":
        return _want_sum(xs, dt, m)
    if coll == "reducescatter":
        return _want_sum([x[r * k:(r + 1) * k] for x in xs], dt, m)
    if coll == "allgather":
        return torch.cat([x[:k] for x in xs])
    return torch.cat([x[r * k:(r + 1) * k] for x in xs])


@pytest.mark.parametrize("coll,name", [c for c in CASES if c[1] in algorithms.ALGORITHMS])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("numel,accum,big", [(1002, None, True), (38, torch.float16, False)])
def test_communicator_fp8_on_the_simulator(coll, name, fp8, numel, accum, big):
    tdt, dt, m = FP8[fp8]
    results, world, fb = run_ranks(N, _body(coll, numel, tdt, m, accum, big), plans=library_plans([name], N),
                                   tuning=_only(coll, name), engine="sim")
    assert fb.calls == [] and world.launches and all(n.startswith(name) for n in world.launches)
    for r, got in enumerate(results):
        assert got.dtype == tdt and _same(got, _want(coll, r, numel, tdt, dt, m, big)), (r, coll, name)


@pytest.mark.parametrize("coll", ["allreduce", "reducescatter", "allgather", "alltoall"])
@pytest.mark.parametrize("fp8", FP8)
def test_communicator_fp8_on_the_torch_fallback(coll, fp8):
    """No plan: the fallback moves fp8 as bytes and reduces by the one-shot rule."""
    tdt, dt, m = FP8[fp8]
    results, _, fb = run_ranks(N, _body(coll, 64, tdt, m, "fp16", True), catalog=catalog_of([]))
    assert fb.calls == ["allgather" if coll in ("allreduce", "reducescatter") else coll] * N
    for r, got in enumerate(results):
        assert _same(got, _want(coll, r, 64, tdt, dt, m, True)), (r, coll)


@pytest.mark.parametrize("call,says", [
    (lambda c, x: c.all_reduce(x.half(), accum_dtype=torch.float32), "applies to fp8 tensors only"),
    (lambda c, x: c.all_reduce(x, op="max"), "reduce op max"),
    (lambda c, x: c.reduce_scatter(x, op="min"), "reduce op min"),
    (lambda c, x: c.all_reduce(x, accum_dtype="bf16"), "not an accumulation dtype"),
    (lambda c, x: c.prepare("all_reduce", x, accum_dtype="int32"), "not an accumulation dtype"),
])
def test_communicator_bad_fp8_input_raises_invalid_call(call, says):
    def body(comm):
        with pytest.raises(InvalidCall, match=says):
            call(comm, torch.zeros(16, dtype=torch.float8_e4m3fn))
        return True

    results, world, _ = run_ranks(N, body, plans=library_plans(["allreduce_oneshot_ll", "reducescatter_ll"], N),
                                  engine="sim")
    assert results == [True, True] and world.launches == []


# ------------------------------------------------------------------------------ kernel sources


def test_fp8_module_sources_hold_the_sum_only():
    from mscclang.runtime import build

    assert "MSCCLANG_KERNELS_SUM_DT(f8e5m2_a16, DT_F8E5M2_A16)" in build.module_source("f8e5m2_a16")
    assert "MSCCLANG_KERNELS_DT(f16, DT_F16)" in build.module_source("f16")
    assert build.module_kernels("f8e4m3_a32") == 2 and build.module_kernels("bf16") == 6
    assert build.kernel_name("f8e4m3_a16", "ll8", "sum", 512) == "mscclang_f8e4m3_a16_ll8_sum_t512"


@pytest.mark.skipif(not nvrtc_ok(), reason="NVRTC not available")
@pytest.mark.parametrize("code,pkt", [("f8e4m3_a32", 16), ("f8e5m2_a16", 8)])
def test_one_fp8_interpreter_kernel_builds_for_sm90(code, pkt):
    """One kernel of the module (a few seconds; the whole module is built by build-kernel)."""
    from mscclang.runtime import build

    name = build.kernel_name(code, f"ll{pkt}", "sum", 512)
    src = ("#define MSCCLANG_ONLY_DTYPE\n#include \"kernels.cu\"\n"
           f"MSCCLANG_KERNEL({name}, DT_{code.upper()}, {pkt}, ROP_SUM, 512)\n")
    cubin = build.compile_source(src, "sm_90", name=f"{code}.cu")
    assert cubin[:4] == b"\x7fELF" and name.encode() in cubin


def test_fp8_through_a_real_gloo_fallback():
    """torch.distributed (gloo, threads over one store) cannot reduce fp8: the fallback gathers the
    bytes and reduces by the one-shot rule; data movement goes as bytes."""
    import threading

    import torch.distributed as dist

    from mscclang.comm import Communicator
    from mscclang.comm.fallback import TorchFallback

    store = dist.HashStore()
    tdt, dt, m = FP8["float8_e5m2"]
    res: list = [None] * N

    def body(r: int) -> None:
        comm = Communicator(store=store, rank=r, world_size=N, device="cpu",
                            fallback=TorchFallback(store=store, rank=r, world_size=N,
                                                   device=torch.device("cpu"), timeout_s=20.0))
        try:
            x = _inputs(40, tdt, m, True)[r]
            res[r] = (comm.all_reduce(x.clone(), accum_dtype="fp16"), comm.reduce_scatter(x.clone()),
                      comm.all_gather(x[:20].clone()), comm.all_to_all(x.clone(), out=torch.empty_like(x)))
        finally:
            comm.close()

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(N)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    for r in range(N):
        assert res[r] is not None, f"rank {r} failed or hung"
        for got, coll in zip(res[r], ("allreduce", "reducescatter", "allgather", "alltoall")):
            assert _same(got, _want(coll, r, 40, tdt, dt, m, True)), (r, coll)


@pytest.mark.parametrize("coll", ["allreduce", "reducescatter"])
def test_the_collective_reference_saturates_like_the_simulator(coll):
    """plan.reference (the definition the checks of ``mscclang run`` use): the one-shot rule."""
    tdt, dt, m = FP8["float8_e4m3"]
    name = "allreduce_oneshot_ll" if coll == "allreduce" else "reducescatter_ll"
    results, _, _ = run_ranks(N, _body(coll, 66, tdt, m, None, True), plans=library_plans([name], N),
                              tuning=_only(coll, name), engine="reference")
    for r, got in enumerate(results):
        assert _same(got, _want(coll, r, 66, tdt, dt, m, True)), r


def _resolved_kernel_codes() -> list[tuple[str, str, object, str]]:
    """(collective, dtype, accum, kernel code) of every API collective x GPU dtype x accumulation
    choice the call accepts (None, and each accumulation dtype where the dtype accumulates), as
    :func:`mscclang.plan.call.make_call` resolves them at 4 ranks on ordinary tensors."""
    from mscclang.plan.call import MIN_HIDDEN, FusedArgs, make_call
    from mscclang.plan.collectives import TABLE
    from mscclang.plan.dtypes import ACCUM_DTYPES, GPU_DTYPES, EPILOGUE_DTYPES, find_dtype

    n, dev, seen = 4, torch.device("cpu"), []
    for row in TABLE.values():
        if row.api is None and not row.fused:
            continue
        for name in GPU_DTYPES:
            info = find_dtype(name)
            if row.fused and name not in EPILOGUE_DTYPES:
                continue
            accums = (None,) + (ACCUM_DTYPES if info.accumulates and row.reduces and not row.fused else ())
            for accum in accums:
                if row.fused:
                    x = torch.zeros(2, MIN_HIDDEN, dtype=info.torch)
                    call = make_call(row, 1, n, dev, x, torch.empty_like(x),
                                     epi=FusedArgs(torch.zeros_like(x), torch.ones(MIN_HIDDEN, dtype=info.torch)))
                else:
                    bi, bo = row.blocks(n)
                    call = make_call(row, 1, n, dev, torch.zeros(bi * 64, dtype=info.torch),
                                     torch.zeros(bo * 64, dtype=info.torch), accum=accum)
                seen.append((row.name, name, accum, call.kernel_code))
    return seen


def test_every_call_resolves_to_a_kernel_module_the_build_provides():
    """Every collective x GPU dtype x accumulation choice resolves to a kernel code that
    :data:`mscclang.runtime.build.DTYPES` builds (an fp8 all_gather has no accumulation dtype of
    its own: it once resolved to ``f8e4m3``, which no module holds, and failed on the GPU)."""
    from mscclang.runtime.build import DTYPES as BUILT

    seen = _resolved_kernel_codes()
    assert {c for c, *_ in seen} >= {"allgather", "alltoall", "broadcast", "allreduce", "reducescatter"}
    assert {d for _, d, *_ in seen} >= {"float8_e4m3", "float8_e5m2", "bfloat16"}
    missing = [s for s in seen if s[3] not in BUILT]
    assert not missing, f"{len(missing)} calls resolve to a code no module holds: {missing[:8]}"
