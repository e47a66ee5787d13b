#!/usr/bin/env bash
# One batched device call for what the port-channel and registration work still needs on GPUs
# (notes/ports.md "pending"): their GPU tests, the bench columns of the copy-engine and
# hierarchical algorithms (one node, then two one-GPU "nodes" through the engine), the port
# measurements (SMs freed) and the soak. Usage (repository root, GPU machine, carrying .whl and
# .cubins): bash tests/gpu/ports_run.sh   (everything logged under $OUT; fits 600 s)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. .whl/prelude.sh || { echo "prelude failed"; exit 1; }
export NCCL_NVLS_ENABLE=0 MSCCLANG_CUBIN_DIR="$PWD/.cubins" MSCCLANG_TEST_TIMEOUT_S=10 PYTHONUNBUFFERED=1
unset MSCCLANG_ENABLE_NVLS
timeout -k 10 200 python3 -m pytest -m gpu tests/gpu/test_ports_gpu.py tests/gpu/test_registration_gpu.py \
  -o addopts="" -q -rfE > "$OUT/gpu_ports.log" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_ports.log"; tail -15 "$OUT/gpu_ports.log"
timeout -k 10 150 python3 -m mscclang bench --collectives all_gather,all_to_all,all_reduce --sizes 256M,1G \
  --modes graph --algos allgather_port,alltoall_port,allreduce_port_pipelined --time-limit 110 \
  --out "$OUT/bench_ports" > "$OUT/bench_ports.log" 2>&1
echo "bench rc=$?"; grep -E "^\| (256M|1G) " "$OUT/bench_ports/bench.md"
timeout -k 10 120 python3 -m mscclang bench --gpus-per-node 1 --collectives all_reduce,all_gather \
  --sizes 1M,16M,64M,256M --impls mscclang,nccl --modes graph \
  --algos allreduce_hierarchical,allgather_hierarchical --time-limit 80 \
  --out "$OUT/bench_two_nodes" > "$OUT/bench_two_nodes.log" 2>&1
echo "bench rc=$?"; grep -E "^\| [0-9]+M " "$OUT/bench_two_nodes/bench.md"
timeout -k 10 100 python3 -m tools.port_bench --out "$OUT" 2>&1 | tail -12
