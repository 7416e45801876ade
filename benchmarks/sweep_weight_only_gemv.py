"""Sweep the weight-only GEMV's launch (tile width, packed rows per tile, K splits, warps)
at one row on Llama-3-8B's int4 group-128 shapes, beside the default config and cuBLAS bf16.

The question it answers: how many bytes must be in flight for the GEMV to stream the packed
weight near the GPU's bandwidth. Each config is timed as CUDA-graph replays cycling through
enough weight copies that L2 cannot hold them (as bench_quant_gemm does).

    python3 benchmarks/sweep_weight_only_gemv.py [--shapes o,down,gate_up] [--rows 1]
        [--out F.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_quant_gemm import L2_BYTES, SHAPES, int_group, time_cycled, weight_bytes  # noqa: E402

from archserve.kernels.linear.triton_weight_only import (  # noqa: E402
    WeightOnlyConfig,
    default_config,
    weight_only_gemm,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="o,down,gate_up")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        one = int_group(n, k, 4, 128, False)
        weights = [one] + [int_group(n, k, 4, 128, False)
                           for _ in range(max(1, L2_BYTES // weight_bytes(one)) - 1)]
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                 for _ in range(max(1, L2_BYTES // (2 * n * k)))]
        cublas = time_cycled(lambda a, w: F.linear(a, w), dense, x, args.iters)
        default = default_config(args.rows, n, k, one)
        timed = []
        for block_n, packed, split, warps in itertools.product(
                (32, 64, 128), (16, 32, 64), (1, 2, 4, 8, 16, 32), (4, 8)):
            config = WeightOnlyConfig(True, block_n, packed * 8, warps, split_k=split)
            if k // split < config.block_k:
                continue
            try:
                us = time_cycled(lambda a, w, c=config: weight_only_gemm(a, w, None, c),
                                 weights, x, args.iters)
            except Exception as exc:  # noqa: BLE001 - a config that fails is reported
                print(f"{shape} {config.key()} failed: {type(exc).__name__}", flush=True)
                continue
            timed.append((us, config.key()))
        timed.sort()
        default_us = time_cycled(
            lambda a, w, default=default: weight_only_gemm(a, w, None, default), weights,
            x, args.iters)
        gbs = weight_bytes(one) / 1e3
        print(f"{shape} {n}x{k} rows {args.rows}: cuBLAS bf16 {cublas:.1f} us; default "
              f"{default.key()} {default_us:.1f} us ({gbs / default_us:.0f} GB/s)")
        for us, key in timed[:8]:
            print(f"    {key:28s} {us:7.1f} us {gbs / us:6.0f} GB/s")
        results.append(dict(shape=shape, rows=args.rows, cublas_us=cublas,
                            default=default.key(), default_us=default_us,
                            timed=[dict(config=key, us=us) for us, key in timed]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
