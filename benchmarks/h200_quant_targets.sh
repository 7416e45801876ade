#!/usr/bin/env bash
# The quantization issue's speed rows on one GPU, beside bf16 in the same run (Llama-3-8B
# shape, dummy weights): batch-1 decode (128 in / 512 out) and 256 x 256/128 throughput for
# bf16, FP8 W8A8 (online --quantization fp8), W4A16 g128 and INT8 W8A8, and batch-1 for the
# GGUF Q4_K kernel form (int4, scale and offset per 32); Qwen3-30B-A3B with online FP8
# experts at batch 1 (its bf16 row is moe_perf.py's). Then the targets' table
# (benchmarks/quant_targets_table.py: step / floor, vs bf16, met or not) and the start-up
# tuner's choice per kind of quantized decode GEMM (its cache, copied beside the results).
#   bash benchmarks/h200_quant_targets.sh OUTDIR
#   env QUANT_ROWS: the rows to run (default all), e.g. "bf16_b1 fp8_b1";
#   QUANT_BENCH_TIMEOUT: seconds per row (default 420: a first start compiles and tunes)
#   results: OUTDIR/quant_perf.tgz, OUTDIR/quant_perf.log, OUTDIR/quant_targets_table.txt
set -uo pipefail
OUT=${1:-out}
D=$(mktemp -d)/quant_perf
mkdir -p "$D"
AS="python3 -m archserve.cli.main"
M=benchmarks/models
COMMON="--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256"
bench() {   # bench NAME ARGS...: one `archserve bench` run, JSON kept
  local name=$1; shift
  [ -z "${QUANT_ROWS:-}" ] || [[ " $QUANT_ROWS " == *" $name "* ]] || return 0
  echo "== $name: archserve bench $*"
  timeout ${QUANT_BENCH_TIMEOUT:-420} $AS bench "$@" --output-json "$D/$name.json" > "$D/$name.log" 2>&1
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
  bench qwen3_30b_fp8_b1 --model $M/qwen3-30b-a3b --quantization fp8 $COMMON $B1
  bench bf16_256 --model $M/llama-3-8b $COMMON $T256
  bench fp8_256 --model $M/llama-3-8b --quantization fp8 $COMMON $T256
  bench w4a16_256 --model $M/llama-3-8b-w4a16 $COMMON $T256
  bench int8_256 --model $M/llama-3-8b-w8a8-int8 $COMMON $T256
  # The tuner's cache of this device (every quantized model above tuned into it).
  KDIR=$(python3 -c "from archserve.engine.kernel_cache import device_kernel_dir
from archserve.platform.detect import detect; print(device_kernel_dir(detect()))")
  cp "$KDIR/quantized_gemms.json" "$D/" 2>/dev/null || echo "no tuner cache in $KDIR"
  echo "== the targets (benchmarks/quant_targets_table.py)"
  python3 benchmarks/quant_targets_table.py "$D" --out "$D/quant_targets_table.json" \
    | tee "$D/quant_targets_table.txt"
} 2>&1 | tee "$D/quant_perf.log"
cp "$D/quant_perf.log" "$OUT/quant_perf.log"
cp "$D/quant_targets_table.txt" "$OUT/" 2>/dev/null
tar -C "$(dirname "$D")" -czf "$OUT/quant_perf.tgz" quant_perf
