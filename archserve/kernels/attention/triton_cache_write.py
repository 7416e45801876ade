"""Triton reshape-and-cache: scatter this step's keys and values into the paged KV cache.

Also holds the jit helpers that turn token positions of a sequence into addresses in the
paged cache and read a K/V tile from there, so the write kernel and the attention kernels
share a single notion of the layout ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.linear.triton_fp8_bits import e4m3_bits_to_fp16, fp32_to_e4m3_bits
from archserve.platform.capability import SM80, SM89, Capability
from archserve.platform.detect import device_info_for

FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# An e4m3 cache read as bytes holds value / 256 once widened (e4m3_bits_to_fp16): the
# readers fold this factor into their K and V scales.
E4M3_BITS_SCALE = 256.0


@triton.jit
def fp32_to_e5m2_bits(v):
    """fp32 ``v`` with |v| <= 57344 -> uint8 e5m2 bits, rounded half to even (the same
    integer method as fp32_to_e4m3_bits, with two mantissa bits and exponent bias 15)."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    rounded = (mag + 0xFFFFF + ((mag >> 21) & 1)) >> 21
    normal = rounded - (112 << 2)
    scaled = tl.abs(v) * 65536.0 + 8388608.0     # subnormals: multiples of 2**-16
    sub = scaled.to(tl.uint32, bitcast=True) & 0x7
    code = tl.where(mag >= 0x38800000, normal, sub)       # 0x38800000 is 2**-14
    return (code | sign).to(tl.uint8)


E5M2_MAX = 57344.0


def e5m2_written_in_software(kv_cache: torch.Tensor) -> bool:
    """Triton's fp32 -> e5m2 conversion uses SM80 instructions: below SM80 the writer
    encodes e5m2 bytes itself (reading e5m2 needs no help on any target)."""
    return kv_cache.dtype == torch.float8_e5m2 and _cuda_below(kv_cache, SM80)


def e4m3_in_software(kv_cache: torch.Tensor) -> bool:
    """Whether an e4m3 cache must be written and read as bytes here: Triton has no e4m3
    type below SM89 (it refuses "fp8e4nv" there), so those GPUs convert with integer ops.
    e5m2 needs no help: Triton widens it on every target."""
    return kv_cache.dtype == torch.float8_e4m3fn and _cuda_below(kv_cache, SM89)


def _cuda_below(tensor: torch.Tensor, capability: Capability) -> bool:
    """Whether ``tensor``'s GPU is an NVIDIA one older than ``capability`` (the targets
    where Triton lacks a conversion); False on ROCm and the CPU."""
    device = device_info_for(tensor.device)
    return device.is_cuda and not device.has_capability(capability)


def cache_operand(kv_cache: torch.Tensor, e4m3_bits: bool | None) -> tuple[torch.Tensor, bool]:
    """(the tensor a kernel gets, whether it holds e4m3 bytes); ``None`` decides by device."""
    if e4m3_bits is None:
        e4m3_bits = e4m3_in_software(kv_cache)
    if e4m3_bits:
        assert kv_cache.dtype == torch.float8_e4m3fn, "byte mode is for an e4m3 cache"
        return kv_cache.view(torch.uint8), True
    return kv_cache, False


@triton.jit
def paged_token_offsets(block_table_row_ptr, positions, mask, stride_cache_block,
                        stride_cache_token, BLOCK_SIZE: tl.constexpr):
    """Element offsets (int64) of the cache rows holding ``positions`` of one sequence.

    The MLA decode and prefill loops compute the next tile's offsets in the current
    iteration and carry them. Computed in the iteration that loads the tile, the
    block-table load is an indirection for Triton's pipeliner: at num_stages 2-4 it then
    gives the K/V tile a single shared-memory buffer and issues its loads only after the
    previous tile's products (seen in the TTGIR for sm_90: one buffer, a wait for every copy
    at the top of the loop; ncu on the H200: the MLA decode kernel's warps waited there 22%
    of the time). Carried, the tile's loads are direct and get num_stages - 1 buffers."""
    block_ids = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=mask, other=0)
    return (block_ids.to(tl.int64) * stride_cache_block
            + (positions % BLOCK_SIZE).to(tl.int64) * stride_cache_token)


