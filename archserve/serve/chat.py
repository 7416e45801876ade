"""POST /v1/chat/completions: messages rendered with the model's chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from archserve.engine.outputs import CompletionOutput, RequestOutput
from archserve.serve.context import ServingContext
from archserve.serve.errors import OpenAIError, check_unicode
from archserve.serve.logprobs import chat_logprobs, prompt_logprobs
from archserve.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
    now,
    random_id,
)
from archserve.serve.sampling import (
    resolve_max_tokens,
    returned_prompt_logprobs,
    sampling_params_for,
    structured_spec,
    truncated,
)
from archserve.serve.streams import (
    PendingTokens,
    logging_disconnect,
    sse,
    sse_stream,
    unless_disconnected,
)
from archserve.serve.tool_calls import (
    ToolCallParser,
    ToolPlan,
    messages_for_template,
    plan_tools,
    tool_grammar,
)


def _message_dict(message: ChatMessage) -> dict:
    """A message as the template expects it: content parts joined into one string."""
    d = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError("only text content parts are supported", param="messages")
            texts.append(part["text"])
        d["content"] = "\n".join(texts)
    elif content is None:
        d["content"] = ""
    return d


def render_chat_prompt(ctx: ServingContext, messages: list[ChatMessage],
                       add_generation_prompt: bool = True,
                       plan: ToolPlan | None = None,
                       continue_final_message: bool = False) -> list[int]:
    """The conversation's prompt ids. ``continue_final_message`` (vLLM's): the last
    message is left open, so the reply continues its text (an assistant prefill)."""
    from archserve.loader.tokenizer import apply_chat_template
    if continue_final_message and add_generation_prompt:
        raise OpenAIError("continue_final_message and add_generation_prompt cannot both be "
                          "true", param="continue_final_message")
    for i, message in enumerate(messages):
        check_unicode(message.model_dump(exclude_none=True), f"messages[{i}]")
    dicts = [_message_dict(m) for m in messages]
    try:
        if plan is None:
            ids = apply_chat_template(ctx.tokenizer, dicts,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message)
        else:
            ids = _render_with_tools(ctx.tokenizer, dicts, plan, add_generation_prompt,
                                     continue_final_message)
    except ValueError as exc:
        raise OpenAIError(str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise OpenAIError(f"the chat template failed on these messages: "
                          f"{type(exc).__name__}: {exc}", param="messages") from None
    if not ids:
        raise OpenAIError("the rendered conversation is empty", param="messages")
    return list(ids)


def _render_with_tools(tokenizer, dicts: list[dict], plan: ToolPlan,
                       add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
    dicts, extra = messages_for_template(dicts, plan, template)
    if continue_final_message:
        extra["continue_final_message"] = True
    text = tokenizer.apply_chat_template(dicts, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request):
    lora_request = ctx.check_model(req.model)
    if req.top_logprobs and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
    check_unicode(req.tools, "tools")
    plan = None
    if req.tools or req.tool_choice is not None:
        plan = plan_tools(req.tools, req.tool_choice,
                          getattr(ctx.tokenizer, "chat_template", None))
    structured, structured_param = structured_spec(req)
    tool_spec = tool_grammar(plan, req.parallel_tool_calls is not False) if plan else None
    if tool_spec is not None:
        if structured is not None:
            raise OpenAIError(f"tool_choice {plan.mode!r} constrains the output itself; it "
                              f"cannot be combined with {structured_param}",
                              param=structured_param)
        structured, structured_param = tool_spec, "tools"
    ids = truncated(render_chat_prompt(ctx, req.messages, req.add_generation_prompt, plan,
                                       req.continue_final_message), req)
    requested = req.max_completion_tokens or req.max_tokens
    max_tokens = resolve_max_tokens(len(ids), requested, ctx.max_model_len, "messages",
                                    ctx.default_max_tokens)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params_for(req, max_tokens, num_logprobs, returned_prompt_logprobs(req),
                                 ctx.vocab_size, ctx.sampling_defaults, structured)
    await ctx.compile_grammar(structured, structured_param)
    ctx.admit()
    request_id = random_id("chatcmpl")
    view = _ChatView(ctx, req, request_id, ids, ctx.served_name(lora_request),
                     plan if plan is not None and plan.parses_calls else None)
    stream = ctx.generate(request_id, ids, params, lora_request)
    if req.stream:
        return StreamingResponse(logging_disconnect(request_id, view.stream(stream)),
                                 media_type="text/event-stream")
    final = await unless_disconnected(raw, _last_output(stream), request_id)
    ctx.check_not_ended([final])
    return JSONResponse(view.response(final).model_dump())


async def _last_output(stream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    return last


class _ChatView:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, request_id: str,
                 prompt_ids: list[int], model_name: str, tools: ToolPlan | None = None) -> None:
        self.ctx, self.req, self.id, self.prompt_ids = ctx, req, request_id, prompt_ids
        self.model_name = model_name
        self.tools = tools     # set when tool calls are read out of the text
        self.created = now()
        # echo (vLLM's): the reply repeats the last message's content first, where that
        # message has the reply's role: the assistant's, or any without a generation prompt
        # (the prefill a continued message extends).
        last = req.messages[-1]
        echoes = last.role == "assistant" or not req.add_generation_prompt
        self.echo = _message_dict(last)["content"] if req.echo and echoes else ""

    def _parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.tools.format) if self.tools is not None else None

    @staticmethod
    def _finish_reason(c: CompletionOutput, parser: ToolCallParser | None) -> str | None:
        if parser is not None and parser.complete_calls and c.finish_reason == "stop":
            return "tool_calls"
        return c.finish_reason

    def _message(self, c: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
        parser = self._parser()
        if parser is None:
            return ChatResponseMessage(content=self.echo + c.text), c.finish_reason
        events = parser.feed(c.text, final=True)
        # A call cut off by max_tokens has no whole arguments object: it is left out; where
        # no call came whole, the raw text is the content (nothing the model wrote is lost).
        calls = [ToolCall(id=call.id, function=FunctionCall(name=call.name,
                                                            arguments=call.arguments))
                 for call in parser.complete_calls]
        content = events.content
        if not calls and c.text.strip() != content.strip():   # a call begun, none whole
            content = c.text
        return (ChatResponseMessage(content=(self.echo + content) or None,
                                    tool_calls=calls or None),
                self._finish_reason(c, parser))

    def _logprobs(self, token_ids: list[int], entries: list):
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.ctx.tokenizer, token_ids, list(entries),
                             self.req.top_logprobs or 0)

    def _usage(self, completion_tokens: int) -> UsageInfo:
        prompt = len(self.prompt_ids)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion_tokens,
                         total_tokens=prompt + completion_tokens)

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in output.outputs:
            message, finish_reason = self._message(c)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=self._logprobs(c.token_ids, c.logprobs or []),
                                      finish_reason=finish_reason, stop_reason=c.stop_reason))
        prompt_lps = None
        if self.req.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs(self.ctx.tokenizer, self.prompt_ids,
                                         output.prompt_logprobs or [], self.req.prompt_logprobs)
        return ChatCompletionResponse(id=self.id, created=self.created,
                                      model=self.model_name, choices=choices,
                                      usage=self._usage(sum(c.num_generated_tokens
                                                            for c in output.outputs)),
                                      prompt_logprobs=prompt_lps)

    def _chunk(self, choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created,
                                       model=self.model_name, choices=[choice]))

    def stream(self, stream) -> AsyncIterator[str]:
        self._pending = [PendingTokens() for _ in range(self.req.n)]
        return sse_stream(self._chunks(stream), self._usage_chunk)

    async def _chunks(self, stream) -> AsyncIterator[str]:
        """The role first (as OpenAI sends it), then one chunk per engine delta that carries
        text, tool-call pieces or a choice's end."""
        parsers = [self._parser() for _ in range(self.req.n)]
        texts = [""] * self.req.n        # the text so far, for a choice whose calls are parsed
        try:
            for index in range(self.req.n):
                yield self._chunk(ChatStreamChoice(
                    index=index, delta=DeltaMessage(role="assistant", content="")))
            if self.echo:
                for index in range(self.req.n):
                    yield self._chunk(ChatStreamChoice(index=index,
                                                       delta=DeltaMessage(content=self.echo)))
            async for output in stream:
                for c in output.outputs:
                    pending = self._pending[c.index]
                    pending.add(c.token_ids, c.logprobs)
                    ends = c.finish_reason is not None and not pending.done
                    if not c.text and not ends:
                        continue
                    parser = parsers[c.index]
                    if parser is None:
                        delta = DeltaMessage(content=c.text)
                    else:
                        texts[c.index] += c.text
                        events = parser.feed(texts[c.index], final=ends)
                        if not events.content and not events.calls and not ends:
                            continue
                        delta = DeltaMessage(content=events.content or None, tool_calls=[
                            DeltaToolCall(**call) for call in events.calls] or None)
                    token_ids, entries, _ = pending.take(c.text)
                    pending.done = pending.done or ends
                    yield self._chunk(ChatStreamChoice(
                        index=c.index, delta=delta, logprobs=self._logprobs(token_ids, entries),
                        finish_reason=self._finish_reason(c, parser) if ends else None,
                        stop_reason=c.stop_reason if ends else None))
        finally:
            await stream.aclose()   # a client that left: the request is aborted now

    def _usage_chunk(self) -> str | None:
        options = self.req.stream_options
        if options is None or not options.include_usage:
            return None
        used = sum(p.num_tokens for p in self._pending)
        return sse(ChatCompletionChunk(id=self.id, created=self.created,
                                       model=self.model_name, choices=[],
                                       usage=self._usage(used)))
