"""The TRITON_SKINNY_GEMM linear routine: per GEMM shape, the Triton GEMV or cuBLAS,
whichever measured faster on this GPU.

Each (rows, out_features, in_features, dtype) a decode graph will run is timed once at
start-up, both ways, inside a CUDA graph (as the engine replays it) and cycling through
every layer's weight of that shape (as a decode step does, so a weight that would fit
in L2 is not read from there). A Triton config wins only when it is faster by a margin
and its output agrees with cuBLAS's; otherwise that shape stays on cuBLAS. The result
is saved per device and library versions, so a second start reads it instead.

The Triton kernel runs only inside ``decode_graph_scope()``, which the engine holds while
it warms up and captures its decode graphs. Launched eagerly, the kernel's Python launch
costs more host time than the kernel takes on the device; the eager paths (prefill, and
decode without graphs) stay on cuBLAS.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CUBLAS = "cublas"
# A Triton config must beat cuBLAS by this fraction: below it, timing noise decides.
MIN_GAIN = 0.03
_CACHE_VERSION = 1

WeightGroups = dict[tuple[int, int, torch.dtype], list[torch.Tensor]]

_graph_scope_depth = 0


@contextmanager
def decode_graph_scope() -> Iterator[None]:
    """Within the block, linear calls may take the tuned Triton kernels (graph capture)."""
    global _graph_scope_depth
    _graph_scope_depth += 1
    try:
        yield
    finally:
        _graph_scope_depth -= 1


def shape_key(rows: int, out_features: int, in_features: int, dtype: torch.dtype) -> str:
    return f"{rows}x{out_features}x{in_features}:{str(dtype).removeprefix('torch.')}"


@dataclass
class ShapeTiming:
    """What tuning measured for one shape: µs per call for cuBLAS and each config."""
    cublas_us: float
    triton_us: dict[str, float] = field(default_factory=dict)
    chosen: str = CUBLAS
    note: str = ""


@dataclass
class TuneReport:
    timings: dict[str, ShapeTiming] = field(default_factory=dict)
    from_cache: bool = False
    seconds: float = 0.0

    def summary(self) -> str:
        won = sorted(k for k, t in self.timings.items() if t.chosen != CUBLAS)
        if not self.timings:
            return "no decode GEMM shapes to tune"
        saved = sum(t.cublas_us - t.triton_us[t.chosen] for k, t in self.timings.items()
                    if t.chosen != CUBLAS)
        source = "cached" if self.from_cache else f"tuned in {self.seconds:.1f}s"
        return (f"Triton GEMV for {len(won)} of {len(self.timings)} decode GEMM shapes "
                f"(sum of per-shape gains {saved:.1f} µs), cuBLAS for the rest; {source}")


class SkinnyGemmRoutine:
    """Called as ``routine(x, weight, bias)`` by every linear layer (set_linear_routine)."""

    def __init__(self, device=None, spec=None) -> None:
        self.choices: dict[str, str] = {}   # shape_key -> config key or CUBLAS
        self.report: TuneReport | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if _graph_scope_depth and x.is_cuda and x.dim() == 2:
            chosen = self.choices.get(shape_key(x.shape[0], weight.shape[0], weight.shape[1],
                                                x.dtype), CUBLAS)
            if chosen != CUBLAS:
                from archserve.kernels.linear.triton_skinny_gemm import (
                    SkinnyConfig,
                    skinny_gemm,
                    skinny_gemm_unsupported,
                )
                if skinny_gemm_unsupported(x, weight, bias) is None:
                    return skinny_gemm(x, weight, bias, SkinnyConfig.from_key(chosen))
        return F.linear(x, weight, bias)

    def tune(self, groups: WeightGroups, rows: Sequence[int], cache_path: str | None
             ) -> TuneReport:
        """Choose per shape for every row count in ``rows`` (those above the kernel's
        limit stay on cuBLAS). ``groups``: the model's linear weights by (out_features,
        in_features, dtype). Reads and writes ``cache_path`` when given."""
        from archserve.kernels.linear.triton_skinny_gemm import MAX_ROWS
        start = time.perf_counter()
        wanted = [shape_key(r, n, k, dtype) for r in rows if 1 <= r <= MAX_ROWS
                  for (n, k, dtype) in groups]
        cached = _read_cache(cache_path)
        if wanted and all(key in cached for key in wanted):
            report = TuneReport({key: cached[key] for key in wanted}, from_cache=True)
        else:
            report = TuneReport()
            for r in sorted({r for r in rows if 1 <= r <= MAX_ROWS}):
                for (n, k, dtype), weights in groups.items():
                    report.timings[shape_key(r, n, k, dtype)] = time_shape(r, weights)
            if cache_path is not None:
                _write_cache(cache_path, {**cached, **report.timings})
        report.seconds = time.perf_counter() - start
        self.choices.update({key: t.chosen for key, t in report.timings.items()})
        self.report = report
        return report


def time_shape(rows: int, weights: list[torch.Tensor], iters: int = 10) -> ShapeTiming:
    """cuBLAS and every candidate config on one shape; the fastest that agrees wins."""
    from archserve.kernels.cuda_timing import graph_median_us
    from archserve.kernels.linear.triton_skinny_gemm import (
        candidate_configs,
        skinny_gemm,
        skinny_gemm_unsupported,
    )
    weight = weights[0]
    x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype)

    def per_call_us(gemm) -> float:
        us, how = graph_median_us(lambda: [gemm(w) for w in weights], iters, warmup=2, reps=1)
        if how != "graph":
            raise RuntimeError("the candidate could not be captured in a CUDA graph")
        return us / len(weights)

    timing = ShapeTiming(cublas_us=per_call_us(lambda w: F.linear(x, w)))
    if skinny_gemm_unsupported(x, weight, None) is not None:
        timing.note = skinny_gemm_unsupported(x, weight, None)
        return timing
    expected = F.linear(x, weight).float()
    best_us = timing.cublas_us * (1 - MIN_GAIN)
    for config in candidate_configs(rows):
        try:
            got = skinny_gemm(x, weight, None, config).float()
            if not torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max()):
                timing.note += f"{config.key()}: disagrees with cuBLAS; "
                continue
            us = per_call_us(lambda w, c=config: skinny_gemm(x, w, None, c))
        except Exception as exc:  # noqa: BLE001 - a config that fails is skipped, and said so
            timing.note += f"{config.key()}: {type(exc).__name__}: {exc}; "
            continue
        timing.triton_us[config.key()] = us
        if us < best_us:
            best_us, timing.chosen = us, config.key()
    return timing


def _read_cache(path: str | None) -> dict[str, ShapeTiming]:
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != _CACHE_VERSION:
            return {}
        return {key: ShapeTiming(**value) for key, value in data["shapes"].items()}
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring unreadable GEMM tuning cache %s (%s)", path, exc)
        return {}


def _write_cache(path: str, timings: dict[str, ShapeTiming]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": _CACHE_VERSION,
                   "shapes": {key: vars(t) for key, t in sorted(timings.items())}}, f, indent=1)
    os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new one
