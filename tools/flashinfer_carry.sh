#!/usr/bin/env bash
# Build .fi/flashinfer.tar.xz: a slim FlashInfer for a GPU machine with no network, Python 3.12.
#
#   bash tools/flashinfer_carry.sh            # from the repository root, on a machine with pip
#
# What the project needs from FlashInfer there is `import flashinfer.comm` and the TRT-LLM
# allreduce-fusion path (create_allreduce_fusion_workspace(backend="trtllm") + allreduce_fusion),
# whose CUDA module (`trtllm_comm`) FlashInfer JIT-compiles with nvcc at first use. The archive
# holds one folder, site/, to put on PYTHONPATH:
#
#   site/flashinfer/   the .py modules that `import flashinfer` and `import flashinfer.comm` load
#                      (every module-level import, followed statically from the two __init__.py,
#                      try/except-guarded ones too, plus the modules the call path imports lazily)
#                      and, under data/, what the trtllm_comm JIT build reads: its three .cu
#                      sources and the csrc headers they include, data/include, data/cccl and
#                      data/spdlog whole (the vendored CCCL takes precedence over the toolkit's,
#                      so it must not be half there), and cutlass/arch/arch.h (read at import).
#                      Dropped: the cake_*/experimental kernel sources, every other csrc, CUTLASS.
#   site/tvm_ffi/      apache-tvm-ffi (cp312 manylinux): the only third-party import that the
#                      machine lacks and that is not guarded (FlashInfer's JIT loads modules
#                      through it). cudnn-frontend, cuda-tile, nccl4py, nccl-extensions and
#                      nvidia-cutlass-dsl are imported under try/except or not at all on this
#                      path, so they stay out.
#
#   site/.aot/trtllm_comm/trtllm_comm.so   optional: the trtllm_comm module built ahead of time
#                      (sm_90a, nvcc 13.0), when $FI_AOT_SO (default
#                      /tmp/fi/aot/trtllm_comm-$FI_VERSION-sm90a.so) exists. The prelude links
#                      it in as flashinfer/data/aot, where FlashInfer loads a module before it
#                      thinks of building one, falling back to the JIT build if it will not load. ptxas alone takes minutes per source,
#                      so this spares the GPU machine's first run several minutes.
#                      `PYTHON=... bash tools/flashinfer_carry.sh --build-aot` builds it here
#                      first (nvcc 13.0, one job unless MAX_JOBS says otherwise; PYTHON needs what
#                      the GPU machine has that FlashInfer imports: torch (CPU is enough), numpy,
#                      nvidia-ml-py, einops, ninja, ...; tens of minutes on a small machine), then
#                      packs.
#
# Beside it: .fi/flashinfer.sha256 (the archive's hash, which the prelude uses as a stamp),
# .fi/flashinfer.files (the archive's file list) and .fi/prelude.sh, which the device command
# sources from the repository root first.
#
# Inputs (downloaded with pip when absent): FI_WHEEL, TVM_WHEEL; output folder: FI_OUT (.fi).
set -euo pipefail
BUILD_AOT=0
[ "${1:-}" = "--build-aot" ] && BUILD_AOT=1

FI_VERSION=${FI_VERSION:-0.7.4}
TVM_VERSION=${TVM_VERSION:-0.1.15.post2}
DL=${FI_DOWNLOAD_DIR:-/tmp/fi}
OUT=${FI_OUT:-.fi}
PY=${PYTHON:-python3}

pip_get() {  # NAME==VERSION: a cp312 manylinux (or pure) wheel into $DL
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$DL" "$1" >&2
}
first() { for f in "$@"; do [ -f "$f" ] && { echo "$f"; return 0; }; done; return 1; }

mkdir -p "$DL"
FI_WHEEL=${FI_WHEEL:-$(first "$DL"/flashinfer_python-"$FI_VERSION"-py3-none-any.whl || true)}
if [ -z "$FI_WHEEL" ]; then
    pip_get "flashinfer-python==$FI_VERSION"
    FI_WHEEL=$(first "$DL"/flashinfer_python-"$FI_VERSION"-py3-none-any.whl)
fi
TVM_WHEEL=${TVM_WHEEL:-$(first "$DL"/apache_tvm_ffi-"$TVM_VERSION"-cp312-cp312-*.whl "$DL"/deps/apache_tvm_ffi-"$TVM_VERSION"-cp312-cp312-*.whl || true)}
if [ -z "$TVM_WHEEL" ]; then
    pip_get "apache-tvm-ffi==$TVM_VERSION"
    TVM_WHEEL=$(first "$DL"/apache_tvm_ffi-"$TVM_VERSION"-cp312-cp312-*.whl)
