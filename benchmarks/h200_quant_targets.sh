#!/usr/bin/env bash
# The quantization issue's speed rows on one GPU, beside bf16 in the same run (Llama-3-8B
# shape, dummy weights): batch-1 decode (128 in / 512 out) and 256 x 256/128 throughput for
# bf16, FP8 W8A8 (online --quantization fp8), W4A16 g128 and INT8 W8A8, and batch-1 for the
# GGUF Q4_K kernel form (int4, scale and offset per 32).
#   bash benchmarks/h200_quant_targets.sh OUTDIR
#   results: OUTDIR/quant_perf.tgz and OUTDIR/quant_perf.log
set -uo pipefail
OUT=${1:-out}
D=$(mktemp -d)/quant_perf
mkdir -p "$D"
AS="python3 -m archserve.cli.main"
M=benchmarks/models
COMMON="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256"
bench() {   # bench NAME ARGS...: one `archserve bench` run, JSON kept
  local name=$1; shift
  echo "== $name: archserve bench $*"
  timeout 300 $AS bench "$@" --output-json "$D/$name.json" > "$D/$name.log" 2>&1
  echo "exit $?"; tail -n 22 "$D/$name.log"
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  B1="--num-prompts 1 --input-len 128 --output-len 512"
  T256="--num-prompts 256 --input-len 256 --output-len 128"
  bench bf16_b1 --model $M/llama-3-8b $COMMON $B1
  bench fp8_b1 --model $M/llama-3-8b --quantization fp8 $COMMON $B1
  bench w4a16_b1 --model $M/llama-3-8b-w4a16 $COMMON $B1
  bench q4k_form_b1 --model $M/llama-3-8b-q4k-form $COMMON $B1
  bench int8_b1 --model $M/llama-3-8b-w8a8-int8 $COMMON $B1
  bench bf16_256 --model $M/llama-3-8b $COMMON $T256
  bench fp8_256 --model $M/llama-3-8b --quantization fp8 $COMMON $T256
  bench w4a16_256 --model $M/llama-3-8b-w4a16 $COMMON $T256
  bench int8_256 --model $M/llama-3-8b-w8a8-int8 $COMMON $T256
} 2>&1 | tee "$D/quant_perf.log"
cp "$D/quant_perf.log" "$OUT/quant_perf.log"
tar -C "$(dirname "$D")" -czf "$OUT/quant_perf.tgz" quant_perf
