"""TRITON_FUSED_MOE on quantized experts: the same token-sorted grouped GEMMs
(triton_fused_moe; tiles from triton_common's ``program_tile``, gate and up in one K loop with
the expert's gated activation, down scaled by the routing weights, each projection plus
its expert's bias where the layer has them), with quantized weight tiles read in the K loop.

Weights (kernels/moe/quantized_experts.py):

* FP8 W8A8, per channel (per-tensor scales stored per channel): the activations are
  quantized to e4m3 once per token before the gate/up GEMM and once per (token, slot)
  row before the down GEMM (dynamic per row, or the checkpoint's static scale), by
  fp8_gemm.quantize_fp8_activation, the dense layers' quantizer. The products of a tile
  accumulate unscaled; the row and column scales are applied once after the K loop.
* FP8 block (128x128 weight blocks, DeepSeek-V3 / Qwen3-FP8): activations quantized per
  token per 128 channels; each K step's product is scaled by its activation group's and
  weight block's scales (BLOCK_K divides 128).
* FP8 weight-only (activations left 16-bit): the e4m3 tile is widened to the activations'
  dtype, exactly.
* Integer groups (W4A16 / W8A16: GPTQ, AWQ, compressed-tensors pack-quantized): each
  int32 is read once and shifted apart into its values, centred on 2**(bits-1) (exact in
  fp16/bf16), multiplied unscaled, and each K step's product is scaled per group
  (BLOCK_K divides the group): sum_k x (q s + o) = s sum_k x (q - h) + (o + h s) sum_k x.

E4m3 operands go to tl.dot as float8 on GPUs with FP8 tensor cores (SM89+); elsewhere
(the CPU interpreter, whose float8 handling is not exact) their bytes are widened to fp16
by integer operations (triton_fp8_bits), which is exact, and the products are the same.
"""

from __future__ import annotations

import torch

from archserve.kernels.linear.quantized_weights import (
    ACT_DYNAMIC_GROUP,
    ACT_NONE,
    FP8_DTYPE,
    Fp8Weight,
    IntGroupWeight,
)
from archserve.kernels.moe.expert_activation import (
    ACTIVATION_CODES,
    DEFAULT_ACTIVATION,
    ExpertBiases,
    GatedActivation,
)
from archserve.kernels.moe.quantized_experts import ExpertWeight, QuantizedExperts, expert_shape
from archserve.kernels.moe.routing import align_to_blocks, route
from archserve.kernels.moe.triton_fused_moe import MoETile, default_tile, sum_slots, triton
from archserve.platform.capability import SM89
from archserve.platform.detect import device_info_for

ACT_GROUP = 128      # activation channels per dynamic group scale (fp8_gemm.GROUP)

