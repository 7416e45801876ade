"""Sizing and allocating the paged KV cache pool (the engine owns the layout)."""

from __future__ import annotations

import torch

from archserve.kernels.attention.interface import kv_cache_shape

DEFAULT_CPU_KV_BYTES = 1 << 30   # 1 GiB: plenty for the tiny and embedded models on a CPU


def kv_dtype_of(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    return model_dtype


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                    dtype: torch.dtype, planes: int = 2) -> int:
    """planes: 2 (keys and values) or 1 (an MLA latent, one "head" of the latent size)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return planes * num_layers * block_size * num_kv_heads * head_size * elem


def blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    return max(0, budget_bytes // per_block)


def cache_row_format(model_config, attn_impl, kv_dtype: torch.dtype
                     ) -> tuple[torch.dtype, int]:
    """(element dtype, head size) of the model's paged cache: ``kv_dtype`` rows of the
    model's kv_cache_head_size, or, for an implementation that lays out its own rows (sparse
    MLA: the latent beside the indexer key, kernels/sparse_mla/layout.py), its layout's."""
    layout = getattr(attn_impl, "layout", None)
    if layout is not None:
        return layout.storage_dtype, layout.row_size
    return kv_dtype, model_config.kv_cache_head_size


def compressed_layouts(model_config, dtype: torch.dtype, block_size: int) -> list | None:
    """Each layer's cache of a DeepSeek V4 model (kernels/compressed_attention/layout.py: a
    block's compressed entries, index keys and compressor state, a sequence's ring of window
    keys, in ``dtype``), or None for any other model."""
    dims = getattr(model_config, "compressed_attention", None)
    if dims is None:
        return None
    from archserve.kernels.compressed_attention.layout import layer_layouts
    return layer_layouts(dims.layer_kinds, dims.compress_rates, dims.sliding_window,
                         model_config.head_dim, dims.index_head_dim, dtype, block_size)


def ring_rows(model_config) -> int:
    """Rows of the window ring a sequence of this model holds per layer (DeepSeek V4: its
    window; kernels/compressed_attention/layout.py), 0 for a model without rings."""
    dims = getattr(model_config, "compressed_attention", None)
    return dims.sliding_window if dims is not None else 0


def ring_bytes_per_sequence(model_config, kv_dtype: torch.dtype, block_size: int) -> int:
    """Bytes one sequence's window rings take over every layer (0: no rings)."""
    layouts = compressed_layouts(model_config, kv_dtype, block_size)
    return sum(layout.ring_bytes for layout in layouts) if layouts is not None else 0


def cache_bytes_per_block(model_config, attn_impl, kv_dtype: torch.dtype, block_size: int
                          ) -> int:
    """Bytes one block id takes over every layer's cache."""
    layouts = compressed_layouts(model_config, kv_dtype, block_size)
    if layouts is not None:
        return sum(layout.block_size * layout.row_bytes for layout in layouts)
    row_dtype, head_size = cache_row_format(model_config, attn_impl, kv_dtype)
    return bytes_per_block(model_config.num_layers, block_size, model_config.kv_cache_heads,
                           head_size, row_dtype, model_config.kv_cache_planes)


def model_kv_caches(model_config, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device, head_size: int | None = None, num_rings: int = 1
                    ) -> list[torch.Tensor]:
    """The paged cache of every layer in the model's layout (MLA: one latent plane; V4: each
    layer's blocks, ``compressed_layouts``, then each layer's ``num_rings`` window rings:
    layout.py's ``ring_cache_index``); ``head_size`` where the rows are not the model's
    (``cache_row_format``)."""
    layouts = compressed_layouts(model_config, dtype, block_size)
    if layouts is not None:
        return (_allocate_layer_blocks(layouts, num_blocks, device)
                + [layout.allocate_rings(num_rings, device) for layout in layouts])
    return allocate_kv_caches(model_config.num_layers, num_blocks, block_size,
                              model_config.kv_cache_heads,
                              head_size or model_config.kv_cache_head_size,
                              dtype, device, model_config.kv_cache_planes)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int, dtype: torch.dtype, device: torch.device,
                       planes: int = 2) -> list[torch.Tensor]:
    """One contiguous allocation, viewed per layer (one free, one pointer per layer)."""
    shape = (planes, *kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)[1:])
    pool = torch.zeros((num_layers, *shape), dtype=dtype, device=device)
    return list(pool.unbind(0))


def _allocate_layer_blocks(layouts: list, num_blocks: int, device: torch.device
                           ) -> list[torch.Tensor]:
    """One uint8 allocation, a [1, blocks, block_size, 1, row_bytes] view per layer (each
    layer's rows as wide as its layout needs)."""
    sizes = [num_blocks * layout.block_size * layout.row_bytes for layout in layouts]
    pool = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
    out, start = [], 0
    for layout, size in zip(layouts, sizes, strict=True):
        out.append(pool[start:start + size].view(1, num_blocks, layout.block_size, 1,
                                                 layout.row_bytes))
        start += size
    return out


def cuda_available_kv_bytes(device: torch.device, utilization: float, peak_activation_bytes: int,
                            reserve_bytes: int = 0) -> int:
    """What is left for the KV pool: the utilisation share of the card, minus everything
    already in use (weights, other processes, the CUDA context), minus the activation
    peak measured by a profiling forward, minus a reserve (CUDA graphs)."""
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    return int(total * utilization - in_use - peak_activation_bytes - reserve_bytes)
