"""Profile decode steps of the engine: device busy vs idle per step, top kernels, top host ops.

    python benchmarks/profile_engine_step.py --model benchmarks/models/llama-3-8b \
        --load-format dummy --dtype bfloat16 --batch-sizes 1,256 --input-len 512 \
        --out OUT/profile.json --trace-dir OUT

Each batch size gets a fresh engine (same caches), a prefill, a few warm-up decode steps,
then --steps profiled decode steps. With --trace-dir a Chrome trace per batch size is kept
(open it in Perfetto). See archserve/bench/step_profile.py for what is counted.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

# Runnable from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from archserve.bench.step_profile import profile_decode_steps  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("-q", "--quantization", default=None,
                    help="as the engine's flag (e.g. fp8: online FP8 W8A8)")
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                    help="KV budget (CPU runs); on a GPU the memory utilisation sizes it")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("-O", "--compilation-config", default=None,
                    help="vLLM's compilation config (JSON or a level: -O 3 compiles a CPU's "
                         "decode steps)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="default: the engine's (on for CUDA, off on CPU)")
    ap.add_argument("--output-kind", default="final_only",
                    choices=["final_only", "cumulative", "delta"],
                    help="what the engine builds per step (the bench uses final_only)")
    ap.add_argument("--no-profiler", action="store_true",
                    help="time the steps without torch.profiler (no breakdown, no overhead)")
    ap.add_argument("--out", default=None, help="write the profiles here as JSON")
    ap.add_argument("--trace-dir", default=None, help="keep a Chrome trace per batch size")
    args = ap.parse_args(argv)

    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    from archserve.loader.loader import resolve_model_path
    from archserve.loader.tokenizer import dummy_without_tokenizer

    model_path = resolve_model_path(args.model)
    results = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        engine = LLMEngine(EngineConfig(
            model=model_path, load_format=args.load_format, dtype=args.dtype,
            quantization=args.quantization,
            max_model_len=args.max_model_len, max_num_seqs=max(batch_size, 1),
            enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
            compilation_config=args.compilation_config,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            skip_tokenizer_init=dummy_without_tokenizer(model_path, args.load_format)))
        trace = (str(Path(args.trace_dir) / f"trace_b{batch_size}.json")
                 if args.trace_dir else None)
        result = profile_decode_steps(engine, batch_size, args.input_len, args.steps,
                                      trace_path=trace, output_kind=args.output_kind,
                                      use_profiler=not args.no_profiler)
        print(result.render(), flush=True)
        results.append({**result.to_json(), "async_scheduling": engine.config.async_scheduling})
        del engine
        gc.collect()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
