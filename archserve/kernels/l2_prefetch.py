"""Ask L2 for a whole tensor without waiting for it: a weight that a later kernel reads.

Why: in a batch-1 decode step DRAM sits idle for the several µs between the QKV GEMV and
the output projection (the q/k norm and rotary, decode attention, the split merge: kernels
that read almost nothing). The output projection's weight (16.8 MB at Qwen3-30B-A3B,
8.4 MB at DeepSeek-V2-Lite) can stream into L2 during that chain, and the GEMV then reads
it from L2 instead of DRAM. The kernel here issues SM90's bulk L2 prefetch
(``cp.async.bulk.prefetch.L2``): a few instructions per program, each asking for a piece
of PIECE bytes, and nothing held in registers or waited for, so the kernel ends as soon as
it has asked.

Under PDL it waits for the kernel before it first (``pdl_start``): it must not end before
its predecessor has, or the kernel after it could read what that one has not written yet;
and asking while the GEMV before it streams its own weight would only share DRAM with it.

A prefetch cannot change a result: it reads, and L2 is coherent. NVIDIA SM90+ only (the
bulk prefetch is SM90's), never under the interpreter or on ROCm.
"""

from __future__ import annotations

import torch

from archserve.kernels.pdl import pdl_enabled, pdl_launch_options
from archserve.kernels.rules import triton_interpreted

try:
    import triton
    import triton.language as tl

    from archserve.kernels.pdl import pdl_start
except ImportError:
    triton = None

# Each lane of a one-warp program asks for one piece: PIECES pieces of PIECE bytes, 256 KB
# a program, so a 16 MB weight is ~64 programs spread over as many SMs (one SM's bulk
# copy unit alone would ask too slowly to fill the window).
PIECE = 8192
PIECES = 32
# A bulk prefetch wants a 16-byte-aligned address and a size in whole 16-byte units.
_ALIGN = 16


def l2_prefetch_supported(device: torch.device) -> bool:
    """Whether ``prefetch_into_l2`` does anything on ``device``."""
    if triton is None or device.type != "cuda" or triton_interpreted() or torch.version.hip:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def l2_bytes(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).L2_cache_size


if triton is not None:

    @triton.jit
    def _l2_prefetch_kernel(base_ptr, nbytes, PIECE: tl.constexpr, PIECES: tl.constexpr,
                            PDL: tl.constexpr):
        pdl_start(PDL)
        offsets = (tl.program_id(0) * PIECES + tl.arange(0, PIECES)).to(tl.int64) * PIECE
        sizes = tl.minimum(nbytes - offsets, PIECE).to(tl.int32)   # <= 0 past the end
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [base_ptr + offsets, sizes], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_into_l2(tensor: torch.Tensor, max_bytes: int | None = None) -> int:
    """Launch the prefetch of ``tensor``'s first ``max_bytes`` (default: half the device's
    L2, so the kernels in between keep room) on the current stream; returns the bytes asked
    for, 0 where it cannot (see ``l2_prefetch_supported``; a non-contiguous or unaligned
    tensor)."""
    if not l2_prefetch_supported(tensor.device) or not tensor.is_contiguous():
        return 0
    if tensor.data_ptr() % _ALIGN:
        return 0
    limit = l2_bytes(tensor.device) // 2 if max_bytes is None else max_bytes
    nbytes = min(tensor.numel() * tensor.element_size(), limit) // _ALIGN * _ALIGN
    if nbytes <= 0:
        return 0
    pdl = pdl_enabled(tensor.device)
    grid = (triton.cdiv(nbytes, PIECE * PIECES),)
    _l2_prefetch_kernel[grid](tensor.reshape(-1).view(torch.uint8), nbytes, PIECE=PIECE,
                              PIECES=PIECES, PDL=pdl, num_warps=1, **pdl_launch_options(pdl))
    return nbytes
