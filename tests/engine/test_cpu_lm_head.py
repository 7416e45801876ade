"""The CPU's 8-bit LM head (kernels/linear/cpu_lm_head.py): the copy is within half a step
of every weight, the timed choice is cached and read back, the engine's head multiplies
by the copy at exactly the row counts start-up chose, and on the embedded model the copy's
log-probs stay within HEAD_DRIFT_BOUND of the float32 expansion, nearer it than the dense
bfloat16 head's, with greedy tokens as near float32's or nearer."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import archserve.kernels.linear.cpu_lm_head as head_module
from archserve import LLM, SamplingParams
from archserve.kernels.linear.cpu_lm_head import (
    HEAD_DRIFT_BOUND,
    HEAD_ROWS,
    int8_groups,
    int8_groups_linear,
    tune_head,
)
from archserve.models.layers.embedding import LMHead


def benchmark_prompts() -> list[str]:
    """benchmarks/cpu_route_accuracy.py's fixed prompts, where HEAD_DRIFT_BOUND was
    measured."""
    path = Path(__file__).parents[2] / "benchmarks" / "cpu_route_accuracy.py"
    spec = importlib.util.spec_from_file_location("cpu_route_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PROMPTS


PROMPTS = benchmark_prompts()
NEW_TOKENS = 32


@pytest.mark.parametrize("group", [32, 192])
def test_the_int8_copy_is_within_half_a_step_of_every_weight(group):
    generator = torch.Generator().manual_seed(group)
    weight = (torch.randn(512, 192, generator=generator)
              * torch.rand(512, 1, generator=generator)).to(torch.bfloat16)
    stored = int8_groups(weight, group)
    assert stored.q.dtype == torch.int8 and stored.scales.shape == (192 // group, 512)
    step = stored.scales.float()[..., None]                              # [G, N, 1]
    expanded = (stored.q.float() * step).transpose(0, 1).reshape(512, 192)
    error = (expanded - weight.float()).view(512, -1, group).transpose(0, 1).abs()
    assert (error <= step * 0.5 + 1e-6).all()
    x = torch.randn(3, 192, generator=generator).to(torch.bfloat16)
    exact = x.float() @ expanded.t()
    # Each group's product is rounded to bfloat16 (2**-9 relative) before the sum.
    bound = (192 // group) * 2**-8 * (x.float().abs() @ expanded.abs().t())
    assert ((int8_groups_linear(x, stored) - exact).abs() <= bound).all()


def test_a_q8_0_matrix_is_held_exactly_up_to_its_scales():
    """A matrix whose groups of 32 are Q8_0's (integers times a per-group scale that is
    a bfloat16 value): the copy holds those integers and scales exactly."""
    q = torch.randint(-127, 128, (256, 128)).float()
    q[:, ::32] = 127                                  # each group's max, as Q8_0 stores it
    scales = (torch.rand(256, 4) * 0.01).to(torch.bfloat16).float()
    weight = q * scales.repeat_interleave(32, dim=1)
    stored = int8_groups(weight, 32)
    assert torch.equal(stored.scales.float(), scales.t())
    assert torch.equal(stored.q.transpose(0, 1).reshape(256, 128).float(), q)


def test_the_timed_choice_is_cached_and_read_back(tmp_path, monkeypatch):
    weight = torch.randn(4096, 256).to(torch.bfloat16)
    path = str(tmp_path / "cpu_lm_head.json")

    def dense(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight)

    first = tune_head(weight, dense, path)
    assert set(first.timing.ms["dense"]) == set(first.timing.ms["int8"]) == set(
        map(str, HEAD_ROWS))
    for rows in HEAD_ROWS:    # the copy serves exactly the timed counts it won
        assert (rows in first.rows) == (rows in first.timing.int8_rows)

    def no_timing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(head_module, "time_head", no_timing)
    # A cache that says int8 won at 1 and 4 rows: 1, 4-7 take the copy, 2-3 and 8+ do not.
    with open(path) as f:
        data = json.load(f)
    (key,) = data["heads"]
    data["heads"][key]["int8_rows"] = [1, 4]
    with open(path, "w") as f:
        json.dump(data, f)
    second = tune_head(weight, dense, path)
    assert second.rows == frozenset({1, 4, 5, 6, 7})


def test_a_timing_at_another_thread_count_is_not_reused(tmp_path, monkeypatch):
    """The forms gain unlike from threads: a choice timed at one count is timed again at
    another, and each count's is kept."""
    weight = torch.randn(512, 64).to(torch.bfloat16)
    path = str(tmp_path / "cpu_lm_head.json")
    timed = []

    def time_head(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        timed.append(torch.get_num_threads())
        return head_module.HeadTiming([timed[-1]], {})

    monkeypatch.setattr(head_module, "time_head", time_head)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1, 2):
            torch.set_num_threads(count)
            route = tune_head(weight, lambda x: x, path)
            assert route.timing.int8_rows == [count]    # this count's own timing
    finally:
        torch.set_num_threads(threads)
    assert timed == [1, 2]
    with open(path) as f:
        assert len(json.load(f)["heads"]) == 2


