"""compressed-tensors fixtures made with llm-compressor (run in the llm-compressor venv).

    python llmcompressor_fixtures.py BASE_DIR OUT_ROOT [NAME ...]

Each fixture: the base model quantized with one oneshot() recipe, lm_head left alone,
saved with save_compressed=True, then reloaded with transformers + compressed-tensors and a
short greedy generate as a check.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base_model  # noqa: E402


def _w4a16_g32_asym():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32,
                               symmetric=False, dynamic=False)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


# name -> (modifier, scheme or config_groups, needs calibration data)
FIXTURES = {
    "ct-fp8-tensor-static": ("QuantizationModifier", "FP8", True),
    "ct-fp8-channel-dynamic": ("QuantizationModifier", "FP8_DYNAMIC", False),
    "ct-fp8-block": ("QuantizationModifier", "FP8_BLOCK", False),
    "ct-int8-w8a8": ("GPTQModifier", "W8A8", True),
    "ct-w4a16-g128-sym": ("GPTQModifier", "W4A16", True),
    "ct-w4a16-g32-asym": ("GPTQModifier", _w4a16_g32_asym, True),
    "ct-w8a16-g128": ("GPTQModifier", "W8A16", True),
}


def _recipe(modifier: str, scheme, ignore: list[str]):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    cls = {"GPTQModifier": GPTQModifier, "QuantizationModifier": QuantizationModifier}[modifier]
    if callable(scheme):
        return cls(config_groups=scheme(), ignore=ignore)
    return cls(targets="Linear", scheme=scheme, ignore=ignore)


def make(base: str, out: str, name: str) -> str:
    modifier, scheme, calibrate = FIXTURES[name]
    return quantize(base, out, modifier, scheme, calibrate, ignore=["lm_head"])


def quantize(base: str, out: str, modifier: str, scheme, calibrate: bool,
             ignore: list[str]) -> str:
    """``base`` quantized by one oneshot() recipe (``modifier`` with ``scheme``: a preset
    name, or a function giving config_groups), on base_model's calibration ids where
    ``calibrate``; saved compressed to ``out`` with the tokenizer."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    kwargs = {}
    if calibrate:
        ids = base_model.calibration_ids(tokenizer)
        kwargs = dict(dataset=Dataset.from_dict(
            {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}),
            num_calibration_samples=len(ids), max_seq_length=128,
            shuffle_calibration_samples=False)
    oneshot(model=model, recipe=_recipe(modifier, scheme, ignore), **kwargs)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    del model
    gc.collect()
    return out


def check(path: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return base_model.smoke_generate(model, tokenizer)


def main(argv):
    import compressed_tensors
    import llmcompressor
    import transformers
    base, root, names = argv[0], argv[1], argv[2:] or list(FIXTURES)
    print(f"llmcompressor {llmcompressor.__version__}, compressed-tensors "
          f"{compressed_tensors.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}")
    return base_model.make_each(names, root, lambda out, name: make(base, out, name), check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
