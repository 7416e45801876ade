#!/usr/bin/env bash
# 16 concurrent streams through HTTP on a CPU: `archserve serve` and llama.cpp's llama-server
# (-np 16, same GGUF, same thread count), each measured by the same client,
# `archserve bench --mode serve` (same prompt token ids, greedy, ignore_eos, streamed).
# Each line: output tok/s, TTFT and ITL P50/P99, and the 1/5/15-minute load average
# (other processes on the cores change every number). Each server takes ROUNDS bursts
# (default 2), each of new prompts: the first after start-up pays each server's first-use costs,
# the later ones are the warm figure.
# The peer comes from benchmarks/build_llama_cpp_peer.sh; CI does not run this.
#
#   bash benchmarks/cpu_serve_vs_llama_server.sh [PEER_DIR] [extra archserve serve args...]
#   e.g. bash benchmarks/cpu_serve_vs_llama_server.sh ~/.cache/archserve/llama_cpp --dtype bfloat16
set -euo pipefail
PEER=${1:-${ARCHSERVE_CACHE_DIR:-$HOME/.cache/archserve}/llama_cpp}
shift || true
THREADS=${THREADS:-$(nproc)}
PROMPTS=${PROMPTS:-16}; INPUT_LEN=${INPUT_LEN:-48}; OUTPUT_LEN=${OUTPUT_LEN:-32}
MODEL=$(python3 -c "from archserve.loader.default_model import default_model_path as p; print(p())")
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_healthy() {   # url, log, pid
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$3" 2>/dev/null || break
    sleep 0.5
  done
  echo "no answer from $1; its log:" >&2; tail -20 "$2" >&2; return 1
}

bench() {   # name url: ROUNDS bursts, one line each
  # A new seed a round: new prompts, so neither server answers from a prompt it has cached.
  for round in $(seq "${ROUNDS:-2}"); do bench_round "$1 $round" "$2" "$OUT/$1-$round.json" "$round"; done
}

bench_round() {   # label url json seed
  python3 -m archserve.cli.main bench --mode serve --url "$2" --model "$MODEL" --seed "$4" \
    --num-prompts "$PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --concurrency "$PROMPTS" --json > "$3"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=d['runs'][-1]; \
print(f\"{sys.argv[2]:>14}: {r['output_tokens_per_s']:7.1f} output tok/s, \
TTFT p50/p99 {r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f} ms, \
ITL p50/p99 {r['itl_ms']['p50']:.1f}/{r['itl_ms']['p99']:.1f} ms, \
TPOT p50 {r['tpot_ms']['p50']:.1f} ms, {r['completed']}/{r['completed'] + r['failed']} completed, \
load {sys.argv[3]}\")" "$3" "$1" "$(cut -d' ' -f1-3 /proc/loadavg)"
}

OMP_NUM_THREADS=$THREADS python3 -m archserve.cli.main serve --model "$MODEL" --port 8431 \
  --max-num-seqs "$PROMPTS" "$@" > "$OUT/archserve.log" 2>&1 &
pids+=($!)
wait_healthy http://127.0.0.1:8431 "$OUT/archserve.log" "${pids[0]}"
bench archserve http://127.0.0.1:8431
kill "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true

# -c: each of the 16 slots gets the same 256-token context archserve's requests fit in.
LD_LIBRARY_PATH="$PEER/build/bin:${LD_LIBRARY_PATH:-}" "$PEER/build/bin/llama-server" \
  -m "$MODEL" --host 127.0.0.1 --port 8432 -np "$PROMPTS" -c $((PROMPTS * 256)) \
  -t "$THREADS" -tb "$THREADS" --cont-batching > "$OUT/llama-server.log" 2>&1 &
pids+=($!)
wait_healthy http://127.0.0.1:8432 "$OUT/llama-server.log" "${pids[1]}"
bench llama-server http://127.0.0.1:8432
echo "results: $OUT"
