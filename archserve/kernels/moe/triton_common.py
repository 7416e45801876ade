"""The Triton helpers both fused-MoE kernel modules build on (triton_fused_moe.py for
16-bit experts, triton_quantized_moe.py for quantized ones): which expert, (token, slot)
rows and output columns a program takes, SiLU*mul (and the other gated activations), an
expert's bias, the routing-weight scale and the store of a tile's rows. Both kernel
families share one tiling, so they share these."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend's availability rule reports it; nothing runs here
    triton = None

if triton is not None:

    @triton.jit
    def program_tile(block_expert_ptr, sorted_pairs_ptr, num_pairs, num_cols,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIR_ROWS: tl.constexpr):
        """This program's expert (-1: past the last tile), its (token, slot) pairs, which
        of them are real, and its output columns (of ``num_cols``) and which of them are.
        PAIR_ROWS: program m is pair m, whose expert is block_expert[m] (the flat expert
        ids); row 0 of the tile is the pair, the other rows repeat it masked off, so they
        load nothing and store nothing."""
        pid_m = tl.program_id(0)
        expert = tl.load(block_expert_ptr + pid_m)
        lanes = tl.arange(0, BLOCK_M)
        if PAIR_ROWS:
            rows = pid_m + lanes * 0
            row_ok = lanes == 0
        else:
            rows = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + lanes)
            row_ok = rows < num_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return expert, rows, row_ok, cols, cols < num_cols

    @triton.jit
    def silu_and_mul(gate, up):
        return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def gated_activation(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
        """The expert's activation (expert_activation.ACTIVATION_CODES): 0 silu(gate) * up,
        1 gpt-oss's clamped SwiGLU (gate at most ``limit``, up within +-``limit``, then
        (up + 1) * gate * sigmoid(``alpha`` * gate)), 2 DeepSeek V4's (the same clamps,
        then silu(gate) * up)."""
        if ACTIVATION == 1:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        elif ACTIVATION == 2:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = silu_and_mul(gate, up)
        else:
            act = silu_and_mul(gate, up)
        return act

    @triton.jit
    def bias_row(b_base, cols, col_ok, HAS_BIAS: tl.constexpr):
        """The expert's bias at ``cols`` as fp32 (0 without one)."""
        if HAS_BIAS:
            bias = tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros(cols.shape, tl.float32)
        return bias

    @triton.jit
    def times_routing_weights(acc, weights_ptr, rows, row_ok):
        """Each (token, slot) row of ``acc`` times that slot's routing weight."""
        return acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]

    @triton.jit
    def store_rows(out_ptr, tile, rows, row_ok, cols, col_ok, stride_ot):
        """``tile`` [M, N] into rows ``rows`` and columns ``cols`` of ``out``."""
        tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :],
                 tile.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
