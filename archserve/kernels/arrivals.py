"""Programs of one Triton launch handing work to each other through a counter in global
memory: an acquire-release atomic at GPU scope after a program's stores counts it in, and a
program that then reads (from L2: loads with ``cache_modifier=".cg"``) sees every store of
the programs counted before it.

Two uses: the last program to arrive reduces what the others stored (greedy argmax,
kernels/elementwise/triton_argmax.py), and programs wait for a number of arrivals (the LoRA
kernel's expand half waits for its shrink half, kernels/lora/triton_lora.py). A program
that waits must only wait for programs that already run, or the wait may never end: the
LoRA kernel's programs take their role from a ticket counter for that reason. The counters
are zero between launches: the program that knows it is the last resets them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def last_arrival_verified() -> bool:
    """Whether a program is known to see the stores of those counted in before it here:
    not on ROCm. On MI300-class GPUs each XCD has its own L2; the kernels compile for them,
    but that is not verified there."""
    return torch.version.hip is None


@triton.jit
def count_arrival(counter_ptr, contributors):
    """Count this program in on ``counter_ptr`` after its stores; True in the program that
    arrives last of ``contributors`` (it may then read every other program's stores, from
    L2: load them with ``cache_modifier=".cg"``)."""
    tl.debug_barrier()      # every thread's stores happen before the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()      # ... and every thread reads only after the acquire
    return arrived == contributors - 1


@triton.jit
def wait_for_arrivals(counter_ptr, contributors):
    """Wait until ``contributors`` programs have counted in on ``counter_ptr``; this
    program may then read their stores (from L2, as above). Only for programs whose
    contributors already run."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < contributors:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()      # every thread reads only after the acquire


@triton.jit
def reset_arrivals(counter_ptr):
    """The last program, once it is done with the counter: zero for the next launch."""
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
