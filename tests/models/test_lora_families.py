"""LoRA adapters on every supported family against transformers + peft (fp32, CPU): Qwen2
(q/k/v biases), Qwen3 (q/k norms), Gemma 3 (its norms are not folded, GeGLU), Qwen2-MoE
(attention and the shared expert), Mixtral (attention), DeepSeek-V2-Lite (MLA's
projections). Adapters on what takes none (MoE experts, shared experts stacked with the
routed ones, the router, MLA's kv_b_proj) are refused with the reason.
"""

from __future__ import annotations

import pytest
from lora_adapters import (
    ALL_LINEARS,
    greedy_reference,
    lora_pair,
    peft_model,
    save_peft_adapter,
    write_adapter,
)
from tiny_checkpoints import TINY_V2_LITE, build_tiny_checkpoint

from archserve import LLM, LoRARequest, SamplingParams

PROMPTS = ["Hello world! How are you", "1 2 3 4 5 6 7"]
NUM_TOKENS = 12
GEMMA3 = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=96, sliding_window=8,
              query_pre_attn_scalar=16, tie_word_embeddings=False,
              layer_types=["sliding_attention", "full_attention"])
QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, tie_word_embeddings=False)
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
# peft maps gate/up/down_proj targets of a transformers-5 MoE model onto its stacked
# experts (target_parameters, refused below), so the MoE families' adapters name the
# dense modules they adapt.
QWEN2_MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj",
                     "shared_expert.up_proj", "shared_expert.down_proj"]
DEEPSEEK_TARGETS = ["q_proj", "kv_a_proj_with_mqa", "o_proj"]

FAMILIES = {
    "qwen2": ("qwen2", dict(tie_word_embeddings=False), ALL_LINEARS),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False), ALL_LINEARS),
    "gemma3": ("gemma3_text", GEMMA3, ALL_LINEARS),
    "qwen2_moe": ("qwen2_moe", QWEN2_MOE, QWEN2_MOE_TARGETS),
    "mixtral": ("mixtral", MIXTRAL, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "deepseek_v2_lite": ("deepseek_v2", TINY_V2_LITE, DEEPSEEK_TARGETS),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in cache:
            model_type, overrides, _ = FAMILIES[family]
            cache[family] = build_tiny_checkpoint(str(tmp_path_factory.mktemp(family)),
                                                  model_type, **overrides)
        return cache[family]

    return make


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_greedy_and_logprobs_match_transformers_peft(checkpoints, tmp_path, family):
    base = checkpoints(family)
    adapter = save_peft_adapter(base, str(tmp_path / "adapter"), FAMILIES[family][2], r=8,
                                lora_alpha=16, seed=7, scale=0.2)
    # float32: compared with transformers + peft in float32 to 1e-4 of a log-prob.
    llm = LLM(base, enable_lora=True, max_lora_rank=8, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logprobs=3)
    outputs = llm.generate(PROMPTS, params, lora_request=LoRARequest("a", 1, adapter))
    base_tokens = llm.generate(PROMPTS, params)
    reference = peft_model(base, adapter)
    tokenizer = llm.get_tokenizer()
    changed = False
    for out, plain in zip(outputs, base_tokens, strict=True):
        tokens, logprobs = greedy_reference(reference, tokenizer.encode(out.prompt), NUM_TOKENS)
        assert out.outputs[0].token_ids == tokens, out.prompt
        for step, entry in enumerate(out.outputs[0].logprobs):
            token = tokens[step]
            assert abs(entry[token].logprob - logprobs[step][token].item()) < 1e-4
        changed |= out.outputs[0].token_ids != plain.outputs[0].token_ids
    assert changed     # the adapter changes what the model says


def _adapter_on(base: str, path: str, targets) -> str:
    return save_peft_adapter(base, path, targets, r=4, lora_alpha=8)


@pytest.mark.parametrize("family, targets, reason", [
    ("deepseek_v2_lite", ["kv_b_proj"], "read by its layer itself"),
    ("qwen2_moe", ["shared_expert_gate"], "the MoE router takes no LoRA"),
    ("deepseek_v2_lite", ALL_LINEARS, "MoE experts take no LoRA adapters"),
])
def test_modules_that_take_no_adapter_are_refused_with_the_reason(checkpoints, tmp_path,
                                                                  family, targets, reason):
    base = checkpoints(family)
    llm = LLM(base, enable_lora=True, max_lora_rank=8)
    request = LoRARequest("x", 1, _adapter_on(base, str(tmp_path / "x"), targets))
    with pytest.raises(ValueError, match=reason):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), lora_request=request)


@pytest.mark.parametrize("family, module, shape, reason", [
    # As a per-expert adapter names an expert's matrix.
    ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w1", (64, 96),
     "MoE experts take no LoRA adapters"),
    # peft does not make these: written by hand.
    ("deepseek_v2_lite", "model.layers.1.mlp.shared_experts.gate_proj", (64, 32),
     "stacked with the routed ones"),
])
def test_expert_matrices_are_refused(checkpoints, tmp_path, family, module, shape, reason):
    path = write_adapter(tmp_path / "experts", lora_pair(module, 4, *shape), {})
    llm = LLM(checkpoints(family), enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=reason):
        llm.llm_engine.add_lora(LoRARequest("experts", 1, path))
