#!/usr/bin/env bash
# The pending speed rows of issues 21 (latency), 13 (MoE) and 14 (MLA) on one H200, in
# priority order, inside one device call: every step has a time limit, and a step that
# cannot finish before the deadline is skipped and named, with the line that runs it later.
#   bash benchmarks/h200_speed.sh OUTDIR       (through `bash scripts/gpu_check.sh OUT speed`,
#                                               which installs the carried wheels first)
#   env SPEED_DEADLINE  seconds for the whole call, from SPEED_START (default 540: the device
#                       allows 600 a call; set it to the call's timeout_s minus 60)
#       SPEED_START     epoch seconds the call began (gpu_check.sh passes its own start)
#       SPEED_STEPS     comma-separated step names to run (default: all, in the order below)
#       SPEED_DRY_RUN=1 print the plan (steps, estimates, limits, commands) and run nothing
# Results: OUTDIR/speed/<step>.log and .json (budget/ for the serving sweep), summary.txt.
# Estimates are for a fresh machine (cold Triton and tuning caches); a warm one is faster.
set -uo pipefail
OUT=${1:-out}
D=$OUT/speed
mkdir -p "$D"
START=${SPEED_START:-$EPOCHSECONDS}
DEADLINE=${SPEED_DEADLINE:-540}
STEPS=${SPEED_STEPS:-all}
DRY=${SPEED_DRY_RUN:-0}
SUMMARY=$D/summary.txt
SKIPPED=()
PLANNED=0   # the dry run's sum of estimates
AS="python3 -m archserve.cli.main"
L8=benchmarks/models/llama-3-8b
Q06=benchmarks/models/qwen3-0.6b
# The commands of docs/benchmarks.md's dense-decoder table (benchmarks/h200_targets.sh), so
# the rows compare with it.
E8="--model $L8 --load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256"
EQ="--model $Q06 --load-format dummy --dtype bfloat16 --max-model-len 2048"
B1="--num-prompts 1 --input-len 128 --output-len 512"
# Every fusion's name, for ARCHSERVE_DISABLE_FUSIONS (one list: the code's).
ALL_FUSIONS=$(python3 -c "from archserve.kernels.elementwise import FUSIONS; print(','.join(FUSIONS))" \
  | tail -n 1)
[ -n "$ALL_FUSIONS" ] || { echo "archserve does not import (PYTHONPATH=\$PWD?)"; exit 1; }

wanted() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]; }

# step NAME EST_S LIMIT_S CMD...: run CMD if EST_S seconds (its estimate on a fresh machine,
# or the least that yields a result) are left before the deadline, for LIMIT_S at most.
step() {
  local name=$1 est=$2 limit=$3 t0 rc left
  shift 3
  wanted "$name" || return 0
  left=$((DEADLINE - (EPOCHSECONDS - START) - 10))   # 10 s: the kill grace and this report
  if [ "$DRY" = 1 ]; then
    printf '%-20s ~%4ss (limit %4ss): %s\n' "$name" "$est" "$limit" "$*"
    PLANNED=$((PLANNED + est))
    return 0
  fi
  if ((left < est)); then
    echo "$name: skipped (needs ~${est}s, ${left}s left)" | tee -a "$SUMMARY"
    SKIPPED+=("$name")
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "== $name (~${est}s, limit ${limit}s): $*"
  t0=$EPOCHSECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | grep -v "^USDT" > "$D/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name: exit $rc in $((EPOCHSECONDS - t0))s (estimate ${est}s, limit ${limit}s)" \
    | tee -a "$SUMMARY"
  if ((rc == 124 || rc == 137)); then   # cut by its limit: its rows may be partial
    SKIPPED+=("$name")
  fi
  tail -n 12 "$D/$name.log"
}

if [ "$DRY" != 1 ]; then
  # Seconds, not minutes, to find that the wheels were not carried: every step needs typer
  # and rich (the CLI, the bench's progress); the server needs fastapi, uvicorn and httpx,
  # and the sweep's plots matplotlib (its JSON is written before them).
  python3 -c "import typer, rich, archserve.cli.main" \
    || { echo "imports failed: carry .whl (bash scripts/device_wheels.sh)"; exit 1; }
  python3 -c "import fastapi, uvicorn, httpx, matplotlib" \
    || echo "warning: the serve_budget step will lack what failed to import above"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv \
    | tee "$D/nvidia_smi.csv"
  echo "deadline ${DEADLINE}s from the call's start; $((EPOCHSECONDS - START))s gone" \
    | tee "$SUMMARY"
fi

