"""The quantized weight layouts every quantized GEMM kernel reads, and their exact meaning.

Checkpoint formats (compressed-tensors, GPTQ, AWQ, HF block FP8, GGUF) differ in how they
pack the same few things; archserve.quant repacks each of them, once at load, into one of
these layouts, so a kernel is written once per layout rather than once per file format:

* ``IntGroupWeight`` - 4- or 8-bit unsigned integers with one scale and one offset per
  group of ``group_size`` input channels: ``w[n, k] = q[k, n] * scale[g, n] + offset[g, n]``
  with ``g = k // group_size``. AWQ, GPTQ (after act-order rows are sorted), compressed
  tensors' pack-quantized W4A16/W8A16 and the GGUF block types are all exactly this.
* ``Fp8Weight`` - float8 e4m3 weights with per-channel or 128x128-block scales, and the
  activation quantization the checkpoint was calibrated for (dynamic per token, dynamic
  per 128-group, static per tensor, or none for weight-only execution).
* ``Int8Weight`` - int8 weights with per-channel scales and int8 activations (dynamic per
  token or static per tensor).
* ``Mxfp4Weight`` - OCP MXFP4: e2m1 values (4 bits: sign, 2 exponent, 1 mantissa; 0 to 6),
  two a byte, and one e8m0 scale (a power of two, 2**(s - 127)) per 32 input channels;
  weight-only (activations stay 16-bit). gpt-oss's ``*_blocks`` / ``*_scales`` are exactly
  this, as are DeepSeek V4's FP4 experts.

The ``reference_*`` functions define the arithmetic (fp32 accumulation of exactly the
quantized operands). They are the oracles of the kernel tests and the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
# A row of zeros must not give a zero scale (0/0): this floor keeps x/scale finite.
MIN_ACTIVATION_SCALE = 1.0 / (FP8_MAX * 512.0)

# How activations are quantized before a W8A8 GEMM.
ACT_DYNAMIC_TOKEN = "dynamic_token"     # one scale per row, from the row's absmax
ACT_DYNAMIC_GROUP = "dynamic_group"     # one scale per row per 128 input channels
ACT_STATIC_TENSOR = "static_tensor"     # one calibrated scale (Fp8Weight.input_scale)
ACT_NONE = "none"                       # weight-only: activations stay 16-bit
ACTIVATION_SCHEMES = (ACT_DYNAMIC_TOKEN, ACT_DYNAMIC_GROUP, ACT_STATIC_TENSOR, ACT_NONE)


@dataclass
class IntGroupWeight:
    qweight: torch.Tensor          # int32 [K // pack, N], pack = 32 // bits; value k of
                                   # column n at bits (k % pack) * bits of row k // pack
    scales: torch.Tensor           # [K // group_size, N], float16 / bfloat16 / float32
    offsets: torch.Tensor | None   # like scales; None: symmetric, offset = -2**(bits-1)*scale
    bits: int                      # 4 or 8
    group_size: int                # divides K; K for one group per column
    in_features: int
    out_features: int
    perm: torch.Tensor | None = None   # int64 [K]: act order, the GEMM reads x[:, perm]

    @property
    def pack(self) -> int:
        return 32 // self.bits

    def validate(self) -> None:
        k, n = self.in_features, self.out_features
        if self.bits not in (4, 8):
            raise ValueError(f"{self.bits}-bit weights: only 4 and 8 are supported")
        if k % self.group_size or k % self.pack:
            raise ValueError(f"in_features {k} is not a multiple of the group size "
                             f"{self.group_size} and of {self.pack} values per int32")
        expect = {"qweight": (k // self.pack, n), "scales": (k // self.group_size, n)}
        if self.offsets is not None:
            expect["offsets"] = expect["scales"]
        for name, shape in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {got}")
        if n > 1 and self.qweight.stride(1) != 1:
            # The kernels address a packed row by stride(0) and step along N by one.
            raise ValueError(f"qweight strides {self.qweight.stride()}: not contiguous along N")


class _RowsByColumns:
    """An [N, K] weight (the checkpoint's orientation): N outputs, K inputs."""

    weight: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


@dataclass
class Fp8Weight(_RowsByColumns):
    weight: torch.Tensor           # float8_e4m3fn [N, K] (the checkpoint's own layout)
    weight_scale: torch.Tensor     # float32 [N] per channel, or [ceil(N/bn), ceil(K/bk)]
    activation: str                # one of ACTIVATION_SCHEMES
    block: tuple[int, int] | None = None       # (bn, bk) for block scales
    input_scale: torch.Tensor | None = None    # float32 [] for ACT_STATIC_TENSOR


@dataclass
class Int8Weight(_RowsByColumns):
    weight: torch.Tensor           # int8 [N, K]
    weight_scale: torch.Tensor     # float32 [N]
    activation: str                # ACT_DYNAMIC_TOKEN or ACT_STATIC_TENSOR
    input_scale: torch.Tensor | None = None    # float32 [] for ACT_STATIC_TENSOR


MXFP4_GROUP = 32                    # input channels per e8m0 scale
E8M0_BIAS = 127
# The 16 e2m1 codes in order: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class Mxfp4Weight:
    blocks: torch.Tensor           # uint8 [N, K // 2]: value k of row n in byte k // 2, the
                                   # low nibble for even k (the checkpoint's [N, K/32, 16])
    scales: torch.Tensor           # uint8 [N, K // 32]: e8m0, the group's 2**(s - 127)

    @property
    def in_features(self) -> int:
        return self.blocks.shape[-1] * 2

    @property
    def out_features(self) -> int:
        return self.blocks.shape[-2]

    @property
    def activation(self) -> str:
        return ACT_NONE

    def validate(self) -> None:
        k, n = self.in_features, self.out_features
        if self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise ValueError("MXFP4 blocks and scales are uint8")
        if k % MXFP4_GROUP:
            raise ValueError(f"in_features {k} is not a multiple of {MXFP4_GROUP}")
        if tuple(self.scales.shape[-2:]) != (n, k // MXFP4_GROUP):
            raise ValueError(f"scales: expected shape {(n, k // MXFP4_GROUP)}, got "
                             f"{tuple(self.scales.shape[-2:])}")


QuantizedWeight = IntGroupWeight | Fp8Weight | Int8Weight | Mxfp4Weight


def weight_signature(w: QuantizedWeight) -> str:
    """What, besides its shape, decides which kernel configs suit a weight."""
    if isinstance(w, IntGroupWeight):
        return (f"int{w.bits}g{w.group_size}{'+offset' if w.offsets is not None else ''}"
                f"{'+perm' if w.perm is not None else ''}")
    if isinstance(w, Fp8Weight):
        return f"fp8{'block' if w.block else 'channel'}-{w.activation}"
    if isinstance(w, Mxfp4Weight):
        return "mxfp4"
    return f"int8-{w.activation}"


# ---- packing helpers (shared by every repacker and the tests) ----------------------------

def pack_int_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ints [K, N] (values < 2**bits) -> int32 [K // pack, N], packed along K,
    row-major whatever ``q``'s strides (a transposed [N, K] view included): the kernels
    step along N by one."""
    pack = 32 // bits
    k, n = q.shape
    q = q.to(torch.int32).reshape(k // pack, pack, n)
    # The values' bits do not overlap, so OR-ing them in int32 is their sum; the top one
    # may set the sign bit, which keeps the low 32 bits as they are. (A clone would keep
    # a transposed input's column-major strides.)
    packed = q[:, 0].clone(memory_format=torch.contiguous_format)
    for i in range(1, pack):
        packed |= q[:, i] << (i * bits)
    return packed


def unpack_int_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K // pack, N] -> unsigned ints [K, N] (int32), the inverse of pack_int_rows."""
    pack = 32 // bits
    rows, n = packed.shape
    shifts = (torch.arange(pack, dtype=torch.int32, device=packed.device) * bits).view(1, pack, 1)
    values = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(rows * pack, n)


def quantize_mxfp4(weight: torch.Tensor) -> Mxfp4Weight:
    """A weight [..., N, K] (K a multiple of 32) in MXFP4 as OpenAI's converter writes it:
    each group's scale is the power of two at or above amax / 6 (so no value saturates),
    each value rounded to the nearest e2m1, ties to the even code."""
    w = weight.float()
    *lead, n, k = w.shape
    groups = w.reshape(*lead, n, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax / 6.0)).nan_to_num(neginf=-E8M0_BIAS)
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=w.device)
    # Nearest code; a tie (the midpoint of two codes) goes to the even code, as rounding
    # half to even does on the 3-bit magnitude.
    distance = (scaled.abs().unsqueeze(-1) - magnitudes).abs()
    best = distance.min(dim=-1, keepdim=True).values
    candidates = (distance == best) & ((torch.arange(8, device=w.device) % 2 == 0)
                                       | (distance == best).sum(-1, keepdim=True).eq(1))
    code = candidates.to(torch.int64).argmax(dim=-1)
    code = code | ((scaled < 0) & (code > 0)).to(torch.int64) << 3
    code = code.reshape(*lead, n, k)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    scales = (exponent + E8M0_BIAS).to(torch.uint8)
    return Mxfp4Weight(blocks.contiguous(), scales.contiguous())


def unpack_e2m1(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> the e2m1 values, float32 [..., K]."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).long()
    return lut[codes].flatten(-2)


def dequantize_mxfp4(w: Mxfp4Weight) -> torch.Tensor:
    """float32 [..., N, K]: each value times its group's 2**(s - 127) (exact in fp32)."""
    values = unpack_e2m1(w.blocks)
    exponents = w.scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponents.repeat_interleave(MXFP4_GROUP, dim=-1))


# ---- dequantization and the reference GEMM ------------------------------------------------

def dequantize_int_group(w: IntGroupWeight) -> torch.Tensor:
    """float32 [N, K] in the input-channel order the GEMM's x uses after ``perm``."""
    q = unpack_int_rows(w.qweight, w.bits).float()                  # [K, N]
    scales = w.scales.float().repeat_interleave(w.group_size, dim=0)
    if w.offsets is None:
        offsets = -(2.0 ** (w.bits - 1)) * scales
    else:
        offsets = w.offsets.float().repeat_interleave(w.group_size, dim=0)
    return (q * scales + offsets).t().contiguous()


def expand_block_scales(scale: torch.Tensor, block: tuple[int, int], n: int, k: int
                        ) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] block scales -> one scale per weight element [N, K]."""
    bn, bk = block
    return scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize_fp8(w: Fp8Weight) -> torch.Tensor:
    """float32 [N, K]."""
    values = w.weight.float()
    if w.block is not None:
        return values * expand_block_scales(w.weight_scale, w.block, *values.shape)
    return values * w.weight_scale.float().view(-1, 1)


def dequantize_int8(w: Int8Weight) -> torch.Tensor:
    return w.weight.float() * w.weight_scale.float().view(-1, 1)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """float32 [N, K] for any layout (x's channel order: apply ``perm`` to x, not to this)."""
    if isinstance(w, IntGroupWeight):
        return dequantize_int_group(w)
    if isinstance(w, Fp8Weight):
        return dequantize_fp8(w)
    if isinstance(w, Mxfp4Weight):
        return dequantize_mxfp4(w)
    return dequantize_int8(w)


def _per_max(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    # A true division (by a tensor): CUDA divides a tensor by a Python number through its
    # reciprocal, one ulp off an exact division now and then, which flips rounding ties.
    # The kernels divide exactly, so the oracle must give the same on every device. The
    # divisor is filled on the device (no host copy), so CUDA graphs can capture it.
    divisor = torch.full((), qmax, dtype=amax.dtype, device=amax.device)
    return (amax / divisor).clamp(min=MIN_ACTIVATION_SCALE)


def quantize_activation_fp8(x: torch.Tensor, activation: str,
                            input_scale: torch.Tensor | None = None, group: int = 128
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 values [M, K], float32 scales: [M, 1], [M, K/group] or [])."""
    xf = x.float()
    if activation == ACT_STATIC_TENSOR:
        scale = input_scale.float()
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    if activation == ACT_DYNAMIC_GROUP:
        m, k = xf.shape
        grouped = xf.view(m, k // group, group)
        scale = _per_max(grouped.abs().amax(dim=-1), FP8_MAX)
        q = (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q.view(m, k), scale
    scale = _per_max(xf.abs().amax(dim=-1, keepdim=True), FP8_MAX)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_activation_int8(x: torch.Tensor, activation: str,
                             input_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 values, float32 scales [M, 1] or []), round half to even."""
    xf = x.float()
    if activation == ACT_STATIC_TENSOR:
        scale = input_scale.float()
    else:
        scale = _per_max(xf.abs().amax(dim=-1, keepdim=True), INT8_MAX)
    return torch.round(xf / scale).clamp(-128, 127).to(torch.int8), scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, group: int = 128
                          ) -> torch.Tensor:
    """The fp32 values a W8A8 GEMM multiplies: quantized x times its scales."""
    values = q.float()
    if scale.dim() == 2 and scale.shape[1] > 1:        # per 128-group
        return values * scale.repeat_interleave(group, dim=1)[:, :values.shape[1]]
    return values * scale


def reference_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """y = x W^T (+ bias) with exactly the operands the kernels multiply, in fp32; the
    result in x's dtype. x is [..., K]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if isinstance(w, IntGroupWeight) and w.perm is not None:
        x2 = x2[:, w.perm]
    activation = getattr(w, "activation", ACT_NONE)
    if activation == ACT_NONE:
        operand = x2.float()
    elif isinstance(w, Fp8Weight):
        operand = dequantize_activation(*quantize_activation_fp8(x2, activation, w.input_scale))
    else:
        operand = dequantize_activation(*quantize_activation_int8(x2, activation,
                                                                   w.input_scale))
    y = operand @ dequantize(w).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])
