"""CPU tests of the plan-specialised kernels: reading packed regions back, the host copy of the
interpreter's range split, generated sources (NVRTC builds for sm_90: a few representative ones by
default, every library plan shape under ``slow``), kernel parameters, thread choice, policy and the
prebuilt-cubin lookup. No GPU needed; GPU runs are in tests/gpu/test_executor_gpu.py."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from mscclang.config import Settings, settings
from mscclang.runtime.structs import BLOCK_HEADER

from mscclang.plan.io import load_plan, plan_to_json
from mscclang.runtime import build, device_plan as dp, packing as pk, spec_build as sb
from mscclang.plan import samples as sp
from mscclang.runtime.device_plan import DOP_DATA, DOP_PIPELINE, MODE_PACKET
from mscclang.runtime.packing import DevRecord
from mscclang.runtime.spec_source import (
    ArgsLayout, SpecUnsupported, choose_threads, generate, parse_region, sub_ranges,
)
from tests.harness.nvrtc import needs_nvrtc

REPO = Path(__file__).resolve().parent.parent


def _sample(name: str, n: int = 2):
    return load_plan(plan_to_json(sp.SAMPLES[name](n)))


def _out_bytes(plan, n: int) -> int:
    if plan.collective == "allgather":
        return n * plan.world_size
    if plan.collective == "reducescatter":
        return n // plan.world_size
    return n


def _library(pattern: str = "*.json"):
    files = [f for f in sorted(glob.glob(str(REPO / "plans" / pattern))) if not f.endswith("index.json")]
    return [load_plan(Path(f).read_text()) for f in files]


# --------------------------------------------------------------------------------------------
# regions and ranges


def _repack(recs) -> bytes:
    out = b""
    for r in recs:
        dr = DevRecord(r.kind, r.index, list(r.operands), r.n_src, list(r.ids), list(r.pieces), r.flags,
                       (r.tbg_member, r.tbg_size), r.tbg_unit, r.total, r.aux0, r.aux1)
        out += dr.pack()
        if r.kind == DOP_PIPELINE:
            out += _repack(r.inner)
    return out


@pytest.mark.parametrize("name", sorted(sp.SAMPLES))
def test_parse_region_reads_back_every_record(name):
    plan = _sample(name)
    for r in range(2):
        for b in pk.pack_blocks(plan, r, 3000, _out_bytes(plan, 3000)).blocks:
            recs = parse_region(b.region)
            body = _repack(recs)
            h = BLOCK_HEADER.size
            assert b.region[h:h + len(body)] == body
            assert b.region[h + len(body):].strip(b"\0") == b""


def _data_records(recs):
    for r in recs:
        if r.kind == DOP_PIPELINE:
            yield from ((x, r) for x in r.inner if x.kind == DOP_DATA)
        elif r.kind == DOP_DATA:
            yield r, None


@pytest.mark.parametrize("name,nbytes", [("allreduce_oneshot_ll_4b", 4096 + 96), ("allreduce_oneshot_ll_4b", 1000),
                                         ("allgather_pipeline", 5000), ("allgather_put_4b", 3000),
                                         ("allreduce_twostep_ll", 3000)])
def test_sub_ranges_partition_every_record(name, nbytes):
    """Over a thread-block group's members and a pipeline's iterations, the host's range split
    covers each record's pieces exactly once (same total, disjoint, inside the pieces)."""
    plan = _sample(name)
    packed = pk.pack_blocks(plan, 0, nbytes, _out_bytes(plan, nbytes))
    for b in packed.blocks:
        for r, pipe in _data_records(parse_region(b.region)):
            its = range(pipe.aux1) if pipe is not None else [None]
            unit = pipe.total if pipe is not None else 0
            got = []
            for m in range(r.tbg_size):
                r.tbg_member = m
                for it in its:
                    got += sub_ranges(r, it, unit)
            assert sum(s.length for s in got) == r.total
            scale = 2 if (r.operands[0] >> 8) & MODE_PACKET else 1
            spans = sorted((s.offsets[0], s.offsets[0] + scale * s.length) for s in got)
            assert all(a[1] <= b_[0] for a, b_ in zip(spans, spans[1:])), spans
            pieces = [(scale * o[0], scale * (o[0] + ln)) for ln, _, o in r.pieces]
            assert all(any(p0 <= a and e <= p1 for p0, p1 in pieces) for a, e in spans)
            assert all(0 <= s.valid <= s.length for s in got)


