"""With temperature > 0, verified drafts leave the output distribution the target's.

The prompt repeats four tokens and each request may sample only those four
(allowed_token_ids), so n-gram lookup always drafts, and a draft is accepted about as
often as it is rejected. The tiny model's weights are drawn wider than usual, so its next
token depends strongly on the one before: a token drawn under the wrong context (a row
used after its draft was rejected) shows in the distribution. Thousands of unseeded requests give the empirical distribution of
the first three output tokens (64 outcomes); transformers, on the same weights, gives
their exact probabilities; a chi-square goodness-of-fit test must not reject them. The
same test on plain decoding is the control.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from archserve import LLM, SamplingParams

NUM_SAMPLES = 6000
TEMPERATURE = 1.0
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
         "prompt_lookup_min": 1}


def chi_square_p_value(observed: Counter, expected: dict, total: int) -> float:
    """p-value of Pearson's chi-square goodness of fit; outcomes expected fewer than 5
    times are pooled into one cell."""
    small = [k for k, p in expected.items() if p * total < 5]
    cells = [(observed.get(k, 0), p * total) for k, p in expected.items() if k not in small]
    if small:
        cells.append((sum(observed.get(k, 0) for k in small),
                      sum(expected[k] for k in small) * total))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(path, prompt ids, the four allowed tokens, exact probability of each outcome)."""
    from tiny_checkpoints import build_tiny_checkpoint
    from transformers import AutoModelForCausalLM
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-wide")), "llama",
                                 tie_word_embeddings=False, initializer_range=0.1)
    allowed = [40, 114, 240, 306]
    prompt = [1] + allowed * 3
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    index = torch.tensor(allowed)

    def next_probs(prefix: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prefix])).logits[0, -1].double()
        return torch.softmax(logits[index] / TEMPERATURE, dim=-1)

    exact = {}
    first = next_probs(prompt)
    for a in range(4):
        second = next_probs(prompt + [allowed[a]])
        for b in range(4):
            third = next_probs(prompt + [allowed[a], allowed[b]])
            for c in range(4):
                exact[(allowed[a], allowed[b], allowed[c])] = float(first[a] * second[b]
                                                                    * third[c])
    return path, prompt, allowed, exact


@pytest.mark.parametrize("speculative_config", [NGRAM, None], ids=["ngram", "plain"])
def test_sampled_tokens_follow_the_targets_distribution(setup, speculative_config):
    path, prompt, allowed, exact = setup
    assert sum(exact.values()) == pytest.approx(1.0)
    llm = LLM(path, max_num_seqs=256, speculative_config=speculative_config)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True,
                            allowed_token_ids=allowed, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * NUM_SAMPLES, params)
    observed = Counter(tuple(o.outputs[0].token_ids) for o in outputs)
    assert set(observed) <= set(itertools.product(allowed, repeat=3))
    assert chi_square_p_value(observed, exact, NUM_SAMPLES) > 1e-3
    if speculative_config is not None:
        stats = llm.llm_engine.speculator.stats
        # Drafts were verified on most requests, and hundreds were accepted and rejected.
        assert stats.num_drafts > NUM_SAMPLES // 2
        assert 300 < stats.num_accepted_tokens < stats.num_draft_tokens - 300
