"""A one-line Triton kernel around round_to_dtype, and its check against torch's casts.

Imported only where Triton may be imported: inside the interpreter run on CPU, or on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from archserve.kernels.elementwise.triton_rounding import round_to_dtype

TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _round_kernel(src, dst, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n)
    tl.store(dst + offs, round_to_dtype(x, DTYPE), mask=offs < n)


def check_round_to_dtype(dtype: torch.dtype, device: str) -> None:
    """Ties, overflow, subnormals, specials and random values round as torch's cast does."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0xBF808000,
                         0x3F801000, 0x3F803000, 0x3F801001, 0x477FEFFF, 0x477FF000,
                         0x7F7FFFFF, 0x7F7F7FFF, 0x00008000, 0x00018000, 0x80000000,
                         0x38800000, 0x387FF000, 0x33800000, 0x7F800000, 0xFF800000,
                         0x7FC00000, 0xFFFFFFFF],
                        dtype=torch.int64).to(torch.int32)  # wraps the high ones
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([bits.view(torch.float32), torch.randn(100_000, generator=gen) * 1e3,
                   torch.randn(100_000, generator=gen) * 1e-4,
                   torch.randn(100_000, generator=gen)]).to(device)
    out = torch.empty_like(x)
    block = 1024
    _round_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), DTYPE=TORCH_TO_TL[dtype],
                                                    BLOCK=block)
    expected = x.to(dtype).float()
    assert torch.equal(out.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(out[finite], expected[finite])
