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
                     "linear | moe (linear and moe take --quantization).")] = None,
    head_size: Annotated[int | None, typer.Option(
        "--head-size", help="Head size for --op attention (mla_attention assumes DeepSeek-V3, "
                            "576).")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="auto | bfloat16 | float16 | float32.")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(
        "--kv-cache-dtype", help="auto | fp8 | fp8_e4m3 | fp8_e5m2.")] = "auto",
    block_size: Annotated[int | None, typer.Option(
        "--block-size", help="KV cache block size to require (default: the backend's).")] = None,
    quantization: Annotated[str | None, typer.Option(
        "--quantization", "-q", help="Override the model's quantization scheme (fp8, awq, "
                                     "gptq, gguf, ...).")] = None,
    backend: Annotated[str | None, typer.Option(
        "--backend", help="Force a backend for --op and validate it (as "
                          "ARCHSERVE_ATTENTION_BACKEND would).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Show which backend each layer kind runs on DEVICE, the ideal one, and why others lost."""
    from archserve.kernels.registry import BackendError
    from archserve.loader.loader import resolve_model_path
    from archserve.platform.profiles import resolve_device
    from archserve.routing.explain import explain_model, explain_op_request, parse_libraries
    from archserve.routing.model_summary import read_model_summary

    if model is not None and op is not None:
        raise typer.BadParameter("give --model PATH or --op OP, not both")
    try:
        info = resolve_device(device)
        default_libraries = "installed" if device.strip().lower() == "live" else "all"
        assumption = parse_libraries(libraries or default_libraries)
        if op is None:
            summary = read_model_summary(resolve_model_path(model))
            result = explain_model(info, summary, dtype, kv_cache_dtype, quantization, assumption)
        else:
            result = explain_op_request(info, op, head_size, dtype, kv_cache_dtype, block_size,
                                        assumption, override=backend, quantization=quantization)
    except (ValueError, BackendError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if json_output:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _print_explanation(result)


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
    for r in result.routes:
        backend = (r.backend + (f" ({r.detail})" if r.detail else "")) if r.backend else "none"
        ideal = (r.ideal or "") + (f" ({r.ideal_detail})" if r.ideal_detail else "")
        if r.ideal and not registry.get(r.op, r.ideal).implemented:
            ideal += " (rules only)"
        rejected = "\n".join(f"{x.backend}: {x.reason}" for x in r.rejected)
        # The op under the layer's name only where the name does not already say it.
        layer = r.layer if r.layer.split(" ")[0] == r.op else f"{r.layer}\n[dim]{r.op}[/dim]"
        table.add_row(layer, backend, ideal, rejected)
    console.print(table)
