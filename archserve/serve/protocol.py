"""Request and response bodies of the OpenAI-compatible API (with vLLM's extensions).

Requests are validated here for shape and range; anything that depends on the model
(context length, vocabulary) is checked in ``sampling.py``. Unknown fields are ignored,
as the OpenAI and vLLM servers do, so newer clients keep working. Known fields are
strict, as OpenAI's API is: "5" is not an integer, "yes" or 1 not a boolean, and true
not a token id (pydantic's lax mode would coerce all three).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
)

# Ranges that keep one request from hurting the batch it joins (a huge n or logprobs
# would allocate without bound; a huge penalty would turn logits into inf/nan).
MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16

_INT64 = 2**63 - 1
_INT32 = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=_INT32)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# The sampler divides logits by it; below 1/100 (or above 100 the other way) the
# penalized logits only run towards float32's infinity.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _fits_float32(value: float) -> float:
    """The sampler holds these numbers as float32: one that would become inf there, or
    0 when it is not 0 (1e-300), would turn the logits into inf or nan. The range check
    is in Python floats: numpy would cast the value to float32 first, and warn."""
    if not abs(value) <= _FLOAT32_MAX or (value != 0 and np.float32(value) == 0):
        raise ValueError(f"{value!r} is outside the range of a 32-bit float")
    return value


Float32 = Annotated[float, AfterValidator(_fits_float32)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = False


class SamplingFields(_Request):
    """Sampling options shared by completions and chat (names and ranges as in vLLM)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    # vLLM sets no upper bound on temperature (OpenAI's is 2); float32's is the sampler's.
    temperature: Annotated[Float32, Field(ge=0.0)] | None = None
    top_p: Annotated[Float32, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_INT32)] | None = None   # 0 or -1: disabled
    min_p: Annotated[Float32, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY,
                                               le=MAX_REPETITION_PENALTY)] | None = None
    seed: Annotated[int, Field(ge=-_INT64 - 1, le=_INT64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=65536)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    # vLLM's: the top-k log-probs of each prompt token (and the token's own), in the
    # response's prompt_logprobs; not with stream=true (as in vLLM).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=1024)] | None = None
    # Structured output (read in sampling.structured_spec): OpenAI's response_format,
    # vLLM's structured_outputs and its older guided_* fields; at most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Tool calling (chat only; see tool_calls.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields):
    # Examples show up in /docs, and schema-driven clients and fuzzers start from them.
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        {"prompt": ["Hello", "Goodbye"], "max_tokens": 4, "n": 2, "stream": True,
         "stream_options": {"include_usage": True}, "logprobs": 2, "echo": True}]})
    prompt: (NonEmptyStr | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1)])
    # Unset: the server's default, else 16 (see completions.py).
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None


class ChatMessage(BaseModel):
    # Extra keys (tool_call_id, ...) travel on to the chat template. The schema says what
    # _content_required checks, so that schema-driven clients send content.
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"anyOf": [
        {"properties": {"content": {"type": ["string", "array"]}}, "required": ["content"]},
        {"properties": {"role": {"const": "assistant"},
                        "tool_calls": {"type": "array", "minItems": 1}},
         "required": ["tool_calls"]}]})
    role: Literal["system", "user", "assistant", "tool", "developer"]
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # Declared after role and tool_calls: its validator reads them.
    content: Annotated[str | list[dict[str, Any]] | None, Field(validate_default=True)] = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, content, info: ValidationInfo):
        # As in OpenAI: only an assistant message that calls tools may leave content out.
        if content is None and "role" in info.data and not (
                info.data["role"] == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (it may be null only on an assistant "
                             "message with tool_calls)")
        return content


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 8, "temperature": 0},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}],
         "max_completion_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 2,
         "stop": ["\n"], "seed": 1}]})
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    # vLLM's: render the last (assistant) message open, so the reply continues its text.
    continue_final_message: bool = False
    # vLLM's: the reply starts with the last message's content when that message has the
    # reply's role (the assistant's; any, without a generation prompt): a prefill echoed.
    echo: bool = False


class TokenizeRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Hello world"}, {"messages": [{"role": "user", "content": "Hi"}]}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [19556, 905]}]})
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's /v1/load_lora_adapter body: serve the PEFT adapter at ``lora_path`` as the
    model ``lora_name`` (``load_inplace``: replace the adapter of that name)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"lora_name": "sql-lora", "lora_path": "/adapters/sql-lora"}]})
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's /v1/unload_lora_adapter body (``lora_int_id`` is accepted and not needed)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"lora_name": "sql-lora"}]})
    lora_name: str
    lora_int_id: int | None = None


# -- responses ------------------------------------------------------------------------

def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's prompt_logprobs: a token id's log-prob, rank and text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first has none): token id (a JSON key, so a string) -> entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class _CompletionObject(BaseModel):
    """The head every completion response and stream chunk carries (OpenAI's order); each
    names its own ``object``."""

    id: str
    object: str
    created: int
    model: str


class CompletionResponse(_CompletionObject):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str            # a JSON object, as text (OpenAI's shape)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


def _chat_choice(name: str, body: str, body_type: type[BaseModel]) -> type[BaseModel]:
    """A chat choice model: its index, its ``body`` (a response's whole message, a stream
    chunk's delta), then how it ends, in OpenAI's order. Made here rather than inherited: a
    base class's fields would come before the subclass's body."""
    return create_model(name, __module__=__name__, index=(int, ...),
                        **{body: (body_type, ...)}, logprobs=(ChatLogprobs | None, None),
                        finish_reason=(str | None, None), stop_reason=(int | str | None, None))


ChatChoice = _chat_choice("ChatChoice", "message", ChatResponseMessage)


class ChatCompletionResponse(_CompletionObject):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


ChatStreamChoice = _chat_choice("ChatStreamChoice", "delta", DeltaMessage)


class ChatCompletionChunk(_CompletionObject):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The body of every error status (as OpenAI's and vLLM's servers send it)."""

    error: ErrorInfo
