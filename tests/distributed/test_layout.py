"""How a model splits over ranks, and the start-up agreement, without processes."""

import pytest

from archserve.distributed.agreement import RankAgreement
from archserve.distributed.layout import (
    head_split_problem,
    layout_decision,
    layout_problems,
    split_heads,
    vocab_part,
)


def test_kv_heads_split_when_at_least_as_many_as_ranks():
    parts = [split_heads(8, 4, 2, r) for r in range(2)]
    assert [(p.num_heads, p.num_kv_heads, p.first_head, p.first_kv_head) for p in parts] == \
        [(4, 2, 0, 0), (4, 2, 4, 2)]
    assert all(p.kv_replicas == 1 for p in parts)


def test_kv_heads_replicated_on_the_ranks_whose_queries_read_them():
    # 8 query heads, 2 KV heads (4 queries per KV head), 4 ranks of 2 query heads each.
    parts = [split_heads(8, 2, 4, r) for r in range(4)]
    assert [p.first_kv_head for p in parts] == [0, 0, 1, 1]
    for p in parts:
        assert p.num_kv_heads == 1 and p.kv_replicas == 2
        # every query head of the rank reads the rank's KV head
        assert {h // 4 for h in range(p.first_head, p.first_head + p.num_heads)} == \
            {p.first_kv_head}


def test_impossible_layouts_say_why():
    assert "attention heads" in head_split_problem(6, 2, 4)
    assert "KV heads" in head_split_problem(12, 6, 4)
    assert "replicated" in head_split_problem(12, 4, 6)
    assert head_split_problem(12, 3, 6) is None           # each KV head on 2 ranks
    assert head_split_problem(16, 3, 2) is not None      # 3 KV heads over 2 ranks

    class Config:
        num_heads, num_kv_heads, intermediate_size = 4, 2, 96

    assert layout_problems(Config, 2) == []
    assert any("attention heads" in p for p in layout_problems(Config, 3))


def test_vocab_parts_cover_the_vocabulary_once():
    vocab, size = 385, 2
    parts = [vocab_part(vocab, size, r) for r in range(size)]
    assert parts[0] == (0, 193, 193) and parts[1] == (193, 192, 193)
    assert sum(rows for _, rows, _ in parts) == vocab


def test_a_rank_that_disagrees_stops_the_start_with_a_message():
    values = {"attention": ["TRITON_ATTN", "TORCH_SDPA"]}
    agree = RankAgreement(lambda value: values["attention"])
    with pytest.raises(ValueError, match="disagree on the attention backend.*rank 1: 'TORCH_SDPA'"):
        agree.same("the attention backend", "TRITON_ATTN")
    RankAgreement(lambda value: [value, value]).same("the attention backend", "X")
    assert RankAgreement(lambda value: [4096, 4000]).min(4096) == 4000


def test_explain_and_doctor_report_the_layout_and_refuse_impossible_ones():
    from archserve.platform import get_profile
    from archserve.routing.doctor import run_doctor
    from archserve.routing.explain import SelectionInputs, explain_model
    from archserve.routing.model_summary import ModelSummary

    h100 = get_profile("h100")
    model = ModelSummary("LlamaForCausalLM", head_size=128, num_heads=32, num_kv_heads=8,
                         intermediate_size=14336)
    two = explain_model(h100, model, inputs=SelectionInputs(tensor_parallel_size=2))
    layout = next(d for d in two.decisions if d.what == "tensor parallel")
    assert layout.chosen == "2 ranks, nccl, mp executor" and "rank 1: query heads 16..31" in \
        layout.reason and two.not_loadable is None
    three = explain_model(h100, model, inputs=SelectionInputs(tensor_parallel_size=3))
    assert "32 attention heads do not split over 3" in three.not_loadable

    report = run_doctor(h100, tensor_parallel_size=4, model=model, num_devices=2)
    assert any("needs 4 GPUs, this machine has 2" in b for b in report.blockers)
    assert not report.can_run
    fits = run_doctor(h100, tensor_parallel_size=2, model=model, num_devices=2)
    assert not any("tensor parallel" in b for b in fits.blockers)
    assert any(d.what == "tensor parallel" for d in fits.decisions)


def test_a_moe_model_splits_when_its_expert_channels_do():
    from transformers import MixtralConfig, Qwen2MoeConfig

    from archserve.models.config import ModelConfig
    from archserve.routing.model_summary import summary_from_hf_config

    hf = MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                       num_key_value_heads=2, num_local_experts=4, num_hidden_layers=1,
                       architectures=["MixtralForCausalLM"])
    for config in (ModelConfig.from_hf_config(hf), summary_from_hf_config(hf.to_dict())):
        assert layout_problems(config, 2) == []
    # Qwen2-MoE: 24 expert channels split 2 ways, not 16; its 36-wide shared expert does
    # not split 8 ways either.
    hf = Qwen2MoeConfig(hidden_size=64, intermediate_size=96, num_attention_heads=16,
                        num_key_value_heads=16, num_experts=4, moe_intermediate_size=24,
                        shared_expert_intermediate_size=36, num_hidden_layers=1,
                        architectures=["Qwen2MoeForCausalLM"])
    for config in (ModelConfig.from_hf_config(hf), summary_from_hf_config(hf.to_dict())):
        assert layout_problems(config, 2) == []
        assert any("intermediate size 24" in p for p in layout_problems(config, 16))
    # The shared expert's 36 channels do not split 8 ways: the engine's config and the
    # summary explain and doctor read say so alike.
    for config in (ModelConfig.from_hf_config(hf), summary_from_hf_config(hf.to_dict())):
        problems = layout_problems(config, 8)
        assert any("shared expert intermediate size 36" in p for p in problems), problems
    # What each rank holds says which channels of every expert.
    reason = layout_decision(ModelConfig.from_hf_config(hf), 2, "cuda").reason
    assert "channels 12..23 of each of the 4 experts" in reason, reason


