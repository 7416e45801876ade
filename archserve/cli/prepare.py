"""`archserve prepare`: pay the start-up costs ahead of time and show what they were."""

from __future__ import annotations

from typing import Annotated

import typer

from archserve.cli.generate import (
    BackendOpt,
    CompilationOpt,
    DtypeOpt,
    EagerOpt,
    EmulateOpt,
    ExecutorOpt,
    LoadFormatOpt,
    MaxLenOpt,
    ModelOpt,
    QuantOpt,
    SpeculativeOpt,
    TargetItlOpt,
    TPOpt,
    parse_target_itl,
)


def prepare(model: ModelOpt = None, dtype: DtypeOpt = "auto", attention_backend: BackendOpt = None,
            enforce_eager: EagerOpt = False, compilation_config: CompilationOpt = None,
            load_format: LoadFormatOpt = "auto",
            max_model_len: MaxLenOpt = None, quantization: QuantOpt = None,
            tensor_parallel_size: TPOpt = 1, distributed_executor_backend: ExecutorOpt = "mp",
            max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="Largest decode batch (CUDA graph sizes follow it).")] = 256,
            gpu_memory_utilization: Annotated[float, typer.Option("--gpu-memory-utilization")] = 0.9,
            target_itl_ms: TargetItlOpt = "auto",   # as `serve`: its step budget is shown too
            speculative_config: SpeculativeOpt = None,
            emulate_device: EmulateOpt = None,
            json_output: Annotated[bool, typer.Option("--json", help="Print the timings as JSON.")] = False) -> None:
    """Warm a model up ahead of time: derive and cache its GGUF metadata, compile and autotune
    its kernels, capture its CUDA graphs, measure the device's ceilings and run the
    roofline self-check. Caches persist on disk, so the next start (prepare, serve,
    generate) skips that work; run it twice to see cold and warm start times."""
    import json
    import logging

    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from archserve.loader.loader import resolve_model_path
    from archserve.loader.tokenizer import dummy_without_tokenizer
    try:
        model_path = resolve_model_path(model)
        engine = LLMEngine(EngineConfig(
            model=model_path, dtype=dtype, attention_backend=attention_backend,
            enforce_eager=enforce_eager, load_format=load_format, max_model_len=max_model_len,
            compilation_config=compilation_config,
            max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization,
            quantization=quantization, tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            target_itl_ms=parse_target_itl(target_itl_ms),
            speculative_config=speculative_config,
            skip_tokenizer_init=dummy_without_tokenizer(model_path, load_format),
            emulate_device=emulate_device,
            self_check_profile=True))   # this process exits next: CUPTI's cost does not matter
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    report = engine.report
    result = {"timings_s": report.timings, "kernel_cache": report.kernel_cache,
              "cuda_graph_sizes": report.graph_sizes,
              "cuda_graphs_demoted": {str(k): v for k, v in report.graph_demoted.items()},
              "attention": report.attention.name, "canary": report.canary,
              "decisions": [d.to_dict() for d in report.decisions],
              "self_check": report.self_check.to_json() if report.self_check else None,
              "token_budget": report.token_budget.to_json() if report.token_budget else None}
    if json_output:
        typer.echo(json.dumps(result, indent=2))
        return
    # The route is already on the console: the engine logs it at start-up (INFO, above).
    typer.echo("start-up timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in report.timings.items()))
