"""TRITON_FUSED_MOE: the experts of a layer as two grouped GEMMs over token-sorted rows.

Routing is one launch (triton_routing.triton_route). Then the (token, slot) pairs are
sorted by expert and padded per expert to the row tile (routing.align_to_blocks), or, for a
batch of a few pairs, not sorted at all (``MoETile.pair_rows``: see ``pair_rows_pay``).
Then:

1. ``_gate_up_kernel``: each program takes one tile of one expert's rows and a tile of
   the intermediate columns, multiplies the gathered token rows by that expert's gate
   *and* up rows in the same K loop (two accumulators), and writes silu(gate) * up: the
   activation never makes a round trip through memory at full 2I width.
2. ``_down_kernel``: the same tiles over the down projection, each row scaled by its
   routing weight before it is written to its (token, slot) row.

The k slots of a token are then summed in fp32, in slot order, by ``_sum_slots_kernel``
(one launch: a token's slots sit in different experts' tiles, so summing inside the down
kernel would need atomics, whose order, and so rounding, changes from run to run). In the
pair layout, a tile with ``down_block_n`` runs the down projection as ``_down_sum_slots_kernel``: a
program per (token, column tile) with all the token's slots, each a GEMV on the CUDA
cores, summed in registers, so no slot holds a row in memory and there is no sum launch
(the tuner times it beside the pair layout's down kernel). A tile with ``gate_up_block_n``
likewise runs the pair layout's gate/up as ``_gate_up_gemv_kernel``: GEMVs on the CUDA
cores, a program per (pair, column tile), the weights straight into registers.

Accumulation is fp32; fp32 operands multiply in full precision (no TF32), so the CPU
interpreter and an fp32 GPU run agree with the reference to rounding. Launch sizes come
from (T, k, E, tile) only: no host synchronisation, so decode can be graph-captured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from archserve.kernels.linear.quantized_weights import Mxfp4Weight
from archserve.kernels.moe.expert_activation import (
    ACTIVATION_CODES,
    DEFAULT_ACTIVATION,
    ExpertBiases,
    GatedActivation,
)
from archserve.kernels.moe.routing import align_to_blocks, experts_touched
from archserve.kernels.moe.triton_routing import triton_route
from archserve.platform.detect import device_info_for

try:
    import triton
    import triton.language as tl

    from archserve.kernels.elementwise.triton_rounding import round_to_dtype
    from archserve.kernels.linear.triton_mxfp4 import (
        mxfp4_row_pairs,
        mxfp4_scaled_dot,
        mxfp4_tile_scales,
        mxfp4_weight_tile,
        mxfp4_word_dots,
    )
    from archserve.kernels.linear.triton_skinny_gemm import _weight_times_rows
    from archserve.kernels.moe.triton_common import (
        bias_row,
        gated_activation,
        program_tile,
        store_rows,
        times_routing_weights,
    )
    from archserve.kernels.pdl import (
        pdl_enabled,
        pdl_launch_options,
        pdl_start,
        prefetch_rows_to_l2,
    )
except ImportError:  # the backend's availability rule reports it; nothing runs here
    triton = None

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class ExpertMatrices:
    """One projection of a layer's experts as the kernels read it: 16-bit ``weight``
    [E, N, K] (``scales`` None), or MXFP4 (quantized_weights.Mxfp4Weight with an expert
    axis: bytes [E, N, K/2] and e8m0 ``scales`` [E, N, K/32]); ``bias`` [E, N] or None."""

    weight: torch.Tensor
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, w: Any, bias: torch.Tensor | None = None) -> ExpertMatrices:
        """From a stacked 16-bit tensor, an Mxfp4Weight, or (as is) an ExpertMatrices."""
        if isinstance(w, ExpertMatrices):
            return w
        if isinstance(w, Mxfp4Weight):
            return cls(w.blocks, w.scales, bias)
        return cls(w, None, bias)

    @property
    def mxfp4(self) -> bool:
        return self.scales is not None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(experts, N, K) of the matrices they stand for."""
        e, n, k = self.weight.shape
        return e, n, 2 * k if self.mxfp4 else k

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def expert_bytes(self) -> int:
        """What one expert's matrix occupies (values and scales)."""
        held = self.weight[0].numel() * self.weight.element_size()
        return held + (self.scales[0].numel() if self.mxfp4 else 0)

    def word_aligned(self) -> bool:
        """Whether the word-decoding kernels (``MoETile.mxfp4_words``) may read these MXFP4
        bytes as int32 words: 4-byte aligned, with expert and row strides of whole words
        (every contiguous stack: K/2 is a multiple of 16)."""
        w = self.weight
        return (self.mxfp4 and w.data_ptr() % 4 == 0 and w.stride(0) % 4 == 0
                and w.stride(1) % 4 == 0)

    def launch_args(self, words: bool = False) -> tuple:
        """(weight, scales, bias, and their strides: expert and row of the weight, of the
        scales, expert of the bias), absent ones standing in by the weight (not read).
        ``words``: the MXFP4 bytes as int32 words (``word_aligned``), strides in words."""
        w, s, b = self.weight, self.scales, self.bias
        if words:
            w = w.view(torch.int32)
        scales = s if s is not None else w
        bias = b if b is not None else w
        return (w, scales, bias, w.stride(0), w.stride(1), scales.stride(0), scales.stride(1),
                b.stride(0) if b is not None else 0)

    def flags(self) -> dict[str, bool]:
        return dict(MXFP4=self.mxfp4, HAS_BIAS=self.bias is not None)


