"""The quantized GEMM kernels (weight-only, FP8 W8A8, INT8 W8A8) against reference_linear,
the weight-only ones also against a float64 product with the dequantized weight, and
their backends' rules.

On CPU the kernels run under Triton's interpreter in a child process (as the other Triton
test files do) at small shapes; the interpreter cannot run a bf16 tl.dot (it multiplies
the raw bf16 bits), so bf16 is checked there only where the kernel does not multiply in
bf16 (the GEMV, and the 8-bit W8A8 kernels). torch._scaled_mm has no CPU FP8 kernel: its
tests are GPU-only. On a GPU the ``gpu``-marked tests run the compiled kernels at
Llama-3-8B's shapes and inside a CUDA graph.

Tolerances (``assert_close``): a kernel's output may differ from the reference by one
unit in the last place of the output dtype (both round an fp32 sum that was added up in
another order) plus ``floor`` x max|reference| for the fp32 sums themselves; the floor is
1e-5, and FP8_FLOOR for FP8 tensor-core products on a GPU. Quantized activations must
equal the reference's bit for bit, the reference evaluated on the CPU (see ``oracle``).
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch

from archserve.kernels.linear.quantized_weights import (
    ACT_DYNAMIC_GROUP,
    ACT_DYNAMIC_TOKEN,
    ACT_NONE,
    ACT_STATIC_TENSOR,
    FP8_DTYPE,
    FP8_MAX,
    Fp8Weight,
    Int8Weight,
    IntGroupWeight,
    Mxfp4Weight,
    dequantize,
    dequantize_activation,
    pack_int_rows,
    quantize_activation_fp8,
    quantize_activation_int8,
    reference_linear,
)
from archserve.kernels.rules import triton_interpreted
from archserve.platform.device import features_for

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 900
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu

# Relative size of one unit in the last place (an upper bound, normal numbers).
ULP = {torch.float32: 2.0 ** -22, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
ROWS = [1, 2, 3, 4, 5, 16, 33, 128]
# FP8 tensor-core products on a GPU: Hopper adds the products inside an MMA with fewer bits
# than fp32 (truncating), so sums drift by a few 1e-4 of the largest output (measured on an
# H200 through torch._scaled_mm); fp32 products elsewhere stay within the 1e-5 floor.
FP8_FLOOR = 1e-3


# ---- operands (plain torch, any device) -------------------------------------------------

def _generator(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(seed) % (2 ** 31))


def int_group_weight(n: int, k: int, bits: int, group: int, asym: bool, act_order: bool,
                     scale_dtype: torch.dtype = torch.float16, device: str = "cpu"
                     ) -> IntGroupWeight:
    g = _generator(n, k, bits, group, asym, act_order)
    q = torch.randint(0, 2 ** bits, (k, n), generator=g)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.002) / (2 ** (bits - 4))
    scales = scales.to(scale_dtype)
    offsets = None
    if asym:
        zeros = torch.randint(0, 2 ** bits, (k // group, n), generator=g).float()
        offsets = (-zeros * scales.float()).to(scale_dtype)
    perm = torch.randperm(k, generator=g) if act_order else None
    w = IntGroupWeight(pack_int_rows(q, bits), scales, offsets, bits, group, k, n, perm)
    w.validate()
    return _to(w, device)


def fp8_weight(n: int, k: int, block: tuple[int, int] | None, activation: str = ACT_NONE,
               device: str = "cpu") -> Fp8Weight:
    g = _generator(n, k, 8, *(block or (0, 0)))
    values = (torch.randn(n, k, generator=g) * 120).clamp(-FP8_MAX, FP8_MAX)
    values[0, : min(k, 16)] = torch.tensor([2.0 ** -9, -(2.0 ** -8), 0.0, 448.0] * 4)[: min(k, 16)]
    if block is None:
        scale = torch.rand(n, generator=g) * 1e-3 + 1e-4
    else:
        scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 1e-3 + 1e-4
    input_scale = torch.tensor(0.03) if activation == ACT_STATIC_TENSOR else None
    return _to(Fp8Weight(values.to(FP8_DTYPE), scale, activation, block, input_scale), device)


def mxfp4_weight(n: int, k: int, device: str = "cpu") -> Mxfp4Weight:
    """Every e2m1 code, and scales 2**-8 to 2**2 (e8m0 119..129)."""
    g = _generator(n, k, 4)
    codes = torch.randint(0, 16, (n, k), generator=g)
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = torch.randint(119, 130, (n, k // 32), generator=g).to(torch.uint8)
    w = Mxfp4Weight(blocks, scales)
    w.validate()
    return _to(w, device)


def int8_weight(n: int, k: int, activation: str, device: str = "cpu") -> Int8Weight:
    g = _generator(n, k, 127)
    values = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 1e-3 + 1e-4
    input_scale = torch.tensor(0.03) if activation == ACT_STATIC_TENSOR else None
    return _to(Int8Weight(values, scale, activation, input_scale), device)


def _to(w, device: str):
    for name, value in vars(w).items():
        if isinstance(value, torch.Tensor):
            setattr(w, name, value.to(device))
    return w


def activations(rows: int, k: int, dtype: torch.dtype, device: str, seed: int = 0
                ) -> torch.Tensor:
    x = torch.randn(rows, k, generator=_generator(rows, k, seed)) * 2
    if rows > 1:
        x[1] = 0.0                        # a zero row: the scale floor, no 0/0
    return x.to(dtype).to(device)


def bias_for(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(n, generator=_generator(n, 3)).to(dtype).to(device)


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 floor: float = 1e-5, slack: torch.Tensor | None = None) -> None:
    assert got.dtype == dtype and got.shape == expected.shape
    expected = expected.double()
    err = (got.double() - expected).abs()
    bound = ULP[dtype] * expected.abs() + floor * expected.abs().max().clamp(min=1e-30)
    if slack is not None:
        bound = bound + slack.to(bound.device)
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (
        f"{int((err > bound).sum())} of {err.numel()} outside; worst got "
        f"{got.flatten()[worst].item()} expected {expected.flatten()[worst].item()}")


def oracle(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """reference_linear, with W8A8 activations quantized on the CPU. On CUDA, torch divides
    by a Python number as a multiply by its fp32 reciprocal (the CPU divides), so there
    reference_linear's per-token and per-group scales (absmax / FP8_MAX, / INT8_MAX) move
    by an ulp and x / scale crosses rounding ties differently; the kernels divide exactly."""
    activation = getattr(w, "activation", ACT_NONE)
    if x.device.type == "cpu" or activation == ACT_NONE:
        return reference_linear(x, w, bias)
    quantize = quantize_activation_fp8 if isinstance(w, Fp8Weight) else quantize_activation_int8
    input_scale = w.input_scale.cpu() if w.input_scale is not None else None
    q, scale = quantize(x.cpu(), activation, input_scale)
    y = dequantize_activation(q.to(x.device), scale.to(x.device)) @ dequantize(w).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def check_weight_only(x: torch.Tensor, w, bias: torch.Tensor | None, config=None) -> None:
    from archserve.kernels.linear.triton_weight_only import (
        weight_only_gemm,
        weight_only_unsupported,
    )
    assert weight_only_unsupported(x, w, bias) is None
    got = weight_only_gemm(x, w, bias, config)
    assert_close(got, reference_linear(x, w, bias), x.dtype)
    x64 = x.double()[:, w.perm] if getattr(w, "perm", None) is not None else x.double()
    exact = x64 @ dequantize(w).double().t() + (bias.double() if bias is not None else 0)
    assert_close(got, exact, x.dtype)


def reciprocal_tie_slack(x: torch.Tensor, w) -> torch.Tensor | None:
    """[M, N] float64 (None without activation quantization): how far a W8A8 kernel that quantizes x as x * (1 / scale) (the GPU
    GEMVs: HW_FP8's cvt, INT8's FAST_DIV; see e4m3_activation) may lie from the oracle,
    which divides exactly. The product is an ulp or two off the quotient, so a quotient
    within a few fp32 ulps of a rounding tie (a midpoint between two e4m3 values, or .5
    for int8) may round to the other neighbour: one quantization step of that element.
    The slack is the sum, per output, of those elements' step x |weight|; elsewhere the
    activations must still equal the oracle's exactly (typically no element is near a tie,
    and the slack is zero)."""
    activation = getattr(w, "activation", ACT_NONE)
    if activation == ACT_NONE:
        return None
    xf = x.float().cpu()
    input_scale = w.input_scale.cpu() if w.input_scale is not None else None
    if isinstance(w, Fp8Weight):
        _, scale = quantize_activation_fp8(xf, activation, input_scale)
    else:
        _, scale = quantize_activation_int8(xf, activation, input_scale)
    if scale.dim() == 2 and scale.shape[1] > 1:                  # per 128-group
        scale = scale.repeat_interleave(128, dim=1)[:, :xf.shape[1]]
    scale = scale.double().expand_as(xf)
    t = (xf.double() / scale).abs()
    octave = torch.floor(torch.log2(t.clamp(min=2.0 ** -40)))
    if isinstance(w, Fp8Weight):       # e4m3: 3 mantissa bits, subnormal below 2**-6
        step = torch.exp2(octave.clamp(min=-6.0) - 3.0)
        top = FP8_MAX
    else:
        step = torch.ones_like(t)
        top = 127.0
    frac = t / step - torch.floor(t / step)
    near = ((frac - 0.5).abs() * step <= 4.0 * torch.exp2(octave - 23.0)) & (t > 0) & (t < top)
    weights = dequantize(w).double().abs().cpu()
    return (near * step * scale) @ weights.t()


def check_w8a8(gemm, x: torch.Tensor, w, bias: torch.Tensor | None, floor: float = 1e-5,
               **kwargs) -> None:
    assert_w8a8_close(gemm(x, w, bias, **kwargs), x, w, bias, floor)


def assert_w8a8_close(got: torch.Tensor, x: torch.Tensor, w, bias: torch.Tensor | None = None,
                      floor: float = 1e-5) -> None:
    """A W8A8 kernel's output against the oracle; on a GPU, with reciprocal_tie_slack (the
    compiled kernels may quantize through a reciprocal; the interpreter's divide exactly)."""
    slack = reciprocal_tie_slack(x, w) if x.is_cuda else None
    assert_close(got, oracle(x, w, bias), x.dtype, floor, slack)


