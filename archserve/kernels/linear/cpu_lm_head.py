"""CPU_WEIGHT_ONLY's LM head: the logits GEMM from an 8-bit copy of the head where that is
faster, chosen per row count by start-up timing.

A batch-1 decode step of a small model on a CPU reads the LM head as much as its body: the
embedded model's bfloat16 head is 49152 x 576, 57 MB a step, against 30 MB of int4 body.
The copy is symmetric int8 in groups of 32 input channels, one bfloat16 scale per output
channel and group (``Int8Groups``: 30 MB): GGUF's Q8_0, in which the embedded model stores
this matrix, so its copy holds the file's own integers (up to the scales' rounding to
bfloat16) and is nearer the float32 expansion than the bfloat16 head. torch has no grouped
int8 kernel: each group is one ``aten._weight_int8pack_mm`` (per-channel scales) on its
[N, 32] block, summed in float32.

Coarser scales lose accuracy; measured with benchmarks/cpu_route_accuracy.py (6 chat
prompts x 32 greedy tokens, log-probs against the float32 expansion; the default route's
body, the head in each form): dense bfloat16 head max 0.189 / mean 0.026, greedy tokens
as float32's on 2 of 6 prompts; groups of 32 0.167 / 0.023, 4 of 6, and on every prompt
as many tokens agree with float32's as with the dense head or more; groups of 64
0.184 / 0.025, 3 of 6, one prompt's tokens further from float32's; one scale per output
channel (one kernel call, the fastest) 0.201 / 0.032, 2 of 6, two prompts' tokens
further from float32's. So the copy is kept at groups of 32 (``HEAD_DRIFT``).

The copy is not always faster: each group's call costs, and torch's int8 kernel
dequantizes the weight for every few rows it multiplies, so past a few rows the dense
bfloat16 GEMM wins (development machine, one thread, loaded: 2.6 / 3.3 ms at 1 row, 5.5 /
4.2 at 2). So both forms are kept (a tied head's dense weight is the embedding table
anyway) and each row count of ``HEAD_ROWS`` is timed once, against the dense head as the
linear route multiplies it; a count between two timed ones takes the lower one's form,
and a count past the last (a prompt's log-probs) stays dense. The choice is cached per
CPU and torch version, next to the body's formats, and per thread count: the two forms
gain unlike from threads (the embedded model's head on a 2-core machine, one row: the copy
1.7 ms at two threads, 2.6 at one; the dense head 2.6-3.0 and 3.3), so a choice timed at
one count need not hold at another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from archserve.kernels.linear.cpu_timing import best_times
from archserve.kernels.tuning_cache import read_cache, write_cache

log = logging.getLogger(__name__)

HEAD_ROWS = (1, 2, 4, 8, 16)     # timed; the decode batch sizes of a CPU, as a rule
HEAD_GROUP = 32                  # Q8_0's groups: see the module doc
DENSE, INT8 = "dense", "int8"
# What the copy costs (the module doc): the route's largest |log-prob| change of a token
# against the float32 expansion on the embedded model's fixed prompts, with the copy
# (measured 0.167; thread counts round the GEMMs' sums otherwise, hence the margin).
HEAD_DRIFT_BOUND = 0.18
HEAD_DRIFT = (f"with the int8 head the embedded model's log-probs stay within "
              f"{HEAD_DRIFT_BOUND} of the float32 expansion's on the fixed prompts "
              f"(measured 0.167, mean 0.023; the bfloat16 head: 0.189, 0.026), its greedy "
              f"tokens as near float32's or nearer")
LM_HEAD_CANDIDATES = ("the dense head, or an int8 copy of it in groups of 32 (GGUF Q8_0's; "
                      "aten._weight_int8pack_mm a group: about half a bfloat16 head's bytes) "
                      "at the row counts where start-up timing finds the copy faster; "
                      + HEAD_DRIFT)
REPS = 5
_CACHE_VERSION = 2     # 2: keyed by the thread count


@dataclass
class Int8Groups:
    """A [N, K] weight as symmetric int8 groups of ``group`` input channels, one bfloat16
    scale per output channel and group, stored group-major: each group's [N, group] block
    is contiguous, the per-channel weight ``_weight_int8pack_mm`` takes."""

    q: torch.Tensor           # int8 [K / group, N, group]
    scales: torch.Tensor      # bfloat16 [K / group, N]

    @property
    def group(self) -> int:
        return self.q.shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales))


def int8_groups(weight: torch.Tensor, group: int) -> Int8Groups:
    """A dense [N, K] weight as symmetric int8 groups (``group`` divides K), each scale
    rounded to bfloat16 first so that q * scale is what the kernel multiplies."""
    n, k = weight.shape
    w = weight.float().view(n, k // group, group).transpose(0, 1)          # [G, N, group]
    scales = (w.abs().amax(dim=2) / 127).clamp(min=torch.finfo(torch.bfloat16).tiny)
    scales = scales.to(torch.bfloat16)
    q = torch.round(w / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return Int8Groups(q.contiguous(), scales.contiguous())


def int8_groups_linear(x: torch.Tensor, w: Int8Groups) -> torch.Tensor:
    """x [rows, K] (bfloat16) times the grouped weight, as float32: one per-channel int8
    product per group, summed in float32."""
    rows, group = x.shape[0], w.group
    parts = x.view(rows, -1, group).transpose(0, 1).contiguous()           # [G, rows, group]
    y = torch._weight_int8pack_mm(parts[0], w.q[0], w.scales[0]).float()
    for g in range(1, w.q.shape[0]):
        y = y + torch._weight_int8pack_mm(parts[g], w.q[g], w.scales[g])
    return y


@dataclass
class HeadTiming:
    int8_rows: list[int]                  # the timed row counts where int8 won
    ms: dict[str, dict[str, float]]       # form -> rows (as text: JSON keys) -> best ms


@dataclass
class HeadRoute:
    """The head's 8-bit copy and the row counts that multiply by it."""

    stored: Int8Groups
    rows: frozenset[int]
    timing: HeadTiming

    def takes(self, hidden: torch.Tensor) -> bool:
        return hidden.dim() == 2 and hidden.shape[0] in self.rows

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits (each group's product rounded to ``hidden``'s dtype)."""
        return int8_groups_linear(hidden, self.stored)

    def describe(self) -> str:
        times = "; ".join(f"{form} " + ", ".join(f"{r} rows {ms:.2f}" for r, ms in by.items())
                          for form, by in self.timing.ms.items())
        timed = self.timing.int8_rows
        if not timed:
            chosen = "the dense head at every row count (the int8 copy timed no faster)"
        else:
            chosen = (f"an int8 copy in groups of {HEAD_GROUP} for {', '.join(map(str, timed))} "
                      f"rows (and the counts between), the dense head otherwise")
        return f"{chosen}; {HEAD_DRIFT}; timed ms: {times}"


def head_key(weight: torch.Tensor) -> str:
    """The cache key of a head's timing: its shape, dtype, group and the thread count it
    runs at (the module doc)."""
    return (f"{weight.shape[0]}x{weight.shape[1]}:{str(weight.dtype).removeprefix('torch.')}"
            f":int8 groups of {HEAD_GROUP}|{torch.get_num_threads()} threads")


def tune_head(weight: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor],
              path: str | None) -> HeadRoute | None:
    """The head's int8 copy and the row counts where it beats ``dense`` (the head as the
    linear route multiplies it), timed or read from the cache at ``path``; None for a
    hidden size the groups do not divide."""
    if weight.shape[1] % HEAD_GROUP:
        return None
    stored = int8_groups(weight, HEAD_GROUP)
    key = head_key(weight)
    cached = read_cache(path, _CACHE_VERSION, "heads", HeadTiming)
    timing = cached.get(key)
    if timing is None:
        timing = time_head(weight, dense, stored)
        if path is not None:
            try:
                write_cache(path, _CACHE_VERSION, "heads", {**cached, key: timing})
            except OSError as exc:   # a cache that cannot be written must not stop a start
                log.warning("could not cache the CPU LM head's form in %s: %s", path, exc)
    rows = frozenset(r for r in range(1, HEAD_ROWS[-1] + 1)
                     if max(t for t in HEAD_ROWS if t <= r) in timing.int8_rows)
    return HeadRoute(stored, rows, timing)


def time_head(weight: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor],
              stored: Int8Groups, reps: int = REPS) -> HeadTiming:
    """Each form's best of ``reps`` at each of HEAD_ROWS (cpu_timing.best_times: the forms
    take turns); int8 wins a row count where it is faster."""
    ms: dict[str, dict[str, float]] = {DENSE: {}, INT8: {}}
    won = []
    for rows in HEAD_ROWS:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        best = best_times({DENSE: partial(dense, x), INT8: partial(int8_groups_linear, x, stored)},
                          reps)
        for form in ms:
            ms[form][str(rows)] = round(best[form] * 1e3, 4)
        if best[INT8] < best[DENSE]:
            won.append(rows)
    return HeadTiming(won, ms)
