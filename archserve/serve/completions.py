"""POST /v1/completions: prompts in, text (or SSE chunks) out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from archserve.engine.outputs import CompletionOutput, RequestOutput
from archserve.serve.context import ServingContext
from archserve.serve.errors import OpenAIError
from archserve.serve.logprobs import completion_logprobs
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
    sampling_params_for,
    structured_spec,
    truncated,
)
from archserve.serve.streams import (
    SSE_DONE,
    logging_disconnect,
    merge,
    sse,
    sse_error,
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
    ctx.check_model(req.model)
    if req.suffix:
        raise OpenAIError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError("best_of must equal n (or be omitted)", param="best_of")
    if req.tools or req.tool_choice not in (None, "none"):
        raise OpenAIError("tools are for /v1/chat/completions", param="tools")
    structured, structured_param = structured_spec(req)
    prompts = [(text, truncated(ids, req)) for text, ids in _prompts(ctx, req.prompt)]
    echo_logprobs = req.logprobs if req.echo else None
    # Legacy completions default to 16 tokens (OpenAI, vLLM) unless the server sets one.
    default = ctx.default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    params = [sampling_params_for(req, resolve_max_tokens(len(ids), req.max_tokens,
                                                          ctx.max_model_len, "prompt", default),
                                  req.logprobs, echo_logprobs, ctx.vocab_size,
                                  ctx.sampling_defaults, structured)
              for _, ids in prompts]
    await ctx.compile_grammar(structured, structured_param)
    ctx.admit(len(prompts))
    request_id = random_id("cmpl")
    streams = [ctx.generate(f"{request_id}-{i}", ids, p)
               for i, ((_, ids), p) in enumerate(zip(prompts, params, strict=True))]
    view = _CompletionView(ctx, req, request_id, prompts)
    if req.stream:
        return StreamingResponse(logging_disconnect(request_id, view.stream(streams)),
                                 media_type="text/event-stream")
    finals = await unless_disconnected(raw, _last_outputs(streams), request_id)
    return JSONResponse(view.response(finals).model_dump())


async def _last_outputs(streams) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for index, output in merge(streams):
        finals[index] = output
    return finals


class _CompletionView:
    """Renders one request's engine outputs as OpenAI completion bodies."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, request_id: str,
                 prompts: list[tuple[str, list[int]]]) -> None:
        self.ctx, self.req, self.id, self.prompts = ctx, req, request_id, prompts
        self.created = now()

    def _echo(self, prompt_index: int, output: RequestOutput) -> tuple[str, list[int], list]:
        if not self.req.echo:
            return "", [], []
        text, ids = self.prompts[prompt_index]
        entries = output.prompt_logprobs or [None] * len(ids)
        return text, ids, list(entries)

    def _choice(self, prompt_index: int, output: RequestOutput, c: CompletionOutput,
                start_text: int, start_token: int, with_echo: bool) -> CompletionChoice:
        prefix, prefix_ids, prefix_lps = (self._echo(prompt_index, output) if with_echo
                                          else ("", [], []))
        logprobs = None
        if self.req.logprobs is not None:
            ids = prefix_ids + c.token_ids[start_token:]
            entries = prefix_lps + list((c.logprobs or [])[start_token:])
            # text_offset counts from the start of the whole text the client has seen,
            # which begins with the echoed prompt even in chunks that no longer carry it.
            echoed = len(self.prompts[prompt_index][0]) if self.req.echo and not with_echo else 0
            logprobs = completion_logprobs(self.ctx.tokenizer, ids, entries,
                                           self.req.logprobs, echoed + start_text)
        return CompletionChoice(index=prompt_index * self.req.n + c.index,
                                text=prefix + c.text[start_text:], logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def _usage(self, finals: dict[int, RequestOutput]) -> UsageInfo:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)

    def response(self, finals: dict[int, RequestOutput]) -> CompletionResponse:
        choices = [self._choice(i, finals[i], c, 0, 0, True)
                   for i in sorted(finals) for c in finals[i].outputs]
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(id=self.id, created=self.created, model=self.ctx.model_name,
                                  choices=choices, usage=self._usage(finals))

    async def stream(self, streams) -> AsyncIterator[str]:
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, output in merge(streams):
                finals[i] = output
                for c in output.outputs:
                    key = i * self.req.n + c.index
                    first = key not in sent_text
                    start_text, start_token = sent_text.get(key, 0), sent_tokens.get(key, 0)
                    ends = c.finish_reason is not None and key not in done
                    # Tokens whose text is held back (part of a character, a possible stop
                    # string) wait, logprobs too, for the chunk that carries their text;
                    # an echoed prompt is text of its own.
                    if len(c.text) == start_text and not ends and not (first and self.req.echo):
                        continue
                    choice = self._choice(i, output, c, start_text, start_token, first)
                    if not ends:
                        choice.finish_reason = choice.stop_reason = None
                    sent_text[key], sent_tokens[key] = len(c.text), len(c.token_ids)
                    if ends:
                        done.add(key)
                    yield sse(CompletionResponse(id=self.id, created=self.created,
                                                 model=self.ctx.model_name, choices=[choice]))
            options = self.req.stream_options
            if options is not None and options.include_usage:
                yield sse(CompletionResponse(id=self.id, created=self.created,
                                             model=self.ctx.model_name, choices=[],
                                             usage=self._usage(finals)))
        except Exception as exc:  # noqa: BLE001 - the status line is gone; report in-band
            yield sse_error(exc)
        yield SSE_DONE
