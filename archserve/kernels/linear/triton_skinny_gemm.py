"""y = x W^T (+ b) for a few rows of x: the GEMM of a small decode batch, as a GEMV.

At one to sixteen rows a GEMM reads its weight once and does little arithmetic, so its
time is the weight's bytes over the memory bandwidth. cuBLAS reaches that on the wide
matrices of an 8B model (gate/up, down) but not on the narrow ones (QKV, O at 3.1 of
4.3 TB/s on an H200), and it adds split-K reduce kernels there. This kernel gives each
program ``BLOCK_N`` output columns over the whole of K, so no reduction crosses programs
and there is no second kernel. Each weight tile is loaded once and multiplied by every
row (a speculative verification step's newest token and drafts, or a small batch): on
the CUDA cores in fp32, the sums reduced over K once at the end, or (configs with
``mma``, from four rows) on the tensor cores, the rows padded to 16 and the weight
staged through shared memory, which holds wide column tiles in few registers.

Whether it beats cuBLAS depends on the shape, the rows and the GPU, so nothing calls it
blindly: ``archserve.kernels.linear.skinny_choice`` times it against cuBLAS per shape
and row count."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_gated_act import gated_product
from archserve.kernels.elementwise.triton_rms_norm import scale_normalized
from archserve.kernels.elementwise.triton_rounding import round_to_dtype
from archserve.kernels.lora.triton_lora import LoRAEpilogue
from archserve.kernels.lora.triton_lora import lora_row_deltas as _lora_deltas
from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start
from archserve.kernels.triton_dot import dot_precision

# Rows this kernel is built for: a batch-1 verification step of up to 15 drafts. On the
# CUDA cores a thread holds BLOCK_M x BLOCK_N sums per vector of K (_times_rows), which
# past 16 rows outgrow the registers; on the tensor cores, 16 rows are one MMA tile,
# where cuBLAS's own kernels take over.
MAX_ROWS = 16


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    # The product on the tensor cores (tl.dot), the rows padded to MMA_ROWS: from a few
    # rows up, the CUDA cores' form reads every row's tile once per BLOCK_N columns of
    # weight and holds BLOCK_M x BLOCK_N sums a thread; the tensor cores take wide BLOCK_N
    # tiles with few registers, the weight staged through shared memory.
    mma: bool = False

    def key(self) -> str:
        return f"n{self.block_n}_k{self.block_k}_w{self.num_warps}" + ("_mma" if self.mma else "")

    @classmethod
    def from_key(cls, key: str) -> SkinnyConfig:
        parts = key.split("_")
        n, k, w = (int(part[1:]) for part in parts[:3])
        return cls(n, k, w, parts[3:] == ["mma"])


# tl.dot's smallest M: the MMA form pads its rows to it.
MMA_ROWS = 16


def _block_m(rows: int, config: SkinnyConfig) -> int:
    block_m = triton.next_power_of_2(rows)
    return max(block_m, MMA_ROWS) if config.mma else block_m


# Tiles (BLOCK_N, BLOCK_K, warps[, MMA]) worth timing per BLOCK_M. One row: the leaders of
# sweeps of 1-32 x 128-4096 tiles at 2, 4 and 8 warps over the 8B and 0.6B shapes on an
# H200 (benchmarks/bench_skinny_gemm.py). More rows (chosen by rule, not yet by a sweep):
# on the CUDA cores, tiles whose BLOCK_K is one 16-byte vector a thread (8 x 32 x warps
# 16-bit values), so the weight's and the rows' load layouts are the product's and nothing
# crosses shared memory in the K loop (a compile test checks it), and whose sums fit
# sm_90a's registers without spilling, plain and gated (BLOCK_N falls as the rows grow: a
# thread holds BLOCK_M x BLOCK_N sums); on the tensor cores (from 4 rows), tiles of 16-32
# columns x 128-256 of K whose gated form fits sm_90a's registers without spilling (with
# the norm prologue some spill: the tuner times that form apart) and 64 KB of shared
# memory in Triton's default three stages. Few: each is compiled and timed at the first
# start.
_MMA_TILES = [(16, 128, 2, True), (32, 128, 4, True), (16, 256, 4, True)]
_CANDIDATE_TILES = {1: [(2, 1024, 4), (1, 2048, 4), (2, 2048, 8), (4, 512, 4)],
                    2: [(2, 1024, 4), (4, 1024, 4), (2, 2048, 8), (4, 512, 2)],
                    4: [(2, 1024, 4), (4, 1024, 4), (2, 2048, 8), (2, 512, 2),
                        _MMA_TILES[1]],
                    8: [(1, 1024, 4), (2, 1024, 4), (2, 2048, 8), (2, 512, 2), *_MMA_TILES],
                    16: [(1, 1024, 4), (2, 1024, 4), (1, 2048, 8), (2, 512, 2), *_MMA_TILES]}


def candidate_configs(rows: int) -> list[SkinnyConfig]:
    """The configs the engine times at ``rows`` rows (1 <= rows <= MAX_ROWS)."""
    return [SkinnyConfig(*tile) for tile in _CANDIDATE_TILES[triton.next_power_of_2(rows)]]


@triton.jit
def _load_weight(w_rows, k, col_ok, K, EVEN_K: tl.constexpr):
    """One weight tile, in the weight's dtype: [BLOCK_N, BLOCK_K] at one row,
    [1, BLOCK_N, BLOCK_K] at more (``w_rows``, ``k`` and ``col_ok`` come shaped for it)."""
    if EVEN_K:
        w = tl.load(w_rows + k, mask=col_ok, other=0.0)
    else:
        w = tl.load(w_rows + k, mask=col_ok & (k < K), other=0.0)
    return w


@triton.jit
def _times_rows(acc, w, x_tile, BLOCK_M: tl.constexpr, VEC: tl.constexpr,
                MMA: tl.constexpr = False, DOT_PRECISION: tl.constexpr = "tf32"):
    """acc + a loaded weight tile times the rows' fp32 tile. One row: [BLOCK_N, BLOCK_K]
    products, summed over K after the loop. More rows: x [BLOCK_M, 1, BLOCK_K] times w
    [1, BLOCK_N, BLOCK_K], each thread's VEC products along K (one 16-byte load of the
    weight) summed in its registers at once, so the accumulator is [BLOCK_M, BLOCK_N,
    BLOCK_K / VEC]: a thread holds BLOCK_M x BLOCK_N sums per vector of K, not
    BLOCK_M x BLOCK_N x VEC. Both tiles are loaded in these three-dimensional shapes, so
    their load layouts are the product's and no tile crosses shared memory; built from
    two-dimensional loads, every K step converted both tiles through shared memory, with
    barriers, at two rows and up (their TTGIR and PTX for sm_90a). MMA: x [BLOCK_M, BLOCK_K]
    times w [BLOCK_N, BLOCK_K] on the tensor cores into [BLOCK_M, BLOCK_N], the rows in the
    weight's dtype (exact for 16-bit rows); DOT_PRECISION "ieee" (dot_precision: a float32
    weight, or bf16 under the CPU interpreter) multiplies in fp32, not TF32."""
    if MMA:
        if DOT_PRECISION == "ieee":
            acc = tl.dot(x_tile, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_tile.to(w.dtype), tl.trans(w), acc)
    elif BLOCK_M == 1:
        acc += w.to(tl.float32) * x_tile
    else:
        w = w.to(tl.float32)
        BLOCK_N: tl.constexpr = w.shape[1]
        BLOCK_K: tl.constexpr = w.shape[2]
        acc += tl.sum(tl.reshape(x_tile * w, [BLOCK_M, BLOCK_N, BLOCK_K // VEC, VEC]), axis=3)
    return acc


@triton.jit
def _weight_times_rows(acc, w_rows, x_tile, k, col_ok, K, BLOCK_M: tl.constexpr,
                       EVEN_K: tl.constexpr, VEC: tl.constexpr, MMA: tl.constexpr = False,
                       DOT_PRECISION: tl.constexpr = "tf32"):
    """acc + the weight tile at k times the rows' fp32 tile (``_times_rows``)."""
    return _times_rows(acc, _load_weight(w_rows, k, col_ok, K, EVEN_K), x_tile, BLOCK_M, VEC,
                       MMA, DOT_PRECISION)


