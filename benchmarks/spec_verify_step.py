"""The cost of a verification step (each sequence's newest token and k drafts, every row
sampled) against a plain decode step, for k = 1..8 at a few batch sizes.

A speculative step that costs r times a decode step pays off once a sequence gets more
than r tokens from it on average (its acceptance length). The steps are the model
runner's, as the engine launches them (the batch's upload, the forward, which replays a
captured graph where one fits, the greedy sampler, the tokens' copy home), each timed to
its tokens' arrival; sequences sit at ``--context`` tokens of cached (dummy) context.

    python3 benchmarks/spec_verify_step.py benchmarks/models/llama-3-8b \
        [--context 512] [--batches 1,8,32] [--max-drafts 8] [--steps 50] [--reps 5]
        [--profile-drafts 1,4]

Dummy bf16 weights. Prints one row per batch size: the decode step's median ms, then each
k's verification step in ms and as a ratio to the decode step, and what it replayed: the
decode graph of its B x (k + 1) rows (every token a decode row), a mixed-step bucket, or
nothing (eager).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from archserve.engine.config import EngineConfig  # noqa: E402
from archserve.engine.llm_engine import LLMEngine  # noqa: E402
from archserve.engine.sampling_params import SamplingParams  # noqa: E402
from archserve.engine.scheduler import ScheduledSeq  # noqa: E402
from archserve.engine.sequence import Sequence  # noqa: E402


def sequences(engine: LLMEngine, batch: int, context: int, max_drafts: int, seed: int
              ) -> list[Sequence]:
    """``batch`` sequences of ``context`` computed tokens and one new one, with blocks for
    the new token and ``max_drafts`` drafts (their cached keys and values are whatever the
    pool holds: the timing does not depend on them)."""
    import random
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_drafts + 2)
    seqs = []
    for i in range(batch):
        seq = Sequence(f"bench-{i}", [rng.randrange(vocab) for _ in range(context + 1)], params)
        if not engine.block_pool.allocate(seq, context + 1 + max_drafts):
            raise ValueError(f"the KV pool cannot hold {batch} x {context} tokens")
        seq.num_computed_tokens = context
        seqs.append(seq)
    return seqs


def step_ms(engine: LLMEngine, chunks: list[ScheduledSeq], steps: int, reps: int) -> float:
    """The median over ``reps`` runs of ``steps`` steps of each step's time, launch to
    tokens on the host."""
    runner = engine.runner
    for _ in range(3):
        runner.execute(chunks).wait()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(steps):
            runner.execute(chunks).wait()
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def profile_steps(engine: LLMEngine, chunks: list[ScheduledSeq], steps: int) -> str:
    """``steps`` steps under torch.profiler, rendered: the device's busy and idle time per
    step and its kernels by device time (archserve.bench.step_profile)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from archserve.bench.step_profile import summarize
    runner = engine.runner
    on_cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    for _ in range(3):
        runner.execute(chunks).wait()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            runner.execute(chunks).wait()
        sync()
        wall = time.perf_counter() - start
    return summarize(prof.events(), len(chunks), steps, wall).render()


def _counting(replay, replays: dict[str, int], key: str):  # noqa: ANN001, ANN202
    """``replay``, counting its calls under ``key``."""
    def counting(*a, **k):  # noqa: ANN002, ANN003, ANN202
        replays[key] += 1
        return replay(*a, **k)
    return counting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--max-drafts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the rows")
    parser.add_argument("--profile-drafts", default="",
                        help="k values (e.g. 1,4) whose steps at the first batch size are "
                             "profiled after the timings, with the decode step: where the "
                             "verification step's extra time goes, kernel by kernel")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    # n-gram drafts (none proposed here: the drafts are given), so the verification steps'
    # graphs have room for a row per draft.
    spec = {"method": "ngram", "num_speculative_tokens": args.max_drafts,
            "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, load_format=args.load_format,
        max_model_len=args.context + args.max_drafts + 64, max_num_seqs=max(batches),
        skip_tokenizer_init=True, speculative_config=spec))
    print(engine.describe_route(), flush=True)
    runner = engine.runner
    # Which graph each verification step replays: the decode graph of its rows (every
    # token a decode row: ModelRunner.runs_as_decode_rows), a mixed-step bucket, or none.
    replays = {"decode rows": 0, "mixed bucket": 0}
    for key, graphs in (("decode rows", runner.graphs), ("mixed bucket", runner.mixed_graphs)):
        if graphs is not None:
            graphs.replay = _counting(graphs.replay, replays, key)
    rows = []
    for batch in batches:
        seqs = sequences(engine, batch, args.context, args.max_drafts, seed=batch)
        decode = step_ms(engine, [ScheduledSeq(s, 1, True) for s in seqs], args.steps,
                         args.reps)
        row = {"batch": batch, "context": args.context, "decode_ms": decode, "verify": {}}
        for k in range(1, args.max_drafts + 1):
            before = dict(replays)
            chunks = [ScheduledSeq(s, 1 + k, True, list(s.token_ids[-k:])) for s in seqs]
            ms = step_ms(engine, chunks, args.steps, args.reps)
            path = next((key for key in replays if replays[key] > before[key]), "eager")
            row["verify"][k] = {"ms": ms, "ratio": ms / decode, "graph": path != "eager",
                                "path": path}
        if args.profile_drafts and batch == batches[0]:
            for k in [0] + [int(d) for d in args.profile_drafts.split(",")]:
                chunks = [ScheduledSeq(s, 1 + k, True, list(s.token_ids[-k:]) if k else [])
                          for s in seqs]
                print(f"profile, batch {batch}, k = {k}:\n"
                      f"{profile_steps(engine, chunks, args.steps)}", flush=True)
        for seq in seqs:
            engine.block_pool.free(seq)
        rows.append(row)
        cells = "  ".join(f"k={k}: {v['ms']:.3f} ({v['ratio']:.2f}x, {v['path']})"
                          for k, v in row["verify"].items())
        print(f"batch {batch:3d}  decode {decode:.3f} ms  |  {cells}", flush=True)
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
