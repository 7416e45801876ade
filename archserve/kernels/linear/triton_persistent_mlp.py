"""A small model's dense MLP block at decode, in one persistent launch (issue 21's try).

    y, new_residual = down(silu(gate(n)) * up(n)), x + residual
    where n = rms_norm(x + residual) * norm_weight

The engine's path for this block is two or three launches: RMSNorm (or the norm in the
gate/up GEMV's prologue), the gate/up GEMV with silu * up in its epilogue, then the down
GEMV. At batch 1 on a small model each launch costs a few µs where its bytes take one or
two: launch, ramp-up and tail, not bandwidth (docs/benchmarks.md, "Small-model decode").
Here one program per SM does both GEMVs: its share of the gate/up columns, a grid-wide
barrier (down needs the whole activation), then its share of the down columns. The first
down tile does not depend on the activation, so each program loads it before it waits.

The barrier needs every program resident at once: the grid is the SM count, one program
each, and a program that spins too long gives up and raises a flag in the sync buffer
(``barrier_gave_up``) instead of hanging the GPU. Under Triton's interpreter programs run
one after another, so no barrier can work there: the two halves run as two launches
(``PHASES``), through the same code.

Numerics follow the separate kernels': the norm rounds as rms_norm does, gate and up are
rounded to the dtype before silu * up (as the gated GEMV epilogue does), sums are fp32. The
sums run over all of K at once, so the last bits can differ from the tiled GEMV's.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rms_norm import scale_normalized
from archserve.kernels.elementwise.triton_rounding import round_to_dtype
from archserve.kernels.linear.triton_skinny_gemm import (
    MAX_ROWS,
    _load_rows,
    _sum_over_k,
    _weight_times_rows,
)
from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start
from archserve.kernels.rules import triton_interpreted
from archserve.platform.detect import device_info_for

# Widest hidden / intermediate this kernel keeps in registers (a row of each, padded to a
# power of two, per program): the small models issue 21 is about. Wider blocks would
# spill; their GEMVs are long enough that a launch's latency is a small share anyway.
MAX_HIDDEN = 4096
MAX_INTER = 8192
# fp32 accumulator values per program: columns per tile are chosen to fill this.
_ACC_VALUES = 8192
# About a second of spinning at the barrier before a program gives up (a barrier takes
# a few µs when every program is resident).
MAX_SPINS = 1 << 20
_SYNC_SLOTS = 3      # arrived, left, gave-up flag


@triton.jit
def _grid_barrier(sync_ptr, num_programs, max_spins):
    """Wait until every program of the grid has arrived. Release / acquire at GPU scope
    make each program's stores before the barrier visible to every program after it; the
    last program to leave resets the counters for the next launch."""
    tl.debug_barrier()      # this program's threads have stored what they computed
    seen = tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu") + 1
    spins = 0
    while (seen < num_programs) & (spins < max_spins):
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    tl.debug_barrier()      # and every thread of it reads only after the acquire
    if seen < num_programs:
        tl.atomic_xchg(sync_ptr + 2, 1, sem="relaxed", scope="gpu")
    left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == num_programs - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _down_tile_weights(w2_ptr, tile, hidden, inter, stride_w2, DOWN_COLS: tl.constexpr,
                       BLOCK_I: tl.constexpr):
    """The down weight's rows of output tile ``tile`` (all of K), fp32 [DOWN_COLS, BLOCK_I]."""
    cols = tile * DOWN_COLS + tl.arange(0, DOWN_COLS)
    ks = tl.arange(0, BLOCK_I)
    w = tl.load(w2_ptr + cols.to(tl.int64)[:, None] * stride_w2 + ks[None, :],
                mask=(cols < hidden)[:, None] & (ks < inter)[None, :], other=0.0)
    return w.to(tl.float32)


@triton.jit
def _store_down_tile(y_ptr, w, act, tile, rows, row_ok, hidden, stride_ym,
                     BLOCK_M: tl.constexpr, DOWN_COLS: tl.constexpr):
    cols = tile * DOWN_COLS + tl.arange(0, DOWN_COLS)
    if BLOCK_M == 1:
        y = tl.sum(w * act, axis=1)[None, :]
    else:
        y = tl.sum(act[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols < hidden)[None, :])


