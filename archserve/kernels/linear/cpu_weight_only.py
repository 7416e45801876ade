"""CPU_WEIGHT_ONLY: integer-group weights on a CPU, in the storage that reads fewest bytes
per token and that this CPU multiplies fastest, chosen per shape by timing.

A decode step on a CPU is bound by the bytes of weights it streams from memory. Expanded to
float32, the embedded Q4_1 model reads 6x what llama.cpp reads. The formats, each a weight's
storage and the torch kernel that reads it:

| format | bytes / weight | kernel | exact? | runs where |
|---|---|---|---|---|
| ``int4`` | 0.5 + group scales | ``aten._weight_int4pack_mm_for_cpu`` | scale and zero rounded to bf16 | 4-bit groups of 32-256, N % 16 == 0; AVX2 |
| ``int8`` | 1 + row scales | ``aten._weight_int8pack_mm`` | yes (per-channel symmetric 8-bit only) | AVX2 |
| ``bf16`` | 2 | ``F.linear`` in bfloat16 (oneDNN) | weights rounded to bf16 | AVX-512 BF16 or AMX |
| ``fp32`` | 4 | ``F.linear`` (MKL) | yes (TORCH_DEQUANT's expansion) | any CPU |

torch's int4 and int8 CPU kernels are fast with bfloat16 activations only (a float32 x
takes a scalar path 20-100x slower), so the route serves bfloat16 models; a float32 model
keeps the exact expansion (TORCH_DEQUANT). Which format wins depends on the CPU and the row
count (the int4 kernel's cost grows with the rows, dense bf16 is a GEMM): on the development
machine (AVX-512 BF16, one thread, the embedded model's 30 layers) a step's linears took
17 / 76 / 90 ms as int4 / bf16 / fp32 at 1 row, 32 / 78 / 169 at 4, but 304 / 157 / 675 at
64 (a prefill). So ``tune_formats`` times every format this CPU runs on the layers' own
weights at decode's row counts (TIMED_ROWS), cycling through enough of them that they come
from memory as in a step (cpu_timing.py, shared with cpu_rows.py), and keeps the format of
least summed time per (shape, group layout): decode is most of a reply's time, a long
prompt's prefill pays for it. Results are cached per CPU and torch version (the engine
passes the path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from archserve.kernels.linear.cpu_timing import best_times, cycled
from archserve.kernels.linear.quantized_weights import (
    IntGroupWeight,
    dequantize_int_group,
    unpack_int_rows,
    weight_signature,
)
from archserve.kernels.tuning_cache import read_cache, write_cache
from archserve.platform.device import DeviceInfo

if TYPE_CHECKING:
    from archserve.kernels.linear.cpu_lm_head import HeadRoute

log = logging.getLogger(__name__)

INT4, INT8, BF16, FP32 = "int4", "int8", "bf16", "fp32"
FORMATS = (INT4, INT8, BF16, FP32)           # also the order when nothing was timed
TIMED_ROWS = (1, 4)
REPS = 5
_INT4_GROUPS = (32, 64, 128, 256)
_CACHE_VERSION = 3


def format_rule(fmt: str, device: DeviceInfo, weight: IntGroupWeight | None = None
                ) -> str | None:
    """None where ``fmt`` runs this weight on this CPU (any weight when None), else why not."""
    features = device.features
    if fmt in (INT4, INT8) and not features.avx2:
        return "torch's int4/int8 CPU kernels need AVX2 (scalar code otherwise)"
    if fmt == BF16 and not features.cpu_bf16:
        return "bfloat16 GEMMs need AVX-512 BF16 or AMX (emulated otherwise)"
    if weight is None or fmt in (BF16, FP32):
        return None
    if weight.perm is not None:
        return "act-order weights read x in their own order"
    if fmt == INT4:
        if weight.bits != 4:
            return f"{weight.bits}-bit weights"
        if weight.group_size not in _INT4_GROUPS:
            return f"groups of {weight.group_size} (takes {', '.join(map(str, _INT4_GROUPS))})"
        if weight.out_features % 16:
            return f"{weight.out_features} outputs (takes multiples of 16)"
        return None
    if weight.bits != 8 or weight.group_size != weight.in_features or not _symmetric(weight):
        return "takes 8-bit per-channel symmetric weights only (exactly)"
    return None


def _symmetric(weight: IntGroupWeight) -> bool:
    if weight.offsets is None:
        return True
    return bool(torch.equal(weight.offsets.float(), -128.0 * weight.scales.float()))


@dataclass
class CpuWeight:
    """One layer's weight in its chosen format (the tensors are the layer's parameters)."""

    format: str
    weight: torch.Tensor                       # int4: packed uint8; int8 [N, K]; dense [N, K]
    scales: torch.Tensor | None = None         # int4 [K/g, N, 2] scale and zero; int8 [N]
    group_size: int = 0
    in_features: int = 0
    out_features: int = 0


def to_format(weight: IntGroupWeight, fmt: str) -> CpuWeight:
    """``weight`` stored as ``fmt`` (the formats' table in the module doc)."""
    n, k = weight.out_features, weight.in_features
    if fmt in (BF16, FP32):
        dense = dequantize_int_group(weight)
        if weight.perm is not None:
            reordered = torch.empty_like(dense)
            reordered[:, weight.perm] = dense      # x[:, perm] @ W^T == x @ W'^T
            dense = reordered
        return CpuWeight(fmt, dense.to(torch.bfloat16 if fmt == BF16 else torch.float32),
                         in_features=k, out_features=n)
    q = unpack_int_rows(weight.qweight, weight.bits).t().contiguous()          # [N, K]
    scales = weight.scales.float()
    if fmt == INT8:
        return CpuWeight(INT8, (q - 128).to(torch.int8), scales[0].to(torch.bfloat16),
                         weight.group_size, k, n)
    # torch's int4 kernel computes (q - 8) * scale + zero: Q4_1's q * d + m has zero m + 8d.
    offsets = -8.0 * scales if weight.offsets is None else weight.offsets.float()
    zeros = offsets + 8.0 * scales
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    pairs = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()
    return CpuWeight(INT4, packed, pairs, weight.group_size, k, n)


def cpu_linear(x: torch.Tensor, w: CpuWeight, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x W^T (+ b) in x's dtype, for any of the formats."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if w.format == FP32:
        y = F.linear(flat.float(), w.weight)
    elif w.format == BF16:
        y = F.linear(flat.to(torch.bfloat16), w.weight)
    elif w.format == INT8:
        y = torch._weight_int8pack_mm(flat.to(torch.bfloat16), w.weight, w.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), w.weight,
                                                       w.group_size, w.scales)
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], w.out_features)


