"""From a validated request body to engine inputs: SamplingParams and the context check.

Everything here depends on the served model (context length, vocabulary), which is why
it is not in the pydantic models. Every failure is an OpenAIError with status 400.
"""

from __future__ import annotations

from typing import Any

from archserve.engine.sampling_params import RequestOutputKind, SamplingParams
from archserve.serve.errors import OpenAIError
from archserve.serve.protocol import SamplingFields
from archserve.structured import StructuredOutputsParams


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int,
                       what: str = "messages", default: int | None = None) -> int:
    """The completion budget, or a 400 that states the lengths (as vLLM words it).

    Without ``requested``: ``default`` (the server's) or else the rest of the context, as
    in vLLM; a default never exceeds what the context has left."""
    if prompt_len >= max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input "
            f"{what}.", param=what)
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


def structured_spec(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that gave it (for error messages).

    OpenAI's ``response_format`` (json_object, json_schema; text is no constraint),
    vLLM's ``structured_outputs`` {json, regex, choice, grammar, json_object,
    structural_tag} and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar``. Only the shape is checked here; compiling is ``ServingContext``'s.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            body = fmt.get("json_schema")
            schema = body.get("schema") if isinstance(body, dict) else None
            if not isinstance(schema, dict):
                raise OpenAIError("response_format json_schema needs json_schema.schema, a "
                                  "JSON schema object", param="response_format.json_schema")
            found.append(("response_format", {"json": schema}))
        elif kind == "structural_tag":
            found.append(("response_format", {"structural_tag": fmt}))
        elif kind != "text":
            raise OpenAIError(f"response_format type must be text, json_object, json_schema "
                              f"or structural_tag; got {kind!r}", param="response_format.type")
    if req.structured_outputs is not None:
        unknown = set(req.structured_outputs) - _STRUCTURED_KEYS
        if unknown:
            raise OpenAIError(f"structured_outputs has unknown field(s) {sorted(unknown)}; "
                              f"known: {sorted(_STRUCTURED_KEYS)}", param="structured_outputs")
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", {name: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise OpenAIError("give one output constraint; got " + ", ".join(f for f, _ in found),
                          param=found[1][0])
    param, fields = found[0]
    if param == "structured_outputs" and isinstance(fields.get("choice"), list):
        fields["choice"] = tuple(fields["choice"])
    for ignored in ("disable_fallback", "disable_additional_properties", "whitespace_pattern",
                    "backend"):
        fields.pop(ignored, None)
    try:
        return StructuredOutputsParams(**fields), param
    except (ValueError, TypeError) as exc:
        raise OpenAIError(str(exc), param=param) from None


_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag",
                    "disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                    "whitespace_pattern", "backend"}


def truncated(ids: list[int], req: SamplingFields) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (before any length check)."""
    k = req.truncate_prompt_tokens
    return ids[-k:] if k else ids


def returned_prompt_logprobs(req: SamplingFields) -> int | None:
    """The prompt_logprobs a response carries: none in a stream (vLLM refuses k > 0 there,
    and k = 0 asks for nothing), so the engine computes none for it either (they would also
    keep the prompt out of the prefix cache)."""
    return None if getattr(req, "stream", False) else req.prompt_logprobs


def sampling_params_for(req: SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None, vocab_size: int,
                        defaults: dict[str, Any] | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams for the request; a field it left out takes the server's default
    (generation_config.json, see generation_defaults.py) or else OpenAI's."""
    def pick(name: str, fallback):
        value = getattr(req, name)
        return value if value is not None else (defaults or {}).get(name, fallback)

    if req.prompt_logprobs and getattr(req, "stream", False):   # 0 asks for none (vLLM)
        raise OpenAIError("`prompt_logprobs` are not available when `stream=True`.",
                          param="prompt_logprobs")
    if req.stop_token_ids:
        check_token_ids(req.stop_token_ids, vocab_size, "stop_token_ids")
    if req.allowed_token_ids:
        check_token_ids(req.allowed_token_ids, vocab_size, "allowed_token_ids")
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
            allowed_token_ids=req.allowed_token_ids, structured_outputs=structured,
            # A stream takes each step's new text and tokens (no copy of what was sent);
            # a plain response needs only the end.
            output_kind=(RequestOutputKind.DELTA if getattr(req, "stream", False)
                         else RequestOutputKind.FINAL_ONLY))
    except ValueError as exc:
        raise OpenAIError(str(exc)) from None
