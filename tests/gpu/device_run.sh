#!/usr/bin/env bash
# One batched device call: GPU test suite (incl. the GPU branch of notebook 02), `mscclang run` on
# library plans and a full `mscclang bench`, everything logged under $OUT. Usage (repository root,
# GPU machine, carrying .whl and .cubins):  bash tests/gpu/device_run.sh N [PYTEST_S] [BENCH_S]
# N = expected GPU count. Inner timeouts default to 260 s + 60 s + 220 s (fits 600 s).
N=${1:?usage: device_run.sh N [PYTEST_S] [BENCH_S]}
PYTEST_S=${2:-260}
BENCH_S=${3:-220}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. .whl/prelude.sh || { echo "prelude failed"; exit 1; }
export NCCL_NVLS_ENABLE=0 MSCCLANG_CUBIN_DIR="$PWD/.cubins" MSCCLANG_TEST_TIMEOUT_S=${MSCCLANG_TEST_TIMEOUT_S:-10}
export MSCCLANG_NB_SAVE="$OUT/notebooks" PYTHONUNBUFFERED=1
unset MSCCLANG_ENABLE_NVLS
nvidia-smi -L | tee "$OUT/gpus.txt"
have=$(nvidia-smi -L | grep -c '^GPU')
[ "$have" = "$N" ] || echo "WARNING: $have GPUs visible, expected $N"
t0=$(date +%s)
timeout -k 10 "$PYTEST_S" python3 -m pytest -m gpu tests/gpu tests/test_notebooks.py -o addopts="" -q -rfE \
  --durations=10 > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/gpu_tests.log"
tail -30 "$OUT/gpu_tests.log"
{
  PLAN=plans/allreduce_rsag_pipelined.r$have.i8.json
  [ -f "$PLAN" ] && timeout -k 10 60 python3 -m mscclang run "$PLAN" --size 1M --size 64M --graph
  echo "run rc=$?"
  timeout -k 10 40 python3 -m mscclang run plans/allreduce_oneshot_ll.r$have.i1.json --size 1K --size 64K --graph
  echo "run rc=$?"
  timeout -k 10 40 python3 -m mscclang run plans/allgather_ll.r$have.i1.json --size 1K --size 64K --graph
  echo "run rc=$?"
} > "$OUT/run.log" 2>&1
cat "$OUT/run.log"
t0=$(date +%s)
timeout -k 10 "$BENCH_S" python3 -m mscclang bench --time-limit $(( BENCH_S - 40 )) \
  --out "$OUT/bench_${have}xh200" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log"
tail -3 "$OUT/bench.log"
grep -E "^\| (all_reduce|all_gather|reduce_scatter|all_to_all) \|" "$OUT/bench_${have}xh200/bench.md" | tail -40
