"""`archserve serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

from typing import Annotated

import typer

from archserve.cli.generate import (
    AsyncSchedulingOpt,
    BackendOpt,
    BatchedTokensOpt,
    CalculateKvScalesOpt,
    ChunkedPrefillOpt,
    CompilationOpt,
    DtypeOpt,
    EagerOpt,
    EmulateOpt,
    EnableLoraOpt,
    ExecutorOpt,
    IndexCacheDtypeOpt,
    KvCacheDtypeOpt,
    LoadFormatOpt,
    MaxCpuLorasOpt,
    MaxLenOpt,
    MaxLoraRankOpt,
    MaxLorasOpt,
    MaxNumSeqsOpt,
    ModelOpt,
    PrefixCachingOpt,
    QuantOpt,
    SpeculativeOpt,
    TargetItlOpt,
    TPOpt,
    parse_target_itl,
)


def serve(
    ctx: typer.Context,
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port; 0 picks a free one (printed at start).")] = 8000,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="ARCHSERVE_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*.")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="The model name clients use; default: derived from --model.")] = None,
    dtype: DtypeOpt = "auto",
    max_model_len: MaxLenOpt = None,
    max_num_seqs: MaxNumSeqsOpt = 256,
    attention_backend: BackendOpt = None,
    enforce_eager: EagerOpt = False,
    compilation_config: CompilationOpt = None,
    async_scheduling: AsyncSchedulingOpt = None,
    speculative_config: SpeculativeOpt = None,
    load_format: LoadFormatOpt = "auto",
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="HF directory or .gguf file to take the tokenizer from; default: --model's (e.g. dummy weights of a config-only folder with another model's tokenizer).")] = None,
    quantization: QuantOpt = None,
    tensor_parallel_size: TPOpt = 1,
    distributed_executor_backend: ExecutorOpt = "mp",
    max_num_batched_tokens: BatchedTokensOpt = None,
    target_itl_ms: TargetItlOpt = "auto",
    enable_prefix_caching: PrefixCachingOpt = True,
    enable_chunked_prefill: ChunkedPrefillOpt = True,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    index_cache_dtype: IndexCacheDtypeOpt = "auto",
    calculate_kv_scales: CalculateKvScalesOpt = False,
    gpu_memory_utilization: Annotated[float, typer.Option("--gpu-memory-utilization", help="Fraction of GPU memory for weights, activations and KV cache.")] = 0.9,
    kv_cache_memory_bytes: Annotated[int | None, typer.Option("--kv-cache-memory-bytes", help="Explicit KV cache budget in bytes.")] = None,
    max_request_bytes: Annotated[int, typer.Option("--max-request-bytes", help="Larger request bodies get 413.")] = 8 * 1024 * 1024,
    max_queued_requests: Annotated[int | None, typer.Option("--max-queued-requests", help="Waiting requests beyond this get 503 with Retry-After.")] = None,
    burst_window_ms: Annotated[str, typer.Option("--burst-window-ms", help="When the engine is idle and a request arrives while other connections are open, wait until no other request has arrived for this many ms (at most 5 windows, and not once the waiting requests fill a step) so that a burst of clients is prefilled in one step; a lone client (its connection the only one open) never waits. auto: 10 on a CPU, 0 (no wait, as vLLM) elsewhere; or milliseconds, 0 for none.")] = "auto",
    shutdown_timeout: Annotated[float, typer.Option("--shutdown-timeout", help="Seconds to let in-flight requests finish on SIGTERM before aborting them.")] = 10.0,
    max_tokens_default: Annotated[int | None, typer.Option("--max-tokens-default", min=1, help="max_tokens for requests that give none (default: generation_config.json's max_new_tokens, else the rest of the context; 16 for /v1/completions).")] = None,
    emulate_device: EmulateOpt = None,
    generation_config: Annotated[str, typer.Option("--generation-config", help="Defaults for unset sampling fields: auto (the checkpoint's generation_config.json), vllm (ignore it) or a folder holding a generation_config.json.")] = "auto",
    enable_lora: EnableLoraOpt = False,
    lora_modules: Annotated[list[str] | None, typer.Option("--lora-modules", metavar="NAME=PATH", help="LoRA adapters served from the start, each as its own model name: name=path (several after the option, as in vLLM, or the option repeated) or JSON {\"name\": ..., \"path\": ..., \"base_model_name\": ...}. Needs --enable-lora; more load at run time through POST /v1/load_lora_adapter.")] = None,
    max_loras: MaxLorasOpt = 1,
    max_lora_rank: MaxLoraRankOpt = 16,
    max_cpu_loras: MaxCpuLorasOpt = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (completions, chat, metrics)."""
    import logging
    import os

    from archserve.engine.config import EngineConfig
    from archserve.serve.context import ServerSettings
    from archserve.serve.launcher import run_server
    from archserve.serve.lora_adapters import parse_lora_modules

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if served_model_name:
        names = [served_model_name]
    elif model is None:
        names = ["SmolLM2-135M-Instruct"]
    else:   # clients may use the short name or the path they know
        names = list(dict.fromkeys([os.path.basename(os.path.normpath(model)), model]))
    # vLLM takes several adapters after one --lora-modules; serve has no arguments of its
    # own, so what click leaves over is those.
    if ctx.args and not lora_modules:
        raise typer.BadParameter(f"unexpected argument(s): {' '.join(ctx.args)}")
    try:
        adapters = parse_lora_modules([*(lora_modules or []), *ctx.args])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--lora-modules") from None
    if adapters and not enable_lora:
        raise typer.BadParameter("needs --enable-lora", param_hint="--lora-modules")
    settings = ServerSettings(host=host, port=port, api_key=api_key,
                              max_request_bytes=max_request_bytes,
                              max_queued_requests=max_queued_requests,
                              served_model_names=names,
                              shutdown_timeout_s=shutdown_timeout,
                              max_tokens_default=max_tokens_default,
                              generation_config=generation_config,
                              lora_modules=adapters,
                              burst_window_ms=parse_burst_window(burst_window_ms))
    config = EngineConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, attention_backend=attention_backend,
                          enforce_eager=enforce_eager, load_format=load_format,
                          tokenizer=tokenizer, compilation_config=compilation_config,
                          quantization=quantization, async_scheduling=async_scheduling,
                          gpu_memory_utilization=gpu_memory_utilization,
                          kv_cache_memory_bytes=kv_cache_memory_bytes,
                          tensor_parallel_size=tensor_parallel_size,
                          distributed_executor_backend=distributed_executor_backend,
                          max_num_batched_tokens=max_num_batched_tokens,
                          target_itl_ms=parse_target_itl(target_itl_ms),
                          enable_prefix_caching=enable_prefix_caching,
                          enable_chunked_prefill=enable_chunked_prefill,
                          kv_cache_dtype=kv_cache_dtype,
                          index_cache_dtype=index_cache_dtype,
                          calculate_kv_scales=calculate_kv_scales,
                          speculative_config=speculative_config,
                          enable_lora=enable_lora, max_loras=max_loras,
                          max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                          emulate_device=emulate_device)
    try:
        run_server(config, settings)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


serve.context_settings = {"allow_extra_args": True}


def parse_burst_window(text: str) -> float | None:
    """--burst-window-ms: 'auto' (None) or a number of milliseconds >= 0."""
    text = text.strip().lower()
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise typer.BadParameter(f"expected auto or a number of ms >= 0, got {text!r}",
                                 param_hint="--burst-window-ms")
    return value