def check_activation_quantization(x: torch.Tensor, activation: str) -> None:
    from archserve.kernels.linear.fp8_gemm import quantize_fp8_activation
    from archserve.kernels.linear.int8_gemm import quantize_int8_activation
    input_scale = torch.tensor(0.05, device=x.device)
    x_cpu, scale_cpu = x.cpu(), input_scale.cpu()   # the reference divides exactly there
    if activation != ACT_DYNAMIC_GROUP:
        q, s = quantize_int8_activation(x, activation, input_scale)
        rq, rs = quantize_activation_int8(x_cpu, activation, scale_cpu)
        assert torch.equal(q.cpu(), rq) and torch.equal(s.cpu(), rs.expand_as(s))
    q, s = quantize_fp8_activation(x, activation, input_scale)
    rq, rs = quantize_activation_fp8(x_cpu, activation, scale_cpu)
    assert torch.equal(q.view(torch.uint8).cpu(), rq.view(torch.uint8))
    assert torch.equal(s.cpu(), rs.expand_as(s))


# ------------------------------------------------------------------- anywhere (no kernel)

def test_config_keys_round_trip_and_rules_pick_the_kernel():
    from archserve.kernels.linear import fp8_gemm, int8_gemm
    from archserve.kernels.linear.gemm_tiles import TileConfig
    from archserve.kernels.linear.triton_weight_only import (
        MAX_GEMV_ROWS,
        WeightOnlyConfig,
        candidate_configs,
        default_config,
    )
    weights = [int_group_weight(64, 256, 4, 32, True, False),
               int_group_weight(64, 256, 8, 256, False, False),
               fp8_weight(64, 256, None), fp8_weight(64, 256, (128, 64)),
               mxfp4_weight(64, 256)]
    for w in weights:
        # The K extent one MMA tile may span: one scale group or block (K: one group); an
        # MXFP4 tile spans whole groups of 32, scaled in registers.
        span = getattr(w, "group_size", None) or (
            w.block[1] if getattr(w, "block", None) else 256)
        for rows in ROWS:
            configs = candidate_configs(rows, 64, 256, w)
            assert configs[0] == default_config(rows, 64, 256, w)
            assert len(configs) == len(set(configs)) > 1
            for c in configs:
                assert WeightOnlyConfig.from_key(c.key()) == c
                assert c.gemv == (rows <= MAX_GEMV_ROWS)
                if c.gemv:   # the fp32 accumulator: at most 32 values per thread
                    block_m = 1 << (rows - 1).bit_length()
                    values = block_m * c.block_n * c.block_k
                    if isinstance(w, IntGroupWeight):
                        values //= w.pack
                    if isinstance(w, Mxfp4Weight):
                        values //= 2     # one accumulator per byte (two values)
                    assert values <= 32 * 32 * c.num_warps
                else:
                    assert c.block_k >= 16 and span % c.block_k == 0
                    assert c.block_m >= min(rows, 128)
                if isinstance(w, Mxfp4Weight):
                    assert c.block_k % 32 == 0
    for rows in ROWS:
        for module in (fp8_gemm, int8_gemm):
            tiles = module.candidate_configs(rows, 4096)
            assert tiles[0] == module.default_config(rows, 4096)
            assert all(TileConfig.from_key(t.key()) == t for t in tiles)
            assert all(t.block_m >= min(rows, 128) for t in tiles)


def test_split_k_fills_the_gpu_only_where_n_is_narrow():
    from archserve.kernels.linear.triton_weight_only import default_config
    w4 = int_group_weight(64, 256, 4, 128, False, False)
    narrow = default_config(1, 4096, 4096, w4)
    wide = default_config(1, 28672, 4096, w4)
    assert narrow.gemv and narrow.split_k > 1
    assert wide.split_k == 1
    assert 4096 // narrow.block_n * narrow.split_k >= 256


