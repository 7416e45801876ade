"""The persistent MLP kernel against the graph of separate kernels it would replace (issue 21).

    python benchmarks/bench_persistent_mlp.py --rows 1,4 --out OUT/persistent_mlp.json

For each small model's MLP shape (hidden x intermediate, bf16, distinct dummy weights per
layer so that nothing is read from L2 the way one repeated layer would be) a chain of
--layers MLP blocks (residual add, RMSNorm, gate/up, silu * up, down), as a decode step
chains them, is captured in one CUDA graph and replayed; the median per layer is the row.
The forms (programmatic dependent launch as the engine sets it: on by default on SM90+):

- ``persistent``: kernels/linear/triton_persistent_mlp.py, one launch per block;
- ``separate``: the RMSNorm kernel, the gate/up skinny GEMV with silu * up in its
  epilogue, the down skinny GEMV: the engine's route where the tuner gives both GEMVs to
  Triton (each GEMV's skinny config timed alone first, the fastest kept);
- ``prologue``: the norm in the gate/up GEMV's prologue, then the down GEMV (the engine's
  ``rms_norm_gemm`` fusion where it timed faster);
- ``cublas``: the RMSNorm kernel, cuBLAS gate/up, the silu * up kernel, cuBLAS down.

Each row also gives the floor (the block's weight bytes at the measured copy bandwidth).
``--device cpu`` (with TRITON_INTERPRET=1) is a smoke run of the script at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runnable from a checkout

import torch  # noqa: E402

SHAPES = {"qwen3-0.6b": (1024, 3072, 28), "qwen3-1.7b": (2048, 6144, 28),
          "llama-3.2-1b": (2048, 8192, 16)}
TINY = {"tiny": (96, 300, 2)}


def build(hidden: int, inter: int, layers: int, rows: int, device: torch.device):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16)

    weights = [(1 + rand(hidden, scale=0.1), rand(2 * inter, hidden, scale=hidden ** -0.5),
                rand(hidden, inter, scale=inter ** -0.5)) for _ in range(layers)]
    return rand(rows, hidden, scale=1.0), rand(rows, hidden, scale=1.0), weights


def forms(rows: int, device: torch.device, weights, x):  # noqa: ANN001, ANN201
    """name -> one block's function (h, r, norm_w, w13, w2) -> (h, r)."""
    import torch.nn.functional as F

    from archserve.kernels.elementwise.dispatch import rms_norm, silu_and_mul
    from archserve.kernels.linear.triton_persistent_mlp import persistent_mlp
    from archserve.kernels.linear.triton_skinny_gemm import (
        candidate_configs,
        rms_norm_skinny_gemm,
        skinny_gemm,
    )

    norm_w, w13, w2 = weights[0]
    act = torch.zeros(rows, w2.shape[1], dtype=x.dtype, device=device)
    gate_up = best_config(lambda c: skinny_gemm(x, w13, None, c, silu_mul=True),
                          candidate_configs(rows), device)
    down = best_config(lambda c: skinny_gemm(act, w2, None, c), candidate_configs(rows), device)

    def separate(h, r, norm_w, w13, w2):  # noqa: ANN001, ANN202
        normed, r = rms_norm(h, norm_w, 1e-6, r)
        return skinny_gemm(skinny_gemm(normed, w13, None, gate_up, silu_mul=True), w2, None,
                           down), r

    def prologue(h, r, norm_w, w13, w2):  # noqa: ANN001, ANN202
        a, r = rms_norm_skinny_gemm(h, r, norm_w, 1e-6, w13, None, gate_up, silu_mul=True)
        return skinny_gemm(a, w2, None, down), r

    def cublas(h, r, norm_w, w13, w2):  # noqa: ANN001, ANN202
        normed, r = rms_norm(h, norm_w, 1e-6, r)
        return F.linear(silu_and_mul(F.linear(normed, w13)), w2), r

    def persistent(h, r, norm_w, w13, w2):  # noqa: ANN001, ANN202
        return persistent_mlp(h, r, norm_w, 1e-6, w13, w2)

    configs = {"gate_up": gate_up.key(), "down": down.key()}
    return {"persistent": persistent, "separate": separate, "prologue": prologue,
            "cublas": cublas}, configs


def best_config(run, configs, device: torch.device):  # noqa: ANN001, ANN201
    if device.type != "cuda":
        return configs[0]
    from archserve.kernels.cuda_timing import graph_median_us
    return min(configs, key=lambda c: graph_median_us(lambda: run(c), 50)[0])


def time_chain(block, x, residual, weights, device: torch.device, iters: int):  # noqa: ANN001
    def chain() -> torch.Tensor:
        h, r = x, residual
        for w in weights:
            h, r = block(h, r, *w)
        return h

    if device.type != "cuda":
        chain()
        return float("nan"), chain()
    from archserve.kernels.cuda_timing import graph_median_us
    us, how = graph_median_us(chain, iters, reps=1)
    assert how == "graph", "the chain must replay as a graph"
    return us / len(weights), chain()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    shapes = TINY if device.type == "cpu" else {s: SHAPES[s] for s in args.shapes.split(",")}
    copy_bytes_per_s = None
    if device.type == "cuda":
        from archserve.engine.ceilings import load_or_measure
        copy_bytes_per_s = load_or_measure(device).copy_bytes_per_s
    from archserve.kernels.linear.triton_persistent_mlp import barrier_gave_up

    results = []
    for name, (hidden, inter, layers) in shapes.items():
        for rows in (int(r) for r in args.rows.split(",")):
            x, residual, weights = build(hidden, inter, layers, rows, device)
            blocks, configs = forms(rows, device, weights, x)
            floor_us = (3 * hidden * inter * 2 / copy_bytes_per_s * 1e6
                        if copy_bytes_per_s else float("nan"))
            row = {"shape": name, "hidden": hidden, "intermediate": inter, "layers": layers,
                   "rows": rows, "floor_us": floor_us, "skinny_configs": configs, "us": {}}
            outs = {}
            for form, block in blocks.items():
                row["us"][form], outs[form] = time_chain(block, x, residual, weights, device,
                                                        args.iters)
            row["barrier_gave_up"] = barrier_gave_up(device)
            row["max_diff_vs_separate"] = (outs["persistent"].float()
                                           - outs["separate"].float()).abs().max().item()
            results.append(row)
            timings = ", ".join(f"{form} {us:.2f}" for form, us in row["us"].items())
            print(f"{name:13s} rows {rows}: µs per layer {timings}; floor {floor_us:.2f}; "
                  f"max |persistent - separate| {row['max_diff_vs_separate']:.3g}"
                  f"{'; BARRIER GAVE UP' if row['barrier_gave_up'] else ''}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
