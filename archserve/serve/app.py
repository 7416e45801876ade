"""The FastAPI application: routes, error handlers and the request guard."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import archserve
from archserve.serve.api_docs import errors, finish, json_or_sse
from archserve.serve.body_errors import (
    BODY_SCOPE_KEY,
    json_error_message,
    parse_failure_message,
)
from archserve.serve.chat import create_chat_completion, render_chat_prompt
from archserve.serve.completions import create_completion
from archserve.serve.context import ServingContext
from archserve.serve.errors import OpenAIError, error_response, from_exception
from archserve.serve.guard import RequestGuard
from archserve.serve.metrics import CONTENT_TYPE
from archserve.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
    now,
)
from archserve.serve.sampling import check_token_ids
from archserve.serve.streams import ClientDisconnected


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One 400 message for pydantic's errors, and OpenAI's ``param`` (messages[0].role)."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        reason = errors[0].get("ctx", {}).get("error", "not valid JSON")
        return json_error_message(reason, exc.body, errors[0]["loc"][-1]), None
    parts, param = [], None
    for err in errors[:5]:
        path = _field_path(err, exc.body)
        if param is None and path:
            param = path
        parts.append(f"{path or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request body", param


def _field_path(err: dict, body) -> str:
    """The error's ``loc`` as OpenAI writes a field (messages[0].role). Pydantic also puts
    the union member it tried into ``loc`` ('list[int]'); walking the body drops those."""
    loc = list(err.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    path, node = "", body
    for i, part in enumerate(loc):
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path, node = f"{path}[{part}]", node[part]
        elif isinstance(node, dict) and part in node:
            path, node = f"{path}.{part}" if path else str(part), node[part]
        elif isinstance(node, dict) and i == len(loc) - 1 and (
                err.get("type") == "missing" or err.get("input", ...) is None):
            # A field the body leaves out (required, or its default refused): no value
            # to walk into. A union tag's input would be the body's value, not None.
            path = f"{path}.{part}" if path else str(part)
    return path


def build_app(ctx: ServingContext) -> RequestGuard:
    """The ASGI application: the FastAPI routes behind the request guard."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # Uvicorn has stopped accepting and waited for in-flight requests (up to its
        # graceful timeout); whatever is left is aborted so its blocks are freed.
        await asyncio.to_thread(ctx.engine.shutdown, ctx.settings.shutdown_timeout_s)

    # /openapi.json, /docs and /redoc as FastAPI serves them (and vLLM: open, no API key).
    app = FastAPI(title="archserve", version=archserve.__version__, lifespan=lifespan)
    app.state.ctx = ctx

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = finish(get_openapi(
                title=app.title, version=app.version, routes=app.routes,
                description="OpenAI-compatible API (with vLLM's extensions)."))
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return from_exception(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's one message for any body it could not parse: say what and where.
        precise = (parse_failure_message(exc.__cause__, request.scope.get(BODY_SCOPE_KEY))
                   if exc.status_code == 400 else None)
        # Starlette's own headers matter: a 405 names the allowed methods in ``Allow``.
        return error_response(precise or str(exc.detail), exc.status_code,
                              headers=exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, exc: ClientDisconnected):
        # Nobody reads this (the connection is closed); nginx's 499 keeps the metrics honest.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    generation_errors = errors(400, 401, 404, 413, 500, 503)

    @app.post("/v1/completions", responses={**json_or_sse(CompletionResponse),
                                            **generation_errors})
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions", responses={**json_or_sse(ChatCompletionResponse),
                                                 **generation_errors})
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)

    def model_card(name: str) -> dict:
        """A served name's card: the base model's, or an adapter's (its directory as the
        root, the base model as the parent, as vLLM lists them)."""
        adapter = ctx.adapters.get(name)
        root = (adapter.lora_path if adapter is not None
                else ctx.engine.engine.config.model or "embedded:SmolLM2-135M-Instruct")
        parent = (adapter.base_model_name or ctx.model_name) if adapter is not None else None
        return {"id": name, "object": "model", "created": now(), "owned_by": "archserve",
                "root": root, "parent": parent, "max_model_len": ctx.max_model_len}

    @app.get("/v1/models", responses={200: {"model": ModelList}, **errors(401, 413, 500)})
    async def models():
        names = [*ctx.model_names, *ctx.adapters.by_name]
        return {"object": "list", "data": [model_card(name) for name in names]}

    # ``:path``: a name the server answers to may be a model path, slashes and all.
    @app.get("/v1/models/{model_id:path}",
             responses={200: {"model": ModelCard}, **errors(401, 404, 413, 500)})
    async def model(model_id: str):
        ctx.check_model(model_id)     # 404 for a name it does not answer to
        return model_card(model_id)

    lora_responses = {200: {"description": "`Success: ...` (plain text)."}}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
              responses={**lora_responses, **errors(400, 401, 413, 500, 503)})
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return PlainTextResponse(await ctx.adapters.load(body.lora_name, body.lora_path,
                                                         body.load_inplace))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses={**lora_responses, **errors(400, 401, 404, 413, 500, 503)})
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return PlainTextResponse(await ctx.adapters.unload(body.lora_name))

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine runs (empty body)."},
                        **errors(413, 500, 503)})
    async def health():
        if not ctx.engine.is_alive:
            return error_response(ctx.engine.dead_reason or "the engine is not running", 503)
        return Response(status_code=200)

    @app.get("/version", responses={200: {"model": VersionResponse}, **errors(413, 500)})
    async def version():
        return {"version": archserve.__version__}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format."}, **errors(413, 500)})
    async def metrics():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse},
                                      **errors(400, 404, 413, 500)})
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("send exactly one of 'prompt' or 'messages'")
        if body.messages is not None:
            ids = render_chat_prompt(ctx, body.messages, body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message)
        else:
            ids = ctx.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        result = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
        if body.return_token_strs:
            result["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
        return result

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse},
                                        **errors(400, 404, 413, 500)})
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        check_token_ids(body.tokens, ctx.vocab_size, "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    return RequestGuard(app, ctx.settings.api_key, ctx.settings.max_request_bytes,
                        ctx.metrics.observe_http)

