"""A CPU decode step eager against compiled (engine/cpu_compiled_step.py), on one thread.

    python3 benchmarks/cpu_compiled_step.py --dtype bfloat16 --context 41 --reps 30

Builds an engine with compiled decode steps (size 1 at one thread) and times the same
decode step both ways, interleaved, in CPU time of the calling thread: on a shared 2-core
machine a wall-clock step moves with the other processes, the thread's CPU time much less.
Prints the start-up's compile time, the median and best step of each, and the logits'
largest difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# Runnable from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=41, help="the step's context length")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    from archserve.kernels.attention.interface import AttentionMetadata
    from archserve.loader.loader import resolve_model_path

    torch.set_num_threads(1)
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=resolve_model_path(args.model), dtype=args.dtype,
                                    max_model_len=max(256, args.context), max_num_seqs=1,
                                    compilation_config={"level": 3}))
    print(f"start-up {time.perf_counter() - start:.1f} s, of which compiling "
          f"{engine.report.timings.get('compile_s', 0.0):.1f} s")
    runner = engine.runner
    torch.set_num_threads(1)   # the governor may have moved it
    blocks = -(-args.context // runner.block_size)
    meta = AttentionMetadata.from_lengths(
        [1], [args.context], torch.arange(blocks, dtype=torch.int32)[None],
        torch.tensor([args.context - 1]), runner.device)
    ids, positions = torch.tensor([5]), torch.tensor([args.context - 1])
    steps = {"eager": lambda: runner._forward_logits(ids, positions, meta),
             "compiled": lambda: runner.graphs.replay(1, ids, positions, meta)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, step in steps.items():
                for _ in range(5):
                    step()
                for _ in range(args.reps):
                    began = time.thread_time()
                    step()
                    times[name].append(time.thread_time() - began)
        diff = (steps["eager"]().float() - steps["compiled"]().float()).abs().max().item()
    for name, samples in times.items():
        print(f"{name}: median {statistics.median(samples) * 1e3:.2f} ms, best "
              f"{min(samples) * 1e3:.2f} ms a step (thread CPU time, 1 thread)")
    print(f"logits: largest difference {diff:.3g}; compiled sizes "
          f"{runner.graphs.set.sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
