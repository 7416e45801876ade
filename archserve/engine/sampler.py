"""Sampler: next tokens for a batch of logits, vectorised on the logits' device.

Per step the engine builds one ``SamplingBatch`` (per-row parameters as tensors) and
calls ``Sampler.sample``. Processing order, as in vLLM:

    raw logits -> logit_bias -> allowed_token_ids -> grammar bitmask (constrained rows)
    -> min_tokens (stop tokens masked) -> repetition/frequency/presence
    penalties -> [greedy rows: argmax here] -> temperature -> min_p -> top_k/top_p
    -> exponential race

Random rows draw ``argmax(probs / q)`` with ``q ~ Exp(1)``, which samples exactly from
``probs``. Unseeded rows share one batch-wide draw; a seeded row draws its ``q`` from a
generator re-seeded with (seed, sequence index, output position), so its tokens depend
on nothing else: not on batch row, neighbours, or preemption and recomputation.

Returned logprobs are the model's raw distribution (log_softmax of the unprocessed
logits), vLLM's default; ranks are 1-based (1 = the most likely token).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
import torch

from archserve.engine.batch import host_to_device
from archserve.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, seq_index: int, step: int) -> int:
    """Generator seed for one draw of one seeded sequence; a pure function of its inputs."""
    key = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ seq_index) ^ step)
    return key >> 1  # 63 bits: accepted by every torch.Generator


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device
                  ) -> torch.Tensor:
    """float32 [len(rows), vocab_size]: how often each token occurs in each row's list."""
    width = max(1, max(len(r) for r in rows))
    ids = np.zeros((len(rows), width), dtype=np.int64)
    valid = np.zeros((len(rows), width), dtype=np.float32)  # padding adds 0 to token 0
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        valid[i, :len(r)] = 1.0
    counts = torch.zeros((len(rows), vocab_size), dtype=torch.float32, device=device)
    return counts.scatter_add_(1, host_to_device(ids, device), host_to_device(valid, device))