@dataclass(frozen=True)
class MoETile:
    block_m: int        # sorted rows per program (one expert's)
    block_n: int        # output columns per program
    block_k: int        # reduction step
    num_warps: int = 4
    num_stages: int = 3
    # One (token, slot) pair per program, no sort: block_m rows of which row 0 is real
    # (tl.dot needs 16), the expert of the program is the pair's own (``pair_rows_pay``).
    pair_rows: bool = False
    # Pair layout only: the down projection as ``_down_sum_slots_kernel`` (a program per
    # token and down_block_n columns, every slot's expert in it, the slots summed in
    # registers: no slot-sum launch) with these columns and K step; 0: ``_down_kernel``.
    down_block_n: int = 0
    down_block_k: int = 0
    # Pair layout only: gate/up as ``_gate_up_gemv_kernel`` (GEMVs on the CUDA cores, a
    # program per pair and gate_up_block_n columns) with this K step; 0: ``_gate_up_kernel``.
    gate_up_block_n: int = 0
    gate_up_block_k: int = 0
    # MXFP4 experts, those two CUDA-core kernels: the packed values read as int32 words and
    # decoded 8 a word, the scale applied once a word (triton_mxfp4.mxfp4_word_dots: about
    # half the instructions a value of the byte decode, WORD_GATE_UP_TILES); the down
    # kernel's slots in one tile. Ignored for 16-bit experts and unaligned bytes.
    mxfp4_words: bool = False
    # MXFP4 experts, the tensor-core kernels (sorted or pair rows): the packed tile handed
    # to tl.dot_scaled (triton_mxfp4.mxfp4_scaled_dot), the compiler's upcast in place of
    # the register decode. bf16 activations only (dot_scaled's upcast computes in bf16);
    # ignored otherwise, and for 16-bit experts.
    mxfp4_scaled_dot: bool = False

    def scaled_dot_runs(self, w: ExpertMatrices, dtype: torch.dtype) -> bool:
        """Whether the tensor-core kernels take ``mxfp4_scaled_dot`` for ``w``."""
        return self.mxfp4_scaled_dot and w.mxfp4 and dtype == torch.bfloat16

    def key(self) -> str:
        return (f"m{self.block_m}_n{self.block_n}_k{self.block_k}_w{self.num_warps}"
                f"_s{self.num_stages}" + ("_pairs" if self.pair_rows else "")
                + (f"_sumdown{self.down_block_n}x{self.down_block_k}"
                   if self.down_block_n else "")
                + (f"_gemvgateup{self.gate_up_block_n}x{self.gate_up_block_k}"
                   if self.gate_up_block_n else "") + ("_words" if self.mxfp4_words else "")
                + ("_scaleddot" if self.mxfp4_scaled_dot else ""))

    @classmethod
    def from_key(cls, key: str) -> MoETile:
        """The tile whose ``key()`` this is (benchmark command lines name tiles by key)."""
        scaled_dot = key.endswith("_scaleddot")
        key = key.removesuffix("_scaleddot")
        words = key.endswith("_words")
        key, _, gemv = key.removesuffix("_words").partition("_gemvgateup")
        head, _, sum_down = key.partition("_sumdown")
        down_n, down_k = (int(v) for v in sum_down.split("x")) if sum_down else (0, 0)
        gate_up_n, gate_up_k = (int(v) for v in gemv.split("x")) if gemv else (0, 0)
        m, n, k, w, s = (int(part[1:]) for part in head.removesuffix("_pairs").split("_"))
        return cls(m, n, k, w, s, pair_rows=head.endswith("_pairs"), down_block_n=down_n,
                   down_block_k=down_k, gate_up_block_n=gate_up_n, gate_up_block_k=gate_up_k,
                   mxfp4_words=words, mxfp4_scaled_dot=scaled_dot)


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


# The pair layout against the sorted one. align_to_blocks is ~15 small launches per layer:
# ~40 µs of a graph replay on an H200 (a profiler trace: ~25 launches of 2-3 µs with the
# torch routing), while giving each pair its own rows costs one more read of an expert's
# weights per pair that shares it with an earlier pair (an upper bound: pairs of one expert
# run side by side in the grid and may meet in L2). At HBM speed (~4.8 TB/s) 40 µs moves
# ~190 MB: so pairs get their own rows while the expected re-read bytes stay under that.
# Qwen3-30B-A3B (E 128, k 8, 9.4 MB experts): up to 8 tokens (12.4 re-reads, 117 MB); 16
# would re-read ~48 (450 MB). Mixtral-8x7B (E 8, k 2, 352 MB experts): 1 and 2 tokens (0
# and 0.5 re-reads); 3 re-read 1.4. Past PAIR_ROWS_MAX_PAIRS the grid (a program row per
# pair) grows with the batch while the sorted one does not. The tuner (kernels/moe/
# tuning.py) times both layouts near the boundary and may choose either.
PAIR_ROWS_BYTES = 190 << 20
PAIR_ROWS_MAX_PAIRS = 64
PAIR_TILE_BLOCK_NS = (64, 32, 16)     # widest first: fewer programs, longer loads
# (down_block_n, down_block_k) of the slot-summing down kernel the tuner times beside the
# pair layout's: a program holds its fp32 products (slots x columns x K step) and the step's
# weights, so a step stays at 4096 values at top-8 (ptxas for sm_90a at 4 warps: 128
# registers, four programs an SM; 8 x 4 x 256 took 254, one). A batch-1 step needs a few
# hundred programs (hidden 2048 / 4 columns = 512) to keep every SM loading weights.
# The leaders of benchmarks/bench_moe_tiles.py's sweep on an H200: 4 x 256
# at Qwen3-30B-A3B's and DeepSeek-V2-Lite's batch 1-2, 1 x 1024 at Mixtral-8x7B's (its
# experts' K is 14336), 4 x 128 and 8 x 128 at batch 4.
SUM_DOWN_TILES = ((4, 256), (4, 128), (2, 256), (1, 1024), (8, 128))
# (gate_up_block_n, gate_up_block_k) of the CUDA-core gate/up the tuner times in the pair
# layout: the skinny GEMV's leading one-row tiles (kernels/linear/triton_skinny_gemm.py),
# here with two weight tiles (gate and up) a step. ncu of the tl.dot form at Qwen3-30B-A3B's
# batch 1 (H200): 57% of DRAM peak, 48% of its warps' stalls on the shared-memory reads that
# feed tensor cores one real row in 16. In bench_moe_tiles.py's sweep a column a program
# with K steps of 1024 led at every model and batch (1-4 tokens), 4 x 256 second or third;
# with the best down, 1-2.5 µs a layer under the tl.dot gate/up.
GATE_UP_GEMV_TILES = ((1, 1024), (4, 256))
# The word-decoding GEMVs' (MoETile.mxfp4_words) tiles for MXFP4 experts: gate/up
# (columns, K step) and the slot-summing down's. A K step of 1024 puts a row's 128 words on
# the 128 threads of 4 warps, one a thread (256 and 512 at 4 slots, 16 and 8 rows), so the
# activations lie where their words do (a K step of 512 at 4 gate/up rows moves them
# through shared memory every step: not a candidate). ptxas at gpt-oss-20b's experts
# (sm_80 to sm_120a): 40-125 registers, no spills; SASS per value a K step: ~7.5
# instructions gate/up and ~9.5 down, against ~14 and ~20 for the byte decode's leading
# tiles (4 x 256, 1 x 1024). K steps nearly divide 2880 (3 x 1024: 7% masked).
WORD_GATE_UP_TILES = ((4, 1024), (8, 1024), (2, 1024))
WORD_SUM_DOWN_TILES = ((1, 1024), (2, 512), (4, 256))
# MXFP4 experts' tl.dot_scaled tiles (MoETile.mxfp4_scaled_dot), the tuner's candidates for
# the sorted layout beside _CANDIDATES, by tokens in the batch. A tile's decoded weights
# serve its block_m rows: the register decode's tiles (m64_n128_k64 at 8 warps past 1024
# tokens) spend about 860 SASS instructions a K step on 1M MACs and store the weights to
# shared memory a 16-bit value at a time (161 TFLOP/s at 4096 tokens of gpt-oss-20b on an
# H100, the bf16 experts' 402); the scaled dot's loop (sm_90a: the upcast weight wgmma's
# register operand, activations and bytes in asynchronous copies, wgmma 3 deep) spends
# about 470 on 2M MACs at m128_n128_k64. ptxas at gpt-oss's experts: 95-243 registers,
# no spills at sm_90a and sm_100a; the m128 tiles spill 40-88 bytes at sm_80 and sm_120
# (mma.sync), where the tuner times them all the same.
SCALED_DOT_TILES: tuple[tuple[int, tuple[MoETile, ...]], ...] = (
    (512, (MoETile(32, 128, 64, 8, 3, mxfp4_scaled_dot=True),
           MoETile(64, 128, 64, 8, 4, mxfp4_scaled_dot=True),
           MoETile(32, 64, 128, 4, 4, mxfp4_scaled_dot=True))),
    (1 << 62, (MoETile(128, 128, 64, 8, 3, mxfp4_scaled_dot=True),
               MoETile(64, 128, 64, 8, 4, mxfp4_scaled_dot=True),
               MoETile(128, 64, 64, 4, 3, mxfp4_scaled_dot=True))),
)


