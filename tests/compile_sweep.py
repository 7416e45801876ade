"""The compile sweep: every Triton kernel each route of every device profile can launch,
compiled for that profile's GPU target with the tiles and launch options the engine would
choose there, and held to its shared memory.

Two tables drive it:

* ``ROUTES``: what ``explain`` is asked, one entry per kind of route (dense, each
  quantization, MoE, MLA, attention with each KV-cache dtype). For each profile the sweep
  asks explain for the backend of each entry, as ``explain --device PROFILE --op ...``
  prints it.
* ``LAUNCHES``: per (op, backend) of a route, a function that calls that backend's kernel
  wrappers as the engine does (its implementation where it has one, the tile rules and
  every candidate its start-up tuner may time, at a decode batch and a prompt), with CPU
  tensors standing for the profile's GPU (tests/triton_compile.py). A backend that needs
  Triton and has no entry is a sweep failure, so a new Triton backend joins with one entry
  (and its route with one ``ROUTES`` line).

A kernel that does not compile for a profile, or needs more shared memory than it has
where nothing would drop it, is a failure: the fix is a rule in the backend's
``request_rule`` / ``device_rule`` so that ``explain`` shows the fallback there. Start-up
tuner candidates and autotuner configs that do not fit are dropped by the engine on that
GPU (and under ``--emulate-device``), so they are reported, not failed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from triton_compile import AUTOTUNED, CANDIDATE, DEFAULT, candidates

from archserve.kernels.catalog import default_registry
from archserve.platform.device import DeviceInfo
from archserve.platform.profiles import all_profiles

# Rows of a GEMM: a decode batch (the GEMV kernels), a large decode graph (the tallest MMA
# tile below the prompt path) and a prompt. Tokens of a MoE layer: a decode step (the pair
# layout) and a prompt (the sorted layout's tallest tile).
GEMM_ROWS = (1, 200, 512)
MOE_TOKENS = (1, 512)
PROMPT_ROWS = 512
# A layer of a Llama-3-8B-like model at a smaller hidden size. Tile rules read the shapes:
# a gate/up matrix this wide gets the widest tiles at a prompt (the most shared memory).
HIDDEN, INTER, VOCAB = 2048, 5632, 32000
HEADS, KV_HEADS, HEAD = 16, 4, 128


@dataclass(frozen=True)
class SweepRoute:
    """One kind of route: what ``explain --op`` is asked, and for a quantized route the
    weight layouts its checkpoints hold (``WEIGHT_FORMS``)."""

    name: str
    op: str
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    forms: tuple[str, ...] = ()
    sparse_mla: bool = False
    sinks: bool = False            # learned attention sinks (gpt-oss)
    sliding_window: int | None = None
    # Also the fused elementwise kernels (norms, rotary, gated activations, argmax, graph
    # inputs) every decoder runs, whose route the engine logs beside explain's.
    elementwise: bool = False
    # A key of MODELS: ``op``'s routes as ``explain --model`` prints them for that model
    # (each of its layer kinds), for a layer ``explain --op`` has no shape for.
    model: str | None = None


ROUTES: tuple[SweepRoute, ...] = (
    SweepRoute("dense", "linear", elementwise=True),
    SweepRoute("attention", "attention"),
    SweepRoute("attention kv fp8_e4m3", "attention", kv_cache_dtype="fp8_e4m3"),
    SweepRoute("attention kv fp8_e5m2", "attention", kv_cache_dtype="fp8_e5m2"),
    SweepRoute("attention sinks, window", "attention", sinks=True, sliding_window=128),
    SweepRoute("fp8", "linear", "fp8", forms=("fp8_token", "fp8_static")),
    SweepRoute("fp8 block", "linear", "fp8_block", forms=("fp8_block",)),
    SweepRoute("int8", "linear", "w8a8_int8", forms=("int8_token",)),
    SweepRoute("awq", "linear", "awq", forms=("int4_g128_zero",)),
    SweepRoute("gptq", "linear", "gptq", forms=("int4_g128_sym", "int8_g128_sym")),
    SweepRoute("gguf", "linear", "gguf", forms=("q4_k", "q8_0", "q6_k")),
    SweepRoute("moe", "moe"),
    SweepRoute("moe fp8", "moe", "fp8", forms=("fp8_token",)),
    SweepRoute("moe fp8 block", "moe", "fp8_block", forms=("fp8_block",)),
    SweepRoute("moe w4a16", "moe", "awq", forms=("int4_g128_zero",)),
    SweepRoute("moe int8", "moe", "w8a8_int8", forms=("int8_token",)),
    SweepRoute("moe mxfp4", "moe", "mxfp4", forms=("mxfp4",)),
    SweepRoute("lora", "lora"),
    SweepRoute("mla", "mla_attention"),
    SweepRoute("mla kv fp8", "mla_attention", kv_cache_dtype="fp8_e4m3"),
    SweepRoute("sparse mla", "mla_attention", sparse_mla=True),
    SweepRoute("sparse mla kv fp8", "mla_attention", kv_cache_dtype="fp8", sparse_mla=True),
    SweepRoute("deepseek v4", "mla_attention", model="deepseek_v4", elementwise=True),
)
# config.json of each model a route names: DeepSeek V4-Flash's (transformers' defaults) with
# one layer of each attention kind (sliding window, compressed sparse, heavily compressed).
MODELS: dict[str, dict[str, Any]] = {
    "deepseek_v4": dict(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"],
                        num_hidden_layers=3,
                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"],
                        mlp_layer_types=["hash_moe", "moe", "moe"]),
}


@functools.cache
def model_config(name: str):  # noqa: ANN201 - archserve's ModelConfig
    """The loader's ModelConfig of ``MODELS[name]``, parsed by transformers offline."""
    from transformers import AutoConfig

    from archserve.models.config import ModelConfig
    fields = dict(MODELS[name])
    return ModelConfig.from_hf_config(AutoConfig.for_model(fields.pop("model_type"), **fields))


