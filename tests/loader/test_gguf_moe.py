"""GGUF MoE files (Mixtral as llama.cpp's "llama" with experts, qwen2moe with its shared
expert, qwen3moe), written here the way llama.cpp's converter writes them, from a tiny
transformers model: archserve's logits equal that model's. Routed experts in F32, F16 and
Q8_0; the experts are dequantized at load (no MoE kernel reads GGUF blocks), and start-up
and ``explain`` say so.
"""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from models.helpers import (
    PagedSequences,
    assert_greedy_outputs_track,
    assert_prompt_positions_match_hf,
)
from tiny_checkpoints import build_tiny_checkpoint, write_tiny_gguf
from transformers import AutoModelForCausalLM

from archserve.loader.loader import load_model
from archserve.models.layers.forward_context import ForwardContext, set_forward_context
from archserve.platform import get_profile
from archserve.routing.explain import explain_model
from archserve.routing.model_summary import summary_from_gguf

PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 9, 120]
SIZES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, tie_word_embeddings=False)
VARIANTS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=96, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
}
# Q8_0 stores each group of 32 as int8 times an fp16 scale: a weight moves by at most
# half a step (|w|max/254 of its group), which moves these logits by well under 0.01.
Q8_0_LOGITS_ATOL = 0.02


_BUILT: dict[str, tuple] = {}


def _built(model_type: str, tmp_path_factory) -> tuple:
    """(hf_dir, the transformers model, a folder for GGUF files), built once per module."""
    if model_type not in _BUILT:
        root = tmp_path_factory.mktemp(model_type)
        hf_dir = build_tiny_checkpoint(str(root / "hf"), model_type,
                                       **{**SIZES, **VARIANTS[model_type]})
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        _BUILT[model_type] = hf_dir, hf_model, root
    return _BUILT[model_type]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return request.param, *_built(request.param, tmp_path_factory)


def _expert_types(path: str) -> set[str]:
    return {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if "_exps." in t.name}


@pytest.mark.parametrize("expert_type", [None, "F16"])
def test_unquantized_experts_equal_transformers(checkpoint, expert_type):
    model_type, hf_dir, hf_model, root = checkpoint
    path = write_tiny_gguf(hf_dir, str(root / f"{expert_type}.gguf"), expert_type=expert_type)
    assert _expert_types(path) == {expert_type or "F32"}
    model, config = load_model(path, dtype=torch.float32)
    assert type(model).__name__.lower().startswith(model_type.replace("_", ""))
    if expert_type == "F16":     # the file holds the experts rounded to fp16
        hf_model = copy.deepcopy(hf_model)
        with torch.no_grad():
            for name, param in hf_model.named_parameters():
                if ".experts." in name:
                    param.copy_(param.half().float())
    assert_prompt_positions_match_hf(model, hf_model, config, PROMPT, tol=1e-4)


def test_q8_0_experts_are_dequantized_at_load(checkpoint, monkeypatch):
    model_type, hf_dir, hf_model, root = checkpoint
    path = write_tiny_gguf(hf_dir, str(root / "q8_0.gguf"), expert_type="Q8_0")
    assert _expert_types(path) == {"Q8_0"}
    # The experts as loaded, without the norm before them folded in (norm_folding.py).
    monkeypatch.setenv("ARCHSERVE_DISABLE_FUSIONS", "fold_norm_weights")
    model, config = load_model(path, dtype=torch.float32)
    # Each expert holds exactly the Q8_0 round trip of transformers' weight ...
    ours = model.moe_layers()[0]
    theirs = hf_model.model.layers[0].mlp.experts
    gate_up = theirs.gate_up_proj.detach().numpy()
    q8 = gguf.GGMLQuantizationType.Q8_0
    round_trip = gguf.quants.dequantize(gguf.quants.quantize(gate_up, q8), q8)
    torch.testing.assert_close(ours.w13, torch.from_numpy(round_trip), rtol=0, atol=0)
    assert not torch.equal(ours.w13, theirs.gate_up_proj)
    # ... and the model's logits stay within Q8_0's error of the original.
    assert_prompt_positions_match_hf(model, hf_model, config, PROMPT, tol=Q8_0_LOGITS_ATOL)


