"""TRITON_FUSED_MOE: the experts of a layer as two grouped GEMMs over token-sorted rows.

After routing, the (token, slot) pairs are sorted by expert and padded per expert to the
row tile (routing.align_to_blocks). Then:

1. ``_gate_up_kernel``: each program takes one tile of one expert's rows and a tile of
   the intermediate columns, multiplies the gathered token rows by that expert's gate
   *and* up rows in the same K loop (two accumulators), and writes silu(gate) * up: the
   activation never makes a round trip through memory at full 2I width.
2. ``_down_kernel``: the same tiles over the down projection, each row scaled by its
   routing weight before it is written to its (token, slot) row.

The k slots of a token are then summed in fp32 (one torch reduction: a token's slots sit
in different experts' tiles, so summing inside the kernel would need atomics, whose
order, and so rounding, changes from run to run).

Accumulation is fp32; fp32 operands multiply in full precision (no TF32), so the CPU
interpreter and an fp32 GPU run agree with the reference to rounding. Launch sizes come
from (T, k, E, tile) only: no host synchronisation, so decode can be graph-captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from archserve.kernels.moe.routing import align_to_blocks, route

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend's availability rule reports it; nothing runs here
    triton = None

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MoETile:
    block_m: int        # sorted rows per program (one expert's)
    block_n: int        # output columns per program
    block_k: int        # reduction step
    num_warps: int = 4
    num_stages: int = 3

    def key(self) -> str:
        return (f"m{self.block_m}_n{self.block_n}_k{self.block_k}_w{self.num_warps}"
                f"_s{self.num_stages}")


# Default tiles by tokens in the batch (the decode buckets first). Decode rows per expert
# are few, so a short row tile wastes least; prefill gives each expert many rows and
# wants taller tiles that reuse each weight tile across more tokens.
DEFAULT_TILES: tuple[tuple[int, MoETile], ...] = (
    (32, MoETile(16, 64, 128, 4, 3)),
    (256, MoETile(32, 64, 64, 4, 3)),
    (1024, MoETile(64, 64, 64, 4, 3)),
    (1 << 62, MoETile(64, 128, 64, 8, 3)),
)
# What the start-up tuner (kernels/moe/tuning.py) times against the default, per class of
# batch: few candidates, since each one is two Triton compiles on the first start.
_CANDIDATES: tuple[tuple[int, tuple[MoETile, ...]], ...] = (
    (16, (MoETile(16, 32, 128, 4, 4), MoETile(16, 64, 64, 4, 4), MoETile(16, 128, 64, 4, 3),
          MoETile(16, 32, 256, 4, 3))),
    (128, (MoETile(16, 64, 128, 4, 3), MoETile(32, 128, 64, 4, 3), MoETile(16, 128, 128, 8, 3),
           MoETile(64, 64, 64, 4, 3))),
    (1 << 62, (MoETile(64, 64, 64, 4, 3), MoETile(64, 128, 64, 8, 3),
               MoETile(64, 128, 64, 4, 4), MoETile(128, 128, 64, 8, 3))),
)


def _by_tokens(table: tuple, num_tokens: int):  # noqa: ANN202 - an entry of ``table``
    return next(entry for bound, entry in table if num_tokens <= bound)


def default_tile(num_tokens: int) -> MoETile:
    return _by_tokens(DEFAULT_TILES, num_tokens)


def token_bucket(num_tokens: int) -> int:
    """The tuned tiles' key: the batch rounded up to a power of two."""
    return 1 << max(num_tokens - 1, 0).bit_length()


def candidate_tiles(num_tokens: int) -> list[MoETile]:
    """The default tile first, then the others the tuner times for this batch size."""
    default = default_tile(num_tokens)
    return [default] + [t for t in _by_tokens(_CANDIDATES, num_tokens) if t != default]


