"""Quantized tiny Qwen3-MoE fixtures made with llm-compressor (run in the llm-compressor venv).

    python moe_fixtures.py OUT_ROOT [NAME ...]

The base: a random Qwen3MoeForCausalLM (hidden 128, 4 experts of width 128, top-2, 2 layers, 4 KV heads so q/k/v each fill a
128-row fp8 block,
the vocabulary-384 BPE tokenizer of tests/tiny_checkpoints.py), bf16. Each fixture is it
quantized by one oneshot() recipe (the router and lm_head left alone, as llm-compressor's
MoE examples do), saved with save_compressed=True, reloaded with transformers +
compressed-tensors for a short greedy generate. Then reference_logits.py can be run on it.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base_model  # noqa: E402

MOE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
           num_hidden_layers=2, num_attention_heads=4, head_dim=32, num_key_value_heads=4,
           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
           max_position_embeddings=256, tie_word_embeddings=False)
IGNORE = ["lm_head", "re:.*mlp.gate$"]
# name -> (modifier, scheme, needs calibration data)
FIXTURES = {
    "ct-moe-fp8-block": ("QuantizationModifier", "FP8_BLOCK", False),
    "ct-moe-fp8-dynamic": ("QuantizationModifier", "FP8_DYNAMIC", False),
    "ct-moe-w4a16": ("GPTQModifier", "W4A16", True),
}


def build_base(path: str, seed: int = 0) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = base_model._tiny_checkpoints().train_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, **MOE)
    model = Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                w = 1.0 + 0.05 * torch.randn(param.shape, generator=gen)
            elif name.endswith("embed_tokens.weight"):
                w = torch.randn(param.shape, generator=gen) * 0.5
            elif param.dim() >= 2:       # [out, in] or stacked experts [E, out, in]
                w = torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5
                if name.endswith("mlp.gate.weight"):
                    w = w * 4.0          # a router that prefers some experts
            else:
                w = param + torch.randn(param.shape, generator=gen) * 0.05
            param.copy_(w)
    os.makedirs(path, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make(base: str, out: str, name: str) -> str:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    modifier, scheme, calibrate = FIXTURES[name]
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    cls = {"GPTQModifier": GPTQModifier, "QuantizationModifier": QuantizationModifier}[modifier]
    kwargs = {}
    if calibrate:
        ids = base_model.calibration_ids(tokenizer)
        kwargs = dict(dataset=Dataset.from_dict(
            {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}),
            num_calibration_samples=len(ids), max_seq_length=128,
            shuffle_calibration_samples=False)
    oneshot(model=model, recipe=cls(targets="Linear", scheme=scheme, ignore=IGNORE), **kwargs)
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
    import tempfile

    import llmcompressor
    import transformers
    root, names = argv[0], argv[1:] or list(FIXTURES)
    print(f"llmcompressor {llmcompressor.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as work:
        base = build_base(os.path.join(work, "base"))
        return base_model.make_each(names, root, lambda out, name: make(base, out, name),
                                    check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
