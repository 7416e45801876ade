#!/usr/bin/env bash
# Serving latency on one GPU: a real `archserve serve` process (Llama-3-8B shape, dummy bf16
# weights) and `archserve bench --mode serve` over HTTP, at several concurrencies and Poisson
# request rates (the serving rows' workload: 512±50% prompt tokens, 128±50% output tokens).
#   bash benchmarks/h200_serve.sh OUTDIR
#   results: OUTDIR/serve/*.json, *.log and server.log
# The config-only model folder has no tokenizer: the server takes one with a word per id of
# the model's vocabulary (benchmarks/word_tokenizer.py; --tokenizer), so every sampled id is
# one streamed delta. The prompts are token ids.
set -uo pipefail
OUT=${1:-out}
D=$OUT/serve
mkdir -p "$D"
AS="python3 -m archserve.cli.main"
MODEL=${MODEL:-benchmarks/models/llama-3-8b}   # MODEL=...: another config-only folder
TOK=$(mktemp -d)/tokenizer
python3 benchmarks/word_tokenizer.py "$MODEL" "$TOK"
PORT=${PORT:-8011}
URL=http://127.0.0.1:$PORT
$AS serve --model "$MODEL" --load-format dummy --dtype bfloat16 \
  --tokenizer "$TOK" --max-model-len 2048 --max-num-seqs 256 --port $PORT \
  > "$D/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 300); do
  python3 -c "import urllib.request; urllib.request.urlopen('$URL/health', timeout=2)" \
    2> /dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited"; tail -n 30 "$D/server.log"; exit 1; }
  sleep 1
done
echo "server up after ${SECONDS}s"
W="--mode serve --url $URL --model $TOK --input-len 512 --output-len 128 --random-range 0.5"
bench() {   # bench NAME ARGS...
  local name=$1; shift
  echo "== $name: archserve bench $W $*"
  timeout 240 $AS bench $W "$@" --output-json "$D/$name.json" > "$D/$name.log" 2>&1
  echo "exit $?"; tail -n 20 "$D/$name.log"
}
bench c1 --num-prompts 16 --concurrency 1
bench c8_32_128 --num-prompts 256 --concurrency 8,32,128 --plots "$D/plots"
for rate in 8 16 24; do
  bench rate$rate --num-prompts $((rate * 20)) --request-rate $rate
done
