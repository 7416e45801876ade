"""Sampler: greedy, truncation, penalties, seeds, distribution and logprobs."""

from __future__ import annotations

import pytest
import torch

from archserve.engine.sampler import Sampler, SamplingBatch, apply_penalties, apply_top_k_top_p
from archserve.engine.sampling_params import SamplingParams
from archserve.engine.sequence import Sequence

EOS = 3


def seqs_for(*params: SamplingParams, prompt=(1, 2), outputs=()) -> list[Sequence]:
    out = []
    for i, p in enumerate(params):
        s = Sequence(f"r{i}", list(prompt), p)
        for t in outputs:
            s.append_token(t)
        out.append(s)
    return out


def sample(logits: torch.Tensor, seqs: list[Sequence]):
    return Sampler(eos_token_ids=EOS).sample(logits, seqs)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_is_argmax_even_next_to_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3)] * 3
    out = sample(logits, seqs_for(*params))
    greedy_rows = [0, 2, 4]
    assert out.sampled_token_ids[greedy_rows].tolist() == logits[greedy_rows].argmax(-1).tolist()


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(top_k=1, top_p=0.5),
                                    SamplingParams(min_p=1.0, temperature=2.0)])
def test_truncation_to_one_token_equals_greedy(params):
    torch.manual_seed(1)
    logits = torch.randn(32, 257)
    out = sample(logits, seqs_for(*[params] * 32))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_top_k_samples_only_the_k_best():
    torch.manual_seed(2)
    logits = torch.randn(1, 50).repeat(4000, 1)
    out = sample(logits, seqs_for(*[SamplingParams(top_k=3)] * 4000))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(out.sampled_token_ids.tolist()) == allowed


def naive_keep(row: torch.Tensor, k: int, p: float) -> set[int]:
    order = row.argsort(descending=True).tolist()[:k]
    probs = torch.softmax(row[order], -1).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(order, probs, strict=True):
        kept.append(token)
        mass += prob
        if mass >= p:
            break
    return set(kept)


@pytest.mark.parametrize("ks", [[5, 40, 2, 17], [5, 64, 0, 1]])
def test_top_k_top_p_keeps_the_same_tokens_as_a_per_row_reference(ks):
    torch.manual_seed(8)
    logits = torch.randn(4, 64) * 2
    params = [SamplingParams(top_k=k, top_p=tp) for k, tp in zip(ks, [0.9, 0.5, 1.0, 0.3],
                                                                   strict=True)]
    batch = SamplingBatch.from_sequences(seqs_for(*params), 64, "cpu")
    got = apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k)
    for i, p in enumerate(params):
        kept = set(torch.nonzero(torch.isfinite(got[i])).flatten().tolist())
        assert kept == naive_keep(logits[i], p.top_k or 64, p.top_p)
        assert torch.equal(got[i][list(kept)], logits[i][list(kept)])


def test_min_p_keeps_tokens_above_the_scaled_max():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])).repeat(4000, 1)
    torch.manual_seed(3)
    out = sample(logits, seqs_for(*[SamplingParams(min_p=0.3)] * 4000))
    # threshold 0.3 * 0.4 = 0.12: tokens 0, 1, 2 stay, renormalised.
    counts = torch.bincount(out.sampled_token_ids, minlength=5).float()
    expected = torch.tensor([0.4, 0.3, 0.15, 0.0, 0.0]) / 0.85
    assert chi_square(counts, expected) < 13.8   # df 2, p = 0.001


@pytest.mark.parametrize("params,transform", [
    (SamplingParams(), lambda p: p),
    (SamplingParams(temperature=0.5), lambda p: p ** 2 / (p ** 2).sum()),
    (SamplingParams(top_k=3), lambda p: torch.where(p >= p.sort(descending=True).values[2], p, 0)),
    (SamplingParams(top_p=0.75), lambda p: torch.where(p >= 0.2, p, 0)),  # 0.35+0.25+0.2 >= 0.75
])
def test_sampling_distribution(params, transform):
    probs = torch.tensor([0.35, 0.25, 0.2, 0.15, 0.05])
    n = 20000
    torch.manual_seed(4)
    out = sample(torch.log(probs).repeat(n, 1), seqs_for(*[params] * n))
    target = transform(probs)
    target = target / target.sum()
    counts = torch.bincount(out.sampled_token_ids, minlength=5).float()
    assert chi_square(counts, target) < 18.5     # df <= 4, p = 0.001


def test_seeded_draws_follow_the_distribution_across_seeds():
    probs = torch.tensor([0.5, 0.3, 0.2])
    params = [SamplingParams(seed=s) for s in range(3000)]
    out = sample(torch.log(probs).repeat(3000, 1), seqs_for(*params))
    counts = torch.bincount(out.sampled_token_ids, minlength=3).float()
    assert chi_square(counts, probs) < 13.8


