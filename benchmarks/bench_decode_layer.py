"""Time one decoder layer's launches at batch-1 decode, with each fusion on and off.

    python benchmarks/bench_decode_layer.py --models qwen3-0.6b,llama-3-8b \
        --configs unfused,all --out OUT/decode_layer.json

For each model shape (benchmarks/models/<name>/config.json, dummy bf16 weights) it builds
--layers decoder layers (distinct weights, so a layer's weights are not read from L2 as a
single repeated layer's would be), one sequence of --context tokens in a paged cache, the
engine's attention (TRITON_ATTN) and its decode GEMM route (TRITON_SKINNY_GEMM, tuned or
read from the tuning cache at batch 1). Each config then gets:

- µs per layer: a CUDA graph of the whole stack, replayed (median), divided by --layers;
- launches per layer: kernels in a torch.profiler trace of one eager pass over the stack
  (with the decode graph scope held, so the same kernels run), divided by --layers, and
  the kernel names of one layer.

A config is a '+'-joined list of the fusions it turns on (``unfused``: none; ``all``: every
fusion in archserve.kernels.elementwise.FUSIONS that a forward decides, ``TOGGLED``); the
others are listed in ARCHSERVE_DISABLE_FUSIONS while it runs, exactly as a user would
switch them off. ``fold_norm_weights`` is decided when the weights load, and this script
builds its layers once, unfolded: it is always off here (bench with the engine for it).

``--device cpu`` is a smoke run of this script, not a measurement: the fusions run on CUDA
only, the attention kernel needs TRITON_INTERPRET=1, one eager pass is timed and no kernel
is counted. It goes through the same build and forward, so an argument or API error shows
here and not on the GPU:

    TRITON_INTERPRET=1 python benchmarks/bench_decode_layer.py --device cpu --models \
        qwen3-0.6b --configs unfused,all --layers 1 --context 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # runnable from a plain checkout

import torch  # noqa: E402

from archserve.kernels.elementwise import DISABLE_FUSIONS_ENV, FUSIONS  # noqa: E402

TOGGLED = [name for name in FUSIONS if name != "fold_norm_weights"]


def fusions_of(config: str) -> set[str]:
    if config == "unfused":
        return set()
    if config == "all":
        return set(TOGGLED)
    names = set(config.split("+"))
    unknown = names - set(TOGGLED)
    if unknown:
        raise SystemExit(f"unknown fusion(s) {sorted(unknown)}; known: {', '.join(TOGGLED)}")
    return names


class LayerStack(torch.nn.Module):
    """``layers`` decoder layers of one model, run as the model runs them."""

    def __init__(self, config, layers: int) -> None:
        super().__init__()
        from archserve.models.llama import LlamaDecoderLayer
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(layers))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden, residual


def build(model_dir: Path, layers: int, context: int, block_size: int, device: str = "cuda"):
    """(stack, forward inputs, forward context) on ``device``, bf16, dummy weights."""
    from archserve.engine.decode_gemms import install_linear_route
    from archserve.engine.kv_cache import model_kv_caches
    from archserve.kernels.attention.interface import AttentionMetadata
    from archserve.kernels.attention.triton_backend import TritonAttentionImpl
    from archserve.loader.dummy import initialize_dummy_weights
    from archserve.loader.loader import load_model_config
    from archserve.models.layers.forward_context import ForwardContext
    from archserve.platform import detect

    config, _ = load_model_config(str(model_dir))
    if not 1 <= layers <= config.num_layers:
        raise SystemExit(f"--layers {layers}: the model has {config.num_layers}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            stack = LayerStack(config, layers)
    finally:
        torch.set_default_dtype(previous)
    initialize_dummy_weights(stack)
    info = detect()
    route = install_linear_route(info, stack, torch.bfloat16, [1])
    blocks = -(-(context + 1) // block_size)
    caches = model_kv_caches(config, blocks, block_size, torch.bfloat16, torch.device(device))
    for cache in caches:   # a context of random keys and values, as a real one would hold
        cache.normal_()
    table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    meta = AttentionMetadata.from_lengths([1], [context + 1], table,
                                          torch.tensor([context], device=device), device)
    ctx = ForwardContext(meta, caches, TritonAttentionImpl(info))
    positions = torch.tensor([context], device=device)
    hidden = torch.randn(1, config.hidden_size, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(hidden)
    return stack, (positions, hidden, residual), ctx, route


def launches(run, layers: int) -> tuple[float, list[str]]:
    """(kernels per layer, the kernel names of the second layer) from one eager pass."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    # Copies and fills count: each is a node of the decode graph as a kernel is.
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    per_layer = len(kernels) / layers
    names = [e.name for e in sorted(kernels, key=lambda e: e.time_range.start)]
    step = len(names) // layers if layers else 0
    return per_layer, names[step:2 * step]