@triton.jit
def load_kv_rows(k_base, v_base, rows, mask, offs_d, mask_d, E4M3_BITS: tl.constexpr):
    """The keys and values [rows, head dim] of one KV head at cache offsets ``rows``
    (``paged_token_offsets``; masked rows and columns read 0). E4M3_BITS: the cache holds
    e4m3 bytes, widened here to fp16 value / 256 (the wrappers fold the 256 into their
    scales)."""
    kv_mask = mask[:, None] & mask_d[None, :]
    k = tl.load(k_base + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if E4M3_BITS:
        k = e4m3_bits_to_fp16(k)
        v = e4m3_bits_to_fp16(v)
    return k, v


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
                     stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                     stride_cache_kv, stride_cache_block, stride_cache_token, stride_cache_head,
                     k_scale, v_scale,
                     NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     QUANTIZE: tl.constexpr, E4M3_BITS: tl.constexpr,
                     E5M2_BITS: tl.constexpr):
    # One program per token: all its KV heads at once, so a token's row is one wide store.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # Slot -1 marks padding: masking (rather than returning) keeps the kernel branch-free.
    # The slot is broadcast to a tensor first: the interpreter mistypes scalar-bool & tensor.
    is_real = (tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot) >= 0
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE) & is_real
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims,
                    mask=mask)
    if QUANTIZE:
        key = key.to(tl.float32) / k_scale
        value = value.to(tl.float32) / v_scale
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = (cache_ptr + block * stride_cache_block + offset * stride_cache_token
           + heads * stride_cache_head + dims)
    if E4M3_BITS:   # saturate as the hardware conversion does, then round to e4m3 bytes
        key = fp32_to_e4m3_bits(tl.minimum(tl.maximum(key, -448.0), 448.0))
        value = fp32_to_e4m3_bits(tl.minimum(tl.maximum(value, -448.0), 448.0))
    if E5M2_BITS:
        key = fp32_to_e5m2_bits(tl.minimum(tl.maximum(key, -57344.0), 57344.0))
        value = fp32_to_e5m2_bits(tl.minimum(tl.maximum(value, -57344.0), 57344.0))
    element = cache_ptr.dtype.element_ty
    tl.store(dst, key.to(element), mask=mask)
    tl.store(dst + stride_cache_kv, value.to(element), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_cache(key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                   e4m3_bits: bool | None = None, e5m2_bits: bool | None = None) -> None:
    """Write key/value [T, Hkv, D] into ``kv_cache`` at ``slot_mapping`` (slot -1 skipped).

    An fp8 cache stores ``x / scale``; readers multiply by the scale again. ``e4m3_bits``
    writes an e4m3 cache as bytes (None: where the device has no e4m3 type, see
    ``e4m3_in_software``), ``e5m2_bits`` an e5m2 one (None: below SM80). A one-plane
    cache (an MLA latent) takes ``key`` alone, ``value`` None.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    # One plane: the kernel's value store rewrites the key's row (plane stride 0).
    one_plane = value is None
    if one_plane:
        value, v_scale = key, k_scale
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    assert kv_cache.stride(-1) == 1, "the KV cache's head dimension must be contiguous"
    quantize = kv_cache.dtype in FP8_CACHE_DTYPES
    if e5m2_bits is None:
        e5m2_bits = e5m2_written_in_software(kv_cache)
    if e5m2_bits:
        assert kv_cache.dtype == torch.float8_e5m2, "e5m2 byte mode is for an e5m2 cache"
        kv_cache, bits = kv_cache.view(torch.uint8), False
    else:
        kv_cache, bits = cache_operand(kv_cache, e4m3_bits)
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        0 if one_plane else kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), float(k_scale), float(v_scale),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_size),
        QUANTIZE=quantize, E4M3_BITS=bits, E5M2_BITS=e5m2_bits,
    )
