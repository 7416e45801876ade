"""Batch-1 output tokens/s with speculative decoding against without, on a copy-heavy
workload (benchmarks/spec_decode/copy_prompts.json: repeat or lightly edit a given text).

Both engines load once; the requests then run one at a time (batch 1), the plain engine
and the speculating one taking turns over ``--reps`` rounds, so a machine whose load
drifts slows both alike; each engine's best round is reported, with every round's rate.
Greedy, so both give the same tokens (checked), and the rate compares like with like.

    python3 benchmarks/spec_decode_cpu.py [--model PATH] [--reps 3] [--max-tokens 160]
        [--speculative-config JSON]      (default: n-gram, 4 drafts, n = 2..4)

Prints per engine: output tokens/s (end to end, prefill included), decode tokens/s (after
each request's first token), output tokens per second of the process's CPU time (what other
processes on a shared machine disturb least), and for the speculating engine vLLM's
figures: mean acceptance length (1 + accepted / drafts) and the acceptance rate by draft
position.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from archserve import LLM, SamplingParams  # noqa: E402
from archserve.bench.runner import spec_decode_counts, spec_decode_summary  # noqa: E402

PROMPTS = os.path.join(os.path.dirname(__file__), "spec_decode", "copy_prompts.json")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def one_round(llm: LLM, chats: list, params: SamplingParams
              ) -> tuple[float, float, float, list]:
    """(output tokens/s, decode tokens/s, output tokens per second of this process's CPU
    time, each request's tokens) over the requests, run one at a time. The CPU-time rate
    is what a loaded machine's other processes disturb least."""
    tokens, elapsed, cpu, decode_tokens, decode_s, outputs = 0, 0.0, 0.0, 0, 0.0, []
    for chat in chats:
        start, start_cpu = time.perf_counter(), time.process_time()
        out = llm.chat([chat], params)[0]
        elapsed += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        ids = out.outputs[0].token_ids
        tokens += len(ids)
        outputs.append(ids)
        m = out.metrics
        if len(ids) > 1 and m.first_token_time is not None:
            decode_tokens += len(ids) - 1
            decode_s += m.finished_time - m.first_token_time
    return (tokens / elapsed, decode_tokens / decode_s if decode_s else 0.0, tokens / cpu,
            outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    args = parser.parse_args()
    with open(PROMPTS, encoding="utf-8") as f:
        chats = [p["messages"] for p in json.load(f)["prompts"]][:args.num_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engines = {"plain": LLM(args.model, max_model_len=2048, max_num_seqs=1),
               "speculative": LLM(args.model, max_model_len=2048, max_num_seqs=1,
                                  speculative_config=args.speculative_config)}
    for llm in engines.values():      # one short request first: nothing cold is timed
        llm.chat([chats[0]], SamplingParams(temperature=0.0, max_tokens=8))
    spec_engine = engines["speculative"].llm_engine
    before = spec_decode_counts(spec_engine)
    rounds: dict[str, list[tuple[float, float, float]]] = {name: [] for name in engines}
    outputs: dict[str, list] = {}
    for rep in range(args.reps):
        for name, llm in engines.items():
            out_rate, decode_rate, cpu_rate, outputs[name] = one_round(llm, chats, params)
            rounds[name].append((out_rate, decode_rate, cpu_rate))
            print(f"round {rep + 1} {name}: {out_rate:.2f} output tok/s, "
                  f"{decode_rate:.2f} decode tok/s, {cpu_rate:.2f} output tok per CPU-s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    assert outputs["plain"] == outputs["speculative"], "speculation changed the tokens"
    spec = spec_decode_summary(before, spec_decode_counts(spec_engine))
    best = {name: max(r[0] for r in rs) for name, rs in rounds.items()}
    best_decode = {name: max(r[1] for r in rs) for name, rs in rounds.items()}
    best_cpu = {name: max(r[2] for r in rs) for name, rs in rounds.items()}
    total = sum(len(o) for o in outputs["plain"])
    print(f"\n{len(chats)} requests, {total} output tokens a round, batch 1, best of "
          f"{args.reps} rounds ({os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f}):")
    for name in engines:
        print(f"  {name:12s} {best[name]:7.2f} output tok/s   {best_decode[name]:7.2f} "
              f"decode tok/s   {best_cpu[name]:7.2f} output tok per CPU-s")
    print(f"  speed-up     {best['speculative'] / best['plain']:.2f}x output, "
          f"{best_decode['speculative'] / best_decode['plain']:.2f}x decode, "
          f"{best_cpu['speculative'] / best_cpu['plain']:.2f}x per CPU-s")
    print(f"  acceptance length {spec['mean_acceptance_length']:.2f} (rate "
          f"{spec['acceptance_rate']:.2f}; by position "
          f"{', '.join(f'{r:.2f}' for r in spec['acceptance_rate_per_pos'])})")


if __name__ == "__main__":
    main()