def test_unsupported_operands_are_named():
    from archserve.kernels.linear.fp8_gemm import block_fp8_unsupported, scaled_mm_unsupported
    from archserve.kernels.linear.int8_gemm import int8_unsupported
    from archserve.kernels.linear.triton_weight_only import weight_only_unsupported
    x = torch.zeros(2, 256, dtype=torch.float16)
    w4 = int_group_weight(32, 256, 4, 64, False, False)
    assert weight_only_unsupported(x, w4, None) is None
    assert "in_features" in weight_only_unsupported(torch.zeros(2, 128), w4, None)
    assert "int8" in weight_only_unsupported(x.to(torch.int8), w4, None)
    assert "bias" in weight_only_unsupported(x, w4, torch.zeros(3))
    odd = IntGroupWeight(w4.qweight, torch.zeros(256 // 4, 32), None, 4, 4, 256, 32)
    assert "multiple of the 8 values per int32" in weight_only_unsupported(x, odd, None)
    per_channel = fp8_weight(32, 256, None, ACT_DYNAMIC_TOKEN)
    block = fp8_weight(32, 256, (128, 128), ACT_DYNAMIC_GROUP)
    assert weight_only_unsupported(x, per_channel, None) is None
    assert weight_only_unsupported(x, block, None) is None
    assert scaled_mm_unsupported(x, per_channel) is None
    assert "block" in scaled_mm_unsupported(x, block)
    assert "divisible by 16" in scaled_mm_unsupported(torch.zeros(2, 40),
                                                      fp8_weight(24, 40, None, ACT_DYNAMIC_TOKEN))
    assert block_fp8_unsupported(x, block) is None
    assert "128-deep" in block_fp8_unsupported(x, per_channel)
    assert "activation scheme" in block_fp8_unsupported(
        x, fp8_weight(32, 256, (128, 128), ACT_DYNAMIC_TOKEN))
    assert int8_unsupported(x, int8_weight(32, 256, ACT_DYNAMIC_TOKEN)) is None
    assert "activation scheme" in int8_unsupported(x, int8_weight(32, 256, ACT_NONE))


def test_w8a8_routines_offer_the_gemv_at_decode_rows_only():
    """TORCH_SCALED_MM's tuner times the in-kernel-quantizing GEMV against its default
    (quantize, then torch._scaled_mm) up to W8A8_GEMV_ROWS; TRITON_BLOCK_FP8's beside its
    tiles, with one 128-deep K tile per activation group; configs survive the cache."""
    import json

    from archserve.kernels.linear.fp8_gemm import SCALED_MM, BlockFp8Linear, ScaledMmFp8Linear
    from archserve.kernels.linear.gemm_tiles import TileConfig
    from archserve.kernels.linear.triton_weight_only import (
        W8A8_GEMV_ROWS,
        WeightOnlyConfig,
        w8a8_gemv_unsupported,
    )
    scaled, block = ScaledMmFp8Linear(), BlockFp8Linear()
    for activation in (ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR):
        w = fp8_weight(4096, 4096, None, activation)
        for rows in (1, 3, 8, W8A8_GEMV_ROWS):
            configs = scaled.candidates(rows, w)
            assert configs[0] == SCALED_MM and len(configs) == len(set(configs)) > 3
            assert all(c.gemv for c in configs[1:])
        assert scaled.candidates(W8A8_GEMV_ROWS + 1, w) == []
        # The narrow layer's splits reach four times the default's programs.
        first, *others = scaled.candidates(1, w)[1:]
        assert dataclasses.replace(first, split_k=4 * first.split_k) in others
    w = fp8_weight(4096, 4096, (128, 128), ACT_DYNAMIC_GROUP)
    for rows in (1, W8A8_GEMV_ROWS, 64):
        configs = block.candidates(rows, w)
        tiles = [c for c in configs if isinstance(c, TileConfig)]
        gemvs = [c for c in configs if isinstance(c, WeightOnlyConfig)]
        assert configs[0] == tiles[0] and len(tiles) > 1
        assert (len(gemvs) > 1) == (rows <= W8A8_GEMV_ROWS)
        assert all(c.gemv and c.block_k == 128 for c in gemvs)
        for c in configs:
            assert block.config_from(json.loads(json.dumps(dataclasses.asdict(c)))) == c
    gemv = scaled.candidates(1, fp8_weight(64, 256, None, ACT_DYNAMIC_TOKEN))[-1]
    assert scaled.config_from(dataclasses.asdict(gemv)) == gemv
    assert "input scale" in w8a8_gemv_unsupported(None, dataclasses.replace(
        fp8_weight(64, 256, None, ACT_STATIC_TENSOR), input_scale=None))
    assert "divisible by 128" in w8a8_gemv_unsupported(
        None, fp8_weight(64, 256, (64, 64), ACT_DYNAMIC_GROUP))
    assert w8a8_gemv_unsupported(None, fp8_weight(64, 256, (128, 128), ACT_DYNAMIC_GROUP)) is None
    assert block.candidates(1, fp8_weight(64, 256, (64, 64), ACT_DYNAMIC_GROUP))[0].block_m
    from archserve.kernels.linear.int8_gemm import Int8Linear
    int8 = Int8Linear()
    for rows in (1, W8A8_GEMV_ROWS, 64):
        configs = int8.candidates(rows, int8_weight(4096, 4096, ACT_DYNAMIC_TOKEN))
        gemvs = [c for c in configs if isinstance(c, WeightOnlyConfig)]
        assert isinstance(configs[0], TileConfig) and (len(gemvs) > 1) == (rows <= 16)
        for c in configs:
            assert int8.config_from(json.loads(json.dumps(dataclasses.asdict(c)))) == c


def test_backend_rules_name_the_hardware_reason():
    from archserve.kernels.linear.quantized_backends import (
        QUANTIZED_LINEAR_BACKENDS,
        CpuWeightOnlyBackend,
        TorchScaledMmBackend,
        TritonBlockFp8Backend,
        TritonInt8Backend,
        TritonWeightOnlyBackend,
    )
    from archserve.kernels.specs import LinearSpec
    from archserve.platform.profiles import get_profile

    activation = {"fp8": ACT_DYNAMIC_TOKEN, "int8": ACT_STATIC_TENSOR,
                  "fp8_block": ACT_DYNAMIC_GROUP, "wna16": ACT_NONE, "mxfp4": ACT_NONE}

    def check(cls, profile, scheme, dtype=torch.float16, **spec):
        spec = {"activation": activation[scheme], **spec}
        return cls().check(get_profile(profile), LinearSpec(dtype=dtype, quant_scheme=scheme,
                                                            **spec), libraries="all")

    wo = TritonWeightOnlyBackend
    for scheme in ("wna16", "fp8", "fp8_block"):
        assert check(wo, "v100", scheme) is None and check(wo, "mi300x", scheme) is None
    assert check(wo, "v100", "wna16", torch.bfloat16) == "bfloat16 needs SM80+, device is SM70"
    assert check(wo, "a100", "wna16", torch.bfloat16) is None
    assert check(wo, "cpu", "wna16") == "needs a CUDA or ROCm GPU, device is cpu"
    assert "executes fp8, fp8_block, mxfp4, wna16 weights; this layer is int8" == check(
        wo, "h200", "int8")
    # MXFP4: weight-only from SM80 (bf16); below, the dequantizing torch path.
    assert check(wo, "a100", "mxfp4", torch.bfloat16) is None
    assert check(wo, "rtx5090", "mxfp4", torch.bfloat16) is None
    assert check(wo, "t4", "mxfp4") == "MXFP4 weights need SM80+ (bf16), device is SM75"
    assert check(TorchScaledMmBackend, "a100", "fp8") == "needs SM89+, device is SM80"
    assert check(TorchScaledMmBackend, "v100", "fp8", torch.bfloat16) == \
        "needs SM89+, device is SM70"
    assert check(TorchScaledMmBackend, "l40s", "fp8") is None
    assert check(TorchScaledMmBackend, "h200", "fp8", torch.bfloat16) is None
    assert "divisible by 16" in check(TorchScaledMmBackend, "h200", "fp8", in_features=4100)
    assert "fp8_block" in check(TorchScaledMmBackend, "h200", "fp8_block")
    assert check(wo, "a10", "fp8", activation=ACT_STATIC_TENSOR) is None   # any scheme
    assert "dynamic group" in check(TorchScaledMmBackend, "h200", "fp8",
                                    activation=ACT_DYNAMIC_GROUP)
    assert "dynamic token" in check(TritonBlockFp8Backend, "h200", "fp8_block",
                                    activation=ACT_DYNAMIC_TOKEN)
    assert "none" in check(TritonInt8Backend, "a100", "int8", activation=ACT_NONE)
    assert check(TritonBlockFp8Backend, "a100", "fp8_block") == "needs SM89+, device is SM80"
    assert check(TritonBlockFp8Backend, "h200", "fp8_block") is None
    assert "divisible by 128" in check(TritonBlockFp8Backend, "h200", "fp8_block",
                                       in_features=4160)
    assert check(TritonInt8Backend, "t4", "int8") == "needs SM80+, device is SM75"
    assert check(TritonInt8Backend, "a100", "int8") is None
    assert check(TritonInt8Backend, "mi300x", "int8") is None
    # CPU_WEIGHT_ONLY: torch's CPU kernels, vectorised from AVX2 on, for a bfloat16 model
    # (they take bfloat16 activations; float32 stays exact with TORCH_DEQUANT).
    cpu = CpuWeightOnlyBackend
    assert check(cpu, "cpu", "wna16", torch.bfloat16) is None
    assert "takes bfloat16 activations" in check(cpu, "cpu", "wna16", torch.float32)
    assert "requested float16" in check(cpu, "cpu", "wna16", torch.float16)
    assert check(cpu, "h200", "wna16", torch.bfloat16) == "CPU only, device is SM90"
    no_avx2 = dataclasses.replace(get_profile("cpu"), features=features_for("cpu", None))
    assert "AVX2" in cpu().check(no_avx2, LinearSpec(dtype=torch.bfloat16, quant_scheme="wna16"),
                                 libraries="all")
    assert "executes wna16 weights; this layer is fp8" == check(cpu, "cpu", "fp8", torch.bfloat16)
    for cls in QUANTIZED_LINEAR_BACKENDS:
        backend = cls()
        assert backend.implemented and backend.library == (None if cls is cpu else "triton")
        scheme = sorted(backend.formats)[0]
        if cls is not cpu:
            assert "triton" in backend.check(get_profile("h200"), LinearSpec(
                quant_scheme=scheme, activation=activation[scheme]), libraries="none")
        module, _, name = backend.impl_path.partition(":")
        assert callable(getattr(importlib.import_module(module), name))


# Compiling for a GPU needs no GPU: Triton's own ptxas and ld.lld ship with it. The launches
# are the wrappers' own (tests/triton_compile.py), so every specialization the engine can
# launch reaches the compiler, which refuses code the interpreter runs.

SM70, SM75, SM80, SM89, SM90, SM100, SM120 = (("cuda", c, 32)
                                              for c in (70, 75, 80, 89, 90, 100, 120))
GFX942 = ("hip", "gfx942", 64)
COMPILE_N, COMPILE_K = 256, 512
# Every weight-only layout: symmetric and offset groups, act order, one group over K, FP8.
WEIGHT_ONLY_LAYOUTS = {
    "int4 g128": lambda: int_group_weight(COMPILE_N, COMPILE_K, 4, 128, False, False),
    "int4 g32 offsets act-order": lambda: int_group_weight(COMPILE_N, COMPILE_K, 4, 32, True,
                                                           True),
    "int8 channel": lambda: int_group_weight(COMPILE_N, COMPILE_K, 8, COMPILE_K, False, False),
    "fp8 channel": lambda: fp8_weight(COMPILE_N, COMPILE_K, None),
    "fp8 block": lambda: fp8_weight(COMPILE_N, COMPILE_K, (128, 128)),
    "mxfp4": lambda: mxfp4_weight(COMPILE_N, COMPILE_K),
}
# GEMV rows, MMA rows, and the dequantize-then-cuBLAS rows.
COMPILE_ROWS = (1, 3, 8, 16, 64, 256)


def _launch_all(target, routine, weight, rows_list, dtype, bias=True, every_candidate=False):
    """Compile what ``routine`` launches at each row count (its default config, or every
    candidate the start-up tuner may time); returns the compiled launches."""
    from triton_compile import compiled_launches
    b = bias_for(weight.out_features, dtype, "cpu") if bias else None
    with compiled_launches(target) as launches:
        for rows in rows_list:
            x = activations(rows, weight.in_features, dtype, "cpu")
            configs = routine.candidates(rows, weight) if every_candidate else [None]
            for config in configs:
                routine.run(x, weight, b, config) if config is not None else routine(x, weight, b)
    return launches


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("layout", sorted(WEIGHT_ONLY_LAYOUTS))
def test_weight_only_launches_compile(layout):
    """Every weight-only launch compiles: bf16 for SM90 at every row count (GEMV, MMA and
    dequantize kernels), fp16 for SM70; no FP8 instruction anywhere (FP8 bytes are decoded
    with integer operations); tensor-core MMA on SM80."""
    from archserve.kernels.linear.triton_weight_only import WeightOnlyLinear
    weight = WEIGHT_ONLY_LAYOUTS[layout]()
    routine = WeightOnlyLinear()
    builds = [(SM90, torch.bfloat16, COMPILE_ROWS), (SM80, torch.bfloat16, (1, 64, 256)),
              (SM70, torch.float16, (1, 64, 256))]
    for target, dtype, rows in builds:
        launches = _launch_all(target, routine, weight, rows, dtype)
        kernels = {launch.kernel for launch in launches}
        assert {"_weight_only_gemv_kernel", "_weight_only_mma_kernel"} <= kernels, kernels
        assert any(name.startswith("_dequantize_") for name in kernels), kernels
        for launch in launches:
            assert launch.code() and "e4m3" not in launch.code(), (target, launch)
            if target == SM80 and launch.kernel == "_weight_only_mma_kernel":
                assert "mma.sync" in launch.code()


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_mxfp4_launches_compile_for_blackwell():
    """MXFP4 weights decoded in registers on the SM100 and SM120 families too (their FP4
    tensor cores are the native kernels' and rules only here): GEMV, MMA and dequantize."""
    from archserve.kernels.linear.triton_weight_only import WeightOnlyLinear
    weight = WEIGHT_ONLY_LAYOUTS["mxfp4"]()
    for target in (SM100, SM120):
        launches = _launch_all(target, WeightOnlyLinear(), weight, (1, 64, 256), torch.bfloat16)
        assert {launch.kernel for launch in launches} == {
            "_weight_only_gemv_kernel", "_weight_only_mma_kernel", "_dequantize_mxfp4_kernel"}
        assert all(launch.code() for launch in launches)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_every_tuner_candidate_compiles():
    """What the start-up tuner may time compiles too (a failing candidate is skipped at
    start-up, but would be a config the tuner can never pick)."""
    from archserve.kernels.linear.fp8_gemm import BlockFp8Linear
    from archserve.kernels.linear.int8_gemm import Int8Linear
    from archserve.kernels.linear.triton_weight_only import WeightOnlyLinear
    cases = [(WeightOnlyLinear(), WEIGHT_ONLY_LAYOUTS["int4 g128"]()),
             (WeightOnlyLinear(), WEIGHT_ONLY_LAYOUTS["fp8 block"]()),
             (BlockFp8Linear(), fp8_weight(COMPILE_N, COMPILE_K, (128, 128), ACT_DYNAMIC_GROUP)),
             (Int8Linear(), int8_weight(COMPILE_N, COMPILE_K, ACT_DYNAMIC_TOKEN))]
    for routine, weight in cases:
        launches = _launch_all(SM90, routine, weight, (1, 64), torch.bfloat16,
                               every_candidate=True)
        assert len(launches) >= 6 and all(launch.code() for launch in launches)
    # The GEMVs with two tiles in flight, on the other generations too.
    from triton_compile import compiled_launches
    routine = WeightOnlyLinear()
    for weight in (int_group_weight(COMPILE_N, 4096, 4, 32, True, True),
                   fp8_weight(COMPILE_N, 4096, None)):      # K of several tiles
        x = activations(1, 4096, torch.bfloat16, "cpu")
        for target in (SM80, SM100, SM120):
            with compiled_launches(target) as launches:
                for config in [c for c in routine.candidates(1, weight) if c.prefetch]:
                    routine.run(x, weight, None, config)
            assert launches and all(launch.constexprs["PREFETCH"]
                                              and launch.code() for launch in launches)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_w8a8_gemv_compiles_with_fp8_conversions_from_sm89():
    """The GEMV candidates of the W8A8 routines compile for each generation that runs
    them (FP8: SM89, SM90, SM100, SM120; INT8 from SM80) as the engine launches them
    there: FP8 weights decoded and activations quantized by the hardware's cvt (e4m3x2),
    one launch per GEMM. On SM90 every candidate the tuner may time; elsewhere the first at
    each row count."""
    from triton_compile import compiled_launches

    from archserve.kernels.linear.fp8_gemm import BlockFp8Linear, ScaledMmFp8Linear
    from archserve.kernels.linear.int8_gemm import Int8Linear
    from archserve.platform.profiles import get_profile
    cases = [(ScaledMmFp8Linear(), fp8_weight(COMPILE_N, COMPILE_K, None, ACT_DYNAMIC_TOKEN)),
             (ScaledMmFp8Linear(), fp8_weight(COMPILE_N, COMPILE_K, None, ACT_STATIC_TENSOR)),
             (BlockFp8Linear(), fp8_weight(COMPILE_N, COMPILE_K, (128, 128), ACT_DYNAMIC_GROUP)),
             (Int8Linear(), int8_weight(COMPILE_N, COMPILE_K, ACT_DYNAMIC_TOKEN)),
             (Int8Linear(), int8_weight(COMPILE_N, COMPILE_K, ACT_STATIC_TENSOR))]
    for profile in ("a100", "l40s", "h200", "b200", "rtx5090"):
        for routine, weight in cases:
            fp8 = isinstance(weight, Fp8Weight)
            if fp8 and profile == "a100":
                continue                      # the FP8 routines need SM89+
            with compiled_launches(get_profile(profile)) as launches:
                for rows in (1, 16):
                    x = activations(rows, COMPILE_K, torch.bfloat16, "cpu")
                    gemvs = [c for c in routine.candidates(rows, weight)
                             if getattr(c, "gemv", False)]
                    for config in gemvs if profile == "h200" else gemvs[:1]:
                        routine.run(x, weight, None, config)
            assert launches, (profile, weight)
            for launch in launches:
                assert launch.kernel == "_weight_only_gemv_kernel", launch.kernel
                assert launch.constexprs["ACT_QUANT"] > 0 and launch.constexprs["HW_FP8"] == (
                    profile != "a100")
                code = launch.code()
                assert ("cvt.rn.f16x2.e4m3x2" in code and "cvt.rn.satfinite.e4m3x2.f32"
                        in code) == fp8, (profile, weight)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_w8a8_launches_compile_to_their_tensor_core_instructions():
    """Block FP8 on FP8 tensor cores (mma.sync on SM89, wgmma on SM90), INT8 on int8 MMA
    (SM80, SM90, MI300) and refused by SM75's compiler; every activation quantization
    mode compiles."""
    from triton_compile import compiled_launches

    from archserve.kernels.linear.fp8_gemm import BlockFp8Linear, quantize_fp8_activation
    from archserve.kernels.linear.int8_gemm import Int8Linear
    block = fp8_weight(COMPILE_N, COMPILE_K, (128, 128), ACT_DYNAMIC_GROUP)
    for target, instruction in [(SM89, r"mma\.sync\S*e4m3"), (SM90, r"wgmma\S*e4m3")]:
        launches = _launch_all(target, BlockFp8Linear(), block, (1, 64, 256), torch.bfloat16)
        gemms = [launch for launch in launches if launch.kernel == "_block_fp8_gemm_kernel"]
        assert gemms and re.search(instruction, gemms[-1].code()), target
    for activation in (ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR):
        weight = int8_weight(COMPILE_N, COMPILE_K, activation)
        for target, instruction in [(SM80, r"mma\.sync\S*s8"), (SM90, r"wgmma\S*s8"),
                                    (GFX942, r"v_mfma_i32")]:
            launches = _launch_all(target, Int8Linear(), weight, (1, 256), torch.float16)
            assert re.search(instruction, launches[-1].code()), (target, activation)
        with compiled_launches(SM89) as launches:
            x = activations(4, COMPILE_K, torch.bfloat16, "cpu")
            quantize_fp8_activation(x, activation, fp8_weight(
                COMPILE_N, COMPILE_K, None, activation).input_scale)
        assert launches and launches[0].code()
    with pytest.raises(Exception):  # noqa: B017 - Triton's compile error type varies
        _launch_all(SM75, Int8Linear(), int8_weight(COMPILE_N, COMPILE_K, ACT_DYNAMIC_TOKEN),
                    (256,), torch.float16)


# ---------------------------------------------------------------- CPU: the interpreter

# (N, K, bits, group, asymmetric, act order, dtype): every group size (32/64/128/K), both
# widths, sym and asym, act order, odd N, fp16/fp32 through both kernels, bf16 (GEMV).
INT_CASES = [(40, 128, 4, 32, True, True, torch.float16),
             (96, 256, 8, 128, False, False, torch.float16),
             (33, 64, 4, 64, False, False, torch.float32),
             (8, 256, 8, 256, True, True, torch.float16),
             (96, 256, 4, 64, True, False, torch.bfloat16),
             (40, 128, 8, 32, False, True, torch.bfloat16)]
# (N, K, block, dtype)
FP8_CASES = [(40, 256, None, torch.float16), (96, 128, (16, 128), torch.float16),
             (33, 256, (32, 64), torch.float32), (40, 128, (128, 128), torch.bfloat16)]
# (N, K, dtype): a K of one group and of several tiles, odd N, every activation dtype.
MXFP4_CASES = [(40, 256, torch.float16), (33, 96, torch.float32), (24, 32, torch.float16),
               (40, 128, torch.bfloat16)]


def _case_id(case) -> str:
    return "-".join(str(v).replace("torch.", "") for v in case)


if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)

    import triton
    import triton.language as tl

    from archserve.kernels.linear.triton_fp8_bits import e4m3_bits_to_fp16, fp32_to_e4m3_bits

    @triton.jit
    def _e4m3_round_trip(x_ptr, q_ptr, back_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        q = fp32_to_e4m3_bits(tl.load(x_ptr + offs, mask=ok))
        tl.store(q_ptr + offs, q, mask=ok)
        tl.store(back_ptr + offs, e4m3_bits_to_fp16(q).to(tl.float32) * 256.0, mask=ok)

    def test_e4m3_encoding_matches_torch_at_every_tie():
        codes = torch.arange(256).to(torch.uint8)
        values = codes.view(FP8_DTYPE).float()
        values = values[values.isfinite()].unique()
        mid = (values[1:] + values[:-1]) / 2
        up, down = torch.full_like(mid, 1e9), torch.full_like(mid, -1e9)
        x = torch.cat([values, mid, torch.nextafter(mid, up), torch.nextafter(mid, down),
                       torch.randn(20000, generator=_generator(1)) * 30,
                       torch.randn(2000, generator=_generator(2)) * 1e-2,
                       torch.tensor([0.0, 1e-30, -1e-30, 2.0 ** -10])])
        q = torch.empty(x.numel(), dtype=torch.uint8)
        back = torch.empty(x.numel())
        _e4m3_round_trip[(triton.cdiv(x.numel(), 8192),)](x, q, back, x.numel(),
                                                          BLOCK=8192)
        expected = x.to(FP8_DTYPE)
        assert torch.equal(q, expected.view(torch.uint8))
        assert torch.equal(back, expected.float())

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
    @pytest.mark.parametrize("activation", [ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR,
                                            ACT_DYNAMIC_GROUP])
    def test_activation_quantization_is_the_reference_bit_for_bit(activation, dtype):
        x = activations(5, 384, dtype, "cpu")
        x[2, :6] = torch.tensor([0.5, 1.5, 2.5, -2.5, 6.35, 1e4]).to(dtype) * 0.05  # ties, clamp
        check_activation_quantization(x, activation)

    @pytest.mark.parametrize("case", INT_CASES, ids=_case_id)
    def test_int_weight_only_every_row_count(case):
        n, k, bits, group, asym, act_order, dtype = case
        w = int_group_weight(n, k, bits, group, asym, act_order)
        bias = bias_for(n, dtype, "cpu")
        rows = ROWS if dtype != torch.bfloat16 else [r for r in ROWS if r <= 5]
        for r in rows:
            check_weight_only(activations(r, k, dtype, "cpu"), w, bias if r % 2 else None)

    @pytest.mark.parametrize("case", FP8_CASES, ids=_case_id)
    def test_fp8_weight_only_every_row_count(case):
        n, k, block, dtype = case
        w = fp8_weight(n, k, block)     # ACT_NONE: the reference keeps x unquantized too
        bias = bias_for(n, dtype, "cpu")
        rows = ROWS if dtype != torch.bfloat16 else [r for r in ROWS if r <= 5]
        for r in rows:
            check_weight_only(activations(r, k, dtype, "cpu"), w, bias if r % 2 else None)

    @pytest.mark.parametrize("case", MXFP4_CASES, ids=_case_id)
    def test_mxfp4_weight_only_every_row_count(case):
        """Against dequantize-then-matmul: every e2m1 code, scales 2**-8 to 2**2; the GEMV
        (up to 8 rows), the MMA kernel (16+) and the dequantize kernel (256)."""
        n, k, dtype = case
        w = mxfp4_weight(n, k)
        bias = bias_for(n, dtype, "cpu")
        rows = ROWS if dtype != torch.bfloat16 else [r for r in ROWS if r <= 5]
        for r in rows:
            check_weight_only(activations(r, k, dtype, "cpu"), w, bias if r % 2 else None)
        if dtype != torch.bfloat16:
            from archserve.kernels.linear.triton_weight_only import WeightOnlyLinear
            x = activations(256, k, dtype, "cpu")
            assert_close(WeightOnlyLinear().run(x, w, bias, None), reference_linear(x, w, bias),
                         dtype)

    def test_every_weight_only_candidate_computes_the_same():
        from archserve.kernels.linear.triton_weight_only import candidate_configs
        for w in (int_group_weight(40, 256, 4, 64, True, False, torch.float32),
                  fp8_weight(40, 256, (16, 128)), mxfp4_weight(40, 256)):
            for rows in (1, 4, 33):
                x = activations(rows, 256, torch.float16, "cpu", seed=1)
                for config in candidate_configs(rows, 40, 256, w):
                    check_weight_only(x, w, None, config)

    def test_the_last_split_adds_the_partials_and_zeroes_its_count(monkeypatch):
        """A GEMV split over K: the tile's last split to finish adds every split's sums
        (with the bias) and writes the output, in the split order whichever finishes
        last, leaving its count zero for the next launch (a graph's replay); a launch of
        more tiles than the counts hold has the host add them, to the same values."""
        from archserve.kernels.linear import triton_weight_only as wo
        w = int_group_weight(40, 256, 4, 64, True, False, torch.float32)
        x = activations(3, 256, torch.float32, "cpu", seed=2)
        bias = torch.randn(40)
        config = dataclasses.replace(wo.default_config(3, 40, 256, w), gemv=True,
                                     block_n=16, block_k=64, split_k=4, num_warps=4)
        fused = wo.weight_only_gemm(x, w, bias, config)
        assert not wo.split_sum_counters(x.device, 1).any()
        assert_close(fused, reference_linear(x, w, bias), x.dtype)
        monkeypatch.setattr(wo, "MAX_SPLIT_TILES", 0)
        assert wo.split_sum_counters(x.device, 3) is None
        torch.testing.assert_close(wo.weight_only_gemm(x, w, bias, config), fused)

    def test_weight_only_scales_in_bf16_and_a_group_no_mma_tile_fits():
        from archserve.kernels.linear.triton_weight_only import default_config
        w = int_group_weight(24, 96, 8, 12, True, False, torch.bfloat16)   # groups of 12
        assert default_config(20, 24, 96, w).gemv                        # MMA cannot tile it
        for rows in (3, 20):
            check_weight_only(activations(rows, 96, torch.float16, "cpu"), w,
                              bias_for(24, torch.float16, "cpu"))

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
    @pytest.mark.parametrize("n,k,block", [(40, 256, (128, 128)), (96, 128, (32, 128))])
    def test_block_fp8_gemm_every_row_count(n, k, block, dtype):
        from archserve.kernels.linear.fp8_gemm import block_fp8_gemm
        w = fp8_weight(n, k, block, ACT_DYNAMIC_GROUP)
        bias = bias_for(n, dtype, "cpu")
        for r in ROWS if dtype == torch.float16 else [1, 5, 33]:
            check_w8a8(block_fp8_gemm, activations(r, k, dtype, "cpu"), w,
                       bias if r % 2 else None)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
    @pytest.mark.parametrize("activation", [ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR])
    def test_int8_gemm_every_row_count(activation, dtype):
        from archserve.kernels.linear.int8_gemm import int8_gemm
        bias = bias_for(40, dtype, "cpu")
        for (n, k) in [(40, 200), (96, 128)]:
            w = int8_weight(n, k, activation)
            for r in ROWS if dtype == torch.float16 else [1, 5, 33]:
                check_w8a8(int8_gemm, activations(r, k, dtype, "cpu"), w,
                           bias[:n] if r % 2 and n == 40 else None)

    def test_w8a8_candidate_tiles_compute_the_same():
        from archserve.kernels.linear import fp8_gemm, int8_gemm
        x = activations(20, 256, torch.float16, "cpu")
        for config in fp8_gemm.candidate_configs(20, 40):
            check_w8a8(fp8_gemm.block_fp8_gemm, x, fp8_weight(40, 256, (128, 128),
                                                                ACT_DYNAMIC_GROUP), None,
                       config=config)
        for config in int8_gemm.candidate_configs(20, 40):
            check_w8a8(int8_gemm.int8_gemm, x, int8_weight(40, 256, ACT_DYNAMIC_TOKEN), None,
                       config=config)


    @pytest.mark.parametrize("activation,block,dtype", [
        (ACT_DYNAMIC_TOKEN, None, torch.bfloat16), (ACT_STATIC_TENSOR, None, torch.float16),
        (ACT_DYNAMIC_GROUP, (128, 128), torch.float32),
        (ACT_DYNAMIC_TOKEN, "int8", torch.float16), (ACT_STATIC_TENSOR, "int8", torch.bfloat16)],
        ids=["token-channel-bf16", "tensor-tensor-fp16", "group-block-fp32", "int8-token-fp16",
             "int8-tensor-bf16"])
    def test_w8a8_gemv_quantizes_activations_as_the_reference(activation, block, dtype):
        """The GEMV with the checkpoint's activation scheme in its registers equals
        reference_linear (FP8: x quantized per token, per tensor or per 128-group;
        per-channel, per-tensor (one value per row, as loaded) or 128x128 block weight
        scales; INT8: per token or per tensor, per-channel weights) within the fp32 sums'
        rounding: every candidate at one row, the default's split at 3 and 16 (two blocks
        of 8 rows)."""
        from archserve.kernels.linear.fp8_gemm import BlockFp8Linear, ScaledMmFp8Linear
        from archserve.kernels.linear.int8_gemm import Int8Linear
        if block == "int8":
            w, routine = int8_weight(40, 256, activation), Int8Linear()
        else:
            w = fp8_weight(40, 256, block, activation)
            routine = BlockFp8Linear() if block else ScaledMmFp8Linear()
        if activation == ACT_STATIC_TENSOR:       # a per-tensor weight scale
            w.weight_scale = w.weight_scale[:1].expand(40).contiguous()
        bias = bias_for(40, dtype, "cpu")
        for rows in (1, 3, 16):
            x = activations(rows, 256, dtype, "cpu")
            x[0, :6] = torch.tensor([0.5, 1.5, 2.5, -2.5, 6.35, 1e4]).to(dtype) * 0.05
            gemvs = [c for c in routine.candidates(rows, w) if getattr(c, "gemv", False)]
            for config in gemvs if rows == 1 else gemvs[:1]:
                assert_close(routine.run(x, w, bias if rows == 3 else None, config),
                             oracle(x, w, bias if rows == 3 else None), dtype)


@pytest.mark.parametrize("activation", [ACT_DYNAMIC_TOKEN, ACT_DYNAMIC_GROUP, "int8_token"])
def test_reciprocal_tie_slack_admits_tie_flips_and_nothing_else(activation):
    """The GPU tests' slack for kernels that quantize x through a reciprocal: x * (1/scale)
    rounded in fp32 with the inverse an ulp off (as a GPU's may be) passes with it; the
    same flips fail without it (the slack is needed and not zero everywhere); a scale 0.5%
    off fails with it (the slack admits tie flips, not a wrong quantization)."""
    n, k, rows = 64, 512, 16
    if activation == "int8_token":
        w = int8_weight(n, k, ACT_DYNAMIC_TOKEN)
    else:
        w = fp8_weight(n, k, (128, 128) if activation == ACT_DYNAMIC_GROUP else None,
                       activation)
    is_fp8 = isinstance(w, Fp8Weight)
    quantize = quantize_activation_fp8 if is_fp8 else quantize_activation_int8
    # Activations on e4m3 (or int8) rounding ties relative to each row's scale, so that a
    # reciprocal's ulp decides their rounding.
    x = activations(rows, k, torch.float32, "cpu")
    x[:, :128] = x.abs().amax(dim=1, keepdim=True)   # each scale's absmax outside the ties
    scale = quantize(x, w.activation)[1]
    per_element = (scale.repeat_interleave(128, dim=1)[:, :k] if scale.shape[1] > 1
                   else scale.expand(rows, k))
    ties = torch.tensor([1.0625, 2.125, 4.25, 8.5, 17.0, 34.0, 68.0, 136.0] if is_fp8 else
                        [0.5, 1.5, 2.5, 10.5, 33.5, 64.5, 100.5, 126.5])
    pick = torch.arange(8, k, 64)
    x[:, pick] = ties[torch.arange(pick.numel()) % ties.numel()] * per_element[:, pick]
    x[1] = 0.0

    def through_reciprocal(inverse_ulps: int, scale_error: float = 1.0) -> torch.Tensor:
        s = per_element * scale_error
        inverse = (1.0 / s).float()
        for _ in range(abs(inverse_ulps)):
            inverse = torch.nextafter(inverse, inverse * (2.0 if inverse_ulps > 0 else 0.0))
        t = x.float() * inverse
        q = (t.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() if is_fp8
             else torch.round(t).clamp(-128, 127))
        return (q * s) @ dequantize(w).t()

    expected = oracle(x, w)
    slack = reciprocal_tie_slack(x, w)
    assert slack is not None and bool((slack > 0).any())
    for ulps in (1, -1, 2, -2):
        got = through_reciprocal(ulps).to(expected.dtype)
        assert_close(got, expected, expected.dtype, slack=slack)
    flipped = through_reciprocal(1).to(expected.dtype)
    with pytest.raises(AssertionError):
        assert_close(flipped, expected, expected.dtype)
    with pytest.raises(AssertionError):
        assert_close(through_reciprocal(0, 1.005).to(expected.dtype), expected,
                     expected.dtype, slack=slack)


# ------------------------------------------------------------------ GPU: real shapes

LLAMA_8B = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]
GPU_ROWS = [1, 16, 256, 4096]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if HAS_CUDA else (0, 0)


needs_fp8 = pytest.mark.skipif(_capability() < (8, 9), reason="needs FP8 tensor cores (SM89+)")


def _gpu_weight(kind: str, n: int, k: int):
    if kind == "int4_g128_asym":
        return int_group_weight(n, k, 4, 128, True, False, torch.bfloat16, "cuda")
    if kind == "int8_channel_sym":
        return int_group_weight(n, k, 8, k, False, False, torch.float32, "cuda")
    if kind == "fp8_channel":
        return fp8_weight(n, k, None, device="cuda")
    if kind == "mxfp4":
        return mxfp4_weight(n, k, "cuda")
    return fp8_weight(n, k, (128, 128), device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["int4_g128_asym", "int8_channel_sym", "fp8_channel",
                                  "fp8_block", "mxfp4"])
@pytest.mark.parametrize("n,k", LLAMA_8B, ids=[f"{n}x{k}" for n, k in LLAMA_8B])
def test_gpu_weight_only_real_shapes(n, k, kind):
    w = _gpu_weight(kind, n, k)
    bias = bias_for(n, torch.bfloat16, "cuda")
    for rows in GPU_ROWS:
        check_weight_only(activations(rows, k, torch.bfloat16, "cuda"), w,
                          bias if rows == 16 else None)


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["int4_g128_asym", "fp8_block", "mxfp4"])
def test_gpu_weight_only_every_candidate_fp16_and_act_order(kind):
    from archserve.kernels.linear.triton_weight_only import candidate_configs
    w = _gpu_weight(kind, 6144, 4096)
    for rows in (1, 3, 16, 256):
        x = activations(rows, 4096, torch.float16, "cuda")
        for config in candidate_configs(rows, 6144, 4096, w)[:None if rows in (1, 16) else 1]:
            check_weight_only(x, w, None, config)
    for group in (32, 64):
        w = int_group_weight(4096, 4096, 4, group, True, True, torch.float16, "cuda")
        for rows in (2, 64):
            check_weight_only(activations(rows, 4096, torch.float16, "cuda"), w, None)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", [ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR,
                                        ACT_DYNAMIC_GROUP])