# --------------------------------------------------------------------------------------------
# generated sources


def _gen(plan, rank=0, nbytes=1024, dtype="f16", packet="ll16", op="sum", **kw):
    return generate(plan, pk.pack_blocks(plan, rank, nbytes, _out_bytes(plan, nbytes)), dtype, packet, op, **kw)


def test_oneshot_source_is_straight_line_with_constants(monkeypatch):
    monkeypatch.delenv("MSCCLANG_SPEC_FLAGS", raising=False)
    plan = load_plan(plan_to_json(sp.allreduce_oneshot_ll(2, nblocks=1, nthreads=128)))
    s = _gen(plan)
    assert s.nthreads == 128 and s.n_blocks == 1 and s.steps == 2
    src = s.source
    # ppkt: 128 whole LL16 units, gated (first op); repkt: input + packets into output
    assert "sp_packets<DT, OP, PKT, NT, 1, 1, 1, 0x2u, 128u, true>" in src
    assert "sp_packets<DT, OP, PKT, NT, 1, 2, 1, 0x2u, 128u, false>" in src
    assert "{a.in + 0ull, rscr0 + 0ull}" in src and "{a.in + 0ull, scr + 0ull, a.out + 0ull}" in src
    assert "#define DT DT_F16" in src and "#define PKT 16" in src and "__launch_bounds__(128, 1)" in src
    assert src.count("record_error(a, -1, WHAT_PEER_ABORT") == 1
    # flags advance once per block, after the first op and its abort check, behind a barrier
    body = src[src.index("case 0:"):]
    i_stop, i_adv = body.index("if (stop)"), body.index("sp_advance_flags<NT, 1u>")
    assert i_stop < body.index("__syncthreads();  // every warp") < i_adv < body.index("0x2u, 128u, false>")
    assert src.count("sp_advance_flags<") == 1
    monkeypatch.setenv("MSCCLANG_SPEC_FLAGS", "end")
    end = _gen(plan).source
    assert end.index("sp_advance_flags<NT, 1u>") > end.index("default: break;")
    assert "__syncthreads();  // flag reads" in end   # no other barrier in the block
    monkeypatch.setenv("MSCCLANG_SPEC_FLAGS", "sometimes")
    with pytest.raises(SpecUnsupported, match="early or end"):
        _gen(plan)
    monkeypatch.delenv("MSCCLANG_SPEC_FLAGS")
    # rank 1 packs into the same slot of rank 0's scratch: only the comment line differs
    s1 = _gen(plan, rank=1)
    assert ([ln for ln in s1.source.splitlines() if not ln.startswith("//")]
            == [ln for ln in src.splitlines() if not ln.startswith("//")])


def test_sources_depend_on_plan_and_size_only():
    plan = _sample("allreduce_twostep_ll")
    a, b = _gen(plan, nbytes=4096), _gen(plan, nbytes=4096)
    assert a.source == b.source
    assert _gen(plan, nbytes=8192).source != a.source
    assert _gen(plan, nbytes=4096, packet="ll8").source != a.source
    assert "0x" not in re.sub(r"0x[0-9a-f]+u", "", a.source)  # no device address baked in


def test_clipped_units_take_the_generic_path():
    # 3000 B over 2 ranks: rank 1's chunk is clipped inside an LL16 unit-aligned scratch slot
    plan = _sample("allreduce_copyfwd_ll")
    src = _gen(plan, rank=1, nbytes=3000).source
    assert "sp_packets_generic<" in src and "sp_packets<" in src


