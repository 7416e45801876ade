"""`archserve bench`: offline throughput or serving latency, roofline, peer comparison."""

from __future__ import annotations

import math
from typing import Annotated

import typer

from archserve.cli.generate import (
    AsyncSchedulingOpt,
    BatchedTokensOpt,
    ChunkedPrefillOpt,
    CompilationOpt,
    DtypeOpt,
    EagerOpt,
    EmulateOpt,
    ExecutorOpt,
    MaxLenOpt,
    MaxNumSeqsOpt,
    PrefixCachingOpt,
    SpeculativeOpt,
    TargetItlOpt,
    TPOpt,
    parse_target_itl,
)


def _levels(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def bench(
    mode: Annotated[str, typer.Option("--mode", help="offline (engine in process) or serve (against --url).")] = "offline",
    model: Annotated[str | None, typer.Option("--model", "-m", help="HF directory or .gguf file; default: the embedded SmolLM2-135M-Instruct. In serve mode: the served model's tokenizer.")] = None,
    load_format: Annotated[str, typer.Option("--load-format", help="auto, safetensors, gguf or dummy (random weights).")] = "auto",
    dtype: DtypeOpt = "auto",
    quantization: Annotated[str | None, typer.Option("--quantization", "-q", help="Default: the checkpoint's own scheme; fp8 quantizes a 16-bit checkpoint at load.")] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Requests to send.")] = 100,
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens per request.")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", help="Output tokens per request.")] = 128,
    random_range: Annotated[float, typer.Option("--random-range", help="R: lengths uniform in [L*(1-R), L*(1+R)].")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of prompts, lengths and arrivals.")] = 0,
    dataset: Annotated[str | None, typer.Option("--dataset", help="JSON list of prompts (strings, or objects with 'prompt' and optional 'output_len').")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos/--stop-at-eos", help="Generate exactly output-len tokens (default).")] = True,
    max_model_len: MaxLenOpt = None,
    max_num_seqs: MaxNumSeqsOpt = 256,
    enforce_eager: EagerOpt = False,
    compilation_config: CompilationOpt = None,
    async_scheduling: AsyncSchedulingOpt = None,
    speculative_config: SpeculativeOpt = None,
    tensor_parallel_size: TPOpt = 1,
    distributed_executor_backend: ExecutorOpt = "mp",
    max_num_batched_tokens: BatchedTokensOpt = None,
    target_itl_ms: TargetItlOpt = "off",
    enable_prefix_caching: PrefixCachingOpt = True,
    enable_chunked_prefill: ChunkedPrefillOpt = True,
    emulate_device: EmulateOpt = None,
    peer: Annotated[str | None, typer.Option("--peer", help="Also run the requests through 'transformers' or 'llama.cpp' (a GGUF model; llama-cpp-python importable) and report the ratio.")] = None,
    url: Annotated[str, typer.Option("--url", help="Server base URL (serve mode).")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="ARCHSERVE_API_KEY", help="Bearer key for the server.")] = None,
    concurrency: Annotated[str | None, typer.Option("--concurrency", help="Requests in flight, e.g. 8 or 1,8,32 (one run per level).")] = None,
    request_rate: Annotated[float, typer.Option("--request-rate", help="Poisson arrivals per second; inf = all at once.")] = math.inf,
    metrics_interval: Annotated[float, typer.Option("--metrics-interval", help="Seconds between /metrics polls (serve mode).")] = 0.25,
    plots: Annotated[str | None, typer.Option("--plots", help="Directory for PNG plots.")] = None,
    output_json: Annotated[str | None, typer.Option("--output-json", help="Write the result JSON here.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log the engine's start-up route.")] = False,
) -> None:
    """Benchmark throughput (offline) or latency under load (serve), with a roofline."""
    import logging

    from archserve.bench.report import print_table, to_json_text, write_json
    from archserve.bench.runner import BenchOptions, run_bench

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    options = BenchOptions(
        mode=mode, model=model, load_format=load_format, dtype=dtype,
        quantization=quantization, num_prompts=num_prompts,
        input_len=input_len, output_len=output_len, random_range=random_range, seed=seed,
        dataset=dataset, ignore_eos=ignore_eos, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
        compilation_config=compilation_config, async_scheduling=async_scheduling,
        speculative_config=speculative_config,
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend=distributed_executor_backend,
        max_num_batched_tokens=max_num_batched_tokens,
        target_itl_ms=parse_target_itl(target_itl_ms),
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill, emulate_device=emulate_device,
        peer=peer, url=url,
        api_key=api_key, concurrency=_levels(concurrency), request_rate=request_rate,
        metrics_interval_s=metrics_interval, plots_dir=plots, show_progress=not json_out)
    try:
        result = run_bench(options)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if output_json:
        write_json(result, output_json)
    if json_out:
        typer.echo(to_json_text(result))
    else:
        print_table(result)