def test_seeded_rows_ignore_batch_composition_and_order():
    torch.manual_seed(5)
    v = 1000
    mine = torch.randn(v)
    seeded = SamplingParams(seed=1234, temperature=1.0)
    tokens = []
    for trial in range(4):
        torch.manual_seed(100 + trial)             # neighbours and global RNG differ per trial
        n = 1 + trial * 3
        logits = torch.randn(n, v)
        row = trial % n
        logits[row] = mine
        params = [SamplingParams(temperature=0.7, seed=None if i % 2 else 99 + trial)
                  for i in range(n)]
        params[row] = seeded
        out = sample(logits, seqs_for(*params))
        tokens.append(int(out.sampled_token_ids[row]))
    assert len(set(tokens)) == 1


def test_seeded_draws_change_with_the_output_position_and_index():
    probs = torch.full((1, 1000), 1e-3)
    p = SamplingParams(seed=7)
    by_step = [int(sample(probs.log(), seqs_for(p, outputs=[5] * k)).sampled_token_ids[0])
               for k in range(6)]
    assert len(set(by_step)) > 1
    assert by_step == [int(sample(probs.log(), seqs_for(p, outputs=[5] * k)).sampled_token_ids[0])
                       for k in range(6)]
    a, b = seqs_for(p, p)
    b.index = 1                                    # n > 1 siblings draw differently
    pairs = set()
    for _step in range(5):
        for s in (a, b):
            s.append_token(5)
        out = sample(probs.log().repeat(2, 1), [a, b])
        pairs.add(tuple(out.sampled_token_ids.tolist()))
    assert any(x != y for x, y in pairs)


def test_penalties_match_a_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    (s,) = seqs_for(params, prompt=(0,), outputs=(1, 1, 2))
    batch = SamplingBatch.from_sequences([s], 5, "cpu")
    got = apply_penalties(logits, batch)
    # token 0: prompt only, positive -> 2 / 2
    # token 1: output x2, negative -> -1 * 2 - 0.5 * 2 - 0.25
    # token 2: output x1, positive -> 0.5 / 2 - 0.5 - 0.25
    expected = torch.tensor([[1.0, -3.25, -0.5, 3.0, 1.0]])
    assert torch.allclose(got, expected)


def test_penalties_change_greedy_choice_and_spare_other_rows():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0, 0.0]]).repeat(2, 1)
    penalised = SamplingParams(temperature=0, frequency_penalty=1.0)
    plain = SamplingParams(temperature=0)
    out = sample(logits, seqs_for(penalised, plain, outputs=(0,)))
    assert out.sampled_token_ids.tolist() == [1, 0]


def test_min_tokens_blocks_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 8.0, 1.0]])
    early = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    assert sample(logits, seqs_for(early, outputs=(1,))).sampled_token_ids.tolist() == [5]
    assert sample(logits, seqs_for(early, outputs=(1, 1))).sampled_token_ids.tolist() == [3]
    no_eos = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits, seqs_for(no_eos)).sampled_token_ids.tolist() == [3]


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_n():
    torch.manual_seed(6)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5, logprobs=3),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=2.0, logprobs=5)]
    out = sample(logits, seqs_for(*params, outputs=(4, 5)))
    ref = torch.log_softmax(logits, -1)
    tokens = out.sampled_token_ids
    assert torch.allclose(out.sampled_logprobs, ref.gather(1, tokens[:, None]).squeeze(1))
    ranks = (ref > ref.gather(1, tokens[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_ranks, ranks)
    assert out.sampled_ranks[1] == 1
    values, ids = ref.topk(5, dim=-1)
    assert torch.equal(out.topn_token_ids, ids)
    assert torch.allclose(out.topn_logprobs, values)


def test_no_logprob_extras_unless_asked():
    out = sample(torch.randn(2, 10), seqs_for(SamplingParams(), SamplingParams(temperature=0)))
    assert out.sampled_ranks is None and out.topn_token_ids is None
    assert out.sampled_logprobs is None  # not even the sampled token's: no vocabulary pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampler_matches_cpu_semantics():
    torch.manual_seed(7)
    v = 151_936
    logits = torch.randn(64, v, device="cuda")
    params = [SamplingParams(temperature=0), SamplingParams(top_k=50, top_p=0.9, seed=11),
              SamplingParams(min_p=0.05, repetition_penalty=1.1, logprobs=5),
              SamplingParams(temperature=0.7, seed=3)] * 16
    seqs = seqs_for(*params, outputs=(10, 11, 12))
    out = sample(logits, seqs)
    assert out.sampled_token_ids.device.type == "cuda"
    assert torch.equal(out.sampled_token_ids[0::4], logits[0::4].argmax(-1))
    # Seeded rows: same token when the batch is reversed.
    rev = sample(logits.flip(0), seqs[::-1])
    for row in range(64):
        if params[row % 4].seed is not None:
            assert int(rev.sampled_token_ids[63 - row]) == int(out.sampled_token_ids[row])
    assert torch.allclose(out.sampled_logprobs,
                          torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None])
                          .squeeze(1), atol=1e-5)


