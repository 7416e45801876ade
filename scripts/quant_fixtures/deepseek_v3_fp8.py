"""A tiny block-FP8 DeepSeek-V3 (MLA + routed and shared experts), in DeepSeek-V3's own
checkpoint layout (run in the llm-compressor venv: transformers 5.17).

    python deepseek_v3_fp8.py tests/fixtures/quant/hf-deepseek-v3-fp8-block

The base: a random DeepseekV3ForCausalLM (2 layers, the first dense; hidden 128; 2 heads of
MLA with q LoRA 128, latent 256 + rope 64 (a latent size TRITON_MLA takes) and nope/v
heads of 64; 8 routed experts of width 128, sigmoid top-2 within the best of 2 groups, one
shared expert), the vocabulary-384 BPE tokenizer of tests/tiny_checkpoints.py, tied
embeddings to stay under 1 MB. Then ``fp8_block_hf.write`` quantizes every projection as
DeepSeek-V3's release does: q_a/q_b/kv_a_proj_with_mqa/kv_b_proj/o_proj, dense, shared and
routed gate/up/down to e4m3 with fp32 ``weight_scale_inv`` per 128x128 block; the router
``gate`` (and its e_score_correction_bias), norms and embeddings stay bf16.
kv_a_proj_with_mqa has 320 rows: its last row block is partial (scales are ceil(N/128)),
as in the real V3 (576 rows).

The reference (references/NAME.safetensors, as reference_logits.py writes them): transformers
5.17 cannot dequantize a partial block (its Fp8Dequantize raises "Weight shape (320, 128) not
divisible by scale grid (3, 1)"; so it cannot load the real V3 on a CPU either), so the
weights are dequantized by ``fp8_block_hf.dequantize_block`` (equal to transformers' own
where it runs, see README) into a float32 copy that transformers loads as a plain
DeepseekV3ForCausalLM; one float32 forward, activations not quantized.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base_model  # noqa: E402
import fp8_block_hf  # noqa: E402
import moe_fixtures  # noqa: E402
import reference_logits  # noqa: E402

SIZES = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
             num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
             num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=256, qk_rope_head_dim=64,
             head_dim=64, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8,
             num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
             routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=256,
             tie_word_embeddings=True)
LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
           "gate_proj", "up_proj", "down_proj")


def build_base(path: str, seed: int = 0) -> str:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return base_model.save_random_model(path, DeepseekV3Config, DeepseekV3ForCausalLM, SIZES,
                                        _init_weights, seed)


def _init_weights(model, gen: torch.Generator) -> None:
    # Embeddings tied to the lm_head: N(0, 1/hidden) keeps the logits' spread near the
    # Llama fixtures' (std ~1.2), so fp8 activations move log-probs alike.
    moe_fixtures.init_moe_weights(model, gen, embed_divisor=SIZES["hidden_size"] ** 0.5)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)


def dequantized_copy(fixture: str, out: str) -> str:
    """The fixture with every fp8 weight times its block scales, float32, no quantization."""
    state = load_file(os.path.join(fixture, "model.safetensors"))
    dense = {}
    for name, t in state.items():
        if name.endswith("_scale_inv"):
            continue
        scale = state.get(name + "_scale_inv")
        dense[name] = (t.float() if scale is None
                       else fp8_block_hf.dequantize_block(t, scale, 128, 128)).contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(dense, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fixture, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    config["dtype"] = "float32"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    for extra in os.listdir(fixture):
        if extra.startswith("tokenizer") or extra == "chat_template.jinja":
            shutil.copy(os.path.join(fixture, extra), os.path.join(out, extra))
    return out


def write_reference(fixture: str, dense: str) -> str:
    ids = reference_logits.input_ids(fixture)
    model = reference_logits._hf_load(dense)
    meta = {"tool": reference_logits._versions("transformers", "torch"),
            "loader": "fp8_block_hf.dequantize_block of every fp8 weight -> float32 copy; "
                      "AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32)",
            "dtype": "float32 (weights dequantized to float32, float32 compute)",
            "backend": f"plain {type(model).__name__}: nn.Linear matmuls, stacked experts",
            "activations": "not quantized"}
    logits = reference_logits._forward(model, ids, meta)
    root = os.path.dirname(os.path.abspath(fixture))
    name = os.path.basename(os.path.abspath(fixture))
    path = os.path.join(root, reference_logits.REFERENCES, f"{name}.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    reference_logits.save(path, ids, logits, meta)
    text = base_model.smoke_generate(model, AutoTokenizer.from_pretrained(dense))
    return f"reference logits written; dequantized copy generates {text!r}"


def main(argv) -> int:
    out = argv[0]
    name = os.path.basename(out.rstrip("/"))
    with tempfile.TemporaryDirectory() as work:
        base = build_base(os.path.join(work, "base"))
        fp8_block_hf.write(base, out, linears=LINEARS)
        print(f"{name}: saved")
        try:
            print(f"{name}: {write_reference(out, dequantized_copy(out, work + '/dense'))}")
        except Exception as exc:
            print(f"{name}: reference FAILED: {type(exc).__name__}: {exc}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