def test_plain_split_head_body_tail():
    plan = _sample("allreduce_read_simple")
    src = _gen(plan, nbytes=3000).source
    units = [(int(v), int(n)) for v, n in re.findall(r"sp_plain<DT, OP, \d+, \d+, NT, \d+, (\d+), (\d+)u", src)]
    assert units and all(v in (2, 16) for v, _ in units)
    assert any(v == 16 for v, _ in units)


def test_threads_choice(monkeypatch):
    plan = load_plan(plan_to_json(sp.allreduce_oneshot_ll(2, nblocks=1, nthreads=512)))
    packed = pk.pack_blocks(plan, 0, 1024, 1024)
    monkeypatch.delenv("MSCCLANG_SPEC_THREADS", raising=False)
    assert choose_threads(plan, packed) == 128          # 1 KiB = 128 LL16 packets per op
    assert choose_threads(plan, packed, "ll8") == 256   # LL8 carries 4 bytes per packet
    assert choose_threads(plan, packed, mode="plan") == 512
    assert choose_threads(plan, packed, mode="96") == 96
    big = pk.pack_blocks(plan, 0, 1 << 20, 1 << 20)
    assert choose_threads(plan, big) == 512
    monkeypatch.setenv("MSCCLANG_SPEC_THREADS", "plan")
    assert _gen(plan).nthreads == 512
    with pytest.raises(SpecUnsupported):
        choose_threads(plan, packed, mode="4096")


def test_refusals():
    plan = _sample("allreduce_scratch_simple")
    with pytest.raises(SpecUnsupported, match="op segments"):
        _gen(plan, nbytes=4096, max_steps=1)
    with pytest.raises(SpecUnsupported, match="unsupported combination"):
        _gen(plan, dtype="f64")
    # packet offsets that are not LL16-aligned: 1000 B over 2 chunks puts a slot at 500 bytes
    packed = pk.pack_blocks(_sample("allreduce_twostep_ll"), 0, 1000, 1000)
    if packed.packet_align < 8:
        with pytest.raises(SpecUnsupported, match="packet"):
            generate(_sample("allreduce_twostep_ll"), packed, "f16", "ll16", "sum")


