"""Start-up tuning of the quantized GEMMs at the decode graphs' row counts, cached per device.

For each kind of quantized weight in the model (routine, shape, weight signature) and each
decode graph size, every candidate config of the routine's GEMM is timed against its
default config inside a CUDA graph, cycling through every layer's weight of that kind (as
a decode step does, so L2 cannot hold them); the fastest that agrees with the default and
beats it by MIN_GAIN is installed in the routine's ``configs``. A timing that fails keeps
the default, is logged and not cached. The results are saved next to the compiled kernels
of this device, so a second start reads them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from archserve.kernels.linear.quantized_weights import weight_signature
from archserve.kernels.tuning_cache import read_cache, write_cache

log = logging.getLogger(__name__)

MIN_GAIN = 0.03           # below this, timing noise decides: keep the default
DEFAULT = "default"
# 2: the W8A8 routines' GEMV candidates, the GEMVs' wider splits and prefetching
_CACHE_VERSION = 2


@dataclass
class KindTiming:
    default_us: float
    best_us: float
    chosen: str = DEFAULT                   # DEFAULT or the chosen config as JSON
    calls: int = 1                          # layers of this kind: calls per decode step
    note: str = ""

    def gain_us(self) -> float:
        return (self.default_us - self.best_us) * self.calls if self.chosen != DEFAULT else 0.0


@dataclass
class QuantTuneReport:
    timings: dict[str, KindTiming] = field(default_factory=dict)
    from_cache: bool = False
    seconds: float = 0.0

    def summary(self) -> str:
        if not self.timings:
            return "no quantized decode GEMM to tune"
        won = sum(t.chosen != DEFAULT for t in self.timings.values())
        saved = sum(t.gain_us() for t in self.timings.values()) / 1e3
        source = "cached" if self.from_cache else f"tuned in {self.seconds:.1f}s"
        return (f"a tuned config for {won} of {len(self.timings)} (kind, rows) of quantized "
                f"GEMM, the default for the rest; saves {saved:.3f} ms per set of decode "
                f"steps at the graph sizes; {source}")


# routine, its backend name, and every prepared weight of one kind (same shape, signature)
Kind = tuple[object, str, list]


def kind_key(backend: str, rows: int, weight, dtype: torch.dtype) -> str:  # noqa: ANN001
    return (f"{backend}:{rows}x{weight.out_features}x{weight.in_features}:"
            f"{weight_signature(weight)}:{str(dtype).removeprefix('torch.')}")


def tune_quantized(kinds: Sequence[Kind], rows: Sequence[int], dtype: torch.dtype,
                   cache_path: str | None) -> QuantTuneReport:
    """Choose a config per (kind, rows) for the routines' ``configs``; see the module doc."""
    start = time.perf_counter()
    cached = _read_cache(cache_path)
    report = QuantTuneReport()
    failed: set[str] = set()
    work = [(routine, backend, weights, r) for routine, backend, weights in kinds
            for r in sorted(set(rows)) if routine.candidates(r, weights[0])]
    report.from_cache = bool(work) and all(
        kind_key(b, r, w[0], dtype) in cached for _, b, w, r in work)
    for routine, backend, weights, r in work:
        key = kind_key(backend, r, weights[0], dtype)
        if key in cached:
            timing = cached[key]
        else:
            try:
                timing = _time_kind(routine, weights, r, dtype)
            except Exception as exc:  # noqa: BLE001 - the default serves; the start goes on
                log.warning("quantized GEMM %s keeps its default config: timing failed "
                            "(%s: %s)", key, type(exc).__name__, exc)
                timing = KindTiming(0.0, 0.0, calls=len(weights),
                                    note=f"timing failed: {type(exc).__name__}: {exc}")
                failed.add(key)
        report.timings[key] = timing
        if timing.chosen != DEFAULT:
            config = routine.config_from(json.loads(timing.chosen))
            routine.configs[routine.config_key(r, weights[0])] = config
    if cache_path is not None and not report.from_cache:
        _write_cache(cache_path, {**cached, **{k: t for k, t in report.timings.items()
                                               if k not in failed}})
    report.seconds = time.perf_counter() - start
    return report


def _time_kind(routine, weights: list, rows: int, dtype: torch.dtype) -> KindTiming:  # noqa: ANN001
    from archserve.kernels.cuda_timing import graph_median_us

    first = weights[0]
    device = next(t for t in vars(first).values() if isinstance(t, torch.Tensor)).device
    x = torch.randn(rows, first.in_features, device=device, dtype=dtype)

    def per_call_us(config) -> float:  # noqa: ANN001
        us, how = graph_median_us(lambda: [routine.run(x, w, None, config) for w in weights],
                                  10, warmup=2, reps=1)
        if how != "graph":
            raise RuntimeError("the GEMM could not be captured in a CUDA graph")
        return us / len(weights)

    candidates = routine.candidates(rows, first)
    expected = routine.run(x, first, None, candidates[0]).float()
    default_us = per_call_us(candidates[0])
    timing = KindTiming(default_us, default_us, calls=len(weights))
    for config in candidates[1:]:
        try:
            got = routine.run(x, first, None, config).float()
            if not torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max()):
                timing.note += f"{config}: disagrees with the default; "
                continue
            us = per_call_us(config)
        except Exception as exc:  # noqa: BLE001 - a config that fails is skipped, and said so
            timing.note += f"{config}: {type(exc).__name__}; "
            continue
        if us < timing.best_us and us < default_us * (1 - MIN_GAIN):
            timing.best_us = us
            timing.chosen = json.dumps(dataclasses.asdict(config))
    return timing


def _read_cache(path: str | None) -> dict[str, KindTiming]:
    return read_cache(path, _CACHE_VERSION, "kinds", KindTiming)


def _write_cache(path: str, timings: dict[str, KindTiming]) -> None:
    write_cache(path, _CACHE_VERSION, "kinds", timings)
