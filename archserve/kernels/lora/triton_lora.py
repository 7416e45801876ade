"""TRITON_LORA: the LoRA delta as two grouped Triton kernels (punica's SGMV idea).

A step's tokens are grouped by adapter slot through the mapping's sorted order; no row is
moved. Programs are laid out per (row tile, slot): a program of slot l handles that slot's
tokens only, so each adapter's matrices are read once per row tile, whatever the batch
mixes. The grid depends on the number of tokens and slots alone, never on the mapping's
values, so one captured CUDA graph serves every mix of adapters; programs of a slot with
fewer tokens than their tile exit at once.

- shrink: t = x A^T for every output block's down-projection at once ([T, S * R], float32),
  split over K where the rows are few (a decode step: one slot's single row would otherwise
  leave one program to read all of A), each split writing its own partial sums;
- expand: y[:, block s] += (sum of t's partials)[:, s] B_s^T, added into the layer's output
  in place; tokens without an adapter are not touched.

Both launch with PDL where it is on (kernels/pdl.py): the mapping and the adapter weights are
read before the wait (nothing before writes them); the layer's input, the partial sums and
the output after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from archserve.kernels.attention.triton_decode import dot_precision
from archserve.kernels.lora.interface import LoRAMapping, LoRASlots
from archserve.kernels.pdl import (
    pdl_enabled,
    pdl_launch_options,
    pdl_start,
    prefetch_rows_to_l2,
)

# Rows at or below which a step counts as decode-sized: few rows per slot, so programs are
# many and small for parallelism: K split, 16 rank columns a shrink program. The constants
# are first choices, not tuned on a GPU (benchmarks/bench_lora.py --set sweeps them).
FEW_ROWS = 128
K_PER_SPLIT = 512       # K columns one shrink program reads when K is split
MAX_SPLITS = 32
BLOCK_N = 128           # output columns one expand program adds to
BLOCK_K = 64


@dataclass(frozen=True)
class LoRATiles:
    block_m: int
    block_r: int          # shrink: rank columns per program
    block_k: int
    splits: int           # shrink partials over K
    k_per_split: int
    block_n: int          # expand: output columns per program
    rank_pow2: int        # expand: the rank, padded to a power of two (>= 16, tl.dot)


def lora_tiles(num_tokens: int, in_features: int, width: int, rank: int) -> LoRATiles:
    """The tiles of a step of ``num_tokens`` rows into a layer of ``in_features`` inputs and
    ``width`` = S * R down-projection rows."""
    few = num_tokens <= FEW_ROWS
    splits = min(MAX_SPLITS, triton.cdiv(in_features, K_PER_SPLIT)) if few else 1
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(in_features, k_per_split)
    return LoRATiles(block_m=16 if few else 64,
                     block_r=16 if few else max(16, min(64, triton.next_power_of_2(width))),
                     block_k=BLOCK_K, splits=splits, k_per_split=k_per_split,
                     block_n=BLOCK_N, rank_pow2=max(16, triton.next_power_of_2(rank)))


@triton.jit
def _slot_rows(mapping, slot, pid_m, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """(the rows of this program's tile of ``slot``'s tokens, which of them exist, the
    first tile row past the slot's tokens: the tile is empty when it is <= 0)."""
    count = tl.load(mapping + slot)
    start = tl.load(mapping + NUM_SLOTS + slot)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_slot = m < count
    rows = tl.load(mapping + 2 * NUM_SLOTS + 2 * (start + m) + 1, mask=in_slot, other=0)
    return rows.to(tl.int64), in_slot, count - pid_m * BLOCK_M


# One compiled variant whatever the step's size: the token count and the K split's width
# and count change with it (decode-sized steps split K; larger ones do not).
@triton.jit(do_not_specialize=["num_tokens", "k_per_split"])
def _lora_shrink_kernel(x, a, partials, mapping, num_tokens, in_features, width,
                        x_row_stride, a_slot_stride, k_per_split,
                        NUM_SLOTS: tl.constexpr, R_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        PREFETCH: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1) % R_TILES
    split = tl.program_id(1) // R_TILES
    slot = tl.program_id(2)
    rows, in_slot, rows_left = _slot_rows(mapping, slot, pid_m, NUM_SLOTS, BLOCK_M)
    if rows_left <= 0:
        return
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < width
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_features)
    a_rows = a + slot.to(tl.int64) * a_slot_stride + r.to(tl.int64) * in_features
    # The adapter's rows stream into L2 while the kernel before drains.
    prefetch_rows_to_l2(a_rows + k_begin, r_ok, k_end - k_begin, PREFETCH, PDL)
    pdl_start(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        xs = tl.load(x + rows[:, None] * x_row_stride + k[None, :],
                     mask=in_slot[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(a_rows[:, None] + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if DOT_PRECISION == "ieee":
            xs, w = xs.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(xs, tl.trans(w), input_precision=DOT_PRECISION)
    out = partials + split.to(tl.int64) * num_tokens * width + rows[:, None] * width + r[None, :]
    tl.store(out, acc, mask=in_slot[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens", "splits"])
def _lora_expand_kernel(partials, b, y, mapping, num_tokens, width, rank, splits,
                        size0, size1, size2, y_row_stride,
                        NUM_SLOTS: tl.constexpr, N_TILES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid_m = tl.program_id(0) // N_TILES
    pid_n = tl.program_id(0) % N_TILES
    block = tl.program_id(1)
    slot = tl.program_id(2)
    # Output block ``block``: its rows of y and of b, its rank columns of the partials.
    size = tl.where(block == 0, size0, tl.where(block == 1, size1, size2))
    first = tl.where(block == 0, 0, tl.where(block == 1, size0, size0 + size1))
    rows, in_slot, rows_left = _slot_rows(mapping, slot, pid_m, NUM_SLOTS, BLOCK_M)
    if (rows_left <= 0) | (pid_n * BLOCK_N >= size):
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < size
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    up = tl.load(b + (first + n[:, None]).to(tl.int64) * (NUM_SLOTS * rank) + slot * rank
                 + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    pdl_start(PDL)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # The partials of every K split: few splits only where the rows are few.
    partial = partials + rows[:, None] * width + (block * rank + r)[None, :]
    for _ in range(0, splits):
        t += tl.load(partial, mask=in_slot[:, None] & r_ok[None, :], other=0.0)
        partial += num_tokens * width
    if DOT_PRECISION == "ieee":
        delta = tl.dot(t, tl.trans(up.to(tl.float32)), input_precision=DOT_PRECISION)
    else:   # rounded to the adapter's dtype between its two matrices, as PEFT computes
        delta = tl.dot(t.to(up.dtype), tl.trans(up), input_precision=DOT_PRECISION)
    out = y + rows[:, None] * y_row_stride + (first + n)[None, :]
    mask = in_slot[:, None] & n_ok[None, :]
    total = tl.load(out, mask=mask, other=0.0).to(tl.float32) + delta
    tl.store(out, total.to(y.dtype.element_ty), mask=mask)


class TritonLoRA:
    """The TRITON_LORA implementation (kernels/lora/rules.py)."""

    def __init__(self, device=None, spec=None) -> None:  # noqa: ANN001 - registry signature
        pass

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, slots: LoRASlots,
                 mapping: LoRAMapping) -> None:
        num_tokens, in_features = x.shape
        if num_tokens == 0:
            return
        if x.stride(1) != 1:
            x = x.contiguous()
        assert y.stride(1) == 1 and slots.num_slices <= 3, "y rows contiguous, <= 3 blocks"
        num_slots, width, rank = slots.num_slots, slots.a.shape[1], slots.rank
        tiles = lora_tiles(num_tokens, in_features, width, rank)
        precision = dot_precision(x.dtype)
        pdl = pdl_enabled(x.device)
        partials = torch.empty((tiles.splits, num_tokens, width), dtype=torch.float32,
                               device=x.device)
        m_tiles = triton.cdiv(num_tokens, tiles.block_m)
        r_tiles = triton.cdiv(width, tiles.block_r)
        _lora_shrink_kernel[(m_tiles, r_tiles * tiles.splits, num_slots)](
            x, slots.a, partials, mapping.packed, num_tokens, in_features, width,
            x.stride(0), slots.a.stride(0), tiles.k_per_split,
            NUM_SLOTS=num_slots, R_TILES=r_tiles, BLOCK_M=tiles.block_m,
            BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k,
            PREFETCH=min(1024, triton.next_power_of_2(tiles.k_per_split)),
            DOT_PRECISION=precision, PDL=pdl,
            **pdl_launch_options(pdl))
        sizes = (*slots.slice_sizes, 0, 0)[:3]
        n_tiles = triton.cdiv(max(slots.slice_sizes), tiles.block_n)
        _lora_expand_kernel[(m_tiles * n_tiles, slots.num_slices, num_slots)](
            partials, slots.b, y, mapping.packed, num_tokens, width, rank, tiles.splits,
            *sizes, y.stride(0),
            NUM_SLOTS=num_slots, N_TILES=n_tiles, BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n, BLOCK_R=tiles.rank_pow2, DOT_PRECISION=precision, PDL=pdl,
            **pdl_launch_options(pdl))
