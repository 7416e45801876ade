"""Would the embedded GGUF model decode faster on a CPU if its int4 weights stayed packed?

archserve expands GGUF weights to dense float32 at load on CPUs. This times one decode
step's linear layers (the embedded model's shapes, all layers) three ways, with the
torch kernels a CPU has:
  dense: float32 weight, ``x @ w.T`` (what archserve runs);
  int4pack: torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``, group 32, a scale
    and an offset per group, as Q4_1 stores them);
  dequantize per call: uint8 nibbles times scale plus offset, then the matmul.
The values are random (timing does not depend on them).

    python3 benchmarks/cpu_gguf_kept_quantized.py [--rows 4] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from archserve.loader.default_model import default_model_path
from archserve.loader.loader import load_model_config

GROUP = 32


def ms_per_call(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e3


def layer_shapes(cfg) -> dict[str, tuple[int, int]]:
    kv = cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (cfg.num_heads * cfg.head_dim + 2 * kv, cfg.hidden_size),
            "o": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down": (cfg.hidden_size, cfg.intermediate_size)}


def time_shape(n: int, k: int, rows: int, iters: int) -> dict[str, float]:
    x = torch.randn(rows, k)
    dense = torch.randn(n, k)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale, offset = torch.rand(k // GROUP, n) * 0.01, torch.rand(k // GROUP, n) * 0.01
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = torch.stack([scale, offset], -1).contiguous()
    nibbles = q.to(torch.uint8).view(n, k // GROUP, GROUP)
    s3, o3 = scale.t().unsqueeze(-1), offset.t().unsqueeze(-1)
    return {
        "dense": ms_per_call(lambda: x @ dense.t(), iters),
        "int4pack": ms_per_call(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed, GROUP, scales_and_zeros), iters),
        "dequantize per call": ms_per_call(
            lambda: x @ (nibbles.float() * s3 + o3).view(n, k).t(), iters),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4, help="sequences in the decode step")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, _ = load_model_config(default_model_path())
    totals = {"dense": 0.0, "int4pack": 0.0, "dequantize per call": 0.0}
    print(f"{cfg.architecture}, {cfg.num_layers} layers, {args.rows} rows, "
          f"{torch.get_num_threads()} threads; ms per layer")
    for name, (n, k) in layer_shapes(cfg).items():
        row = time_shape(n, k, args.rows, args.iters)
        for key, value in row.items():
            totals[key] += value
        print(f"  {name:8s} {n}x{k}: " + ", ".join(f"{k_} {v:.3f}" for k_, v in row.items()))
    print("one step's linears (x layers), ms: " + ", ".join(
        f"{k_} {v * cfg.num_layers:.1f}" for k_, v in totals.items()))


if __name__ == "__main__":
    main()
