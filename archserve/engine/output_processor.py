"""Output processing: what the engine makes of a step's sampled tokens.

Per sequence that got a token: its logprobs (top-N, decoded), incremental detokenizing,
stop strings (which finish the sequence through the scheduler), and the ``RequestOutput``
of each request it advanced (cumulative, or only the new part for DELTA requests, holding
back text a stop string could still claim). The engine owns the requests; this module
owns how their outputs are built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from archserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from archserve.engine.sampler import SamplerOutput
from archserve.engine.sampling_params import RequestOutputKind, SamplingParams
from archserve.engine.sequence import Sequence, SequenceStatus
from archserve.engine.stop_checker import find_stop_string


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    detokenizers: list = field(default_factory=list)
    sent: list = field(default_factory=list)   # per sequence (text, tokens) already output
    num_cached_tokens: int = 0                 # prompt tokens found in the prefix cache
    grammar: Future | None = None              # its grammar's compilation (structured output)
    lora_request: Any = None                   # the LoRARequest it runs with, if any


class OutputProcessor:
    """Builds the outputs of ``requests`` (the engine's live dict, shared) from sampled
    tokens; ``finish_seq(seq, status, stop_reason=...)`` ends a sequence a stop string hit."""

    def __init__(self, tokenizer: Any, requests: dict[str, RequestState],
                 finish_seq: Callable[..., None]) -> None:
        self.tokenizer = tokenizer
        self.requests = requests
        self.finish_seq = finish_seq

    def process_sampled(self, result: SamplerOutput,
                        emitted: list[tuple[Sequence, list[int]]]) -> list[RequestOutput]:
        """Logprobs, detokenizing, stop strings and outputs of the sequences that got tokens.

        ``result`` is the sampler's output copied to the host; ``emitted`` holds each
        sequence that got tokens with the rows of ``result`` they came from, in order (one
        row, or with speculative decoding one per accepted draft and the token after).
        Tokens are taken one at a time, as separate steps would take them: a stop string
        completed by one drops the tokens after it."""
        columns = _SampledColumns(result)
        touched: dict[str, RequestState] = {}
        now = time.time()
        for seq, rows in emitted:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            n = seq.sampling_params.logprobs
            for i, row in enumerate(rows):
                if n is not None:
                    seq.output_logprobs.append(self._logprobs_of_row(columns, row, n))
                later = len(rows) - 1 - i     # tokens of this step after this one
                if self._detokenize(state, seq, later) and later:
                    dropped = rows[i + 1:]
                    seq.drop_newest_tokens(later, [columns.logprobs[r] for r in dropped]
                                           if columns.logprobs is not None else ())
                    break
            touched[seq.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            finished = all(s.is_finished for s in state.seqs)
            if finished:
                state.metrics.finished_time = now
                del self.requests[request_id]
            elif state.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(self.request_output(state, finished))
        return outputs

    def _detokenize(self, state: RequestState, seq: Sequence, later: int) -> bool:
        """Detokenize the output token that has ``later`` tokens after it; True when a
        stop string completed there ended the sequence."""
        params = seq.sampling_params
        if not params.detokenize or self.tokenizer is None:
            return False
        detok = state.detokenizers[seq.index]
        ends_here = seq.is_finished and later == 0
        stopped_by_token = ends_here and seq.status is SequenceStatus.FINISHED_STOPPED
        # The stop token's text is not part of the output (vLLM semantics).
        drop_last = stopped_by_token and not params.include_stop_str_in_output
        if params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop_strings:
            # Nobody reads the text before the end: detokenize once, when it finishes.
            if ends_here:
                ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
                seq.output_text = detok.add_tokens(list(ids)) + detok.finish()
            return False
        if drop_last:
            seq.output_text += detok.finish()
            return False
        delta = detok.add_tokens([seq.output_token_ids[-1 - later]])
        if ends_here:
            delta += detok.finish()
        seq.output_text += delta
        if not params.stop_strings or seq.num_output_tokens - later < params.min_tokens:
            return False
        hit = find_stop_string(seq.output_text, len(delta), params.stop_strings)
        if hit is None:
            return False
        index, matched = hit
        end = index + len(matched) if params.include_stop_str_in_output else index
        seq.output_text = seq.output_text[:end]
        self.finish_seq(seq, SequenceStatus.FINISHED_STOPPED, stop_reason=matched)
        return True

    def _logprobs_of_row(self, columns: _SampledColumns, row: int, n: int) -> dict:
        """The sampled token's logprob entry of ``row``, with the row's top ``n``."""
        token = columns.ids[row]
        entry = {token: Logprob(columns.logprobs[row], columns.ranks[row],
                                self._decode_one(token))}
        if n and columns.top_ids is not None:
            for rank, (tid, lp) in enumerate(zip(columns.top_ids[row][:n],
                                                 columns.top_logprobs[row][:n], strict=True),
                                             start=1):
                entry.setdefault(tid, Logprob(lp, rank, self._decode_one(tid)))
        return entry

    def record_prompt_logprobs(self, prompt_lps) -> None:
        for seq, first_pos, logprobs, targets in prompt_lps:
            state = self.requests.get(seq.request_id)
            # By identity: a request id reused after an abort must not get the old one's rows.
            if (state is None or state.prompt_logprobs is None
                    or not any(s is seq for s in state.seqs)):
                continue
            have = len(state.prompt_logprobs)          # entries for positions 0..have-1
            skip = have - (first_pos + 1)             # rows already recorded (recompute)
            if skip < 0 or skip >= targets.numel():
                continue
            n = seq.sampling_params.prompt_logprobs
            tok_lp = logprobs.gather(1, targets[:, None]).squeeze(1)
            ranks = (logprobs > tok_lp[:, None]).sum(-1) + 1
            top_v, top_i = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1) if n else (None, None)
            for r in range(skip, targets.numel()):
                tid = int(targets[r])
                entry = {tid: Logprob(float(tok_lp[r]), int(ranks[r]), self._decode_one(tid))}
                if n:
                    for rank, (v, t) in enumerate(zip(top_v[r].tolist(), top_i[r].tolist(), strict=True), 1):
                        entry.setdefault(t, Logprob(v, rank, self._decode_one(t)))
                state.prompt_logprobs.append(entry)

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def request_output(self, state: RequestState, finished: bool) -> RequestOutput:
        delta = state.params.output_kind is RequestOutputKind.DELTA
        wants_logprobs = state.params.logprobs is not None
        completions = []
        for s in state.seqs:
            text_from, tokens_from = state.sent[s.index] if delta else (0, 0)
            text_to = visible_text_length(s)
            completions.append(CompletionOutput(
                index=s.index, text=s.output_text[text_from:text_to],
                token_ids=s.output_token_ids[tokens_from:],
                cumulative_logprob=s.cumulative_logprob if wants_logprobs else None,
                logprobs=s.output_logprobs[tokens_from:] if wants_logprobs else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                num_generated_tokens=s.num_output_tokens))
            if delta:
                state.sent[s.index] = (max(text_from, text_to), s.num_output_tokens)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs, outputs=completions, finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            lora_request=state.lora_request)


class _SampledColumns:
    """The sampler's host output as Python lists, made once a step."""

    def __init__(self, result: SamplerOutput) -> None:
        def listed(tensor):  # noqa: ANN001, ANN202
            return None if tensor is None else tensor.tolist()

        self.ids = listed(result.sampled_token_ids)
        self.logprobs = listed(result.sampled_logprobs)
        self.ranks = listed(result.sampled_ranks)
        self.top_ids = listed(result.topn_token_ids)
        self.top_logprobs = listed(result.topn_logprobs)


def visible_text_length(seq: Sequence) -> int:
    """How much of a running sequence's text may be shown: while a stop string could still
    be completing at its end, the last ``len(longest stop) - 1`` characters wait (text once
    shown cannot be taken back when the stop string truncates it)."""
    params = seq.sampling_params
    if seq.is_finished or not params.stop_strings or params.include_stop_str_in_output:
        return len(seq.output_text)
    hold = max(len(stop) for stop in params.stop_strings) - 1
    return max(0, len(seq.output_text) - hold)