@triton.jit
def _persistent_mlp_kernel(x_ptr, r_ptr, norm_w_ptr, w13_ptr, w2_ptr, act_ptr, y_ptr,
                           new_r_ptr, sync_ptr, M, hidden, inter, stride_xm, stride_w13,
                           stride_w2, stride_ym, eps, max_spins,
                           HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
                           UP_COLS: tl.constexpr, DOWN_COLS: tl.constexpr,
                           PHASES: tl.constexpr, PDL: tl.constexpr):
    # PHASES: 3 both halves with the grid barrier between them (a GPU); 1 or 2 one half
    # (the interpreter launches the kernel once for each).
    pdl_start(PDL)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    if PHASES != 2:
        hs = tl.arange(0, BLOCK_H)
        # Broadcast before the compare: the interpreter mistypes scalar-bool & tensor.
        first = (tl.zeros([BLOCK_M, BLOCK_H], tl.int32) + pid) == 0
        x = _load_rows(x_ptr, r_ptr, new_r_ptr, rows, row_ok, hs, hidden, stride_xm, first,
                       HAS_RESIDUAL, False, True)
        inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)[:, None]
        norm_w = tl.load(norm_w_ptr + hs, mask=hs < hidden, other=0.0).to(tl.float32)
        x = scale_normalized(x, inv_rms, norm_w[None, :], dtype, dtype, False)
        for tile in range(pid, tl.cdiv(inter, UP_COLS), num_programs):
            cols = tile * UP_COLS + tl.arange(0, UP_COLS)
            col_ok = cols < inter
            gate_rows = w13_ptr + cols.to(tl.int64)[:, None] * stride_w13
            up_rows = w13_ptr + (cols + inter).to(tl.int64)[:, None] * stride_w13
            if BLOCK_M == 1:
                acc = tl.zeros([UP_COLS, BLOCK_H], dtype=tl.float32)
            else:
                acc = tl.zeros([BLOCK_M, UP_COLS, BLOCK_H], dtype=tl.float32)
            acc_up = _weight_times_rows(tl.zeros_like(acc), up_rows, x, hs, col_ok, hidden,
                                        BLOCK_M, False)
            acc = _weight_times_rows(acc, gate_rows, x, hs, col_ok, hidden, BLOCK_M, False)
            gate = round_to_dtype(_sum_over_k(acc, BLOCK_M), dtype)
            act = (round_to_dtype(gate * tl.sigmoid(gate), dtype)
                   * round_to_dtype(_sum_over_k(acc_up, BLOCK_M), dtype))
            tl.store(act_ptr + rows[:, None] * inter + cols[None, :], act.to(dtype),
                     mask=row_ok[:, None] & col_ok[None, :])
    if PHASES != 1:
        down_tiles = tl.cdiv(hidden, DOWN_COLS)
        # Weights first: they do not wait for the activation.
        w_first = _down_tile_weights(w2_ptr, pid, hidden, inter, stride_w2, DOWN_COLS, BLOCK_I)
        if PHASES == 3:
            _grid_barrier(sync_ptr, num_programs, max_spins)
        ks = tl.arange(0, BLOCK_I)
        # .cg: from L2, where the other programs' stores are; never a stale L1 line.
        act = tl.load(act_ptr + rows[:, None] * inter + ks[None, :],
                      mask=row_ok[:, None] & (ks < inter)[None, :], other=0.0,
                      cache_modifier=".cg").to(tl.float32)
        if pid < down_tiles:
            _store_down_tile(y_ptr, w_first, act, pid, rows, row_ok, hidden, stride_ym,
                             BLOCK_M, DOWN_COLS)
        for tile in range(pid + num_programs, down_tiles, num_programs):
            w = _down_tile_weights(w2_ptr, tile, hidden, inter, stride_w2, DOWN_COLS, BLOCK_I)
            _store_down_tile(y_ptr, w, act, tile, rows, row_ok, hidden, stride_ym, BLOCK_M,
                             DOWN_COLS)


