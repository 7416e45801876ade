"""Start-up tuning of TRITON_FUSED_MOE's tiles per (experts, N, K, top-k, batch bucket).

For each expert shape in the model and each token bucket the decode graphs use, the
tiles of ``candidate_tiles`` are timed against the default inside a CUDA graph on one
layer's real weights (a layer's experts are far larger than L2, as in a decode step); at
small batches both layouts (a pair per program, and sorted) and the pair layout's two
gate/up and two down kernels. The fastest that agrees with the default and beats it by
MIN_GAIN goes into every layer impl's ``tiles``. Results are cached with the other tuning results of this device
(kernels/tuning_cache.py), so a second start, or ``archserve prepare`` before it, pays
nothing. A timing that fails keeps the default, is logged and not cached.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from archserve.kernels.linear.quantized_tuning import (
    DEFAULT,
    MIN_GAIN,
    KindTiming,
    QuantTuneReport,
)
from archserve.kernels.moe.expert_activation import (
    DEFAULT_ACTIVATION,
    ExpertBiases,
    GatedActivation,
)
from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
from archserve.kernels.moe.triton_fused_moe import (
    ExpertMatrices,
    MoETile,
    candidate_tiles,
    fused_moe,
    token_bucket,
)
from archserve.kernels.tuning_cache import read_cache, write_cache

log = logging.getLogger(__name__)
# 2: the pair layout (MoETile.pair_rows); 3: its widest tile at 8 warps; 4: the
# slot-summing down kernel (MoETile.down_block_n); 5: the CUDA-core gate/up
# (MoETile.gate_up_block_n); 6: timed over routings that differ call to call; 7: MXFP4
# experts' word-decoding GEMVs (MoETile.mxfp4_words); 8: their tl.dot_scaled tiles
# (MoETile.mxfp4_scaled_dot). Keys name
# MXFP4 experts, the activation and biases where a layer has them (no version change:
# the 16-bit silu keys are as before).
_CACHE_VERSION = 8
# Calls in one timed graph, each with its own routing (so its own experts): a decode step's
# layers never find the experts they read in L2, and Qwen3-30B-A3B's 8 experts a token
# (75 MB) would half fit in an H200's 50 MB L2 if every call routed alike.
_ROUTINGS = 4


@dataclass
class MoEShape:
    """Every layer impl that runs one expert shape, and one layer's weights to time: 16-bit
    (``dtype`` theirs) or MXFP4 (``dtype`` the activations'), with the layer's activation
    and biases, as it runs."""

    impls: list[TritonFusedMoEImpl]
    w13: Any                   # [E, 2I, H]: a tensor or an Mxfp4Weight
    w2: Any                    # [E, H, I]
    top_k: int
    renormalize: bool
    dtype: torch.dtype | None = None
    activation: GatedActivation = DEFAULT_ACTIVATION
    biases: ExpertBiases | None = None

    @property
    def activations_dtype(self) -> torch.dtype:
        return self.dtype or self.w13.dtype

    def key(self, bucket: int) -> str:
        w13 = ExpertMatrices.of(self.w13)
        e, n, k = w13.shape
        kind = ("mxfp4-" if w13.mxfp4 else "") + str(self.activations_dtype).removeprefix(
            "torch.")
        extras = ("" if self.activation == DEFAULT_ACTIVATION else f":{self.activation.kind}"
                  ) + (":bias" if self.biases is not None else "")
        return f"moe:E{e}xN{n}xK{k}:top{self.top_k}:{kind}{extras}:b{bucket}"

    def run(self, x: torch.Tensor, logits: torch.Tensor, tile: MoETile) -> torch.Tensor:
        return fused_moe(x, logits, self.w13, self.w2, self.top_k, self.renormalize, tile,
                         activation=self.activation, biases=self.biases)


class MoETuneReport(QuantTuneReport):
    """The quantized tuner's record (timings per key, cached or not), per MoE bucket."""

    def summary(self) -> str:
        if not self.timings:
            return "no MoE layer to tune"
        won = sum(t.chosen != DEFAULT for t in self.timings.values())
        source = "cached" if self.from_cache else f"tuned in {self.seconds:.1f}s"
        return (f"a tuned tile for {won} of {len(self.timings)} (expert shape, token bucket), "
                f"the default for the rest; {source}")


def tune_moe(shapes: Sequence[MoEShape], token_counts: Sequence[int], cache_path: str | None,
             timer=None) -> MoETuneReport:  # noqa: ANN001 - timer(shape, tokens, tile) -> µs
    """Choose a tile per (shape, bucket of ``token_counts``) for the impls; see the doc."""
    start = time.perf_counter()
    timer = timer or _graph_us
    cached = _read(cache_path)
    buckets = sorted({token_bucket(n) for n in token_counts})
    work = [(shape, b) for shape in shapes for b in buckets]
    report = MoETuneReport(from_cache=bool(work) and all(s.key(b) in cached for s, b in work))
    failed: set[str] = set()
    for shape, bucket in work:
        key = shape.key(bucket)
        timing = cached.get(key)
        if timing is None:
            try:
                timing = _time_bucket(shape, bucket, timer)
            except Exception as exc:  # noqa: BLE001 - the default serves; the start goes on
                log.warning("MoE %s keeps its default tile: timing failed (%s: %s)", key,
                            type(exc).__name__, exc)
                timing = KindTiming(0.0, 0.0, note=f"timing failed: {type(exc).__name__}")
                failed.add(key)
        report.timings[key] = timing
        if timing.chosen != DEFAULT:
            tile = MoETile(**json.loads(timing.chosen))
            for impl in shape.impls:
                impl.tiles[bucket] = tile
    if cache_path is not None and not report.from_cache:
        write_cache(cache_path, _CACHE_VERSION, "shapes",
                    {k: t for k, t in {**cached, **report.timings}.items() if k not in failed})
    report.seconds = time.perf_counter() - start
    return report


def _time_bucket(shape: MoEShape, bucket: int, timer) -> KindTiming:  # noqa: ANN001
    candidates = candidate_tiles(bucket, shape.top_k, shape.w13, shape.w2)
    x, logits = _inputs(shape, bucket)
    expected = shape.run(x, logits, candidates[0]).float()
    default_us = timer(shape, bucket, candidates[0])
    timing = KindTiming(default_us, default_us, calls=len(shape.impls))
    for tile in candidates[1:]:
        try:
            got = shape.run(x, logits, tile).float()
            if not torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max()):
                timing.note += f"{tile.key()}: disagrees with the default; "
                continue
            us = timer(shape, bucket, tile)
        except Exception as exc:  # noqa: BLE001 - a tile that fails is skipped, and said so
            timing.note += f"{tile.key()}: {type(exc).__name__}; "
            continue
        if us < timing.best_us and us < default_us * (1 - MIN_GAIN):
            timing.best_us, timing.chosen = us, json.dumps(dataclasses.asdict(tile))
    return timing


def _inputs(shape: MoEShape, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = ExpertMatrices.of(shape.w13)
    experts, _, hidden = w13.shape
    gen = torch.Generator(device=w13.device).manual_seed(tokens + (seed << 20))
    x = torch.randn(tokens, hidden, generator=gen, device=w13.device,
                    dtype=shape.activations_dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=w13.device)
    return x, logits


def _graph_us(shape: MoEShape, tokens: int, tile: MoETile) -> float:
    """µs a call of ``tile`` on ``tokens`` tokens, in a CUDA graph of _ROUTINGS calls that
    each route differently."""
    from archserve.kernels.cuda_timing import graph_median_us
    inputs = [_inputs(shape, tokens, seed) for seed in range(_ROUTINGS)]

    def calls() -> None:
        for x, logits in inputs:
            shape.run(x, logits, tile)
    us, how = graph_median_us(calls, 10, warmup=2, reps=1)
    if how != "graph":
        raise RuntimeError("the fused MoE could not be captured in a CUDA graph")
    return us / _ROUTINGS


def _read(path: str | None) -> dict[str, KindTiming]:
    return read_cache(path, _CACHE_VERSION, "shapes", KindTiming)