def test_engine_and_explain_say_the_experts_are_dequantized(tmp_path_factory):
    """One engine run, on qwen2_moe (its shared expert's path too)."""
    from archserve import LLM, SamplingParams

    hf_dir, _, root = _built("qwen2_moe", tmp_path_factory)
    path = write_tiny_gguf(hf_dir, str(root / "engine.gguf"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # float32: the file's dequantized experts must give the checkpoint's tokens exactly
    engine = LLM(path, max_model_len=64, dtype="float32")
    decisions = {d.requested: d for d in engine.llm_engine.report.decisions}
    assert decisions["gguf experts"].chosen == "dense float32"
    from_gguf = engine.generate(["Hello world! The capital of France"], params)[0]
    from_hf = LLM(hf_dir, max_model_len=64, dtype="float32").generate(["Hello world! The capital of France"],
                                                      params)[0]
    assert from_gguf.outputs[0].token_ids == from_hf.outputs[0].token_ids
    # explain, from the file's metadata alone, on a GPU profile: the linears stay GGUF
    # blocks, the experts take the 16-bit MoE route.
    summary = summary_from_gguf(path)
    assert summary.architecture == "qwen2_moe" and summary.num_experts == 4
    out = explain_model(get_profile("h200"), summary)
    assert out.not_loadable is None
    moe = next(r for r in out.routes if r.layer == "moe experts")
    assert moe.backend == "TRITON_FUSED_MOE"
    assert any(d.requested == "gguf experts" for d in out.decisions)


def test_mixtral_gguf_reads_as_mixtral(tmp_path_factory):
    """llama.cpp writes Mixtral as "llama" + expert_count; transformers reads a dense Llama."""
    hf_dir, _, root = _built("mixtral", tmp_path_factory)
    path = write_tiny_gguf(hf_dir, str(root / "arch.gguf"))
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "llama"
    assert summary_from_gguf(path).architecture == "mixtral"


def test_an_unsupported_gguf_moe_architecture_is_refused_by_name(tmp_path):
    """A GGUF MoE family archserve has no model for (OLMoE) is refused by explain with the
    architecture's name, before any tensor is read."""
    path = str(tmp_path / "olmoe.gguf")
    writer = gguf.GGUFWriter(path, "olmoe")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = explain_model(get_profile("cpu"), summary_from_gguf(path))
    assert out.not_loadable and "'olmoe' is not supported" in out.not_loadable


def test_kept_quantized_linears_with_dequantized_experts(tmp_path_factory):
    """The GPU's load (GGUF linears kept as integer groups) on the CPU: the shared expert and
    attention stay Q8_0 blocks, the routed experts are dense, logits equal the dense load."""
    from archserve.engine.decode_gemms import install_quantized_kernels
    from archserve.quant.config import gguf_quant_config
    from archserve.quant.linear_state import quantized_layers
    from archserve.quant.plan import plan_quantization

    hf_dir, _, root = _built("qwen2_moe", tmp_path_factory)
    path = write_tiny_gguf(hf_dir, str(root / "all-q8_0.gguf"), expert_type="Q8_0",
                           linear_types=lambda name: "Q8_0")
    kept, config = load_model(path, dtype=torch.float32, quantization=gguf_quant_config())
    layers = dict(quantized_layers(kept))
    assert "model.layers.0.mlp.shared_expert.down_proj" in layers
    assert all(m.quantized is None and m.w13.dtype == torch.float32 for m in kept.moe_layers())
    install_quantized_kernels(get_profile("cpu"), kept,
                              plan_quantization(get_profile("cpu"), gguf_quant_config(),
                                                torch.float32))
    dense, _ = load_model(path, dtype=torch.float32)
    torch.testing.assert_close(kept.moe_layers()[1].w2, dense.moe_layers()[1].w2, rtol=0, atol=0)
    logits = []
    for model in (kept, dense):
        cache = PagedSequences.for_config(config)
        ids, positions, meta, _ = cache.step({0: PROMPT})
        with set_forward_context(ForwardContext(meta, cache.kv_caches, cache.attn_impl)):
            logits.append(model.compute_logits(model(ids, positions)))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gguf_moe_runs_on_the_gpu(tmp_path_factory):
    """Q8_0 linears kept quantized (TRITON_WEIGHT_ONLY), Q8_0 experts dequantized to fp16
    (TRITON_FUSED_MOE): the greedy tokens follow the fp32 CPU run, log-probs close."""
    from archserve import LLM, SamplingParams

    hf_dir, _, root = _built("qwen2_moe", tmp_path_factory)
    path = write_tiny_gguf(hf_dir, str(root / "gpu-q8_0.gguf"), expert_type="Q8_0",
                           linear_types=lambda name: "Q8_0")
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
    prompts = ["Hello world! The capital of France", "A paged KV cache"]
    gpu = LLM(path, dtype="float16", device="cuda", max_model_len=128)
    routes = {r.layer: r.backend for r in gpu.llm_engine.report.routes}
    assert routes["linear (qkv, o, mlp)"] == "TRITON_WEIGHT_ONLY", routes
    assert routes["moe experts"] == "TRITON_FUSED_MOE", routes
    decisions = {d.requested: d.chosen for d in gpu.llm_engine.report.decisions}
    assert decisions["gguf experts"] == "dense float16"
    got = gpu.generate(prompts, params)
    del gpu
    want = LLM(path, dtype="float32", device="cpu", max_model_len=128).generate(prompts, params)
    assert_greedy_outputs_track(got, want)