if triton is not None:

    @triton.jit
    def _program_tile(block_expert_ptr, sorted_pairs_ptr, num_pairs, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        """This program's expert (-1: past the last tile), its (token, slot) pairs, which
        of them are real, and its output columns."""
        pid_m = tl.program_id(0)
        expert = tl.load(block_expert_ptr + pid_m)
        rows = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return expert, rows, rows < num_pairs, cols

    @triton.jit
    def _operand_tiles(a_ptr, a_rows, stride_a, row_ok, w_base, w_cols, stride_wn, col_ok,
                       ks, k_ok):
        """The activation tile [M, K] (rows ``a_rows``) and the weight tile [K, N]."""
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + w_cols[None, :] * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        return a, w

    @triton.jit
    def _dot(acc, a, w, IEEE_FP32: tl.constexpr):
        if IEEE_FP32:
            return acc + tl.dot(a, w, input_precision="ieee")
        return acc + tl.dot(a, w)

    @triton.jit
    def _gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
                        num_pairs, inter, hidden, stride_xt, stride_we, stride_wn,
                        stride_ot, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        IEEE_FP32: tl.constexpr):
        expert, rows, row_ok, cols = _program_tile(block_expert_ptr, sorted_pairs_ptr,
                                                   num_pairs, BLOCK_M, BLOCK_N)
        if expert < 0:
            return
        tokens = rows // TOP_K
        col_ok = cols < inter
        w_base = w13_ptr + expert.to(tl.int64) * stride_we
        gate_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            a, gate_w = _operand_tiles(x_ptr, tokens, stride_xt, row_ok, w_base, cols,
                                       stride_wn, col_ok, ks, k_ok)
            up_w = tl.load(w_base + (cols + inter)[None, :] * stride_wn + ks[:, None],
                           mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            gate_acc = _dot(gate_acc, a, gate_w, IEEE_FP32)
            up_acc = _dot(up_acc, a, up_w, IEEE_FP32)
        act = gate_acc / (1.0 + tl.exp(-gate_acc)) * up_acc
        tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :],
                 act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(act_ptr, w2_ptr, out_ptr, weights_ptr, sorted_pairs_ptr,
                     block_expert_ptr, num_pairs, hidden, inter, stride_at, stride_we,
                     stride_wn, stride_ot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, IEEE_FP32: tl.constexpr):
        expert, rows, row_ok, cols = _program_tile(block_expert_ptr, sorted_pairs_ptr,
                                                   num_pairs, BLOCK_M, BLOCK_N)
        if expert < 0:
            return
        col_ok = cols < hidden
        w_base = w2_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inter
            a, w = _operand_tiles(act_ptr, rows, stride_at, row_ok, w_base, cols, stride_wn,
                                  col_ok, ks, k_ok)
            acc = _dot(acc, a, w, IEEE_FP32)
        scale = tl.load(weights_ptr + rows, mask=row_ok, other=0.0)
        acc = acc * scale[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fused_moe_unsupported(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
                          ) -> str | None:
    """None when the kernels take these operands, else why not."""
    if triton is None:
        return "triton is not importable"
    if hidden.dtype not in SUPPORTED_DTYPES:
        return f"computes in float16, bfloat16 or float32, not {hidden.dtype}"
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        return "expert weights must be in the activations' dtype (no quantized experts yet)"
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return "expert weights must be contiguous in K"
    return None


def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, top_k: int, renormalize: bool,
              tile: MoETile | None = None,
              routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: sum over each token's top-k experts of weight * expert(x)."""
    weights, experts = routed or route(router_logits, top_k, renormalize)
    return fused_experts(hidden, weights, experts, w13, w2, tile)


def fused_experts(hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, tile: MoETile | None = None
                  ) -> torch.Tensor:
    """The expert computation after routing: weights / experts [T, k] from ``route``."""
    num_tokens, hidden_size = hidden.shape
    top_k = experts.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    tile = tile or default_tile(num_tokens)
    hidden = hidden.contiguous()
    align = align_to_blocks(experts, num_experts, tile.block_m)
    pairs = num_tokens * top_k
    act = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty(pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    ieee = hidden.dtype == torch.float32
    launch = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    _gate_up_kernel[(align.num_blocks, triton.cdiv(inter, tile.block_n))](
        hidden, w13, act, align.sorted_pairs, align.block_expert, pairs, inter, hidden_size,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0), TOP_K=top_k,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, IEEE_FP32=ieee,
        **launch)
    _down_kernel[(align.num_blocks, triton.cdiv(hidden_size, tile.block_n))](
        act, w2, out, flat_weights, align.sorted_pairs, align.block_expert, pairs,
        hidden_size, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, IEEE_FP32=ieee,
        **launch)
    if top_k == 1:
        return out
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(
        hidden.dtype)


class TritonFusedMoEImpl:
    """The backend's implementation: ``forward`` as TORCH_MOE's, through the fused kernels.
    ``tiles`` maps a token bucket (``token_bucket``) to the tile the tuner chose."""

    graph_capturable = True

    def __init__(self, device: Any = None, spec: Any = None) -> None:
        self.device = device
        self.spec = spec
        self.tiles: dict[int, MoETile] = {}

    def tile_for(self, num_tokens: int) -> MoETile:
        return self.tiles.get(token_bucket(num_tokens)) or default_tile(num_tokens)

    def prepare(self, quantized: Any, dtype: torch.dtype) -> tuple[Any, Any]:
        """Quantized experts (QuantizedExperts) as ``forward`` takes them: as they are."""
        return quantized.w13, quantized.w2

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor, w13: Any, w2: Any,
                top_k: int, renormalize: bool = True,
                routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if not isinstance(w13, torch.Tensor):        # quantized experts
            from archserve.kernels.moe.triton_quantized_moe import quantized_moe
            return quantized_moe(hidden, router_logits, w13, w2, top_k, renormalize,
                                 self.tile_for(hidden.shape[0]), routed)
        reason = fused_moe_unsupported(hidden, w13, w2)
        if reason is not None:
            raise ValueError(f"TRITON_FUSED_MOE cannot run this layer: {reason}")
        return fused_moe(hidden, router_logits, w13, w2, top_k, renormalize,
                         self.tile_for(hidden.shape[0]), routed)
