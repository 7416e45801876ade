"""Programmatic dependent launch (PDL, SM90+): a kernel launched with it may be scheduled
while the kernel before it in the stream drains, instead of after it has finished.

In a small model's decode step every kernel is short (a few µs), so the gap between the end
of one kernel and the start of the next is a large share of the step (Qwen3-0.6B: about
170 kernels in a 1.0 ms step against a 0.3 ms floor, before PDL). With PDL the next kernel's
launch overlaps the previous one's tail. Safety is in the kernel: one launched with PDL
calls ``gdc_wait`` before it reads anything the kernel before it may have written and
before it writes anything (it then sees everything that kernel wrote, and that kernel saw
its own predecessor's, so the chain holds), then ``gdc_launch_dependents`` so that the next
one may launch in turn.

The rule for what may be read before the wait: only what the kernel launched right before
cannot write. Reading it early lets its bytes stream while that kernel drains:
- model weights: the skinny GEMV's first tile, RMSNorm's and the q/k norms' weights, the
  MLA decode inputs kernel's tile of W_UK and its norm weight, the MLA merge's W_UV rows;
- the step's inputs and constants: positions, slots and rotary rows (q/k-norm-rope-cache
  kernel, MLA decode inputs kernel), query starts, lengths and block tables (decode
  attention, MLA decode; the split merges' query starts and lengths, for which splits hold
  keys);
- what an earlier kernel than the one right before wrote: the MoE down kernels' experts
  and rows (the routing's and the sort's, before the gate/up kernel), and with them the
  slot-summing down kernel's first K step of its experts' weights;
- L2 prefetches (``prefetch_rows_to_l2``) of rows the kernel will read: decode's and MLA
  decode's first tile of KV cached by earlier steps (held in registers, that tile made them
  spill), and the first K tile of the MoE down kernel's expert weights.
The step's inputs are written before its first kernel; where they are built on the device
(MLA's mixed step gathers its decoding rows'), another kernel runs between that and the
kernel that reads them, as in the start-up tuners, which make such operands first. Nor
does a wrapper copy what its kernel reads early (a strided weight or positions): the copy
would be the kernel launched right before; the kernel reads it through its stride. Nothing
is stored before the wait: tests/engine/test_pdl.py reads the SM90 PTX of the decode-side
kernels (attention, norms, MLA, MoE), tests/kernels/test_skinny_gemm.py the GEMV's.

On by default on NVIDIA SM90+ (measured on the H200: Qwen3-0.6B batch-1 step 0.987 ->
0.909 ms, Llama-3-8B 4.318 -> 4.222 ms, same tokens and logprobs bit for bit);
``ARCHSERVE_PDL=0`` turns it off. Never on ROCm or under Triton's interpreter. Kernels take it as a ``PDL`` constexpr, and their
launch gets ``launch_pdl`` through ``pdl_launch_options``.
"""

from __future__ import annotations

import os

import torch

from archserve.kernels.rules import triton_interpreted
from archserve.platform.capability import SM90
from archserve.platform.detect import device_info_for
from archserve.platform.device import DeviceInfo

try:   # the engine core imports this module; Triton is not installed everywhere
    import triton
    import triton.language as tl
except ImportError:
    triton = None

PDL_ENV = "ARCHSERVE_PDL"


def pdl_supported(device: DeviceInfo) -> bool:
    """The hardware rule: NVIDIA SM90+ (PDL and Triton's launch_pdl are NVIDIA's alone;
    ROCm GPUs are not CUDA devices here, whatever torch calls them)."""
    return device.is_cuda and device.has_capability(SM90)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (see the module doc)."""
    if os.environ.get(PDL_ENV) == "0" or triton is None or triton_interpreted():
        return False
    return pdl_supported(device_info_for(device))


def pdl_launch_options(pdl: bool) -> dict:
    """The launch keyword of a kernel that takes PDL (none without it: the interpreter and
    older GPUs do not know it)."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """First thing in a kernel launched with PDL: wait for the kernel before it, then
        let the next one launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_to_l2(pointers, mask, PDL: tl.constexpr):
        """Before ``pdl_start``: ask L2 for the lines at ``pointers`` (where ``mask``; one
        pointer per 128-byte line is enough) without waiting for them and without holding
        them in registers, so memory the kernel before does not write streams while that
        kernel drains; the loads after the wait find it in L2. Only under PDL (NVIDIA SM90+:
        elsewhere there is no early start to use, and the interpreter has no PTX)."""
        if PDL:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                "=r,l,r", [pointers, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_rows_to_l2(row_starts, row_mask, row_elements, ROW_POW2: tl.constexpr,
                            PDL: tl.constexpr):
        """``prefetch_to_l2`` of rows: ``row_starts`` [R] point at rows of ``row_elements``
        contiguous values each (ROW_POW2: a power of two at or above it), one pointer per
        128-byte line; rows where ``row_mask``."""
        if PDL:
            LINE: tl.constexpr = 128 * 8 // row_starts.dtype.element_ty.primitive_bitwidth
            LINES: tl.constexpr = ROW_POW2 // LINE if ROW_POW2 > LINE else 1
            lines = tl.arange(0, LINES) * LINE
            prefetch_to_l2(row_starts[:, None] + lines[None, :],
                           row_mask[:, None] & (lines < row_elements)[None, :], PDL)
