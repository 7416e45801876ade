"""Start-up choice of the MLA decode kernel's tiles at this model's sizes, cached per device.

``mla_decode_tiles`` gives the heads of a sequence as the rows (M) of the kernel's dots;
KEYS_AS_ROWS gives them the token tile and the latent values instead. On Hopper only the
second compiles to wgmma (tests/kernels/test_mla_triton.py), but whether it is faster
depends on the GPU, the head count and the latent dtype. So both are timed here, as CUDA
graph replays over a latent cache far larger than L2 (``TUNE_BATCH`` sequences of up to
``TUNE_CONTEXT`` tokens, as a long decode batch reads), and the fastest that agrees with
the rule's output and beats it by MIN_GAIN is what the impl launches. A timing that fails
keeps the rule's tiles, is logged and not cached.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from archserve.kernels.linear.quantized_tuning import DEFAULT, MIN_GAIN, KindTiming
from archserve.kernels.tuning_cache import read_cache, write_cache
from archserve.platform.detect import device_info_for

log = logging.getLogger(__name__)
_CACHE_VERSION = 3   # 2: the rule's splits and stages changed; 3: the 8-warp latent tile
TUNE_BATCH = 64
TUNE_CONTEXT = 4096
# (BLOCK_H, BLOCK_N, num_warps, num_stages, KEYS_AS_ROWS): 64-token tiles give wgmma its
# 64 rows in the score product; the latent's 512 values are the rows of the output product.
# The last is the rule's three-stage latent tile on 8 warps, half the registers a thread:
# sparse MLA's 64 x top-2048 of 8k (16 heads, bf16, 4 splits) ran 85.0 us against the
# rule's 90.5 on an H100 (a sweep of tiles x splits; 3 stages: a GPU whose shared
# memory takes two fails to compile it, which the timing skips).
CANDIDATE_TILES = ((16, 64, 4, 2, True), (16, 64, 8, 2, True), (16, 32, 8, 3, False))


@dataclass(frozen=True)
class MlaShape:
    """What the decode kernel's speed depends on: one key per model."""

    num_heads: int          # this rank's query heads
    kv_lora_rank: int
    rope: int
    dtype: torch.dtype
    cache_dtype: str        # "auto" or "fp8_e4m3"; sparse: "auto" or "fp8_ds_mla"
    block_size: int
    # Sparse MLA: the indexed kernel over ``sparse_topk`` selected rows of cache rows of
    # ``index_dim`` indexer values beside the latent (kernels/sparse_mla/layout.py); 0: dense.
    sparse_topk: int = 0
    index_dim: int = 0

    def tuned_context(self) -> int:
        """The context each timed row has: TUNE_CONTEXT, or for sparse rows twice the top-k
        where that is more (a selection is spread over a context larger than itself)."""
        return max(TUNE_CONTEXT, 2 * self.sparse_topk)

    def describe(self) -> str:
        sparse = f" (top-{self.sparse_topk} of each)" if self.sparse_topk else ""
        return f"{TUNE_BATCH} x {self.tuned_context()}{sparse}"

    def key(self) -> str:
        sparse = f":top{self.sparse_topk}:I{self.index_dim}" if self.sparse_topk else ""
        return (f"mla:H{self.num_heads}:L{self.kv_lora_rank}:R{self.rope}:"
                f"{str(self.dtype).removeprefix('torch.')}:{self.cache_dtype}:"
                f"b{self.block_size}{sparse}")


Timer = Callable[[MlaShape, "tuple | None"], tuple[float, torch.Tensor]]


def tune_mla_tiles(shape: MlaShape, cache_path: str | None, device: torch.device,
                   timer: Timer | None = None) -> tuple[tuple | None, KindTiming, str]:
    """(the tiles to launch, None for the rule's; the timing; where it came from: "cached"
    or "tuned in N s"). ``timer(shape, tiles)`` -> (µs per launch, the output), tiles None:
    the rule's."""
    cached = read_cache(cache_path, _CACHE_VERSION, "shapes", KindTiming)
    timing = cached.get(shape.key())
    source = "cached"
    if timing is None:
        start = time.perf_counter()
        try:
            timing = _time_shape(shape, timer or _graph_timer(device))
        except Exception as exc:  # noqa: BLE001 - the rule's tiles serve; the start goes on
            log.warning("MLA decode %s keeps the rule's tiles: timing failed (%s: %s)",
                        shape.key(), type(exc).__name__, exc)
            return None, KindTiming(0.0, 0.0), f"timing failed: {type(exc).__name__}"
        source = f"tuned in {time.perf_counter() - start:.1f}s"
        if cache_path is not None:
            write_cache(cache_path, _CACHE_VERSION, "shapes", {**cached, shape.key(): timing})
    tiles = None if timing.chosen == DEFAULT else tuple(json.loads(timing.chosen))
    return tiles, timing, source


def _time_shape(shape: MlaShape, timer: Timer) -> KindTiming:
    default_us, expected = timer(shape, None)
    expected = expected.float()
    timing = KindTiming(default_us, default_us)
    for tiles in CANDIDATE_TILES:
        try:
            us, got = timer(shape, tiles)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is skipped, and said so
            timing.note += f"{list(tiles)}: {type(exc).__name__}; "
            continue
        scale = expected.abs().max().clamp_min(1.0)
        if not torch.allclose(got.float(), expected, rtol=2e-2, atol=2e-2 * float(scale)):
            timing.note += f"{list(tiles)}: disagrees with the rule's tiles; "
            continue
        if us < timing.best_us and us < default_us * (1 - MIN_GAIN):
            timing.best_us, timing.chosen = us, json.dumps(list(tiles))
    return timing


