"""DeepSeek's multi-head latent attention (MLA) layer, absorbed form.

Per token the layer projects hidden -> q (through the q LoRA ``q_a_proj``/``q_a_layernorm``/
``q_b_proj`` when ``q_lora_rank`` is set, else ``q_proj``) and hidden -> ``kv_a_proj_with_mqa``
= [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]. The paged cache keeps only the normalised
c_kv and the rotated k_pe (one entry per token, shared by every head).

``kv_b_proj`` [H * (nope + v), kv_lora_rank] holds W_UK and W_UV per head. Rather than
expanding the cache to per-head keys and values, W_UK can be absorbed into the query
(q_nope . W_UK c_kv = (W_UK^T q_nope) . c_kv) and W_UV applied to the attention output over
the latent, so attention reads only the latent. The layer hands both halves to the
``mla_attention`` implementation, which picks the form per step (kernels/mla/interface.py).

RoPE: DeepSeek stores the rope dimensions as interleaved pairs (V2 always, V3 when
``rope_interleave``); they are de-interleaved (evens, then odds) for both q and k before the
neox rotation, which leaves every q.k product unchanged. The softmax scale is
qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN.

Sparse MLA (DeepSeek-V3.2, GLM-5: ``ModelConfig.sparse_attention``): each query attends to
the ``index_topk`` keys its lightning indexer (models/layers/indexer.py) scores best; the
layer hands the indexer's query, key and weights to the implementation's ``forward_sparse``
(kernels/sparse_mla/interface.py), which keeps the key beside the latent in the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from archserve.distributed.layout import split_heads
from archserve.distributed.parallel_state import get_tp
from archserve.kernels.sparse_mla.interface import IndexerInputs
from archserve.models.layers.attention import attend_or_record, register_attention_layer
from archserve.models.layers.forward_context import (
    get_forward_context,
    op_region,
)
from archserve.models.layers.indexer import LightningIndexer
from archserve.models.layers.kv_scales import KVCacheScales
from archserve.models.layers.linear import DenseMatrix, Linear, add_in_last_gemm
from archserve.models.layers.norm import RMSNorm
from archserve.models.layers.norm_folding import float_matrices
from archserve.models.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from archserve.models.layers.rotary import RotaryEmbedding, deinterleave, yarn_mscale

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig

LORA_NORM_EPS = 1e-6   # the q/kv LoRA norms use the RMSNorm default, not rms_norm_eps


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    scale = qk_head_dim ** -0.5
    scaling = rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        mscale_all_dim = scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_mscale(float(scaling["factor"]), float(mscale_all_dim))
            scale *= m * m
    return scale


class MLAAttention(nn.Module, KVCacheScales):
    def __init__(self, config: ModelConfig, layer_index: int, rope_interleaved: bool = True
                 ) -> None:
        super().__init__()
        m = config.mla
        assert m is not None
        self.dims, self.layer_index = m, layer_index
        self.layer_key = register_attention_layer(self)
        # Tensor parallelism splits the heads: each rank projects its heads' queries, keeps
        # its heads' rows of kv_b_proj, and o_proj reduces over the heads' outputs. The
        # latent (kv_a_proj_with_mqa and the cache) is every head's, so every rank holds it
        # whole, as vLLM's MLA ranks do.
        tp = get_tp()
        heads = split_heads(config.num_heads, config.num_heads, tp.size, tp.rank)
        whole, self.num_heads = config.num_heads, heads.num_heads
        h, first = heads.num_heads, heads.first_head
        hidden, bias = config.hidden_size, config.attention_bias
        qk, kv_b = m.qk_head_dim, m.qk_nope_head_dim + m.v_head_dim
        if m.q_lora_rank:
            self.q_a_proj = Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, whole * qk, first * qk, h * qk)
        else:
            self.q_proj = ColumnParallelLinear(hidden, whole * qk, first * qk, h * qk)
        self.kv_a_proj_with_mqa = Linear(hidden, m.latent_size, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        # Not a Linear: the layer reads its matrix (absorbed into q and the output), so it
        # is in the model dtype, dequantized at load where the checkpoint quantizes it.
        self.kv_b_proj = DenseMatrix(h * kv_b, m.kv_lora_rank,
                                     split_rows=(first * kv_b, whole * kv_b)
                                     if tp.size > 1 else None)
        self.o_proj = RowParallelLinear(whole * m.v_head_dim, hidden, bias=bias)
        self.rotary_emb = RotaryEmbedding(m.qk_rope_head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)
        self.rope_interleaved = rope_interleaved
        self.scale = mla_softmax_scale(m.qk_head_dim, config.rope_scaling)
        # Sparse MLA (DSA): this layer's lightning indexer, or None where it reuses the
        # previous indexer layer's selection (GLM-5's shared layers); dense MLA: neither.
        sparse = config.sparse_attention
        self.index_topk = sparse.index_topk if sparse is not None else None
        self.indexer = (LightningIndexer(config)
                        if sparse is not None and sparse.indexer_layers[layer_index] else None)

    def _query(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(q [T, H * qk_head_dim], the q LoRA's normalised output where the indexer reads
        it, else None)."""
        if self.dims.q_lora_rank:
            out = self.q_b_proj.forward_after_norm(self.q_a_proj(hidden), None,
                                                   self.q_a_layernorm,
                                                   keep_normed=self.indexer is not None)
            return out[0], out[2] if self.indexer is not None else None
        return self.q_proj(hidden), None

    def forward_after_norm(self, positions: torch.Tensor, hidden: torch.Tensor,
                           residual: torch.Tensor | None, norm: RMSNorm
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(hidden, residual)) and the new residual, the norm fused into
        kv_a_proj_with_mqa's GEMV where the linear routine can; that kernel also writes
        the normalised rows, which the query projection reads. kv_a is the narrower of the
        two (576 rows against q's 3,072 or q_a's 1,536): every program of a GEMV with the
        norm in its prologue reads the whole row, so the fewer programs the better."""
        kv_a, residual, hidden = self.kv_a_proj_with_mqa.forward_after_norm(
            hidden, residual, norm, keep_normed=True)
        return add_in_last_gemm(self.o_proj, self._heads(positions, hidden, kv_a), residual)

    def input_matrices(self) -> list[torch.Tensor] | None:
        """The matrices that read the layer's input (norm_folding.py)."""
        query = self.q_a_proj if self.dims.q_lora_rank else self.q_proj
        matrices = float_matrices(query, self.kv_a_proj_with_mqa)
        if matrices is None or self.indexer is None:
            return matrices
        indexer = self.indexer.reader_matrices()
        return None if indexer is None else matrices + indexer

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV [H, v, L]) from kv_b_proj."""
        m = self.dims
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim,
                                       m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self._heads(positions, hidden))

    def _heads(self, positions: torch.Tensor, hidden: torch.Tensor,
               kv_a: torch.Tensor | None = None) -> torch.Tensor:
        """The heads' values [T, H * v] o_proj reads, of (normalised) ``hidden``; ``kv_a``:
        its kv_a_proj_with_mqa output, where ``forward_after_norm`` ran that GEMV."""
        m, h, t = self.dims, self.num_heads, hidden.shape[0]
        q, q_resid = self._query(hidden)
        if kv_a is None:
            kv_a = self.kv_a_proj_with_mqa(hidden)
        ctx = get_forward_context()
        if self.index_topk is not None:
            return self._sparse_heads(positions, hidden, q, q_resid, kv_a)
        # An implementation that takes a decode step from the projections themselves does
        # the norm, rotary, latent write and W_UK in one kernel (TRITON_MLA); None: it
        # cannot here, and the steps below run.
        from_projections = getattr(ctx.attn_impl, "decode_from_projections", None)
        if from_projections is not None:
            with op_region("attention"):
                out = from_projections(
                    q, kv_a, positions, self.rotary_emb.cos_cache, self.rotary_emb.sin_cache,
                    self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, self.rope_interleaved,
                    ctx.kv_caches[self.layer_index], ctx.attn_metadata,
                    *self._absorbed_weights(), self.scale)
            if out is not None:
                return out.reshape(t, h * m.v_head_dim)
        return attend_or_record(self, *self._split_and_rotate(positions, q, kv_a))

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
               *indexer: torch.Tensor) -> torch.Tensor:
        """The latent's cache write and attention, eagerly -> [T, H * v]; ``indexer``:
        sparse MLA's query, key and weights where this layer has the indexer."""
        ctx = get_forward_context()
        w_uk, w_uv = self._absorbed_weights()
        if self.index_topk is not None:
            index = IndexerInputs(*indexer) if indexer else None
            with op_region("attention"):
                out, ctx.sparse_selection = ctx.attn_impl.forward_sparse(
                    q_nope, q_pe, latent, ctx.kv_caches[self.layer_index], ctx.attn_metadata,
                    w_uk, w_uv, self.scale, self.index_topk, index,
                    None if index is not None else ctx.sparse_selection)
        else:
            # One scale for the latent: MLA's cache has one plane, written and read as "k".
            k_scale, _ = self.kv_scales(ctx.kv_cache_dtype, ctx.calibrate_kv_scales, latent,
                                        latent)
            with op_region("attention"):
                out = ctx.attn_impl.forward(q_nope, q_pe, latent,
                                            ctx.kv_caches[self.layer_index], ctx.attn_metadata,
                                            w_uk, w_uv, self.scale, k_scale)
        return out.reshape(q_nope.shape[0], self.num_heads * self.dims.v_head_dim)

    def attended_shape(self, q_nope: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return q_nope.new_empty(q_nope.shape[0], self.num_heads * self.dims.v_head_dim)

    def _split_and_rotate(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, H, nope], rotated q_pe [T, H, rope], the latent [T, L + rope]: the
        normalised c_kv and the rotated k_pe) of the projections."""
        m, h, t = self.dims, self.num_heads, q.shape[0]
        q_nope, q_pe = q.view(t, h, m.qk_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())[0]
        if self.rope_interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, -1), k_pe.contiguous())
        return q_nope, q_pe.view(t, h, m.qk_rope_head_dim), torch.cat((c_kv, k_pe), dim=-1)

    def _sparse_heads(self, positions: torch.Tensor, hidden: torch.Tensor,
                      q: torch.Tensor, q_resid: torch.Tensor | None, kv_a: torch.Tensor
                      ) -> torch.Tensor:
        """Sparse MLA: the indexer's projections (or, without an indexer here, the
        selection an earlier layer left in the forward context) and the implementation's
        ``forward_sparse``; this layer's selection is left there for the layers that reuse
        it (GLM-5's shared layers)."""
        q_nope, q_pe, latent = self._split_and_rotate(positions, q, kv_a)
        if self.indexer is None:
            return attend_or_record(self, q_nope, q_pe, latent)
        index = self.indexer(hidden, q_resid, positions, self.rotary_emb)
        return attend_or_record(self, q_nope, q_pe, latent, index.query, index.key,
                                index.weights)
