"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers with the same (tiny, random)
weights, fp32, CPU: logits of every prompt position, batched prefill then decode, and the
whole engine's greedy tokens (32) and prompt log-probabilities.

The variants cover what an MoE implementation gets wrong: top-1 and top-8 routing, with
and without renormalisation, many experts of which most get no token, a shared expert
with its sigmoid gate, dense layers among sparse ones (decoder_sparse_step,
mlp_only_layers), and every checkpoint naming of the expert matrices.
"""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import build_tiny_checkpoint

from archserve import LLM, SamplingParams
from archserve.loader.loader import load_model
from archserve.models.layers.moe import FusedMoE, SparseMoEBlock
from models.helpers import (
    PROMPTS,
    TEXT_PROMPTS,
    PagedSequences,
    assert_dummy_weights_run,
    assert_greedy_agrees_with_hf,
    assert_llm_greedy_and_prompt_logprobs_equal_hf,
    assert_prefill_then_decode_match_hf,
    assert_prompt_positions_match_hf,
    hf_last_logits,
    prompt_logprob_gaps,
    tiny_hf_model,
    variant_pair,
)

ATOL = RTOL = 1e-4
MOE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, tie_word_embeddings=False)

# Attention heads every GPU attention backend takes, so decode runs in CUDA graphs.
GRAPH_HEADS = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2)

VARIANTS = {
    # Mixtral: renormalised top-2 of 4.
    "mixtral_top2": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Top-1 of 64: most experts see no token in a prompt.
    "mixtral_top1_64_experts": ("mixtral", dict(num_local_experts=64, num_experts_per_tok=1,
                                                intermediate_size=24)),
    # Shared expert with its sigmoid gate; no renormalisation; layer 0 dense (sparse step 2).
    "qwen2_moe_shared_step2": ("qwen2_moe", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2,
        num_hidden_layers=2)),
    # Top-8 of 16, renormalised; layer 1 listed dense; q/k norms.
    "qwen3_moe_top8_mlp_only": ("qwen3_moe", dict(
        num_experts=16, num_experts_per_tok=8, moe_intermediate_size=24, norm_topk_prob=True,
        mlp_only_layers=[1], num_hidden_layers=3)),
    # Top-8 of 8 (every expert on every token), not renormalised.
    "qwen3_moe_top8_of_8_raw": ("qwen3_moe", dict(
        num_experts=8, num_experts_per_tok=8, moe_intermediate_size=24,
        norm_topk_prob=False)),
}



@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    return variant_pair(VARIANTS, request.param, MOE, tmp_path_factory.mktemp(request.param))


def test_sparse_and_dense_layers_follow_the_config(pair):
    name, hf_model, model, _ = pair
    ours = [any(isinstance(m, SparseMoEBlock) for m in layer.modules())
            for layer in model.model.layers]
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock")
              for layer in hf_model.model.layers]
    assert ours == theirs and any(ours)
    if name.startswith("qwen2"):
        assert ours == [False, True]
    for moe in model.moe_layers():
        assert moe.impl() is not None and moe.backend_name == "TORCH_MOE"  # CPU route


def test_routers_are_decode_gemm_shapes(pair):
    """The decode tuner times the routers' GEMMs (and Qwen2-MoE's shared-expert gate) as
    any other linear: each router weight is in the groups it tunes."""
    from archserve.engine.decode_gemms import linear_weights_by_shape
    from archserve.models.layers.moe import Router
    _, _, model, _ = pair
    grouped = {id(w) for weights in linear_weights_by_shape(model).values() for w in weights}
    routers = [m.weight for m in model.modules() if isinstance(m, Router)]
    assert routers and all(id(w) in grouped for w in routers)


def test_all_positions_of_a_prompt_match_hf(pair):
    _, hf_model, model, config = pair
    assert_prompt_positions_match_hf(model, hf_model, config, PROMPTS[0], ATOL)


def test_batched_prefill_then_decode_matches_hf(pair):
    _, hf_model, model, config = pair
    assert_prefill_then_decode_match_hf(model, hf_model, config, PROMPTS, ATOL)


def test_the_comparison_can_fail(pair):
    """Routing matters: with the renormalisation flipped (or, for top-k = E without it,
    the top-1 expert alone), the logits move away from transformers'."""
    _, hf_model, model, config = pair
    moes = model.moe_layers()
    saved = [(m.top_k, m.renormalize) for m in moes]
    for m in moes:
        if m.top_k == m.num_experts and not m.renormalize:
            m.top_k = 1
        else:
            m.renormalize = not m.renormalize
    try:
        changed = PagedSequences.for_config(config).run(model, {0: PROMPTS[0]})[0]
    finally:
        for m, (k, renorm) in zip(moes, saved, strict=True):
            m.top_k, m.renormalize = k, renorm
    assert (changed - hf_last_logits(hf_model, PROMPTS[0])).abs().max() > 1e-3


