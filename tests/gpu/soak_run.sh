#!/usr/bin/env bash
# One batched device call for the trust issue's figures: the soak (100k eager calls + 10k graph
# replays, random collectives / sizes / dtypes / ops, bit-exact checks), then the trust GPU tests.
# Eager calls run the interpreter (no first-use or hot NVRTC builds: thousands of distinct sizes);
# captured calls are prepared, so they get the plan-specialised kernel up to 64 MiB.
# Usage (repository root, GPU machine, carrying .whl and .cubins): bash tests/gpu/soak_run.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. .whl/prelude.sh || { echo "prelude failed"; exit 1; }
export NCCL_NVLS_ENABLE=0 MSCCLANG_CUBIN_DIR="$PWD/.cubins" MSCCLANG_TEST_TIMEOUT_S=10 PYTHONUNBUFFERED=1
unset MSCCLANG_ENABLE_NVLS
t0=$(date +%s)
MSCCLANG_SPEC_FIRST_BYTES=0 MSCCLANG_SPEC_HOT_CALLS=1000000000 timeout -k 10 ${SOAK_S:-380} \
  python3 -m tools.reliability --out "$OUT" --soak-s $(( ${SOAK_S:-380} - 35 )) --size-pool 256 \
  --reserve-s ${RESERVE_S:-120} \
  > "$OUT/soak.log" 2>&1
echo "soak rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/soak.log"
tail -20 "$OUT/soak.log"
[ "${TRUST_S:-180}" = 0 ] && exit 0
t0=$(date +%s)
timeout -k 10 ${TRUST_S:-180} python3 -m pytest -m gpu tests/gpu/test_trust_gpu.py -o addopts="" -v -rfE \
  --durations=10 > "$OUT/trust.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/trust.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUT/trust.log" | tail -30
