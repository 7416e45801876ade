"""DeepSeek V4 speed on one GPU: DeepSeek-V4-Flash cut to four layers (compressed sparse,
heavily compressed, twice: benchmarks/models/deepseek-v4-4l) with dummy bf16 weights, on
TRITON_MLA_SPARSE_DSV4.

- ``--part engine``: batch-1 decode steps (one request, 64 output tokens; the step time is
  the trace's decode mean, beside its floor: the weights a step reads and the cache it
  reads, at the measured copy bandwidth) at contexts 2k, 32k and 128k, and the 32k / 2k
  ratio (target: at most 1.3);
- ``--part throughput``: 64 prompts of 8192 tokens with 128 outputs each, output tok/s and
  the decode step;
- ``--part cache``: the KV bytes a token of context costs at 2k, 32k and 128k (the window
  ring is one window's keys per sequence), V4-Flash's 43 layers against DeepSeek-V3's MLA
  and against plain multi-head attention of V4's heads.

    python3 benchmarks/deepseek_v4_perf.py [--part engine|throughput|cache|all]
        [--contexts N ...] [--out F.json]
    python3 benchmarks/deepseek_v4_perf.py --tiny      # CPU smoke run (tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sparse_mla_perf import _engine, _release, _run  # noqa: E402

from archserve.engine.ceilings import load_or_measure  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
V4_4L = os.path.join(HERE, "models", "deepseek-v4-4l")
FLASH_LAYERS = 43           # V4-Flash: 2 sliding-window-only layers, then CSA and HCA
V3_LAYERS = 61


@dataclass(frozen=True)
class Plan:
    path: str
    engine_dtype: str = "bfloat16"
    decode_contexts: tuple[int, ...] = (2048, 32768, 131072)
    decode_output: int = 64
    throughput: tuple[int, int, int] = (64, 8192, 128)


def tiny_plan(folder: str) -> Plan:
    """V4-4L shrunk (hidden 64, 8 heads of 48 with 16 rope channels, window 16, rates 4
    and 16, indexer 8 x 16, top-8) on the CPU."""
    with open(os.path.join(V4_4L, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, moe_intermediate_size=32, num_attention_heads=8,
                  head_dim=48, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
                  o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
                  index_n_heads=8, index_head_dim=16, index_topk=8, sliding_window=16,
                  vocab_size=256, max_position_embeddings=512,
                  layer_types=["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
                  compress_rates={"compressed_sparse_attention": 4,
                                  "heavily_compressed_attention": 16},
                  rope_scaling={**config["rope_scaling"], "original_max_position_embeddings": 64,
                                "factor": 4})
    del config["compress_ratios"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return Plan(path=folder, engine_dtype="float32", decode_contexts=(20, 100),
                decode_output=4, throughput=(2, 40, 4))


@dataclass(frozen=True)
class _EnginePlan:
    """What sparse_mla_perf's engine helpers read of a plan."""

    engine_dtype: str


def engine_rows(ceilings, plan: Plan, part: str, save) -> list[dict]:  # noqa: ANN001
    rows = []
    helper_plan = _EnginePlan(plan.engine_dtype)
    if part == "engine":
        longest = max(plan.decode_contexts) + plan.decode_output + 64
        engine = _engine(plan.path, helper_plan, longest, 8)
        routes = {r.layer: r.backend for r in engine.report.routes}
        print(f"deepseek-v4-4l: {routes}, block {engine.report.block_size}, graphs "
              f"{engine.report.graph_sizes[:4]}...", flush=True)
        for context in plan.decode_contexts:
            rows.append(_run(engine, ceilings, "deepseek-v4-4l", 1, context,
                             plan.decode_output))
            save(rows)
        steps = {row["input_len"]: row["decode_step_ms"] for row in rows}
        first, *_ = plan.decode_contexts
        for context in plan.decode_contexts[1:]:
            print(f"decode step at {context} / at {first}: "
                  f"{steps[context] / steps[first]:.3f}", flush=True)
    else:
        num, input_len, output_len = plan.throughput
        engine = _engine(plan.path, helper_plan, input_len + output_len + 64, num)
        rows.append(_run(engine, ceilings, "deepseek-v4-4l", num, input_len, output_len))
        save(rows)
    del engine
    _release(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return rows


def cache_rows(contexts: tuple[int, ...] = (2048, 32768, 131072)) -> list[dict]:
    """KV bytes per token of one sequence's context, bf16, V4-Flash's layers, block sizes
    256 (vLLM's) and 1024: each block's entries, index keys and accumulators spread over
    its tokens, plus the sequence's window rings (one window's keys per layer, whatever the
    context) spread over the context."""
    from archserve.kernels.compressed_attention.layout import CSA, HCA, SLIDING, layer_layouts
    kinds = [SLIDING] * 2 + [CSA if i % 2 == 0 else HCA for i in range(FLASH_LAYERS - 2)]
    rows = []
    for block in (256, 1024):
        layouts = layer_layouts(kinds, {CSA: 4, HCA: 128}, 128, 512, 128, torch.bfloat16,
                                block)
        per_token = sum(layout.block_size * layout.row_bytes for layout in layouts) / block
        ring = sum(layout.ring_bytes for layout in layouts)
        for context in contexts:
            rows.append({"what": f"DeepSeek V4-Flash, {block}-token blocks, {context} tokens "
                                 f"of context", "bytes_per_token": per_token + ring / context,
                         "ring_bytes_per_sequence": ring})
    rows.append({"what": "DeepSeek-V3 MLA (61 layers, latent 512 + 64, bf16)",
                 "bytes_per_token": V3_LAYERS * (512 + 64) * 2})
    rows.append({"what": "plain MHA of V4's 64 heads of 512 (43 layers, K and V, bf16)",
                 "bytes_per_token": FLASH_LAYERS * 2 * 64 * 512 * 2})
    for row in rows:
        print(f"{row['what']}: {row['bytes_per_token'] / 1024:.2f} KiB a token", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="all",
                        choices=("engine", "throughput", "cache", "all"))
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="engine: the batch-1 contexts (default 2048 32768 131072; "
                             "fewer a run where one device call must fit)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on tiny shapes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        device, plan = torch.device("cpu"), tiny_plan(tempfile.mkdtemp(prefix="dsv4_"))
    elif torch.cuda.is_available():
        device, plan = torch.device("cuda"), Plan(path=V4_4L)
    elif args.part == "cache":          # bytes from the layouts alone: any machine
        device, plan = torch.device("cpu"), Plan(path=V4_4L)
    else:
        sys.exit("deepseek_v4_perf.py needs a CUDA GPU (or --tiny for a CPU smoke run)")
    if args.contexts:
        plan = replace(plan, decode_contexts=tuple(args.contexts))
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}

    def save(key: str, value) -> None:  # noqa: ANN001
        result[key] = value
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, default=str)

    if args.part in ("cache", "all"):
        save("cache", cache_rows())
    if args.part == "cache":
        return
    ceilings = load_or_measure(device)
    result["ceilings"] = ceilings.describe()
    print(ceilings.describe(), flush=True)
    for part in ("engine", "throughput"):
        if args.part in (part, "all"):
            engine_rows(ceilings, plan, part, lambda rows, part=part: save(part, rows))


if __name__ == "__main__":
    main()
