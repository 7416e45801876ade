"""Decode-sized GEMMs: cuBLAS (torch.nn.functional.linear) against the Triton skinny GEMM.

For each weight shape of Llama-3-8B and Qwen3-0.6B and each row count (a decode batch),
times cuBLAS and every Triton tile in a sweep with the engine's own timing routine
(``skinny_choice.time_shape``): CUDA-graph replays cycling through enough copies of the
weight (>= 256 MB in all) that L2 cannot hold them, as a decode step's layers do. A
"+silu" shape is the gate/up GEMM followed by silu(gate) * up: cuBLAS then the SiLU
kernel, against the Triton kernel with the SiLU in its epilogue ("n.._k.._w..") and the
Triton GEMV then the SiLU kernel ("unfused:n.._k.._w.."). Prints µs and the achieved
bandwidth (weight bytes / time); --out writes the timings as JSON. The engine's candidate
configs (triton_skinny_gemm._CANDIDATE_TILES) were picked from this sweep's results at one
row; --candidates times those instead of the sweep (the start-up tuner's choice per row
count, from 1 to 16 rows: a speculative verification step's).

    python3 benchmarks/bench_skinny_gemm.py [--rows 1,2,4,8] [--iters 10] [--configs K,..]
        [--candidates] [--shapes 8b.qkv,..] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from archserve.kernels.linear.skinny_choice import (  # noqa: E402
    LINEAR,
    SILU_MUL,
    time_shape,
    triton_choices,
)
from archserve.kernels.linear.triton_skinny_gemm import (  # noqa: E402
    SkinnyConfig,
    candidate_configs,
)

SHAPES = {  # name: (out_features, in_features); "+silu": the GEMM then silu(gate) * up
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096),
    "8b.gate_up+silu": (28672, 4096), "8b.down": (4096, 14336), "8b.lm_head": (128256, 4096),
    "0.6b.qkv": (4096, 1024), "0.6b.o": (1024, 2048), "0.6b.gate_up": (6144, 1024),
    "0.6b.gate_up+silu": (6144, 1024), "0.6b.down": (1024, 3072),
    "0.6b.lm_head": (151936, 1024),
    # the MoE models' dense GEMVs (their batch-1 rows)
    "q3moe.qkv": (5120, 2048), "q3moe.o": (2048, 4096), "q3moe.router": (128, 2048),
    "v2lite.q": (3072, 2048), "v2lite.kv_a": (576, 2048), "v2lite.o": (2048, 2048),
}
STEP = ("qkv", "o", "gate_up+silu", "down", "lm_head")  # the GEMMs of one decode step
LAYERS = {"8b": 32, "0.6b": 28}


def sweep_configs(rows: int) -> list[str]:
    keys = []
    if rows == 1:   # [BLOCK_N, BLOCK_K] sums: tiles of 512-8192 values
        for bn in (1, 2, 4, 8, 16):
            for bk in (256, 512, 1024, 2048):
                tile = bn * bk
                if tile < 512 or tile > 8192:
                    continue
                keys.append(SkinnyConfig(bn, bk, 4).key())
                if tile >= 4096:
                    keys.append(SkinnyConfig(bn, bk, 8).key())
        return keys
    # More rows: BLOCK_K one or two 16-byte vectors a thread (no layout conversion in the
    # K loop), at most 64 sums a thread (BLOCK_M x BLOCK_N x vectors).
    block_m = 1 << (rows - 1).bit_length()
    for warps in (1, 2, 4, 8):
        for vectors in (1, 2):
            bk = 8 * 32 * warps * vectors
            for bn in (1, 2, 4, 8):
                if bk <= 4096 and block_m * bn * vectors <= 64:
                    keys.append(SkinnyConfig(bn, bk, warps).key())
    if rows >= 4:   # the tensor cores' form (rows padded to 16)
        keys += [SkinnyConfig(bn, bk, warps, mma=True).key()
                 for bn, bk, warps in ((16, 128, 2), (16, 256, 4), (32, 128, 4), (32, 256, 4),
                                       (64, 128, 4), (64, 128, 8))]
    return keys


def configs_at(rows: int, configs: list[str] | None, engine: bool) -> list[str]:
    """The configs timed at ``rows``: those given, the engine's candidates, or the sweep."""
    if configs:
        return configs
    return [c.key() for c in candidate_configs(rows)] if engine else sweep_configs(rows)


def time_one(name: str, rows: int, configs: list[str], iters: int) -> dict:
    n, k = SHAPES[name]
    kind = SILU_MUL if name.endswith("+silu") else LINEAR
    nbytes = n * k * 2
    copies = max(1, min(32, -(-(256 << 20) // nbytes)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    t = time_shape(kind, rows, weights, iters, triton_choices(kind, configs))
    best = min(t.triton_us, key=t.triton_us.get) if t.triton_us else None
    tb = lambda us: nbytes / us / 1e6  # noqa: E731 - TB/s from µs
    line = f"{name:17s} rows {rows}: cuBLAS {t.cublas_us:7.2f} µs ({tb(t.cublas_us):.2f} TB/s)"
    if best is not None:
        line += (f"  best Triton {best:22s} {t.triton_us[best]:7.2f} µs "
                 f"({tb(t.triton_us[best]):.2f} TB/s)")
    print(line + (f"  [{t.note.strip()}]" if t.note else ""), flush=True)
    return {"shape": name, "n": n, "k": k, "rows": rows, "copies": copies,
            "cublas_us": t.cublas_us, "triton_us": t.triton_us, "best": best, "note": t.note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--configs", help="config keys to time (e.g. n2_k1024_w4,n1_k2048_w8) "
                                          "instead of the built-in sweep")
    parser.add_argument("--candidates", action="store_true",
                        help="time the engine's candidate configs at each row count (what the "
                             "start-up tuner times) instead of the sweep")
    parser.add_argument("--out")
    args = parser.parse_args()
    configs = args.configs.split(",") if args.configs else None
    # Row count by row count, each one's decode-step sums printed as soon as its shapes
    # are timed (a run cut short keeps the rows it finished).
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        mine = [time_one(name, rows, configs_at(rows, configs, args.candidates), args.iters)
                for name in args.shapes.split(",")]
        results += mine
        for model, layers in LAYERS.items():
            print_step(model, layers, rows, mine)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


def print_step(model: str, layers: int, rows: int, results: list[dict]) -> None:
    """The GEMMs of one decode step of ``model`` at ``rows`` rows, layers x (qkv + o +
    gate_up+silu + down) + lm_head, on cuBLAS and on the faster of each shape; nothing
    unless ``results`` hold all of them."""
    mine = [r for r in results if r["shape"] in {f"{model}.{s}" for s in STEP}]
    if len(mine) != len(STEP):
        return
    calls = [1 if r["shape"].endswith("lm_head") else layers for r in mine]
    cublas = sum(c * r["cublas_us"] for c, r in zip(calls, mine, strict=True))
    best = sum(c * min([r["cublas_us"], *r["triton_us"].values()])
               for c, r in zip(calls, mine, strict=True))
    print(f"{model} rows {rows}: GEMMs (+ SiLU) per step cuBLAS {cublas / 1e3:.3f} ms, "
          f"best of both {best / 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