@triton.jit
def _sum_over_k(acc, BLOCK_M: tl.constexpr, MMA: tl.constexpr):
    """The accumulator summed over K: [BLOCK_M, BLOCK_N]."""
    if MMA:     # the tensor cores summed it
        total = acc
    elif BLOCK_M == 1:
        total = tl.sum(acc, axis=1)[None, :]
    else:
        total = tl.sum(acc, axis=2)
    return total


@triton.jit
def _row_sums(tile, BLOCK_M: tl.constexpr, MMA: tl.constexpr):
    """A rows' tile summed over K: [BLOCK_M, 1]."""
    if BLOCK_M == 1 or MMA:
        total = tl.sum(tile, axis=1)[:, None]
    else:
        total = tl.sum(tile, axis=2)
    return total


@triton.jit
def _load_rows(x_ptr, r_ptr, new_r_ptr, rows, row_ok, k, K, stride_xm, write_residual,
               HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr, STORE: tl.constexpr):
    """fp32 x at rows ``rows`` and columns ``k`` (each shaped to broadcast into the tile:
    [BLOCK_M, 1] and [1, BLOCK_K], or [BLOCK_M, 1, 1] and [1, 1, BLOCK_K]) (+ residual,
    rounded to x's dtype as the norm rounds its sum; with STORE, where ``write_residual``
    holds, that sum is stored: the next residual)."""
    if EVEN_K:
        mask = row_ok & (k >= 0)
    else:
        mask = row_ok & (k < K)
    offsets = rows * stride_xm + k
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        x = round_to_dtype(x + tl.load(r_ptr + offsets, mask=mask, other=0.0).to(tl.float32),
                           dtype)
        if STORE:
            tl.store(new_r_ptr + rows * K + k, x.to(dtype), mask=mask & write_residual)
    return x


