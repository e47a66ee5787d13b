#!/usr/bin/env bash
# The port-channel and registration GPU tests (each test bounded by pytest-timeout, present on the
# GPU machine), then the copy-engine allreduce at 3 pipeline depths (ONE_NODE=1, default), the
# port measurements (PORT_BENCH=1) and the two-"node" bench (TWO_NODE=1, default), which also times the 4-channel hierarchical
# variants. Usage (repository root, GPU machine, carrying .whl and .cubins):
#   [PYTEST_S=260] [ONE_NODE=1] [PORT_BENCH=0] [TWO_NODE=1] bash tests/gpu/ports_call.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. .whl/prelude.sh || exit 1
export NCCL_NVLS_ENABLE=0 MSCCLANG_CUBIN_DIR="$PWD/.cubins" MSCCLANG_TEST_TIMEOUT_S=10 PYTHONUNBUFFERED=1
unset MSCCLANG_ENABLE_NVLS
python3 -c "from mscclang.runtime.build import find_prebuilt as f; import sys; sys.exit(0 if all(f(d, 'sm_90') for d in ('f16','bf16','f32','i32')) else 1)" \
  || echo "WARNING: .cubins does not match the executor sources: every worker builds with NVRTC (rebuild: python3 -m mscclang build-kernel --out .cubins)"
t0=$(date +%s)
timeout -k 5 ${PYTEST_S:-260} python3 -m pytest -m gpu tests/gpu/test_ports_gpu.py tests/gpu/test_registration_gpu.py \
  -o addopts="" -v -rfE --tb=short --timeout 100 > "$OUT/gpu_ports.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/gpu_ports.log"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|rc=|^E  " "$OUT/gpu_ports.log" | cut -c1-200 | tail -60
if [ "${ONE_NODE:-1}" = 1 ]; then
  # the copy-engine allreduce's pipeline depth (steps 4 was the one measured in session 5)
  t0=$(date +%s)
  timeout -k 5 130 python3 -m mscclang bench --collectives all_reduce --sizes 256M,1G --modes graph \
    --algos allreduce_port_pipelined.r2.i1.steps4.inplace,allreduce_port_pipelined.r2.i1.steps8.inplace,allreduce_port_pipelined.r2.i1.steps16.inplace \
    --time-limit 60 --out "$OUT/bench_ports" > "$OUT/bench_ports.log" 2>&1
  echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "^\| (size|256M|1G) |^## " "$OUT/bench_ports/bench.md"
fi
if [ "${PORT_BENCH:-0}" = 1 ]; then
  timeout -k 5 110 python3 -m tools.port_bench --out "$OUT" > "$OUT/port_bench.log" 2>&1; echo "port_bench rc=$?"
  tail -14 "$OUT/port_bench.log" | cut -c1-200
fi
if [ "${TWO_NODE:-1}" = 1 ]; then
  timeout -k 5 150 python3 -m mscclang bench --gpus-per-node 1 --collectives all_reduce,all_gather --sizes 64M,256M \
    --impls mscclang,nccl --modes graph \
    --algos allreduce_hierarchical,allgather_hierarchical,allreduce_hierarchical.r2.i4.gpus_per_node1.inplace,allgather_hierarchical.r2.i4.gpus_per_node1 \
    --time-limit 80 --out "$OUT/bench_two_nodes" > "$OUT/bench_two_nodes.log" 2>&1
  echo "two-node bench rc=$?"; grep -E "^\| (size|[0-9]+M) |^## " "$OUT/bench_two_nodes/bench.md"
fi