if triton is not None:
    import triton.language as tl

    from archserve.kernels.linear.fp8_gemm import quantize_fp8_activation
    from archserve.kernels.linear.triton_fp8_bits import E4M3_AS_FP16_SCALE, e4m3_bits_to_fp16
    from archserve.kernels.linear.triton_weight_only import (
        FP8_WEIGHT,
        INT_WEIGHT,
        _centered_as,
        _int_group_params,
    )
    from archserve.kernels.moe.triton_common import (
        bias_row,
        gated_activation,
        program_tile,
        store_rows,
        times_routing_weights,
    )

    @triton.jit
    def _activation_tile(a_ptr, a_scale_ptr, a_rows, stride_a, stride_as, row_ok, k0, K,
                         A_FP8: tl.constexpr, A_GROUPED: tl.constexpr,
                         NATIVE_FP8: tl.constexpr, BLOCK_K: tl.constexpr):
        """The activation tile [M, BLOCK_K] as tl.dot takes it (e4m3 bits widened to fp16
        = value / 256 unless NATIVE_FP8), and its per-group scales for this K step."""
        ks = k0 + tl.arange(0, BLOCK_K)
        ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + ks[None, :]
        mask = row_ok[:, None] & (ks < K)[None, :]
        if A_FP8 and not NATIVE_FP8:
            a = e4m3_bits_to_fp16(tl.load(ptrs, mask=mask, other=0))
        else:
            a = tl.load(ptrs, mask=mask, other=0.0)
        sa = 1.0
        if A_GROUPED:
            sa = tl.load(a_scale_ptr + a_rows.to(tl.int64) * stride_as + k0 // 128,
                         mask=row_ok, other=0.0)
        return a, sa

    @triton.jit
    def _product(a, b, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _expert_k_step(acc, a, sa, w_base, s_base, o_base, cols, col_ok, k0, K, stride_wn,
                       stride_wk, stride_sn, stride_sk, W_KIND: tl.constexpr,
                       A_FP8: tl.constexpr, A_GROUPED: tl.constexpr,
                       NATIVE_FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                       HAS_OFFSETS: tl.constexpr, BLOCK_SCALE_N: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        """acc + this K step's product of ``a`` with the weight's columns ``cols``; scaled
        here when the scale changes along K (groups, blocks), else after the loop."""
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        if W_KIND == INT_WEIGHT:
            PACK: tl.constexpr = 32 // BITS
            BLOCK_P: tl.constexpr = BLOCK_K // PACK
            HALF: tl.constexpr = 1 << (BITS - 1)
            p = k0 // PACK + tl.arange(0, BLOCK_P)
            packed = tl.load(w_base + p.to(tl.int64)[:, None] * stride_wk
                             + cols[None, :] * stride_wn,
                             mask=(p < K // PACK)[:, None] & col_ok[None, :], other=0)
            shifts = tl.arange(0, PACK) * BITS
            q = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
            b = _centered_as(tl.reshape(q, (BLOCK_K, BLOCK_N)), a.dtype, BITS)
            t = _product(a, b, IEEE)
            s, o = _int_group_params(s_base, o_base, k0 // GROUP, cols, col_ok, stride_sk,
                                     HAS_OFFSETS, BITS)
            acc += t * s[None, :]
            if HAS_OFFSETS:
                row_sum = tl.sum(a.to(tl.float32), axis=1)
                acc += row_sum[:, None] * (o + HALF * s)[None, :]
        else:
            ptrs = w_base + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
            mask = k_ok[:, None] & col_ok[None, :]
            if NATIVE_FP8:
                b = tl.load(ptrs, mask=mask, other=0.0)
            else:
                b = e4m3_bits_to_fp16(tl.load(ptrs, mask=mask, other=0))
                if not A_FP8:
                    b = b.to(a.dtype)       # e4m3 / 256 is exact in fp16, bf16 and fp32
            t = _product(a, b, IEEE)
            if BLOCK_SCALE_N > 0:
                sw = tl.load(s_base + (cols // BLOCK_SCALE_N) * stride_sn
                             + (k0 // 128) * stride_sk, mask=col_ok, other=0.0)
                t = t * sw[None, :]
                if A_GROUPED:
                    t = t * sa[:, None]
            acc += t
        return acc

    @triton.jit
    def _expert_epilogue(acc, a_scale_ptr, a_rows, stride_as, row_ok, s_base, cols, col_ok,
                         stride_sn, W_KIND: tl.constexpr, A_FP8: tl.constexpr,
                         A_GROUPED: tl.constexpr, NATIVE_FP8: tl.constexpr,
                         BLOCK_SCALE_N: tl.constexpr):
        """The scales that do not change along K: widened e4m3's 1/256 per operand, the
        per-channel weight scale and the per-row activation scale."""
        if W_KIND == FP8_WEIGHT:
            if not NATIVE_FP8:
                acc = acc * E4M3_AS_FP16_SCALE
                if A_FP8:
                    acc = acc * E4M3_AS_FP16_SCALE
            if BLOCK_SCALE_N == 0:
                sw = tl.load(s_base + cols * stride_sn, mask=col_ok, other=0.0)
                acc = acc * sw[None, :]
            if A_FP8 and not A_GROUPED:
                sa = tl.load(a_scale_ptr + a_rows.to(tl.int64) * stride_as, mask=row_ok,
                             other=0.0)
                acc = acc * sa[:, None]
        return acc

    @triton.jit
    def _expert_operands(w_ptr, s_ptr, o_ptr, expert, stride_we, stride_se):
        """Where ``expert``'s weights, scales and offsets start."""
        e = expert.to(tl.int64)
        return w_ptr + e * stride_we, s_ptr + e * stride_se, o_ptr + e * stride_se

    @triton.jit
    def _gate_up_quant_kernel(
            x_ptr, x_scale_ptr, w_ptr, s_ptr, o_ptr, out_ptr, sorted_pairs_ptr,
            block_expert_ptr, num_pairs, inter, hidden, stride_xt, stride_xs, stride_we,
            stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ot, b_ptr, stride_be,
            alpha, limit, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
            TOP_K: tl.constexpr, W_KIND: tl.constexpr, A_FP8: tl.constexpr,
            A_GROUPED: tl.constexpr, NATIVE_FP8: tl.constexpr, BITS: tl.constexpr,
            GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_SCALE_N: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            IEEE: tl.constexpr):
        # Sorted tiles only (align_to_blocks): never the pair-rows layout.
        expert, rows, row_ok, cols, col_ok = program_tile(
            block_expert_ptr, sorted_pairs_ptr, num_pairs, inter, BLOCK_M, BLOCK_N, False)
        if expert < 0:
            return
        tokens = rows // TOP_K
        w_base, s_base, o_base = _expert_operands(w_ptr, s_ptr, o_ptr, expert, stride_we,
                                                  stride_se)
        gate_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            a, sa = _activation_tile(x_ptr, x_scale_ptr, tokens, stride_xt, stride_xs, row_ok,
                                     k0, hidden, A_FP8, A_GROUPED, NATIVE_FP8, BLOCK_K)
            gate_acc = _expert_k_step(gate_acc, a, sa, w_base, s_base, o_base, cols, col_ok,
                                      k0, hidden, stride_wn, stride_wk, stride_sn, stride_sk,
                                      W_KIND, A_FP8, A_GROUPED, NATIVE_FP8, BITS, GROUP,
                                      HAS_OFFSETS, BLOCK_SCALE_N, BLOCK_N, BLOCK_K, IEEE)
            up_acc = _expert_k_step(up_acc, a, sa, w_base, s_base, o_base, cols + inter,
                                    col_ok, k0, hidden, stride_wn, stride_wk, stride_sn,
                                    stride_sk, W_KIND, A_FP8, A_GROUPED, NATIVE_FP8, BITS,
                                    GROUP, HAS_OFFSETS, BLOCK_SCALE_N, BLOCK_N, BLOCK_K, IEEE)
        gate = _expert_epilogue(gate_acc, x_scale_ptr, tokens, stride_xs, row_ok, s_base,
                                cols, col_ok, stride_sn, W_KIND, A_FP8, A_GROUPED,
                                NATIVE_FP8, BLOCK_SCALE_N)
        up = _expert_epilogue(up_acc, x_scale_ptr, tokens, stride_xs, row_ok, s_base,
                              cols + inter, col_ok, stride_sn, W_KIND, A_FP8, A_GROUPED,
                              NATIVE_FP8, BLOCK_SCALE_N)
        b_base = b_ptr + expert.to(tl.int64) * stride_be
        gate += bias_row(b_base, cols, col_ok, HAS_BIAS)[None, :]
        up += bias_row(b_base + inter, cols, col_ok, HAS_BIAS)[None, :]
        store_rows(out_ptr, gated_activation(gate, up, alpha, limit, ACTIVATION), rows, row_ok,
                   cols, col_ok, stride_ot)

    @triton.jit
    def _down_quant_kernel(
            a_ptr, a_scale_ptr, w_ptr, s_ptr, o_ptr, out_ptr, weights_ptr, sorted_pairs_ptr,
            block_expert_ptr, num_pairs, hidden, inter, stride_at, stride_as, stride_we,
            stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ot, b_ptr, stride_be,
            HAS_BIAS: tl.constexpr, W_KIND: tl.constexpr, A_FP8: tl.constexpr, A_GROUPED: tl.constexpr,
            NATIVE_FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
            HAS_OFFSETS: tl.constexpr, BLOCK_SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        expert, rows, row_ok, cols, col_ok = program_tile(
            block_expert_ptr, sorted_pairs_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N, False)
        if expert < 0:
            return
        w_base, s_base, o_base = _expert_operands(w_ptr, s_ptr, o_ptr, expert, stride_we,
                                                  stride_se)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            a, sa = _activation_tile(a_ptr, a_scale_ptr, rows, stride_at, stride_as, row_ok,
                                     k0, inter, A_FP8, A_GROUPED, NATIVE_FP8, BLOCK_K)
            acc = _expert_k_step(acc, a, sa, w_base, s_base, o_base, cols, col_ok, k0, inter,
                                 stride_wn, stride_wk, stride_sn, stride_sk, W_KIND, A_FP8,
                                 A_GROUPED, NATIVE_FP8, BITS, GROUP, HAS_OFFSETS,
                                 BLOCK_SCALE_N, BLOCK_N, BLOCK_K, IEEE)
        acc = _expert_epilogue(acc, a_scale_ptr, rows, stride_as, row_ok, s_base, cols, col_ok,
                               stride_sn, W_KIND, A_FP8, A_GROUPED, NATIVE_FP8, BLOCK_SCALE_N)
        # The bias is the expert's output's: added before the routing weight scales it.
        acc += bias_row(b_ptr + expert.to(tl.int64) * stride_be, cols, col_ok,
                        HAS_BIAS)[None, :]
        acc = times_routing_weights(acc, weights_ptr, rows, row_ok)
        store_rows(out_ptr, acc, rows, row_ok, cols, col_ok, stride_ot)


# ---- what the kernels take ------------------------------------------------------------------

def quantized_experts_unsupported(hidden: torch.Tensor, experts: QuantizedExperts) -> str | None:
    """None when the kernels take these operands, else why not."""
    if triton is None:
        return "triton is not importable"
    if hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"computes in float16, bfloat16 or float32, not {hidden.dtype}"
    for name, w in (("w13", experts.w13), ("w2", experts.w2)):
        k = expert_shape(w)[1]
        if isinstance(w, Fp8Weight):
            if w.block is not None and w.block != (128, 128):
                return f"{name}: fp8 blocks {w.block}; the kernels take 128x128"
            if w.activation == ACT_DYNAMIC_GROUP and k % ACT_GROUP:
                return f"{name}: per-128-group activations need K % 128 == 0, K is {k}"
        elif w.group_size % 16 and w.group_size != k:
            return f"{name}: integer group size {w.group_size} is not a multiple of 16"
    if isinstance(experts.w13, Fp8Weight) and experts.w13.block is not None \
            and expert_shape(experts.w2)[1] % 128:
        return "block-fp8 gate and up rows must each fill whole 128-row blocks"
    return None


def _native_fp8(device: torch.device) -> bool:
    """tl.dot on float8 operands: CUDA GPUs with FP8 tensor cores (SM89+)."""
    info = device_info_for(device)
    return info.is_cuda and info.has_capability(SM89)


def _block_k(tile: MoETile, w: ExpertWeight) -> int:
    """The tile's K step where scales change along K: it must divide the group or block."""
    if isinstance(w, IntGroupWeight):
        return max(w.pack, min(tile.block_k, w.group_size & -w.group_size))
    if w.block is not None or w.activation == ACT_DYNAMIC_GROUP:
        return min(tile.block_k, 128)
    return tile.block_k


def _kernel_operands(a: torch.Tensor, w: ExpertWeight, native_fp8: bool
                     ) -> tuple[list, dict]:
    """(a, a_scale, weight, scale, offsets, strides...) and the constexprs of one GEMM."""
    if isinstance(w, IntGroupWeight):
        offsets = w.offsets if w.offsets is not None else w.scales
        args = [a, a, w.qweight, w.scales, offsets, a.stride(0), 0, w.qweight.stride(0),
                w.qweight.stride(2), w.qweight.stride(1), w.scales.stride(0),
                w.scales.stride(2), w.scales.stride(1)]
        return args, dict(W_KIND=INT_WEIGHT, A_FP8=False, A_GROUPED=False, NATIVE_FP8=False,
                          BITS=w.bits,
                          GROUP=w.group_size, HAS_OFFSETS=w.offsets is not None,
                          BLOCK_SCALE_N=0, IEEE=a.dtype == torch.float32)
    a_fp8 = w.activation != ACT_NONE
    native = native_fp8 and a_fp8       # weight-only fp8 widens its bytes on every GPU
    scale = a
    if a_fp8:
        a, scale = quantize_fp8_activation(a, w.activation, w.input_scale)
    weight = w.weight
    if not native:
        weight = weight.view(torch.uint8)
        a = a.view(torch.uint8) if a.dtype == FP8_DTYPE else a
    s = w.weight_scale
    block = w.block is not None
    args = [a, scale, weight, s, s, a.stride(0), scale.stride(0) if a_fp8 else 0,
            weight.stride(0), weight.stride(1), weight.stride(2), s.stride(0), s.stride(1),
            s.stride(2) if block else 0]
    return args, dict(W_KIND=FP8_WEIGHT, A_FP8=a_fp8, A_GROUPED=w.activation == ACT_DYNAMIC_GROUP,
                      NATIVE_FP8=native, BITS=8, GROUP=1, HAS_OFFSETS=False,
                      BLOCK_SCALE_N=w.block[0] if block else 0,
                      IEEE=not a_fp8 and a.dtype == torch.float32)


def fused_quantized_experts(hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                            quantized: QuantizedExperts, tile: MoETile | None = None,
                            native_fp8: bool | None = None,
                            activation: GatedActivation = DEFAULT_ACTIVATION,
                            biases: ExpertBiases | None = None) -> torch.Tensor:
    """hidden [T, H] -> [T, H] through the quantized experts; weights / experts [T, k]
    from ``route``. ``native_fp8`` None: float8 tl.dot where the GPU has FP8 tensor cores.
    ``activation`` between the projections, ``biases`` after each (the down bias before
    the routing weight)."""
    num_tokens, hidden_size = hidden.shape
    top_k = experts.shape[1]
    w13, w2 = quantized.w13, quantized.w2
    inter = expert_shape(w2)[1]
    tile = tile or default_tile(num_tokens)
    native = _native_fp8(hidden.device) if native_fp8 is None else native_fp8
    hidden = hidden.contiguous()
    align = align_to_blocks(experts, quantized.num_experts, tile.block_m)
    pairs = num_tokens * top_k
    act = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty(pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    launch = dict(num_warps=tile.num_warps, num_stages=tile.num_stages,
                  BLOCK_M=tile.block_m, BLOCK_N=tile.block_n)
    b13 = biases.w13 if biases is not None else None
    b2 = biases.w2 if biases is not None else None
    args, consts = _kernel_operands(hidden, w13, native)
    _gate_up_quant_kernel[(align.num_blocks, triton.cdiv(inter, tile.block_n))](
        args[0], args[1], *args[2:5], act, align.sorted_pairs, align.block_expert, pairs,
        inter, hidden_size, *args[5:], act.stride(0), *_bias_operands(b13, act),
        activation.alpha, activation.limit, HAS_BIAS=b13 is not None,
        ACTIVATION=ACTIVATION_CODES[activation.kind], TOP_K=top_k,
        BLOCK_K=_block_k(tile, w13), **consts, **launch)
    args, consts = _kernel_operands(act, w2, native)
    _down_quant_kernel[(align.num_blocks, triton.cdiv(hidden_size, tile.block_n))](
        args[0], args[1], *args[2:5], out, flat_weights, align.sorted_pairs,
        align.block_expert, pairs, hidden_size, inter, *args[5:], out.stride(0),
        *_bias_operands(b2, out), HAS_BIAS=b2 is not None,
        BLOCK_K=_block_k(tile, w2), **consts, **launch)
    if top_k == 1:
        return out
    return sum_slots(out, num_tokens, top_k)



def _bias_operands(bias: torch.Tensor | None, stand_in: torch.Tensor) -> tuple:
    """(a projection's biases [E, N], their expert stride); without biases a tensor that
    stands in, never read."""
    return (bias, bias.stride(0)) if bias is not None else (stand_in, 0)


def quantized_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w13: ExpertWeight,
                  w2: ExpertWeight, top_k: int, renormalize: bool, tile: MoETile | None = None,
                  routed: tuple[torch.Tensor, torch.Tensor] | None = None,
                  activation: GatedActivation = DEFAULT_ACTIVATION,
                  biases: ExpertBiases | None = None) -> torch.Tensor:
    """TritonFusedMoEImpl.forward for quantized experts: route, then the kernels."""
    quantized = QuantizedExperts(w13, w2)
    reason = quantized_experts_unsupported(hidden, quantized)
    if reason is not None:
        raise ValueError(f"TRITON_FUSED_MOE cannot run these quantized experts: {reason}")
    weights, experts = routed or route(router_logits, top_k, renormalize)
    return fused_quantized_experts(hidden, weights, experts, quantized, tile,
                                   activation=activation, biases=biases)
