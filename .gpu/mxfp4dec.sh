#!/usr/bin/env bash
# MXFP4 experts' word-decoding GEMVs (MoETile.mxfp4_words): correctness of every candidate
# tile against dequantize-then-matmul at gpt-oss-20b's shape, then the kernel table and the
# engine rows. ~450 s at most; logs under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt 2>&1
timeout -s INT 110 python3 -m pytest -rfEs -m gpu -v -p no:cacheprovider tests/kernels/test_mxfp4_moe.py > $R/mxfp4_gpu_tests.log 2>&1
echo "rc=$?" >> $R/mxfp4_gpu_tests.log
timeout 120 python3 benchmarks/moe_perf.py --models gpt-oss-20b --part kernels --out $R/gpt_oss_kernels.json > $R/gpt_oss_kernels.txt 2>&1
echo "rc=$?" >> $R/gpt_oss_kernels.txt
timeout 210 python3 benchmarks/moe_perf.py --models gpt-oss-20b,gpt-oss-20b-bf16 --part engine --skip-peer --out $R/gpt_oss_engine.json > $R/gpt_oss_engine.txt 2>&1
echo "rc=$?" >> $R/gpt_oss_engine.txt
cat $R/gpu.txt
grep -E "^(FAILED|ERROR)|passed|failed|error|^rc=" $R/mxfp4_gpu_tests.log | tail -8
grep -v "^USDT" $R/gpt_oss_kernels.txt | tail -n 24
grep -v "^USDT" $R/gpt_oss_engine.txt | tail -n 16
