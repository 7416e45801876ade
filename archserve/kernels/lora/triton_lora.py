"""TRITON_LORA: the LoRA delta as two grouped Triton kernels per layer (punica's SGMV idea:
shrink, then expand, over the step's tokens grouped by adapter slot).

A step's tokens are grouped by slot through the mapping's sorted order; no row is moved.
The work is cut into tiles of one slot's tokens (``BLOCK_M`` rows each), numbered across
the slots that hold tokens, so the launches grow with the step's tokens and not with
``max_loras``: a decode step of one adapter among eight slots runs one tile's programs, not
eight slots' worth of programs that exit at once. Both grids are sized by the most tiles a
step of that many tokens can have (``max_tiles``), never by the mapping's values, so one
captured CUDA graph serves every mix of adapters; programs past the step's tiles exit.

- shrink: t = x A^T for every output block's down-projection at once ([T, S * R], float32),
  split over K where the rows are few (a decode step: one tile's single row would otherwise
  leave one program to read all of A), each split storing its own partial sums;
- expand: y[:, block s] += (sum of t's partials)[:, s] B_s^T, added into the layer's output
  in place; tokens without an adapter are not touched.

A gate/up layer of a step of few rows (``ACTIVATION_ROWS``) takes the gated activation in
its expand instead (``add_lora_silu_mul``): silu(gate + delta) * (up + delta) for every
row, so the SiLU kernel's launch and its read of the [T, 2I] sums are gone. That expand
walks the rows in their own order, each with its slot's B columns: at a few rows the
gathers cost less than the launch they save; at more, grouping by slot reads B once a
slot, so the grouped expand then the SiLU kernel run.

At those few rows the expand's launch can go too (``expand_epilogue``): the shrink runs
first, on the layer's input (normalising it itself, ``ShrinkNorm``, where the base GEMM
takes the norm in its prologue), and the base GEMM's epilogue adds each row's delta
(``lora_row_deltas``: its slot's B columns times t), before its residual add's rounding
is final or the gated activation; a layer is then two launches, not three. The linear
routine decides where its GEMM can (kernels/linear/skinny_choice.py); elsewhere the
expand runs as above. Every shrink program waits for the kernel before it, those past
the step's tiles too: a step whose tokens take no adapter has no tile, and the GEMM after
the shrink reads what the kernel before the shrink wrote.

Both launch with PDL where it is on (kernels/pdl.py): the mapping and the adapter weights (a
shrink program's A tile, an expand program's B tile) are read before the wait (nothing
before writes them); the layer's input, the partial sums and the output after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_gated_act import gated_product
from archserve.kernels.elementwise.triton_rms_norm import scale_normalized
from archserve.kernels.elementwise.triton_rounding import round_to_dtype
from archserve.kernels.lora.interface import LoRAMapping, LoRASlots, ShrinkNorm
from archserve.kernels.pdl import (
    pdl_enabled,
    pdl_launch_options,
    pdl_start,
    prefetch_rows_to_l2,
)
from archserve.kernels.triton_dot import dot_precision

# Rows at or below which a step counts as decode-sized: few rows per slot, so programs are
# many and small for parallelism: K split, 16 rank columns a shrink program, its A tile
# loaded whole before the wait. The constants are first choices (benchmarks/bench_lora.py
# --set sweeps them).
FEW_ROWS = 128
K_PER_SPLIT = 512       # K columns one shrink program reads when K is split
MAX_SPLITS = 32
# An expand program sums its tile's partials in one load of [splits, block_m, rank]: this
# many float32 values at most (64 registers a thread at 4 warps), which bounds the split.
MAX_PARTIAL_VALUES = 8192
BLOCK_N = 128           # output columns one expand program adds to
BLOCK_K = 64            # K columns a step of a larger step's shrink loop
K_GRAIN = 64            # a K split's width is a multiple of it (aligned vector loads)
# Rows at or below which a gate/up layer's expand applies the activation (module doc); an
# activating expand program holds at most this many B values a block (rows x columns x
# rank), which sets its columns.
ACTIVATION_ROWS = 4
ACTIVATION_B_VALUES = 4096


@dataclass(frozen=True)
class LoRATiles:
    block_m: int
    block_r: int          # shrink: rank columns per program
    block_k: int          # shrink: K columns per load (the whole split where one_k_tile)
    one_k_tile: bool      # shrink: the split's A tile in one load, made before the wait
    splits: int           # shrink partials over K
    k_per_split: int
    block_n: int          # expand: output columns per program
    rank_pow2: int        # expand: the rank, padded to a power of two (>= 16, tl.dot)


def lora_tiles(num_tokens: int, in_features: int, width: int, rank: int) -> LoRATiles:
    """The tiles of a step of ``num_tokens`` rows into a layer of ``in_features`` inputs and
    ``width`` = S * R down-projection rows."""
    few = num_tokens <= FEW_ROWS
    block_m = 16 if few else 64
    rank_pow2 = max(16, triton.next_power_of_2(rank))
    most = max(1, min(MAX_SPLITS, MAX_PARTIAL_VALUES // (block_m * rank_pow2)))
    splits = min(most, triton.cdiv(in_features, K_PER_SPLIT)) if few else 1
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), K_GRAIN) * K_GRAIN
    splits = triton.cdiv(in_features, k_per_split)
    one_k_tile = few and k_per_split <= K_PER_SPLIT
    return LoRATiles(block_m=block_m,
                     block_r=16 if few else max(16, min(64, triton.next_power_of_2(width))),
                     block_k=triton.next_power_of_2(k_per_split) if one_k_tile else BLOCK_K,
                     one_k_tile=one_k_tile, splits=splits, k_per_split=k_per_split,
                     block_n=BLOCK_N, rank_pow2=rank_pow2)


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """The most tiles of ``block_m`` rows that ``num_tokens`` tokens spread over
    ``num_slots`` slots make: a slot of c tokens makes ceil(c / block_m) <= (c + block_m -
    1) / block_m, and at most min(tokens, slots) slots hold any."""
    return (num_tokens + min(num_tokens, num_slots) * (block_m - 1)) // block_m


@triton.jit
def _tile_of(mapping, tile, NUM_SLOTS: tl.constexpr, SLOTS_POW2: tl.constexpr,
             BLOCK_M: tl.constexpr):
    """(the rows of the step's tile ``tile``, which of them exist, its slot, the step's
    number of tiles: ``tile`` exists when below it). Tiles are numbered slot by slot, each
    slot's tokens in their sorted order."""
    s = tl.arange(0, SLOTS_POW2)
    counts = tl.load(mapping + s, mask=s < NUM_SLOTS, other=0)
    starts = tl.load(mapping + NUM_SLOTS + s, mask=s < NUM_SLOTS, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    here = (tile >= ends - tiles) & (tile < ends)
    slot = tl.sum(tl.where(here, s, 0), 0)
    m = ((tile - tl.sum(tl.where(here, ends - tiles, 0), 0)) * BLOCK_M
         + tl.arange(0, BLOCK_M))
    in_slot = m < tl.sum(tl.where(here, counts, 0), 0)
    first = tl.sum(tl.where(here, starts, 0), 0)
    rows = tl.load(mapping + 2 * NUM_SLOTS + 2 * (first + m) + 1, mask=in_slot, other=0)
    return rows.to(tl.int64), in_slot, slot, tl.sum(tiles, 0)


@triton.jit
def _input_sum(x, r, rows, in_slot, k, k_ok, x_row_stride, HAS_RESIDUAL: tl.constexpr):
    """fp32 x (+ residual, rounded to x's dtype as the norm rounds its sum) at the tile's
    rows and columns ``k``."""
    offsets = rows[:, None] * x_row_stride + k[None, :]
    mask = in_slot[:, None] & k_ok[None, :]
    h = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = round_to_dtype(h + tl.load(r + offsets, mask=mask, other=0.0).to(tl.float32),
                           x.dtype.element_ty)
    return h


@triton.jit
def _shrink_inv_rms(x, r, rows, in_slot, in_features, x_row_stride, eps, NORM: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """With NORM, 1/rms of the tile's rows of x (+ residual) from the whole row (a few KiB
    a row, beside the adapter's tile), once a program before its K loop and after the PDL
    wait (x is the kernel before's output); else ones, unused."""
    if NORM:
        squares = tl.zeros([rows.shape[0]], dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            h = _input_sum(x, r, rows, in_slot, kk, kk < in_features, x_row_stride,
                           HAS_RESIDUAL)
            squares += tl.sum(h * h, 1)
        return tl.math.rsqrt(squares / in_features + eps)
    return tl.full([rows.shape[0]], 1.0, tl.float32)


@triton.jit
def _shrink_rows(x, r, norm_w, rows, in_slot, k, k_ok, x_row_stride, inv_rms,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM_WEIGHT: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The tile's input rows at columns ``k`` in x's dtype: x itself, or with NORM
    rms_norm(x (+ residual)) rounded as the norm kernel rounds it (the layer's input when
    the base GEMM takes the norm in its prologue), ``inv_rms`` the rows' 1/rms."""
    dtype: tl.constexpr = x.dtype.element_ty
    if NORM:
        h = _input_sum(x, r, rows, in_slot, k, k_ok, x_row_stride, HAS_RESIDUAL)
        if NORM_WEIGHT:
            w = tl.load(norm_w + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        else:   # folded into the GEMM's weight and the adapter's A (RMSNorm.fold_into)
            w = tl.full([1, BLOCK_K], 1.0, tl.float32)
        return scale_normalized(h, inv_rms[:, None], w, dtype, dtype, False).to(dtype)
    return tl.load(x + rows[:, None] * x_row_stride + k[None, :],
                   mask=in_slot[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _shrink(item, x, a, partials, mapping, num_tokens, in_features, width,
            x_row_stride, a_slot_stride, k_steps_per_split, splits, res, norm_w, eps,
            NUM_SLOTS: tl.constexpr, SLOTS_POW2: tl.constexpr, R_TILES: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
            K_GRAIN: tl.constexpr, ONE_K_TILE: tl.constexpr, PREFETCH: tl.constexpr,
            DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr,
            HAS_RESIDUAL: tl.constexpr, NORM_WEIGHT: tl.constexpr):
    """Shrink work item ``item`` = (tile, K split, rank tile): its partial sums."""
    tile = item // (R_TILES * splits)
    pid_r = item % R_TILES
    split = (item // R_TILES) % splits
    rows, in_slot, slot, num_tiles = _tile_of(mapping, tile, NUM_SLOTS, SLOTS_POW2, BLOCK_M)
    if tile < num_tiles:
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < width
        # A split is whole steps of K_GRAIN columns: its start is known aligned, so
        # the loads of A and x are vectors.
        k_per_split = k_steps_per_split * K_GRAIN
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, in_features)
        a_rows = a + slot.to(tl.int64) * a_slot_stride + r.to(tl.int64) * in_features
        if ONE_K_TILE:
            # Decode-sized: the split's whole A tile in registers while the kernel before
            # drains, so after the wait the only memory on the way is x's row.
            k = k_begin + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            w = tl.load(a_rows[:, None] + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)
            pdl_start(PDL)
            inv_rms = _shrink_inv_rms(x, res, rows, in_slot, in_features, x_row_stride, eps,
                                      NORM, HAS_RESIDUAL, BLOCK_K)
            xs = _shrink_rows(x, res, norm_w, rows, in_slot, k, k_ok, x_row_stride,
                              inv_rms, NORM, HAS_RESIDUAL, NORM_WEIGHT, BLOCK_K)
            if DOT_PRECISION == "ieee":
                xs, w = xs.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(xs, tl.trans(w), input_precision=DOT_PRECISION)
        else:
            # The adapter's rows stream into L2 while the kernel before drains.
            prefetch_rows_to_l2(a_rows + k_begin, r_ok, k_end - k_begin, PREFETCH, PDL)
            pdl_start(PDL)
            inv_rms = _shrink_inv_rms(x, res, rows, in_slot, in_features, x_row_stride, eps,
                                      NORM, HAS_RESIDUAL, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_begin, k_end, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < k_end
                xs = _shrink_rows(x, res, norm_w, rows, in_slot, k, k_ok, x_row_stride,
                                  inv_rms, NORM, HAS_RESIDUAL, NORM_WEIGHT, BLOCK_K)
                w = tl.load(a_rows[:, None] + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                            other=0.0)
                if DOT_PRECISION == "ieee":
                    xs, w = xs.to(tl.float32), w.to(tl.float32)
                acc += tl.dot(xs, tl.trans(w), input_precision=DOT_PRECISION)
        out = (partials + split.to(tl.int64) * num_tokens * width + rows[:, None] * width
               + r[None, :])
        tl.store(out, acc, mask=in_slot[:, None] & r_ok[None, :])
    else:
        # Waits all the same: a step whose tokens take no adapter has no tile, and the
        # kernel after this one (a GEMM whose epilogue adds the delta) relies on this
        # one's end to mean the kernel before it ended too (kernels/pdl.py's chain).
        pdl_start(PDL)


@triton.jit
def _expand(item, b, y, partials, mapping, num_tokens, width, rank, splits,
            size0, size1, size2, y_row_stride,
            NUM_SLOTS: tl.constexpr, SLOTS_POW2: tl.constexpr, R_TILES: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
            SPLITS_POW2: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Expand work item ``item`` = (tile, output columns): its tile's delta added into y."""
    # The output blocks' column tiles, numbered block after block.
    tiles0 = tl.cdiv(size0, BLOCK_N)
    tiles01 = tiles0 + tl.cdiv(size1, BLOCK_N)
    n_items = tiles01 + tl.cdiv(size2, BLOCK_N)
    tile = item // n_items
    column_tile = item % n_items
    block = (column_tile >= tiles0).to(tl.int32) + (column_tile >= tiles01).to(tl.int32)
    pid_n = column_tile - tl.where(block == 0, 0, tl.where(block == 1, tiles0, tiles01))
    size = tl.where(block == 0, size0, tl.where(block == 1, size1, size2))
    first = tl.where(block == 0, 0, tl.where(block == 1, size0, size0 + size1))
    rows, in_slot, slot, num_tiles = _tile_of(mapping, tile, NUM_SLOTS, SLOTS_POW2, BLOCK_M)
    if tile < num_tiles:
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < size
        r = tl.arange(0, BLOCK_R)
        r_ok = r < rank
        up = tl.load(b + (first + n[:, None]).to(tl.int64) * (NUM_SLOTS * rank) + slot * rank
                     + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        pdl_start(PDL)
        out = y + rows[:, None] * y_row_stride + (first + n)[None, :]
        mask = in_slot[:, None] & n_ok[None, :]
        current = tl.load(out, mask=mask, other=0.0)
        # Every K split's partials in one load.
        s = tl.arange(0, SPLITS_POW2)
        partial = (partials + s[:, None, None] * num_tokens * width
                   + rows[None, :, None] * width + (block * rank + r)[None, None, :])
        t = tl.sum(tl.load(partial, mask=(s < splits)[:, None, None] & in_slot[None, :, None]
                           & r_ok[None, None, :], other=0.0), 0)
        if DOT_PRECISION == "ieee":
            delta = tl.dot(t, tl.trans(up.to(tl.float32)), input_precision=DOT_PRECISION)
        else:   # rounded to the adapter's dtype between its two matrices, as PEFT computes
            delta = tl.dot(t.to(up.dtype), tl.trans(up), input_precision=DOT_PRECISION)
        total = current.to(tl.float32) + delta
        tl.store(out, total.to(y.dtype.element_ty), mask=mask)
    else:
        pdl_start(PDL)   # as the shrink's programs past the tiles (the chain holds)


# One compiled variant each whatever the step's size: the token count and the K split's
# width and count change with it.
@triton.jit(do_not_specialize=["num_tokens", "k_steps_per_split", "splits"])
def _lora_shrink_kernel(x, a, partials, mapping, num_tokens, in_features, width,
                        x_row_stride, a_slot_stride, k_steps_per_split, splits, res, norm_w,
                        eps, NUM_SLOTS: tl.constexpr, SLOTS_POW2: tl.constexpr,
                        R_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr, K_GRAIN: tl.constexpr,
                        ONE_K_TILE: tl.constexpr, PREFETCH: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                        NORM: tl.constexpr = False, HAS_RESIDUAL: tl.constexpr = False,
                        NORM_WEIGHT: tl.constexpr = False):
    # NORM: the input is rms_norm(x (+ res), norm_w), computed here (_shrink_rows).
    _shrink(tl.program_id(0), x, a, partials, mapping, num_tokens, in_features, width,
            x_row_stride, a_slot_stride, k_steps_per_split, splits, res, norm_w, eps,
            NUM_SLOTS, SLOTS_POW2, R_TILES, BLOCK_M, BLOCK_R, BLOCK_K, K_GRAIN,
            ONE_K_TILE, PREFETCH, DOT_PRECISION, PDL, NORM, HAS_RESIDUAL, NORM_WEIGHT)


@triton.jit(do_not_specialize=["num_tokens", "splits"])
def _lora_expand_kernel(b, y, partials, mapping, num_tokens, width, rank, splits,
                        size0, size1, size2, y_row_stride,
                        NUM_SLOTS: tl.constexpr, SLOTS_POW2: tl.constexpr,
                        R_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, SPLITS_POW2: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    _expand(tl.program_id(0), b, y, partials, mapping, num_tokens, width, rank, splits,
            size0, size1, size2, y_row_stride, NUM_SLOTS, SLOTS_POW2, R_TILES, BLOCK_M,
            BLOCK_N, BLOCK_R, SPLITS_POW2, DOT_PRECISION, PDL)


@triton.jit
def _lora_silu_mul_rows(mapping, token, NUM_SLOTS: tl.constexpr, SLOTS_POW2: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    """(the slot of each row ``token``, whether that row takes it in this step). A row
    takes its slot when the step's sorted order lists it: rows a CUDA graph runs past the
    step keep an earlier step's slot in the mapping, and no partial sums of this step."""
    s = tl.arange(0, SLOTS_POW2)
    taking = tl.sum(tl.load(mapping + s, mask=s < NUM_SLOTS, other=0), 0)
    # The step's taking rows are its first ``taking`` sorted entries; a forward of
    # ``num_tokens`` <= BLOCK_M rows has no more.
    p = tl.arange(0, BLOCK_M)
    listed = tl.load(mapping + 2 * NUM_SLOTS + 2 * p + 1, mask=p < taking, other=-1)
    takes = tl.sum((listed[None, :] == token[:, None]).to(tl.int32), 1) > 0
    slot = tl.load(mapping + 2 * NUM_SLOTS + 2 * token, mask=takes, other=0)
    return slot, takes & (slot >= 0)


@triton.jit(do_not_specialize=["num_tokens", "splits"])
def _lora_expand_silu_mul_kernel(b, y, out, partials, mapping, num_tokens, width, rank,
                                 splits, inter, y_row_stride, out_row_stride,
                                 NUM_SLOTS: tl.constexpr, SLOTS_POW2: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_R: tl.constexpr, SPLITS_POW2: tl.constexpr,
                                 ROUND_T: tl.constexpr, PDL: tl.constexpr):
    """out[:, cols] = silu(gate + delta_gate) * (up + delta_up) for every row (gate: y's
    first ``inter`` columns, up: the next), each row's deltas from its own slot's B."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    token = tl.arange(0, BLOCK_M)
    row_ok = token < num_tokens
    slot, takes = _lora_silu_mul_rows(mapping, token, NUM_SLOTS, SLOTS_POW2, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    # [rows, columns, rank] of each row's slot's B, gate rows then up rows.
    b_mask = takes[:, None, None] & n_ok[None, :, None] & r_ok[None, None, :]
    in_slot = (slot * rank)[:, None, None] + r[None, None, :]
    gate_b = tl.load(b + n.to(tl.int64)[None, :, None] * (NUM_SLOTS * rank) + in_slot,
                     mask=b_mask, other=0.0).to(tl.float32)
    up_b = tl.load(b + (inter + n).to(tl.int64)[None, :, None] * (NUM_SLOTS * rank) + in_slot,
                   mask=b_mask, other=0.0).to(tl.float32)
    pdl_start(PDL)
    s = tl.arange(0, SPLITS_POW2)
    partial = (partials + s[:, None, None] * num_tokens * width
               + token[None, :, None] * width + r[None, None, :])
    p_mask = (s < splits)[:, None, None] & takes[None, :, None] & r_ok[None, None, :]
    t_gate = tl.sum(tl.load(partial, mask=p_mask, other=0.0), 0)
    t_up = tl.sum(tl.load(partial + rank, mask=p_mask, other=0.0), 0)
    if ROUND_T:   # rounded to the adapter's dtype between its two matrices, as PEFT computes
        t_gate = round_to_dtype(t_gate, b.dtype.element_ty)
        t_up = round_to_dtype(t_up, b.dtype.element_ty)
    dtype: tl.constexpr = y.dtype.element_ty
    mask = row_ok[:, None] & n_ok[None, :]
    rows = token.to(tl.int64)[:, None] * y_row_stride + n[None, :]
    # Each sum rounded to y's dtype, as the grouped expand stores it for the SiLU kernel.
    gate = round_to_dtype(tl.load(y + rows, mask=mask, other=0.0).to(tl.float32)
                          + tl.sum(t_gate[:, None, :] * gate_b, 2), dtype)
    up = round_to_dtype(tl.load(y + rows + inter, mask=mask, other=0.0).to(tl.float32)
                        + tl.sum(t_up[:, None, :] * up_b, 2), dtype)
    act = gated_product(gate, up, dtype)   # rounded as the SiLU kernel rounds
    tl.store(out + token.to(tl.int64)[:, None] * out_row_stride + n[None, :], act.to(dtype),
             mask=mask)


@dataclass(frozen=True)
class LoRAEpilogue:
    """What a base GEMM's epilogue reads to add each row's delta itself (the expand's
    launch gone; ``lora_row_deltas``): the shrink's partial sums of the layer's input,
    the slots' B and the step's mapping."""

    b: torch.Tensor              # LoRASlots.b [N, L, R]
    partials: torch.Tensor       # [splits, T, S * R] float32
    mapping: torch.Tensor        # the packed mapping
    num_slots: int
    rank: int
    splits: int
    slice_sizes: tuple[int, ...]
    round_t: bool                # t rounded to the adapter's dtype before B (as PEFT)


@triton.jit
def lora_row_deltas(b, partials, mapping, b_rows, blocks, col_ok, num_tokens, rank, splits,
                    NUM_SLOTS: tl.constexpr, SLOTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                    RANK_POW2: tl.constexpr, SPLITS_POW2: tl.constexpr,
                    NUM_BLOCKS: tl.constexpr, FIRST_BLOCK: tl.constexpr,
                    END_BLOCK: tl.constexpr, ROUND_T: tl.constexpr):
    """[BLOCK_M, columns] float32: each of a step's first rows' delta at the output columns
    whose B rows are ``b_rows`` and whose output block (of the layer's NUM_BLOCKS; one of
    FIRST_BLOCK..END_BLOCK - 1) is ``blocks`` (t_block B^T, t the sum of the shrink's
    partials), each row with its own slot's B (zero for a row that takes none, or past
    the step). One row's B columns at a time: at a decode step's few rows the gathers cost
    less than the expand's launch."""
    token = tl.arange(0, BLOCK_M)
    slot, takes = _lora_silu_mul_rows(mapping, token, NUM_SLOTS, SLOTS_POW2, BLOCK_M)
    takes = takes & (token < num_tokens)
    r = tl.arange(0, RANK_POW2)
    s = tl.arange(0, SPLITS_POW2)
    width = NUM_BLOCKS * rank
    delta = tl.zeros([BLOCK_M, b_rows.shape[0]], dtype=tl.float32)
    for m in range(0, tl.minimum(num_tokens, BLOCK_M)):
        here = (token == m) & takes
        # A row that takes no slot reads nothing: its rank mask is empty.
        r_ok = r < tl.sum(tl.where(here, rank, 0), 0)
        slot_m = tl.sum(tl.where(here, slot, 0), 0)
        b_m = tl.load(b + b_rows.to(tl.int64)[:, None] * (NUM_SLOTS * rank) + slot_m * rank
                      + r[None, :], mask=col_ok[:, None] & r_ok[None, :],
                      other=0.0).to(tl.float32)
        row_delta = tl.zeros([b_rows.shape[0]], dtype=tl.float32)
        for block in tl.static_range(FIRST_BLOCK, END_BLOCK):
            t = tl.sum(tl.load(partials + s[:, None] * num_tokens * width + m * width
                               + block * rank + r[None, :],
                               mask=(s < splits)[:, None] & r_ok[None, :], other=0.0), 0)
            if ROUND_T:
                t = round_to_dtype(t, b.dtype.element_ty)
            row_delta = tl.where(blocks == block, tl.sum(b_m * t[None, :], 1), row_delta)
        delta = tl.where((token == m)[:, None], row_delta[None, :], delta)
    return delta


class TritonLoRA:
    """The TRITON_LORA implementation (kernels/lora/rules.py)."""

    def __init__(self, device=None, spec=None) -> None:  # noqa: ANN001 - registry signature
        pass

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, slots: LoRASlots,
                 mapping: LoRAMapping) -> None:
        if x.shape[0] == 0:
            return
        assert y.stride(1) == 1 and slots.num_slices <= 3, "y rows contiguous, <= 3 blocks"
        partials, tiles, common = self._shrink(x, slots, mapping)
        num_tokens, rank = x.shape[0], slots.rank
        column_tiles = sum(triton.cdiv(size, tiles.block_n) for size in slots.slice_sizes)
        num_expand = max_tiles(num_tokens, slots.num_slots, tiles.block_m) * column_tiles
        sizes = (*slots.slice_sizes, 0, 0)[:3]
        _lora_expand_kernel[(num_expand,)](
            slots.b, y, partials, mapping.packed, num_tokens, slots.a.shape[1], rank,
            tiles.splits, *sizes, y.stride(0), BLOCK_N=tiles.block_n,
            BLOCK_R=tiles.rank_pow2, SPLITS_POW2=triton.next_power_of_2(tiles.splits),
            **common)

    def add_lora_silu_mul(self, y: torch.Tensor, x: torch.Tensor, slots: LoRASlots,
                          mapping: LoRAMapping) -> torch.Tensor | None:
        """silu(gate) * up [T, I] of a gate/up layer's output y [T, 2I] with each token's
        delta added to gate and up first, the activation in the expand (module doc); None
        where it does not apply (more rows than ``ACTIVATION_ROWS``, not two equal
        blocks): the caller then adds the delta and runs the SiLU kernel. y is read, not
        written."""
        num_tokens = x.shape[0]
        sizes = slots.slice_sizes
        if not (1 <= num_tokens <= ACTIVATION_ROWS and len(sizes) == 2
                and sizes[0] == sizes[1] and y.stride(1) == 1):
            return None
        inter = sizes[0]
        out = torch.empty((num_tokens, inter), dtype=y.dtype, device=y.device)
        partials, tiles, common = self._shrink(x, slots, mapping)
        block_m = triton.next_power_of_2(num_tokens)
        block_n = max(16, min(BLOCK_N, ACTIVATION_B_VALUES // (block_m * tiles.rank_pow2)))
        _lora_expand_silu_mul_kernel[(triton.cdiv(inter, block_n),)](
            slots.b, y, out, partials, mapping.packed, num_tokens, slots.a.shape[1],
            slots.rank, tiles.splits, inter, y.stride(0), out.stride(0),
            NUM_SLOTS=common["NUM_SLOTS"], SLOTS_POW2=common["SLOTS_POW2"], BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_R=tiles.rank_pow2,
            SPLITS_POW2=triton.next_power_of_2(tiles.splits),
            ROUND_T=common["DOT_PRECISION"] != "ieee", PDL=common["PDL"],
            **pdl_launch_options(common["PDL"]))
        return out

    def expand_epilogue(self, x: torch.Tensor, slots: LoRASlots, mapping: LoRAMapping,
                        norm: ShrinkNorm | None = None) -> LoRAEpilogue | None:
        """Launch the shrink of x (with ``norm``: of the layer's input rms_norm(x +
        residual), for a base GEMM that takes the norm in its prologue) and return what
        the base GEMM's epilogue reads to add the delta itself (``lora_row_deltas``);
        None, launching nothing, where that does not apply: more rows than
        ``ACTIVATION_ROWS`` (the per-row gathers of B pay only at a decode step's few
        rows)."""
        if not 1 <= x.shape[0] <= ACTIVATION_ROWS or slots.num_slices > 3:
            return None
        partials, tiles, common = self._shrink(x, slots, mapping, norm)
        return LoRAEpilogue(slots.b, partials, mapping.packed, slots.num_slots, slots.rank,
                            tiles.splits, slots.slice_sizes,
                            round_t=common["DOT_PRECISION"] != "ieee")

    def _shrink(self, x: torch.Tensor, slots: LoRASlots, mapping: LoRAMapping,
                norm: ShrinkNorm | None = None) -> tuple[torch.Tensor, LoRATiles, dict]:
        """Launch the shrink of x (with ``norm``: of rms_norm(x + its residual)) into its
        partial sums; (the partials, the step's tiles, the launch arguments the expand
        shares)."""
        num_tokens, in_features = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        num_slots, width = slots.num_slots, slots.a.shape[1]
        tiles = lora_tiles(num_tokens, in_features, width, slots.rank)
        pdl = pdl_enabled(x.device)
        partials = torch.empty((tiles.splits, num_tokens, width), dtype=torch.float32,
                               device=x.device)
        r_tiles = triton.cdiv(width, tiles.block_r)
        num_shrink = max_tiles(num_tokens, num_slots, tiles.block_m) * r_tiles * tiles.splits
        common = dict(NUM_SLOTS=num_slots, SLOTS_POW2=triton.next_power_of_2(num_slots),
                      R_TILES=r_tiles, BLOCK_M=tiles.block_m,
                      DOT_PRECISION=dot_precision(x.dtype), PDL=pdl, **pdl_launch_options(pdl))
        _lora_shrink_kernel[(num_shrink,)](
            x, slots.a, partials, mapping.packed, num_tokens, in_features, width,
            x.stride(0), slots.a.stride(0), tiles.k_per_split // K_GRAIN, tiles.splits,
            *(x, x, 0.0) if norm is None else (
                norm.residual if norm.residual is not None else x,
                norm.weight if norm.weight is not None else x, float(norm.eps)),
            NORM=norm is not None, HAS_RESIDUAL=norm is not None and norm.residual is not None,
            NORM_WEIGHT=norm is not None and norm.weight is not None,
            BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k, K_GRAIN=K_GRAIN,
            ONE_K_TILE=tiles.one_k_tile,
            PREFETCH=min(1024, triton.next_power_of_2(tiles.k_per_split)), **common)
        return partials, tiles, common