def _graph_timer(device: torch.device) -> Timer:
    """Times ``mla_decode`` at TUNE_BATCH x TUNE_CONTEXT on ``device`` as graph replays,
    over random operands made there (no reference: the rule's output is the reference)."""
    from archserve.kernels.cuda_timing import graph_median_us
    from archserve.kernels.mla.triton_mla_decode import mla_decode

    operands: dict[MlaShape, tuple] = {}

    def make(shape: MlaShape) -> tuple:
        width = shape.kv_lora_rank + shape.rope
        blocks_per_seq = -(-TUNE_CONTEXT // shape.block_size)
        # The metadata first: the decode kernel reads it before PDL's wait, so the kernel
        # launched right before its first call must not be the one that writes it.
        tables = torch.arange(TUNE_BATCH * blocks_per_seq, dtype=torch.int32,
                              device=device).reshape(TUNE_BATCH, blocks_per_seq)
        lens = torch.full((TUNE_BATCH,), TUNE_CONTEXT, dtype=torch.int32, device=device)
        starts = torch.arange(TUNE_BATCH + 1, dtype=torch.int32, device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        cache = torch.randn(1, TUNE_BATCH * blocks_per_seq, shape.block_size, 1, width,
                            generator=gen, device=device, dtype=shape.dtype)
        if shape.cache_dtype == "fp8_e4m3":
            cache = cache.to(torch.float8_e4m3fn)
        query = torch.randn(TUNE_BATCH, shape.num_heads, width, generator=gen, device=device,
                            dtype=shape.dtype)
        return query, cache, tables, lens, starts, width ** -0.5, {}

    def make_sparse(shape: MlaShape) -> tuple:
        """Each of TUNE_BATCH rows selects sparse_topk random positions of its own
        ``tuned_context()``-token context, in the layout's cache rows (written by the row writer:
        real fp8_ds_mla values where the latent is fp8)."""
        from archserve.kernels.sparse_mla.layout import SparseMlaLayout
        from archserve.kernels.sparse_mla.triton_rows import write_sparse_rows

        layout = SparseMlaLayout.for_cache(shape.kv_lora_rank, shape.rope, shape.index_dim,
                                           shape.dtype, shape.cache_dtype)
        context = shape.tuned_context()
        blocks_per_seq = -(-context // shape.block_size)
        tables = torch.arange(TUNE_BATCH * blocks_per_seq, dtype=torch.int32,
                              device=device).reshape(TUNE_BATCH, blocks_per_seq)
        counts = torch.full((TUNE_BATCH,), shape.sparse_topk, dtype=torch.int32, device=device)
        starts = torch.arange(TUNE_BATCH + 1, dtype=torch.int32, device=device)
        row_seq = torch.arange(TUNE_BATCH, dtype=torch.int32, device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        cache = layout.allocate(TUNE_BATCH * blocks_per_seq, shape.block_size, device)
        width = shape.kv_lora_rank + shape.rope
        slots = cache.shape[1] * shape.block_size
        for first in range(0, slots, 1 << 15):
            n = min(1 << 15, slots - first)
            write_sparse_rows(layout, cache,
                              torch.arange(first, first + n, device=device),
                              torch.randn(n, width, generator=gen, device=device,
                                          dtype=shape.dtype),
                              torch.randn(n, shape.index_dim, generator=gen, device=device,
                                          dtype=shape.dtype) if shape.index_dim else None)
        indices = torch.rand(TUNE_BATCH, context, generator=gen, device=device).argsort(
            dim=1)[:, :shape.sparse_topk].to(torch.int32).contiguous()
        query = torch.randn(TUNE_BATCH, shape.num_heads, width, generator=gen, device=device,
                            dtype=shape.dtype)
        return (query, cache, tables, counts, starts, width ** -0.5,
                dict(indices=indices, row_seq=row_seq, layout=layout))

    def timer(shape: MlaShape, tiles: tuple | None) -> tuple[float, torch.Tensor]:
        if shape not in operands:
            operands[shape] = make(shape) if not shape.sparse_topk else make_sparse(shape)
        query, cache, tables, lens, starts, scale, sparse = operands[shape]
        out = torch.empty(TUNE_BATCH, shape.num_heads, shape.kv_lora_rank, dtype=query.dtype,
                          device=device)
        sms = device_info_for(device).multiprocessor_count or 0
        entries = shape.sparse_topk or TUNE_CONTEXT

        def run() -> None:
            mla_decode(query, cache, tables, lens, starts, out, num_seqs=TUNE_BATCH,
                       max_seq_len=entries, scale=scale, num_sms=sms, tiles=tiles, **sparse)

        us, how = graph_median_us(run, 10, warmup=2, reps=4)
        if how != "graph":
            raise RuntimeError("the MLA decode kernel could not be captured in a CUDA graph")
        run()
        return us, out.clone()

    return timer


def describe(timing: KindTiming, source: str, shape: MlaShape | None = None) -> str:
    """The start-up decision's reason (``source``: tune_mla_tiles' third value)."""
    at = shape.describe() if shape is not None else f"{TUNE_BATCH} x {TUNE_CONTEXT}"
    if timing.default_us == 0.0:
        return f"the rule's tiles ({source})"
    if timing.chosen == DEFAULT:
        return (f"the rule's tiles: {timing.default_us:.1f} µs at {at}, no candidate faster "
                f"by {MIN_GAIN:.0%} ({source})")
    return (f"tiles {timing.chosen} (keys as the dots' rows): {timing.best_us:.1f} µs against "
            f"the rule's {timing.default_us:.1f} µs at {at} ({source})")
