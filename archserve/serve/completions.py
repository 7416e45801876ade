"""POST /v1/completions: prompts in, text (or SSE chunks) out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from archserve.engine.outputs import RequestOutput
from archserve.serve.context import ServingContext
from archserve.serve.errors import OpenAIError
from archserve.serve.logprobs import completion_logprobs, prompt_logprobs
from archserve.serve.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    now,
    random_id,
)
from archserve.serve.sampling import (
    check_token_ids,
    resolve_max_tokens,
    returned_prompt_logprobs,
    sampling_params_for,
    structured_spec,
    truncated,
)
from archserve.serve.streams import (
    PendingTokens,
    logging_disconnect,
    merge,
    sse,
    sse_stream,
    unless_disconnected,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _prompts(ctx: ServingContext, prompt) -> list[tuple[str, list[int]]]:
    """Each prompt as (text, token ids); token-id prompts are decoded for ``echo``."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise OpenAIError("prompt must not be empty", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = ctx.encode(item, "prompt")
            text = item
        else:
            ids = list(item)
            check_token_ids(ids, ctx.vocab_size, "prompt")
            text = ctx.tokenizer.decode(ids) if ids else ""
        if not ids:
            raise OpenAIError("prompt must not be empty", param="prompt")
        out.append((text, ids))
    return out


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    lora_request = ctx.check_model(req.model)
    if req.suffix:
        raise OpenAIError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError("best_of must equal n (or be omitted)", param="best_of")
    if req.tools or req.tool_choice not in (None, "none"):
        raise OpenAIError("tools are for /v1/chat/completions", param="tools")
    structured, structured_param = structured_spec(req)
    prompts = [(text, truncated(ids, req)) for text, ids in _prompts(ctx, req.prompt)]
    # The engine's prompt log-probs serve both echo's logprobs and vLLM's prompt_logprobs.
    wanted = [k for k in (req.logprobs if req.echo else None, returned_prompt_logprobs(req))
              if k is not None]
    engine_prompt_logprobs = max(wanted) if wanted else None
    # Legacy completions default to 16 tokens (OpenAI, vLLM) unless the server sets one.
    default = ctx.default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    params = [sampling_params_for(req, resolve_max_tokens(len(ids), req.max_tokens,
                                                          ctx.max_model_len, "prompt", default),
                                  req.logprobs, engine_prompt_logprobs, ctx.vocab_size,
                                  ctx.sampling_defaults, structured)
              for _, ids in prompts]
    await ctx.compile_grammar(structured, structured_param)
    ctx.admit(len(prompts))
    request_id = random_id("cmpl")
    streams = [ctx.generate(f"{request_id}-{i}", ids, p, lora_request)
               for i, ((_, ids), p) in enumerate(zip(prompts, params, strict=True))]
    view = _CompletionView(ctx, req, request_id, prompts, ctx.served_name(lora_request))
    if req.stream:
        return StreamingResponse(logging_disconnect(request_id, view.stream(streams)),
                                 media_type="text/event-stream")
    finals = await unless_disconnected(raw, _last_outputs(streams), request_id)
    ctx.check_not_ended(finals.values())
    return JSONResponse(view.response(finals).model_dump())


async def _last_outputs(streams) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for index, output in merge(streams):
        finals[index] = output
    return finals


class _CompletionView:
    """Renders one request's engine outputs as OpenAI completion bodies."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, request_id: str,
                 prompts: list[tuple[str, list[int]]], model_name: str) -> None:
        self.ctx, self.req, self.id, self.prompts = ctx, req, request_id, prompts
        self.model_name = model_name
        self.created = now()

    def _echo(self, prompt_index: int, output: RequestOutput) -> tuple[str, list[int], list]:
        if not self.req.echo:
            return "", [], []
        text, ids = self.prompts[prompt_index]
        entries = output.prompt_logprobs or [None] * len(ids)
        return text, ids, list(entries)

    def _choice(self, prompt_index: int, output: RequestOutput, index: int, text: str,
                token_ids: list[int], entries: list, text_start: int, with_echo: bool,
                finish_reason: str | None, stop_reason) -> CompletionChoice:
        """One choice carrying ``text`` and its tokens; ``text_start``: characters of the
        completion the client already has (logprobs' text_offset counts on from there)."""
        prefix, prefix_ids, prefix_lps = (self._echo(prompt_index, output) if with_echo
                                          else ("", [], []))
        logprobs = None
        if self.req.logprobs is not None:
            # text_offset counts from the start of the whole text the client has seen,
            # which begins with the echoed prompt even in chunks that no longer carry it.
            echoed = len(self.prompts[prompt_index][0]) if self.req.echo and not with_echo else 0
            logprobs = completion_logprobs(self.ctx.tokenizer, prefix_ids + token_ids,
                                           prefix_lps + list(entries), self.req.logprobs,
                                           echoed + text_start)
        return CompletionChoice(index=prompt_index * self.req.n + index, text=prefix + text,
                                logprobs=logprobs, finish_reason=finish_reason,
                                stop_reason=stop_reason)

    def _usage(self, completion_tokens: int) -> UsageInfo:
        prompt = sum(len(ids) for _, ids in self.prompts)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion_tokens,
                         total_tokens=prompt + completion_tokens)

    def response(self, finals: dict[int, RequestOutput]) -> CompletionResponse:
        choices = [self._choice(i, finals[i], c.index, c.text, c.token_ids, c.logprobs or [],
                                0, True, c.finish_reason, c.stop_reason)
                   for i in sorted(finals) for c in finals[i].outputs]
        if self.req.prompt_logprobs is not None:
            for choice in choices:
                i = choice.index // self.req.n
                choice.prompt_logprobs = prompt_logprobs(
                    self.ctx.tokenizer, self.prompts[i][1], finals[i].prompt_logprobs or [],
                    self.req.prompt_logprobs)
        choices.sort(key=lambda ch: ch.index)
        used = sum(c.num_generated_tokens for o in finals.values() for c in o.outputs)
        return CompletionResponse(id=self.id, created=self.created, model=self.model_name,
                                  choices=choices, usage=self._usage(used))

    def stream(self, streams) -> AsyncIterator[str]:
        self._pending: dict[int, PendingTokens] = {}
        return sse_stream(self._chunks(streams), self._usage_chunk)

    async def _chunks(self, streams) -> AsyncIterator[str]:
        """One chunk per engine delta that carries text (or ends a choice, or echoes)."""
        async for i, output in merge(streams):
            for c in output.outputs:
                key = i * self.req.n + c.index
                first = key not in self._pending
                pending = self._pending.setdefault(key, PendingTokens())
                pending.add(c.token_ids, c.logprobs)
                ends = c.finish_reason is not None and not pending.done
                # An echoed prompt is text of its own: the first chunk always goes.
                if not c.text and not ends and not (first and self.req.echo):
                    continue
                token_ids, entries, start = pending.take(c.text)
                pending.done = pending.done or ends
                choice = self._choice(i, output, c.index, c.text, token_ids, entries, start,
                                      first, c.finish_reason if ends else None,
                                      c.stop_reason if ends else None)
                yield sse(CompletionResponse(id=self.id, created=self.created,
                                             model=self.model_name, choices=[choice]))

    def _usage_chunk(self) -> str | None:
        options = self.req.stream_options
        if options is None or not options.include_usage:
            return None
        used = sum(p.num_tokens for p in self._pending.values())
        return sse(CompletionResponse(id=self.id, created=self.created,
                                      model=self.model_name, choices=[],
                                      usage=self._usage(used)))