# (a) Dense decoders: Qwen3-0.6B batch-1 step (target <= 0.6 ms) with the fusions and without
# them, and the Llama-3-8B batch-1 step against its floor (target <= 1.11x).
step qwen06b_b1 60 150 $AS bench $EQ $B1 --output-json "$D/qwen06b_b1.json"
step qwen06b_b1_unfused 35 120 env ARCHSERVE_DISABLE_FUSIONS=$ALL_FUSIONS \
  $AS bench $EQ $B1 --output-json "$D/qwen06b_b1_unfused.json"
step llama8b_b1 70 180 $AS bench $E8 $B1 --output-json "$D/llama8b_b1.json"
# The same two without programmatic dependent launch (kernels/pdl.py: on by default on SM90+).
step qwen06b_b1_nopdl 60 150 env ARCHSERVE_PDL=0 $AS bench $EQ $B1 \
  --output-json "$D/qwen06b_b1_nopdl.json"
step llama8b_b1_nopdl 70 180 env ARCHSERVE_PDL=0 $AS bench $E8 $B1 \
  --output-json "$D/llama8b_b1_nopdl.json"
# (b) MoE: Qwen3-30B-A3B batch 1 (<= 1.5x its active-weight floor) and 256 x 256/128
# (MBU >= 60%); Mixtral-8x7B batch 1 (<= 1.4x). One model per process: 60 GB and 93 GB of
# dummy weights never share the device.
step moe_qwen3 75 180 python3 benchmarks/moe_perf.py --part engine --models qwen3-30b-a3b \
  --skip-peer --out "$D/moe_qwen3.json"
step moe_mixtral 80 200 python3 benchmarks/moe_perf.py --part engine --models mixtral-8x7b \
  --skip-peer --skip-mixtral-throughput --out "$D/moe_mixtral.json"
# (c) MLA: the MLA decode kernel at 64 x 4096 (>= 70% of copy bandwidth at 16 heads),
# DeepSeek-V2-Lite batch 1 (<= 1.5x) and 256 x 1024/128, KV bytes per token and 4k-token
# sequences against an MHA-sized cache.
step mla_kernel 45 120 python3 benchmarks/mla_perf.py --part kernel --out "$D/mla_kernel.json"
step mla_engine 80 200 python3 benchmarks/mla_perf.py --part engine --out "$D/mla_engine.json"
# The same without PDL: 256 x 1024/128 once measured slower with it (19.6 against 16.0 ms,
# one run each).
step mla_engine_nopdl 80 200 env ARCHSERVE_PDL=0 python3 benchmarks/mla_perf.py --part engine \
  --out "$D/mla_engine_nopdl.json"
# DeepSeek's shared experts as their own MLP (two GEMVs and an add a layer at batch 1)
# against stacked with the routed experts (the default).
step mla_engine_shared_mlp 80 200 env ARCHSERVE_DISABLE_FUSIONS=shared_experts \
  python3 benchmarks/mla_perf.py --part engine --out "$D/mla_engine_shared_mlp.json"
# The MoE and MLA rows with every RMSNorm in a kernel of its own (fusion rms_norm_gemm off):
# the norm before a MoE router, and before MLA's first projection, can run
# in that GEMV's prologue, as the QKV and gate/up GEMVs' could.
step moe_qwen3_norm_kernel 75 180 env ARCHSERVE_DISABLE_FUSIONS=rms_norm_gemm \
  python3 benchmarks/moe_perf.py --part engine --models qwen3-30b-a3b --skip-peer \
  --out "$D/moe_qwen3_norm_kernel.json"
step mla_engine_norm_kernel 80 200 env ARCHSERVE_DISABLE_FUSIONS=rms_norm_gemm \
  python3 benchmarks/mla_perf.py --part engine --out "$D/mla_engine_norm_kernel.json"
# The same rows with the norms' weights left in the norms and the residual added by the
# norms (fusion fold_norm_weights off; on, they are folded into the GEMMs after, and the add
# is in each block's last GEMM or MoE kernel: models/layers/norm_folding.py).
step moe_qwen3_unfolded 75 180 env ARCHSERVE_DISABLE_FUSIONS=fold_norm_weights \
  python3 benchmarks/moe_perf.py --part engine --models qwen3-30b-a3b --skip-peer \
  --out "$D/moe_qwen3_unfolded.json"
step mla_engine_unfolded 80 200 env ARCHSERVE_DISABLE_FUSIONS=fold_norm_weights \
  python3 benchmarks/mla_perf.py --part engine --out "$D/mla_engine_unfolded.json"
