#!/usr/bin/env bash
# Functional GPU checks on a ONE-GPU machine: two ranks time-share the GPU
# (MSCCLANG_RANKS_PER_GPU=2, see mscclang.runtime.workers.ranks_per_gpu). Timings mean nothing
# here and NCCL-based tests skip or fail (NCCL refuses two ranks on one GPU).
# RANKS (default 2) ranks share the GPU: 4 or 8 run the 4- and 8-rank plans on real kernels.
# Usage (repository root, GPU machine, carrying .whl and .cubins):
#   [RANKS=2] [TESTS="tests/gpu/test_ports_gpu.py ..."] [PYTEST_S=400] [PYTEST_ARGS=-rP] [SMOKE=0] bash tests/gpu/shared_gpu_call.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. .whl/prelude.sh || exit 1
export NCCL_NVLS_ENABLE=0 MSCCLANG_CUBIN_DIR="$PWD/.cubins" MSCCLANG_TEST_TIMEOUT_S=${MSCCLANG_TEST_TIMEOUT_S:-20} \
  PYTHONUNBUFFERED=1 MSCCLANG_RANKS_PER_GPU=${RANKS:-2}
unset MSCCLANG_ENABLE_NVLS
python3 -c "from mscclang.runtime.build import DTYPES, find_prebuilt as f; import sys; sys.exit(0 if all(f(d, 'sm_90') for d in DTYPES) else 1)" \
  || echo "WARNING: .cubins does not match the executor sources: every worker builds with NVRTC (rebuild: python3 -m mscclang build-kernel --out .cubins)"
nvidia-smi --query-gpu=name,compute_mode --format=csv,noheader
if [ "${SMOKE:-1}" != 0 ]; then
  t0=$(date +%s)
  timeout -k 5 90 python3 tests/gpu/smoke.py > "$OUT/smoke.log" 2>&1
  echo "smoke rc=$? in $(( $(date +%s) - t0 )) s"; tail -5 "$OUT/smoke.log" | cut -c1-300
fi
log="$OUT/gpu_shared${RANKS:-2}.log"
t0=$(date +%s)
timeout -k 5 ${PYTEST_S:-400} python3 -m pytest -m gpu ${TESTS:-tests/gpu/test_ports_gpu.py tests/gpu/test_registration_gpu.py} \
  -o addopts="" -v -rfE ${PYTEST_ARGS:-} --tb=short --timeout ${TEST_TIMEOUT:-120} > "$log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s" >> "$log"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|rc=|^E  |^ran |^BAD |refused" "$log" | cut -c1-240 | tail -70