def test_explain_shows_a_moe_and_an_mla_layout_and_refuses_what_doctor_blocks():
    """explain splits MoE and MLA models as the engine and doctor do: their layout at two
    ranks, and a refusal where the experts' channels do not split."""
    from transformers import DeepseekV2Config, Qwen2MoeConfig

    from archserve.platform import get_profile
    from archserve.routing.explain import SelectionInputs, explain_model
    from archserve.routing.model_summary import summary_from_hf_config

    h200 = get_profile("h200")
    moe = summary_from_hf_config(Qwen2MoeConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=16, num_key_value_heads=16,
        num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=32,
        num_hidden_layers=1, architectures=["Qwen2MoeForCausalLM"]).to_dict())
    two = explain_model(h200, moe, inputs=SelectionInputs(tensor_parallel_size=2))
    layout = next(d for d in two.decisions if d.what == "tensor parallel")
    assert "channels 12..23 of each of the 4 experts" in layout.reason
    sixteen = explain_model(h200, moe, inputs=SelectionInputs(tensor_parallel_size=16))
    assert "24 does not split over 16" in (sixteen.not_loadable or "")
    mla = summary_from_hf_config(DeepseekV2Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        num_hidden_layers=1, architectures=["DeepseekV2ForCausalLM"]).to_dict())
    two = explain_model(h200, mla, inputs=SelectionInputs(tensor_parallel_size=2))
    layout = next(d for d in two.decisions if d.what == "tensor parallel")
    assert "whole MLA latent cache" in layout.reason