def time_config(stack, inputs, ctx, fusions: set[str], layers: int, iters: int,
                cuda: bool = True) -> dict:
    from archserve.kernels.linear.skinny_choice import decode_graph_scope
    from archserve.models.layers.forward_context import set_forward_context

    os.environ[DISABLE_FUSIONS_ENV] = ",".join(sorted(set(FUSIONS) - fusions))

    def run():
        with set_forward_context(ctx):
            return stack(*inputs)

    with torch.inference_mode(), decode_graph_scope():
        run()   # compiles every kernel before the profile and the capture
        if cuda:
            from archserve.kernels.cuda_timing import graph_median_us
            per_layer, names = launches(run, layers)
            us, how = graph_median_us(run, iters, warmup=2, reps=1)
        else:   # the smoke run: no kernels to count, one eager pass timed
            t0 = time.perf_counter()
            run()
            per_layer, names, us, how = 0.0, [], (time.perf_counter() - t0) * 1e6, "eager cpu"
    return {"fusions": sorted(fusions), "us_per_layer": us / layers, "timed_as": how,
            "launches_per_layer": per_layer, "kernels_of_one_layer": names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,llama-3-8b",
                    help="directories under benchmarks/models (or paths) holding config.json")
    ap.add_argument("--configs", default="unfused," + ",".join(TOGGLED) + ",all",
                    help="comma-separated; each 'unfused', 'all' or fusions joined by '+'")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a smoke run of the script (see the module doc), not a timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    # Unfolded layers: the decode tuner then times the norm prologue in that form too.
    os.environ[DISABLE_FUSIONS_ENV] = "fold_norm_weights"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --device cpu for a smoke run)")
    configs = args.configs.split(",")
    for config in configs:   # before any model is built: a typo costs no device time
        fusions_of(config)
    results = []
    for name in args.models.split(","):
        model_dir = Path(name) if Path(name).is_dir() else ROOT / "benchmarks" / "models" / name
        stack, inputs, ctx, route = build(model_dir, args.layers, args.context, args.block_size,
                                          args.device)
        print(f"{name}: {args.layers} layers, context {args.context}; "
              f"{route.reason if route else 'linear route not tuned'}")
        for config in configs:
            row = {"model": name, "config": config,
                   **time_config(stack, inputs, ctx, fusions_of(config), args.layers,
                                 args.iters, args.device == "cuda")}
            results.append(row)
        del stack, inputs, ctx
        if args.device == "cuda":
            torch.cuda.empty_cache()
    os.environ.pop(DISABLE_FUSIONS_ENV, None)

    print(f"\n{'model':<14} {'config':<40} {'us/layer':>9} {'launches/layer':>15}")
    for row in results:
        print(f"{row['model']:<14} {row['config']:<40} {row['us_per_layer']:>9.2f} "
              f"{row['launches_per_layer']:>15.1f}")
    for row in results:
        counts = Counter(name[:60] for name in row["kernels_of_one_layer"])
        print(f"\n{row['model']} / {row['config']}: one layer's kernels")
        for kernel, n in counts.items():
            print(f"  {n} x {kernel}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results},
                                             indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