def test_gpu_activation_quantization_is_the_reference_bit_for_bit(activation, dtype):
    for rows, k in [(1, 4096), (300, 14336), (7, 384)]:
        x = activations(rows, k, dtype, "cuda") * 3
        check_activation_quantization(x, activation)


@gpu
@needs_cuda
@needs_fp8
@pytest.mark.parametrize("activation", [ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR])
@pytest.mark.parametrize("n,k", LLAMA_8B, ids=[f"{n}x{k}" for n, k in LLAMA_8B])
def test_gpu_scaled_mm_fp8_real_shapes(n, k, activation):
    from archserve.kernels.linear.fp8_gemm import scaled_mm_fp8
    w = fp8_weight(n, k, None, activation, "cuda")
    bias = bias_for(n, torch.bfloat16, "cuda")
    for rows in GPU_ROWS:
        check_w8a8(scaled_mm_fp8, activations(rows, k, torch.bfloat16, "cuda"), w,
                   bias if rows == 16 else None, floor=FP8_FLOOR)


@gpu
@needs_cuda
@needs_fp8
def test_gpu_scaled_mm_fp16_fp32_bias_and_the_tensorwise_fallback():
    from archserve.kernels.linear.fp8_gemm import rowwise_scaled_mm_works, scaled_mm_fp8
    assert rowwise_scaled_mm_works(torch.device("cuda"))
    w = fp8_weight(6144, 4096, None, ACT_DYNAMIC_TOKEN, "cuda")
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        bias = bias_for(6144, dtype, "cuda")
        for rows in (1, 5, 256):
            x = activations(rows, 4096, dtype, "cuda")
            for rowwise in (True, False):
                check_w8a8(scaled_mm_fp8, x, w, bias, floor=FP8_FLOOR, rowwise=rowwise)