fi
echo "flashinfer wheel: $FI_WHEEL" >&2
echo "tvm-ffi wheel:    $TVM_WHEEL" >&2

STAGE=$(mktemp -d /tmp/fi-stage.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/site"

# Select and extract (no full unpack of the 700 MB wheel).
"$PY" - "$FI_WHEEL" "$TVM_WHEEL" "$STAGE/site" <<'PYEOF'
import ast, posixpath, re, sys, zipfile

fi_whl, tvm_whl, site = sys.argv[1:4]
z = zipfile.ZipFile(fi_whl)
names = set(z.namelist())


def modfile(mod):
    p = mod.replace(".", "/")
    if p + "/__init__.py" in names:
        return p + "/__init__.py"
    if p + ".py" in names:
        return p + ".py"
    return None


def modname(f):
    m = f[:-3].replace("/", ".")
    return m[: -len(".__init__")] if m.endswith(".__init__") else m


def module_level_imports(tree):
    """Imports outside function and class bodies (module level, inside if/try/with too)."""
    stack = list(tree.body)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            yield n
        elif not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(c for c in ast.iter_child_nodes(n) if isinstance(c, (ast.stmt, ast.excepthandler)))


def deps(f):
    me = modname(f)
    pkg = me if f.endswith("__init__.py") else me.rpartition(".")[0]
    found = set()
    for n in module_level_imports(ast.parse(z.read(f), f)):
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
            continue
        if n.level:
            base = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
            b = ".".join(base + ([n.module] if n.module else []))
        else:
            b = n.module or ""
        found.add(b)
        found.update(f"{b}.{a.name}" for a in n.names)
    out = set()
    for m in found:
        parts = m.split(".")
        if parts[0] != "flashinfer":
            continue
        for i in range(1, len(parts) + 1):  # the packages above a module run their __init__ too
            mf = modfile(".".join(parts[:i]))
            if mf:
                out.add(mf)
    return out


# Seeds: the two packages the project imports, and the modules that the trtllm path imports
# inside functions (api logging / tracing hooks, the JIT machinery).
seeds = ["flashinfer/__init__.py", "flashinfer/comm/__init__.py", "flashinfer/_build_meta.py",
         "flashinfer/version.py", "flashinfer/fi_trace.py", "flashinfer/jit/api_log_stats.py",
         "flashinfer/jit/comm.py", "flashinfer/jit/core.py", "flashinfer/jit/cpp_ext.py",
         "flashinfer/jit/env.py", "flashinfer/comm/trtllm_ar.py", "flashinfer/comm/allreduce.py",
         "flashinfer/comm/mnnvl.py", "flashinfer/comm/fd_exchange.py", "flashinfer/comm/comm_backend.py",
         "flashinfer/comm/torch_symmetric_memory.py", "flashinfer/cuda_utils.py", "flashinfer/utils.py"]
seeds += sorted(n for n in names if n.startswith("flashinfer/trace/") and n.endswith(".py"))
missing = [s for s in seeds if s not in names]
if missing:
    sys.exit(f"flashinfer wheel lacks {missing}")
py, todo = set(), list(seeds)
while todo:
    f = todo.pop()
    if f not in py:
        py.add(f)
        todo.extend(deps(f))

# JIT sources of the trtllm_comm module, read from gen_trtllm_comm_module in jit/comm.py.
src = z.read("flashinfer/jit/comm.py").decode()
body = re.search(r"def gen_trtllm_comm_module\(.*?\n(?=def )", src, re.S).group(0)
cu = re.findall(r'FLASHINFER_CSRC_DIR\s*/\s*"([^"]+)"', body)
assert cu, "no sources found in gen_trtllm_comm_module"
data = set()
keep_whole = ("flashinfer/data/include/", "flashinfer/data/cccl/", "flashinfer/data/spdlog/")
data.update(n for n in names if n.startswith(keep_whole) and not n.endswith("/"))
data.add("flashinfer/data/cutlass/include/cutlass/arch/arch.h")  # read by cutlass_supports_sm107()
# csrc: the sources and, transitively, every header they include that lives in csrc
# (quoted or angled, resolved against the including file's folder and the include roots).
roots = ["flashinfer/data/csrc", "flashinfer/data/include", "flashinfer/data/spdlog/include"]
inc_re = re.compile(rb'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
todo = [f"flashinfer/data/csrc/{c}" for c in cu]
seen = set()
while todo:
    f = todo.pop()
    if f in seen:
        continue
    seen.add(f)
    if f not in names:
        sys.exit(f"missing JIT source {f}")
    for inc in inc_re.findall(z.read(f)):
        inc = inc.decode()
        for r in [posixpath.dirname(f)] + roots:
            cand = posixpath.normpath(posixpath.join(r, inc))
            if cand in names:
                todo.append(cand)
                break
data.update(seen)

dist = [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[1] in ("METADATA", "WHEEL")]
sel = sorted(py | data | set(dist))
for n in sel:
    z.extract(n, site)
csrc = sorted(n for n in sel if n.startswith("flashinfer/data/csrc/"))
print(f"flashinfer: {len(py)} .py modules, {len(data)} data files; csrc kept: {csrc}", file=sys.stderr)

# apache-tvm-ffi, less its vendored libbacktrace sources. Its testing library stays: the cp312
# core module links against it (seen on the H200: "ImportError: libtvm_ffi_testing.so").
t = zipfile.ZipFile(tvm_whl)
drop = ("tvm_ffi/3rdparty/libbacktrace/",)
kept = [n for n in t.namelist() if not n.startswith(drop) and not n.endswith("/")]
for n in kept:
    t.extract(n, site)
print(f"tvm_ffi: {len(kept)} files", file=sys.stderr)
PYEOF

# The extracted shared objects keep their execute bits off; restore them.
find "$STAGE/site" -name '*.so*' -exec chmod 755 {} +

AOT_SO=${FI_AOT_SO:-$DL/aot/trtllm_comm-$FI_VERSION-sm90a.so}
if [ "$BUILD_AOT" = 1 ]; then
    # Build trtllm_comm from the slim tree with this machine's nvcc and python (+ CPU torch);
    # tvm_ffi for this python's version comes from pip when it is not 3.12.
    "$PY" -c 'import torch, numpy, pynvml, einops, ninja, jinja2, filelock' \
        || { echo "--build-aot: $PY lacks a module FlashInfer imports (set PYTHON)" >&2; exit 1; }
    PYV=$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')
    TVM_HERE="$STAGE/site"
    if [ "$PYV" != 312 ]; then
        mkdir -p "$DL/tvm$PYV" "$STAGE/tvm$PYV"
        w=$(first "$DL/tvm$PYV"/apache_tvm_ffi-"$TVM_VERSION"-cp"$PYV"-*.whl || true)
        if [ -z "$w" ]; then
            "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DL/tvm$PYV" "apache-tvm-ffi==$TVM_VERSION" >&2
            w=$(first "$DL/tvm$PYV"/apache_tvm_ffi-"$TVM_VERSION"-cp"$PYV"-*.whl)
        fi
        "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$STAGE/tvm$PYV"
        TVM_HERE="$STAGE/tvm$PYV"
    fi
    CH=${CUDA_HOME:-$(cd "$(nvcc --dryrun -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)" && pwd)}
    # FlashInfer links with -lcuda, which a toolkit assembled from wheels has no stub for and a
    # machine without a driver cannot resolve; the module uses no driver symbol, so an empty
    # stub (soname libcuda.so.1) does.
    LDX=${FLASHINFER_EXTRA_LDFLAGS:-}
    if [ ! -e "$CH/lib64/stubs/libcuda.so" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so ('; then
        mkdir -p "$DL/stubs"
        echo "" | cc -shared -x c - -o "$DL/stubs/libcuda.so" -Wl,-soname,libcuda.so.1
        LDX="$LDX -L$DL/stubs"
    fi
    CUDA_HOME=$CH FLASHINFER_EXTRA_LDFLAGS=$LDX \
    PYTHONPATH="$TVM_HERE:$STAGE/site" FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-1} \
    FLASHINFER_WORKSPACE_BASE="$DL/aot-build" FLASHINFER_JIT_DEBUG=0 \
        "$PY" - "$AOT_SO" <<'PYEOF'
import shutil, sys, time
from pathlib import Path
from flashinfer.jit.comm import gen_trtllm_comm_module
spec = gen_trtllm_comm_module()
t = time.time()
spec.build()
Path(sys.argv[1]).parent.mkdir(parents=True, exist_ok=True)
shutil.copyfile(spec.jit_library_path, sys.argv[1])
print(f"built {sys.argv[1]} in {time.time() - t:.0f} s", file=sys.stderr)
PYEOF
fi
if [ -f "$AOT_SO" ]; then
    mkdir -p "$STAGE/site/.aot/trtllm_comm"
    cp "$AOT_SO" "$STAGE/site/.aot/trtllm_comm/trtllm_comm.so"
    chmod 755 "$STAGE/site/.aot/trtllm_comm/trtllm_comm.so"
    echo "carrying the prebuilt $AOT_SO" >&2
else
    echo "no prebuilt trtllm_comm.so ($AOT_SO): the GPU machine JIT-builds it" >&2
fi

# Check: with the slim tree only, `nvcc -M` finds every header of the three sources (toolkit and
# system headers aside). Done only where nvcc exists; it compiles nothing.
NVCC=$(command -v nvcc || true)
if [ -n "$NVCC" ]; then
    D="$STAGE/site/flashinfer/data"
    T="$STAGE/site/tvm_ffi/include"
    for s in "$D"/csrc/trtllm_*allreduce*.cu; do
        "$NVCC" -M -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
            -DNDEBUG -DFLASHINFER_ENABLE_F16 -DFLASHINFER_ENABLE_BF16 -DFLASHINFER_ENABLE_FP8_E4M3 \
            -DFLASHINFER_ENABLE_FP8_E5M2 -DFLASHINFER_ENABLE_FP8_E8M0 -DFLASHINFER_ENABLE_FP4_E2M1 \
            -I"$D/cccl/cub" -I"$D/cccl/libcudacxx/include" -I"$D/cccl/thrust" -isystem "$T" \
            -isystem "$D/include" -isystem "$D/csrc" -isystem "$D/cutlass/include" \
            -isystem "$D/spdlog/include" "$s" > "$STAGE/deps.txt" \
            || { echo "nvcc -M failed on $s with the slim tree" >&2; exit 1; }
        echo "nvcc -M ok: $(basename "$s") ($(tr ' ' '\n' < "$STAGE/deps.txt" | grep -c "$STAGE") headers from the slim tree)" >&2
    done
    rm -f "$STAGE/deps.txt"
else
    echo "nvcc not found here: skipped the nvcc -M header check" >&2
fi

mkdir -p "$OUT"
(cd "$STAGE" && find site -type f | LC_ALL=C sort) > "$OUT/flashinfer.files"
tar -C "$STAGE" --owner=0 --group=0 --numeric-owner -cf - site | xz -9 -T1 > "$OUT/flashinfer.tar.xz.part"
mv "$OUT/flashinfer.tar.xz.part" "$OUT/flashinfer.tar.xz"
sha256sum "$OUT/flashinfer.tar.xz" | cut -d' ' -f1 > "$OUT/flashinfer.sha256"

cat > "$OUT/prelude.sh" <<'SHEOF'
# Source from the repository root on the GPU machine, first:  source .fi/prelude.sh
# Unpacks .fi/flashinfer.tar.xz into /tmp/fisite (once per archive), puts it on PYTHONPATH, and
# sets FlashInfer's JIT up for sm_90 (H200) with its cache under /tmp. NVLink multicast stays
# off: NCCL's NVLS, torch symmetric memory's multicast, and FlashInfer's trtllm workspace, which
# this pins to SymmDeviceMemory(enable_multicast=False) (unicast cuMem* buffers, one mapping per
# peer; FABRIC handles, or POSIX fds when FABRIC is unusable) rather than torch symmetric memory.
_fi_dir=$(cd "$(dirname "${BASH_SOURCE[0]:-.fi/prelude.sh}")" && pwd)
FI_SITE=${FI_SITE:-/tmp/fisite}
_fi_sum=$(cat "$_fi_dir/flashinfer.sha256")
if [ "$(cat "$FI_SITE/.stamp" 2>/dev/null)" != "$_fi_sum" ]; then
    rm -rf "$FI_SITE" "$FI_SITE.part" && mkdir -p "$FI_SITE.part" \
        && tar -xJf "$_fi_dir/flashinfer.tar.xz" -C "$FI_SITE.part" \
        && mv "$FI_SITE.part/site" "$FI_SITE" && rm -rf "$FI_SITE.part" \
        && echo "$_fi_sum" > "$FI_SITE/.stamp" \
        || { echo "prelude: unpacking flashinfer failed" >&2; return 1 2>/dev/null || exit 1; }
fi
export PYTHONPATH="$FI_SITE${PYTHONPATH:+:$PYTHONPATH}"
# The prebuilt trtllm_comm module, if carried, unless FI_NO_AOT=1 (then FlashInfer JIT-builds it).
if [ -d "$FI_SITE/.aot" ] && [ "${FI_NO_AOT:-0}" != 1 ]; then
    ln -sfn "$FI_SITE/.aot" "$FI_SITE/flashinfer/data/aot"
else
    rm -f "$FI_SITE/flashinfer/data/aot"
fi
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}   # -> -gencode sm_90a
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}  # JIT cache: $it/.cache/flashinfer/
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/fiws/tvm-ffi}
export MAX_JOBS=${MAX_JOBS:-16}                                       # ninja -j for the JIT build
export FLASHINFER_JIT_DEBUG=0     # else FLASHINFER_JIT_VERBOSE=1 would also mean a -G -O0 build
# trtllm_comm is three sources, ptxas taking minutes on each: let nvcc/ptxas split each one's
# optimization over a share of the cores (16 cores -> 5 threads per source).
_fi_split=$(( $(nproc) / 3 )); [ "$_fi_split" -ge 1 ] || _fi_split=1
export FLASHINFER_EXTRA_CUDAFLAGS=${FLASHINFER_EXTRA_CUDAFLAGS:---split-compile=$_fi_split}
export FLASHINFER_CONFIDENTIAL_COMPUTE=0      # the multicast-free SymmDeviceMemory workspace path
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# FlashInfer takes CUDA_HOME from `which nvcc`, which is wrong for a wrapper script such as
# /usr/local/bin/nvcc; ask nvcc where it lives instead.
if [ -z "${CUDA_HOME:-}" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then
        export CUDA_HOME=/usr/local/cuda
    elif command -v nvcc >/dev/null 2>&1; then
        _fi_top=$(nvcc --dryrun -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)
        [ -n "$_fi_top" ] && export CUDA_HOME=$(cd "$_fi_top" && pwd)
    fi
fi
if [ -n "${CUDA_HOME:-}" ] && [ ! -d "$CUDA_HOME/lib64" ] && [ -d "$CUDA_HOME/lib" ]; then
    export FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:+$FLASHINFER_EXTRA_LDFLAGS }-L$CUDA_HOME/lib -L$CUDA_HOME/lib/stubs"