# The rows of the one host array of per-row scalars that ``SamplingBatch.from_sequences``
# fills and copies to the device in one transfer.
(_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION_PENALTY, _FREQUENCY_PENALTY, _PRESENCE_PENALTY,
 _GREEDY, _NUM_SCALARS) = range(8)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, on the logits' device.

    Optional tensors are None when no row uses the feature, so the sampler skips it.
    """

    temperature: torch.Tensor | None          # float32 [B]; 1.0 on greedy rows
    greedy: torch.Tensor | None               # bool [B]
    all_greedy: bool                          # (then the two above are None: unused)
    top_k: torch.Tensor | None = None         # int64 [B]; vocab size on rows without top-k
    max_top_k: int | None = None              # host max of top_k
    top_p: torch.Tensor | None = None         # float32 [B]; 1.0 on rows without top-p
    min_p: torch.Tensor | None = None         # float32 [B]
    repetition_penalty: torch.Tensor | None = None   # float32 [B]
    frequency_penalty: torch.Tensor | None = None    # float32 [B]
    presence_penalty: torch.Tensor | None = None     # float32 [B]
    repetition_mask: torch.Tensor | None = None  # bool [B, V]: token in prompt or output
    output_counts: torch.Tensor | None = None # float32 [B, V]: occurrences in the output
    blocked_rows: torch.Tensor | None = None  # int64 [M]: (row, token) pairs masked to -inf
    blocked_tokens: torch.Tensor | None = None  # int64 [M] (stop tokens before min_tokens)
    bias_rows: torch.Tensor | None = None     # int64 [K]: (row, token, value) logit biases
    bias_tokens: torch.Tensor | None = None   # int64 [K]
    bias_values: torch.Tensor | None = None   # float32 [K]
    allowed_mask: torch.Tensor | None = None  # bool [B, V]: False where a row may not sample
    grammar_rows: torch.Tensor | None = None  # int64 [M]: rows under a grammar
    grammar_bitmask: torch.Tensor | None = None  # int32 [M, ceil(V/32)]: their allowed tokens
    seeded_rows: tuple[int, ...] = ()         # random rows with their own generator
    seeded_keys: tuple[int, ...] = ()         # their draw seeds (see ``draw_seed``)
    max_num_logprobs: int = -1                # -1: no row asked; N: top-N for the widest ask

    @property
    def argmax_only(self) -> bool:
        """Every row greedy, nothing shapes the logits first, and no logprobs asked."""
        return (self.all_greedy and self.max_num_logprobs < 0 and self.output_counts is None
                and self.blocked_rows is None and self.bias_rows is None
                and self.allowed_mask is None and self.grammar_rows is None)

    @classmethod
    def from_sequences(cls, seqs: SequenceOf[Sequence], vocab_size: int,
                       device: torch.device | str,
                       eos_token_ids: Collection[int] = (),
                       pending_token: Callable[[Sequence], int] | None = None
                       ) -> SamplingBatch:
        """``pending_token(seq)``: the value of ``seq``'s pending token, from the step still
        in flight (asynchronous scheduling); only a grammar row asks for it, after this
        step's forward pass is queued, so waiting for it overlaps that pass."""
        if all(s.sampling_params.plain_greedy
               and s.num_output_tokens >= s.sampling_params.min_tokens for s in seqs):
            # The common batch-1 case, and a greedy server's: an argmax, nothing on the device.
            return cls(temperature=None, greedy=None, all_greedy=True)
        device = torch.device(device)
        n = len(seqs)
        scalars = np.empty((_NUM_SCALARS, n), dtype=np.float32)   # one transfer
        top_k = np.zeros(n, dtype=np.int64)
        seeded_rows: list[int] = []
        seeded_keys: list[int] = []
        blocked: list[tuple[int, int]] = []
        biases: list[tuple[int, int, float]] = []
        allowed_rows: list[tuple[int, list[int]]] = []
        grammar_rows: list[int] = []
        grammar_states: list = []
        max_logprobs = -1
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            greedy = p.greedy
            scalars[_TEMPERATURE, i] = 1.0 if greedy else p.temperature
            scalars[_TOP_P, i] = p.top_p
            scalars[_MIN_P, i] = p.min_p
            scalars[_REPETITION_PENALTY, i] = p.repetition_penalty
            scalars[_FREQUENCY_PENALTY, i] = p.frequency_penalty
            scalars[_PRESENCE_PENALTY, i] = p.presence_penalty
            scalars[_GREEDY, i] = greedy
            # Greedy rows keep 1: their argmax is taken before truncation anyway.
            top_k[i] = 1 if greedy else min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
            if p.seed is not None and not greedy:
                seeded_rows.append(i)
                seeded_keys.append(draw_seed(p.seed, seq.index, seq.num_output_tokens))
            grammar = seq.extra.get("grammar") if p.structured_outputs is not None else None
            if grammar is not None:
                grammar.catch_up(seq.output_token_ids, pending_token and (
                    lambda seq=seq: pending_token(seq)))
                grammar_rows.append(i)
                grammar_states.append(grammar)
            elif seq.num_output_tokens < p.min_tokens:   # a grammar decides where EOS goes
                stops = set(p.stop_token_ids)
                if not p.ignore_eos:
                    stops.update(eos_token_ids)
                blocked.extend((i, t) for t in stops if 0 <= t < vocab_size)
            if p.allowed_token_ids is not None:
                allowed_rows.append((i, p.allowed_token_ids))
            if p.logit_bias:
                biases.extend((i, t, b) for t, b in p.logit_bias.items() if t < vocab_size)
            if p.logprobs is not None:
                max_logprobs = max(max_logprobs, p.logprobs)

        greedy_rows = scalars[_GREEDY] > 0.5
        all_greedy = bool(greedy_rows.all())
        uses_rep = scalars[_REPETITION_PENALTY] != 1.0
        uses_output = ((scalars[_FREQUENCY_PENALTY] != 0.0)
                       | (scalars[_PRESENCE_PENALTY] != 0.0) | uses_rep)
        # Every row greedy and unpenalised (the common batch-1 case): the argmax needs no
        # per-row scalar on the device, so no host-to-device copy is made for them.
        dev = None if all_greedy and not uses_output.any() else host_to_device(scalars, device)
        batch = cls(temperature=None if all_greedy else dev[_TEMPERATURE],
                    greedy=None if all_greedy else dev[_GREEDY] > 0.5, all_greedy=all_greedy,
                    seeded_rows=tuple(seeded_rows), seeded_keys=tuple(seeded_keys),
                    max_num_logprobs=max_logprobs)
        random_rows = ~greedy_rows  # top-k/p and min-p cannot change a greedy row's argmax
        if (top_k[random_rows] < vocab_size).any():
            batch.top_k = host_to_device(top_k, device)
            batch.max_top_k = int(top_k.max())
        if (scalars[_TOP_P][random_rows] < 1.0).any():
            batch.top_p = dev[_TOP_P]
        if (scalars[_MIN_P][random_rows] > 0.0).any():
            batch.min_p = dev[_MIN_P]
        if blocked:
            pairs = host_to_device(np.asarray(blocked, dtype=np.int64).T.copy(), device)
            batch.blocked_rows, batch.blocked_tokens = pairs[0], pairs[1]
        if allowed_rows:
            restricted = torch.zeros((n, vocab_size), dtype=torch.bool)
            restricted[[i for i, _ in allowed_rows]] = True   # rows that have a list
            mask = ~restricted
            for i, ids in allowed_rows:
                mask[i, [t for t in ids if t < vocab_size]] = True
            batch.allowed_mask = mask.to(device, non_blocking=True)
        if grammar_rows:
            from archserve.structured.bitmask import fill_bitmask
            mask = fill_bitmask(grammar_states, vocab_size, sorted(eos_token_ids))
            batch.grammar_bitmask = host_to_device(mask.numpy(), device)
            batch.grammar_rows = host_to_device(np.asarray(grammar_rows, dtype=np.int64),
                                                device)
        if biases:
            rows_tokens = host_to_device(np.asarray([(r, t) for r, t, _ in biases],
                                                dtype=np.int64).T.copy(), device)
            batch.bias_rows, batch.bias_tokens = rows_tokens[0], rows_tokens[1]
            batch.bias_values = host_to_device(np.asarray([b for *_, b in biases],
                                                      dtype=np.float32), device)

        if uses_output.any():
            outputs = [s.output_token_ids if uses_output[i] else [] for i, s in enumerate(seqs)]
            batch.output_counts = _token_counts(outputs, vocab_size, device)
            batch.frequency_penalty = dev[_FREQUENCY_PENALTY]
            batch.presence_penalty = dev[_PRESENCE_PENALTY]
        if uses_rep.any():
            prompts = [s.prompt_token_ids if uses_rep[i] else [] for i, s in enumerate(seqs)]
            batch.repetition_mask = (_token_counts(prompts, vocab_size, device) > 0) | (
                batch.output_counts > 0)
            batch.repetition_penalty = dev[_REPETITION_PENALTY]
        return batch


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor           # int64 [B]
    sampled_logprobs: torch.Tensor | None = None  # float32 [B], raw model logprob of the
                                                  # token; None when no row asked logprobs
    sampled_ranks: torch.Tensor | None = None # int64 [B], 1-based; when any row asked logprobs
    topn_token_ids: torch.Tensor | None = None   # int64 [B, N]; N = widest ask (row i uses
    topn_logprobs: torch.Tensor | None = None    # float32 [B, N]   its own first n_i columns)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: ``logits.float().argmax(-1)``, in one Triton launch on GPUs where the
    fusion "greedy_argmax" is on (kernels/elementwise/triton_argmax.py)."""
    from archserve.kernels.elementwise import fusion_enabled
    if logits.is_cuda and fusion_enabled("greedy_argmax", logits.device):
        from archserve.kernels.elementwise.triton_argmax import (
            argmax_unsupported,
            triton_argmax,
        )
        if argmax_unsupported(logits) is None:
            return triton_argmax(logits)
    return logits.float().argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """HF repetition penalty over prompt+output; OpenAI frequency/presence over output."""
    counts = batch.output_counts
    if counts is None:
        return logits
    if batch.repetition_penalty is not None:
        rep = torch.where(batch.repetition_mask, batch.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - batch.frequency_penalty[:, None] * counts
    return logits - batch.presence_penalty[:, None] * (counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability < min_p * (top probability); in log space, no softmax."""
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, max_top_k: int | None = None) -> torch.Tensor:
    """Keep each row's ``top_k`` best tokens, then its smallest nucleus of mass >= ``top_p``.

    ``top_k`` holds each row's k (the vocabulary size for "all"); ``max_top_k`` is its
    host-side maximum. When every row is limited, a partial ``topk`` replaces the full
    sort of the vocabulary, which is what makes the common top_k + top_p case cheap.
    """
    vocab = logits.shape[-1]
    if top_k is not None and max_top_k is not None and max_top_k < vocab:
        values, order = logits.topk(max_top_k, dim=-1)       # sorted, descending
    else:
        values, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(values.shape[-1], device=logits.device)[None, :]
        values = values.masked_fill(positions >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # top_p == 1 means "off": guard it from cumsum rounding that would clip the tail.
        p = torch.where(top_p >= 1.0, torch.full_like(top_p, float("inf")), top_p)
        values = values.masked_fill(mass_before > p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, values)


class Sampler:
    def __init__(self, eos_token_ids: int | Collection[int] | None = None) -> None:
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.eos_token_ids = frozenset(eos_token_ids)
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, batch: SamplingBatch | SequenceOf[Sequence],
               pending_token: Callable[[Sequence], int] | None = None) -> SamplerOutput:
        """Sample one token per row of ``logits`` [B, V]; ``batch`` may be the B sequences
        (``pending_token``: see ``SamplingBatch.from_sequences``)."""
        if not isinstance(batch, SamplingBatch):
            batch = SamplingBatch.from_sequences(batch, logits.shape[-1], logits.device,
                                                 self.eos_token_ids, pending_token)
        if batch.argmax_only:   # a greedy batch-1 step's: between two graphs, so it counts
            return SamplerOutput(sampled_token_ids=greedy_argmax(logits))
        raw = logits.float()
        x = raw
        if batch.bias_rows is not None:   # OpenAI's logit_bias: added before anything else
            x = x.index_put((batch.bias_rows, batch.bias_tokens), batch.bias_values,
                            accumulate=True)
        if batch.allowed_mask is not None:
            x = x.masked_fill(~batch.allowed_mask, float("-inf"))
        if batch.grammar_rows is not None:
            from archserve.structured.bitmask import apply_bitmask
            x = apply_bitmask(x.clone() if x is raw else x, batch.grammar_bitmask,
                              batch.grammar_rows)
        if batch.blocked_rows is not None:
            x = x.index_put((batch.blocked_rows, batch.blocked_tokens),
                            x.new_full((), float("-inf")))   # no host-to-device copy
        x = apply_penalties(x, batch)
        greedy_tokens = x.argmax(dim=-1)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            x = x / batch.temperature[:, None]
            if batch.min_p is not None:
                x = apply_min_p(x, batch.min_p)
            if batch.top_k is not None or batch.top_p is not None:
                x = apply_top_k_top_p(x, batch.top_k, batch.top_p, batch.max_top_k)
            probs = x.softmax(dim=-1)
            q = self._exponentials(probs, batch)
            tokens = torch.where(batch.greedy, greedy_tokens, (probs / q).argmax(dim=-1))
        return self._logprobs(raw, tokens, batch.max_num_logprobs)

    def _exponentials(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        q = torch.empty_like(probs).exponential_()
        if batch.seeded_rows:
            gen = self._generator(probs.device)
            draws = []
            for key in batch.seeded_keys:
                gen.manual_seed(key)
                draws.append(torch.empty(probs.shape[-1], device=probs.device)
                             .exponential_(generator=gen))
            rows = host_to_device(np.asarray(batch.seeded_rows, dtype=np.int64), probs.device)
            q.index_copy_(0, rows, torch.stack(draws))
        # Exp(1) can round to 0; a tiny floor keeps 0/q at 0 instead of NaN.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, max_num_logprobs: int
                  ) -> SamplerOutput:
        if max_num_logprobs < 0:  # nobody reads them: no pass over the vocabulary for them
            return SamplerOutput(sampled_token_ids=tokens)
        lse = raw.logsumexp(dim=-1, keepdim=True)
        token_logits = raw.gather(1, tokens[:, None])
        out = SamplerOutput(sampled_token_ids=tokens,
                            sampled_logprobs=(token_logits - lse).squeeze(1))
        out.sampled_ranks = (raw > token_logits).sum(dim=-1) + 1
        if max_num_logprobs > 0:
            values, ids = raw.topk(min(max_num_logprobs, raw.shape[-1]), dim=-1)
            out.topn_token_ids, out.topn_logprobs = ids, values - lse
        return out
