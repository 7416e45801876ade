"""A tiny gpt-oss in OpenAI's MXFP4 checkpoint form (transformers 5.25, offline, CPU).

    python scripts/quant_fixtures/gpt_oss_mxfp4.py tests/fixtures/quant/gpt-oss-mxfp4

The base: a random GptOssForCausalLM (2 layers, sliding and full; hidden 128; 4 query heads
of 32, 2 KV heads, a 16-token window; 4 experts of width 64, top-2; YaRN; every bias, sink
and norm non-trivial) with the vocabulary-384 BPE tokenizer of tests/tiny_checkpoints.py.
Then, as OpenAI's release is laid out: each layer's experts quantized to MXFP4 (e2m1
values, one e8m0 scale per 32 input channels, by archserve's ``quantize_mxfp4``: the scale
is the power of two at or above amax / 6, values rounded to nearest, ties to even, as the
triton_kernels converter OpenAI used) and written untransposed, gate and up rows
interleaved, as ``mlp.experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] and
``_scales`` uint8 [E, 2I, H/32] (down: [E, H, I/32, 16] / [E, H, I/32]); the expert biases,
router, attention (sinks included), norms and embeddings stay bf16; config.json carries
``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`` as the
release's does.

Check (``--check``): transformers loads the files with ``Mxfp4Config(dequantize=True)`` (its
own MXFP4 decoder, on CPU) and its dequantized experts equal the bf16 model's quantized
ones; a short greedy generate runs.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base_model  # noqa: E402

REPO = base_model.REPO
sys.path.insert(0, REPO)
from archserve.kernels.linear.quantized_weights import (  # noqa: E402
    dequantize_mxfp4,
    quantize_mxfp4,
)

SIZES = dict(hidden_size=128, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=16, max_position_embeddings=1024,
             tie_word_embeddings=False,
             rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 32,
                              "rope_theta": 150000.0})
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                 "model.embed_tokens", "lm_head"]


def build_base(path: str, seed: int = 0) -> str:
    from transformers import GptOssConfig, GptOssForCausalLM

    return base_model.save_random_model(path, GptOssConfig, GptOssForCausalLM, SIZES,
                                        _init_weights, seed)


def _init_weights(model, gen: torch.Generator) -> None:
    base_model._init_llama(model, gen)        # linears N(0, 1/fan_in), norms near 1, biases
    for name, param in model.named_parameters():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            fan_in = param.shape[1]           # stored [E, K, N]
            param.copy_(torch.randn(param.shape, generator=gen) / fan_in ** 0.5)
        elif name.endswith("sinks"):
            param.copy_(torch.randn(param.shape, generator=gen))


def _mxfp4_tensors(prefix: str, stored: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' stacked [E, K, N] expert matrix -> OpenAI's ``_blocks`` [E, N, K/32, 16]
    and ``_scales`` [E, N, K/32] (gate/up's N rows interleaved as transformers keeps them)."""
    w = quantize_mxfp4(stored.float().transpose(1, 2))
    e, n, k_half = w.blocks.shape
    return {f"{prefix}_blocks": w.blocks.reshape(e, n, k_half // 16, 16).contiguous(),
            f"{prefix}_scales": w.scales.contiguous()}


def quantize(base: str, out: str) -> str:
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(base, "model.safetensors"))
    tensors = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors.update(_mxfp4_tensors(name, t))
        else:
            tensors[name] = t
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for extra in os.listdir(base):
        if extra != "model.safetensors":
            with open(os.path.join(base, extra), "rb") as src, \
                    open(os.path.join(out, extra), "wb") as dst:
                dst.write(src.read())
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"modules_to_not_convert": NOT_CONVERTED,
                                     "quant_method": "mxfp4"}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return out


def check(base: str, out: str) -> None:
    """transformers' own MXFP4 decoder reads the experts written here."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)).eval()
    state = load_file(os.path.join(base, "model.safetensors"))
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            expected = dequantize_mxfp4(quantize_mxfp4(state[name].float().transpose(1, 2)))
            assert torch.equal(param.detach(), expected.transpose(1, 2)), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("Hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=8, do_sample=False)
    print(f"gpt-oss-mxfp4: transformers dequantizes it; greedy {generated[0].tolist()}")


def main() -> None:
    import tempfile

    out = sys.argv[1]
    with tempfile.TemporaryDirectory() as work:
        base = build_base(os.path.join(work, "base"))
        quantize(base, out)
        if "--check" in sys.argv:
            check(base, out)
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    print(f"gpt-oss-mxfp4: {out} ({size // 1024} KB)")


if __name__ == "__main__":
    main()
