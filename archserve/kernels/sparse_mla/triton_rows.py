"""Triton reads and writes of a sparse-MLA cache row (layout.py): the latent and the indexer key.

Kernels address the cache as bytes (its uint8 view, strides in bytes) and reach each part
through a pointer of the part's type at the part's byte offset, so one kernel serves every
layout. fp8 values are written through ``fp32_to_e4m3_bits`` (exact round-half-to-even on
every target; Triton's own cast rounds wrongly in the CPU interpreter) and read through
Triton's e4m3 type, or as bytes widened by integer operations where the GPU has none
(E4M3_BITS, below SM89).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.linear.triton_fp8_bits import e4m3_bits_to_fp16, fp32_to_e4m3_bits
from archserve.kernels.sparse_mla.layout import QUANT_TILE, SparseMlaLayout, fp8_tiles
from archserve.platform.capability import SM89
from archserve.platform.detect import device_info_for

TORCH_TO_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
               torch.float32: tl.float32}


def e4m3_read_as_bits(device: torch.device) -> bool:
    """Whether kernels widen e4m3 bytes with integer operations here: GPUs without Triton's
    e4m3 type (below SM89; AMD, whose e4m3 is the fnuz variant). Asked of the platform, so
    an emulated GPU and a compile target answer as the GPU they stand for."""
    info = device_info_for(device)
    return info.platform == "rocm" or (info.is_cuda and not info.has_capability(SM89))


@triton.jit
def e4m3_bytes_to_float(bits, E4M3_BITS: tl.constexpr):
    """uint8 e4m3 bits -> fp32 values."""
    if E4M3_BITS:
        values = e4m3_bits_to_fp16(bits).to(tl.float32) * 256.0
    else:
        values = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return values


@triton.jit
def part_pointer(cache_ptr, rows, offset, DTYPE: tl.constexpr):
    """Pointers of type DTYPE to the part at byte ``offset`` of the rows at byte offsets
    ``rows`` (a vector)."""
    return (cache_ptr + rows + offset).to(tl.pointer_type(DTYPE), bitcast=True)


@triton.jit
def load_fp8_tiles(cache_ptr, rows, mask, offs_d, mask_d, VALUES: tl.constexpr,
                   SCALES: tl.constexpr, WIDTH: tl.constexpr, E4M3_BITS: tl.constexpr):
    """fp32 [rows, D] of an fp8 part of WIDTH values: e4m3 bytes at byte offset VALUES, one
    fp32 scale per QUANT_TILE values at SCALES. Masked entries read 0. A row's few scales
    are loaded once each and spread over their tile's columns by selects (not a gather a
    value)."""
    bits = tl.load(cache_ptr + rows[:, None] + VALUES + offs_d[None, :],
                   mask=mask[:, None] & mask_d[None, :], other=0)
    scale_ptr = part_pointer(cache_ptr, rows, SCALES, tl.float32)
    factor = tl.zeros([rows.shape[0], offs_d.shape[0]], tl.float32)
    for tile in tl.static_range((offs_d.shape[0] + 127) // 128):
        if tile * 128 < WIDTH:
            scale = tl.load(scale_ptr + tile, mask=mask, other=0.0)
            factor = tl.where((offs_d // 128 == tile)[None, :], scale[:, None], factor)
    return e4m3_bytes_to_float(bits, E4M3_BITS) * factor


@triton.jit
def load_index_keys(cache_ptr, rows, mask, offs_d, mask_d, OFFSET: tl.constexpr,
                    SCALES: tl.constexpr, WIDTH: tl.constexpr, FP8: tl.constexpr,
                    DTYPE: tl.constexpr, E4M3_BITS: tl.constexpr):
    """The indexer keys [rows, D] (WIDTH values) at byte offsets ``rows``, in DTYPE (an fp8
    key dequantized: e4m3 times a power of two is exact in 16 bits)."""
    if FP8:
        keys = load_fp8_tiles(cache_ptr, rows, mask, offs_d, mask_d, OFFSET, SCALES, WIDTH,
                              E4M3_BITS).to(DTYPE)
    else:
        keys = tl.load(part_pointer(cache_ptr, rows, OFFSET, DTYPE)[:, None] + offs_d[None, :],
                       mask=mask[:, None] & mask_d[None, :], other=0.0)
    return keys


@triton.jit
def _store_fp8_tiles(dst_ptr, scale_ptr, x, mask, WIDTH: tl.constexpr,
                     BLOCK_TILES: tl.constexpr, POWER_OF_TWO: tl.constexpr):
    """x [BLOCK_TILES * 128] fp32 (0 past WIDTH) -> e4m3 bytes at ``dst_ptr`` and one fp32
    scale a tile at ``scale_ptr``: amax / 448, or the power of two at or above it."""
    tiles = tl.reshape(x, [BLOCK_TILES, 128])
    amax = tl.max(tl.abs(tiles), axis=1)
    scale = tl.where(amax > 0.0, amax / 448.0, 1.0)
    if POWER_OF_TWO:   # exponent up by one unless the mantissa is zero (already a power)
        bits = scale.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
    q = tiles / scale[:, None]
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    offs = tl.arange(0, BLOCK_TILES * 128)
    tl.store(dst_ptr + offs, tl.reshape(fp32_to_e4m3_bits(q), [BLOCK_TILES * 128]),
             mask=mask & (offs < WIDTH))
    tile_ids = tl.arange(0, BLOCK_TILES)
    tl.store(scale_ptr + tile_ids, scale, mask=(tile_ids < (WIDTH + 127) // 128) & mask)


@triton.jit
def _write_rows_kernel(latent_ptr, index_ptr, cache_ptr, slot_mapping_ptr,
                       stride_latent, stride_index, stride_cache_token,
                       KV_RANK: tl.constexpr, ROPE: tl.constexpr, INDEX_DIM: tl.constexpr,
                       LATENT_FP8: tl.constexpr, INDEX_FP8: tl.constexpr,
                       SCALE_OFFSET: tl.constexpr, ROPE_OFFSET: tl.constexpr,
                       INDEX_OFFSET: tl.constexpr, INDEX_SCALE_OFFSET: tl.constexpr,
                       MODEL_DTYPE: tl.constexpr, WRITE_LATENT: tl.constexpr,
                       WRITE_INDEX: tl.constexpr, BLOCK_L: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    # One program per token. The cache is addressed per slot (block * block_size + offset)
    # as rows of stride_cache_token bytes: a layer's cache is one contiguous tensor.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    real = (tl.zeros([1], tl.int64) + slot) >= 0       # slot -1: padding, nothing written
    row = cache_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_cache_token
    if WRITE_LATENT:
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        src = latent_ptr + token * stride_latent
        c_kv = tl.load(src + offs_l, mask=offs_l < KV_RANK, other=0.0)
        k_pe = tl.load(src + KV_RANK + offs_r, mask=offs_r < ROPE, other=0.0)
        rope_dst = (row + ROPE_OFFSET).to(tl.pointer_type(MODEL_DTYPE), bitcast=True)
        tl.store(rope_dst + offs_r, k_pe.to(MODEL_DTYPE), mask=(offs_r < ROPE) & real)
        if LATENT_FP8:
            _store_fp8_tiles(row, (row + SCALE_OFFSET).to(tl.pointer_type(tl.float32),
                                                          bitcast=True),
                             c_kv.to(tl.float32), real, KV_RANK, BLOCK_L // 128, False)
        else:
            dst = row.to(tl.pointer_type(MODEL_DTYPE), bitcast=True)
            tl.store(dst + offs_l, c_kv.to(MODEL_DTYPE), mask=(offs_l < KV_RANK) & real)
    if WRITE_INDEX:
        offs_i = tl.arange(0, BLOCK_I)
        key = tl.load(index_ptr + token * stride_index + offs_i, mask=offs_i < INDEX_DIM,
                      other=0.0)
        if INDEX_FP8:
            _store_fp8_tiles(row + INDEX_OFFSET,
                             (row + INDEX_SCALE_OFFSET).to(tl.pointer_type(tl.float32),
                                                           bitcast=True),
                             key.to(tl.float32), real, INDEX_DIM, BLOCK_I // 128, True)
        else:
            dst = (row + INDEX_OFFSET).to(tl.pointer_type(MODEL_DTYPE), bitcast=True)
            tl.store(dst + offs_i, key.to(MODEL_DTYPE), mask=(offs_i < INDEX_DIM) & real)


def _tile_block(width: int, fp8: bool) -> int:
    """Values a program holds of a part: whole fp8 tiles (a power of two of them)."""
    if fp8:
        return triton.next_power_of_2(fp8_tiles(width)) * QUANT_TILE
    return max(triton.next_power_of_2(width), 16)


def write_sparse_rows(layout: SparseMlaLayout, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, latent: torch.Tensor | None,
                      index_key: torch.Tensor | None) -> None:
    """Write this step's latents [T, L + R] and indexer keys [T, I] (None: that part is not
    written, e.g. a layer that shares another's top-k keeps no key) at ``slot_mapping``."""
    num_tokens = slot_mapping.shape[0]
    write_latent = latent is not None
    write_index = index_key is not None and layout.index_dim > 0
    if num_tokens == 0 or not (write_latent or write_index):
        return
    rows = layout.byte_rows(kv_cache)
    given = latent if write_latent else index_key      # stands in for the part not written
    latent = latent if write_latent else given
    index_key = index_key if write_index else given
    assert latent.stride(-1) == 1 and index_key.stride(-1) == 1
    _write_rows_kernel[(num_tokens,)](
        latent, index_key, rows, slot_mapping, latent.stride(0), index_key.stride(0),
        rows.stride(0),
        KV_RANK=layout.kv_lora_rank, ROPE=layout.rope_dim, INDEX_DIM=layout.index_dim,
        LATENT_FP8=layout.latent_fp8, INDEX_FP8=layout.index_fp8,
        SCALE_OFFSET=layout.scale_offset, ROPE_OFFSET=layout.rope_offset,
        INDEX_OFFSET=layout.index_offset, INDEX_SCALE_OFFSET=layout.index_scale_offset,
        MODEL_DTYPE=TORCH_TO_TL[layout.model_dtype], WRITE_LATENT=write_latent,
        WRITE_INDEX=write_index,
        BLOCK_L=_tile_block(layout.kv_lora_rank, layout.latent_fp8),
        BLOCK_R=max(triton.next_power_of_2(layout.rope_dim), 16),
        BLOCK_I=_tile_block(max(layout.index_dim, 1), layout.index_fp8),
    )