fi
# The JIT links with -lcuda: with no toolkit stub and no libcuda.so dev link, point the linker at
# the driver's libcuda.so.1 (the module uses no driver symbol; this only satisfies -lcuda).
if [ ! -e "${CUDA_HOME:-/nonexistent}/lib64/stubs/libcuda.so" ] && [ ! -e "${CUDA_HOME:-/nonexistent}/lib/stubs/libcuda.so" ] \
        && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so ('; then
    _fi_cu=$(ldconfig -p 2>/dev/null | sed -n 's/^[[:space:]]*libcuda\.so\.1 (.*) => //p' | head -n1)
    if [ -n "$_fi_cu" ]; then
        mkdir -p "$FLASHINFER_WORKSPACE_BASE/lib" && ln -sfn "$_fi_cu" "$FLASHINFER_WORKSPACE_BASE/lib/libcuda.so"
        export FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:+$FLASHINFER_EXTRA_LDFLAGS }-L$FLASHINFER_WORKSPACE_BASE/lib"
    else
        echo "prelude: warning: no libcuda.so(.1) found for the JIT link's -lcuda" >&2
    fi
fi
# The JIT runs `ninja` from PATH; the pip package's binary may not be there.
if ! command -v ninja >/dev/null 2>&1; then
    _fi_nb=$(python3 -c 'import ninja, os; print(getattr(ninja, "BIN_DIR", os.path.dirname(ninja.__file__) + "/data/bin"))' 2>/dev/null)
    [ -n "$_fi_nb" ] && export PATH="$_fi_nb:$PATH"
fi
python3 -c 'import sys; sys.version_info[:2] == (3, 12) or print("prelude: warning: the carried tvm_ffi is for CPython 3.12, this is", sys.version.split()[0])'
echo "prelude: flashinfer site $FI_SITE, CUDA_HOME=${CUDA_HOME:-unset}, ninja=$(command -v ninja || echo missing)" >&2
unset _fi_dir _fi_sum _fi_top _fi_nb _fi_split _fi_cu
SHEOF

size=$(stat -c %s "$OUT/flashinfer.tar.xz")
echo "wrote $OUT/flashinfer.tar.xz ($size bytes, $(wc -l < "$OUT/flashinfer.files") files), $OUT/prelude.sh" >&2