@triton.jit
def _gemm_rows(x_ptr, r_ptr, new_r_ptr, norm_w_ptr, rows, row_ok, k, K, stride_xm,
               write_residual, squares, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
               NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
               VEC: tl.constexpr, MMA: tl.constexpr):
    """The GEMM's fp32 rows' tile at k (``_load_rows``'s shapes): x (+ residual; program 0
    stores the sum), and with NORM its squares added to ``squares`` (the tile's shape at
    one row and with MMA, [BLOCK_M, 1, BLOCK_K / VEC] at more: the row's 1/rms is known only after the
    last K step, and scales the sums then) and, with NORM_WEIGHT, x times the norm's
    weight (without: the weight was folded into the GEMM's, RMSNorm.fold_into). The
    squares are held per element (per thread's run, at more rows) and summed over K once,
    after the loop: summed every K step, each step's block-wide reduction stood between
    one tile's loads and the next (H200 tuner, standalone, µs: Qwen3-30B-A3B's QKV 7.41
    -> 7.14, V2-Lite's q 5.73 -> 5.02, its dense down 18.16 -> 12.16)."""
    x = _load_rows(x_ptr, r_ptr, new_r_ptr, rows, row_ok, k, K, stride_xm, write_residual,
                   HAS_RESIDUAL, EVEN_K, True)
    if NORM:
        if BLOCK_M == 1 or MMA:
            squares += x * x
        else:   # each thread's run summed in its registers, as _times_rows sums products
            BLOCK_K: tl.constexpr = x.shape[2]
            squares += tl.sum(tl.reshape(x * x, [BLOCK_M, 1, BLOCK_K // VEC, VEC]), axis=3)
        if NORM_WEIGHT:
            x = x * tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    return x, squares


@triton.jit
def _store_normed_rows(x_ptr, r_ptr, norm_w_ptr, normed_ptr, rows, row_ok, first, end, K,
                       stride_xm, inv_rms, HAS_RESIDUAL: tl.constexpr, NORM_WEIGHT: tl.constexpr,
                       BLOCK: tl.constexpr):
    """rms_norm's output rows (x + residual, normalised, times the weight, rounded as the
    norm kernel rounds them), columns [first, end) in steps of BLOCK, into ``normed``
    [rows, K], for the layer's other readers of the normalised row (a MoE block's experts
    after its router)."""
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    for k0 in range(first, end, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = _load_rows(x_ptr, r_ptr, x_ptr, rows[:, None], row_ok[:, None], k[None, :], end,
                       stride_xm, row_ok[:, None], HAS_RESIDUAL, False, False)
        if NORM_WEIGHT:
            norm_w = tl.load(norm_w_ptr + k, mask=k < end, other=0.0).to(tl.float32)[None, :]
        else:   # folded into the GEMMs that read the row: rms_norm with a weight of ones
            norm_w = tl.full([1, BLOCK], 1.0, tl.float32)
        normed = scale_normalized(x, inv_rms, norm_w, dtype, dtype, False)
        tl.store(normed_ptr + rows[:, None] * K + k[None, :], normed.to(dtype),
                 mask=row_ok[:, None] & (k < end)[None, :])


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        r_ptr, norm_w_ptr, new_r_ptr, normed_ptr, eps, add_ptr,
                        lora_b_ptr, lora_t_ptr, lora_map_ptr, lora_rank, lora_splits,
                        lora_size0, lora_size1,
                        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                        NORMED_OUT: tl.constexpr, PDL: tl.constexpr,
                        NORM_WEIGHT: tl.constexpr = True, ADD: tl.constexpr = False,
                        NORMED_SLICE: tl.constexpr = 0, WIDEN: tl.constexpr = False,
                        MMA: tl.constexpr = False, DOT_PRECISION: tl.constexpr = "tf32",
                        LORA: tl.constexpr = False, LORA_BLOCKS: tl.constexpr = 1,
                        LORA_SLOTS: tl.constexpr = 1,
                        LORA_SLOTS_POW2: tl.constexpr = 1, LORA_RANK_POW2: tl.constexpr = 16,
                        LORA_SPLITS_POW2: tl.constexpr = 1, LORA_ROUND_T: tl.constexpr = False):
    # GATED: the weight is [2N, K], gate rows then up rows (GateUpLinear); y = silu(gate) * up.
    # NORM: x is RMS-normalised first (after adding the residual, with HAS_RESIDUAL) with the
    # weight at norm_w_ptr, in the same pass over K as the product: W (x * w) / rms is
    # W ((x / rms) * w), and 1/rms is one number a row, so the sums over K are scaled by it
    # at the end. No program reads the row twice before its weights (a first pass for the
    # squares put one round trip to memory before every program's product, and lost to
    # the norm kernel on most shapes). The normalised row is not rounded to x's dtype
    # before the product, as the norm kernel's output is: the sums differ from the
    # unfused ones by about that rounding. Program 0 writes the new residual; with
    # NORMED_OUT every program writes a slice of the normalised rows, rounded as the norm
    # kernel rounds them. NORM_WEIGHT False: the norm's weight is folded into W
    # (RMSNorm.fold_into), so none is read.
    # ADD: the rounded output plus add[rows, cols] (the residual stream: a layer's last
    # GEMM adds its block's input back, and the norm after it reads one row, not two),
    # rounded again, as the unfused add rounds the GEMM's output and then the sum.
    # LORA: each row's adapter delta (the shrink's partial sums, launched before, times
    # its slot's B columns: kernels/lora/triton_lora.py) added to the rounded output (and
    # sum), rounded again, as the LoRA expand adds it into the stored output; GATED, to
    # the rounded gate and up before the activation, as the activating expand adds them.
    # The output's LORA_BLOCKS blocks (q/k/v) start at columns 0, lora_size0 and
    # lora_size0 + lora_size1.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    # The weight's elements in one 16-byte load: a thread's run along K (_times_rows).
    VEC: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth
    # The tiles' shapes (_times_rows): one row and MMA, weight [BLOCK_N, BLOCK_K] and rows
    # [BLOCK_M, BLOCK_K]; more rows on the CUDA cores, weight [1, BLOCK_N, BLOCK_K] and
    # rows [BLOCK_M, 1, BLOCK_K].
    if BLOCK_M == 1 or MMA:
        tile_cols, tile_col_ok = cols[:, None], col_ok[:, None]
        tile_rows, tile_row_ok, tile_ks = rows[:, None], row_ok[:, None], ks[None, :]
        first = tl.zeros([BLOCK_M, BLOCK_K], tl.int32)
        squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        if MMA:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        tile_cols, tile_col_ok = cols[None, :, None], col_ok[None, :, None]
        tile_rows, tile_row_ok = rows[:, None, None], row_ok[:, None, None]
        tile_ks = ks[None, None, :]
        first = tl.zeros([BLOCK_M, 1, BLOCK_K], tl.int32)
        squares = tl.zeros([BLOCK_M, 1, BLOCK_K // VEC], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    # int64: an LM head's weight (vocab x hidden) passes 2^31 elements.
    w_rows = w_ptr + tile_cols.to(tl.int64) * stride_wn
    up_rows = w_ptr + (tile_cols + N).to(tl.int64) * stride_wn  # read only when GATED
    # The weights are not written by the kernel before this one, so the first tile is
    # requested before PDL's wait: its bytes stream while that kernel drains, where they
    # would otherwise start after it (the wait holds only reads of what it wrote: x, the
    # residual). At batch 1 one tile is most of a program's bytes (one K step on a
    # 0.6B's QKV and gate/up).
    w_first = _load_weight(w_rows, tile_ks, tile_col_ok, K, EVEN_K)
    up_first = w_first
    if GATED:
        up_first = _load_weight(up_rows, tile_ks, tile_col_ok, K, EVEN_K)
    pdl_start(PDL)
    # Broadcast before the compare: the interpreter mistypes scalar-bool & tensor.
    first = (first + tl.program_id(0)) == 0
    acc_up = tl.zeros_like(acc)
    x, squares = _gemm_rows(x_ptr, r_ptr, new_r_ptr, norm_w_ptr, tile_rows, tile_row_ok,
                            tile_ks, K, stride_xm, first, squares, HAS_RESIDUAL, EVEN_K, NORM,
                            NORM_WEIGHT, BLOCK_M, VEC, MMA)
    acc = _times_rows(acc, w_first, x, BLOCK_M, VEC, MMA, DOT_PRECISION)
    if GATED:
        acc_up = _times_rows(acc_up, up_first, x, BLOCK_M, VEC, MMA, DOT_PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tile_ks
        x, squares = _gemm_rows(x_ptr, r_ptr, new_r_ptr, norm_w_ptr, tile_rows, tile_row_ok,
                                k, K, stride_xm, first, squares, HAS_RESIDUAL, EVEN_K, NORM,
                                NORM_WEIGHT, BLOCK_M, VEC, MMA)
        acc = _weight_times_rows(acc, w_rows, x, k, tile_col_ok, K, BLOCK_M, EVEN_K, VEC, MMA,
                                 DOT_PRECISION)
        if GATED:
            acc_up = _weight_times_rows(acc_up, up_rows, x, k, tile_col_ok, K, BLOCK_M,
                                        EVEN_K, VEC, MMA, DOT_PRECISION)
    y = _sum_over_k(acc, BLOCK_M, MMA)
    inv_rms = 1.0
    if NORM:
        inv_rms = tl.math.rsqrt(_row_sums(squares, BLOCK_M, MMA) / K + eps)
        y = y * inv_rms
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        up = _sum_over_k(acc_up, BLOCK_M, MMA)
        if NORM:
            up = up * inv_rms
        if HAS_BIAS:
            up += tl.load(b_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        # Rounded where the unfused path rounds: the GEMM's outputs, silu(gate), the product.
        gate = round_to_dtype(y, dtype)
        up = round_to_dtype(up, dtype)
        if LORA:
            gate = round_to_dtype(gate + _lora_deltas(
                lora_b_ptr, lora_t_ptr, lora_map_ptr, cols, tl.zeros_like(cols), col_ok, M,
                lora_rank, lora_splits, LORA_SLOTS, LORA_SLOTS_POW2, BLOCK_M, LORA_RANK_POW2,
                LORA_SPLITS_POW2, 2, 0, 1, LORA_ROUND_T), dtype)
            up = round_to_dtype(up + _lora_deltas(
                lora_b_ptr, lora_t_ptr, lora_map_ptr, cols + N, tl.zeros_like(cols) + 1,
                col_ok, M, lora_rank, lora_splits, LORA_SLOTS, LORA_SLOTS_POW2, BLOCK_M,
                LORA_RANK_POW2, LORA_SPLITS_POW2, 2, 1, 2, LORA_ROUND_T), dtype)
        y = gated_product(gate, up, dtype)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if ADD:
        y = round_to_dtype(round_to_dtype(y, dtype) + tl.load(
            add_ptr + rows[:, None] * N + cols[None, :], mask=out_mask, other=0.0).to(
                tl.float32), dtype)
    if LORA and not GATED:
        if not ADD:
            y = round_to_dtype(y, dtype)
        blocks = (cols >= lora_size0).to(tl.int32) + (cols >= lora_size0 + lora_size1).to(
            tl.int32)
        y = round_to_dtype(y + _lora_deltas(
            lora_b_ptr, lora_t_ptr, lora_map_ptr, cols, blocks, col_ok, M, lora_rank,
            lora_splits, LORA_SLOTS, LORA_SLOTS_POW2, BLOCK_M, LORA_RANK_POW2,
            LORA_SPLITS_POW2, LORA_BLOCKS, 0, LORA_BLOCKS, LORA_ROUND_T), dtype)
    if WIDEN:   # y is float32: the product as x's dtype rounds it, then widened
        y = round_to_dtype(y, x_ptr.dtype.element_ty)
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, y.to(dtype), mask=out_mask)
    if NORMED_OUT:
        # Each program stores NORMED_SLICE columns of the rows; program 0 storing them all
        # ended last, and the kernel with it.
        # (In steps of at most BLOCK_K: a grid of one program stores the whole row.)
        STORE_BLOCK: tl.constexpr = NORMED_SLICE if NORMED_SLICE < BLOCK_K else BLOCK_K
        first_col = tl.program_id(0) * NORMED_SLICE
        _store_normed_rows(x_ptr, r_ptr, norm_w_ptr, normed_ptr, rows, row_ok, first_col,
                           tl.minimum(K, first_col + NORMED_SLICE), K, stride_xm, inv_rms,
                           HAS_RESIDUAL, NORM_WEIGHT, STORE_BLOCK)


def skinny_gemm_unsupported(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None) -> str | None:
    """Why this kernel cannot take these operands, or None."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return f"operands x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return f"{x.shape[0]} rows; the kernel takes 1-{MAX_ROWS}"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or (
            weight.dtype != x.dtype and weight.dtype != torch.float32):
        return f"x {x.dtype}, weight {weight.dtype}"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        return f"bias {tuple(bias.shape)}"
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return "operands not contiguous along K"
    return None


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: SkinnyConfig, silu_mul: bool = False,
                add: torch.Tensor | None = None, widen: bool = False,
                out: torch.Tensor | None = None, lora: LoRAEpilogue | None = None
                ) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> [M, N] in x's dtype;
    in float32 for a 16-bit x with a float32 weight (converted in the kernel, as
    ``torch_linear`` converts it before its GEMM).
    ``weight`` is a model weight: under PDL its first tile is read before the wait for the
    kernel launched before, which must not write it.
    With ``silu_mul`` the weight holds gate rows then up rows (as GateUpLinear stores
    them) and the result is silu(gate) * up, [M, N/2], as ``silu_and_mul`` of the plain
    product would give. With ``add`` [M, N] (not with ``silu_mul``) the result is the
    product plus ``add``, each rounded as ``product + add`` rounds them (a layer's residual
    add in its last GEMM). With ``widen`` (neither of those) the result is rounded to
    x's dtype and stored as float32, what ``.float()`` of the plain product gives, without
    that conversion's launch: an LM head's logits; into ``out`` when given (float32
    [M, N], rows contiguous). With ``lora`` (not with ``widen``) each row's adapter delta
    is added as the LoRA expand would add it into the product (into gate and up before the
    activation, as the activating expand does). The
    caller checks ``skinny_gemm_unsupported`` first (and
    ``add_unsupported``, ``widen_unsupported``)."""
    return _launch(x, weight, bias, config, silu_mul, None, None, 0.0, add=add, widen=widen,
                   out=out, lora=lora)[0]


def widen_unsupported(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None
                      ) -> str | None:
    """Why ``skinny_gemm`` cannot widen this product (into ``out``), or None."""
    if weight.dtype != x.dtype or x.dtype == torch.float32:
        return f"x {x.dtype}, weight {weight.dtype}: nothing to widen"
    if out is not None and (tuple(out.shape) != (x.shape[0], weight.shape[0])
                            or out.dtype != torch.float32 or out.stride(1) != 1
                            or out.device != x.device):
        return f"out {tuple(out.shape)} {out.dtype} for a product {x.shape[0]} x {weight.shape[0]}"
    return None


def add_unsupported(y_shape: tuple[int, int], dtype: torch.dtype, add: torch.Tensor
                    ) -> str | None:
    """Why ``skinny_gemm`` cannot add ``add`` to an output of ``y_shape`` in ``dtype``."""
    if tuple(add.shape) != tuple(y_shape) or add.dtype != dtype or not add.is_contiguous():
        return f"add {tuple(add.shape)} {add.dtype} to an output {tuple(y_shape)} {dtype}"
    return None


def rms_norm_skinny_gemm(x: torch.Tensor, residual: torch.Tensor | None,
                         norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor,
                         bias: torch.Tensor | None, config: SkinnyConfig,
                         silu_mul: bool = False, keep_normed: bool = False,
                         lora: LoRAEpilogue | None = None) -> tuple[torch.Tensor, ...]:
    """``skinny_gemm`` of rms_norm(x, norm_weight, eps, residual)'s output, and its new
    residual (x + residual; x itself without one), in one kernel; with ``keep_normed``
    also that normalised output, as rms_norm returns it; with ``lora`` each row's adapter
    delta added in the epilogue (to gate and up before the activation with ``silu_mul``). ``norm_weight`` None: a norm
    whose weight is folded into ``weight`` (RMSNorm.fold_into), so its weight is ones.
    The caller checks ``skinny_gemm_unsupported`` and ``norm_unsupported`` first."""
    y, new_residual, normed = _launch(x, weight, bias, config, silu_mul, residual,
                                      norm_weight, eps, keep_normed, norm=True, lora=lora)
    return (y, new_residual, normed) if keep_normed else (y, new_residual)


def norm_unsupported(x: torch.Tensor, residual: torch.Tensor | None,
                     norm_weight: torch.Tensor | None, weight: torch.Tensor) -> str | None:
    """Why the norm prologue cannot take these operands, or None (``norm_weight`` None: a
    folded norm's)."""
    if norm_weight is not None and (norm_weight.shape != x.shape[-1:]
                                    or norm_weight.dtype != x.dtype):
        return f"norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} for x {x.dtype}"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride() != x.stride()):
        return "residual of another shape, dtype or layout than x"
    return None


def _launch(x, weight, bias, config, silu_mul, residual, norm_weight, eps, keep_normed=False,
            norm=False, add=None, widen=False, out=None, lora=None):
    rows, depth = x.shape
    cols = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert lora is None or not widen, "a delta in the model's dtype"
    assert lora is None or not silu_mul or (
        len(lora.slice_sizes) == 2 and lora.slice_sizes[0] == lora.slice_sizes[1] == cols), \
        "a gated layer's delta: gate and up blocks"
    assert out is None or widen, "``out`` is the widened product's (widen_unsupported)"
    y = out if out is not None else torch.empty(
        (rows, cols), dtype=torch.float32 if widen else torch.promote_types(x.dtype, weight.dtype),
        device=x.device)
    new_residual = x
    if residual is not None:
        new_residual = torch.empty((rows, depth), dtype=x.dtype, device=x.device)
    normed = torch.empty((rows, depth), dtype=x.dtype, device=x.device) if keep_normed else None
    grid = (triton.cdiv(cols, config.block_n),)
    pdl = pdl_enabled(x.device)
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, y, rows, cols, depth,
        x.stride(0), weight.stride(0), y.stride(0),
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, new_residual,
        normed if normed is not None else x, float(eps), add if add is not None else y,
        *_lora_operands(lora, y),
        HAS_BIAS=bias is not None, GATED=silu_mul, BLOCK_M=_block_m(rows, config),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=depth % config.block_k == 0,
        NORM=norm, HAS_RESIDUAL=residual is not None,
        NORMED_OUT=normed is not None, PDL=pdl, NORM_WEIGHT=norm_weight is not None,
        ADD=add is not None, WIDEN=widen, MMA=config.mma,
        DOT_PRECISION=dot_precision(weight.dtype), **_lora_constants(lora),
        NORMED_SLICE=triton.next_power_of_2(triton.cdiv(depth, grid[0])) if normed is not None
        else 0,
        num_warps=config.num_warps, **pdl_launch_options(pdl))
    return y, new_residual, normed


def _lora_operands(lora: LoRAEpilogue | None, y: torch.Tensor) -> tuple:
    """The kernel's LoRA pointers and sizes (y stands in for the pointers without one)."""
    if lora is None:
        return (y, y, y, 1, 1, 1, 1)
    sizes = (*lora.slice_sizes, 0, 0)
    return (lora.b, lora.partials, lora.mapping, lora.rank, lora.splits, sizes[0], sizes[1])


def _lora_constants(lora: LoRAEpilogue | None) -> dict:
    if lora is None:
        return {}
    return dict(LORA=True, LORA_BLOCKS=len(lora.slice_sizes), LORA_SLOTS=lora.num_slots,
                LORA_SLOTS_POW2=triton.next_power_of_2(lora.num_slots),
                LORA_RANK_POW2=max(16, triton.next_power_of_2(lora.rank)),
                LORA_SPLITS_POW2=triton.next_power_of_2(lora.splits),
                LORA_ROUND_T=lora.round_t)
