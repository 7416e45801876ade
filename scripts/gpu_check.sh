#!/usr/bin/env bash
# Everything this project checks on a CUDA machine, in parts that each fit one device call.
#   bash scripts/gpu_check.sh OUTDIR [doctor|tests|attention|gemm|perf|perf_sync|profile|
#                                     quant_gemm|quant_perf|serve|structured|moe|tp|tp4|tp8|mla|ncu|speed|
#                                     lora|sparse_mla|sparse_mla_perf|dsv4|dsv4_perf|spec|
#                                     emulate|gpt_oss|gpt_oss_engine|all]
#   (default: all)
#   doctor: nvidia-smi, `archserve doctor`, `explain` on the live device;
#   tests:  every gpu-marked test; the kernel tests (many small Triton compiles, CPU-bound)
#           run under xdist while the engine tests run beside them on the same GPU
#           (env KERNEL_K / ENGINE_K: a pytest -k expression for either; ENGINE_PATHS:
#           the engine side's paths, default tests; it needs ~13 minutes on a fresh
#           machine, so two calls: e.g. "tests/distributed tests/engine tests/loader",
#           then "tests/models tests/platform tests/quant tests/serve" with SKIP_KERNELS=1);
#   attention: benchmarks/bench_attention.py, with a decode split sweep (env SPLITS);
#   gemm:   benchmarks/bench_skinny_gemm.py, cuBLAS against the Triton skinny GEMM sweep;
#   perf:   benchmarks/h200_targets.sh (the dense-decoder workloads, async scheduling: the CUDA
#           default); perf_sync: the same rows with --no-async-scheduling;
#   profile: benchmarks/profile_engine_step.py on the 8B and 0.6B shapes at batch 1 and 256
#           (device busy/idle per decode step, top kernels, engine phases);
#   quant_gemm: the quantized GEMMs' GPU tests (the W8A8 GEMV candidates against the
#           reference, the start-up tuner on them; env QUANT_TESTS=0 skips them), then
#           benchmarks/bench_quant_gemm.py: every quantized GEMM beside cuBLAS bf16, µs, TB/s
#           and x its bytes' floor, with [tuned] rows at decode sizes (the start-up tuner's
#           choice; env QUANT_GEMM_ARGS: its arguments, default --m 1,16,256,4096);
#   quant_perf: benchmarks/h200_quant_targets.sh (the quantized 8B rows beside bf16, the
#           targets' table, the tuner's choices; env QUANT_ROWS: a subset of its rows);
#   serve:  benchmarks/h200_serve.sh (a real server, 8B shape; bench --mode serve over HTTP);
#   structured: benchmarks/structured_perf.py (the token mask's cost per decode
#           step at batch 1, 32, 256; TTFT with a cold and a cached grammar) on the 0.6B and
#           8B shapes, with the embedded model's tokenizer carried in .tok/smollm2 (made
#           here by `python benchmarks/structured_perf.py --save-tokenizer .tok/smollm2`;
#           carry .tok and .whl: xgrammar is a carried wheel), then the structured-output
#           GPU tests;
#   tp:     (2+ GPUs) the tensor-parallel tests, benchmarks/tp_perf.py allreduce and engine
#           (8B shape TP=2 against TP=1); `all` leaves it out, ask for it by name;
#   tp_moe: (2 GPUs) benchmarks/tp_perf.py engine on the Qwen3-30B-A3B shape, TP=1 and 2;
#   tp4, tp8: (4 / 8 GPUs) the Llama-3-70B shape at TP=4 or TP=8: `doctor` on its
#           layout, benchmarks/tp_perf.py engine (start-up, CUDA graphs, KV pool against the
#           memory left per rank, greedy identical across two runs, batch-1 decode and
#           256 x 256/128 each against its floor), then the all-reduce table on as many
#           GPUs; `all` leaves them out.
#   moe:    benchmarks/moe_perf.py, the MoE kernel table then the Qwen3-30B-A3B and
#           Mixtral-8x7B engine rows (env MOE_ARGS: extra arguments, e.g. --skip-peer).
#   gpt_oss: the gpt-oss GPU tests (MXFP4 MoE and GEMV kernels at real shapes, sinks, the
#           tiny bf16 and MXFP4 models against transformers with and without graphs), then
#           the MXFP4-beside-bf16 MoE kernel table at 1, 16, 256, 4096 tokens;
#   gpt_oss_engine: moe_perf.py's engine rows on gpt-oss-20b (MXFP4) and -bf16 (batch 1
#           vs floor, 256 x 256/128); `all` leaves both out, ask for them by name;
#   mla:    the MLA GPU tests (TRITON_MLA kernel and implementation at DeepSeek's
#           sizes, tiny V2/V3 engines against transformers), then benchmarks/mla_perf.py:
#           the MLA decode kernel's GB/s (env MLA_ARGS, e.g. --sweep), DeepSeek-V2-Lite
#           batch-1 step vs floor and 256 x 1024/128, KV bytes per token and 4k-token
#           sequences vs an MHA-sized cache; `all` leaves it out, ask for it by name.
#   sparse_mla: the sparse-MLA GPU tests (TRITON_MLA_SPARSE's kernels and implementation at
#           DeepSeek-V3.2's sizes, tiny V3.2 / GLM-5 engines against transformers, graphs;
#           env SPARSE_TESTS: the test paths, e.g. one file a call);
#   sparse_mla_perf: benchmarks/sparse_mla_perf.py (env SPARSE_ARGS: --part kernel, engine
#           or throughput, one a call; SPARSE_TIMEOUT, default 540 s); `all` leaves both out.
#   dsv4:   the DeepSeek V4 GPU tests (TRITON_MLA_SPARSE_DSV4's kernels at V4's sizes and in a
#           CUDA graph, the hyper-connection and rope kernels, the tiny V4 engine in bf16
#           against transformers' drift, chunked prefill over a cached prefix; env
#           DSV4_TESTS: the test paths);
#   dsv4_perf: benchmarks/deepseek_v4_perf.py (env DSV4_ARGS: --part engine, throughput or
#           cache, one a call, and --contexts; DSV4_TIMEOUT, default 540 s); `all` leaves
#           both out.
#   ncu:    Nsight Compute's counters of single kernels (benchmarks/ncu_kernels.py), one
#           report per case: env NCU_CASES, space-separated "CASE@KERNEL_REGEX@COUNT"
#           (default: the MLA decode kernel); writes ncu/CASE.txt (the details page) and
#           ncu/CASE.sass.csv.gz (stall samples per SASS instruction); `all` leaves it out.
#   lora:   the LoRA GPU tests (the kernels at Llama-3-8B sizes; the engine with CUDA graphs
#           against peft: a batch mixing four adapters and the base model, slots refilled),
#           then benchmarks/bench_lora.py on the Llama-3-8B shape (dummy weights, rank-16
#           adapters: batch 32 with 8 adapters and batch 1 with one, against the base
#           steps); carry .whl (peft, accelerate); `all` leaves it out, ask for it by name.
#   spec:   the speculative decoding GPU tests (every method lossless in CUDA graphs with
#           async scheduling), then benchmarks/spec_verify_step.py on the Llama-3-8B shape:
#           a verification step of k = 1..8 drafts against a decode step at batch 1, 8 and
#           32 (dummy weights, 512 tokens of context); `all` leaves it out, ask by name.
#   emulate: tests/engine/test_emulated_generations.py: v100, t4, a100, a10, l40s and rtx4090
#           emulated on this GPU (--emulate-device), one process each side by side: tiny Llama,
#           Qwen3, Qwen3-MoE, DeepSeek-V2-Lite and the quantized fixtures against transformers
#           in float32, the printed route against explain's, Triton's code for the profile
#           and its shared-memory limit (env EMULATE_K: a pytest -k expression, e.g. "t4 or
#           native"); each profile's log in $OUT/emulated; `all` leaves it out.
#   speed:  benchmarks/h200_speed.sh: the pending speed rows of issues 21, 13 and 14 in
#           priority order within one device call (env SPEED_DEADLINE, default 540 s from
#           this script's start; SPEED_STEPS: some steps only; SPEED_DRY_RUN=1: the plan);
#           steps that do not fit are skipped and named; `all` leaves it out.
# Carried wheels in .whl/ (scripts/device_wheels.sh) are installed first when present.
set -uo pipefail
STARTED=$EPOCHSECONDS   # the speed part's deadline counts the wheel install too
OUT=${1:-${OUT:-out}}
PART=${2:-all}
mkdir -p "$OUT"
# Reinstalled when the wheel list changes (a warm machine keeps /tmp/site between calls).
if [ -d .whl ] && [ "$(ls .whl | md5sum)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && ls .whl | md5sum > /tmp/site/.wheels
fi
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PYTEST="python3 -m pytest -rfEs -p no:cacheprovider -m gpu"
# The device returns at most 8 files from $OUT, two folders deep: when a part writes more,
# everything also travels in one bundle.tgz and the loose files beyond it are removed.
bundle() {
  local n
  n=$(find "$OUT" -type f ! -name bundle.tgz | wc -l)
  [ "$n" -le 8 ] && return
  tar -C "$OUT" --exclude=bundle.tgz -czf /tmp/bundle.tgz . && mv /tmp/bundle.tgz "$OUT/bundle.tgz"
  find "$OUT" -mindepth 1 ! -name bundle.tgz -exec rm -rf {} +
  echo "$n files under $OUT: they travel in $OUT/bundle.tgz (tar -xzf it)"
}
trap bundle EXIT
want() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
if [ "$PART" = tp ]; then
  $PYTEST -v --durations=10 tests/distributed 2>&1 | tee "$OUT/pytest_tp.log" | tail -n 25
  python3 benchmarks/tp_perf.py allreduce --out "$OUT/tp_allreduce.json" 2>&1 \
    | tee "$OUT/tp_allreduce.txt"
  python3 benchmarks/tp_perf.py engine --out "$OUT/tp_perf" 2>&1 | tee "$OUT/tp_engine.txt"
  tar -C "$OUT" -czf "$OUT/tp_perf.tgz" tp_perf
  exit 0
fi
if [ "$PART" = lora ]; then
  timeout -s INT 300 $PYTEST -v --durations=10 tests/kernels/test_lora_kernels.py \
    tests/engine/test_lora_gpu.py 2>&1 | tee "$OUT/pytest_lora.log" | tail -n 25
  timeout 270 python3 benchmarks/bench_lora.py benchmarks/models/llama-3-8b \
    --output-json "$OUT/lora_perf.json" 2>&1 | grep -v "^USDT" | tee "$OUT/lora_perf.txt" \
    | tail -n 8
  exit 0
fi
if [ "$PART" = spec ]; then
  timeout -s INT 300 $PYTEST -v --durations=10 tests/engine/test_spec_decode_gpu.py 2>&1 \
    | tee "$OUT/pytest_spec.log" | tail -n 25
  timeout 270 python3 benchmarks/spec_verify_step.py benchmarks/models/llama-3-8b \
    --json "$OUT/spec_verify_step.json" 2>&1 | grep -v "^USDT" \
    | tee "$OUT/spec_verify_step.txt" | tail -n 4
  exit 0
fi
if [ "$PART" = tp_moe ]; then    # the MoE shape at TP=2 against TP=1 (experts' channels split)
  python3 benchmarks/tp_perf.py engine --model benchmarks/models/qwen3-30b-a3b --tp 1 2 \
    --out "$OUT/tp_perf_moe" 2>&1 | tee "$OUT/tp_engine_moe.txt"
  exit 0
fi
if [ "$PART" = tp4 ] || [ "$PART" = tp8 ]; then
  N=${PART#tp}
  L70=benchmarks/models/llama-3-70b
  python3 -m archserve.cli.main doctor -m $L70 -tp "$N" 2>&1 | tee "$OUT/doctor_tp$N.txt"
  python3 benchmarks/tp_perf.py engine --model $L70 --tp "$N" --out "$OUT/tp_perf_70b" 2>&1 \
    | grep -v "^USDT" | tee "$OUT/tp_engine_70b_tp$N.txt"
  python3 benchmarks/tp_perf.py allreduce --ranks "$N" --out "$OUT/tp_allreduce_$N.json" 2>&1 \
    | tee "$OUT/tp_allreduce_$N.txt"
  exit 0
fi

if want doctor; then
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -m archserve.cli.main doctor; } 2>&1 | tee "$OUT/doctor.txt"
  python3 -m archserve.cli.main explain --device live --op attention --head-size 128 \
    --dtype bfloat16 --libraries installed --json > "$OUT/explain_live.json" 2>&1
  python3 -m archserve.cli.main explain --device h200 --op attention --head-size 128 \
    --dtype bfloat16 --libraries installed 2>&1 | tee "$OUT/explain_h200.txt"
fi
if want tests; then
  # (test_openapi needs schemathesis, a CPU-only test of the schema: not carried.)
  # -v: one line per test as it ends, so a run cut by the timeout still says what passed;
  # SIGINT makes pytest print its summary before it exits.
  if [ "${SKIP_KERNELS:-0}" = 1 ]; then
    echo "SKIP_KERNELS=1: kernel tests not run" > "$OUT/pytest_gpu_kernels.log"
  else
    timeout -s INT ${KERNEL_TIMEOUT:-500} $PYTEST -v -n ${WORKERS:-14} --durations=10 \
      ${KERNEL_ARGS:-} ${KERNEL_K:+-k "$KERNEL_K"} tests/kernels > "$OUT/pytest_gpu_kernels.log" 2>&1 &
    kernels=$!
  fi
  timeout -s INT ${ENGINE_TIMEOUT:-500} $PYTEST --durations=10 \
    --ignore=tests/kernels --ignore=tests/serve/test_openapi.py ${ENGINE_ARGS:-} ${ENGINE_K:+-k "$ENGINE_K"} ${ENGINE_PATHS:-tests} > "$OUT/pytest_gpu_engine.log" 2>&1
  [ -n "${kernels:-}" ] && wait "$kernels"
  tail -n 25 "$OUT/pytest_gpu_kernels.log" "$OUT/pytest_gpu_engine.log"
fi
if want attention; then
  python3 benchmarks/bench_attention.py --iters 30 --split-sweep ${SPLITS:-1,2,4,8,16} \
    --out "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.txt"
fi
if want gemm; then
  python3 benchmarks/bench_skinny_gemm.py --out "$OUT/bench_skinny_gemm.json" 2>&1 \
    | tee "$OUT/bench_skinny_gemm.txt"
fi
if want perf; then
  bash benchmarks/h200_targets.sh "$OUT"
fi
if want perf_sync; then   # the bench rows again without async scheduling
  bash benchmarks/h200_targets.sh "$OUT" _sync --no-async-scheduling
fi
if want quant_gemm; then
  if [ "${QUANT_TESTS:-1}" != 0 ]; then
    timeout 300 $PYTEST -v -s tests/kernels/test_quantized_tuning.py \
      tests/kernels/test_quant_gemm.py -k "w8a8 or tuned or tuner or scaled_mm or block_fp8 or int8 or weight_only" 2>&1 \
      | tee "$OUT/pytest_quant_gemm.log" | grep -E "PASS|FAIL|ERROR|default .* us|passed|failed"
  fi
  timeout ${QUANT_GEMM_TIMEOUT:-560} python3 benchmarks/bench_quant_gemm.py \
    ${QUANT_GEMM_ARGS:-} --out "$OUT/bench_quant_gemm.json" 2>&1 \
    | tee "$OUT/bench_quant_gemm.txt"
fi
if want quant_perf; then
  bash benchmarks/h200_quant_targets.sh "$OUT"
fi
if want serve; then
  bash benchmarks/h200_serve.sh "$OUT"
fi
if want structured; then
  for m in qwen3-0.6b llama-3-8b; do
    timeout 280 python3 benchmarks/structured_perf.py --model benchmarks/models/$m \
      --load-format dummy --dtype bfloat16 --tokenizer .tok/smollm2 --batch-sizes 1,32,256 \
      --out "$OUT/structured_perf_$m.json" 2>&1 | grep -v "^USDT" | tee "$OUT/structured_perf_$m.txt"
  done
  timeout 240 $PYTEST -v tests/engine/test_structured_engine.py 2>&1 | tail -n 15 \
    | tee "$OUT/pytest_gpu_structured.log"
fi
if want moe; then
  timeout ${MOE_TIMEOUT:-580} python3 benchmarks/moe_perf.py ${MOE_ARGS:-} \
    --out "$OUT/moe_perf.json" 2>&1 | grep -v "^USDT" | tee "$OUT/moe_perf.txt"
fi
if want profile; then
  for m in llama-3-8b qwen3-0.6b; do
    for mode in "" --no-async-scheduling; do
      tag=$m${mode:+_sync}
      timeout 240 python3 benchmarks/profile_engine_step.py --model benchmarks/models/$m \
        --load-format dummy --dtype bfloat16 --batch-sizes 1,256 --input-len 512 --steps 20 \
        $mode --out "$OUT/profile_$tag.json" 2>&1 | grep -v "^USDT" > "$OUT/profile_$tag.txt"
    done
  done
  tail -n 40 "$OUT"/profile_*.txt
fi
if [ "$PART" = mla ]; then
  $PYTEST -v --durations=15 tests/kernels/test_mla_triton.py tests/models/test_deepseek_vs_hf.py \
    2>&1 | tee "$OUT/pytest_mla.log" | tail -n 30
  timeout ${MLA_TIMEOUT:-480} python3 benchmarks/mla_perf.py ${MLA_ARGS:-} \
    --out "$OUT/mla_perf.json" 2>&1 | grep -v "^USDT" | tee "$OUT/mla_perf.txt"
fi
if [ "$PART" = sparse_mla ]; then
  $PYTEST -v --durations=15 ${SPARSE_TESTS:-tests/kernels/test_sparse_mla_triton.py \
    tests/models/test_sparse_mla_vs_hf.py} 2>&1 | tee "$OUT/pytest_sparse_mla.log" | tail -n 30
fi
if [ "$PART" = dsv4 ]; then
  $PYTEST -v --durations=15 ${DSV4_TESTS:-tests/kernels/test_compressed_attention_triton.py \
    tests/kernels/test_v4_elementwise.py tests/models/test_deepseek_v4_vs_hf.py} 2>&1 \
    | tee "$OUT/pytest_dsv4.log" | tail -n 30
fi
if [ "$PART" = dsv4_perf ]; then
  timeout ${DSV4_TIMEOUT:-540} python3 benchmarks/deepseek_v4_perf.py ${DSV4_ARGS:-} \
    --out "$OUT/deepseek_v4_perf.json" 2>&1 | grep -v "^USDT" | tee "$OUT/deepseek_v4_perf.txt"
fi
if [ "$PART" = emulate ]; then
  EMULATED_LOGS="$OUT/emulated" timeout -s INT 580 $PYTEST -v --durations=10 \
    tests/engine/test_emulated_generations.py -k "${EMULATE_K:-}" 2>&1 \
    | tee "$OUT/pytest_emulate.log" | tail -n 40
fi
if [ "$PART" = sparse_mla_perf ]; then
  timeout ${SPARSE_TIMEOUT:-540} python3 benchmarks/sparse_mla_perf.py ${SPARSE_ARGS:-} \
    --out "$OUT/sparse_mla_perf.json" 2>&1 | grep -v "^USDT" | tee "$OUT/sparse_mla_perf.txt"
fi
if [ "$PART" = gpt_oss ]; then
  $PYTEST -v --durations=15 tests/kernels/test_mxfp4_moe.py tests/models/test_gpt_oss_vs_hf.py \
    tests/kernels/test_attention_impls.py::test_gpu_sinks_match_reference \
    "tests/kernels/test_quant_gemm.py::test_gpu_weight_only_real_shapes" \
    2>&1 | tee "$OUT/pytest_gpt_oss.log" | tail -n 30
  timeout ${GPT_OSS_TIMEOUT:-480} python3 benchmarks/moe_perf.py --models gpt-oss-20b \
    --part kernels --out "$OUT/gpt_oss_kernels.json" 2>&1 | grep -v "^USDT" \
    | tee "$OUT/gpt_oss_kernels.txt"
fi
if [ "$PART" = gpt_oss_engine ]; then
  timeout ${GPT_OSS_TIMEOUT:-580} python3 benchmarks/moe_perf.py \
    --models gpt-oss-20b,gpt-oss-20b-bf16 --part engine --skip-peer \
    --out "$OUT/gpt_oss_engine.json" 2>&1 | grep -v "^USDT" | tee "$OUT/gpt_oss_engine.txt"
fi
if [ "$PART" = ncu ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  mkdir -p "$OUT/ncu"
  read -ra specs <<< "${NCU_CASES:-mla@_mla_decode_kernel@1}"   # no glob expansion
  for spec in "${specs[@]}"; do
    IFS=@ read -r case kernels count <<< "$spec"
    count=${count:-1}
    tag=${case//:/_}
    # 4 launches of the case, COUNT matching kernels each: profile the third launch's, after
    # the first two compiled and warmed everything; --clock-control none leaves the clocks.
    timeout ${NCU_TIMEOUT:-240} "$NCU" --clock-control none --set full -k "regex:$kernels" \
      --launch-skip $((2 * count)) --launch-count "$count" -f -o "$OUT/ncu/$tag" \
      python3 benchmarks/ncu_kernels.py "$case" --launches 4 > "$OUT/ncu/$tag.log" 2>&1
    "$NCU" --import "$OUT/ncu/$tag.ncu-rep" --page details > "$OUT/ncu/$tag.txt" 2>&1
    "$NCU" --import "$OUT/ncu/$tag.ncu-rep" --page source --csv --print-source sass 2>&1 \
      | gzip > "$OUT/ncu/$tag.sass.csv.gz"
    rm -f "$OUT/ncu/$tag.ncu-rep"
    grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per" \
      "$OUT/ncu/$tag.txt" | sed "s|^|$tag: |"
  done
fi
if [ "$PART" = speed ]; then
  SPEED_START=$STARTED bash benchmarks/h200_speed.sh "$OUT"
fi