@dataclass
class FormatTiming:
    chosen: str
    ms: dict[str, float]          # format -> summed best time over TIMED_ROWS, one pass


def kind_key(weight: IntGroupWeight) -> str:
    """A kind's cache key: its shape and group layout. Not the thread count: the storage is
    fixed at load while the thread governor moves the count with the machine's load, and
    two engines on one machine must store (and so compute) alike."""
    return f"{weight.out_features}x{weight.in_features}:{weight_signature(weight)}"


class CpuWeightOnlyLinear:
    """The CPU_WEIGHT_ONLY routine: ``prepare`` stores a weight in its kind's format,
    ``__call__`` multiplies (``cpu_linear``)."""

    def __init__(self, device: DeviceInfo, spec: object = None) -> None:
        self.device = device
        self.choices: dict[str, str] = {}     # kind_key -> format (filled by tune_formats)

    def formats_for(self, weight: IntGroupWeight) -> list[str]:
        return [f for f in FORMATS if format_rule(f, self.device, weight) is None]

    def prepare(self, weight: IntGroupWeight, dtype: torch.dtype) -> CpuWeight:
        fmt = self.choices.get(kind_key(weight))
        return to_format(weight, fmt or self.formats_for(weight)[0])

    def __call__(self, x: torch.Tensor, weight: CpuWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_linear(x, weight, bias)

    def tune_head(self, weight: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor],
                  path: str | None) -> HeadRoute | None:
        """The LM head's 8-bit copy and the row counts it serves (cpu_lm_head.py), or None
        where this CPU has no int8 kernel or the copy's groups do not fit."""
        # Imported here: cpu_lm_head builds on this module's formats.
        from archserve.kernels.linear.cpu_lm_head import tune_head
        if format_rule(INT8, self.device) is not None:
            return None
        return tune_head(weight, dense, path)

    def tune_formats(self, weights: list[IntGroupWeight], path: str | None
                     ) -> dict[str, FormatTiming]:
        """Choose each kind's format by timing (see the module doc), or read the choice
        from the cache at ``path``; returns the timings by kind."""
        kinds: dict[str, list[IntGroupWeight]] = {}
        for w in weights:
            kinds.setdefault(kind_key(w), []).append(w)
        cached = read_cache(path, _CACHE_VERSION, "kinds", FormatTiming)
        timings = {}
        for key, group in kinds.items():
            formats = self.formats_for(group[0])
            timing = cached.get(key)
            if not _timed_among(timing, formats):
                timing = time_formats(group, formats)
            timings[key] = timing
            self.choices[key] = timing.chosen
        if any(k not in cached for k in timings):
            _save(path, {**cached, **timings})
        return timings


def time_formats(weights: list[IntGroupWeight], formats: list[str], reps: int = REPS
                 ) -> FormatTiming:
    """Each format's best of ``reps`` passes over the kind's weights (up to
    cpu_timing.TIMED_BYTES of them in float32) at each of TIMED_ROWS; the least summed
    time wins."""
    if len(formats) == 1:
        return FormatTiming(formats[0], {})
    timed = cycled(weights, lambda w: w.out_features * w.in_features * 4)
    return _time_stored({f: [to_format(w, f) for w in timed] for f in formats},
                        weights[0].in_features, reps)


def _time_stored(stored: dict[str, list[CpuWeight]], k: int, reps: int = REPS
                 ) -> FormatTiming:
    """The formats' summed time a layer over TIMED_ROWS (cpu_timing.best_times: they take
    turns), and the fastest."""
    formats = list(stored)
    if len(formats) == 1:
        return FormatTiming(formats[0], {})
    total = dict.fromkeys(formats, 0.0)
    for rows in TIMED_ROWS:
        x = torch.randn(rows, k)
        best = best_times({f: partial(_one_pass, x, stored[f]) for f in formats}, reps)
        for f in formats:
            total[f] += best[f]
    layers = len(stored[formats[0]])
    ms = {f: round(total[f] * 1e3 / layers, 4) for f in formats}
    return FormatTiming(min(formats, key=ms.__getitem__), ms)


def _one_pass(x: torch.Tensor, weights: list[CpuWeight]) -> None:
    for w in weights:
        cpu_linear(x, w)


def _timed_among(timing: FormatTiming | None, formats: list[str]) -> bool:
    """Whether a cached ``timing`` chose among exactly ``formats`` (a CPU with other
    features, or a format's rule that changed, times again)."""
    return timing is not None and set(timing.ms or [timing.chosen]) == set(formats)


def _save(path: str | None, timings: dict[str, FormatTiming]) -> None:
    if path is None:
        return
    try:
        write_cache(path, _CACHE_VERSION, "kinds", timings)
    except OSError as exc:   # a cache that cannot be written must not stop a start
        log.warning("could not cache the CPU weight formats in %s: %s", path, exc)
