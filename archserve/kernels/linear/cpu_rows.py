"""TORCH_MATMUL on a CPU: the GEMM of a few rows in the form the CPU BLAS runs faster.

A product of 2-16 rows (a step verifying draft tokens, a small decode batch) can be asked
of the BLAS as ``F.linear(x, W)`` (x Wᵀ: its transposed-B GEMM) or as (W xᵀ)ᵀ (W streamed
row by row against a few columns). Which is faster depends on the library and the CPU: on
the development machine (AMD EPYC, MKL 2024.2, one thread, SmolLM2-135M's decode weights
read from memory) 2 rows took 246 ms a step's weights as x Wᵀ and 99 ms as W xᵀ, 5 rows
259 against 189, 9 rows the same, 17 rows x Wᵀ won. So each row count is timed once, both
forms, over the model's weights (cycled, so they come from memory as in a step), and the
choice is cached per CPU, library versions, thread count and the model's weight shapes. One row stays ``F.linear`` (a GEMV either
way), and so does anything the timing did not cover.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import partial

import torch

from archserve.kernels.linear.cpu_timing import best_times, cycled, tensor_bytes
from archserve.kernels.linear.torch_linear import torch_linear
from archserve.kernels.tuning_cache import read_cache, write_cache

log = logging.getLogger(__name__)

ROWS = (2, 3, 4, 5, 6, 8, 12, 16)   # timed; a count between two takes the lower one's form
MAX_ROWS = ROWS[-1]
# W xᵀ must beat x Wᵀ by this fraction: below it, timing noise decides.
MIN_GAIN = 0.05
_CACHE_VERSION = 1


@dataclass
class RowsChoice:
    transposed: bool          # (W xᵀ)ᵀ
    linear_ms: float
    transposed_ms: float


class CpuRowsLinear:
    """The CPU's linear routine: ``F.linear``, or (W xᵀ)ᵀ for the row counts where that was
    measured faster."""

    def __init__(self) -> None:
        self.transposed_rows: frozenset[int] = frozenset()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] in self.transposed_rows and weight.dtype == x.dtype:
            y = torch.mm(weight, x.t()).t().contiguous()
            return y if bias is None else y + bias
        return torch_linear(x, weight, bias)

    def tune_rows(self, weights: list[torch.Tensor], path: str | None) -> str:
        """Time both forms at each of ``ROWS`` over ``weights`` (cached at ``path``);
        returns what was chosen, for the start-up decision."""
        if not weights:
            return "no dense weights"
        shapes = sorted({(tuple(w.shape), str(w.dtype)) for w in weights})
        digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]
        key = f"{digest}|{torch.get_num_threads()}"
        cached = read_cache(path, _CACHE_VERSION, "rows", RowsChoice)
        choices = {rows: cached[f"{key}|{rows}"] for rows in ROWS if f"{key}|{rows}" in cached}
        if len(choices) < len(ROWS):
            choices = _time_forms(cycled(weights, tensor_bytes))
            if path is not None:
                write_cache(path, _CACHE_VERSION, "rows",
                            {**cached, **{f"{key}|{r}": c for r, c in choices.items()}})
        timed = sorted(r for r, c in choices.items() if c.transposed)
        self.transposed_rows = frozenset(
            rows for rows in range(2, MAX_ROWS + 1)
            if choices[max(r for r in ROWS if r <= rows)].transposed)
        detail = ", ".join(f"{r} rows {c.linear_ms:.1f}/{c.transposed_ms:.1f} ms"
                           for r, c in sorted(choices.items()))
        return (f"(W xT)T for {', '.join(map(str, timed))} rows (and the counts between), x WT "
                f"otherwise" if timed else "x WT at every row count") + \
            f"; timed x WT / (W xT)T: {detail}"


def _time_forms(weights: list[torch.Tensor], reps: int = 3) -> dict[int, RowsChoice]:
    """Per row count, the best of ``reps`` passes over ``weights`` in each form
    (cpu_timing.best_times: the forms take turns)."""
    plain, transposed = CpuRowsLinear(), CpuRowsLinear()
    choices = {}
    for rows in ROWS:
        transposed.transposed_rows = frozenset({rows})
        # keyed by dtype too: a float32 router weight can share a 16-bit weight's width
        inputs = {(w.shape[1], w.dtype): torch.randn(rows, w.shape[1], dtype=w.dtype)
                  for w in weights}
        best = best_times({False: partial(_one_pass, plain, weights, inputs),
                           True: partial(_one_pass, transposed, weights, inputs)}, reps)
        choices[rows] = RowsChoice(best[True] < best[False] * (1 - MIN_GAIN),
                                   best[False] * 1e3, best[True] * 1e3)
    return choices


def _one_pass(routine: CpuRowsLinear, weights: list[torch.Tensor], inputs: dict) -> None:
    for w in weights:
        routine(inputs[w.shape[1], w.dtype], w)
