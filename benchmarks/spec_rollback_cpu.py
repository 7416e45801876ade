"""What speculative decoding's cache rollback costs a step on a DeepSeek V4 model (CPU).

Before every step that verifies drafts, ``CompressedCacheRollback.save`` copies the rows the
drafts may overwrite (each drafting sequence's window-ring rows at the step's positions and
the compressor state of the blocks they fall in, per layer); after it, ``rewind_rejected``
restores them for the sequences with a draft rejected. This times both inside real engine
steps: DeepSeek V4 cut to four layers and shrunk (deepseek_v4_perf.py's ``--tiny`` shapes),
dummy float32 weights, n-gram drafts over prompts of a repeated pattern, greedy.

Each round runs the workload twice on one engine, with the save and without it (the
rollback's two calls replaced by nothing: the tokens may then differ, the step's work does
not), in turns, so a machine whose load drifts slows both alike. Prints per batch size
the mean step time each way (best round), the save's and the rewind's own mean time a step,
and the save's share of the step, with ``uptime``'s load.

    python3 benchmarks/spec_rollback_cpu.py [--batch 1 4] [--tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from deepseek_v4_perf import tiny_plan  # noqa: E402

from archserve import LLM, SamplingParams  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
PATTERN = [11, 12, 13, 14, 15, 16, 17, 18]


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


class Timed:
    """``fn`` with each call's seconds kept in ``seconds``; ``skip`` calls nothing."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds, self.skip = fn, [], False

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        if self.skip:
            return None
        start = time.perf_counter()
        result = self.fn(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="spec_rollback_")
    tiny_plan(folder)
    llm = LLM(folder, dtype="float32", load_format="dummy", skip_tokenizer_init=True,
              max_model_len=512, speculative_config=NGRAM)
    engine = llm.llm_engine
    rollback = engine.draft_rollback
    save, rewind = Timed(rollback.save), Timed(rollback.rewind_rejected)
    rollback.save, rollback.rewind_rejected = save, rewind
    step = Timed(engine.step)
    engine.step = step
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    print(f"threads {__import__('torch').get_num_threads()}; {load()}")
    for batch in args.batch:
        prompts = [{"prompt_token_ids": (PATTERN * 16)[:80 + i]} for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)          # warm-up
        best: dict[bool, float] = {}
        saves, rewinds, shares = [], [], []
        for _ in range(args.reps):
            for saving in (True, False):
                save.skip = rewind.skip = not saving
                for timer in (save, rewind, step):
                    timer.seconds.clear()
                llm.generate(prompts, params, use_tqdm=False)
                mean = statistics.mean(step.seconds)
                best[saving] = min(best.get(saving, mean), mean)
                if saving:
                    steps = len(step.seconds)
                    saves.append(sum(save.seconds) / steps)
                    rewinds.append(sum(rewind.seconds) / steps)
                    shares.append(sum(save.seconds) / sum(step.seconds))
        save.skip = rewind.skip = False
        print(f"batch {batch}: step {best[True] * 1e3:.3f} ms with the save, "
              f"{best[False] * 1e3:.3f} ms without; save {min(saves) * 1e3:.3f} ms a step "
              f"(rounds: {', '.join(f'{s * 1e3:.3f}' for s in saves)}), rewind "
              f"{min(rewinds) * 1e3:.3f} ms; the save's share of the step "
              f"{min(shares) * 100:.2f}-{max(shares) * 100:.2f}%; {load()}")
    print(engine.speculator.stats.as_dict())


if __name__ == "__main__":
    main()
