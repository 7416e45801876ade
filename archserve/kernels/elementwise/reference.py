"""PyTorch reference implementations of the fused elementwise ops.

These are the CPU path and the oracle the Triton kernels are tested against, so their
numerics are the contract: they reproduce the Hugging Face modules step by step,
including where intermediate results are rounded to the activations' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None, unit_offset: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * normalise(x + residual), x + residual); without residual, (.., x) itself.

    ``unit_offset`` is Gemma's form: the row is scaled by (1 + weight) in fp32 and
    rounded once, to x's dtype, at the end.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(dtype), x
    # Cast before the weight multiply, as the HF reference does, so bf16 results agree.
    return weight * x32.to(dtype), x


def rotate_neox_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          head_size: int) -> torch.Tensor:
    """x [T, H*D]; cos, sin [T, 1, D/2] in x's dtype -> rotated x [T, H*D] (rotate_half)."""
    num_tokens = x.shape[0]
    x = x.view(num_tokens, -1, head_size)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.view(num_tokens, -1)


def rotary_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, H*D], k [T, Hkv*D]; caches [max_pos, D/2] -> rotated q, k."""
    head_size = 2 * cos_cache.shape[-1]
    cos = cos_cache[positions].to(q.dtype).unsqueeze(1)
    sin = sin_cache[positions].to(q.dtype).unsqueeze(1)
    return (rotate_neox_reference(q, cos, sin, head_size),
            rotate_neox_reference(k, cos, sin, head_size))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) fp32 [..., rope_dim / 2] of ``positions`` (any shape): the angles
    position * inv_freq, computed where they are used (DeepSeek V4's million positions would
    make cos/sin tables of 128 MiB each)."""
    angles = positions.float()[..., None] * inv_freq.float()
    return angles.cos(), angles.sin()


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with its trailing 2 * cos.shape[-1] channels rotated as interleaved pairs
    (DeepSeek V4's rope) by cos/sin [..., R / 2] (broadcast over x's middle dimensions), in
    fp32, back in x's dtype. sin negated rotates back."""
    half = cos.shape[-1]
    rope = x[..., x.shape[-1] - 2 * half:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat((x[..., :x.shape[-1] - 2 * half], rotated.flatten(-2).to(x.dtype)), -1)


def norm_rope_interleaved_reference(x: torch.Tensor, positions: torch.Tensor,
                                    inv_freq: torch.Tensor, weight: torch.Tensor | None = None,
                                    eps: float | None = None, inverse: bool = False
                                    ) -> torch.Tensor:
    """DeepSeek V4's per-head input (or output) transform: x [T, (H,) D] RMS-normalised over
    D when ``eps`` is given (with ``weight``: rms_norm_reference's numerics; without: scaled
    by 1/rms rounded to x's dtype, transformers' unweighted norm), then rotated at
    ``positions`` [T] (``inverse``: rotated back)."""
    if eps is not None:
        if weight is not None:
            x = rms_norm_reference(x, weight, eps)[0]
        else:
            x = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    cos, sin = rope_cos_sin(positions, inv_freq)
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return rotate_interleaved(x, cos, -sin if inverse else sin)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [.., 2I] (gate then up) -> silu(gate) * up [.., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [.., 2I] (gate then up) -> gelu_tanh(gate) * up [.., I] (Gemma's GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
