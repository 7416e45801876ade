"""The fused MoE's small-batch tiles on real expert shapes: every pair-layout combination of
a gate/up kernel and a down kernel, timed as the start-up tuner times them.

The tuner (kernels/moe/tuning.py) times only ``candidate_tiles``, a few per batch, because
each is compiled at the first start. This sweep times many more, with the tuner's own
timer (a CUDA graph of calls that each route differently, on dummy bf16 experts of the
model's shape), so the candidates can be chosen from measurements: gate/up as the tl.dot
kernel at each pair-tile width, or as CUDA-core GEMVs of (columns, K step); down as the
tl.dot kernel plus the slot sum, or as the slot-summing GEMV of (columns, K step). Each
result is checked against the default tile first. Prints µs per call, fastest first.

    python3 benchmarks/bench_moe_tiles.py [--models qwen3-30b-a3b,deepseek-v2-lite]
        [--tokens 1,2] [--out F.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from archserve.bench.report import write_json  # noqa: E402
from archserve.kernels.moe.triton_fused_moe import (  # noqa: E402
    PAIR_TILE_BLOCK_NS,
    candidate_tiles,
    choose_tile,
    fused_moe,
    pair_tile,
)
from archserve.kernels.moe.tuning import MoEShape, _graph_us, _inputs  # noqa: E402

# experts (routed + shared, stacked as the engine stacks them), top-k slots (with the
# shared ones), hidden, expert intermediate
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (66, 8, 2048, 1408),
          "mixtral-8x7b": (8, 2, 4096, 14336)}
GATE_UP_GEMVS = ((1, 512), (1, 1024), (1, 2048), (2, 512), (2, 1024), (4, 256), (4, 512),
                 (8, 128), (8, 256))
SUM_DOWNS = ((1, 1024), (1, 2048), (2, 256), (2, 512), (2, 1024), (4, 64), (4, 128),
             (4, 256), (4, 512), (8, 128), (8, 256))


def sweep_tiles(tokens: int, top_k: int, w13: torch.Tensor, w2: torch.Tensor) -> list:
    """The tuner's candidates, then every pair-layout combination not among them."""
    default = choose_tile(tokens, top_k, w13, w2)
    tiles = candidate_tiles(tokens, top_k, w13, w2)
    if not default.pair_rows:
        return tiles
    narrowest = min(w13.shape[1] // 2, w13.shape[2])
    sms = torch.cuda.get_device_properties(w13.device).multi_processor_count
    gate_ups = [pair_tile(tokens * top_k, narrowest, sms, n) for n in PAIR_TILE_BLOCK_NS]
    gate_ups += [dataclasses.replace(default, gate_up_block_n=n, gate_up_block_k=k)
                 for n, k in GATE_UP_GEMVS]
    downs = [(0, 0)] + (list(SUM_DOWNS) if top_k > 1 else [])
    for gate_up in gate_ups:
        for n, k in downs:
            tiles.append(dataclasses.replace(gate_up, down_block_n=n, down_block_k=k))
    return list(dict.fromkeys(tiles))


def sweep(name: str, tokens_list: list[int], device: torch.device) -> list[dict]:
    experts, top_k, hidden, inter = SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device,
                      dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, generator=gen, device=device,
                     dtype=torch.bfloat16) * 0.02
    shape = MoEShape([], w13, w2, top_k, renormalize=True)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    rows = []
    for tokens in tokens_list:
        tiles = sweep_tiles(tokens, top_k, w13, w2)
        x, logits = _inputs(shape, tokens)
        expected = fused_moe(x, logits, w13, w2, top_k, True, tiles[0]).float()
        candidates = {t.key() for t in candidate_tiles(tokens, top_k, w13, w2)}
        results = []
        for tile in tiles:
            row = {"model": name, "tokens": tokens, "tile": tile.key(),
                   "tuner_candidate": tile.key() in candidates}
            try:
                got = fused_moe(x, logits, w13, w2, top_k, True, tile).float()
                if not torch.allclose(got, expected, rtol=2e-2,
                                      atol=2e-2 * expected.abs().max()):
                    row["error"] = "disagrees with the default"
                else:
                    row["us"] = _graph_us(shape, tokens, tile)
            except Exception as exc:  # noqa: BLE001 - a tile that fails is reported
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            results.append(row)
        timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
        # the bytes of the distinct experts a call reads at most (pairs <= experts)
        touched = min(tokens * top_k, experts) * expert_bytes
        print(f"\n{name}, {tokens} token(s): {len(timed)} of {len(results)} tiles timed "
              f"(default {tiles[0].key()}); * = a tuner candidate")
        for r in timed[:12] + [r for r in timed[12:] if r["tile"] == tiles[0].key()]:
            print(f"  {r['us']:8.2f} µs  {touched / r['us'] / 1e3:7.0f} GB/s  "
                  f"{'*' if r['tuner_candidate'] else ' '} {r['tile']}")
        for r in results:
            if "error" in r:
                print(f"  failed: {r['tile']}: {r['error']}")
        rows += results
    del w13, w2, shape
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite")
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = [row for name in args.models.split(",") for row in sweep(name, tokens, device)]
    if args.out:
        write_json({"device": torch.cuda.get_device_name(device), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
