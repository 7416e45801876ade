"""Decode-sized GEMMs: cuBLAS (torch.nn.functional.linear) against the Triton skinny GEMM.

For each weight shape of Llama-3-8B and Qwen3-0.6B and each row count (a decode batch),
times cuBLAS and every Triton tile in a sweep, as CUDA-graph replays that cycle through
enough copies of the weight (>= 256 MB in all) that L2 cannot hold them, as a decode
step's layers do. Prints µs and the achieved bandwidth (weight bytes / time); --out
writes the same as JSON. The engine's own choice (skinny_choice.candidate_configs) is a
subset of this sweep, picked from its results.

    python3 benchmarks/bench_skinny_gemm.py [--rows 1,2,4,8] [--iters 10] [--configs K,..]
        [--shapes 8b.qkv,..] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from archserve.kernels.cuda_timing import graph_median_us  # noqa: E402
from archserve.kernels.linear.triton_skinny_gemm import (  # noqa: E402
    SkinnyConfig,
    candidate_configs,
    skinny_gemm,
)

SHAPES = {  # name: (out_features, in_features)
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096),
    "8b.down": (4096, 14336), "8b.lm_head": (128256, 4096),
    "0.6b.qkv": (4096, 1024), "0.6b.o": (1024, 2048), "0.6b.gate_up": (6144, 1024),
    "0.6b.down": (1024, 3072), "0.6b.lm_head": (151936, 1024),
}
LAYERS = {"8b": 32, "0.6b": 28}


def sweep_configs(rows: int) -> list[SkinnyConfig]:
    block_m = 1 << (rows - 1).bit_length()
    configs = []
    for bn in (2, 4, 8, 16, 32):
        for bk in (128, 256, 512, 1024):
            tile = bn * bk
            if tile < 512 or tile * block_m > 16384:
                continue
            configs.append(SkinnyConfig(bn, bk, 4))
            if tile * block_m >= 8192:
                configs.append(SkinnyConfig(bn, bk, 8))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--configs", help="config keys to time (e.g. n2_k1024_w4,n1_k2048_w8) "
                                          "instead of the built-in sweep")
    parser.add_argument("--out")
    args = parser.parse_args()
    dtype, dev = torch.bfloat16, torch.device("cuda")
    results = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(1, min(32, -(-(256 << 20) // nbytes)))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device=dev, dtype=dtype)

            def per_call(gemm):
                us, _ = graph_median_us(lambda: [gemm(w) for w in weights], args.iters,
                                        warmup=2, reps=1)
                return us / copies

            ref = F.linear(x, weights[0]).float()
            row = {"shape": name, "n": n, "k": k, "rows": rows, "copies": copies,
                   "cublas_us": per_call(lambda w: F.linear(x, w)), "triton": {}}
            engine_keys = {c.key() for c in candidate_configs(rows)}
            configs = ([SkinnyConfig.from_key(c) for c in args.configs.split(",")]
                       if args.configs else sweep_configs(rows))
            for config in configs:
                got = skinny_gemm(x, weights[0], None, config).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                us = per_call(lambda w, c=config: skinny_gemm(x, w, None, c))
                row["triton"][config.key()] = {"us": us, "rel_err": err,
                                               "engine_candidate": config.key() in engine_keys}
            best = min(row["triton"], key=lambda c: row["triton"][c]["us"])
            row["best"] = best
            tb = lambda us: nbytes / us / 1e6  # noqa: E731 - TB/s from µs
            print(f"{name:13s} rows {rows}: cuBLAS {row['cublas_us']:7.2f} µs "
                  f"({tb(row['cublas_us']):.2f} TB/s)  best Triton {best:14s} "
                  f"{row['triton'][best]['us']:7.2f} µs ({tb(row['triton'][best]['us']):.2f} TB/s)"
                  f"  err {row['triton'][best]['rel_err']:.1e}", flush=True)
            results.append(row)
        del weights
        torch.cuda.empty_cache()
    # Per-model decode step: layers x (qkv + o + gate_up + down) + lm_head, both ways.
    for model, layers in LAYERS.items():
        for rows in sorted({r["rows"] for r in results}):
            mine = [r for r in results if r["shape"].startswith(model + ".") and r["rows"] == rows]
            if len(mine) != 5:
                continue
            mult = lambda r: 1 if r["shape"].endswith("lm_head") else layers  # noqa: E731
            cublas = sum(mult(r) * r["cublas_us"] for r in mine)
            best = sum(mult(r) * min(r["cublas_us"], r["triton"][r["best"]]["us"]) for r in mine)
            print(f"{model} rows {rows}: GEMMs per step cuBLAS {cublas / 1e3:.3f} ms, "
                  f"best of both {best / 1e3:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
