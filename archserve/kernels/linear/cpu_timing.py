"""Start-up timing of the CPU's GEMM alternatives (the form of a few rows' product in
cpu_rows.py, the storage of a quantized weight in cpu_weight_only.py).

A CPU decode step streams its weights from memory, so a choice is timed over enough of the
model's own weights to spill the caches (``TIMED_BYTES``), cycled as a step reads them. The
machine is shared and its load moves: the alternatives take turns within each repetition,
so a change in load falls on all of them, and each keeps its best pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

# Weights cycled per timing: enough to spill the CPU's caches, as a step's do.
TIMED_BYTES = 96 << 20


def cycled(items: list, nbytes: Callable[[object], int], budget: int = TIMED_BYTES) -> list:
    """``items``, largest first, until ``budget`` bytes (all of them if fewer; at least one)."""
    chosen, total = [], 0
    for item in sorted(items, key=lambda item: -nbytes(item)):
        if total >= budget:
            break
        chosen.append(item)
        total += nbytes(item)
    return chosen


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def best_times(candidates: dict[Hashable, Callable[[], object]], reps: int
               ) -> dict[Hashable, float]:
    """Each candidate's best time in seconds over ``reps`` runs, the candidates taking
    turns within each repetition."""
    best = dict.fromkeys(candidates, float("inf"))
    with torch.inference_mode():
        for _ in range(reps):
            for key, run in candidates.items():
                start = time.perf_counter()
                run()
                best[key] = min(best[key], time.perf_counter() - start)
    return best
