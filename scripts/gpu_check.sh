#!/usr/bin/env bash
# Everything this project checks on a CUDA machine, in one call (device time is scarce).
#   bash scripts/gpu_check.sh OUTDIR
# Writes: doctor.txt, explain.json, pytest_gpu.log, bench_attention.{md,json}.
set -uo pipefail
OUT=${1:-${OUT:-out}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -m archserve.cli.main doctor 2>&1 | tee "$OUT/doctor.txt"
python3 -m archserve.cli.main explain --device live --op attention --head-size 128 \
  --dtype bfloat16 --libraries installed --json > "$OUT/explain.json" 2>&1
python3 -m archserve.cli.main explain --device h200 --op attention --head-size 128 \
  --dtype bfloat16 --libraries installed 2>&1 | tee "$OUT/explain_h200.txt"
# Engine first, then kernels: what comes back when the lease runs short is the most useful part.
timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/serve --ignore=tests/kernels tests 2>&1 | tee "$OUT/pytest_gpu_engine.log" | tail -25
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/pytest_gpu_kernels.log" | tail -25
timeout 90 python3 benchmarks/bench_elementwise.py --out "$OUT/bench_elementwise.json" 2>&1 | tee "$OUT/bench_elementwise.md" | tail -20
timeout 70 python3 benchmarks/bench_attention.py --out "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.md" | tail -30
