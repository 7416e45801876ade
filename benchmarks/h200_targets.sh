#!/usr/bin/env bash
# The dense-decoder workloads on one GPU (Llama-3-8B and Qwen3-0.6B shapes, dummy weights, bf16),
# in the order: cold and warm start, batch-1 decode, 256-request throughput (+ transformers).
#   bash benchmarks/h200_targets.sh OUTDIR [LABEL [EXTRA BENCH ARGS...]]
#   results: OUTDIR/perfLABEL.tgz and OUTDIR/perfLABEL.log; e.g. LABEL=_sync with
#   --no-async-scheduling runs every bench row in that mode (the start-up rows are the same).
set -uo pipefail
OUT=${1:-out}
LABEL=${2:-}
EXTRA=("${@:3}")
D=$(mktemp -d)/perf$LABEL
mkdir -p "$D"
AS="python3 -m archserve.cli.main"
L8=benchmarks/models/llama-3-8b
Q06=benchmarks/models/qwen3-0.6b
# One engine shape for every 8B run, so the warm start's caches serve them all.
E8="--model $L8 --load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256"

start() {   # start NAME: time one `archserve prepare`
  local t0=$EPOCHREALTIME rc
  timeout 300 $AS prepare $E8 --json > "$D/prepare_$1.json" 2> "$D/prepare_$1.err"
  rc=$?
  echo "$1 start: exit $rc in $(awk "BEGIN{print $EPOCHREALTIME - $t0}") s"
}
bench() {   # bench NAME ARGS...: one `archserve bench` run, JSON kept
  local name=$1; shift
  echo "== $name: archserve bench $* ${EXTRA[*]}"
  timeout 300 $AS bench "$@" "${EXTRA[@]}" --output-json "$D/$name.json" > "$D/$name.log" 2>&1
  echo "exit $?"; tail -n 22 "$D/$name.log"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  start cold
  start warm
  bench llama8b_b1 $E8 --num-prompts 1 --input-len 128 --output-len 512
  bench qwen06b_b1 --model $Q06 --load-format dummy --dtype bfloat16 --max-model-len 2048 \
    --num-prompts 1 --input-len 128 --output-len 512
  bench llama8b_256x256x128_peer $E8 --num-prompts 256 --input-len 256 --output-len 128 \
    --peer transformers --plots "$D/plots"
  bench llama8b_256x128x1024 $E8 --num-prompts 256 --input-len 128 --output-len 1024
  bench llama8b_256x1024x128 $E8 --num-prompts 256 --input-len 1024 --output-len 128
} 2>&1 | tee "$D/perf.log"
cp "$D/perf.log" "$OUT/perf$LABEL.log"
tar -C "$(dirname "$D")" -czf "$OUT/perf$LABEL.tgz" "perf$LABEL"