@gpu
@needs_cuda
@needs_fp8
@pytest.mark.parametrize("n,k", LLAMA_8B, ids=[f"{n}x{k}" for n, k in LLAMA_8B])
def test_gpu_block_fp8_real_shapes(n, k):
    from archserve.kernels.linear.fp8_gemm import block_fp8_gemm, candidate_configs
    w = fp8_weight(n, k, (128, 128), ACT_DYNAMIC_GROUP, "cuda")
    bias = bias_for(n, torch.bfloat16, "cuda")
    for rows in GPU_ROWS:
        x = activations(rows, k, torch.bfloat16, "cuda")
        check_w8a8(block_fp8_gemm, x, w, bias if rows == 16 else None, floor=FP8_FLOOR)
        if (n, k) == (6144, 4096) and rows in (1, 256):
            for config in candidate_configs(rows, n):
                check_w8a8(block_fp8_gemm, x, w, None, floor=FP8_FLOOR, config=config)


@gpu
@needs_cuda
@pytest.mark.skipif(_capability() < (8, 0), reason="int8 tl.dot needs SM80+")
@pytest.mark.parametrize("activation", [ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR])
@pytest.mark.parametrize("n,k", LLAMA_8B, ids=[f"{n}x{k}" for n, k in LLAMA_8B])
def test_gpu_int8_real_shapes(n, k, activation):
    from archserve.kernels.linear.int8_gemm import candidate_configs, int8_gemm
    w = int8_weight(n, k, activation, "cuda")
    bias = bias_for(n, torch.bfloat16, "cuda")
    for rows in GPU_ROWS:
        x = activations(rows, k, torch.bfloat16, "cuda")
        check_w8a8(int8_gemm, x, w, bias if rows == 16 else None)
        if (n, k) == (6144, 4096) and activation == ACT_DYNAMIC_TOKEN and rows in (1, 256):
            for config in candidate_configs(rows, n):
                check_w8a8(int8_gemm, x, w, None, config=config)


