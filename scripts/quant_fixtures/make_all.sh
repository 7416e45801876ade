#!/usr/bin/env bash
# Regenerates tests/fixtures/quant/*: small real quantized checkpoints made offline by the real
# tools (llm-compressor, GPTQModel) and by fp8_block_hf.py, all from the same tiny random
# Llama built by base_model.py. CPU only; no hub downloads.
#   bash scripts/quant_fixtures/make_all.sh            all fixtures
#   ONLY="llmc gptqmodel fp8 dsv3 gptoss refs" bash ...  a subset of the steps
# "refs" (last) writes references/<fixture>.safetensors with its tool's own loader
# (reference_logits.py, once per venv) and references/base.safetensors from the base model.
# Venvs live under ${VENV_ROOT:-/work/venvs} and are created when missing (torch first and
# pinned: the CPU build lies on local disk; a loose range would pull a CUDA build).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV_ROOT=${VENV_ROOT:-/work/venvs}
OUT=${OUT:-$REPO/tests/fixtures/quant}
ONLY=${ONLY:-"llmc gptqmodel fp8 dsv3 gptoss refs"}
TORCH_PIN="torch==2.13.0"
LLMC_PIN="llmcompressor==0.14.0.1"   # brings compressed-tensors 0.19, transformers 5.15-5.17
GPTQMODEL_PIN="gptqmodel==7.6.0"

venv() {  # venv NAME IMPORT PIN: create $VENV_ROOT/NAME with torch then PIN, unless importable
  local dir="$VENV_ROOT/$1"
  if ! "$dir/bin/python" -c "import $2" > /dev/null 2>&1; then
    python3 -m venv "$dir" >&2
    "$dir/bin/pip" install -q "$TORCH_PIN" >&2
    "$dir/bin/pip" install -q "$TORCH_PIN" "$3" >&2
  fi
  echo "$dir/bin/python"
}

export TQDM_DISABLE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONHASHSEED=0
LLMC_PY=$(venv llmc llmcompressor "$LLMC_PIN")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
"$LLMC_PY" "$HERE/base_model.py" "$WORK/base" > "$WORK/base.log" 2>&1 || { cat "$WORK/base.log"; exit 1; }

status=0
run() {  # run LOGNAME PYTHON SCRIPT ARGS...: keep the tool's chatter in a log, print the summary
  local log="$WORK/$1.log"; shift
  local summary='^(llmcompressor |gptqmodel |base|(ct|gptq|awq|hf|gpt-oss)-[a-z0-9-]+: )'
  if ! "$@" > "$log" 2>&1; then status=1; fi
  grep -E "$summary" "$log" || tail -n 20 "$log"
}
case " $ONLY " in *" llmc "*)
  run llmc "$LLMC_PY" "$HERE/llmcompressor_fixtures.py" "$WORK/base" "$OUT" ;; esac
case " $ONLY " in *" gptqmodel "*)
  GPTQ_PY=$(venv gptqm gptqmodel "$GPTQMODEL_PIN")
  run gptqmodel "$GPTQ_PY" "$HERE/gptqmodel_fixtures.py" "$WORK/base" "$OUT" ;; esac
case " $ONLY " in *" fp8 "*)
  run fp8 "$LLMC_PY" "$HERE/fp8_block_hf.py" "$WORK/base" "$OUT/hf-fp8-block" --check ;; esac
case " $ONLY " in *" dsv3 "*)   # a tiny block-FP8 DeepSeek-V3 and its own reference
  run dsv3 "$LLMC_PY" "$HERE/deepseek_v3_fp8.py" "$OUT/hf-deepseek-v3-fp8-block" ;; esac
case " $ONLY " in *" gptoss "*)   # a tiny MXFP4 gpt-oss (this repo's transformers, no venv)
  run gptoss python3 "$HERE/gpt_oss_mxfp4.py" "$OUT/gpt-oss-mxfp4" --check ;; esac
case " $ONLY " in *" refs "*)
  run refs-llmc "$LLMC_PY" "$HERE/reference_logits.py" "$OUT" --base "$WORK/base"
  GPTQ_PY=$(venv gptqm gptqmodel "$GPTQMODEL_PIN")
  run refs-gptqmodel "$GPTQ_PY" "$HERE/reference_logits.py" "$OUT" ;; esac
du -sh "$OUT"/*
du -sh "$OUT"
exit $status