@dataclass
class SweepCase:
    """One (profile, route, backend): what a launch function needs."""

    profile: DeviceInfo
    route: SweepRoute
    op: str
    backend: str
    dtype: torch.dtype
    kv_cache_dtype: str          # as the dtype decisions resolved it


# ---- launch functions: one per (op, backend) -------------------------------------------

def _empty(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def _kv_torch_dtype(case: SweepCase) -> torch.dtype:
    from archserve.engine.kv_cache import kv_dtype_of
    return kv_dtype_of(case.kv_cache_dtype, case.dtype)


def _metadata(query_lens: list[int], seq_lens: list[int], block_size: int):  # noqa: ANN202
    from archserve.kernels.attention.interface import AttentionMetadata
    width = max(-(-s // block_size) for s in seq_lens)
    tables = torch.arange(len(seq_lens) * width, dtype=torch.int32).reshape(-1, width)
    slots = torch.arange(sum(query_lens), dtype=torch.int64)
    return AttentionMetadata.from_lengths(query_lens, seq_lens, tables, slots, "cpu")


def _attention_steps(block_size: int) -> list:
    """A long batch-1 decode (split, so the merge too), a wide decode, a prompt, and the
    same prompt padded to a captured bucket (mixed-step graphs)."""
    decode_long = _metadata([1], [8192], block_size)
    decode_wide = _metadata([1] * 64, [512] * 64, block_size)
    prompt = _metadata([PROMPT_ROWS, 1], [PROMPT_ROWS, 700], block_size)
    return [decode_long, decode_wide, prompt, dataclasses.replace(prompt, padded_bucket=True)]


def triton_attention(case: SweepCase) -> None:
    from archserve.kernels.attention.interface import AttentionLayerParams
    from archserve.kernels.attention.preamble import attention_preamble
    from archserve.kernels.specs import AttentionSpec

    spec = AttentionSpec(head_size=HEAD, dtype=case.dtype, kv_cache_dtype=case.kv_cache_dtype,
                         num_heads=HEADS, num_kv_heads=KV_HEADS, has_sinks=case.route.sinks,
                         sliding_window=case.route.sliding_window)
    backend = default_registry().get("attention", case.backend)
    impl = backend.make_impl(case.profile, spec)
    block_size = getattr(backend, "preferred_block_size", 16)
    cache = _empty(2, 1024, block_size, KV_HEADS, HEAD, dtype=_kv_torch_dtype(case))
    layer = AttentionLayerParams(HEADS, KV_HEADS, HEAD, HEAD ** -0.5,
                                 sliding_window=case.route.sliding_window,
                                 kv_cache_dtype=case.kv_cache_dtype,
                                 sinks=torch.empty(HEADS) if case.route.sinks else None)
    cos_sin = torch.empty(8192, HEAD // 2)
    norms = (_empty(HEAD, dtype=case.dtype),) * 2
    for meta in _attention_steps(block_size):
        tokens = meta.slot_mapping.shape[0]
        qkv = _empty(tokens, (HEADS + 2 * KV_HEADS) * HEAD, dtype=case.dtype)
        positions = torch.zeros(tokens, dtype=torch.long)
        for norm_weights in (None, norms):      # Llama's preamble, then Qwen3's q/k norms
            q, k, v = attention_preamble(qkv, positions, cos_sin, cos_sin, norm_weights, 1e-6,
                                         HEADS, KV_HEADS, cache, meta.slot_mapping,
                                         getattr(impl, "takes_written_kv", False))
        if k is not None:
            impl.write_cache(k.view(tokens, KV_HEADS, HEAD), v.view(tokens, KV_HEADS, HEAD),
                             cache, meta.slot_mapping, 1.0, 1.0)
        out = _empty(tokens, HEADS, HEAD, dtype=case.dtype)
        impl.attend(q.view(tokens, HEADS, HEAD), cache, meta, layer, out, 1.0, 1.0)


def triton_mla(case: SweepCase) -> None:
    from archserve.kernels.mla.tuning import CANDIDATE_TILES
    from archserve.kernels.specs import AttentionSpec
    from archserve.routing.explain import DEEPSEEK_V3_MLA

    shape = dict(DEEPSEEK_V3_MLA, num_heads=16)
    rank, rope, nope, v_dim = 512, 64, 128, 128
    spec = AttentionSpec(dtype=case.dtype, kv_cache_dtype=case.kv_cache_dtype, **shape)
    backend = default_registry().get("mla_attention", case.backend)
    impl = backend.make_impl(case.profile, spec)
    block_size = getattr(backend, "preferred_block_size", 16)
    cache = _empty(1, 1024, block_size, 1, rank + rope, dtype=_kv_torch_dtype(case))
    w_uk, w_uv = _empty(16, nope, rank, dtype=case.dtype), _empty(16, v_dim, rank,
                                                                  dtype=case.dtype)
    cos_sin = torch.empty(8192, rope // 2)
    for meta in _attention_steps(block_size):
        tokens = meta.slot_mapping.shape[0]
        q_nope, q_pe = _empty(tokens, 16, nope, dtype=case.dtype), _empty(
            tokens, 16, rope, dtype=case.dtype)
        latent = _empty(tokens, rank + rope, dtype=case.dtype)
        impl.forward(q_nope, q_pe, latent, cache, meta, w_uk, w_uv, 0.1)
        if meta.max_query_len == 1:     # a decode step straight from the projections
            impl.decode_from_projections(
                _empty(tokens, 16 * (nope + rope), dtype=case.dtype), latent,
                torch.zeros(tokens, dtype=torch.long), cos_sin, cos_sin,
                _empty(rank, dtype=case.dtype), 1e-6, True, cache, meta, w_uk, w_uv, 0.1)
            with candidates():                     # the start-up timing's variants
                for tiles in CANDIDATE_TILES:
                    impl.tiles = tiles
                    impl.forward(q_nope, q_pe, latent, cache, meta, w_uk, w_uv, 0.1)
            impl.tiles = None


def skinny_gemm(case: SweepCase) -> None:
    """TRITON_SKINNY_GEMM: every candidate at each of its row counts, in each epilogue and
    prologue the decode graphs use (all candidates: the tuner keeps cuBLAS where none runs
    or wins)."""
    from archserve.kernels.linear import triton_skinny_gemm as skinny

    dtype = case.dtype
    qkv, gate_up = _empty(3072, HIDDEN, dtype=dtype), _empty(2 * INTER, HIDDEN, dtype=dtype)
    down, head = _empty(HIDDEN, INTER, dtype=dtype), _empty(VOCAB, HIDDEN, dtype=dtype)
    router = _empty(64, HIDDEN, dtype=torch.float32)
    norm = _empty(HIDDEN, dtype=dtype)
    with candidates():
        for rows in (1, 2, 4, 8, 16):   # each BLOCK_M up to MAX_ROWS
            x, x_inter = _empty(rows, HIDDEN, dtype=dtype), _empty(rows, INTER, dtype=dtype)
            for config in skinny.candidate_configs(rows):
                skinny.skinny_gemm(x, qkv, None, config)
                skinny.skinny_gemm(x, gate_up, None, config, silu_mul=True)
                skinny.skinny_gemm(x_inter, down, None, config,
                                   add=_empty(rows, HIDDEN, dtype=dtype))
                skinny.skinny_gemm(x, head, None, config, widen=True)
                skinny.skinny_gemm(x, router, None, config)
                skinny.rms_norm_skinny_gemm(x, None, None, 1e-6, qkv, None, config)
                skinny.rms_norm_skinny_gemm(x, x, norm, 1e-6, router, None, config,
                                            keep_normed=True)


def elementwise(case: SweepCase) -> None:
    """The fused elementwise kernels of a step, through their dispatch: norms (with and
    without the residual), gated activations, the greedy argmax, the graph inputs."""
    from archserve.kernels.elementwise import dispatch
    from archserve.kernels.elementwise.triton_argmax import triton_argmax
    from archserve.kernels.elementwise.triton_graph_inputs import load_graph_inputs_triton

    dtype = case.dtype
    norm = _empty(HIDDEN, dtype=dtype)
    for rows in (1, 64, PROMPT_ROWS):
        x = _empty(rows, HIDDEN, dtype=dtype)
        dispatch.rms_norm(x, norm, 1e-6)
        dispatch.rms_norm(x, norm, 1e-6, residual=x)
        dispatch.silu_and_mul(_empty(rows, 2 * INTER, dtype=dtype))
        dispatch.gelu_tanh_and_mul(_empty(rows, 2 * INTER, dtype=dtype))
        triton_argmax(_empty(min(rows, 256), VOCAB, dtype=torch.float32))
    size, width = 64, 16
    static = (torch.zeros(size, dtype=torch.long), torch.zeros(size, dtype=torch.long),
              torch.zeros(size, dtype=torch.long), torch.zeros(size, dtype=torch.int32),
              torch.zeros(size, width, dtype=torch.int32))
    load_graph_inputs_triton(size, static, tuple(t[:8] for t in static))
    if case.route.model == "deepseek_v4":
        _v4_elementwise(case)


def _v4_elementwise(case: SweepCase) -> None:
    """DeepSeek V4's own fused kernels at the model's sizes: the hyper-connections around
    each block and the head's collapse, and the per-head norm + interleaved rope of the
    queries, the key row and the rotated-back output."""
    from archserve.kernels.elementwise import dispatch

    config = model_config(case.route.model)
    hf, dtype = config.hf_config, case.dtype
    n, hidden, heads = int(hf.hc_mult), config.hidden_size, config.num_heads
    head_dim, rope = config.kv_cache_head_size, config.compressed_attention.rope_head_dim
    mixes = (2 + n) * n
    fn, base = _empty(mixes, n * hidden, dtype=torch.float32), _empty(mixes, dtype=torch.float32)
    scale, norm = _empty(3, dtype=torch.float32), _empty(hidden, dtype=dtype)
    inv_freq = _empty(rope // 2, dtype=torch.float32)
    for rows in (1, 64, PROMPT_ROWS):
        streams, positions = _empty(rows, n, hidden, dtype=dtype), torch.zeros(rows).long()
        _, post, comb = dispatch.hyper_connection_pre(streams, fn, base, scale, 1e-6, 1e-6,
                                                      int(hf.hc_sinkhorn_iters), norm, 1e-6)
        dispatch.hyper_connection_post(streams, streams[:, 0], post, comb)
        dispatch.hyper_connection_head(streams, fn[:n], base[:n], scale[:1], 1e-6, 1e-6,
                                       norm, 1e-6)
        dispatch.norm_rope_interleaved(_empty(rows, heads, head_dim, dtype=dtype), positions,
                                       inv_freq, eps=1e-6)
        dispatch.norm_rope_interleaved(_empty(rows, head_dim, dtype=dtype), positions,
                                       inv_freq, _empty(head_dim, dtype=dtype), 1e-6)


def _weight(form: str, n: int, k: int, experts: int = 0):  # noqa: ANN202 - a weight layout
    """An empty quantized weight of ``form`` (WEIGHT_FORMS), [n outputs, k inputs]; with
    ``experts``, that many stacked as the MoE kernels read them."""
    from archserve.kernels.linear.quantized_weights import (
        ACT_DYNAMIC_GROUP,
        ACT_DYNAMIC_TOKEN,
        ACT_STATIC_TENSOR,
        FP8_DTYPE,
        Fp8Weight,
        Int8Weight,
        IntGroupWeight,
    )
    lead = (experts,) if experts else ()
    bits, group, zero = WEIGHT_FORMS[form]
    if form == "mxfp4":
        from archserve.kernels.linear.quantized_weights import Mxfp4Weight
        return Mxfp4Weight(torch.zeros(*lead, n, k // 2, dtype=torch.uint8),
                           torch.full((*lead, n, k // group), 127, dtype=torch.uint8))
    if form.startswith("fp8"):
        block = (128, 128) if form == "fp8_block" else None
        scale = torch.ones(*lead, -(-n // 128), -(-k // 128)) if block else torch.ones(*lead, n)
        activation = {"fp8_block": ACT_DYNAMIC_GROUP, "fp8_token": ACT_DYNAMIC_TOKEN,
                      "fp8_static": ACT_STATIC_TENSOR}[form]
        return Fp8Weight(torch.empty(*lead, n, k, dtype=FP8_DTYPE), scale, activation, block,
                         torch.ones(()) if activation == ACT_STATIC_TENSOR else None)
    if form == "int8_token":
        return Int8Weight(torch.empty(*lead, n, k, dtype=torch.int8), torch.ones(*lead, n),
                          ACT_DYNAMIC_TOKEN)
    scales = torch.ones(*lead, k // group, n, dtype=torch.float16)
    return IntGroupWeight(torch.empty(*lead, k * bits // 32, n, dtype=torch.int32), scales,
                          scales.clone() if zero else None, bits, group, k, n)


# form -> (bits, group, offsets) for integer groups; the fp8 / int8 forms ignore them
WEIGHT_FORMS: dict[str, tuple[int, int, bool]] = {
    "fp8_token": (8, 0, False), "fp8_static": (8, 0, False), "fp8_block": (8, 0, False),
    "int8_token": (8, 0, False),
    "int4_g128_zero": (4, 128, True),     # AWQ, compressed-tensors W4A16 asymmetric
    "int4_g128_sym": (4, 128, False),     # GPTQ, compressed-tensors W4A16 symmetric
    "int8_g128_sym": (8, 128, False),     # GPTQ 8-bit, W8A16
    # GGUF block types as integer groups (quant/gguf_blocks.py): Q4_K / Q4_0 / Q4_1 are
    # 4-bit groups of 32, Q8_0 / Q5_* 8-bit groups of 32, Q6_K 8-bit groups of 16.
    "q4_k": (4, 32, True), "q8_0": (8, 32, True), "q6_k": (8, 16, True),
    "mxfp4": (4, 32, False),              # e2m1 pairs, an e8m0 scale per 32 (gpt-oss)
}


def quantized_linear(case: SweepCase) -> None:
    """A quantized linear backend's routine at each decode row count, between and at a
    prompt: its default launch and every config its start-up tuner may time."""
    from archserve.kernels.specs import LinearSpec

    backend = default_registry().get("linear", case.backend)
    routine = backend.make_impl(case.profile, LinearSpec(dtype=case.dtype))
    for form in case.route.forms:
        weight = _weight(form, 2 * INTER, HIDDEN)
        for rows in GEMM_ROWS:
            x = _empty(rows, HIDDEN, dtype=case.dtype)
            routine(x, weight)
            if hasattr(routine, "candidates"):
                with candidates():
                    for config in routine.candidates(rows, weight):
                        routine.run(x, weight, None, config)


def fused_moe(case: SweepCase) -> None:
    """TRITON_FUSED_MOE: routing (softmax top-k and DeepSeek's grouped top-k), then the
    experts at each token bucket with every tile the tuner may time (16-bit experts), or
    the default tiles (quantized experts, which the tuner does not time)."""
    from archserve.kernels.moe.routing import route
    from archserve.kernels.moe.triton_fused_moe import candidate_tiles, fused_moe
    from archserve.kernels.moe.triton_quantized_moe import quantized_moe
    from archserve.kernels.moe.triton_routing import triton_route

    experts, top_k, hidden, inter = 64, 8, HIDDEN, 768
    triton_route(torch.empty(4, experts), top_k, True)
    triton_route(torch.empty(4, 256), 8, True, scoring="sigmoid", num_groups=8,
                 topk_groups=4, correction_bias=torch.empty(256), scaling=2.5,
                 shared_experts=1)
    if case.route.forms == ("mxfp4",):
        # The fused kernels' own path (their tiles and the tuner's), with gpt-oss's
        # clamped SwiGLU and expert biases, and without them.
        from archserve.kernels.moe.expert_activation import (
            SWIGLU_OAI,
            ExpertBiases,
            GatedActivation,
        )
        w13, w2 = _weight("mxfp4", 2 * inter, hidden, experts), _weight("mxfp4", hidden,
                                                                       inter, experts)
        biases = ExpertBiases(_empty(experts, 2 * inter, dtype=case.dtype),
                              _empty(experts, hidden, dtype=case.dtype))
        for tokens in MOE_TOKENS:
            x, logits = _empty(tokens, hidden, dtype=case.dtype), torch.randn(tokens, experts)
            routed = route(logits, top_k, True)
            default, *others = candidate_tiles(tokens, top_k, w13, w2)
            fused_moe(x, logits, w13, w2, top_k, True, default, routed)
            fused_moe(x, logits, w13, w2, top_k, True, default, routed,
                      activation=GatedActivation(SWIGLU_OAI), biases=biases)
            with candidates():
                for tile in others:
                    fused_moe(x, logits, w13, w2, top_k, True, tile, routed)
        return
    if case.route.forms:
        from archserve.kernels.moe.quantized_experts import QuantizedExperts
        for form in case.route.forms:
            quantized = QuantizedExperts(_weight(form, 2 * inter, hidden, experts),
                                         _weight(form, hidden, inter, experts))
            for tokens in MOE_TOKENS:
                x, logits = _empty(tokens, hidden, dtype=case.dtype), torch.randn(tokens,
                                                                                  experts)
                quantized_moe(x, logits, quantized.w13, quantized.w2, top_k, True,
                              routed=route(logits, top_k, True))
        return
    w13, w2 = _empty(experts, 2 * inter, hidden, dtype=case.dtype), _empty(
        experts, hidden, inter, dtype=case.dtype)
    for tokens in MOE_TOKENS:
        x, logits = _empty(tokens, hidden, dtype=case.dtype), torch.randn(tokens, experts)
        routed = route(logits, top_k, True)     # compiled routing writes nothing: route here
        default, *others = candidate_tiles(tokens, top_k, w13, w2)
        fused_moe(x, logits, w13, w2, top_k, True, default, routed)
        fused_moe(x, logits, w13, w2, top_k, True, default, routed, add=x)
        with candidates():
            for tile in others:
                fused_moe(x, logits, w13, w2, top_k, True, tile, routed)
                fused_moe(x, logits, w13, w2, top_k, True, tile, routed, add=x)


def scaled_mm_activations(case: SweepCase) -> None:
    """TORCH_SCALED_MM: torch._scaled_mm is torch's; the activation quantization is ours."""
    from archserve.kernels.linear.fp8_gemm import quantize_fp8_activation
    from archserve.kernels.linear.quantized_weights import ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR

    for rows in GEMM_ROWS:
        x = _empty(rows, HIDDEN, dtype=case.dtype)
        quantize_fp8_activation(x, ACT_DYNAMIC_TOKEN)
        quantize_fp8_activation(x, ACT_STATIC_TENSOR, torch.ones(()))


def triton_sparse_mla(case: SweepCase) -> None:
    """TRITON_MLA_SPARSE at DeepSeek-V3.2's sizes: a decode batch past the top-k (the
    indexer's scores, the top-k, the indexed decode) and a prompt chunk past it."""
    from archserve.kernels.mla.sparse_cases import make_sparse_case
    from archserve.kernels.specs import AttentionSpec
    from archserve.routing.explain import DEEPSEEK_V3_MLA

    sizes = dict(kv_lora_rank=512, rope=64, nope=128, v_head=128, index_heads=64,
                 index_dim=128)
    spec = AttentionSpec(dtype=case.dtype, kv_cache_dtype=case.kv_cache_dtype,
                         **dict(DEEPSEEK_V3_MLA, num_heads=16), mla_sparse=True,
                         index_topk=2048, index_head_dim=128, index_num_heads=64)
    backend = default_registry().get("mla_attention", case.backend)
    for seqs in ([(1, 3000), (1, 2500)], [(64, 2200)]):
        sparse = make_sparse_case(seqs, topk=2048, num_heads=16, block_size=64,
                                  dtype=case.dtype, kv_cache_dtype=case.kv_cache_dtype,
                                  **sizes)
        sparse.run(backend.make_impl(case.profile, spec))


def triton_dsv4(case: SweepCase) -> None:
    """TRITON_MLA_SPARSE_DSV4 at the model's sizes, each layer kind: a long batch-1 decode
    (split attention, the indexer's scores past top-k), a wide decode, and a prompt chunk
    continuing a cached prefix mid-group beside a decode (the indexer's stacked prompt rows).
    """
    from archserve.kernels.compressed_attention.layout import CSA
    from archserve.kernels.specs import AttentionSpec

    config = model_config(case.route.model)
    dims = config.compressed_attention
    spec = AttentionSpec(head_size=config.kv_cache_head_size, dtype=case.dtype,
                         kv_cache_dtype=case.kv_cache_dtype, num_heads=config.num_heads,
                         num_kv_heads=1, sliding_window=config.sliding_window, has_sinks=True,
                         **dims.spec_fields(CSA))
    backend = default_registry().get("mla_attention", case.backend)
    impl = backend.make_impl(case.profile, spec)
    for step in _dsv4_steps(case.route.model, case.dtype, backend.preferred_block_size):
        step.run(impl)


@functools.cache
def _dsv4_steps(model: str, dtype: torch.dtype, block_size: int) -> list:
    """triton_dsv4's steps (the same for every profile of a dtype: made once)."""
    from archserve.kernels.compressed_attention.layout import CSA
    from archserve.kernels.mla.dsv4_cases import make_compressed_case

    config = model_config(model)
    dims = config.compressed_attention
    sizes = dict(num_heads=config.num_heads, head_dim=config.kv_cache_head_size,
                 rope_dim=dims.rope_head_dim, window=config.sliding_window,
                 index_dim=dims.index_head_dim, index_heads=dims.index_n_heads,
                 topk=dims.index_topk, dtype=dtype, block_size=block_size, run_history=False)
    longest = 2 * dims.index_topk * dims.compress_rates.get(CSA, 1)   # twice what top-k covers
    steps = ([(longest, 1)], [(600, 1)] * 32, [(longest // 2 + 3, PROMPT_ROWS), (600, 1)])
    return [make_compressed_case(seqs, compress_rate=dims.compress_rates.get(kind, 0),
                                 overlap=kind == CSA, **sizes)
            for kind in dims.kinds for seqs in steps]


def triton_lora(case: SweepCase) -> None:
    """TRITON_LORA: shrink then expand over a step's adapter slots (q/k/v blocks), at a
    decode batch and a prompt."""
    import numpy as np

    from archserve.kernels.lora.interface import LoRAMapping, LoRASlots, pack_mapping

    backend = default_registry().get("lora", case.backend)
    impl = backend.make_impl(case.profile, None)
    blocks, slots = (3072, 1024, 1024), 8
    lora = LoRASlots(_empty(slots, 3 * 16, HIDDEN, dtype=case.dtype),
                     _empty(sum(blocks), slots, 16, dtype=case.dtype), blocks)
    for tokens in (1, 32, PROMPT_ROWS):
        packed = torch.from_numpy(pack_mapping(np.arange(tokens) % slots, slots))
        impl.add_lora(_empty(tokens, sum(blocks), dtype=case.dtype),
                      _empty(tokens, HIDDEN, dtype=case.dtype), lora,
                      LoRAMapping.views(packed, slots, tokens))


LAUNCHES: dict[tuple[str, str], Callable[[SweepCase], None]] = {
    ("attention", "TRITON_ATTN"): triton_attention,
    ("mla_attention", "TRITON_MLA"): triton_mla,
    ("mla_attention", "TRITON_MLA_SPARSE"): triton_sparse_mla,
    ("mla_attention", "TRITON_MLA_SPARSE_DSV4"): triton_dsv4,
    ("linear", "TRITON_SKINNY_GEMM"): skinny_gemm,
    ("elementwise", "triton"): elementwise,
    ("linear", "TRITON_WEIGHT_ONLY"): quantized_linear,
    ("linear", "TRITON_BLOCK_FP8"): quantized_linear,
    ("linear", "TRITON_INT8"): quantized_linear,
    ("linear", "TORCH_SCALED_MM"): scaled_mm_activations,
    ("moe", "TRITON_FUSED_MOE"): fused_moe,
    ("lora", "TRITON_LORA"): triton_lora,
}


# ---- the sweep --------------------------------------------------------------------------

@dataclass
class RouteResult:
    """One (profile, route): what explain chose and what its kernels did."""

    profile: str
    route: str
    backends: list[str] = field(default_factory=list)
    status: str = ""                 # compiles | no Triton kernel | not loadable | failed
    reason: str = ""                 # why not loadable, or the failures
    launches: list[Any] = field(default_factory=list)     # LaunchSpec, in launch order
    failures: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)      # tuner candidates over the limit


def route_cases(profile: DeviceInfo, route: SweepRoute) -> tuple[list[SweepCase], str | None]:
    """The (op, backend) cases explain's route for ``profile`` runs, or why it has none."""
    from archserve.routing.explain import SelectionInputs, explain_model, explain_op_request
    from archserve.routing.model_summary import summary_from_model_config

    if route.model is not None:
        explanation = explain_model(profile, summary_from_model_config(model_config(route.model)),
                                    kv_cache_dtype=route.kv_cache_dtype, libraries="all")
    else:
        explanation = explain_op_request(profile, route.op, head_size=HEAD if route.op ==
                                         "attention" else None,
                                         kv_cache_dtype=route.kv_cache_dtype,
                                         quantization=route.quantization, libraries="all",
                                         inputs=SelectionInputs(has_sinks=route.sinks),
                                         sparse_mla=route.sparse_mla)
    if explanation.not_loadable:
        return [], explanation.not_loadable
    routes = explanation.routes
    if route.model is not None:     # its routes of ``op`` (a layer kind each), a case a backend
        routes = list({r.backend: r for r in routes if r.op == route.op}.values())
    unrouted = next((r for r in routes if not r.backend), None)
    if unrouted is not None:     # explain's first rejection says why (the ideal's, mostly)
        why = (f"{unrouted.rejected[0].backend}: {unrouted.rejected[0].reason}"
               if unrouted.rejected else "every backend refuses it")
        return [], f"no {unrouted.layer} backend runs it ({why})"
    kv = next((d.chosen for d in explanation.decisions if d.what == "kv_cache_dtype"), "auto")
    cases = [SweepCase(profile, route, r.op, r.backend, explanation.dtype, kv) for r in routes]
    if route.elementwise and profile.is_gpu:
        from archserve.kernels.elementwise.dispatch import fused_kernel_route
        from archserve.platform.emulation import compile_target
        with compile_target(profile):
            fused, _ = fused_kernel_route(torch.device("cpu"))
        cases.append(SweepCase(profile, route, "elementwise", fused, explanation.dtype, kv))
    return cases, None


def _uses_triton(op: str, backend: str) -> bool:
    if op == "elementwise":
        return backend == "triton"
    return default_registry().get(op, backend).library == "triton"


def collect(profiles: list[DeviceInfo] | None = None,
            routes: tuple[SweepRoute, ...] = ROUTES) -> list[RouteResult]:
    """Every (profile, route)'s launches, recorded without compiling."""
    from triton_compile import collected_launches

    results = []
    for profile in profiles or [p for p in all_profiles()]:
        for route in routes:
            result = RouteResult(profile.id, route.name)
            results.append(result)
            cases, refused = route_cases(profile, route)
            result.backends = [case.backend for case in cases]
            if refused:
                result.status, result.reason = "not loadable", refused
                continue
            triton_cases = [c for c in cases if _uses_triton(c.op, c.backend)]
            if not profile.is_gpu or not triton_cases:
                result.status = "no Triton kernel"
                continue
            for case in triton_cases:
                launch = LAUNCHES.get((case.op, case.backend))
                if launch is None:
                    result.failures.append(f"{case.op} backend {case.backend} needs Triton "
                                           "and has no entry in compile_sweep.LAUNCHES")
                    continue
                with collected_launches(profile) as specs:
                    launch(case)
                result.launches += specs
    return results


# What a sweep compiles, by the kind of launch (tests/triton_compile.py):
#   representative: for each target, each kernel (apart for each combination of byte
#             operands it reads: fp8, int8, packed 4-bit) at the largest tiles the engine
#             launches it with there (the launch most likely to exceed the GPU's shared
#             memory). What CI compiles and the docs' table records;
#   defaults: every launch the engine runs with its rules' tiles, and each autotuned
#             kernel's first config the pruning keeps (archserve lists them largest first);
#   autotuned: also every other config the autotuners keep for the profile;
#   all:       also every candidate the start-up tuners time.
LEVELS = ("representative", "defaults", "autotuned", "all")
# Operands of a byte a value (fp8, int8, packed 4-bit): a kernel's launches over them take
# other code than its 16-bit ones, so each such combination is compiled apart.
BYTE_POINTERS = frozenset({"*fp8e4nv", "*fp8e5", "*i8", "*u8"})


def _by_kind(spec: Any, level: str) -> bool:
    if spec.kind == DEFAULT:
        return True
    if spec.kind == AUTOTUNED:
        return spec.rank == 0 or level not in ("representative", "defaults")
    return level == "all"


def _footprint(spec: Any) -> int:
    """How much shared memory a launch's tiles ask for, in proportion: the product of its
    BLOCK_* sizes and its pipeline stages."""
    size = dict(spec.options).get("num_stages") or 1
    for name, value in spec.constexprs:
        if name.startswith("BLOCK") and isinstance(value, int) and value > 0:
            size *= value
    return size


def selected_keys(specs: list[Any], level: str) -> set[tuple]:
    """The keys of the launches ``level`` compiles, out of ``specs`` (in launch order)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, not {level!r}")
    kept = [spec for spec in specs if _by_kind(spec, level)]
    if level != "representative":
        return {spec.key() for spec in kept}
    largest: dict[tuple, Any] = {}
    for spec in kept:
        group = (spec.target, spec.module, spec.name,
                 frozenset(kind for _, kind in spec.signature if kind in BYTE_POINTERS))
        if group not in largest or _footprint(spec) > _footprint(largest[group]):
            largest[group] = spec
    return {spec.key() for spec in largest.values()}


def check(results: list[RouteResult], level: str = "representative", workers: int = 2,
          profiles: dict[str, DeviceInfo] | None = None) -> dict[str, float]:
    """Compile each distinct launch of ``level`` once; fill each result's status, its
    failures (a launch the engine would fail on: one it must run that does not compile or
    fit, an autotuned config that does not compile) and what the engine would drop there
    (configs and candidates over the GPU's shared memory, candidates that fail). Returns
    counts and timings. ``profiles``: the results' profiles by id (default: every profile)."""
    from triton_compile import compile_all

    start = time.perf_counter()
    launches = [spec for result in results for spec in result.launches]
    keys = selected_keys(launches, level)
    specs = [spec for spec in launches if spec.key() in keys]
    compiled = compile_all(specs, workers)
    profiles = profiles or {p.id: p for p in all_profiles()}
    limits = {pid: p.shared_memory_per_block_bytes for pid, p in profiles.items()}
    for result in results:
        for spec in result.launches:
            if spec.key() not in keys:
                continue
            outcome = compiled[spec.key()]
            what = f"{spec.name} {_describe(spec)}"
            limit = limits[result.profile]
            if outcome.error:
                # An autotuner fails on a compile error; a start-up tuner skips the candidate.
                (result.dropped if spec.kind == CANDIDATE else result.failures).append(
                    f"{what}: {outcome.error}")
            elif limit and outcome.shared > limit:
                # Both tuners drop what the GPU cannot hold; a default launch would fail.
                (result.failures if spec.kind == DEFAULT else result.dropped).append(
                    f"{what}: {outcome.shared} bytes of shared memory, the GPU has {limit}")
        if not result.status:
            result.status = "failed" if result.failures else "compiles"
            result.reason = "; ".join(result.failures)
    return {"launches": len(specs), "compiled": len(compiled),
            "compile_cpu_seconds": round(sum(c.cpu_seconds for c in compiled.values()), 1),
            "wall_seconds": round(time.perf_counter() - start, 1)}


def _describe(spec: Any) -> str:
    constexprs = dict(spec.constexprs)
    tiles = {k: v for k, v in constexprs.items() if k.startswith("BLOCK")}
    options = dict(spec.options)
    return ("(" + ", ".join(f"{k}={v}" for k, v in {**tiles, **options}.items()) + ")")


# ---- the table in docs/compile-sweep.md ------------------------------------------------

TABLE_START = "<!-- compile sweep table: scripts/compile_sweep.py writes it -->"
TABLE_END = "<!-- end of the compile sweep table -->"
EMULATION_HOST = "h200"     # the GPU the emulated GPU tests run on


def table(results: list[RouteResult]) -> str:
    """Markdown: one row per profile, one column per route, and whether the profile runs
    emulated on the H200 (or why not). Cells: ``ok N`` (the route's N kernels compile and
    fit), ``torch`` (the route runs no Triton kernel there), ``n/l`` (not loadable there:
    a footnote says why), ``FAILED``."""
    from archserve.platform.emulation import emulation_refusal
    from archserve.platform.profiles import get_profile

    routes = list(dict.fromkeys(r.route for r in results))
    notes: dict[str, int] = {}
    lines = ["| profile | " + " | ".join(routes) + f" | emulated on an {EMULATION_HOST.upper()} |",
             "|---" * (len(routes) + 2) + "|"]
    by_profile: dict[str, dict[str, RouteResult]] = {}
    for result in results:
        by_profile.setdefault(result.profile, {})[result.route] = result
    host = get_profile(EMULATION_HOST)
    for profile, row in by_profile.items():
        cells = []
        for route in routes:
            result = row[route]
            if result.status == "not loadable":
                number = notes.setdefault(result.reason, len(notes) + 1)
                cells.append(f"n/l [{number}]")
            elif result.status == "compiles":
                cells.append(f"ok {len({(s.module, s.name) for s in result.launches})}")
            elif result.status == "no Triton kernel":
                cells.append("torch")
            else:
                cells.append("FAILED")
        refusal = emulation_refusal(host, get_profile(profile))
        if refusal is None:
            emulated = "yes"
        else:
            number = notes.setdefault(refusal, len(notes) + 1)
            emulated = f"refused [{number}]"
        lines.append(f"| {profile} | " + " | ".join(cells) + f" | {emulated} |")
    lines.append("")
    lines += [f"[{number}] {text}" for text, number in notes.items()]
    return "\n".join(lines)
