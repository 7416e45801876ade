"""How far a bfloat16 run of the embedded model, in each CPU_WEIGHT_ONLY storage format,
moves from the float32 expansion: log-prob drift and greedy tokens on fixed prompts.

The reference is the float32 model (``--dtype float32``: every GGUF linear expanded to
float32). Each other variant is the bfloat16 model with one format forced on every linear
layer (``int4`` falls back to ``bf16`` for shapes it cannot take); ``tuned`` is what
start-up chooses here (with the LM head dense, with its 8-bit copy at every row count,
or as start-up chooses: the copy where it is faster, which prompt log-probs, many rows,
do not take), and ``auto`` the route a user gets without ``--dtype`` (bfloat16,
tuned, on a CPU with native bfloat16; float32, the reference, elsewhere). For
each fixed prompt the reference decodes greedily; every variant then scores the prompt plus
the reference's tokens (prompt log-probs), so drift is measured on the same tokens,
and decodes greedily itself (the tokens must agree until the first near-tie).

    python3 benchmarks/cpu_route_accuracy.py [--new-tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
]
# name -> (model dtype, format forced on every linear (None: start-up's), LM head forced
# dense, forced int8 at every row count (the prompt log-probs too), or None: start-up's).
VARIANTS = {
    "float32 (reference)": ("float32", None, None),
    "bfloat16, fp32 weights": ("bfloat16", "fp32", "dense"),
    "bfloat16, bf16 weights": ("bfloat16", "bf16", "dense"),
    "bfloat16, int4 weights": ("bfloat16", "int4", "dense"),
    "bfloat16, tuned, dense head": ("bfloat16", None, "dense"),
    "bfloat16, tuned, int8 head": ("bfloat16", None, "int8"),
    "bfloat16, tuned (start-up's choice)": ("bfloat16", None, None),
    "auto (the default dtype here)": ("auto", None, None),
}


@contextlib.contextmanager
def forced(fmt: str | None, head: str | None):
    """Start-up stores every linear as ``fmt`` (None: as it chooses), and the LM head dense
    where ``head`` says so (None: as it chooses)."""
    from archserve.kernels.linear import cpu_weight_only as cwo

    tune, tune_head = cwo.CpuWeightOnlyLinear.tune_formats, cwo.CpuWeightOnlyLinear.tune_head
    if head == "dense":
        cwo.CpuWeightOnlyLinear.tune_head = lambda self, weight, dense, path: None
    elif head == "int8":
        def every_row_count(self, weight, dense, path):
            route = tune_head(self, weight, dense, path)
            return route and dataclasses.replace(route, rows=range(1, 1 << 30))
        cwo.CpuWeightOnlyLinear.tune_head = every_row_count

    def tune_forced(self, weights, path):
        for w in weights:
            formats = self.formats_for(w)
            choice = fmt if fmt in formats else "bf16" if "bf16" in formats else formats[-1]
            self.choices[cwo.kind_key(w)] = choice
        return {}

    if fmt is not None:
        cwo.CpuWeightOnlyLinear.tune_formats = tune_forced
    try:
        yield
    finally:
        cwo.CpuWeightOnlyLinear.tune_formats = tune
        cwo.CpuWeightOnlyLinear.tune_head = tune_head


def run_variant(dtype, fmt, head, prompts_ids, reference_tokens, new_tokens):
    """(greedy tokens, the log-prob of each reference token after its prefix); the
    reference tokens are this variant's own when ``reference_tokens`` is None."""
    from archserve import LLM, SamplingParams

    with forced(fmt, head):
        llm = LLM(model=None, dtype=dtype, max_num_seqs=8)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts_ids], greedy,
                        use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    reference_tokens = reference_tokens or tokens
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    scored = llm.generate([{"prompt_token_ids": ids + ref}
                           for ids, ref in zip(prompts_ids, reference_tokens, strict=True)],
                          score, use_tqdm=False)
    logprobs = []
    for out, ids, ref in zip(scored, prompts_ids, reference_tokens, strict=True):
        rows = out.prompt_logprobs[len(ids):]
        logprobs.append([row[tok].logprob for row, tok in zip(rows, ref, strict=True)])
    return tokens, logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from archserve.loader.default_model import default_model_path
    from archserve.loader.gguf_cache import gguf_tokenizer
    tokenizer = gguf_tokenizer(default_model_path())
    prompts_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
                   for p in PROMPTS]
    prompts_ids = [list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)
                   for ids in prompts_ids]
    results = {}
    reference = None
    for name, (dtype, fmt, head) in VARIANTS.items():
        tokens, logprobs = run_variant(dtype, fmt, head, prompts_ids,
                                       reference and reference["tokens"], args.new_tokens)
        if reference is None:
            reference = {"tokens": tokens, "logprobs": logprobs}
        drift = [abs(a - b) for lp, ref in zip(logprobs, reference["logprobs"], strict=True)
                 for a, b in zip(lp, ref, strict=True)]
        same = sum(t == r for t, r in zip(tokens, reference["tokens"], strict=True))
        agree = [next((i for i, (a, b) in enumerate(zip(t, r, strict=True)) if a != b), len(r))
                 for t, r in zip(tokens, reference["tokens"], strict=True)]
        results[name] = {"max_logprob_drift": max(drift),
                         "mean_logprob_drift": sum(drift) / len(drift),
                         "prompts_identical": f"{same}/{len(PROMPTS)}",
                         "tokens_before_first_difference": agree}
        print(f"{name:36s} max |dlogp| {max(drift):.4f}  mean {sum(drift) / len(drift):.5f}  "
              f"greedy identical {same}/{len(PROMPTS)}  agree for {agree}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    assert all(math.isfinite(r["max_logprob_drift"]) for r in results.values())


if __name__ == "__main__":
    main()