@gpu
@needs_cuda
@needs_fp8
@pytest.mark.parametrize("activation", [ACT_DYNAMIC_TOKEN, ACT_STATIC_TENSOR,
                                        ACT_DYNAMIC_GROUP, "int8_token", "int8_static"])
@pytest.mark.parametrize("n,k", LLAMA_8B, ids=[f"{n}x{k}" for n, k in LLAMA_8B])
def test_gpu_w8a8_gemv_real_shapes(n, k, activation):
    """The W8A8 GEMV candidates (FP8: hardware conversions; x quantized in registers by a
    multiply with 1/scale) against the reference at decode rows; every candidate at 1 and
    16 rows on the narrow shape."""
    from archserve.kernels.linear.fp8_gemm import BlockFp8Linear, ScaledMmFp8Linear
    from archserve.kernels.linear.int8_gemm import Int8Linear
    group = activation == ACT_DYNAMIC_GROUP
    if activation.startswith("int8"):
        scheme = ACT_DYNAMIC_TOKEN if activation == "int8_token" else ACT_STATIC_TENSOR
        w, routine = int8_weight(n, k, scheme, "cuda"), Int8Linear()
    else:
        w = fp8_weight(n, k, (128, 128) if group else None, activation, "cuda")
        routine = BlockFp8Linear() if group else ScaledMmFp8Linear()
    bias = bias_for(n, torch.bfloat16, "cuda")
    for rows in (1, 4, 16):
        x = activations(rows, k, torch.bfloat16, "cuda")
        gemvs = [c for c in routine.candidates(rows, w) if getattr(c, "gemv", False)]
        every = (n, k) == (4096, 4096) and rows in (1, 16)
        for config in gemvs if every else gemvs[:1]:
            check_w8a8(routine.run, x, w, bias if rows == 4 else None, floor=FP8_FLOOR,
                       config=config)


