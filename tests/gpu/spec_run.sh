#!/usr/bin/env bash
# One batched device call validating sizes-as-parameters (issue 13 part 3): the GPU suites of the
# executor, communicator, trust, port and registration work, then the allreduce bench (graph,
# 1K..64M) of this tree and of a reference tree (REF, default benchref/: `git archive` of the
# commit before the change), so the 3% comparison is one machine in one call.
# Usage (repository root, GPU machine, carrying .whl and .cubins): bash tests/gpu/spec_run.sh
OUT=${OUT:-/tmp/out}
REF=${REF:-benchref}
mkdir -p "$OUT"
. .whl/prelude.sh || { echo "prelude failed"; exit 1; }
export NCCL_NVLS_ENABLE=0 MSCCLANG_CUBIN_DIR="$PWD/.cubins" MSCCLANG_TEST_TIMEOUT_S=10 PYTHONUNBUFFERED=1
unset MSCCLANG_ENABLE_NVLS
t0=$(date +%s)
timeout -k 10 ${PYTEST_S:-330} python3 -m pytest -m gpu tests/gpu/test_executor_gpu.py tests/gpu/test_comm_gpu.py \
  tests/gpu/test_trust_gpu.py tests/gpu/test_ports_gpu.py tests/gpu/test_registration_gpu.py \
  -o addopts="" -v -rfE --tb=short --timeout 120 > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/gpu_tests.log"
tail -40 "$OUT/gpu_tests.log"
# LIT=1 adds a third run: this tree with MSCCLANG_SPEC_LITERAL=1 (the skeleton with its values as
# literals, one build per size), which separates the cost of reading sizes from the parameters
# from the skeleton's structural changes
for tree in new ref ${LIT:+lit}; do
  t0=$(date +%s)
  if [ $tree = ref ]; then D="$REF"; else D=.; fi
  if [ $tree = lit ]; then export MSCCLANG_SPEC_LITERAL=1; else unset MSCCLANG_SPEC_LITERAL; fi
  (cd "$D" && timeout -k 10 ${BENCH_S:-120} python3 -m mscclang bench --collectives all_reduce --sizes 1K:64M \
    --modes graph --impls mscclang,nccl --time-limit $(( ${BENCH_S:-120} - 70 )) --out "$OUT/bench_$tree" \
    > "$OUT/bench_$tree.log" 2>&1)
  echo "bench $tree rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^\| all_reduce" "$OUT/bench_$tree/bench.md"
done
