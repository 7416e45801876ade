"""`archserve explain`: the backend route for a model or one op on any device (live or simulated)."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def explain(
    device: Annotated[str, typer.Option(
        "--device", "-d", help="A profile id (h100, v100, b200, ...), an SM alias (sm90) or "
                               "'live' for this machine.")] = "live",
    libraries: Annotated[str | None, typer.Option(
        "--libraries", help="Which kernel libraries to assume: all | none | installed | "
                            "NAME,NAME. Default: all for profiles, installed for live.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="An HF model directory or a .gguf file (config only, no weights); "
                              "default: the embedded SmolLM2-135M-Instruct.")] = None,
    op: Annotated[str | None, typer.Option(
        "--op", help="Explain one layer instead of a model: attention | mla_attention | "
                     "linear | moe (linear and moe take --quantization) | lora, or vLLM's side "
                     "selections vit_attention | mla_prefill (vLLM rules; mla_prefill also shows what runs).")] = None,
    head_size: Annotated[int | None, typer.Option(
        "--head-size", help="Head size for --op attention (default 128, Llama-3-8B's) and "
                            "vit_attention (mla_attention assumes DeepSeek-V3, 576).")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="auto | bfloat16 | float16 | float32.")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(
        "--kv-cache-dtype", help="auto | fp8 | fp8_e4m3 | fp8_e5m2 run here; vLLM's other "
                                 "names (nvfp4, int8_per_token_head, fp8_ds_mla, "
                                 "turboquant_*, ...) show their ideal.")] = "auto",
    block_size: Annotated[int | None, typer.Option(
        "--block-size", help="KV cache block size to require (default: the backend's).")] = None,
    quantization: Annotated[str | None, typer.Option(
        "--quantization", "-q", help="Override the model's quantization scheme (fp8, awq, "
                                     "gptq, gguf, ...).")] = None,
    backend: Annotated[str | None, typer.Option(
        "--backend", help="Force a backend for --op and validate it (as "
                          "ARCHSERVE_ATTENTION_BACKEND would).")] = None,
    sinks: Annotated[bool, typer.Option(
        "--sinks", help="The attention layers have learned sinks (as gpt-oss; a --model "
                        "config that declares sinks sets it).")] = False,
    attn_type: Annotated[str, typer.Option(
        "--attn-type", help="decoder | encoder | encoder_only | encoder_decoder (a --model "
                            "config with is_causal false is encoder_only).")] = "decoder",
    non_causal: Annotated[bool, typer.Option(
        "--non-causal", help="Bidirectional attention over the paged cache.")] = False,
    batch_invariant: Annotated[bool, typer.Option(
        "--batch-invariant", help="Results must not depend on the batch (vLLM's "
                                  "VLLM_BATCH_INVARIANT=1, which also sets it).")] = False,
    per_head_kv_scales: Annotated[bool, typer.Option(
        "--per-head-kv-scales", help="Per-head KV quantization scales (a --model "
                                     "kv_cache_scheme with strategy attn_head sets it).")] = False,
    fa_version: Annotated[int | None, typer.Option(
        "--fa-version", help="Force the FlashAttention generation (2, 3 or 4).")] = None,
    sparse_mla: Annotated[bool, typer.Option(
        "--sparse-mla", help="--op mla_attention: sparse (indexer) MLA, as DeepSeek-V3.2."
    )] = False,
    tensor_parallel_size: Annotated[int, typer.Option(
        "--tensor-parallel-size", "-tp", help="GPUs per tensor-parallel group: heads per rank "
                                              "and the MoE layout follow it.")] = 1,
    expert_parallel: Annotated[bool, typer.Option(
        "--enable-expert-parallel", help="Experts split across GPUs (MoE).")] = False,
    enable_lora: Annotated[bool, typer.Option(
        "--enable-lora", help="Serve LoRA adapters: add the route of their deltas (--op lora "
                              "explains it alone).")] = False,
    max_loras: Annotated[int, typer.Option("--max-loras", min=1,
                                           help="Adapter slots per layer (LoRA).")] = 1,
    max_lora_rank: Annotated[int, typer.Option("--max-lora-rank",
                                               help="The largest adapter rank (LoRA).")] = 16,
    speculative_config: Annotated[str | None, typer.Option(
        "--speculative-config", help="vLLM's speculative config as JSON (ngram, draft_model "
                                     "or mtp): say what would draft and verify for the "
                                     "model.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Show which backend each layer kind runs on DEVICE, the ideal one, and why others lost."""
    # The arguments are checked first, with modules that do not import torch: a typo is
    # answered at once, not after the seconds the selection rules take to import.
    from archserve.loader.default_model import resolve_model_path
    from archserve.platform.detect import resolve_device
    from archserve.routing.explain_inputs import SelectionInputs, check_op, parse_libraries

    try:
        if model is not None and op is not None:
            raise ValueError("give --model PATH or --op OP, not both")
        if op is not None:
            check_op(op, head_size)
        inputs = SelectionInputs(
            has_sinks=sinks, attn_type=attn_type.strip().lower(), non_causal=non_causal,
            batch_invariant=batch_invariant, per_head_kv_scales=per_head_kv_scales,
            fa_version=fa_version, tensor_parallel_size=tensor_parallel_size,
            expert_parallel=expert_parallel, enable_lora=enable_lora, max_loras=max_loras,
            max_lora_rank=max_lora_rank)
        model_path = resolve_model_path(model) if op is None else None
        info = resolve_device(device)
        default_libraries = "installed" if device.strip().lower() == "live" else "all"
        assumption = parse_libraries(libraries or default_libraries)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc

    from dataclasses import replace

    from archserve.kernels.registry import BackendError
    from archserve.kernels.specs import batch_invariant_requested
    from archserve.routing.explain import explain_model, explain_op_request
    from archserve.routing.model_summary import read_model_summary

    if batch_invariant_requested():   # vLLM's VLLM_BATCH_INVARIANT=1
        inputs = replace(inputs, batch_invariant=True)
    try:
        if op is None:
            result = explain_model(info, read_model_summary(model_path), dtype, kv_cache_dtype,
                                   quantization, assumption, inputs)
        else:
            result = explain_op_request(info, op, head_size, dtype, kv_cache_dtype, block_size,
                                        assumption, override=backend, quantization=quantization,
                                        inputs=inputs, sparse_mla=sparse_mla)
        if speculative_config is not None:
            if op is not None:
                raise ValueError("--speculative-config explains a model: give --model, not --op")
            result.decisions.append(speculation_decision(speculative_config,
                                                         resolve_model_path(model),
                                                         result.routes))
    except (ValueError, BackendError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if op is None:
        from archserve.engine.step_budget import itl_target_decision
        result.decisions.append(itl_target_decision(info.platform))
        if info.platform == "cpu":
            from archserve.engine.compilation_config import cpu_decode_steps_decision
            result.decisions.append(cpu_decode_steps_decision())
    if json_output:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _print_explanation(result)


def speculation_decision(speculative_config: str, model_path: str, routes=()):  # noqa: ANN001, ANN201
    """What a speculative config would run for the model at ``model_path`` (a Decision;
    ValueError when it cannot), from configs alone; with the model's ``routes``, how its
    verification steps run over the attention route's backend (CUDA graphs or eagerly)."""
    from dataclasses import replace

    from archserve.engine.spec_decode.setup import plan_speculation, verification_graphs_text
    from archserve.engine.speculative_config import parse_speculative_config
    from archserve.kernels.catalog import default_registry
    from archserve.loader.loader import load_model_config
    target, _ = load_model_config(model_path)
    config, decision = plan_speculation(parse_speculative_config(speculative_config), target,
                                        model_path)
    # The route of the target's attention: MLA (sparse or dense, as the model is) or not.
    op = "mla_attention" if target.mla is not None else "attention"
    sparse = target.sparse_attention is not None
    registry = default_registry()
    for route in routes:
        if route.op != op or not route.backend:
            continue
        backend = registry.get(op, route.backend)
        if op == "attention" or backend.sparse == sparse:
            return replace(decision, reason=f"{decision.reason}; " + verification_graphs_text(
                backend, config.num_speculative_tokens + 1))
    return decision


def _print_explanation(result) -> None:  # noqa: ANN001 - an Explanation
    from rich.console import Console
    from rich.table import Table

    from archserve.kernels.catalog import default_registry

    console = Console()
    d = result.device
    cap = f" {d.capability}" if d.capability else ""
    console.print(f"[bold]{d.name}[/bold] ({d.id}, {d.platform}{cap}); dtype "
                  f"{str(result.dtype).removeprefix('torch.')}; libraries assumed: "
                  f"{result.libraries}")
    if d.platform == "cpu":   # what CPU_WEIGHT_ONLY's rules read
        console.print(f"  ISA: {', '.join(d.features.cpu_isa()) or 'no vector extension'}")
    changed = {k: v for k, v in result.inputs.to_dict().items()
               if v != type(result.inputs)().to_dict()[k]}
    if changed:
        console.print("  inputs: " + ", ".join(f"{k}={v}" for k, v in changed.items()),
                      markup=False)
    for decision in result.decisions:
        console.print(f"  {decision.what}: {decision.requested} -> {decision.chosen} "
                      f"({decision.reason})", markup=False)
    if result.not_loadable:
        console.print("[red]not loadable in this build:[/red] ", end="")
        console.print(result.not_loadable, markup=False)
    table = Table()
    for column in ("layer", "backend", "ideal (hardware rules)", "rejected"):
        table.add_column(column, overflow="fold")   # a backend's name is never cut short
    registry = default_registry()
    from archserve.kernels.registry import OP_KINDS as registry_ops
    for r in result.routes:
        backend = (r.backend + (f" ({r.detail})" if r.detail else "")) if r.backend else "none"
        ideal = (r.ideal or "") + (f" ({r.ideal_detail})" if r.ideal_detail else "")
        if r.ideal and (r.op not in registry_ops or not registry.get(r.op, r.ideal).implemented):
            ideal += " (rules only)"
        rejected = "\n".join(f"{x.backend}: {x.reason}" for x in r.rejected)
        # The op under the layer's name only where the name does not already say it.
        layer = r.layer if r.layer.split(" ")[0] == r.op else f"{r.layer}\n[dim]{r.op}[/dim]"
        table.add_row(layer, backend, ideal, rejected)
    console.print(table)
