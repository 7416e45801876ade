"""Decode steps with LoRA adapters against the base model's, at batch 32 and batch 1.

Dummy bf16 weights for the base model and rank-R adapters on every dense linear (q, k, v,
o, gate, up, down), written as PEFT directories. Each case is the median decode step of
an engine run (``--output-len`` tokens per request, all requests in one batch):

- base: the engine without LoRA, batch 32 and batch 1;
- LoRA: ``--enable-lora`` with ``--max-loras`` slots: batch 32 whose requests use the
  adapters in turn (8 distinct ones by default), batch 1 with one adapter, and batch 32
  of base requests on the LoRA engine (what serving base traffic there costs).

    python3 benchmarks/bench_lora.py benchmarks/models/llama-3-8b \
        [--rank 16] [--adapters 8] [--output-len 256] [--output-json FILE]
        [--set archserve.kernels.lora.triton_lora:K_PER_SPLIT=1024 ...] [--profile]

The targets (docs/benchmarks.md): batch 32 with 8 adapters <= 1.2x the base step at
batch 32; batch 1 with an adapter <= 1.1x the base step at batch 1. ``--profile`` also prints the
per-kernel profile (archserve/bench/step_profile.py) of batch 1's decode steps on the base
engine and with the adapter: where the adapter's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from archserve.bench.module_settings import set_module_constants  # noqa: E402
from archserve.bench.offline import bench_sampling_params, warm_up  # noqa: E402
from archserve.bench.step_profile import profile_decode_steps  # noqa: E402
from archserve.bench.step_trace import trace_steps  # noqa: E402
from archserve.bench.workload import random_requests  # noqa: E402
from archserve.engine import heap  # noqa: E402
from archserve.engine.config import EngineConfig  # noqa: E402
from archserve.engine.llm_engine import LLMEngine  # noqa: E402
from archserve.engine.lora.request import LoRARequest  # noqa: E402

TARGETS = {"batch 32, adapters": 1.2, "batch 1, adapter": 1.1}


def write_dummy_adapters(engine: LLMEngine, count: int, rank: int, root: str
                         ) -> list[LoRARequest]:
    """``count`` PEFT adapters of rank ``rank`` on every linear that takes one, random."""
    from safetensors.torch import save_file
    targets = engine.lora.layout.targets
    requests = []
    for index in range(count):
        gen = torch.Generator().manual_seed(index)
        tensors = {}
        for target in targets:
            for module, rows in zip(target.modules, target.slots.slice_sizes, strict=True):
                cols = target.linear.in_features
                prefix = f"base_model.model.{module}"
                tensors[f"{prefix}.lora_A.weight"] = (
                    torch.randn(rank, cols, generator=gen) / cols ** 0.5).to(torch.bfloat16)
                tensors[f"{prefix}.lora_B.weight"] = (
                    torch.randn(rows, rank, generator=gen) * 0.01).to(torch.bfloat16)
        path = os.path.join(root, f"adapter{index}")
        os.makedirs(path)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}, f)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        requests.append(LoRARequest(f"adapter{index}", index + 1, path))
    return requests


def decode_step_ms(engine: LLMEngine, batch: int, adapters: list[LoRARequest | None],
                   input_len: int, output_len: int) -> float:
    """The median decode step (ms) of ``batch`` requests that take ``adapters`` in turn;
    only steps that hold the whole batch count."""
    requests = random_requests(batch, input_len, output_len, engine.model_config.vocab_size,
                               seed=batch)
    warm_up(engine, requests[0])
    with trace_steps(engine) as trace:
        for i, request in enumerate(requests):
            engine.add_request(f"lora-bench-{i}", request.prompt_token_ids,
                               bench_sampling_params(output_len),
                               lora_request=adapters[i % len(adapters)])
        while engine.has_unfinished_requests():
            engine.step()
    steps = [s.seconds * 1e3 for s in trace.steps if s.is_decode and len(s.work) == batch]
    return statistics.median(steps)


def print_profile(title: str, engine: LLMEngine, adapter: LoRARequest | None,
                  input_len: int) -> None:
    profile = profile_decode_steps(engine, 1, input_len, steps=20, lora_request=adapter)
    print(f"== {title}\n{profile.render()}", flush=True)


def engine_for(args, **lora) -> LLMEngine:
    return LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", load_format="dummy",
                                  max_model_len=args.max_model_len, max_num_seqs=32,
                                  skip_tokenizer_init=True, **lora))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--output-json")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=INT",
                        help="set an integer constant of a module before the engines start "
                             "(the LoRA kernels' tiles: FEW_ROWS, K_PER_SPLIT, BLOCK_N ...)")
    parser.add_argument("--profile", action="store_true",
                        help="print batch 1's per-kernel step profile, base and adapter")
    args = parser.parse_args()
    set_module_constants(args.set)
    runs = dict(input_len=args.input_len, output_len=args.output_len)

    base = engine_for(args)
    rows = {"base batch 32": decode_step_ms(base, 32, [None], **runs),
            "base batch 1": decode_step_ms(base, 1, [None], **runs)}
    if args.profile:
        print_profile("base engine, batch 1", base, None, args.input_len)
    base.shutdown()
    del base
    heap.free_dropped_engines("cuda" if torch.cuda.is_available() else "cpu")

    engine = engine_for(args, enable_lora=True, max_loras=args.adapters,
                        max_lora_rank=args.rank)
    print(engine.describe_route(), flush=True)
    with tempfile.TemporaryDirectory() as root:
        adapters = write_dummy_adapters(engine, args.adapters, args.rank, root)
        rows["LoRA engine, batch 32, base requests"] = decode_step_ms(engine, 32, [None], **runs)
        rows["batch 32, adapters"] = decode_step_ms(engine, 32, adapters, **runs)
        rows["batch 1, adapter"] = decode_step_ms(engine, 1, adapters[:1], **runs)
        if args.profile:
            print_profile("LoRA engine, batch 1, adapter", engine, adapters[0], args.input_len)
    base_of = {"batch 32, adapters": "base batch 32", "batch 1, adapter": "base batch 1",
               "LoRA engine, batch 32, base requests": "base batch 32"}
    report = {"model": args.model, "rank": args.rank, "adapters": args.adapters,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "rows": {}}
    for name, ms in rows.items():
        ratio = ms / rows[base_of[name]] if name in base_of else None
        target = TARGETS.get(name)
        met = target is not None and ratio <= target
        verdict = "" if target is None else f" (target <= {target}x: {'met' if met else 'NOT met'})"
        print(f"{name:40s} {ms:8.3f} ms" + (f"  {ratio:.3f}x{verdict}" if ratio else ""))
        report["rows"][name] = {"step_ms": ms, "ratio": ratio, "target": target}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
