"""Fused elementwise kernels vs their torch-op references, per op and per decoder layer.

    python benchmarks/bench_elementwise.py --out results/elementwise.json

For the Qwen3-0.6B and Llama-3-8B shapes, at decode (T = 1..256) and prefill (T = 4096)
token counts, each op runs through the Triton route and the torch route of
archserve.kernels.elementwise. Times come from CUDA events around a CUDA graph of
--reps back-to-back calls (a decode step replays a graph, so launch gaps are counted as
they will be paid, not the Python overhead of eager launches); if capture fails, eager
timing is used and the row says so. GB/s counts the bytes each op must move at least.
The per-layer total counts what one decoder layer calls: two add+RMSNorms, the q/k norm
(Qwen3 only), one rotary and one SiLU*mul.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Runnable from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from archserve.kernels.cuda_timing import graph_median_us, median_ms  # noqa: E402
from archserve.kernels.elementwise import (  # noqa: E402
    apply_rotary,
    forced_fused_route,
    rms_norm,
    silu_and_mul,
)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_size: int
    intermediate: int
    layers: int
    qk_norm: bool


SHAPES = {
    "qwen3-0.6b": ModelShape(1024, 16, 8, 128, 3072, layers=28, qk_norm=True),
    "llama3-8b": ModelShape(4096, 32, 8, 128, 14336, layers=32, qk_norm=False),
}
# op -> calls per decoder layer
CALLS_PER_LAYER = {"add+rms_norm": 2, "q/k rms_norm": 1, "rotary": 1, "silu*mul": 1}


@dataclass
class OpCase:
    op: str
    bytes_moved: int
    run: Callable[[], object]


def op_cases(shape: ModelShape, tokens: int, dtype: torch.dtype) -> list[OpCase]:
    """One layer's elementwise calls on random activations of the model's shape."""
    elt = torch.tensor([], dtype=dtype).element_size()
    dev = "cuda"
    q_width, kv_width = shape.heads * shape.head_size, shape.kv_heads * shape.head_size
    x = torch.randn(tokens, shape.hidden, device=dev, dtype=dtype)
    residual = torch.randn_like(x)
    norm_weight = torch.rand(shape.hidden, device=dev, dtype=dtype) + 0.5
    qkv = torch.randn(tokens, q_width + 2 * kv_width, device=dev, dtype=dtype)
    q, k = qkv[:, :q_width], qkv[:, q_width:q_width + kv_width]
    head_weight = torch.rand(shape.head_size, device=dev, dtype=dtype) + 0.5
    positions = torch.randint(0, 4096, (tokens,), device=dev)
    cos = torch.rand(8192, shape.head_size // 2, device=dev)
    sin = torch.rand_like(cos)
    gate_up = torch.randn(tokens, 2 * shape.intermediate, device=dev, dtype=dtype)
    qk_elements = tokens * (q_width + kv_width)

    def qk_norm():
        rms_norm(q.view(tokens, -1, shape.head_size), head_weight, 1e-6)
        rms_norm(k.view(tokens, -1, shape.head_size), head_weight, 1e-6)

    cases = [
        OpCase("add+rms_norm", elt * (4 * x.numel() + shape.hidden),
               lambda: rms_norm(x, norm_weight, 1e-6, residual)),
        OpCase("rotary", elt * 2 * qk_elements + 4 * tokens * shape.head_size,
               lambda: apply_rotary(positions, q, k, cos, sin)),
        OpCase("silu*mul", elt * 3 * tokens * shape.intermediate,
               lambda: silu_and_mul(gate_up)),
    ]
    if shape.qk_norm:
        cases.insert(1, OpCase("q/k rms_norm", elt * (2 * qk_elements + 2 * shape.head_size),
                               qk_norm))
    return cases


def copy_bandwidth(iters: int, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / (median_ms(lambda: dst.copy_(src), iters) * 1e-3)


def measure(args, model: str, tokens: int, dtype: torch.dtype) -> list[dict]:
    rows = []
    for case in op_cases(SHAPES[model], tokens, dtype):
        row = {"model": model, "tokens": tokens, "op": case.op, "bytes": case.bytes_moved}
        for route in ("torch", "triton"):
            try:
                with forced_fused_route(route):
                    us, mode = graph_median_us(case.run, args.iters, args.warmup,
                                               args.reps if tokens <= 256 else 2)
                row[f"{route}_us"], row[f"{route}_timing"] = us, mode
            except Exception as exc:  # noqa: BLE001 - every failure is reported in the table
                traceback.print_exc()
                row[f"{route}_error"] = f"{type(exc).__name__}: {exc}"[:160]
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def _cell(row: dict, route: str) -> str:
    if f"{route}_error" in row:
        return f"error: {row[f'{route}_error']}"
    suffix = "" if row[f"{route}_timing"] == "graph" else " (eager)"
    return f"{row[f'{route}_us']:.2f}{suffix}"


def markdown(rows: list[dict], device: str, copy_bw: float, dtype: str) -> str:
    lines = [f"Device: {device}; {dtype}; device-to-device copy bandwidth "
             f"{copy_bw / 1e9:.0f} GB/s", "",
             "| model | T | op | torch µs | fused µs | speedup | fused GB/s | % of copy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "torch_us" in r and "triton_us" in r
        speedup = f"{r['torch_us'] / r['triton_us']:.1f}x" if ok else ""
        gbps = r["bytes"] / (r["triton_us"] * 1e-6) / 1e9 if "triton_us" in r else None
        lines.append(f"| {r['model']} | {r['tokens']} | {r['op']} | {_cell(r, 'torch')} | "
                     f"{_cell(r, 'triton')} | {speedup} | "
                     f"{'' if gbps is None else f'{gbps:.0f}'} | "
                     f"{'' if gbps is None else f'{100 * gbps * 1e9 / copy_bw:.0f}%'} |")
    lines += ["", "Per decoder layer (2 x add+rms_norm, q/k norm if any, rotary, silu*mul):", "",
              "| model | T | torch µs/layer | fused µs/layer | fused µs x layers |",
              "|---|---|---|---|---|"]
    for (model, tokens), group in _by_model_and_tokens(rows).items():
        if not all("torch_us" in r and "triton_us" in r for r in group):
            continue
        torch_us = sum(CALLS_PER_LAYER[r["op"]] * r["torch_us"] for r in group)
        fused_us = sum(CALLS_PER_LAYER[r["op"]] * r["triton_us"] for r in group)
        lines.append(f"| {model} | {tokens} | {torch_us:.1f} | {fused_us:.1f} | "
                     f"{fused_us * SHAPES[model].layers:.0f} |")
    return "\n".join(lines)


def _by_model_and_tokens(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["tokens"]), []).append(r)
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON to this path")
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated")
    parser.add_argument("--tokens", default="1,8,32,64,128,256,4096", help="comma-separated")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20,
                        help="calls per captured graph at decode sizes (T <= 256)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_elementwise: needs a CUDA/ROCm GPU; nothing measured", file=sys.stderr)
        return 2
    unknown = [m for m in args.models.split(",") if m not in SHAPES]
    if unknown:
        parser.error(f"unknown model shapes {unknown}; known: {', '.join(SHAPES)}")
    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth(args.iters)
    rows: list[dict] = []
    for model in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",") if t):
            rows += measure(args, model, tokens, dtype)
    print(markdown(rows, device, copy_bw, args.dtype))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "dtype": args.dtype, "copy_bandwidth_Bps": copy_bw,
                       "command": sys.argv, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