def pair_rows_pay(num_tokens: int, top_k: int, num_experts: int, expert_bytes: int) -> bool:
    """Whether this batch runs faster unsorted, each (token, slot) pair its own row tile."""
    pairs = num_tokens * top_k
    if pairs > PAIR_ROWS_MAX_PAIRS:
        return False
    rereads = pairs - experts_touched(num_tokens, num_experts, top_k)
    return rereads * expert_bytes <= PAIR_ROWS_BYTES


def pair_tile(num_pairs: int, narrowest: int, sm_count: int, block_n: int | None = None,
              block_k: int = 128, num_stages: int = 4, num_warps: int = 4) -> MoETile:
    """The pair layout's tile. Its grid is num_pairs x (columns / block_n), a few hundred
    programs at most in decode: the default block_n is the widest that still gives both
    GEMMs (``narrowest``: the smaller of intermediate and hidden) two programs per SM, so
    that a batch-1 step keeps every SM loading weights (8 pairs x 768 / 16 = 384 programs
    for Qwen3-30B-A3B's gate/up on 132 SMs, where 64 would give 96)."""
    if block_n is None:
        block_n = next((n for n in PAIR_TILE_BLOCK_NS
                        if num_pairs * -(-narrowest // n) >= 2 * sm_count),
                       PAIR_TILE_BLOCK_NS[-1])
    return MoETile(16, block_n, block_k, num_warps, num_stages, pair_rows=True)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU (a host-side property: no sync, so it is safe
    inside a graph capture); 1 elsewhere, where it only sizes interpreter grids."""
    return device_info_for(device).multiprocessor_count or 1


def _expert_bytes(w13: ExpertMatrices, w2: ExpertMatrices) -> int:
    return w13.expert_bytes + w2.expert_bytes


def _by_tokens(table: tuple, num_tokens: int):  # noqa: ANN202 - an entry of ``table``
    return next(entry for bound, entry in table if num_tokens <= bound)


def default_tile(num_tokens: int) -> MoETile:
    return _by_tokens(DEFAULT_TILES, num_tokens)


def token_bucket(num_tokens: int) -> int:
    """The tuned tiles' key: the batch rounded up to a power of two."""
    return 1 << max(num_tokens - 1, 0).bit_length()


def choose_tile(num_tokens: int, top_k: int, w13: Any, w2: Any) -> MoETile:
    """The untuned tile of a batch: the pair layout where ``pair_rows_pay``, else the sorted
    layout's ``default_tile``. w13, w2: anything ``ExpertMatrices.of`` takes."""
    w13, w2 = ExpertMatrices.of(w13), ExpertMatrices.of(w2)
    experts, two_inter, hidden = w13.shape
    if pair_rows_pay(num_tokens, top_k, experts, _expert_bytes(w13, w2)):
        return pair_tile(num_tokens * top_k, min(two_inter // 2, hidden), _sm_count(w13.device))
    return default_tile(num_tokens)


def candidate_tiles(num_tokens: int, top_k: int, w13: Any, w2: Any) -> list[MoETile]:
    """``choose_tile`` first, then the others the tuner times for this batch: where the
    pair layout is the default, its other widths, the sorted default, and each gate/up
    kernel (tl.dot, GATE_UP_GEMV_TILES) with each down (tl.dot then the sum,
    SUM_DOWN_TILES); near the boundary
    (up to twice PAIR_ROWS_MAX_PAIRS pairs), the sorted tiles and two pair tiles; past it,
    the sorted tiles (and MXFP4 experts' SCALED_DOT_TILES)."""
    w13, w2 = ExpertMatrices.of(w13), ExpertMatrices.of(w2)
    default = choose_tile(num_tokens, top_k, w13, w2)
    pairs = num_tokens * top_k
    _, two_inter, hidden = w13.shape
    narrowest = min(two_inter // 2, hidden)
    sms = _sm_count(w13.device)
    pair_tiles = [pair_tile(pairs, narrowest, sms, n) for n in PAIR_TILE_BLOCK_NS]
    pair_tiles.append(pair_tile(pairs, narrowest, sms, default.block_n, 256, 3))
    # The widest pair tile at 8 warps: at 4 its gate/up kernel needs 255 registers and
    # spills (ptxas for sm_90a, Qwen3-30B-A3B's experts: 428 bytes), and on the H200 the
    # tuner chose that tile at batch 1 all the same; at 8 nothing spills.
    pair_tiles.append(pair_tile(pairs, narrowest, sms, PAIR_TILE_BLOCK_NS[0], num_warps=8))
    if default.pair_rows:
        tiles = pair_tiles + [default_tile(num_tokens)]
        # Each gate/up (the default's tl.dot, the CUDA-core ones) with each down (the
        # default's and the slot-summing ones): the two kernels' best partners differ.
        gate_ups = [default] + [dataclasses.replace(default, gate_up_block_n=n,
                                                    gate_up_block_k=k)
                                for n, k in GATE_UP_GEMV_TILES]
        downs = [(0, 0)] + (list(SUM_DOWN_TILES) if top_k > 1 else [])
        tiles += [dataclasses.replace(gate_up, down_block_n=n, down_block_k=k)
                  for gate_up in gate_ups for n, k in downs]
        tiles += _word_tiles(default, top_k, w13, w2)
    elif pairs <= 2 * PAIR_ROWS_MAX_PAIRS:
        tiles = (list(_by_tokens(_CANDIDATES, num_tokens)) + pair_tiles[:2]
                 + _word_tiles(pair_tiles[0], top_k, w13, w2)[:2])
    else:
        tiles = list(_by_tokens(_CANDIDATES, num_tokens))
        if w13.mxfp4 and w2.mxfp4:
            tiles += _by_tokens(SCALED_DOT_TILES, num_tokens)
    return [default] + [t for t in dict.fromkeys(tiles) if t != default]


def _word_tiles(pair: MoETile, top_k: int, w13: ExpertMatrices,
                w2: ExpertMatrices) -> list[MoETile]:
    """MXFP4 experts' word-decoding tiles on a pair tile: each WORD_GATE_UP_TILES gate/up
    with each WORD_SUM_DOWN_TILES down (the pair tile's down at top-1). None for 16-bit or
    unaligned experts."""
    if not (w13.word_aligned() and w2.word_aligned()):
        return []
    downs = list(WORD_SUM_DOWN_TILES) if top_k > 1 else [(0, 0)]
    return [dataclasses.replace(pair, gate_up_block_n=gn, gate_up_block_k=gk,
                                down_block_n=dn, down_block_k=dk, mxfp4_words=True)
            for gn, gk in WORD_GATE_UP_TILES for dn, dk in downs]


if triton is not None:

    @triton.jit
    def _activation_tile(a_ptr, a_rows, stride_a, row_ok, ks, k_ok):
        """The activation tile [M, K] (rows ``a_rows``)."""
        return tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                       mask=row_ok[:, None] & k_ok[None, :], other=0.0)

    @triton.jit
    def _weight_tile(w_base, s_base, cols, col_ok, k0, ks, k_ok, K, stride_wn, stride_sn,
                     dtype: tl.constexpr, MXFP4: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_N: tl.constexpr):
        """The expert's weight tile [K, N] at rows ``cols``: 16-bit as stored, or MXFP4
        decoded into ``dtype`` in registers (triton_mxfp4)."""
        if MXFP4:
            w = mxfp4_weight_tile(w_base, s_base, cols, col_ok, k0, K, stride_wn, stride_sn,
                                  dtype, BLOCK_K, BLOCK_N)
        else:
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        return w

    @triton.jit
    def _dot(acc, a, w, IEEE_FP32: tl.constexpr):
        if IEEE_FP32:
            return acc + tl.dot(a, w, input_precision="ieee")
        return acc + tl.dot(a, w)

    @triton.jit
    def _gate_up_kernel(x_ptr, w13_ptr, s13_ptr, b13_ptr, out_ptr, sorted_pairs_ptr,
                        block_expert_ptr, num_pairs, inter, hidden, stride_xt, stride_we,
                        stride_wn, stride_se, stride_sn, stride_be, stride_ot, alpha, limit,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        IEEE_FP32: tl.constexpr, PAIR_ROWS: tl.constexpr,
                        MXFP4: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
                        ACTIVATION: tl.constexpr = 0, PDL: tl.constexpr = False,
                        SCALED_DOT: tl.constexpr = False):
        """act[rows, cols] = activation(x[tokens] . gate[cols]ᵀ, x[tokens] . up[cols]ᵀ) for
        one tile of one expert's rows. MXFP4 weights: decoded in registers
        (``_weight_tile``), or with SCALED_DOT (bf16) handed packed to tl.dot_scaled
        (``mxfp4_scaled_dot``)."""
        pdl_start(PDL)
        expert, rows, row_ok, cols, col_ok = program_tile(
            block_expert_ptr, sorted_pairs_ptr, num_pairs, inter, BLOCK_M, BLOCK_N, PAIR_ROWS)
        if expert < 0:
            return
        tokens = rows // TOP_K
        e = expert.to(tl.int64)
        w_base, s_base = w13_ptr + e * stride_we, s13_ptr + e * stride_se
        gate_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SCALED_DOT:
            gate_s = mxfp4_tile_scales(s_base, cols, col_ok, 0, hidden, stride_sn, BLOCK_K)
            up_s = mxfp4_tile_scales(s_base, cols + inter, col_ok, 0, hidden, stride_sn,
                                     BLOCK_K)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            a = _activation_tile(x_ptr, tokens, stride_xt, row_ok, ks, k_ok)
            if SCALED_DOT:
                next_gate_s = mxfp4_tile_scales(s_base, cols, col_ok, k0 + BLOCK_K, hidden,
                                                stride_sn, BLOCK_K)
                next_up_s = mxfp4_tile_scales(s_base, cols + inter, col_ok, k0 + BLOCK_K,
                                              hidden, stride_sn, BLOCK_K)
                gate_acc = mxfp4_scaled_dot(gate_acc, a, w_base, gate_s, cols, col_ok, k0,
                                            hidden, stride_wn, BLOCK_K)
                up_acc = mxfp4_scaled_dot(up_acc, a, w_base, up_s, cols + inter, col_ok, k0,
                                          hidden, stride_wn, BLOCK_K)
                gate_s, up_s = next_gate_s, next_up_s
            else:
                gate_w = _weight_tile(w_base, s_base, cols, col_ok, k0, ks, k_ok, hidden,
                                      stride_wn, stride_sn, a.dtype, MXFP4, BLOCK_K, BLOCK_N)
                up_w = _weight_tile(w_base, s_base, cols + inter, col_ok, k0, ks, k_ok,
                                    hidden, stride_wn, stride_sn, a.dtype, MXFP4, BLOCK_K,
                                    BLOCK_N)
                gate_acc = _dot(gate_acc, a, gate_w, IEEE_FP32)
                up_acc = _dot(up_acc, a, up_w, IEEE_FP32)
        b_base = b13_ptr + e * stride_be
        gate_acc += bias_row(b_base, cols, col_ok, HAS_BIAS)[None, :]
        up_acc += bias_row(b_base + inter, cols, col_ok, HAS_BIAS)[None, :]
        store_rows(out_ptr, gated_activation(gate_acc, up_acc, alpha, limit, ACTIVATION), rows,
                   row_ok, cols, col_ok, stride_ot)

    @triton.jit
    def _gate_up_gemv_kernel(x_ptr, w13_ptr, s13_ptr, b13_ptr, out_ptr, experts_ptr, inter,
                             hidden, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
                             stride_be, stride_ot, alpha, limit, TOP_K: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EVEN_K: tl.constexpr, MXFP4: tl.constexpr = False,
                             HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = 0,
                             PDL: tl.constexpr = False, WORDS: tl.constexpr = False):
        """act[pair, cols] = silu(x[token] . gate[cols]ᵀ) * (x[token] . up[cols]ᵀ) for one
        (token, slot) pair of the pair layout, with the pair's expert: two GEMVs on the
        CUDA cores, whose weight tiles go from memory straight to registers (the tl.dot
        form stages them through shared memory for tensor cores that use one row in 16).
        The products are summed over K in fp32 and rounded once, as ``_gate_up_kernel``
        stores its tile. MXFP4 weights: each byte's two values times x's even and odd
        elements (triton_mxfp4.mxfp4_row_pairs); with WORDS, int32 words of 8 values
        (triton_mxfp4.mxfp4_word_dots). The experts come from the routing, the kernel
        right before: all is read after PDL's wait."""
        pdl_start(PDL)
        pair = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        expert = tl.load(experts_ptr + pair).to(tl.int64)
        x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xt
        # [N, 1]: bytes, 16-bit values, or int32 words (WORDS: strides in words).
        gate_rows = w13_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        up_rows = gate_rows + inter * stride_wn
        gate_scales = s13_ptr + expert * stride_se + cols.to(tl.int64)[:, None] * stride_sn
        up_scales = gate_scales + inter * stride_sn
        if MXFP4 and WORDS:
            BLOCK_W: tl.constexpr = BLOCK_K // 8
            gate = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
            up = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
            for w0 in range(0, hidden // 8, BLOCK_W):
                x = _word_activations(x_row, w0, hidden, BLOCK_W)
                gate += mxfp4_word_dots(gate_rows, gate_scales, col_ok[:, None], x, w0,
                                        hidden, BLOCK_W)
                up += mxfp4_word_dots(up_rows, up_scales, col_ok[:, None], x, w0, hidden,
                                      BLOCK_W)
        elif MXFP4:
            BLOCK_P: tl.constexpr = BLOCK_K // 2
            gate = tl.zeros([BLOCK_N, BLOCK_P], tl.float32)
            up = tl.zeros([BLOCK_N, BLOCK_P], tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                k = k0 + 2 * tl.arange(0, BLOCK_P)
                x_even = tl.load(x_row + k, mask=k < hidden, other=0.0).to(tl.float32)[None, :]
                x_odd = tl.load(x_row + k + 1, mask=k < hidden,
                                other=0.0).to(tl.float32)[None, :]
                even, odd = mxfp4_row_pairs(gate_rows, gate_scales, col_ok[:, None], k0,
                                            hidden, BLOCK_K)
                gate += even * x_even + odd * x_odd
                even, odd = mxfp4_row_pairs(up_rows, up_scales, col_ok[:, None], k0, hidden,
                                            BLOCK_K)
                up += even * x_even + odd * x_odd
        else:
            ks = tl.arange(0, BLOCK_K)
            gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                k = k0 + ks
                x = tl.load(x_row + k, mask=k < hidden, other=0.0).to(tl.float32)[None, :]
                # One row: [BLOCK_N, BLOCK_K] tiles, no runs summed in registers (VEC 1).
                gate = _weight_times_rows(gate, gate_rows, x, k[None, :], col_ok[:, None],
                                          hidden, 1, EVEN_K, 1)
                up = _weight_times_rows(up, up_rows, x, k[None, :], col_ok[:, None], hidden, 1,
                                        EVEN_K, 1)
        b_base = b13_ptr + expert * stride_be
        act = gated_activation(tl.sum(gate, axis=1) + bias_row(b_base, cols, col_ok, HAS_BIAS),
                               tl.sum(up, axis=1) + bias_row(b_base + inter, cols, col_ok,
                                                             HAS_BIAS),
                               alpha, limit, ACTIVATION)
        tl.store(out_ptr + pair * stride_ot + cols, act.to(out_ptr.dtype.element_ty),
                 mask=col_ok)

    @triton.jit
    def _store_sum(dst, total, mask, add_ptr, add_offsets, ADD: tl.constexpr):
        """Store a token's fp32 expert sum at ``dst``; with ADD, rounded first, plus
        add_ptr[add_offsets] (the residual: a decoder block's output and its input summed
        as ``moe_out + residual`` rounds them), rounded again."""
        dtype: tl.constexpr = dst.dtype.element_ty
        if ADD:
            total = round_to_dtype(round_to_dtype(total, dtype) + tl.load(
                add_ptr + add_offsets, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(dst, total.to(dtype), mask=mask)

    @triton.jit
    def _down_kernel(act_ptr, w2_ptr, s2_ptr, b2_ptr, out_ptr, weights_ptr, sorted_pairs_ptr,
                     block_expert_ptr, num_pairs, hidden, inter, stride_at, stride_we,
                     stride_wn, stride_se, stride_sn, stride_be, stride_ot,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, IEEE_FP32: tl.constexpr, PAIR_ROWS: tl.constexpr,
                     MXFP4: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
                     PDL: tl.constexpr = False, SCALED_DOT: tl.constexpr = False):
        # SCALED_DOT: as ``_gate_up_kernel``'s. Before PDL's wait (kernels/pdl.py): which
        # expert and rows this program takes were written by the routing (and the sort)
        # before the gate/up kernel, the kernel right before, which writes only the
        # activations. So the first K tile of the expert's weight is prefetched into L2
        # while gate/up drains.
        expert, rows, row_ok, cols, col_ok = program_tile(
            block_expert_ptr, sorted_pairs_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N, PAIR_ROWS)
        e = expert.to(tl.int64)
        w_base, s_base = w2_ptr + e * stride_we, s2_ptr + e * stride_se
        if PDL:
            # The first K tile's bytes of each row (half its values for MXFP4).
            ROW_BYTES: tl.constexpr = BLOCK_K // 2 if MXFP4 else BLOCK_K
            prefetch_rows_to_l2(w_base + cols.to(tl.int64) * stride_wn,
                                col_ok & ((cols * 0 + expert) >= 0),
                                tl.minimum(inter // (2 if MXFP4 else 1), ROW_BYTES), ROW_BYTES,
                                PDL)
        pdl_start(PDL)
        if expert < 0:
            return
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SCALED_DOT:
            scales = mxfp4_tile_scales(s_base, cols, col_ok, 0, inter, stride_sn, BLOCK_K)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inter
            a = _activation_tile(act_ptr, rows, stride_at, row_ok, ks, k_ok)
            if SCALED_DOT:
                next_scales = mxfp4_tile_scales(s_base, cols, col_ok, k0 + BLOCK_K, inter,
                                                stride_sn, BLOCK_K)
                acc = mxfp4_scaled_dot(acc, a, w_base, scales, cols, col_ok, k0, inter,
                                       stride_wn, BLOCK_K)
                scales = next_scales
            else:
                w = _weight_tile(w_base, s_base, cols, col_ok, k0, ks, k_ok, inter,
                                 stride_wn, stride_sn, a.dtype, MXFP4, BLOCK_K, BLOCK_N)
                acc = _dot(acc, a, w, IEEE_FP32)
        # The bias is the expert's output's: added before the routing weight scales it.
        acc += bias_row(b2_ptr + e * stride_be, cols, col_ok, HAS_BIAS)[None, :]
        acc = times_routing_weights(acc, weights_ptr, rows, row_ok)
        store_rows(out_ptr, acc, rows, row_ok, cols, col_ok, stride_ot)

    @triton.jit
    def _down_sum_slots_kernel(act_ptr, w2_ptr, s2_ptr, b2_ptr, out_ptr, weights_ptr,
                               experts_ptr, hidden, inter, stride_at, stride_we, stride_wn,
                               stride_se, stride_sn, stride_be, stride_ot, add_ptr, stride_add,
                               TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               MXFP4: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
                               PDL: tl.constexpr = False, ADD: tl.constexpr = False,
                               WORDS: tl.constexpr = False):
        """out[t, cols] = sum over slots j of weight[t, j] * (act[t * TOP_K + j] .
        w2[expert[t, j]][cols]ᵀ): a GEMV per slot on the CUDA cores (one row each: tensor
        cores would be 1/16 used), rounded to the output dtype as ``_down_kernel`` stores
        each slot's row, then summed in fp32 in registers (``_sum_slots_kernel``'s sum,
        without its launch). SLOTS: TOP_K rounded up to a power of two, masked. ADD: plus
        add[t] (``_store_sum``). MXFP4: the slots one after another, each a GEMV over its
        expert's decoded rows (``_mxfp4_slot_parts``), summed in the same order; with WORDS,
        every slot's rows in one tile of int32 words (``_mxfp4_word_slot_parts``)."""
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        if MXFP4 and WORDS:
            pdl_start(PDL)
            total = _mxfp4_word_slot_parts(act_ptr, w2_ptr, s2_ptr, b2_ptr, weights_ptr,
                                           experts_ptr, token, hidden, inter, stride_at,
                                           stride_we, stride_wn, stride_se, stride_sn,
                                           stride_be, out_ptr.dtype.element_ty, TOP_K, SLOTS,
                                           BLOCK_N, BLOCK_K, HAS_BIAS)
            _store_sum(out_ptr + token * stride_ot + cols, total, col_ok, add_ptr,
                       token * stride_add + cols, ADD)
            return
        if MXFP4:
            pdl_start(PDL)
            total = _mxfp4_slot_parts(act_ptr, w2_ptr, s2_ptr, b2_ptr, weights_ptr,
                                      experts_ptr, token, cols, col_ok, inter, stride_at,
                                      stride_we, stride_wn, stride_se, stride_sn, stride_be,
                                      out_ptr.dtype.element_ty, TOP_K, BLOCK_N, BLOCK_K,
                                      HAS_BIAS)
            _store_sum(out_ptr + token * stride_ot + cols, total, col_ok, add_ptr,
                       token * stride_add + cols, ADD)
            return
        slots = tl.arange(0, SLOTS)
        slot_ok = slots < TOP_K
        pairs = token * TOP_K + slots
        ks = tl.arange(0, BLOCK_K)
        # Before PDL's wait (kernels/pdl.py): the experts were written by the routing,
        # before the gate/up kernel (the one right before, which writes only the
        # activations), and the weights by nobody: the first K step's weights load while
        # gate/up drains.
        experts = tl.load(experts_ptr + pairs, mask=slot_ok, other=0)
        w_rows = (w2_ptr + experts.to(tl.int64)[:, None, None] * stride_we
                  + cols.to(tl.int64)[None, :, None] * stride_wn)          # [S, N, 1]
        w_ok = slot_ok[:, None, None] & col_ok[None, :, None]
        w = tl.load(w_rows + ks[None, None, :], mask=w_ok & (ks < inter)[None, None, :],
                    other=0.0)
        pdl_start(PDL)
        a_rows = act_ptr + pairs[:, None] * stride_at                      # [S, 1]
        a = tl.load(a_rows + ks[None, :], mask=slot_ok[:, None] & (ks < inter)[None, :],
                    other=0.0)
        acc = w.to(tl.float32) * a.to(tl.float32)[:, None, :]
        for k0 in range(BLOCK_K, inter, BLOCK_K):
            k = k0 + ks
            k_ok = k < inter
            w = tl.load(w_rows + k[None, None, :], mask=w_ok & k_ok[None, None, :], other=0.0)
            a = tl.load(a_rows + k[None, :], mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * a.to(tl.float32)[:, None, :]
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        parts = tl.sum(acc, axis=2)
        if HAS_BIAS:     # each slot's expert's bias, before its routing weight
            parts += tl.load(b2_ptr + experts.to(tl.int64)[:, None] * stride_be + cols[None, :],
                             mask=slot_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        parts = parts * tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0)[:, None]
        total = tl.sum(round_to_dtype(parts, dtype), axis=0)
        _store_sum(out_ptr + token * stride_ot + cols, total, col_ok, add_ptr,
                   token * stride_add + cols, ADD)

    @triton.jit
    def _mxfp4_slot_parts(act_ptr, w_ptr, s_ptr, b_ptr, weights_ptr, experts_ptr, token,
                          cols, col_ok, inter, stride_at, stride_we, stride_wn, stride_se,
                          stride_sn, stride_be, dtype: tl.constexpr, TOP_K: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr):
        """Sum over token ``token``'s slots of each slot's down row at ``cols`` (MXFP4
        experts, decoded by triton_mxfp4.mxfp4_row_pairs; plus its bias), times its routing
        weight, rounded to ``dtype``: in fp32, in slot order."""
        BLOCK_P: tl.constexpr = BLOCK_K // 2
        total = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(TOP_K):
            pair = token * TOP_K + j
            expert = tl.load(experts_ptr + pair).to(tl.int64)
            w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
            s_rows = s_ptr + expert * stride_se + cols.to(tl.int64)[:, None] * stride_sn
            a_row = act_ptr + pair * stride_at
            acc = tl.zeros([BLOCK_N, BLOCK_P], tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                even, odd = mxfp4_row_pairs(w_rows, s_rows, col_ok[:, None], k0, inter,
                                            BLOCK_K)
                k = k0 + 2 * tl.arange(0, BLOCK_P)
                a_even = tl.load(a_row + k, mask=k < inter, other=0.0).to(tl.float32)
                a_odd = tl.load(a_row + k + 1, mask=k < inter, other=0.0).to(tl.float32)
                acc += even * a_even[None, :] + odd * a_odd[None, :]
            part = tl.sum(acc, axis=1) + bias_row(b_ptr + expert * stride_be, cols, col_ok,
                                                   HAS_BIAS)
            total += round_to_dtype(part * tl.load(weights_ptr + pair), dtype)
        return total

    @triton.jit
    def _word_activations(a_rows, w0, K, BLOCK_W: tl.constexpr, row_ok=None):
        """The activations of words w0 .. w0 + BLOCK_W as fp32 [R, BLOCK_W, 8]: ``a_rows``
        a row's pointer (R 1) or [R, 1, 1] pointers (``row_ok`` [R, 1, 1]); 0 from K on."""
        k = 8 * (w0 + tl.arange(0, BLOCK_W))[None, :, None] + tl.arange(0, 8)[None, None, :]
        mask = k < K
        if row_ok is not None:
            mask = mask & row_ok
        return tl.load(a_rows + k, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _mxfp4_word_slot_parts(act_ptr, w_ptr, s_ptr, b_ptr, weights_ptr, experts_ptr, token,
                               hidden, inter, stride_at, stride_we, stride_wn,
                               stride_se, stride_sn, stride_be, dtype: tl.constexpr,
                               TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               HAS_BIAS: tl.constexpr):
        """``_mxfp4_slot_parts``' sum with every slot's rows in one tile (row r: slot
        r // BLOCK_N, column r % BLOCK_N), so a K step loads SLOTS times the words of one
        slot; the slots' parts rounded to ``dtype`` and summed in fp32."""
        ROWS: tl.constexpr = SLOTS * BLOCK_N
        r = tl.arange(0, ROWS)
        slot = r // BLOCK_N
        row_cols = tl.program_id(1) * BLOCK_N + r % BLOCK_N
        row_ok = (slot < TOP_K) & (row_cols < hidden)
        pairs = token * TOP_K + slot
        experts = tl.load(experts_ptr + pairs, mask=row_ok, other=0).to(tl.int64)
        w_rows = w_ptr + (experts * stride_we + row_cols.to(tl.int64) * stride_wn)[:, None]
        s_rows = (s_ptr + experts[:, None] * stride_se
                  + row_cols.to(tl.int64)[:, None] * stride_sn)
        a_rows = act_ptr + pairs[:, None, None] * stride_at
        BLOCK_W: tl.constexpr = BLOCK_K // 8
        acc = tl.zeros([ROWS, BLOCK_W], tl.float32)
        for w0 in range(0, inter // 8, BLOCK_W):
            a = _word_activations(a_rows, w0, inter, BLOCK_W, row_ok[:, None, None])
            acc += mxfp4_word_dots(w_rows, s_rows, row_ok[:, None], a, w0, inter, BLOCK_W)
        parts = tl.sum(acc, axis=1)
        if HAS_BIAS:     # each slot's expert's bias, before its routing weight
            parts += tl.load(b_ptr + experts * stride_be + row_cols, mask=row_ok,
                             other=0.0).to(tl.float32)
        parts = round_to_dtype(parts * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0),
                               dtype)
        return tl.sum(tl.reshape(parts, (SLOTS, BLOCK_N)), axis=0)

    @triton.jit
    def _sum_slots_kernel(src_ptr, dst_ptr, hidden, stride_src, stride_dst, add_ptr,
                          stride_add, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                          PDL: tl.constexpr = False, ADD: tl.constexpr = False):
        """dst[t] = sum over j of src[t * TOP_K + j], in fp32 and slot order (the same
        rounding on every run); with ADD, plus add[t] (``_store_sum``)."""
        pdl_start(PDL)
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        col_ok = cols < hidden
        acc = tl.zeros(cols.shape, dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(src_ptr + (token * TOP_K + j) * stride_src + cols, mask=col_ok,
                           other=0.0).to(tl.float32)
        _store_sum(dst_ptr + token * stride_dst + cols, acc, col_ok, add_ptr,
                   token * stride_add + cols, ADD)


def fused_moe_unsupported(hidden: torch.Tensor, w13: Any, w2: Any) -> str | None:
    """None when the kernels take these operands (16-bit experts in the activations' dtype,
    or MXFP4 experts), else why not."""
    if triton is None:
        return "triton is not importable"
    if hidden.dtype not in SUPPORTED_DTYPES:
        return f"computes in float16, bfloat16 or float32, not {hidden.dtype}"
    w13, w2 = ExpertMatrices.of(w13), ExpertMatrices.of(w2)
    for w in (w13, w2):
        if w.mxfp4:
            if w.shape[2] % 32:
                return f"MXFP4 experts need K a multiple of 32, K is {w.shape[2]}"
        elif w.weight.dtype != hidden.dtype:
            return "16-bit expert weights must be in the activations' dtype"
        if w.weight.stride(-1) != 1 or (w.mxfp4 and w.scales.stride(-1) != 1):
            return "expert weights must be contiguous in K"
    return None


def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w13: Any, w2: Any,
              top_k: int, renormalize: bool, tile: MoETile | None = None,
              routed: tuple[torch.Tensor, torch.Tensor] | None = None,
              add: torch.Tensor | None = None,
              activation: GatedActivation = DEFAULT_ACTIVATION,
              biases: ExpertBiases | None = None) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: sum over each token's top-k experts of weight * expert(x)
    (+ ``add``, see ``fused_experts``)."""
    weights, experts = routed or triton_route(router_logits, top_k, renormalize)
    return fused_experts(hidden, weights, experts, w13, w2, tile, add, activation, biases)


def fused_experts(hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  w13: Any, w2: Any, tile: MoETile | None = None,
                  add: torch.Tensor | None = None,
                  activation: GatedActivation = DEFAULT_ACTIVATION,
                  biases: ExpertBiases | None = None) -> torch.Tensor:
    """The expert computation after routing: weights / experts [T, k] from ``route``.
    w13, w2: stacked 16-bit tensors or Mxfp4Weights. ``activation`` between gate/up and
    down; ``biases`` after each projection (the down bias before the routing weight).
    ``add`` [T, H] (a decoder block's residual): added to the rounded sum and rounded
    again, in the kernel that sums the slots (a torch add after the single-slot path, which
    has none)."""
    w13 = ExpertMatrices.of(w13, biases.w13 if biases is not None else None)
    w2 = ExpertMatrices.of(w2, biases.w2 if biases is not None else None)
    tile = tile or choose_tile(hidden.shape[0], experts.shape[1], w13, w2)
    layout = _pair_layout if tile.pair_rows else _sorted_layout
    return layout(hidden.contiguous(), weights, experts, w13, w2, tile, add, activation)


def _sorted_layout(hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   w13: ExpertMatrices, w2: ExpertMatrices, tile: MoETile,
                   add: torch.Tensor | None, activation: GatedActivation) -> torch.Tensor:
    """The (token, slot) pairs sorted by expert and padded per expert to the row tile
    (``align_to_blocks``): both GEMMs as tensor-core tiles of one expert's rows, then the
    slot sum."""
    align = align_to_blocks(experts, w13.shape[0], tile.block_m)
    flat_weights = _flat_weights(weights)
    act = _gate_up_tiles(hidden, w13, tile, experts.shape[1], align.sorted_pairs,
                         align.block_expert, align.num_blocks, activation)
    return _down_tiles_then_sum(act, flat_weights, w2, tile, experts.shape, align.sorted_pairs,
                                align.block_expert, align.num_blocks, add)


def _pair_layout(hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 w13: ExpertMatrices, w2: ExpertMatrices, tile: MoETile,
                 add: torch.Tensor | None, activation: GatedActivation) -> torch.Tensor:
    """No sort: program m is pair m, of expert ``experts.flatten()[m]``. Gate/up as
    tensor-core tiles, or with ``gate_up_block_n`` as GEMVs on the CUDA cores; down as tiles
    then the slot sum, or with ``down_block_n`` as GEMVs whose slots are summed in
    registers."""
    num_tokens, top_k = experts.shape
    flat_experts = experts.reshape(-1)
    pairs = flat_experts.shape[0]
    flat_weights = _flat_weights(weights)
    if tile.gate_up_block_n:
        act = _gate_up_gemvs(hidden, w13, tile, top_k, flat_experts, activation)
    else:
        act = _gate_up_tiles(hidden, w13, tile, top_k, flat_experts, flat_experts, pairs,
                             activation)
    if tile.down_block_n and top_k > 1:
        return _down_gemvs_summed(act, flat_weights, w2, tile, num_tokens, top_k,
                                  flat_experts, add)
    return _down_tiles_then_sum(act, flat_weights, w2, tile, experts.shape, flat_experts,
                                flat_experts, pairs, add)


def _flat_weights(weights: torch.Tensor) -> torch.Tensor:
    return weights.reshape(-1).to(torch.float32).contiguous()


def _tile_launch(tile: MoETile, device: torch.device) -> dict[str, Any]:
    pdl = pdl_enabled(device)
    return dict(num_warps=tile.num_warps, num_stages=tile.num_stages, PDL=pdl,
                **pdl_launch_options(pdl))


def _activation_args(activation: GatedActivation) -> tuple[tuple[float, float], dict]:
    return (activation.alpha, activation.limit), dict(ACTIVATION=ACTIVATION_CODES[activation.kind])


def _gate_up_tiles(hidden: torch.Tensor, w13: ExpertMatrices, tile: MoETile, top_k: int,
                   sorted_pairs: torch.Tensor, block_expert: torch.Tensor, num_blocks: int,
                   activation: GatedActivation) -> torch.Tensor:
    """The activation [T * k, I] of every pair, as ``_gate_up_kernel``'s tiles."""
    num_tokens, hidden_size = hidden.shape
    pairs, inter = num_tokens * top_k, w13.shape[1] // 2
    act = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    w, s, b, *strides = w13.launch_args()
    scalars, act_kind = _activation_args(activation)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tile.block_n))](
        hidden, w, s, b, act, sorted_pairs, block_expert, pairs, inter, hidden_size,
        hidden.stride(0), *strides, act.stride(0), *scalars, TOP_K=top_k,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        IEEE_FP32=hidden.dtype == torch.float32, PAIR_ROWS=tile.pair_rows, **w13.flags(),
        SCALED_DOT=tile.scaled_dot_runs(w13, hidden.dtype), **act_kind,
        **_tile_launch(tile, hidden.device))
    return act


def _gate_up_gemvs(hidden: torch.Tensor, w13: ExpertMatrices, tile: MoETile, top_k: int,
                   flat_experts: torch.Tensor, activation: GatedActivation) -> torch.Tensor:
    """``_gate_up_tiles``' result through ``_gate_up_gemv_kernel`` (pair layout)."""
    num_tokens, hidden_size = hidden.shape
    pairs, inter = num_tokens * top_k, w13.shape[1] // 2
    act = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    pdl = pdl_enabled(hidden.device)
    words = tile.mxfp4_words and w13.word_aligned()
    w, s, b, *strides = w13.launch_args(words)
    scalars, act_kind = _activation_args(activation)
    _gate_up_gemv_kernel[(pairs, triton.cdiv(inter, tile.gate_up_block_n))](
        hidden, w, s, b, act, flat_experts, inter, hidden_size, hidden.stride(0), *strides,
        act.stride(0), *scalars, TOP_K=top_k, BLOCK_N=tile.gate_up_block_n,
        BLOCK_K=tile.gate_up_block_k, EVEN_K=hidden_size % tile.gate_up_block_k == 0,
        **w13.flags(), **act_kind, num_warps=4, PDL=pdl, WORDS=words,
        **pdl_launch_options(pdl))
    return act


def _down_tiles_then_sum(act: torch.Tensor, flat_weights: torch.Tensor, w2: ExpertMatrices,
                         tile: MoETile, routed_shape: torch.Size, sorted_pairs: torch.Tensor,
                         block_expert: torch.Tensor, num_blocks: int,
                         add: torch.Tensor | None) -> torch.Tensor:
    """Each pair's down projection (plus its bias) times its routing weight
    (``_down_kernel``'s tiles), then each token's slots summed (``sum_slots``; plus
    ``add``)."""
    num_tokens, top_k = routed_shape
    pairs, inter = act.shape
    hidden_size = w2.shape[1]
    if add is not None:
        add = add.contiguous()
    out = torch.empty(pairs, hidden_size, dtype=act.dtype, device=act.device)
    w, s, b, *strides = w2.launch_args()
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, tile.block_n))](
        act, w, s, b, out, flat_weights, sorted_pairs, block_expert, pairs,
        hidden_size, inter, act.stride(0), *strides, out.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        IEEE_FP32=act.dtype == torch.float32, PAIR_ROWS=tile.pair_rows, **w2.flags(),
        SCALED_DOT=tile.scaled_dot_runs(w2, act.dtype), **_tile_launch(tile, act.device))
    if top_k == 1:
        return out if add is None else out + add
    return sum_slots(out, num_tokens, top_k, add)


def _down_gemvs_summed(act: torch.Tensor, flat_weights: torch.Tensor, w2: ExpertMatrices,
                       tile: MoETile, num_tokens: int, top_k: int, flat_experts: torch.Tensor,
                       add: torch.Tensor | None) -> torch.Tensor:
    """The down projection and the slot sum in one launch (``_down_sum_slots_kernel``,
    pair layout, top-k > 1); plus ``add``."""
    inter = act.shape[1]
    hidden_size = w2.shape[1]
    if add is not None:
        add = add.contiguous()
    summed = torch.empty(num_tokens, hidden_size, dtype=act.dtype, device=act.device)
    pdl = pdl_enabled(act.device)
    words = tile.mxfp4_words and w2.word_aligned()
    w, s, b, *strides = w2.launch_args(words)
    _down_sum_slots_kernel[(num_tokens, triton.cdiv(hidden_size, tile.down_block_n))](
        act, w, s, b, summed, flat_weights, flat_experts, hidden_size, inter, act.stride(0),
        *strides, summed.stride(0), add if add is not None else summed,
        add.stride(0) if add is not None else 0, TOP_K=top_k,
        SLOTS=triton.next_power_of_2(top_k), BLOCK_N=tile.down_block_n,
        BLOCK_K=tile.down_block_k, **w2.flags(), num_warps=4, PDL=pdl, ADD=add is not None,
        WORDS=words, **pdl_launch_options(pdl))
    return summed


def sum_slots(out: torch.Tensor, num_tokens: int, top_k: int,
              add: torch.Tensor | None = None) -> torch.Tensor:
    """[T * k, H] -> [T, H]: each token's k rows summed in fp32 (one launch); with ``add``
    (contiguous [T, H]), plus it, rounded as ``sum + add`` rounds."""
    hidden_size = out.shape[1]
    summed = torch.empty(num_tokens, hidden_size, dtype=out.dtype, device=out.device)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    pdl = pdl_enabled(out.device)
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        out, summed, hidden_size, out.stride(0), summed.stride(0),
        add if add is not None else summed, add.stride(0) if add is not None else 0,
        TOP_K=top_k, BLOCK_H=block_h, num_warps=4, PDL=pdl, ADD=add is not None,
        **pdl_launch_options(pdl))
    return summed
