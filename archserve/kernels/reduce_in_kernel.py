"""Reductions across a kernel's programs done by the program that finishes last, instead of
by a second kernel (``ARCHSERVE_REDUCE_IN_KERNEL=1``; opt-in: on an H200 it was slower).

At batch 1 a decode step's kernels are short, and each launch costs a few µs whatever it
does (issue 21). Two reductions run as kernels of their own after the work they reduce:
the merge of split-KV decode's partial outputs (kernels/attention/triton_decode.py, and
MLA's in kernels/mla/triton_mla_decode.py) and the sum of each token's top-k expert outputs
(kernels/moe/triton_fused_moe.py, the pair layout). Here each
program that contributes to one reduction counts itself in on that reduction's counter
(an acquire-release atomic at GPU scope, after its own stores); the one that sees every
other arrived does the reduction, in a fixed order (so the result is the same whichever
program arrives last), and resets the counter for the next launch.

Measured on an H200 with PDL on (docs/benchmarks.md, session 15), it did not pay:
Qwen3-0.6B's batch-1 graph replay took 0.877 ms against 0.854 ms with the merge kernels,
and Qwen3-30B-A3B's batch-1 step 2.813 against 2.784 ms. With PDL a second kernel is
scheduled while the first drains, so its launch costs little; the last arriver instead
adds a GPU-scope atomic round trip and reduces alone at the end. It stays opt-in.

Greedy decoding's argmax (kernels/elementwise/triton_argmax.py) reduces its blocks the same
way, always on (it replaces torch's one-kernel reduction, not a second kernel of ours), on
counters of its own.

This module is free of Triton where the engine's start-up reads it; the kernels' shared
step, ``count_arrival``, is defined where Triton is installed.
"""

from __future__ import annotations

import functools
import os

import torch

try:   # the engine core imports this module; Triton is not installed everywhere
    import triton
    import triton.language as tl
except ImportError:
    triton = None

REDUCE_IN_KERNEL_ENV = "ARCHSERVE_REDUCE_IN_KERNEL"
# Counters, one per reduction of a launch: split decode runs only while sequences x KV heads
# leave SMs idle, and the slot sum in the kernel only for a few tokens (the pair layout), so
# a few thousand cover every launch that takes this path; a larger one reduces in a kernel.
ARRIVAL_COUNTERS = 4096


def last_arrival_verified() -> bool:
    """Whether the last program to arrive is known to see every other's stores here: not
    on ROCm. On MI300-class GPUs each XCD has its own L2; the kernels compile for them, but
    that is not verified there."""
    return torch.version.hip is None


def reduce_in_kernel(counters: int = 0) -> bool:
    """Whether a launch needing ``counters`` reductions does them in the kernel: asked for
    with ``ARCHSERVE_REDUCE_IN_KERNEL=1``, within the counter buffer, and where
    ``last_arrival_verified`` (ROCm keeps the second kernel)."""
    return (os.environ.get(REDUCE_IN_KERNEL_ENV) == "1" and counters <= ARRIVAL_COUNTERS
            and last_arrival_verified())


@functools.cache
def arrival_counters(device: torch.device, owner: str = "reductions") -> torch.Tensor:
    """The counters on ``device``: zero between launches (the last program resets its own).
    Each ``owner`` has its own (the opt-in reductions share "reductions"; greedy decoding's
    argmax has its own, so nothing the opt-in kernels leave can reach it). Made on first
    use, which the engine's eager warm-up makes before any CUDA graph is captured."""
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


if triton is not None:

    @triton.jit
    def count_arrival(counter_ptr, contributors):
        """Count this program in on ``counter_ptr`` after its stores; True in the program
        that arrives last of ``contributors`` (it may then read every other program's
        stores, from L2: load them with ``cache_modifier=".cg"``)."""
        tl.debug_barrier()      # every thread's stores happen before the release below
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()      # ... and every thread reads only after the acquire
        return arrived == contributors - 1

    @triton.jit
    def reset_arrivals(counter_ptr):
        """The last program, once it has reduced: the counter is zero for the next launch."""
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
