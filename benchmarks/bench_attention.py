"""Attention kernel benchmark: paged decode bandwidth and causal prefill throughput.

    python benchmarks/bench_attention.py --out results/attention.json

Decode rows report the KV bytes the kernel must read per second next to this device's
measured device-to-device copy bandwidth (the practical ceiling). Prefill rows report
TFLOP/s counting causal work only (2 * 2 * s^2 * h * d / 2 per sequence), for TRITON_ATTN
and, side by side, torch SDPA (flash backend) on contiguous tensors of the same shape.
Times come from CUDA events: warm-up, then the median of --iters runs. Decode is timed as
CUDA-graph replays (as the engine runs it): a kernel of a few microseconds timed eagerly
measures Python and launch overhead. ``--split-sweep`` adds decode rows for each forced
number of KV splits, the data behind ``choose_num_splits``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

# Runnable from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from archserve.kernels.cuda_timing import graph_median_us, median_ms  # noqa: E402


def copy_bandwidth(iters: int, warmup: int, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters, warmup)
    return 2 * nbytes / (ms * 1e-3)


def paged_batch(batch: int, ctx: int, query_len: int, block_size: int, heads: int,
                kv_heads: int, head_size: int, dtype: torch.dtype):
    """A batch of `batch` sequences of context `ctx`, blocks shuffled across the pool."""
    from archserve.kernels.attention.interface import AttentionLayerParams, AttentionMetadata

    blocks_per_seq = (ctx + block_size - 1) // block_size
    num_blocks = batch * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, -1)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size, device="cuda",
                        dtype=dtype)
    positions = torch.arange(ctx - query_len, ctx, device="cuda")
    slots = (block_tables[:, positions // block_size].long() * block_size
             + positions % block_size).flatten()
    tokens = batch * query_len
    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, tokens + 1, query_len, device="cuda",
                                     dtype=torch.int32),
        seq_lens=torch.full((batch,), ctx, device="cuda", dtype=torch.int32),
        block_tables=block_tables, slot_mapping=slots, max_query_len=query_len,
        max_seq_len=ctx, num_seqs=batch, query_lens_cpu=[query_len] * batch,
        seq_lens_cpu=[ctx] * batch)
    layer = AttentionLayerParams(num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
                                 scale=head_size ** -0.5)
    query = torch.randn(tokens, heads, head_size, device="cuda", dtype=dtype)
    key = torch.randn(tokens, kv_heads, head_size, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    return query, key, value, cache, meta, layer


def bench_decode(args, batch: int, ctx: int, block_size: int, copy_bw: float,
                 num_splits: int | None = None, heads: int = 32,
                 tiles: tuple[int, int, int] | None = None) -> dict:
    """The engine's decode call over 8 KV heads; ``num_splits`` and ``tiles`` force the split
    count and the (BLOCK_N, num_warps, num_stages) (None: the engine's rules)."""
    from archserve.kernels.attention.triton_decode import (
        choose_num_splits,
        decode_attention,
        decode_tiles,
    )

    kv_heads, d, dtype = 8, 128, torch.bfloat16
    query, key, value, cache, meta, layer = paged_batch(batch, ctx, 1, block_size, heads,
                                                        kv_heads, d, dtype)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = num_splits or choose_num_splits(batch, kv_heads, ctx, num_sms)
    out = torch.empty_like(query)

    # The attention read alone: the one-token cache write is not what is being measured.
    def run():
        decode_attention(query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                         out, num_seqs=batch, max_seq_len=ctx, scale=layer.scale,
                         num_splits=splits, tiles=tiles)

    us, timing = graph_median_us(run, args.iters, args.warmup)
    kv_bytes = 2 * batch * ctx * kv_heads * d * cache.element_size()
    bw = kv_bytes / (us * 1e-6)
    return {"kind": "decode", "backend": "TRITON_ATTN", "batch": batch, "ctx": ctx,
            "heads": heads, "kv_heads": kv_heads, "tiles": tiles or decode_tiles(
                d, heads // kv_heads, -(-ctx // splits) if splits > 1 else None),
            "block_size": block_size, "num_splits": splits, "forced_splits": num_splits is not None,
            "timing": timing, "ms": us / 1e3, "kv_GBps": bw / 1e9,
            "fraction_of_copy_bw": bw / copy_bw,
            "fraction_of_4.3TBps": bw / 4.3e12}


def causal_flops(batch: int, seq: int, heads: int, d: int) -> float:
    return batch * 2 * 2 * seq * seq * heads * d / 2


def bench_prefill_triton(args, batch: int, seq: int, block_size: int) -> dict:
    from archserve.kernels.attention.triton_backend import TritonAttentionImpl

    heads, kv_heads, d = 32, 8, 128
    query, key, value, cache, meta, layer = paged_batch(batch, seq, seq, block_size, heads,
                                                        kv_heads, d, torch.bfloat16)
    impl = TritonAttentionImpl()
    ms = median_ms(lambda: impl.forward(query, None, None, cache, meta, layer),
                   args.iters, args.warmup)
    return {"kind": "prefill", "backend": "TRITON_ATTN", "batch": batch, "seq": seq,
            "block_size": block_size, "ms": ms,
            "TFLOPs": causal_flops(batch, seq, heads, d) / (ms * 1e-3) / 1e12}


def bench_prefill_sdpa(args, batch: int, seq: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, d = 32, 8, 128
    q = torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16)
    # Flash SDPA has no GQA: give it K/V already expanded to every query head.
    k = torch.randn(batch, kv_heads, seq, d, device="cuda", dtype=torch.bfloat16)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = torch.randn_like(k)

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    ms = median_ms(run, args.iters, args.warmup)
    return {"kind": "prefill", "backend": "torch SDPA (flash, contiguous)", "batch": batch,
            "seq": seq, "block_size": None, "ms": ms,
            "TFLOPs": causal_flops(batch, seq, heads, d) / (ms * 1e-3) / 1e12}


def markdown(rows: list[dict], copy_bw: float, device: str) -> str:
    lines = [f"Device: {device}; device-to-device copy bandwidth {copy_bw / 1e9:.0f} GB/s", "",
             "| kind | backend | shape | block | ms | result |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['backend']} | {r.get('shape', '')} | | | "
                         f"error: {r['error']} |")
        elif r["kind"] == "decode":
            forced = " (forced)" if r.get("forced_splits") else ""
            lines.append(f"| decode | {r['backend']} | {r['batch']} x ctx {r['ctx']}, "
                         f"{r['heads']}/{r['kv_heads']} heads, {r['num_splits']} split(s)"
                         f"{forced}, tiles {tuple(r['tiles'])} | "
                         f"{r['block_size']} | {r['ms']:.4f} | {r['kv_GBps']:.0f} GB/s KV "
                         f"({100 * r['fraction_of_copy_bw']:.0f}% of copy, "
                         f"{100 * r['fraction_of_4.3TBps']:.0f}% of 4.3 TB/s) |")
        else:
            lines.append(f"| prefill | {r['backend']} | {r['batch']} x {r['seq']} causal | "
                         f"{r['block_size'] or '-'} | {r['ms']:.3f} | "
                         f"{r['TFLOPs']:.0f} TFLOP/s |")
    return "\n".join(lines)


def guarded(rows: list[dict], kind: str, backend: str, shape: str, fn: Callable[[], dict]):
    """Run one measurement; a missing or failing backend becomes an error row, not a crash."""
    try:
        rows.append(fn())
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the table
        traceback.print_exc()
        rows.append({"kind": kind, "backend": backend, "shape": shape,
                     "error": f"{type(exc).__name__}: {exc}"[:200]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON to this path")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block-sizes", default="16,32",
                        help="paged block sizes to measure (16 and the preferred size)")
    parser.add_argument("--split-sweep", default="",
                        help="also time decode with each of these forced split counts, e.g. 1,2,4,8")
    parser.add_argument("--tile-sweep", action="store_true",
                        help="also time decode for each (BLOCK_N, warps, stages) on batch 256")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA/ROCm GPU; nothing measured", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth(args.iters, args.warmup)
    rows: list[dict] = []
    block_sizes = [int(b) for b in args.block_sizes.split(",") if b]
    for block_size in block_sizes:
        for batch, ctx in ((64, 4096), (8, 512)):
            guarded(rows, "decode", "TRITON_ATTN", f"{batch}x{ctx}",
                    lambda b=batch, c=ctx, bs=block_size: bench_decode(args, b, c, bs, copy_bw))
    for splits in [int(n) for n in args.split_sweep.split(",") if n]:
        for batch, ctx in ((64, 4096), (8, 512), (8, 4096), (1, 2048)):
            guarded(rows, "decode", "TRITON_ATTN", f"{batch}x{ctx}/{splits}",
                    lambda b=batch, c=ctx, n=splits: bench_decode(args, b, c, 16, copy_bw, n))
    if args.tile_sweep:
        for tiles in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
            for batch, ctx, heads in ((256, 512, 32), (256, 512, 16), (64, 4096, 32)):
                guarded(rows, "decode", "TRITON_ATTN", f"{batch}x{ctx}/{heads} {tiles}",
                        lambda b=batch, c=ctx, h=heads, t=tiles:
                        bench_decode(args, b, c, 16, copy_bw, heads=h, tiles=t))
    for block_size in block_sizes:
        guarded(rows, "prefill", "TRITON_ATTN", "4x4096",
                lambda bs=block_size: bench_prefill_triton(args, 4, 4096, bs))
    guarded(rows, "prefill", "torch SDPA", "4x4096", lambda: bench_prefill_sdpa(args, 4, 4096))
    print(markdown(rows, copy_bw, device))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "copy_bandwidth_Bps": copy_bw, "rows": rows}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