@pytest.fixture(scope="module")
def engines(embedded_model_path):
    """The embedded model in bfloat16 with the head start-up chose and with the dense head
    (its 8-bit copy removed), and the float32 expansion (the reference)."""
    options = dict(max_num_seqs=1, max_model_len=256, dtype="bfloat16")
    chosen = LLM(embedded_model_path, **options)
    head = lm_head_of(chosen)
    if head.low_precision is None or 1 not in head.low_precision.rows:
        pytest.skip("start-up timing kept the dense head at one row on this CPU")
    dense = LLM(embedded_model_path, **options)
    lm_head_of(dense).low_precision = None
    reference = LLM(embedded_model_path, **{**options, "dtype": "float32"})
    return chosen, dense, reference


def lm_head_of(llm: LLM) -> LMHead:
    (head,) = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, LMHead)]
    return head


def test_the_head_multiplies_by_the_copy_at_the_row_counts_chosen(engines):
    chosen, _dense, _reference = engines
    head = lm_head_of(chosen)
    route = head.low_precision
    (decision,) = [line for line in chosen.llm_engine.describe_route().splitlines()
                   if line.startswith("decision: LM head")]
    assert "CPU_WEIGHT_ONLY" in decision and f"within {HEAD_DRIFT_BOUND}" in decision
    assert any(line.startswith("route lm_head: CPU_WEIGHT_ONLY")
               for line in chosen.llm_engine.describe_route().splitlines())
    for rows in (1, HEAD_ROWS[-1], HEAD_ROWS[-1] + 1):
        hidden = torch.randn(rows, head.weight.shape[1]).to(torch.bfloat16)
        with torch.inference_mode():
            logits = head(hidden)
            dense = torch.nn.functional.linear(hidden, head.weight).float()
            low = route.logits(hidden)
        assert not torch.equal(low, dense)
        assert torch.equal(logits, low if rows in route.rows else dense), rows


def greedy(llm: LLM, prompts_ids: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts_ids], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def scored(llm: LLM, prompts_ids: list[list[int]], tokens: list[list[int]]
           ) -> list[float]:
    """The log-prob of each of ``tokens`` after its prompt and the tokens before it."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids + t} for ids, t in zip(prompts_ids, tokens,
                                                                         strict=True)],
                        params, use_tqdm=False)
    return [row[t].logprob for out, ids, toks in zip(outs, prompts_ids, tokens, strict=True)
            for row, t in zip(out.prompt_logprobs[len(ids):], toks, strict=True)]


def agreement(tokens: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b),
                len(reference))


def test_the_copy_is_within_the_bound_and_nearer_float32_than_the_dense_head(engines):
    """benchmarks/cpu_route_accuracy.py's measurement: the float32 expansion's greedy
    tokens of each fixed prompt, scored by each head (the copy at every row count, so
    that a prompt's log-probs take it too); and the greedy tokens of each, decoded one
    row a step (the row count the copy serves as chosen)."""
    chosen, dense, reference = engines
    prompts_ids = chat_prompts(reference)
    exact_tokens = greedy(reference, prompts_ids)
    exact = scored(reference, prompts_ids, exact_tokens)
    copy = lm_head_of(chosen).low_precision
    decoded = greedy(chosen, prompts_ids)
    every_row_count = dataclasses.replace(copy, rows=range(1, 1 << 30))
    lm_head_of(chosen).low_precision = every_row_count
    try:
        ours = scored(chosen, prompts_ids, exact_tokens)
    finally:
        lm_head_of(chosen).low_precision = copy
    theirs = scored(dense, prompts_ids, exact_tokens)
    drift = [abs(a - b) for a, b in zip(ours, exact, strict=True)]
    dense_drift = [abs(a - b) for a, b in zip(theirs, exact, strict=True)]
    assert ours != theirs                   # the copy is what ran
    assert max(drift) <= HEAD_DRIFT_BOUND, (max(drift), max(dense_drift))
    assert sum(drift) <= sum(dense_drift), (sum(drift), sum(dense_drift))
    dense_decoded = greedy(dense, prompts_ids)
    for ids, dense_ids, exact_ids in zip(decoded, dense_decoded, exact_tokens, strict=True):
        assert agreement(ids, exact_ids) >= agreement(dense_ids, exact_ids), (
            ids, dense_ids, exact_ids)


def chat_prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for p in PROMPTS]
