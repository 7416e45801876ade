"""Every loadable format, end to end on CPU: a real checkpoint made by the real tool loads,
generates, and agrees with that tool's own loader.

The fixtures and their reference logits come from scripts/quant_fixtures (llm-compressor,
GPTQModel, a block-FP8 writer; the references are the tools' own forward passes, saved so
CI needs no quantizer). archserve's prompt logprobs at the same token ids are compared with
the reference's log-softmax: top-1 agreement and mean |delta logprob| of the true tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
from models.helpers import without_activation_quantization
from safetensors import safe_open

from archserve import LLM, SamplingParams

ROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant")
FIXTURES = sorted(n for n in os.listdir(ROOT)
                  if os.path.isfile(os.path.join(ROOT, "references", f"{n}.safetensors")))
# (mean |delta logprob|, top-1 agreement) each fixture must reach; the default is for a
# float32 reference computing what archserve computes.
BOUNDS = {
    # GPTQModel's CPU kernels compute in bf16; the base model alone moves by ~0.1 in its
    # logits between bf16 and float32.
    "gptq-w4-g128-sym": (0.05, 0.95), "gptq-w4-g32-asym-actorder": (0.05, 0.95),
    "gptq-w8-g128": (0.05, 0.95), "awq-w4-g64": (0.05, 0.95),
    # llm-compressor scales dynamic int8 activations by absmax / 127.5 and clips the
    # largest; vLLM (and archserve) by absmax / 127. On this model's outlier channels the
    # two differ by as much as int8 quantization itself (both ~0.06 from the bf16 base).
    "ct-int8-w8a8": (0.08, 0.8),
    # transformers on a CPU dequantizes block-FP8 weights and leaves activations 16-bit;
    # archserve quantizes them per 128-group as the checkpoint's scheme says (vLLM does).
    # The weights themselves are checked exactly in test_block_fp8_weights_match_exactly.
    "hf-fp8-block": (0.12, 0.75),
    # Tiny Qwen3-MoE (scripts/quant_fixtures/moe_fixtures.py). transformers 5.17 loads the
    # routed experts into its stacked (non-Linear) experts dequantized, so they run
    # weight-only there; archserve quantizes their activations as the scheme says. The
    # W4A16 one is weight-only on both sides: a random model's near-ties cost top-1.
    "ct-moe-fp8-block": (0.06, 0.85), "ct-moe-fp8-dynamic": (0.06, 0.85),
    "ct-moe-w4a16": (0.02, 0.9),
    # Tiny block-FP8 DeepSeek-V3 (scripts/quant_fixtures/deepseek_v3_fp8.py): MLA, routed
    # and shared experts, kv_b_proj dequantized at load. The reference is weight-only (the
    # weights dequantized, activations 16-bit); measured 0.131 / 0.84, nearly all of it the
    # dense projections' fp8 activations (0.022 with those off).
    "hf-deepseek-v3-fp8-block": (0.18, 0.75),
}


def reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    with safe_open(os.path.join(ROOT, "references", f"{name}.safetensors"), "pt") as f:
        return f.get_tensor("input_ids"), f.get_tensor("logits")


def compare(llm: LLM, name: str) -> tuple[float, float]:
    """(mean |delta logprob| of the prompt tokens, top-1 agreement) against the reference."""
    ids, logits = reference(name)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": row.tolist()} for row in ids], params)
    deltas, agree, total = [], 0, 0
    ref_logprobs = torch.log_softmax(logits.double(), dim=-1)
    for row, (out, token_ids) in enumerate(zip(outs, ids, strict=True)):
        for pos in range(1, token_ids.shape[0]):
            entry = out.prompt_logprobs[pos]
            token = int(token_ids[pos])
            deltas.append(abs(entry[token].logprob - float(ref_logprobs[row, pos - 1, token])))
            ours_top = max(entry.items(), key=lambda kv: kv[1].logprob)[0]
            theirs_top = int(ref_logprobs[row, pos - 1].argmax())
            ranked_first = [t for t, lp in entry.items() if lp.rank == 1]
            agree += int((ranked_first[0] if ranked_first else ours_top) == theirs_top)
            total += 1
    return sum(deltas) / len(deltas), agree / total


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_loads_generates_and_matches_its_tool(name: str) -> None:
    llm = LLM(os.path.join(ROOT, name), dtype="float32", max_model_len=128)
    routes = {r.layer: r.backend for r in llm.llm_engine.report.routes}
    assert routes["linear (qkv, o, mlp)"] == "TORCH_DEQUANT"
    if "moe" in name or "deepseek" in name:      # quantized experts, dequantized once on a CPU
        assert routes["moe experts"] == "TORCH_MOE"
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
    mean_delta, top1 = compare(llm, name)
    bound, min_top1 = BOUNDS.get(name, (0.01, 0.95))
    assert mean_delta < bound and top1 >= min_top1, (mean_delta, top1)


@pytest.mark.parametrize("name", ["hf-fp8-block", "hf-deepseek-v3-fp8-block"])
def test_block_fp8_weights_match_exactly(name: str) -> None:
    """The block-FP8 references are weight-only: with the activation quantization of each
    layer's (and each MoE layer's) prepared weights turned off, archserve's logits are the
    reference's. For DeepSeek-V3 that covers MLA's kv_b_proj, dequantized at load, and the
    partial last row block of kv_a_proj_with_mqa (320 rows)."""
    llm = LLM(os.path.join(ROOT, name), dtype="float32", max_model_len=128)
    model = llm.llm_engine.model
    without_activation_quantization(model)
    mean_delta, top1 = compare(llm, name)
    assert mean_delta < 1e-4 and top1 == 1.0


def test_online_fp8_quantizes_a_dense_checkpoint(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama")
    dense = LLM(path, dtype="float32")
    fp8 = LLM(path, dtype="float32", quantization="fp8")
    decisions = [d for d in fp8.llm_engine.report.decisions if d.what == "quantization"]
    assert decisions and "per-channel" in decisions[0].requested
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    a = dense.generate([prompt], params)[0].prompt_logprobs[1:]
    b = fp8.generate([prompt], params)[0].prompt_logprobs[1:]
    deltas = [abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob)
              for x, y in zip(a, b, strict=True)]
    assert 0 < sum(deltas) / len(deltas) < 0.05      # quantized (not identical), and close


# In bf16 a scheme that quantizes activations moves further from the float32 reference than
# bf16 alone does: an activation rounded differently in bf16 falls into another 8-bit code.
# Measured on CPU with archserve's emulation (TORCH_DEQUANT, bf16), before any GPU kernel:
# FP8 0.09-0.10 mean |delta| with top-1 0.78-0.84, INT8 0.05 with 0.87, weight-only <= 0.018.
# (mean |delta| bound, top-1 floor) in bf16; weight-only schemes keep the float32 bound + 0.05.
BF16_ACTIVATION_BOUNDS = {"fp8": (0.15, 0.7), "int8": (0.13, 0.75)}


# The tiny DeepSeek-V3 moves further in float32 already (0.131 / 0.84; bf16 on CPU 0.091 /
# 0.82): two layers of MLA whose q and latent both pass through fp8 activations.
BF16_FIXTURE_BOUNDS = {"hf-deepseek-v3-fp8-block": (0.2, 0.7)}


def bf16_bounds(name: str) -> tuple[float, float]:
    if name in BF16_FIXTURE_BOUNDS:
        return BF16_FIXTURE_BOUNDS[name]
    if "fp8" in name:
        return BF16_ACTIVATION_BOUNDS["fp8"]
    if "w8a8" in name:
        return BF16_ACTIVATION_BOUNDS["int8"]
    bound, min_top1 = BOUNDS.get(name, (0.01, 0.95))
    return bound + 0.05, min_top1 - 0.1


@pytest.mark.parametrize("name", [n for n in FIXTURES if "fp8" in n or "w8a8" in n])
def test_activation_quantized_fixture_in_bf16_on_cpu(name: str) -> None:
    """The bf16 bounds the GPU test uses hold for the CPU emulation already: the distance is
    bf16's, not a GPU kernel's."""
    llm = LLM(os.path.join(ROOT, name), dtype="bfloat16", max_model_len=128)
    mean_delta, top1 = compare(llm, name)
    bound, min_top1 = bf16_bounds(name)
    assert mean_delta < bound and top1 >= min_top1, (mean_delta, top1)


WEIGHT_ONLY = [n for n in FIXTURES if "a16" in n or n.startswith(("gptq", "awq"))]


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_weight_only_fixture_in_bf16_on_cpu(name: str) -> None:
    """A bfloat16 run keeps integer groups packed (CPU_WEIGHT_ONLY, where the CPU has AVX2:
    int4, int8, bf16 or fp32 per kind, as timed here) within bf16's bounds of the tool's
    reference."""
    llm = LLM(os.path.join(ROOT, name), dtype="bfloat16", max_model_len=128)
    routes = {r.layer: r.backend for r in llm.llm_engine.report.routes}
    packed = llm.llm_engine.report.device.features.avx2
    assert routes["linear (qkv, o, mlp)"] == ("CPU_WEIGHT_ONLY" if packed else "TORCH_DEQUANT")
    if packed:
        formats = next(d for d in llm.llm_engine.report.decisions
                       if d.what == "CPU weight formats")
        assert formats.chosen == "CPU_WEIGHT_ONLY" and "x" in formats.reason
    mean_delta, top1 = compare(llm, name)
    bound, min_top1 = bf16_bounds(name)
    assert mean_delta < bound and top1 >= min_top1, (mean_delta, top1)


# The kernel each fixture's layers must run on an SM90 GPU (the H200 of the device tool).
SM90_ROUTES = {"ct-fp8-tensor-static": "TORCH_SCALED_MM", "ct-fp8-channel-dynamic":
               "TORCH_SCALED_MM", "ct-fp8-block": "TRITON_BLOCK_FP8", "hf-fp8-block":
               "TRITON_BLOCK_FP8", "hf-deepseek-v3-fp8-block": "TRITON_BLOCK_FP8",
               "ct-int8-w8a8": "TRITON_INT8", "ct-moe-fp8-block": "TRITON_BLOCK_FP8",
               "ct-moe-fp8-dynamic": "TORCH_SCALED_MM"}
# The other layers' routes where a fixture has more than attention and dense linears.
SM90_OTHER_ROUTES = {"hf-deepseek-v3-fp8-block": {"attention": "TRITON_MLA",
                                                  "moe experts": "TRITON_FUSED_MOE"},
                     **{name: {"moe experts": "TRITON_FUSED_MOE"} for name in
                        ("ct-moe-fp8-block", "ct-moe-fp8-dynamic", "ct-moe-w4a16")}}


@pytest.mark.gpu
@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_on_the_gpu_runs_its_native_kernel_and_matches(name: str) -> None:
    """bf16 on the GPU, CUDA graphs on: the native kernel, within bf16's noise of the tool
    (the base model alone moves by ~0.1 in its logits between bf16 and float32)."""
    llm = LLM(os.path.join(ROOT, name), dtype="bfloat16", device="cuda", max_model_len=128,
              gpu_memory_utilization=0.3)
    routes = {r.layer: r.backend for r in llm.llm_engine.report.routes}
    assert routes["linear (qkv, o, mlp)"] == SM90_ROUTES.get(name, "TRITON_WEIGHT_ONLY")
    for layer, backend in SM90_OTHER_ROUTES.get(name, {}).items():
        assert routes[layer] == backend, (layer, routes)
    if name in SM90_OTHER_ROUTES:
        report = llm.llm_engine.report
        assert report.graph_sizes, report.graphs_off           # decode in CUDA graphs
    mean_delta, top1 = compare(llm, name)
    bound, min_top1 = bf16_bounds(name)
    assert mean_delta < bound and top1 >= min_top1, (mean_delta, top1)
    greedy = llm.generate(["The quick brown fox"] * 3,
                          SamplingParams(temperature=0.0, max_tokens=16))
    assert len({tuple(o.outputs[0].token_ids) for o in greedy}) == 1   # batch-invariant


@pytest.mark.parametrize("name", ["ct-w4a16-g32-asym", "ct-int8-w8a8", "ct-fp8-block"])
def test_dummy_weights_of_a_quantized_config(name: str) -> None:
    """The benchmarks' quantized shapes (benchmarks/models/*-w4a16 ...) load this way:
    random packed integers and small scales, quantized layers all the same."""
    from archserve.quant.linear_state import quantized_layers

    llm = LLM(os.path.join(ROOT, name), load_format="dummy", dtype="float32",
              skip_tokenizer_init=True)
    assert len(quantized_layers(llm.llm_engine.model)) == 8
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("name", FIXTURES)
def test_explain_on_an_h100_predicts_the_routes_the_gpu_test_expects(name: str) -> None:
    """explain --model on an SM90 profile shows what the GPU test above asserts the engine
    runs: a prediction and a run that disagree fail here, on the CPU, first."""
    from archserve.platform import get_profile
    from archserve.routing.explain import explain_model
    from archserve.routing.model_summary import read_model_summary

    out = explain_model(get_profile("h100"), read_model_summary(os.path.join(ROOT, name)),
                        dtype="bfloat16", libraries="installed")
    routes = {r.layer: r.backend for r in out.routes}
    assert routes["linear (qkv, o, mlp)"] == SM90_ROUTES.get(name, "TRITON_WEIGHT_ONLY")
    for layer, backend in SM90_OTHER_ROUTES.get(name, {}).items():
        assert routes[layer] == backend, (layer, routes)
