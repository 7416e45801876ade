"""DeepSeek V4 (DeepseekV4ForCausalLM): compressed attention, hyper-connections, hash-routed
and sqrt(softplus)-routed experts.

- attention (models/layers/compressed_attention.py): a sliding window with sinks on every
  layer, plus compressed entries per ``layer_types`` (compressed sparse: the indexer's
  top-k of 4-token entries; heavily compressed: every 128-token entry), grouped output;
- the residual stream is ``hc_mult`` streams (models/layers/hyper_connection.py): each block
  reads their collapse and its output is mixed back in; a last collapse (``hc_head``) feeds
  the final norm;
- every layer's MLP is a MoE: the router scores experts by sqrt(softplus(logits)) (its
  ``scoring_func``); the first layers (``mlp_layer_types`` "hash_moe") take their experts
  from a fixed token-id table (``tid2eid``), the others the top k of the scores plus a
  selection bias; the chosen scores, renormalised and times ``routed_scaling_factor``,
  weigh them; one shared expert of ``moe_intermediate_size`` per shared expert; routed
  and shared experts clamp their gate (above) and up (both sides) at ``swiglu_limit``.

Checkpoints: transformers' names, or DeepSeek's release layout (``layers.N.attn.wq_a``,
``ffn.experts.E.w1``, ``hc_attn_fn``, ... with or without a ``model.`` prefix; an FP8
weight's ``scale``, ue8m0 powers of two, is its ``weight_scale_inv`` in fp32; FP4 routed
experts, ``expert_dtype`` fp4, are MXFP4's bytes); the multi-token-prediction layers
(``mtp.``) are not loaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from archserve.kernels.moe.expert_activation import SILU_CLAMPED, GatedActivation
from archserve.models.deepseek import DeepseekRouter
from archserve.models.layers.compressed_attention import DeepseekV4Attention
from archserve.models.layers.hyper_connection import HyperConnection, HyperHead
from archserve.models.layers.moe import MIXTRAL_EXPERT_NAMES, FusedMoE, GatedMLP
from archserve.models.layers.norm import RMSNorm
from archserve.models.layers.parallel_embedding import VocabParallelEmbedding
from archserve.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig


class HashRouter(DeepseekRouter):
    """The router of a hash layer: its scores weigh the experts a fixed table gives each
    token id (``tid2eid`` [vocab, k]). The table starts as a valid hash (token t's slot j
    takes expert (t k + j) mod E), so dummy weights route somewhere real."""

    def __init__(self, num_experts: int, hidden_size: int, vocab_size: int, top_k: int
                 ) -> None:
        super().__init__(num_experts, hidden_size, correction_bias=False)
        table = (torch.arange(vocab_size)[:, None] * top_k + torch.arange(top_k)) % num_experts
        self.tid2eid = nn.Parameter(table, requires_grad=False)


class DeepseekV4MoE(nn.Module):
    def __init__(self, config: ModelConfig, hf: Any, layer_index: int) -> None:
        super().__init__()
        num_experts, top_k = int(hf.n_routed_experts), int(hf.num_experts_per_tok)
        hidden, inter = config.hidden_size, int(hf.moe_intermediate_size)
        kinds = getattr(hf, "mlp_layer_types", None) or ["moe"] * config.num_layers
        self.hashed = kinds[layer_index] == "hash_moe"
        self.gate = (HashRouter(num_experts, hidden, config.vocab_size, top_k) if self.hashed
                     else DeepseekRouter(num_experts, hidden, correction_bias=True))
        limit = float(hf.swiglu_limit)
        self.experts = FusedMoE(num_experts, top_k, hidden, inter, True, MIXTRAL_EXPERT_NAMES,
                                activation=GatedActivation(SILU_CLAMPED, limit=limit))
        shared = int(getattr(hf, "n_shared_experts", 0) or 0)
        self.shared_experts = GatedMLP(hidden, shared * inter, limit=limit) if shared else None
        self.grouping = dict(scoring=str(getattr(hf, "scoring_func", "sqrtsoftplus")),
                             scaling=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        grouping = dict(self.grouping)
        if self.hashed:
            grouping["fixed_ids"] = self.gate.tid2eid[input_ids]
        else:
            grouping["correction_bias"] = self.gate.e_score_correction_bias
        out = self.experts(x, self.gate(x), grouping)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        hf = config.hf_config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DeepseekV4Attention(config, layer_index)
        self.mlp = DeepseekV4MoE(config, hf, layer_index)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        hc = (hidden, int(hf.hc_mult), int(hf.hc_sinkhorn_iters), float(hf.hc_eps), eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor
                ) -> torch.Tensor:
        """streams [T, hc_mult, hidden] -> the streams after attention and MoE."""
        x, post, comb = self.attn_hc.pre(streams, self.input_layernorm)
        out = self.self_attn(positions, x)
        streams = self.attn_hc.post(streams, out, post, comb)
        x, post, comb = self.ffn_hc.pre(streams, self.post_attention_layernorm)
        out = self.mlp(x, input_ids)
        return self.ffn_hc.post(streams, out, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        self.hc_mult = int(hf.hc_mult)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config.hidden_size, self.hc_mult, float(hf.hc_eps),
                                 config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        streams = x[:, None, :].expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams, input_ids)
        return self.hc_head(streams, self.norm)


class DeepseekV4ForCausalLM(LlamaForCausalLM):
    op_kinds = ("mla_attention", "linear", "moe")
    model_class = DeepseekV4Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        quant = self.config.quantization_config or {}
        fp4_experts = str(quant.get("expert_dtype", "fp8")).lower() == "fp4"
        return super().load_weights(release_names(weights, fp4_experts))


# DeepSeek's release names -> transformers' (after ``layers.N.``): the attention's, the
# compressor's and the indexer's parts, the norms, the hyper-connections, the MoE's.
_LAYER_RENAMES = [(re.compile(a), b) for a, b in (
    (r"^attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
    (r"^attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"^attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
    (r"^attn\.", "self_attn."),
    (r"^ffn\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
    (r"^ffn\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
    (r"^ffn\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^ffn\.", "mlp."),
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_attn_(fn|base|scale)$", r"attn_hc.\1"),
    (r"^hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
)]
# Within the attention (after the renames above): DeepSeek's short module names.
_ATTENTION_RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.wq_a\.", ".q_a_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.norm\.", ".kv_norm."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"),
)]
_TOP_RENAMES = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
                "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
                "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


def release_name(name: str) -> str | None:
    """transformers' name of a tensor of DeepSeek's release layout (or of transformers' own,
    unchanged); None for a tensor the model does not load (the MTP layers)."""
    bare = name.removeprefix("model.")
    if bare.startswith("mtp."):
        return None
    if bare in _TOP_RENAMES:
        return _TOP_RENAMES[bare]
    m = _LAYER.match(bare)
    if m is None:
        return name
    rest = m[2]
    for pattern, repl in _LAYER_RENAMES:
        rest, hit = pattern.subn(repl, rest, count=1)
        if hit:
            break
    if rest.startswith("self_attn."):
        for pattern, repl in _ATTENTION_RENAMES:
            rest = pattern.sub(repl, rest)
    if rest.endswith(".scale") and not rest.endswith("_hc.scale"):
        rest = rest.removesuffix(".scale") + ".weight_scale_inv"
    return f"model.layers.{m[1]}.{rest}"


_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.w[123]\.(weight|weight_scale_inv)$")


def release_names(weights: Iterable[tuple[str, torch.Tensor]], fp4_experts: bool = False
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``release_name`` of each tensor. ``fp4_experts`` (the release's ``expert_dtype``
    fp4): a routed expert's int8 weight is its e2m1 pairs, low nibble first, and its ue8m0
    scale one per 32 input channels, MXFP4's ``blocks`` and ``scales`` bytes as they are."""
    for name, tensor in weights:
        renamed = release_name(name)
        if renamed is None:
            continue
        if fp4_experts and (m := _ROUTED_EXPERT.search(renamed)):
            part = "blocks" if m[1] == "weight" else "scales"
            yield renamed[:m.start(1)] + part, tensor.view(torch.uint8)
            continue
        if renamed.endswith(".weight_scale_inv") and tensor.dtype == torch.float8_e8m0fnu:
            tensor = tensor.float()      # a power of two: exact in fp32
        yield renamed, tensor
