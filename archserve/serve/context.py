"""What every endpoint needs: settings, the engine, a tokenizer, admission checks."""

from __future__ import annotations

import asyncio
import copy
import weakref
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from archserve.engine.lora.request import LoRARequest
from archserve.engine.outputs import RequestOutput
from archserve.engine.sampling_params import SamplingParams
from archserve.serve.async_engine import AsyncEngine, EngineDeadError
from archserve.serve.errors import OpenAIError, check_unicode
from archserve.serve.generation_defaults import load_generation_defaults
from archserve.serve.lora_adapters import ServedAdapters
from archserve.serve.metrics import ServerMetrics
from archserve.structured import GrammarError, StructuredOutputsParams

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queued_requests: int | None = None
    served_model_names: list[str] = field(default_factory=list)
    shutdown_timeout_s: float = 10.0
    max_tokens_default: int | None = None   # for requests without max_tokens
    generation_config: str = "auto"         # vLLM's --generation-config: auto, vllm or a folder
    lora_modules: list = field(default_factory=list)   # LoRAModulePath entries (--lora-modules)
    # How long an idle engine waits for the rest of a burst of requests (serve/async_engine.py);
    # None: the device's default (serve/launcher.py).
    burst_window_ms: float | None = None


class ServingContext:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics,
                 settings: ServerSettings) -> None:
        self.engine = engine
        self.metrics = metrics
        self.settings = settings
        llm_engine = engine.engine
        # The engine thread detokenizes with its tokenizer; the handlers get their own
        # copy so a Rust tokenizer is never used from two threads at once.
        self.tokenizer = copy.deepcopy(llm_engine.tokenizer)
        self.max_model_len: int = llm_engine.max_model_len
        self.vocab_size: int = llm_engine.model_config.vocab_size
        self.model_names = settings.served_model_names or ["archserve-default"]
        # LoRA adapters served under their own model names (--enable-lora).
        self.adapters = ServedAdapters(engine, self.model_names)
        self.adapters.load_static(settings.lora_modules)
        metrics.model_name = self.model_name    # the label of its vllm: aliases
        # Defaults for what a request leaves unset; --max-tokens-default beats the checkpoint's.
        self.sampling_defaults = load_generation_defaults(settings.generation_config,
                                                          llm_engine.config.model)
        self.default_max_tokens: int | None = (settings.max_tokens_default
                                               or self.sampling_defaults.get("max_tokens"))
        self._reserved = 0   # admitted requests whose streams have not started yet

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a name
        the server does not answer to."""
        if name is None or name in self.model_names:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise OpenAIError(f"The model `{name}` does not exist.", status=404, param="model")
        return adapter

    def served_name(self, lora_request: LoRARequest | None) -> str:
        """The model name a response carries: the adapter's, or the base model's."""
        return lora_request.lora_name if lora_request is not None else self.model_name

    def encode(self, text: str, param: str, **kwargs) -> list[int]:
        """Token ids of client text; text that is not valid Unicode is a 400, not a 500."""
        check_unicode(text, param)
        try:
            return list(self.tokenizer.encode(text, **kwargs))
        except (UnicodeEncodeError, TypeError, ValueError) as exc:
            raise OpenAIError(f"{param} is not valid Unicode text ({type(exc).__name__})",
                              param=param) from None

    async def compile_grammar(self, spec: StructuredOutputsParams | None, param: str | None
                              ) -> None:
        """Compile ``spec`` on the compiler's threads before the request reaches the engine
        (whose check is then a cache hit, so no step waits for a compiler); a spec that
        does not compile is a 400 naming the problem."""
        if spec is None:
            return
        compiler = self.engine.engine.grammars
        if compiler is None:
            raise OpenAIError("structured output needs the model's tokenizer", param=param)
        try:
            await asyncio.wrap_future(compiler.submit(spec))
        except GrammarError as exc:
            raise OpenAIError(str(exc), param=param) from None

    def admit(self, num_requests: int = 1) -> None:
        """503 when the waiting queue is full (the client should retry later)."""
        if self.engine.ending:
            raise OpenAIError("the server is shutting down", 503)
        if not self.engine.is_alive:
            raise OpenAIError(self.engine.dead_reason or "the engine is not running", 503,
                              headers={"Retry-After": "5"})
        limit = self.settings.max_queued_requests
        queued = self.engine.num_queued + self._reserved
        if limit is not None and queued + num_requests > limit:
            raise OpenAIError(f"the server is busy: {queued} requests are "
                              f"waiting (limit {limit}); retry later", 503,
                              headers={"Retry-After": "1"})
        # Admitted requests count as queued before their streams start (a streamed
        # response starts its generator only when the body is sent), so a burst of
        # simultaneous requests cannot all pass the check above.
        self._reserved += num_requests

    def check_not_ended(self, outputs: Iterable[RequestOutput]) -> None:
        """A non-streaming request that the server ended while shutting down is a 503 (a
        stream ends with finish_reason "abort" instead: its status line is already sent)."""
        if self.engine.ending and any(c.finish_reason == "abort"
                                      for output in outputs for c in output.outputs):
            raise OpenAIError("the server is shutting down: this request was still running "
                              "when the shutdown timeout passed, and was aborted", 503)

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs; its admission reservation ends when the stream starts or,
        if the client left before the body was sent, when the stream is discarded."""
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._reserved -= 1

        stream = self._generate(request_id, prompt, params, release, lora_request)
        weakref.finalize(stream, release)
        return stream

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                        release, lora_request: LoRARequest | None
                        ) -> AsyncIterator[RequestOutput]:
        release()   # from here on the engine's own queue counts this request
        try:
            async for output in self.engine.generate(request_id, prompt, params,
                                                     lora_request):
                yield output
        except ValueError as exc:
            raise OpenAIError(str(exc)) from None
        except EngineDeadError as exc:
            raise OpenAIError(str(exc), 503, headers={"Retry-After": "5"}) from None