def persistent_mlp_unsupported(x: torch.Tensor, residual: torch.Tensor | None,
                               norm_weight: torch.Tensor, w13: torch.Tensor,
                               w2: torch.Tensor) -> str | None:
    """Why this kernel cannot take these operands, or None."""
    rows, hidden = x.shape if x.dim() == 2 else (0, 0)
    inter = w2.shape[1] if w2.dim() == 2 else 0
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows; the kernel takes 1-{MAX_ROWS}"
    if w13.shape != (2 * inter, hidden) or w2.shape != (hidden, inter):
        return f"weights gate/up {tuple(w13.shape)}, down {tuple(w2.shape)} for hidden {hidden}"
    if hidden > MAX_HIDDEN or inter > MAX_INTER:
        return (f"hidden {hidden} / intermediate {inter}: the kernel keeps rows of up to "
                f"{MAX_HIDDEN} / {MAX_INTER} in registers")
    dtypes = {x.dtype, w13.dtype, w2.dtype, norm_weight.dtype}
    if len(dtypes) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtypes {sorted(str(d) for d in dtypes)}"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride() != x.stride()):
        return "residual of another shape, dtype or layout than x"
    if x.stride(1) != 1 or w13.stride(1) != 1 or w2.stride(1) != 1:
        return "operands not contiguous along K"
    return None


@functools.cache
def _sync_buffer(device: torch.device) -> torch.Tensor:
    # One per device, zero between launches (the last program out resets it). Made on the
    # first call, which the engine's eager warm-up makes before any graph capture.
    return torch.zeros(_SYNC_SLOTS, dtype=torch.int32, device=device)


def barrier_gave_up(device: torch.device) -> bool:
    """Whether a launch on ``device`` left its barrier without every program (it then
    computed garbage): a check for tests and for the start-up timing. Synchronises."""
    return bool(_sync_buffer(device)[2].item())


def _num_programs(device: torch.device) -> int:
    info = device_info_for(device)
    if not info.is_gpu:
        return 4        # the interpreter: a few programs, so that the tile loops loop
    return info.multiprocessor_count or 4


def persistent_mlp(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                   eps: float, w13: torch.Tensor, w2: torch.Tensor,
                   num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(silu(gate(n)) * up(n)), x + residual), n = rms_norm(x + residual) * norm_weight;
    ``w13`` holds gate rows then up rows (GateUpLinear's layout), [2I, H]; ``w2`` [H, I].
    Without a residual the second result is x. The caller checks
    ``persistent_mlp_unsupported`` first."""
    rows, hidden = x.shape
    inter = w2.shape[1]
    device = x.device
    act = torch.empty((rows, inter), dtype=x.dtype, device=device)
    y = torch.empty((rows, hidden), dtype=x.dtype, device=device)
    new_residual = x if residual is None else torch.empty_like(x)
    block_m = triton.next_power_of_2(rows)
    block_h, block_i = triton.next_power_of_2(hidden), triton.next_power_of_2(inter)
    up_cols = max(1, _ACC_VALUES // (block_m * block_h))
    down_cols = max(1, _ACC_VALUES // (block_m * block_i))
    num_programs = _num_programs(device)
    interpreted = triton_interpreted()
    pdl = pdl_enabled(device)
    for phases in ((1, 2) if interpreted else (3,)):
        _persistent_mlp_kernel[(num_programs,)](
            x, residual if residual is not None else x, norm_weight, w13, w2, act, y,
            new_residual, _sync_buffer(device), rows, hidden, inter, x.stride(0),
            w13.stride(0), w2.stride(0), y.stride(0), float(eps), MAX_SPINS,
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_H=block_h,
            BLOCK_I=block_i, UP_COLS=up_cols, DOWN_COLS=down_cols, PHASES=phases, PDL=pdl,
            num_warps=num_warps, **pdl_launch_options(pdl))
    return y, new_residual
