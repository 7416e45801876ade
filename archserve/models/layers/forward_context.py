"""The per-step state every attention layer needs, set by the model runner around a forward.

Models stay free of engine plumbing: a layer fetches the batch metadata, its own KV cache
tensor and the selected attention implementation from here instead of taking them as
forward arguments threaded through every module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from archserve.kernels.attention.interface import AttentionImpl, AttentionMetadata
from archserve.kernels.lora.interface import LoRAImpl, LoRAMapping


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]          # one [2, blocks, block_size, Hkv, D] tensor per layer
    attn_impl: AttentionImpl
    kv_cache_dtype: str = "auto"           # forwarded to AttentionLayerParams.kv_cache_dtype
    # Set on the first real prefill under calculate_kv_scales: each layer measures its
    # fp8 cache scales from this forward's keys and values (models/layers/kv_scales.py).
    calibrate_kv_scales: bool = False
    # Sparse MLA: the latest indexer layer's selection ([T, topk] positions, or None where
    # the step ran dense), which the layers that share it read (GLM-5).
    sparse_selection: torch.Tensor | None = None
    # Set when the step's tokens may take LoRA adapters: each layer with adapter slots
    # adds its delta through ``lora_impl`` (models/layers/linear.py, ``Linear.add_lora``).
    lora_mapping: LoRAMapping | None = None
    lora_impl: LoRAImpl | None = None


_current: ForwardContext | None = None

# Op regions inside the forward (``archserve.op::NAME`` in a torch profile), by which the
# self-check's CPU profile attributes time; free when no profiler runs.
OP_PREFIX = "archserve.op::"
_NOTHING = nullcontext()


def profiled_region(label: str):
    """``label`` as a region of a running torch profile; a no-op (one C-level flag check)
    otherwise. The engine's step phases (engine/phases.py) and the ops below use it."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(label)
    return _NOTHING


def op_region(name: str):
    return profiled_region(OP_PREFIX + name)


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` visible to every layer for the duration of one forward (nests)."""
    global _current
    previous = _current
    _current = ctx
    try:
        yield ctx
    finally:
        _current = previous


def current_forward_context() -> ForwardContext | None:
    """The forward context, or None outside a forward (a layer called on its own)."""
    return _current


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context is set: wrap the model forward in "
                           "set_forward_context(ForwardContext(...))")
    return _current