@gpu
@needs_cuda
@needs_fp8
def test_gpu_every_routine_replays_in_a_cuda_graph():
    """Each backend's routine captured once in a CUDA graph gives, on replay with new
    inputs, what it gives eagerly (the same kernels, so bit for bit)."""
    from archserve.kernels.linear.fp8_gemm import BlockFp8Linear, ScaledMmFp8Linear
    from archserve.kernels.linear.int8_gemm import Int8Linear
    from archserve.kernels.linear.triton_weight_only import WeightOnlyLinear
    k = 4096
    layers = [(WeightOnlyLinear(), _gpu_weight("int4_g128_asym", 4096, k)),   # GEMV, split K
              (WeightOnlyLinear(), _gpu_weight("fp8_block", 6144, k)),
              (ScaledMmFp8Linear(), fp8_weight(6144, k, None, ACT_DYNAMIC_TOKEN, "cuda")),
              (BlockFp8Linear(), fp8_weight(6144, k, (128, 128), ACT_DYNAMIC_GROUP, "cuda")),
              (Int8Linear(), int8_weight(6144, k, ACT_STATIC_TENSOR, "cuda"))]
    for rows in (1, 16):
        x = activations(rows, k, torch.bfloat16, "cuda")
        outs = [routine(x, w) for routine, w in layers]          # eager warm-up (compiles)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [routine(x, w) for routine, w in layers]
        for seed in (1, 2):
            x.copy_(activations(rows, k, torch.bfloat16, "cuda", seed=seed))
            graph.replay()
            torch.cuda.synchronize()
            for (routine, w), out in zip(layers, outs, strict=True):
                assert torch.equal(out, routine(x, w)), type(routine).__name__
                assert_w8a8_close(out, x, w, floor=FP8_FLOOR)


@gpu
@needs_cuda
@needs_fp8
def test_gpu_dequantized_w8a8_replays_in_a_cuda_graph():
    """TORCH_DEQUANT (the route of GPUs without a W8A8 kernel, e.g. a T4) quantizes the
    activations with torch ops alone, so its steps capture in a CUDA graph and replay with
    what it gives eagerly."""
    from archserve.kernels.linear.torch_dequant import TorchDequantLinear
    routine, k = TorchDequantLinear(), 1024
    weights = [routine.prepare(int8_weight(768, k, ACT_DYNAMIC_TOKEN, "cuda"), torch.float16),
               routine.prepare(fp8_weight(768, k, (128, 128), ACT_DYNAMIC_GROUP, "cuda"),
                               torch.float16)]
    x = activations(4, k, torch.float16, "cuda")
    outs = [routine(x, w) for w in weights]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [routine(x, w) for w in weights]
    x.copy_(activations(4, k, torch.float16, "cuda", seed=3))
    graph.replay()
    torch.cuda.synchronize()
    for w, out in zip(weights, outs, strict=True):
        assert torch.equal(out, routine(x, w))
