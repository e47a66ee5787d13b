#!/usr/bin/env bash
# The call-path measurements, on the public API (tools/callpath_checks.py), on a GPU machine. With
# one GPU the two ranks time-share it (MSCCLANG_RANKS_PER_GPU=2: functional, timings inflated;
# their ratios are what counts). A reference tree (REF, default benchref/: `git archive` of an
# older commit's mscclang/ and executor/ with its own .cubins) runs the same checks for "before".
# Usage (repository root, carrying .whl, .cubins and, for the reference, benchref):
#   [PHASES="first stream memory abort"] [REF=benchref] bash tests/gpu/callpath_call.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. .whl/prelude.sh || exit 1
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
unset MSCCLANG_ENABLE_NVLS
have=$(nvidia-smi -L | grep -c '^GPU')
[ "$have" -ge 2 ] || export MSCCLANG_RANKS_PER_GPU=2
REF=${REF:-benchref}
PHASES=${PHASES:-first stream memory abort}
CPC=tools/callpath_checks.py
new() { MSCCLANG_CUBIN_DIR="$PWD/.cubins" timeout -k 5 "$@"; }
old() { PYTHONPATH="$PWD/$REF:$PYTHONPATH" MSCCLANG_CUBIN_DIR="$PWD/$REF/.cubins" MSCCLANG_PLANS_DIR="$PWD/plans" \
        timeout -k 5 "$@"; }
run() {  # run NAME WHICH SECONDS ARGS...: one check, its JSON line under $OUT/NAME.json
  local name=$1 which=$2 secs=$3; shift 3
  local t0=$(date +%s)
  $which "$secs" python3 $CPC --timeout $((secs - 10)) --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t0 )) s: $(cut -c1-600 "$OUT/$name.json" 2>/dev/null)"
}
for p in $PHASES; do
  case $p in
    first)  run first_new new 120 first; [ -d "$REF" ] && run first_old old 120 first ;;
    stream) run stream_new new 200 stream --calls 2000
            run stream_never new 120 stream --calls 2000 --specialize never
            [ -d "$REF" ] && run stream_old old 200 stream --calls 2000 ;;
    memory) run memory_new new 240 memory --sizes 10000 ;;
    abort)  for m in graph eager hung; do run "abort_$m" new 150 abort --mode "$m" --runs 3; done ;;
  esac
done
