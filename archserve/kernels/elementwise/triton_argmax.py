"""Greedy decoding's argmax over the vocabulary in one launch over many programs.

After each decode step's graph the sampler of a greedy batch takes the argmax of the
float32 logits the graph's LM head wrote. torch reduces a row in one kernel whose few
programs read all of it (an H200 profile of a batch-1 step: 8 µs on Qwen3's 151,936
logits, 23 µs on DeepSeek-V2's 102,400), on the path between two graphs, where nothing
overlaps it. Here a row is split into blocks over many programs; each stores its block's
maximum and first index, and the last program to arrive on its row's counter picks among
them (``count_arrival``: an acquire-release atomic at GPU scope after its stores, so it sees
every other program's blocks), then resets the counter for the next launch.

Same answer as ``torch.argmax`` of the float32 logits: the first index of the maximum, NaN
above everything (the first NaN), and -0.0 equal to +0.0. Values are compared as ordered
integers of their float32 bits, so every comparison is exact. 16-bit logits are read as
they are (widened in the kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 4096          # logits a program reads: 38 programs a row for a 152k vocabulary
MAX_PARTS = 1024      # blocks a row may have (a 4M-token vocabulary)
ARRIVAL_COUNTERS = 4096   # rows a launch may have: one counter each


def last_arrival_verified() -> bool:
    """Whether the last program to arrive is known to see every other's stores here: not
    on ROCm. On MI300-class GPUs each XCD has its own L2; the kernel compiles for them, but
    that is not verified there."""
    return torch.version.hip is None


@functools.cache
def arrival_counters(device: torch.device) -> torch.Tensor:
    """The rows' counters on ``device``: zero between launches (the last program resets its
    own). Shared by every kernel that counts arrivals (this argmax, the split top-k of
    sparse_mla/triton_topk.py): their launches follow one another on the stream. Made on
    first use; a first use inside a CUDA graph's capture puts the zeroing into that graph,
    which then only zeroes counters that are already zero."""
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


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
def reset_arrivals(counter_ptr):
    """The last program, once it has reduced: the counter is zero for the next launch."""
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def ordered_keys(x):
    """int32 keys in the order of the float32 values ``x`` (NaN above +inf, -0.0 as +0.0)."""
    x = x + 0.0                       # -0.0 + 0.0 is +0.0 (round to nearest)
    bits = x.to(tl.int32, bitcast=True)
    keys = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, keys)


@triton.jit
def _argmax_kernel(logits_ptr, out_ptr, part_keys_ptr, part_index_ptr, counters_ptr, vocab,
                   stride_row, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)
    keys = tl.where(cols < vocab, ordered_keys(x), -0x7FFFFFFF - 1)
    best = tl.argmax(keys, axis=0, tie_break_left=True)
    slot = row * parts + part
    tl.store(part_keys_ptr + slot, tl.max(keys, axis=0))
    tl.store(part_index_ptr + slot, part * BLOCK + best)
    if count_arrival(counters_ptr + row, parts):
        p = tl.arange(0, PARTS)
        found = tl.load(part_keys_ptr + row * parts + p, mask=p < parts,
                        other=-0x7FFFFFFF - 1, cache_modifier=".cg")
        first = tl.argmax(found, axis=0, tie_break_left=True)   # blocks in index order
        index = tl.load(part_index_ptr + row * parts + first, cache_modifier=".cg")
        tl.store(out_ptr + row, index.to(tl.int64))
        reset_arrivals(counters_ptr + row)


def argmax_unsupported(logits: torch.Tensor) -> str | None:
    """Why ``triton_argmax`` cannot take ``logits``, or None."""
    if not last_arrival_verified():
        return "ROCm (the last-arriving program's reads across XCDs are not verified)"
    if logits.dim() != 2 or logits.stride(-1) != 1:
        return f"logits {tuple(logits.shape)} not rows contiguous along the vocabulary"
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"logits in {logits.dtype}"
    if not 1 <= logits.shape[0] <= ARRIVAL_COUNTERS:
        return f"{logits.shape[0]} rows; 1-{ARRIVAL_COUNTERS} take one counter each"
    if not 1 <= logits.shape[1] <= BLOCK * MAX_PARTS:
        return f"a vocabulary of {logits.shape[1]}"
    return None


def triton_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: ``torch.argmax(logits.float(), dim=-1)`` of logits [B, V] (check
    ``argmax_unsupported`` first)."""
    rows, vocab = logits.shape
    parts = triton.cdiv(vocab, BLOCK)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    part_keys = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
    part_index = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
    _argmax_kernel[(rows, parts)](
        logits, out, part_keys, part_index, arrival_counters(logits.device), vocab,
        logits.stride(0), BLOCK=BLOCK, PARTS=triton.next_power_of_2(parts), num_warps=4)
    return out
