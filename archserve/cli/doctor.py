"""`archserve doctor`: is this machine fit to run archserve, and how would it run here?"""

from __future__ import annotations

import json
from typing import Annotated

import typer


def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
    device: Annotated[str | None, typer.Option(
        "--device", "-d", help="A profile id or SM alias to simulate; default: this machine.")
    ] = None,
    tensor_parallel_size: Annotated[int, typer.Option(
        "--tensor-parallel-size", "-tp", min=1,
        help="Check a layout over N ranks: enough devices, heads that split.")] = 1,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="With --tensor-parallel-size: the model whose layout to check "
                              "(config only).")] = None,
) -> None:
    """Check device, driver / CUDA runtime / torch build and kernel libraries; show each op's backend.

    Exits non-zero only when the engine cannot run here.
    """
    from archserve.platform.profiles import resolve_device
    from archserve.routing.doctor import run_doctor

    try:
        info = resolve_device(device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from exc
    summary = None
    if model is not None or tensor_parallel_size > 1:
        from archserve.loader.loader import resolve_model_path
        from archserve.routing.model_summary import read_model_summary
        try:
            summary = read_model_summary(resolve_model_path(model))
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--model") from exc
    report = run_doctor(info, tensor_parallel_size=tensor_parallel_size, model=summary,
                        num_devices=_live_device_count() if device is None else None)
    if json_output:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report)
    if not report.can_run:
        raise typer.Exit(1)


def _print_report(report) -> None:  # noqa: ANN001 - a DoctorReport
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from archserve.kernels.catalog import default_registry

    console = Console()
    d = report.device
    data = report.to_dict()
    gib = d.memory_bytes / 1024**3
    cap = f", capability {d.capability} ({d.capability.arch})" if d.capability else ""
    # escape(): "[cuda, capability SM90 (sm_90)]" would otherwise be read as a style tag.
    console.print(f"[bold]device[/bold]   {escape(f'{d.name} [{d.platform}{cap}]')}, "
                  f"{gib:.1f} GiB")
    versions = data["versions"]
    libs = ", ".join(f"{k} {v}" for k, v in versions["libraries"].items() if v) or "none"
    console.print(f"[bold]torch[/bold]    {versions['torch'] or 'unknown'}; libraries: {libs}")
    mark = "[green]ok[/green]" if report.toolchain_ok else "[red]problem[/red]"
    console.print(f"[bold]toolchain[/bold] {mark}")
    console.print(report.toolchain_text, markup=False)
    arch = "[green]ok[/green]" if report.arch_ok else "[red]mismatch[/red]"
    console.print(f"[bold]arch list[/bold] {arch}: ", end="")
    console.print(report.arch_text, markup=False)
    for f in report.findings:
        colour = {"error": "red", "warning": "yellow"}.get(f.severity, "cyan")
        console.print(f"[{colour}]{f.severity}[/{colour}] {escape(f'{f.code}: {f.title}')}")
        console.print(f"    {f.detail}\n    fix: {f.remedy}", markup=False)
    for decision in report.decisions:
        console.print(f"[bold]{decision.what}[/bold] " + escape(
            f"{decision.requested} -> {decision.chosen}: {decision.reason}"))
    table = Table(title="backend per op kind (representative request)")
    for column in ("op", "backend", "ideal", "why the others were not chosen"):
        table.add_column(column)
    for op, r in report.ops.items():
        if r.route is None:
            table.add_row(op, "[red]none[/red]", "", escape(r.error or ""))
            continue
        why = [f"{x.backend}: {x.reason}" for x in r.route.rejected]
        why += [f"{name}: {reason}" for name, reason in r.others]
        backend = r.route.backend + (f" ({r.route.detail})" if r.route.detail else "")
        ideal = r.route.ideal or ""
        if ideal and not default_registry().get(r.route.op, ideal).implemented:
            ideal += " (rules only)"
        table.add_row(op, escape(backend), escape(ideal), escape("\n".join(why)))
    console.print(table)
    if report.can_run:
        console.print("[green]archserve can run here.[/green]")
    else:
        console.print("[red]archserve cannot run here:[/red] " + escape("; ".join(report.blockers)))


def _live_device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
