"""A batch-1 decode step in the engine against replays of its decode graph alone.

The difference is what runs between two graphs on the device: the step's input copies into
the graph's static buffers, the sampler (a greedy argmax here) and the token's copy home.
PDL cannot overlap those with the graph's kernels, so they add to every step.

    python3 benchmarks/step_vs_graph.py benchmarks/models/qwen3-30b-a3b --max-model-len 1024
        [--reps 3] [--replays 200]    (dummy bf16 weights; 1 request, 128 in, 256 out)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from archserve.bench.module_settings import set_module_constants  # noqa: E402
from archserve.bench.offline import run_offline  # noqa: E402
from archserve.bench.roofline import analyze, model_facts  # noqa: E402
from archserve.bench.workload import random_requests  # noqa: E402
from archserve.engine.ceilings import load_or_measure  # noqa: E402
from archserve.engine.config import EngineConfig  # noqa: E402
from archserve.engine.llm_engine import LLMEngine  # noqa: E402
from archserve.kernels.cuda_timing import mean_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3, help="engine runs, each 1 x 128/256")
    parser.add_argument("--replays", type=int, default=200, help="graph replays timed")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=INT",
                        help="set an integer constant of a module before the engine starts")
    args = parser.parse_args()
    set_module_constants(args.set)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", load_format="dummy",
                                    max_model_len=args.max_model_len, max_num_seqs=1,
                                    skip_tokenizer_init=True))
    ceilings = load_or_measure(engine.runner.device)
    steps = []
    for _ in range(args.reps):
        requests = random_requests(1, 128, 256, engine.model_config.vocab_size, seed=1)
        _, trace = run_offline(engine, requests, True, show_progress=False)
        roof = analyze(trace, model_facts(engine), ceilings)
        steps.append(roof.decode_step_s_mean * 1e3)
        decode = sorted(s.seconds * 1e3 for s in trace.steps if s.is_decode)
        prefill = sum(s.seconds for s in trace.steps if not s.is_decode) * 1e3
        median = statistics.median(decode)   # 255 decode steps: never empty
        print(f"engine step {steps[-1]:.3f} ms (floor {roof.decode_floor_s_mean * 1e3:.3f}; "
              f"median {median:.3f}, slowest {decode[-1]:.3f}; "
              f"prefill {prefill:.3f} ms)", flush=True)
        # Steps well over the median: which, and where their host time went.
        for i, s in enumerate(trace.steps):
            if s.is_decode and s.seconds * 1e3 > 1.2 * median:
                phases = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in sorted(s.phases.items()))
                print(f"  slow step {i}: {s.seconds * 1e3:.3f} ms ({phases})", flush=True)
    # The size-1 graph over the last step's buffers (its context, its lengths).
    alone = mean_ms(engine.runner.graphs.set.graphs[1].replay, args.replays)
    mean = sum(steps) / len(steps)
    print(f"graph replay alone {alone:.3f} ms; engine step {mean:.3f} ms (mean of "
          f"{len(steps)}): {mean - alone:.3f} ms between graphs", flush=True)


if __name__ == "__main__":
    main()
