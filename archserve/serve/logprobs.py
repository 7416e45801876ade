"""Engine logprobs (token id -> Logprob per position) in the two OpenAI formats."""

from __future__ import annotations

from archserve.engine.outputs import LogprobsDict
from archserve.serve.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)


def _token_text(tokenizer, token_id: int, entry: LogprobsDict | None) -> str:
    if entry is not None and token_id in entry and entry[token_id].decoded_token is not None:
        return entry[token_id].decoded_token
    return tokenizer.decode([token_id])


def _top(tokenizer, entry: LogprobsDict, num: int) -> list[tuple[str, float]]:
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))
    return [(_token_text(tokenizer, tid, entry), lp.logprob) for tid, lp in ranked
            if lp.rank is not None and lp.rank <= num][:num]


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[LogprobsDict | None],
                        num: int, text_start: int) -> CompletionLogprobs:
    """OpenAI completions format; ``text_start`` is where this text begins in the choice."""
    out = CompletionLogprobs()
    offset = text_start
    for token_id, entry in zip(token_ids, entries, strict=False):
        token = _token_text(tokenizer, token_id, entry)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if entry is None or token_id not in entry:    # the first prompt token has none
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry[token_id].logprob)
        top = dict(_top(tokenizer, entry, num))
        top.setdefault(token, entry[token_id].logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[LogprobsDict | None],
                  num: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None or token_id not in entry:
            continue
        token = _token_text(tokenizer, token_id, entry)
        content.append(ChatTokenLogprob(
            token=token, logprob=entry[token_id].logprob, bytes=list(token.encode()),
            top_logprobs=[ChatTopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                          for t, lp in _top(tokenizer, entry, num)]))
    return ChatLogprobs(content=content)


def prompt_logprobs(tokenizer, token_ids: list[int], entries: list[LogprobsDict | None],
                    num: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt position (None for the first) the prompt token's
    entry and those of the ``num`` most likely tokens there, keyed by token id."""
    out: PromptLogprobs = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None or token_id not in entry:
            out.append(None)
            continue
        kept = {tid: lp for tid, lp in entry.items()
                if tid == token_id or (lp.rank is not None and lp.rank <= num)}
        out.append({str(tid): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                            decoded_token=_token_text(tokenizer, tid, entry))
                    for tid, lp in kept.items()})
    return out
