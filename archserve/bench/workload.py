"""Benchmark requests: seeded random token prompts, or prompts from a JSON file.

Random prompts draw token ids from the vocabulary minus the special tokens, so a
prompt never contains an EOS or BOS that would change what the model does.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [L*(1-R), L*(1+R)], never below 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(length * (1.0 - range_ratio)))
    high = max(low, int(length * (1.0 + range_ratio)))
    return low, high


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    special_token_ids: set[int] | None = None, range_ratio: float = 0.0,
                    seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` requests of random tokens; lengths fixed or uniform in the range."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    special = special_token_ids or set()
    allowed = [t for t in range(vocab_size) if t not in special]
    if not allowed:
        raise ValueError("the vocabulary has no ordinary tokens to draw prompts from")
    rng = random.Random(seed)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    requests = []
    for _ in range(num_prompts):
        n_in = rng.randint(in_low, in_high)
        n_out = rng.randint(out_low, out_high)
        requests.append(BenchRequest([rng.choice(allowed) for _ in range(n_in)], n_out))
    return requests


def dataset_requests(path: str, tokenizer, output_len: int, num_prompts: int | None = None
                     ) -> list[BenchRequest]:
    """Requests from a JSON file: a list of strings, or of objects with ``prompt`` (text
    or token ids) and optionally ``output_len`` (else ``output_len`` applies)."""
    with open(path, encoding="utf-8") as f:
        items = json.load(f)
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty JSON list of prompts")
    requests = []
    for i, item in enumerate(items[:num_prompts] if num_prompts else items):
        entry = {"prompt": item} if isinstance(item, (str, list)) else item
        if not isinstance(entry, dict) or "prompt" not in entry:
            raise ValueError(f"{path}: item {i} is neither a string nor an object with 'prompt'")
        prompt = entry["prompt"]
        ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"{path}: item {i} has an empty prompt")
        requests.append(BenchRequest(ids, int(entry.get("output_len", output_len))))
    return requests


def special_token_ids(tokenizer) -> set[int]:
    """Every id the tokenizer calls special (BOS, EOS, PAD, added control tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            ids.add(value)
    return ids