def test_most_of_64_experts_get_no_token():
    """The top-1-of-64 variant really leaves experts empty (the case it exists to test)."""
    model_type, overrides = VARIANTS["mixtral_top1_64_experts"]
    hf_model = tiny_hf_model(model_type, **{**MOE, **overrides})
    hidden = hf_model.model.embed_tokens(torch.tensor(PROMPTS[0]))
    router = hf_model.model.layers[0].mlp.gate
    with torch.no_grad():
        chosen = router(hidden)[2]
    assert 1 < chosen.unique().numel() < 32


# ---------------------------------------------------------------- checkpoint names

def _rename(state: dict[str, torch.Tensor], style: str) -> dict[str, torch.Tensor]:
    """transformers' per-expert Mixtral checkpoint in another naming: ``hf`` (mlp.experts.E.
    gate_proj/up_proj/down_proj) or ``stacked`` (transformers 5: experts.gate_up_proj
    [E, 2I, H] and experts.down_proj [E, H, I])."""
    import re
    per = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
    out, stacks = {}, {}
    for name, tensor in state.items():
        m = per.match(name)
        if not m:
            out[name.replace("block_sparse_moe", "mlp")] = tensor
            continue
        block, e, w = m[1], int(m[2]), m[3]
        if style == "hf":
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[w]
            out[f"{block}.mlp.experts.{e}.{proj}.weight"] = tensor
        else:
            stacks.setdefault(block, {})[(w, e)] = tensor
    for block, parts in stacks.items():
        experts = sorted({e for _, e in parts})
        out[f"{block}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts["w1", e], parts["w3", e]]) for e in experts])
        out[f"{block}.mlp.experts.down_proj"] = torch.stack([parts["w2", e] for e in experts])
    return out


@pytest.mark.parametrize("style", ["hf", "stacked"])
def test_mixtral_expert_namings_load_the_same_model(tmp_path, style):
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf_model = tiny_hf_model("mixtral", **{**MOE, **VARIANTS["mixtral_top2"][1]})
    hf_model.save_pretrained(tmp_path / "ref")
    with safe_open(str(tmp_path / "ref" / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in state)
    renamed = _rename(state, style)
    (tmp_path / style).mkdir()
    save_file({k: v.contiguous() for k, v in renamed.items()},
              str(tmp_path / style / "model.safetensors"))
    (tmp_path / style / "config.json").write_text(
        (tmp_path / "ref" / "config.json").read_text())
    model, config = load_model(str(tmp_path / style), dtype=torch.float32)
    logits = PagedSequences.for_config(config).run(model, {0: PROMPTS[0]})[0]
    torch.testing.assert_close(logits, hf_last_logits(hf_model, PROMPTS[0]),
                               atol=ATOL, rtol=RTOL)


def test_a_missing_expert_is_named(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    tiny_hf_model("qwen3_moe", **{**MOE, **VARIANTS["qwen3_moe_top8_of_8_raw"][1]}
                  ).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    with safe_open(path, "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, path)
    with pytest.raises(ValueError, match=r"missing: model\.layers\.1\.mlp\.experts\.5\.up_proj"):
        load_model(str(tmp_path), dtype=torch.float32)


def test_expert_matrices_are_views_of_the_stacked_kernel_weights(pair):
    _, hf_model, model, _ = pair
    moe: FusedMoE = model.moe_layers()[0]
    inter = moe.intermediate_size
    names = [n for n, _ in moe.named_parameters()]
    gate, up, down = (getattr(moe.get_submodule("1"), n).weight for n in
                      [n.split(".")[1] for n in names[3:6]])
    assert gate.data_ptr() == moe.w13[1, :inter].data_ptr()
    assert up.data_ptr() == moe.w13[1, inter:].data_ptr()
    assert down.data_ptr() == moe.w2[1].data_ptr()
    # Parameters count each expert matrix once: memory accounting sees the real total.
    assert sum(p.numel() for p in moe.parameters()) == moe.w13.numel() + moe.w2.numel()


def test_dummy_weights_fill_the_experts(tmp_path):
    model = assert_dummy_weights_run(
        tiny_hf_model("qwen2_moe", **{**MOE, **VARIANTS["qwen2_moe_shared_step2"][1]}),
        tmp_path)
    for moe in model.moe_layers():
        assert moe.w13.abs().max() > 0 and moe.w2.abs().max() > 0


# ---------------------------------------------------------------- the engine

NUM_TOKENS = 32


@pytest.mark.parametrize("variant", ["mixtral_top1_64_experts", "qwen2_moe_shared_step2",
                                     "qwen3_moe_top8_mlp_only"])
def test_llm_greedy_and_prompt_logprobs_equal_transformers(tmp_path, variant):
    model_type, overrides = VARIANTS[variant]
    path = build_tiny_checkpoint(str(tmp_path), model_type, **{**MOE, **overrides})
    assert_llm_greedy_and_prompt_logprobs_equal_hf(path, TEXT_PROMPTS, NUM_TOKENS)


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("variant", ["mixtral_top2", "qwen2_moe_shared_step2",
                                     "qwen3_moe_top8_mlp_only"])
def test_gpu_llm_greedy_equals_transformers(tmp_path, variant, enforce_eager):
    """The engine on the GPU runs the fused Triton MoE (decode inside CUDA graphs unless
    eager); in fp32 its greedy tokens are transformers' (on the CPU). Head size 64: below
    32 the attention route is one that reads host lengths, and graphs stay off."""
    from transformers import AutoModelForCausalLM

    model_type, overrides = VARIANTS[variant]
    path = build_tiny_checkpoint(str(tmp_path), model_type,
                                 **{**MOE, **overrides, **GRAPH_HEADS})
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", device="cuda", enforce_eager=enforce_eager)
    engine = llm.llm_engine
    assert {m.backend_name for m in engine.model.moe_layers()} == {"TRITON_FUSED_MOE"}
    assert bool(engine.report.graph_sizes) != enforce_eager
    tiles = [d for d in engine.report.decisions if d.what == "MoE tiles"]
    assert len(tiles) == (0 if enforce_eager else 1)    # tuned (or cached) for the graphs
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for out in llm.generate(TEXT_PROMPTS, params):
        assert_greedy_agrees_with_hf(hf_model, out.prompt_token_ids, list(out.outputs[0].token_ids), 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["mixtral_top2", "qwen3_moe_top8_mlp_only"])
def test_gpu_bf16_prompt_logprobs_are_close_to_transformers(tmp_path, variant):
    """bf16 on the GPU (Triton MoE) against transformers bf16 on the GPU: the prompt's
    log-probabilities agree to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    model_type, overrides = VARIANTS[variant]
    path = build_tiny_checkpoint(str(tmp_path), model_type, **{**MOE, **overrides})
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(path, dtype="bfloat16", device="cuda")
    diffs = prompt_logprob_gaps(hf_model, llm, TEXT_PROMPTS)
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02
