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

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base_model  # noqa: E402
import llmcompressor_fixtures  # noqa: E402

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

    return base_model.save_random_model(
        path, Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE,
        lambda model, gen: init_moe_weights(model, gen, embed_divisor=2.0), seed)


def init_moe_weights(model, gen: torch.Generator, embed_divisor: float) -> None:
    """Norms near 1, linear and stacked expert weights ~ N(0, 1/in_features), the router
    sharper, embeddings N(0, 1/embed_divisor**2)."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.05 * torch.randn(param.shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            w = torch.randn(param.shape, generator=gen) / embed_divisor
        elif param.dim() >= 2:       # [out, in] or stacked experts [E, out, in]
            w = torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5
            if name.endswith("mlp.gate.weight"):
                w = w * 4.0          # a router that prefers some experts
        else:
            w = param + torch.randn(param.shape, generator=gen) * 0.05
        param.copy_(w)


def make(base: str, out: str, name: str) -> str:
    modifier, scheme, calibrate = FIXTURES[name]
    return llmcompressor_fixtures.quantize(base, out, modifier, scheme, calibrate,
                                           ignore=IGNORE)


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
                                    llmcompressor_fixtures.check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
