"""The attention layer models use; the computation belongs to the selected backend."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from archserve.kernels.attention.interface import AttentionLayerParams, DecodeRows
from archserve.kernels.attention.preamble import attention_preamble
from archserve.models.layers.forward_context import get_forward_context, op_region
from archserve.models.layers.kv_scales import KVCacheScales
from archserve.models.layers.norm import RMSNorm
from archserve.models.layers.rotary import RotaryEmbedding

# Attention layers by a number of their own, which the opaque op below finds its layer by
# (several models live in one process: a drafter beside its target, tests). A layer there
# has ``attend(*inputs)`` (its cache writes and attention, run eagerly) and
# ``attended_shape(*inputs)`` (an empty tensor shaped as attend's result).
_LAYERS: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_LAYER_KEYS = itertools.count()
# While a decode step is traced: its cache reads and writes as the graph's inputs.
_traced_step: DecodeRows | None = None


@contextlib.contextmanager
def attention_in_traced_step(step: DecodeRows) -> Iterator[None]:
    """Within the block (a decode step being traced: engine/cpu_compiled_step.py) an
    attention layer is recorded as the tensor ops of its backend's ``decode_in_graph``,
    which read the step's slots, cache rows and lengths from ``step``, the graph's
    inputs; a layer whose backend has no such form (and every MLA and compressed
    attention layer) is recorded as ``layer_attention_op``, one opaque op that reads them
    from the forward context when it runs. Either way a graph traced once serves every
    context length and step."""
    global _traced_step
    previous, _traced_step = _traced_step, step
    try:
        yield
    finally:
        _traced_step = previous


def register_attention_layer(layer: nn.Module) -> int:
    """The key ``layer_attention_op`` finds ``layer`` by."""
    key = next(_LAYER_KEYS)
    _LAYERS[key] = layer
    return key


@torch.library.custom_op("archserve::layer_attention", mutates_args=())
def layer_attention_op(inputs: list[torch.Tensor | None], layer_key: int) -> torch.Tensor:
    """One layer's cache writes and attention (its ``attend``), opaque to a tracer: the
    cache and the step's metadata come from the forward context when it runs."""
    return _LAYERS[layer_key].attend(*inputs)


@layer_attention_op.register_fake
def _layer_attention_shape(inputs: list[torch.Tensor | None], layer_key: int) -> torch.Tensor:
    return _LAYERS[layer_key].attended_shape(*inputs)


def attend_or_record(layer: nn.Module, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``layer.attend(*inputs)``; while a decode step is traced, the opaque op that calls
    it when the step runs (its data-dependent loops and cache writes stay out of the
    graph, which the rest of the step's ops can then be compiled into)."""
    if _traced_step is not None:
        return layer_attention_op(list(inputs), layer.layer_key)
    return layer.attend(*inputs)


class Attention(nn.Module, KVCacheScales):
    """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D] through ``ForwardContext.attn_impl``.

    ``sinks_of``: (this rank's first query head, the checkpoint's query heads) where the
    layer has attention sinks (gpt-oss): a learned logit per query head, the parameter
    ``sinks`` [num_heads] (float32), which answers the loader for the checkpoint's whole
    vector and keeps this rank's heads of it."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 layer_index: int, sliding_window: int | None = None,
                 logit_soft_cap: float | None = None,
                 sinks_of: tuple[int, int] | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.layer_index = layer_index
        self.sinks_of = sinks_of
        self.sinks = (None if sinks_of is None else
                      nn.Parameter(torch.zeros(num_heads, dtype=torch.float32),
                                   requires_grad=False))
        self.params = AttentionLayerParams(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, scale=scale,
            sliding_window=sliding_window, logit_soft_cap=logit_soft_cap)
        self.layer_key = register_attention_layer(self)

    def checkpoint_shape(self, param: str) -> tuple[int, ...]:
        """The checkpoint's ``sinks``: one per query head of the whole layer."""
        return (self.sinks_of[1],)

    @torch.no_grad()
    def load_checkpoint(self, param: str, tensor: torch.Tensor) -> None:
        self.sinks.copy_(tensor.narrow(0, self.sinks_of[0], self.num_heads))

    def _params_for(self, kv_cache_dtype: str) -> AttentionLayerParams:
        if self.params.kv_cache_dtype != kv_cache_dtype or self.params.sinks is not self.sinks:
            # Fixed for a whole run (the sinks once loaded), so this rebuild happens once.
            self.params = dataclasses.replace(self.params, kv_cache_dtype=kv_cache_dtype,
                                              sinks=self.sinks)
        return self.params

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, rotary: RotaryEmbedding,
                    q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                    ) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) D] straight from the QKV GEMM -> [T, H*D]: per-head q/k
        norm, rotary, the cache write and attention (the first three one kernel where the
        fused route allows, see ``attention_preamble``)."""
        if q_norm is not None and q_norm.identity_weight != 1.0:
            # Every path here scales by the weight itself; Gemma's (1 + w) norm is not one.
            raise ValueError(f"{type(q_norm).__name__} q/k norms are not supported here")
        ctx = get_forward_context()
        norm_weights = None if q_norm is None else (q_norm.weight, k_norm.weight)
        q, k, v = attention_preamble(
            qkv, positions, rotary.cos_cache, rotary.sin_cache, norm_weights,
            q_norm.eps if q_norm is not None else 0.0, self.num_heads, self.num_kv_heads,
            ctx.kv_caches[self.layer_index], ctx.attn_metadata.slot_mapping,
            getattr(ctx.attn_impl, "takes_written_kv", False))
        return self(q, k, v)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
                ) -> torch.Tensor:
        """k and v None: this step's keys and values are already in the cache."""
        if _traced_step is not None:
            return self._traced_forward(q, k, v, _traced_step)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
               ) -> torch.Tensor:
        """The cache write and attention, eagerly: q [T, H*D] -> [T, H*D]."""
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        k_scale, v_scale = self.kv_scales(ctx.kv_cache_dtype, ctx.calibrate_kv_scales, k, v)
        with op_region("attention"):   # the self-check's CPU profile attributes time by it
            out = ctx.attn_impl.forward(
                *self._heads(q, k, v),
                kv_cache=ctx.kv_caches[self.layer_index],
                meta=ctx.attn_metadata,
                layer=self._params_for(ctx.kv_cache_dtype),
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def _heads(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q [T, H, D], k/v [T, Hkv, D] (None stays None)."""
        num_tokens = q.shape[0]
        return (q.view(num_tokens, self.num_heads, self.head_size),
                None if k is None else k.view(num_tokens, self.num_kv_heads, self.head_size),
                None if v is None else v.view(num_tokens, self.num_kv_heads, self.head_size))

    def _traced_forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                        step: DecodeRows) -> torch.Tensor:
        """``forward`` as a traced decode step records it (``attention_in_traced_step``)."""
        ctx = get_forward_context()
        in_graph = getattr(ctx.attn_impl, "decode_in_graph", None)
        if in_graph is not None:
            k_scale, v_scale = self.kv_scales(ctx.kv_cache_dtype, False, k, v)
            out = in_graph(*self._heads(q, k, v), ctx.kv_caches[self.layer_index], step,
                           self._params_for(ctx.kv_cache_dtype), k_scale, v_scale)
            if out is not None:
                return out.reshape(q.shape[0], self.num_heads * self.head_size)
        return layer_attention_op([q.flatten(1), k, v], self.layer_key)

    def attended_shape(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
                       ) -> torch.Tensor:
        return torch.empty_like(q)
