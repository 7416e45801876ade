"""From a validated request body to engine inputs: SamplingParams and the context check.

Everything here depends on the served model (context length, vocabulary), which is why
it is not in the pydantic models. Every failure is an OpenAIError with status 400.
"""

from __future__ import annotations

from typing import Any

from archserve.engine.sampling_params import SamplingParams
from archserve.serve.errors import OpenAIError
from archserve.serve.protocol import SamplingFields


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int,
                       what: str = "messages", default: int | None = None) -> int:
    """The completion budget, or a 400 that states the lengths (as vLLM words it).

    Without ``requested``: ``default`` (the server's) or else the rest of the context, as
    in vLLM; a default never exceeds what the context has left."""
    if prompt_len >= max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input "
            f"{what}.", param="max_tokens" if requested else "messages")
    if requested is None:
        return min(default or max_model_len, max_model_len - prompt_len)
    if prompt_len + requested > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the {what}, "
            f"{requested} in the completion). Please reduce the length of the {what} or "
            f"completion.", param="max_tokens")
    return requested


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(f"token ids must be in [0, {vocab_size}); got {bad[:5]}", param=param)


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not bias:
        return None
    try:
        parsed = {int(token): float(value) for token, value in bias.items()}
    except ValueError:
        raise OpenAIError("logit_bias keys must be token ids", param="logit_bias") from None
    check_token_ids(list(parsed), vocab_size, "logit_bias")
    return parsed


def reject_unsupported(req: SamplingFields) -> None:
    """Say no clearly to what archserve does not do, instead of silently ignoring it."""
    fmt = req.response_format
    if fmt and fmt.get("type", "text") != "text":
        raise OpenAIError(f"response_format type {fmt.get('type')!r} (structured output) is "
                          "not supported", param="response_format")
    if req.tools:
        raise OpenAIError("tool calling is not supported", param="tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise OpenAIError("tool calling is not supported", param="tool_choice")


def truncated(ids: list[int], req: SamplingFields) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (before any length check)."""
    k = req.truncate_prompt_tokens
    return ids[-k:] if k else ids


def sampling_params_for(req: SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None, vocab_size: int,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
    """SamplingParams for the request; a field it left out takes the server's default
    (generation_config.json, see generation_defaults.py) or else OpenAI's."""
    def pick(name: str, fallback):
        value = getattr(req, name)
        return value if value is not None else (defaults or {}).get(name, fallback)

    if req.stop_token_ids:
        check_token_ids(req.stop_token_ids, vocab_size, "stop_token_ids")
    if req.allowed_token_ids:
        check_token_ids(req.allowed_token_ids, vocab_size, "allowed_token_ids")
    reject_unsupported(req)
    logit_bias = parse_logit_bias(req.logit_bias, vocab_size)
    if req.min_tokens > max_tokens:
        raise OpenAIError(f"min_tokens ({req.min_tokens}) must not exceed max_tokens "
                          f"({max_tokens})", param="min_tokens")
    try:
        return SamplingParams(
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=req.stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens, logit_bias=logit_bias,
            allowed_token_ids=req.allowed_token_ids)
    except ValueError as exc:
        raise OpenAIError(str(exc)) from None