# What runs between two batch-1 decode graphs: the engine's step against its graph replayed
# alone, on the MoE and MLA shapes.
step step_vs_graph_qwen3 60 150 python3 benchmarks/step_vs_graph.py benchmarks/models/qwen3-30b-a3b \
  --max-model-len 1024
step step_vs_graph_v2 60 150 python3 benchmarks/step_vs_graph.py benchmarks/models/deepseek-v2-lite \
  --max-model-len 4224
# What each byte-less kernel of a batch-1 MoE / MLA layer costs in a chain of launches
# (benchmarks/bench_chain_latency.py).
step chain_latency 30 90 python3 benchmarks/bench_chain_latency.py --out "$D/chain_latency.json"
# Where the 0.6B's batch-1 step goes, kernel by kernel (device time per step, top kernels).
step profile_06b_b1 60 150 python3 benchmarks/profile_engine_step.py --model $Q06 \
  --load-format dummy --dtype bfloat16 --batch-sizes 1 --input-len 128 --steps 20 \
  --out "$D/profile_06b_b1.json"
# Where the MoE and MLA models' batch-1 steps go, kernel by kernel (issues 13 and 14).
step profile_moe_b1 90 200 python3 benchmarks/profile_engine_step.py \
  --model benchmarks/models/qwen3-30b-a3b --load-format dummy --dtype bfloat16 \
  --batch-sizes 1 --input-len 128 --steps 20 --out "$D/profile_moe_b1.json"
step profile_mla_b1 90 200 python3 benchmarks/profile_engine_step.py \
  --model benchmarks/models/deepseek-v2-lite --load-format dummy --dtype bfloat16 \
  --batch-sizes 1 --input-len 128 --steps 20 --out "$D/profile_mla_b1.json"
# (b, continued) ours against transformers (>= 10x) on the first 12 of Qwen3's 48 layers
# (transformers loops over the experts in Python), then the fused MoE kernel table at 1, 16,
# 64, 256 and 1024 tokens (after the engines: their tuned tiles are in the cache).
step moe_peer 70 150 python3 benchmarks/moe_perf.py --part peer --models qwen3-30b-a3b \
  --peer-layers 12 --out "$D/moe_peer.json"
step moe_kernels 75 180 python3 benchmarks/moe_perf.py --part kernels --out "$D/moe_kernels.json"
# (a, continued) µs and launches per decoder layer, every fusion off and on.
step decode_layer 35 120 python3 benchmarks/bench_decode_layer.py --models qwen3-0.6b \
  --configs unfused,all --iters 100 --out "$D/decode_layer.json"
# (a, continued) host time of a step with prompt tokens on the 0.6B shape: replayed from the
# mixed-step graphs (cudagraph_mode FULL, the default), eagerly (FULL_DECODE_ONLY), and
# eagerly with CUPTI attached first (as the start-up self-check's CUDA profile once did).
step eager_host_full 50 120 python3 benchmarks/eager_step_host.py $EQ \
  --out "$D/eager_host_full.json"
step eager_host 45 120 python3 benchmarks/eager_step_host.py $EQ \
  --compilation-config '{"cudagraph_mode":"FULL_DECODE_ONLY"}' --out "$D/eager_host.json"
step eager_host_cupti 45 120 python3 benchmarks/eager_step_host.py $EQ --cuda-profile-first \
  --compilation-config '{"cudagraph_mode":"FULL_DECODE_ONLY"}' \
  --cprofile 25 --out "$D/eager_host_cupti.json"
# (d) The serving tail, shortened: the auto budget (then the old fixed 8192) at 8, 16
# and 24 requests/s for 10 s each (about 135 s a budget); what ran is kept if
# cut. Then the fixed budgets between at 16 requests/s, for the trade-off plot.
step serve_budget 270 330 python3 benchmarks/serve_budget_sweep.py --out "$D/budget" \
  --budgets auto,8192 --rates 8,16,24 --duration 10
step serve_budget_sweep 330 420 python3 benchmarks/serve_budget_sweep.py \
  --out "$D/budget_sweep" --budgets 256,512,1024,2048 --rates 16 --duration 10

if [ "$DRY" = 1 ]; then
  echo "estimates: ${PLANNED}s in all, against a deadline of ${DEADLINE}s"
else
  echo "total $((EPOCHSECONDS - START))s of ${DEADLINE}s" | tee -a "$SUMMARY"
  if ((${#SKIPPED[@]})); then
    skipped=$(IFS=,; echo "${SKIPPED[*]}")
    echo "run the skipped and the cut: SPEED_STEPS=$skipped bash scripts/gpu_check.sh \$OUT speed" \
      | tee -a "$SUMMARY"
  fi
fi
