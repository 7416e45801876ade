"""One decoder for the Llama family: Llama 2/3/3.x, Mistral, SmolLM, Qwen2/2.5, Qwen3.

The variants differ only in switches read from ModelConfig: q/k/v (and o) biases, per-head
q/k RMSNorm (Qwen3), RoPE scaling, sliding windows, tied embeddings. Inputs are flattened
tokens (no batch dimension, no padding); the attention layer finds the batch layout in the
forward context set by the model runner.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from archserve.models.layers.attention import Attention
from archserve.models.layers.kv_scales import KVCacheScales, checkpoint_kv_scale
from archserve.models.layers.linear import Linear, add_in_last_gemm
from archserve.models.layers.norm import RMSNorm
from archserve.models.layers.norm_folding import float_matrices
from archserve.models.layers.parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from archserve.models.layers.parallel_linear import (
    GateUpParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from archserve.models.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig

# checkpoint module name -> (our fused module name, shard)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_SHARD_MODULES = {(fused, shard): hf for hf, (fused, shard) in _FUSED_SHARDS.items()}
# Checkpoint entries that carry no weights we use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Checkpoint names of tensors a layer of ours holds one module down: the attention sinks
# (gpt-oss's ``self_attn.sinks``) belong to the Attention op inside self_attn. Renamed only
# where the model has no tensor of the checkpoint's name (a DeepSeek V4 layer holds its own).
_RENAMED_SUFFIXES = {".self_attn.sinks": ".self_attn.attn.sinks"}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        h, d = config.num_heads, config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, h, config.num_kv_heads,
                                          bias=config.attention_bias)
        self.o_proj = RowParallelLinear(h * d, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = RotaryEmbedding(d, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)
        heads = self.qkv_proj.heads          # this rank's heads
        sinks = config.attention_facts.has_sinks
        self.attn = Attention(heads.num_heads, heads.num_kv_heads, d, scale=d ** -0.5,
                              layer_index=layer_index,
                              sliding_window=config.layer_sliding_windows[layer_index],
                              sinks_of=(heads.first_head, h) if sinks else None)
        self.head_dim = d

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self._heads(positions, self.qkv_proj(hidden)))

    def forward_after_norm(self, positions: torch.Tensor, hidden: torch.Tensor,
                           residual: torch.Tensor | None, norm: RMSNorm
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward(norm(hidden, residual)) and the new residual, the norm fused into the
        QKV GEMM where the linear routine can; the residual None where o_proj added it
        (``add_in_last_gemm``)."""
        qkv, residual = self.qkv_proj.forward_after_norm(hidden, residual, norm)
        return add_in_last_gemm(self.o_proj, self._heads(positions, qkv), residual)

    def input_matrices(self) -> list[torch.Tensor] | None:
        return float_matrices(self.qkv_proj)

    def _heads(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The attention's output heads, o_proj's input."""
        return self.attn.forward_qkv(positions, qkv, self.rotary_emb, self.q_norm, self.k_norm)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(config.hidden_size, config.intermediate_size,
                                                 bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_mul(x))

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                           norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward(norm(x, residual)) and the new residual, the norm fused into the
        gate/up GEMM where the linear routine can; the residual None where down_proj added
        it (``add_in_last_gemm``)."""
        act, residual = self.gate_up_proj.forward_silu_mul_after_norm(x, residual, norm)
        return add_in_last_gemm(self.down_proj, act, residual)

    def input_matrices(self) -> list[torch.Tensor] | None:
        return float_matrices(self.gate_up_proj)


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP, each after an RMSNorm. A family whose MLP differs (a sparse MoE
    block) passes its own, under the name its checkpoints give it; one whose attention
    differs (DeepSeek's MLA) passes that."""

    def __init__(self, config: ModelConfig, layer_index: int, mlp: nn.Module | None = None,
                 mlp_name: str = "mlp", attention: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attention if attention is not None else LlamaAttention(config,
                                                                                layer_index)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp if mlp is not None else LlamaMLP(config))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, residual): their sum is the residual stream after the layer; residual
        None where the layer's last GEMM added it (norm_folding.py)."""
        hidden, residual = _after_norm(self.self_attn, self.input_layernorm, hidden, residual,
                                       positions)
        return _after_norm(getattr(self, self.mlp_name), self.post_attention_layernorm,
                           hidden, residual)

    def norms_and_readers(self) -> list[tuple[nn.Module, nn.Module]]:
        """Each norm with the block that reads its output (norm_folding.py)."""
        return [(self.input_layernorm, self.self_attn),
                (self.post_attention_layernorm, getattr(self, self.mlp_name))]


def _after_norm(block: nn.Module, norm: RMSNorm, hidden: torch.Tensor,
                residual: torch.Tensor | None, *args: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """block(*args, norm(hidden, residual)) and the new residual; a block that can take the
    norm into its first GEMM (``forward_after_norm``) is handed it, and may return the
    residual None, having added it itself."""
    after_norm = getattr(block, "forward_after_norm", None)
    if after_norm is not None:
        return after_norm(*args, hidden, residual, norm)
    hidden, residual = norm(hidden, residual)
    return block(*args, hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        """One decoder layer (a family whose MLP differs builds its own)."""
        return LlamaDecoderLayer(config, layer_index)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    op_kinds = ("attention", "linear")      # what routing must find a backend for
    # The decoder stack; a family with other layers (Gemma 3) swaps it and keeps the
    # checkpoint handling below, which reads only module names.
    model_class: type[nn.Module] = LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: long [T] -> hidden [T, hidden_size]."""
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """hidden [N, hidden_size] (rows to sample from) -> float32 logits [N, vocab];
        in ``out`` where the LM head can write them there (LMHead.forward)."""
        return self.lm_head(hidden, out)

    # ---- weights -------------------------------------------------------------------------

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must provide, by its Hugging Face name, with its shape.

        Linear layers answer for themselves (a quantized one stores scales, packed
        integers ...); a fused layer answers once per checkpoint matrix it fuses.
        """
        shapes: dict[str, tuple[int, ...]] = {}
        for hf_module, (module, shard) in self.linear_checkpoint_modules().items():
            for param in module.checkpoint_params():
                shapes[f"{hf_module}.{param}"] = module.shard_shape(shard, param)
        modules = dict(self.named_modules())
        # named_parameters lists a tied lm_head weight once, under the embedding.
        for name, param in self.named_parameters():
            owner, _, param_name = name.rpartition(".")
            if isinstance(modules[owner], Linear):
                continue
            # A vocabulary-parallel layer holds part of what the checkpoint stores.
            whole = getattr(modules[owner], "checkpoint_shape", None)
            shapes[name] = whole(param_name) if whole else tuple(param.shape)
        return shapes

    def linear_checkpoint_modules(self) -> dict[str, tuple[Linear, str | None]]:
        """HF module name -> (our linear layer, its shard) for every checkpoint linear."""
        out: dict[str, tuple[Linear, str | None]] = {}
        for name, module in self.named_modules():
            if not isinstance(module, Linear):
                continue
            prefix, _, own = name.rpartition(".")
            for shard in module.shard_names:
                hf_module = name if shard is None else f"{prefix}.{_SHARD_MODULES[own, shard]}"
                out[hf_module] = (module, shard)
        return out

    def checkpoint_module_name(self, name: str) -> str | None:
        """A module name of this family's checkpoints (or of an adapter trained on one) in
        the names ``linear_checkpoint_modules`` uses; None for a part the model does not
        run. A family whose checkpoints nest the decoder (multimodal Gemma 3) renames."""
        return name

    @staticmethod
    def _load_kv_scale(name: str, tensor: torch.Tensor, modules: dict[str, nn.Module]) -> bool:
        """Give an fp8 KV-cache scale to its attention layer; False if ``name`` is none."""
        found = _kv_scale_layer(name, modules)
        if found is None:
            return False
        layer, planes = found
        try:
            layer.load_kv_scale(planes, tensor)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (hf_name, tensor) pairs into the model, fusing q/k/v and gate/up.

        Raises ValueError naming every missing, unexpected or mis-shaped tensor: that is
        what a config that does not match its weights looks like.
        """
        expected = self.checkpoint_shapes()
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        linears = self.linear_checkpoint_modules()
        loaded: set[str] = set()
        unexpected: list[str] = []
        mismatched: list[str] = []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name not in expected:
                name = next((name.removesuffix(old) + new for old, new in _RENAMED_SUFFIXES.items()
                             if name.endswith(old)), name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still store the copy
            if self._load_kv_scale(name, tensor, modules):
                loaded.add(name)
                continue
            if name not in expected:
                unexpected.append(name)
                continue
            if not _same_shape(tuple(tensor.shape), expected[name]):
                mismatched.append(f"{name}: checkpoint {tuple(tensor.shape)}, "
                                  f"model {expected[name]}")
                continue
            module_path, _, param_name = name.rpartition(".")
            if module_path in linears:
                module, shard = linears[module_path]
                module.load_shard(shard, param_name, tensor.reshape(expected[name]))
            elif hasattr(modules[module_path], "load_checkpoint"):
                modules[module_path].load_checkpoint(param_name, tensor)
            else:
                with torch.no_grad():
                    params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(n for n in set(expected) - loaded
                         if not _optional(n, linears, modules))
        if missing or unexpected or mismatched:
            raise ValueError(_weights_mismatch_message(missing, unexpected, mismatched))
        return loaded


def _kv_scale_layer(name: str, modules: dict[str, nn.Module]) -> tuple[KVCacheScales, tuple[str, ...]] | None:
    """The attention layer a checkpoint's KV-cache scale belongs to, and its planes."""
    target = checkpoint_kv_scale(name)
    if target is None or target[0] not in modules:
        return None
    module = modules[target[0]]
    layer = getattr(module, "attn", module)   # Llama's self_attn holds an Attention; MLA is one
    return (layer, target[1]) if isinstance(layer, KVCacheScales) else None


def _same_shape(got: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Equal up to size-1 dimensions: a per-tensor scale is stored as [], [1] or [1, 1]."""
    return [d for d in got if d != 1] == [d for d in expected if d != 1]


def _optional(name: str, linears: dict[str, tuple[Linear, str | None]],
              modules: dict[str, nn.Module]) -> bool:
    """A tensor some checkpoints of the layer's format leave out (a symmetric zero point);
    a quantized expert matrix answers for itself."""
    module_path, _, param = name.rpartition(".")
    module = linears.get(module_path, (None, None))[0]
    if module is None:
        owner = modules.get(module_path)
        return owner is not None and hasattr(owner, "optional") and owner.optional(param)
    return module.quant is not None and module.quant.optional(param)


def _weights_mismatch_message(missing: list[str], unexpected: list[str],
                              mismatched: list[str]) -> str:
    def listing(title: str, names: list[str]) -> str:
        shown = ", ".join(names[:8]) + (f" ... ({len(names)} in all)" if len(names) > 8 else "")
        return f"{title}: {shown}"

    parts = [listing(title, names) for title, names in
             (("shape mismatch", mismatched), ("missing", missing), ("unexpected", unexpected))
             if names]
    return "checkpoint does not match the model config; " + "; ".join(parts)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
