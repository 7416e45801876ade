#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has torch, triton, transformers, safetensors,
# numpy, pytest) into .whl/ for the device tool's `carry`: the CLI's, the server's (fastapi,
# uvicorn, prometheus-client), the serving bench's (httpx), the server tests' client and
# validator (openai, jsonschema), structured output's grammar library (xgrammar) and what the
# LoRA tests make their adapters with (peft, accelerate), and transformers 5.25 with the hub
# client, tokenizers and kernels versions it requires (the machine's older transformers lacks
# the configs the tests build tiny DeepSeek-V3.2, GLM-5, DeepSeek V4 and gpt-oss models from).
# Run here, on a machine with pip.
# On the device: pip install --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  typer==0.29.1 click rich markdown-it-py mdurl pygments shellingham gguf \
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types annotated-doc typing-inspection \
  typing-extensions xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11 prometheus-client httpx==0.28.1 \
  httpcore anyio sniffio idna certifi psutil openai==3.57.0 jiter==0.19.0 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore distro tqdm \
  opentelemetry-api==1.45.2 jsonschema==4.26.0 referencing==0.37.0 \
  jsonschema-specifications==2025.9.1 rpds-py==0.30.0 attrs==26.1.0 \
  peft==0.21.2 accelerate==1.15.0 \
  transformers==5.25.0 huggingface-hub==2.4.0 tokenizers==0.23.3 kernels==0.19.1 fsspec tomlkit
ls .whl
