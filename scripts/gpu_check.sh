#!/usr/bin/env bash
# Everything this project checks on a CUDA machine, in parts that each fit one device call.
#   bash scripts/gpu_check.sh OUTDIR [doctor|engine|kernels|bench|all]   (default: all)
# Carried wheels in .whl/ (scripts/device_wheels.sh) are installed first when present.
set -uo pipefail
OUT=${1:-${OUT:-out}}
PART=${2:-all}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PYTEST="python3 -m pytest -rA -p no:cacheprovider -m gpu"
want() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }

if want doctor; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
  python3 -m archserve.cli.main doctor 2>&1 | tee "$OUT/doctor.txt"
  python3 -m archserve.cli.main explain --device live --op attention --head-size 128 \
    --dtype bfloat16 --libraries installed --json > "$OUT/explain.json" 2>&1
  python3 -m archserve.cli.main explain --device h200 --op attention --head-size 128 \
    --dtype bfloat16 --libraries installed 2>&1 | tee "$OUT/explain_h200.txt"
fi
if want engine; then
  timeout 420 $PYTEST --junitxml="$OUT/junit_engine.xml" --ignore=tests/serve \
    --ignore=tests/kernels tests 2>&1 | tee "$OUT/pytest_gpu_engine.log" | tail -40
fi
if want kernels; then
  timeout 480 $PYTEST --junitxml="$OUT/junit_kernels.xml" tests/kernels \
    2>&1 | tee "$OUT/pytest_gpu_kernels.log" | tail -40
fi
if want bench; then
  timeout 150 python3 benchmarks/bench_elementwise.py --out "$OUT/bench_elementwise.json" \
    2>&1 | tee "$OUT/bench_elementwise.md" | tail -20
  timeout 150 python3 benchmarks/bench_attention.py --out "$OUT/bench_attention.json" \
    2>&1 | tee "$OUT/bench_attention.md" | tail -30
fi