def test_the_70b_shape_takes_one_kv_head_per_rank_at_8_and_refuses_what_cannot_split():
    import json
    from pathlib import Path

    from archserve.platform import get_profile
    from archserve.routing.doctor import run_doctor
    from archserve.routing.explain import SelectionInputs, explain_model
    from archserve.routing.model_summary import ModelSummary, summary_from_hf_config

    shape = Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "llama-3-70b"
    model = summary_from_hf_config(json.loads((shape / "config.json").read_text()))
    assert (model.num_heads, model.num_kv_heads) == (64, 8)
    parts = [split_heads(64, 8, 8, r) for r in range(8)]
    assert [(p.num_heads, p.num_kv_heads, p.kv_replicas) for p in parts] == [(8, 1, 1)] * 8
    assert [p.first_kv_head for p in parts] == list(range(8))
    assert layout_problems(model, 8, "cuda", 8) == []

    h200 = get_profile("h200")
    eight = explain_model(h200, model, inputs=SelectionInputs(tensor_parallel_size=8))
    layout = next(d for d in eight.decisions if d.what == "tensor parallel")
    assert layout.chosen == "8 ranks, nccl, mp executor" and eight.not_loadable is None
    assert "rank 7: query heads 56..63, KV heads 7..7, MLP columns 25088..28671" in \
        layout.reason
    assert not any("tensor parallel" in b for b in run_doctor(
        h200, tensor_parallel_size=8, model=model, num_devices=8).blockers)
    short = run_doctor(h200, tensor_parallel_size=8, model=model, num_devices=4)
    assert any("needs 8 GPUs, this machine has 4" in b for b in short.blockers)
    assert not short.can_run

    # 28 query / 4 KV heads (Qwen2.5-7B's) split over 4 ranks, not over 8.
    odd = ModelSummary("Qwen2ForCausalLM", head_size=128, num_heads=28, num_kv_heads=4,
                       intermediate_size=18944)
    assert explain_model(h200, odd, inputs=SelectionInputs(tensor_parallel_size=4)
                         ).not_loadable is None
    refused = explain_model(h200, odd, inputs=SelectionInputs(tensor_parallel_size=8))
    assert "28 attention heads do not split over 8" in refused.not_loadable
    assert any("28 attention heads" in b for b in run_doctor(
        h200, tensor_parallel_size=8, model=odd, num_devices=8).blockers)


def test_a_ranks_step_weights_are_its_shard(tiny_checkpoint):
    import torch

    from archserve.distributed.layout import rank_model_config
    from archserve.distributed.parallel_state import TensorParallelGroup, tensor_parallel
    from archserve.engine.step_weights import step_weights
    from archserve.loader.loader import load_model

    path = tiny_checkpoint("llama-8q4kv")      # 8 query / 4 KV heads: nothing replicated
    whole_model, mc = load_model(path, dtype=torch.float32, load_format="dummy")
    whole = step_weights(whole_model, mc)
    with tensor_parallel(TensorParallelGroup(rank=3, size=4)):
        shard_model, _ = load_model(path, dtype=torch.float32, load_format="dummy")
    shard = step_weights(shard_model, rank_model_config(mc, 4, 3))
    norms = mc.hidden_size * (2 * mc.num_layers + 1)      # every rank holds them whole
    assert shard.body_params == (whole.body_params - norms) // 4 + norms
    assert shard.body_bytes == 4 * shard.body_params     # float32; no embedding rows
    assert mc.vocab_size % 4 == 0 and shard.lm_head_params == whole.lm_head_params // 4


def test_the_readmes_tensor_parallel_example_splits_the_embedded_model(embedded_model_path):
    """The README's example runs the embedded model (9 query heads, 3 KV heads) at a size
    it splits over; 2, what users try first, is refused with the reason."""
    import json
    import os
    import re

    from typer.testing import CliRunner

    from archserve.cli.main import app
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    section = readme.split("## Several GPUs")[1].split("\n## ")[0]
    command = re.search(r"```bash\n(archserve generate .*-tp (\d+).*)\n```", section)
    assert command is not None and "-m " not in command[1], section
    size = command[2]
    ok = json.loads(CliRunner().invoke(app, ["explain", "-tp", size, "--json"]).output)
    assert ok["not_loadable"] is None
    two = json.loads(CliRunner().invoke(app, ["explain", "-tp", "2", "--json"]).output)
    assert "9 attention heads do not split over 2" in two["not_loadable"]