def test_logit_bias_steers_greedy_choice_and_is_per_row():
    from archserve.engine.sampler import Sampler
    from archserve.engine.sampling_params import SamplingParams
    from archserve.engine.sequence import Sequence
    logits = torch.zeros(2, 10)
    logits[:, 3] = 1.0
    biased = Sequence("a", [1, 2], SamplingParams(temperature=0.0, logit_bias={7: 5.0}))
    plain = Sequence("b", [1, 2], SamplingParams(temperature=0.0))
    out = Sampler().sample(logits, [biased, plain])
    assert out.sampled_token_ids.tolist() == [7, 3]
    banned = Sequence("c", [1, 2], SamplingParams(temperature=1.0, seed=0,
                                                  logit_bias={t: -100.0 for t in range(9)}))
    assert Sampler().sample(torch.zeros(1, 10), [banned]).sampled_token_ids.tolist() == [9]


def test_allowed_token_ids_restrict_only_their_row():
    from archserve.engine.sampler import Sampler
    from archserve.engine.sampling_params import SamplingParams
    from archserve.engine.sequence import Sequence
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    only = Sequence("a", [1], SamplingParams(temperature=0.0, allowed_token_ids=[6, 8]))
    free = Sequence("b", [1], SamplingParams(temperature=0.0))
    logits[:, 8] = 1.0
    out = Sampler().sample(logits, [only, free])
    assert out.sampled_token_ids.tolist() == [8, 3]


@pytest.mark.parametrize("extra", [dict(), dict(seed=7, top_k=5, top_p=0.5, min_p=0.1)])
def test_a_plain_greedy_batch_is_an_argmax_with_nothing_on_the_device(extra):
    """Greedy rows whose argmax nothing else shapes take the short way (no per-row arrays);
    each feature that does shape it, or asks for more, takes the full one."""
    plain = SamplingParams(temperature=0, **extra)
    batch = SamplingBatch.from_sequences(seqs_for(plain, plain), 8, "cpu")
    assert batch.all_greedy and batch.max_num_logprobs == -1
    assert all(getattr(batch, name) is None for name in (
        "temperature", "greedy", "top_k", "top_p", "min_p", "blocked_rows", "bias_rows",
        "allowed_mask", "grammar_rows", "output_counts", "repetition_mask"))
    logits = torch.randn(2, 8)
    assert sample(logits, seqs_for(plain, plain)).sampled_token_ids.tolist() == \
        logits.argmax(-1).tolist()
    from archserve.structured.params import StructuredOutputsParams
    shaped = {"logprobs": 0, "logit_bias": {1: 5.0}, "allowed_token_ids": [1, 2],
              "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.3,
              "temperature": 0.7, "structured_outputs": StructuredOutputsParams(regex="a+")}
    for name, value in shaped.items():
        assert not SamplingParams(**{"temperature": 0, **extra, name: value}).plain_greedy, name
    # min_tokens depends on the sequence: below it, its stop tokens are blocked.
    early = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4], **extra)
    assert SamplingBatch.from_sequences(seqs_for(early), 8, "cpu").blocked_rows is not None
    done = SamplingBatch.from_sequences(seqs_for(early, outputs=(1, 1)), 8, "cpu")
    assert done.all_greedy and done.blocked_rows is None


def test_only_a_batch_nothing_shapes_takes_the_argmax_kernel():
    """``argmax_only`` (the sampler's one-launch argmax on GPUs): every row greedy, no
    logprobs, and none of the features that change the logits before the argmax."""
    def batch(**fields) -> SamplingBatch:
        return SamplingBatch(temperature=None, greedy=None, all_greedy=True, **fields)
    assert batch().argmax_only
    assert not SamplingBatch(temperature=torch.ones(1), greedy=torch.zeros(1, dtype=torch.bool),
                             all_greedy=False).argmax_only
    some = torch.zeros(1)
    for name in ("output_counts", "blocked_rows", "bias_rows", "allowed_mask", "grammar_rows"):
        assert not batch(**{name: some}).argmax_only, name
    assert not batch(max_num_logprobs=0).argmax_only
