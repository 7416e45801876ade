"""GPTQ and AWQ fixtures made with GPTQModel on CPU (run in the gptqmodel venv).

    python gptqmodel_fixtures.py BASE_DIR OUT_ROOT [NAME ...]

Each fixture: the base model quantized with GPTQModel.quantize() on the calibration ids of
base_model.py, saved with model.save() in the tool's standard format, then reloaded with
GPTQModel.load(..., device="cpu") and a short greedy generate as a check.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys

import torch

# GPTQModel 7.6 sizes its CPU pool as (cores + 1) // 2 but always asks 2 workers for its
# "model_loader:cpu" sub-pool, so on a 2-core machine quantize() fails with "Virtual pool
# 'model_loader:cpu' requests 2 workers but parent 'cpu' only has 1". Give the pool 2.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, ((os.cpu_count() or 1) + 1) // 2)))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base_model  # noqa: E402

# name -> kwargs of GPTQConfig / AWQConfig
FIXTURES = {
    "gptq-w4-g128-sym": ("gptq", dict(bits=4, group_size=128, sym=True, desc_act=False)),
    "gptq-w4-g32-asym-actorder": ("gptq", dict(bits=4, group_size=32, sym=False,
                                               desc_act=True)),
    "gptq-w8-g128": ("gptq", dict(bits=8, group_size=128, sym=True, desc_act=False)),
    "awq-w4-g64": ("awq", dict(bits=4, group_size=64, sym=False)),
}


def _config(method: str, kwargs: dict):
    from gptqmodel import AWQConfig, GPTQConfig
    # offload_to_disk=False: the default writes a random temp path into the saved config.
    if method == "awq":
        return AWQConfig(format="gemm", offload_to_disk=False, **kwargs)
    return GPTQConfig(format="gptq", offload_to_disk=False, **kwargs)


def make(base: str, out: str, name: str) -> str:
    from gptqmodel import BACKEND, GPTQModel
    from transformers import AutoTokenizer

    method, kwargs = FIXTURES[name]
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    calibration = [{"input_ids": ids, "attention_mask": [1] * len(ids)}
                   for ids in base_model.calibration_ids(tokenizer)]
    model = GPTQModel.load(base, _config(method, kwargs), device="cpu", dtype=torch.bfloat16)
    # AWQ's default packing backend for FORMAT.GEMM is the CUDA AwqGEMM kernel ("AWQ: CUDA is
    # not available." on CPU); the portable torch kernel packs the same GEMM layout.
    backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.AUTO
    model.quantize(calibration, batch_size=1, tokenizer=tokenizer, backend=backend)
    shutil.rmtree(out, ignore_errors=True)
    model.save(out)
    os.remove(os.path.join(out, "quant_log.csv"))  # per-module loss/timing log, not checkpoint
    del model
    gc.collect()
    return out


def check(path: str) -> str:
    from gptqmodel import GPTQModel
    from transformers import AutoTokenizer
    model = GPTQModel.load(path, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return base_model.smoke_generate(model, tokenizer)


def main(argv):
    import gptqmodel
    import transformers
    base, root, names = argv[0], argv[1], argv[2:] or list(FIXTURES)
    print(f"gptqmodel {gptqmodel.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}")
    return base_model.make_each(names, root, lambda out, name: make(base, out, name), check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