def test_args_layout_and_packing():
    lay = ArgsLayout(n_peers=2, n_remote=3, n_channels=4)
    assert lay.offset("in") == 0 and lay.offset("timeout_ns") == 32
    assert lay.peer_abort == 104 and lay.remote == 120 and lay.chan == 144 and lay.size == 144 + 96
    addr = dp.Addresses(0x10000, 0x20000, 0x800, 0x9000, [0x5000, 0x5100], [(0x30000, 2), (0x31000, 0), (0x32000, 1)],
                        [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)])
    plan = _sample("allreduce_oneshot_ll")
    sync = dp.sync_layout(plan, 0)
    w = list(sb.pack_args(lay, addr, sync, 1))
    assert w[lay.offset("flags") // 8] == 0x10000 + dp.SYNC_FLAGS_OFF
    assert w[lay.offset("abort_word") // 8] == 0x10000 + dp.SYNC_ABORT_OFF
    assert w[lay.offset("sems") // 8] == 0x10000 + sync.semaphores
    assert w[lay.offset("bars") // 8] == 0x10000 + sync.barriers
    assert w[lay.offset("scratch") // 8] == 0x20000 and w[lay.offset("half") // 8] == 0x800
    assert w[lay.offset("err") // 8] == 0x9000
    assert w[lay.offset("rank_npeers") // 8] == 1 | (2 << 32)
    assert w[13:15] == [0x5000, 0x5100] and w[15:18] == [0x30000, 0x31000, 0x32000]
    assert w[18:30] == list(range(1, 13)) and w[:5] == [0] * 5
    with pytest.raises(Exception, match="do not match"):
        sb.pack_args(ArgsLayout(1, 3, 4), addr, sync, 0)


def test_policy(monkeypatch):
    monkeypatch.delenv("MSCCLANG_SPECIALIZE", raising=False)
    monkeypatch.delenv("MSCCLANG_SPEC_MAX_BYTES", raising=False)
    mode = Settings.specialize.or_env
    assert mode() == "auto" and settings.specialize == "auto"
    assert mode("0") == "never" and mode("ALWAYS") == "always"
    monkeypatch.setenv("MSCCLANG_SPECIALIZE", "off")
    assert mode() == "never" and mode("auto") == "auto"
    with pytest.raises(Exception, match="auto, always or never"):
        mode("maybe")
    for v in ("MSCCLANG_SPEC_FIRST_BYTES", "MSCCLANG_SPEC_HOT_CALLS"):
        monkeypatch.delenv(v, raising=False)
    assert sb.when("auto", 1024, 1024) == "first" and sb.when("auto", 256 << 10, 256 << 10) == "first"
    assert sb.when("auto", 1 << 20, 1 << 20) == "hot" and sb.when("auto", 64 << 20, 64 << 20) == "hot"
    assert sb.when("auto", 1 << 20, 128 << 20) == "never" and sb.when("auto", 1 << 30, 1 << 30) == "never"
    assert sb.when("always", 1 << 30, 1 << 30) == "first"
    assert sb.when("never", 1024, 1024) == "never"
    assert settings.spec_hot_calls == 3
    monkeypatch.setenv("MSCCLANG_SPEC_HOT_CALLS", "1")   # hot from the first call (built then, in the background)
    assert sb.when("auto", 1 << 20, 1 << 20) == "hot" and settings.spec_hot_calls == 1
    monkeypatch.setenv("MSCCLANG_SPEC_HOT_CALLS", "0")
    with pytest.raises(Exception, match="MSCCLANG_SPEC_HOT_CALLS=0: must be at least 1"):
        settings.spec_hot_calls
    monkeypatch.setenv("MSCCLANG_SPEC_HOT_CALLS", "x")
    with pytest.raises(Exception, match="not an integer"):
        settings.spec_hot_calls
    monkeypatch.delenv("MSCCLANG_SPEC_HOT_CALLS")
    monkeypatch.setenv("MSCCLANG_SPEC_MAX_BYTES", "4096")
    assert sb.when("auto", 8192, 8192) == "never" and sb.when("auto", 4096, 4096) == "first"
    monkeypatch.setenv("MSCCLANG_SPEC_MAX_BYTES", str(1 << 20))
    monkeypatch.setenv("MSCCLANG_SPEC_FIRST_BYTES", "0")
    assert sb.when("auto", 1024, 1024) == "hot" and sb.when("auto", 2 << 20, 2 << 20) == "never"


# --------------------------------------------------------------------------------------------
# NVRTC builds

REPRESENTATIVE = [
    ("allreduce_oneshot_ll", 1024, "f16", "ll16", "sum"),
    ("allreduce_oneshot_ll_4b", 4096 + 96, "i32", "ll8", "max"),
    ("allreduce_twostep_ll", 3000, "bf16", "ll16", "min"),
    ("allreduce_scratch_simple", 8192 + 64, "f32", "ll16", "sum"),   # signal/wait, plain reduce
    ("allgather_pipeline", 5000, "f16", "ll16", "sum"),              # pipeline, semaphore, barrier
    ("allreduce_twostep_ll", 3001, "f8e4m3_a16", "ll16", "sum"),     # fp8, fp16 accumulation, odd bytes
    ("allreduce_scratch_simple", 8192 + 67, "f8e5m2_a32", "ll8", "sum"),  # fp8 plain reduce, 1-byte units
]


@needs_nvrtc
@pytest.mark.parametrize("name,nbytes,dtype,packet,op", REPRESENTATIVE)
def test_representative_sources_build_for_sm90(name, nbytes, dtype, packet, op):
    plan = _sample(name)
    s = _gen(plan, rank=1, nbytes=nbytes, dtype=dtype, packet=packet, op=op)
    cubin = build.compile_source(s.source, "sm_90", ["-DMSCCLANG_CHECK_LAYOUT"], name="spec.cu")
    assert cubin[:4] == b"\x7fELF" and b"mscclang_spec" in cubin


@needs_nvrtc
def test_args_static_asserts_catch_drift():
    s = _gen(_sample("allreduce_oneshot_ll"))
    assert "#ifdef MSCCLANG_CHECK_LAYOUT" in s.source   # offsets only where __builtin_offsetof exists
    build.compile_source(s.source, "sm_90", ["-DMSCCLANG_CHECK_LAYOUT"], name="layout.cu")
    bad = s.source.replace("== 104, \"SpecArgs.peer_abort", "== 112, \"SpecArgs.peer_abort")
    assert bad != s.source
    with pytest.raises(Exception, match="drifted"):
        build.compile_source(bad, "sm_90", ["-DMSCCLANG_CHECK_LAYOUT"], name="drift.cu")
    bad = s.source.replace(f"sizeof(SpecArgs) == {s.args.size}", f"sizeof(SpecArgs) == {s.args.size + 8}")
    with pytest.raises(Exception, match="drifted"):
        build.compile_source(bad, "sm_90", name="drift.cu")


@needs_nvrtc
def test_prebuilt_cubins_are_found_without_nvrtc(tmp_path, monkeypatch):
    plan = load_plan(plan_to_json(sp.allreduce_oneshot_ll(2, nblocks=1, nthreads=128)))
    monkeypatch.setenv("MSCCLANG_CACHE_DIR", str(tmp_path / "cache"))
    done = sb.prebuild(plan, [(1024, 1024)], ["f16"], ["ll16"], ["sum"], tmp_path / "cubins")
    assert len(done) == 2 and all(name.endswith(".cubin") for _, name in done)
    assert len(list((tmp_path / "cubins").glob("mscclang_spec_sm_90_*.cubin"))) == 2
    spec = _gen(plan)
    builder = sb.SpecBuilder("sm_90")
    assert builder.get(spec).origin == "cache"          # prebuild filled the disk cache too
    monkeypatch.setenv("MSCCLANG_CUBIN_DIR", str(tmp_path / "cubins"))

    def no_nvrtc():
        raise build.RuntimeUnavailable("no NVRTC here")

    monkeypatch.setattr(build, "nvrtc_version", no_nvrtc)
    got = builder.get(spec)
    assert got.origin == "prebuilt" and got.cubin[:4] == b"\x7fELF"
    other = _gen(plan, nbytes=2048)
    with pytest.raises(build.RuntimeUnavailable, match="no NVRTC"):
        builder.get(other)


def _refused_at_load(plan) -> bool:
    """Whether ``plan`` never reaches the generator: the runtime refuses it at load, or it has
    port channels (the executor runs those on the interpreter, next to the proxy; the generator
    refuses their port records), or it has epilogue ops (plan/2: they run on the interpreter's
    epilogue kernels, never the specialised one), or segments (plan/3: their lengths come from
    the count matrix when the interpreter runs)."""
    from mscclang.errors import PlanError

    if plan.uses_port_channels() or plan.has_epilogue_ops() or plan.has_segments():
        return True
    try:
        dp.check_runnable(plan)
    except PlanError:
        return False
    return False


def test_every_library_plan_generates():
    """Every shipped plan shape (rank 0, 4 KiB, bf16) the runtime loads: generated, or refused
    only for the reasons the generator names."""
    n_ok = 0
    for plan in _library():
        if _refused_at_load(plan):
            continue
        try:
            s = _gen(plan, nbytes=4096, dtype="bf16")
        except SpecUnsupported as e:  # pragma: no cover - shipped plans are all specialisable at 4 KiB
            pytest.fail(f"{plan.name}: {e}")
        assert s.n_blocks == len(plan.gpus[0].threadblocks) and s.args.size <= 4096
        n_ok += 1
    assert n_ok > 50


@pytest.mark.slow
@needs_nvrtc
def test_every_library_plan_builds_for_sm90():
    for plan in _library():
        if _refused_at_load(plan):
            continue
        for nbytes in (1024, 65536):
            s = _gen(plan, nbytes=nbytes, dtype="bf16")
            assert build.compile_source(s.source, "sm_90", name=f"{plan.name}.cu")[:4] == b"\x7fELF"


def test_kernel_cache_warms_nvrtc_on_the_calling_thread_and_survives_without_it(monkeypatch):
    """Measured on one GPU: the second call of a small size (the one that starts its background
    build) took 145 ms, because the build thread searched for and imported NVRTC holding the GIL
    and the import lock while the call ran. The executor warms NVRTC at set-up (KernelCache.warm);
    without NVRTC, warming logs and the interpreter serves every call."""
    import threading

    from mscclang.errors import RuntimeUnavailable
    from mscclang.runtime import spec_build
    from mscclang.runtime.kernels import KernelCache

    seen = []
    monkeypatch.setattr(spec_build.build, "nvrtc_version", lambda: seen.append(threading.current_thread()) or (13, 0))
    kc = KernelCache("sm_90", 132)
    kc.warm()
    assert seen == [threading.current_thread()]

    def missing():
        raise RuntimeUnavailable("NVRTC is not available")

    monkeypatch.setattr(spec_build.build, "nvrtc_version", missing)
    KernelCache("sm_90", 132).warm()   # no exception


def test_background_builds_load_their_module_off_the_launching_thread(monkeypatch):
    """The background thread builds and loads the module (in the launching thread's context);
    finish() on the launching thread only takes it. Two builds of one kernel keep the first."""
    import threading
    import types

    from mscclang.runtime import kernels as kmod
    from mscclang.runtime.kernels import KernelCache

    loads, unloads, ctxs = [], [], []
    drv = types.SimpleNamespace(
        cuCtxGetCurrent=lambda: (0, "ctx0"),
        cuCtxSetCurrent=lambda c: ctxs.append((threading.current_thread().name, c)) or (0,),
        cuModuleLoadData=lambda b: loads.append(threading.current_thread().name) or (0, f"mod{len(loads)}"),
        cuModuleGetFunction=lambda m, n: (0, f"{m}:fn"),
        cuModuleUnload=lambda m: unloads.append(m),
        cuOccupancyMaxActiveBlocksPerMultiprocessor=lambda f, nt, smem: (0, 1))
    fake_cu = types.SimpleNamespace(driver=lambda: drv, check=lambda r, what="": r[1] if len(r) > 1 else None,
                                    ptr=lambda f: 1)
    monkeypatch.setattr(kmod, "cu", fake_cu)
    kc = KernelCache("sm_90", 132)
    kc._builder = types.SimpleNamespace(name=lambda src: src.source,
                                        get=lambda src: types.SimpleNamespace(cubin=b"c", origin="nvrtc"))
    src = types.SimpleNamespace(source="k1", kernel="k", nthreads=256, n_blocks=4, steps=1, args=None)
    f1 = kc.specialise_later(lambda: src)
    f2 = kc.specialise_later(lambda: src)
    assert kc.wait_builds(10)
    assert loads and all(n.startswith("mscclang-spec-build") for n in loads)
    assert all(c == "ctx0" for _, c in ctxs)
    sp = kc.finish(f1)
    assert sp.origin == "nvrtc" and len(kc._spec_mods) == 1
    kc.finish(f2)
    assert len(kc._spec_mods) == 1 and unloads in ([], ["mod2"])   # the duplicate (if any) unloaded
    kc._pool.shutdown(wait=True)
