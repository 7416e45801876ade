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
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Every backend each op kind passed over, and why (the "
                                "default shows each op's verdict).")] = False,
    speculative_config: Annotated[str | None, typer.Option(
        "--speculative-config", help="vLLM's speculative config as JSON: check that it runs "
                                     "for --model (default: the embedded model) and say "
                                     "what would draft.")] = None,
    emulate_device: Annotated[str | None, typer.Option(
        "--emulate-device", help="Check a run of this machine (or --device) emulating a "
                                 "profile: its routes on this GPU, or why it cannot.")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="The model dtype the routes are for: auto (the device's default), "
                        "bfloat16, float16, float32.")] = "auto",
) -> None:
    """Check device, driver / CUDA runtime / torch build and kernel libraries; show each op's backend.

    Exits non-zero only when the engine cannot run here.
    """
    from archserve.loader.default_model import resolve_model_path
    from archserve.platform.detect import resolve_device

    # The arguments first, with modules that do not import torch: a typo is answered at once.
    try:
        info = resolve_device(device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from exc
    if emulate_device is not None:
        from archserve.platform.profiles import get_profile
        try:
            get_profile(emulate_device)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--emulate-device") from exc
    checked_layout = model is not None or tensor_parallel_size > 1
    try:
        model_path = resolve_model_path(model) if checked_layout else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from exc
    from archserve.routing.doctor import run_doctor
    from archserve.routing.dtypes import parse_dtype
    try:
        parse_dtype(dtype)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--dtype") from exc
    from archserve.routing.model_summary import read_model_summary

    summary = None
    if model_path is not None:
        try:
            summary = read_model_summary(model_path)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--model") from exc
    report = run_doctor(info, tensor_parallel_size=tensor_parallel_size, model=summary,
                        num_devices=_live_device_count() if device is None else None,
                        emulate=emulate_device, dtype=dtype)
    from archserve.engine.step_budget import itl_target_decision
    report.decisions.append(itl_target_decision(info.platform))
    if info.platform == "cpu":
        from archserve.engine.compilation_config import cpu_decode_steps_decision
        report.decisions.append(cpu_decode_steps_decision())
    if speculative_config is not None:
        from archserve.cli.explain import speculation_decision
        try:
            report.decisions.append(speculation_decision(
                speculative_config, resolve_model_path(model),
                [op.route for op in report.ops.values() if op.route is not None]))
        except ValueError as exc:
            report.blockers.append(f"speculative decoding: {exc}")
    if json_output:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report, verbose)
    if not report.can_run:
        raise typer.Exit(1)


def _print_report(report, verbose: bool = False) -> None:  # noqa: ANN001 - a DoctorReport
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from archserve.kernels.catalog import default_registry
    from archserve.platform.device import ALL_CPU_ISA

    console = Console()
    d = report.device
    data = report.to_dict()
    gib = d.memory_bytes / 1024**3
    cap = f", capability {d.capability} ({d.capability.arch})" if d.capability else ""
    # escape(): "[cuda, capability SM90 (sm_90)]" would otherwise be read as a style tag.
    host = d.emulated_on
    on = "" if host is None else escape(
        f", emulated on {host.name} [{host.platform}, capability {host.capability}]")
    console.print(f"[bold]device[/bold]   {escape(f'{d.name} [{d.platform}{cap}]')}, "
                  f"{gib:.1f} GiB{on}")
    if d.platform == "cpu":
        present = d.features.cpu_isa()
        absent = [n for n in ALL_CPU_ISA if n not in present]
        console.print(f"[bold]ISA[/bold]      {', '.join(present) or 'no vector extension'}"
                      + (f"; not {', '.join(absent)}" if absent else ""))
    versions = data["versions"]
    libs = ", ".join(f"{k} {v}" for k, v in versions["libraries"].items() if v) or "none"
    console.print(f"[bold]torch[/bold]    {versions['torch'] or 'unknown'}; libraries: {libs}")
    mark = "[green]ok[/green]" if report.toolchain_ok else "[red]problem[/red]"
    console.print(f"[bold]toolchain[/bold] {mark}")
    console.print(report.toolchain_text, markup=False)
    arch = "[green]ok[/green]" if report.arch_ok else "[red]mismatch[/red]"
    console.print(f"[bold]arch list[/bold] {arch}: " + escape(report.arch_text))
    for f in report.findings:
        colour = {"error": "red", "warning": "yellow"}.get(f.severity, "cyan")
        console.print(f"[{colour}]{f.severity}[/{colour}] {escape(f'{f.code}: {f.title}')}")
        console.print(f"    {f.detail}\n    fix: {f.remedy}", markup=False)
    for decision in report.decisions:
        console.print(f"[bold]{decision.what}[/bold] " + escape(
            f"{decision.requested} -> {decision.chosen}: {decision.reason}"))
    registry = default_registry()

    def ideal_of(r) -> str:  # noqa: ANN001 - an OpReport
        ideal = r.route.ideal or ""
        if ideal and not registry.get(r.route.op, ideal).implemented:
            ideal += " (rules only)"
        return ideal

    if not verbose:   # one line per op: fits a screen at 80 columns
        console.print("[bold]backend per op kind[/bold] (representative request)")
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True)
        grid.add_column(overflow="fold")
        grid.add_column()
        for op, r in report.ops.items():
            if r.route is None:
                grid.add_row(op, "[red]none[/red]", escape(r.error or ""))
            else:
                grid.add_row(op, escape(r.route.backend), escape(_verdict(r, ideal_of(r))))
        console.print(grid)
        console.print("[dim]archserve doctor --verbose: every backend each op passed over, "
                      "and why[/dim]")
    else:
        table = Table(title="backend per op kind (representative request)")
        table.add_column("op", no_wrap=True)
        table.add_column("backend", overflow="fold")   # a name folds; it is never cut short
        table.add_column("ideal", overflow="fold")
        table.add_column("why the others were not chosen")
        for op, r in report.ops.items():
            if r.route is None:
                table.add_row(op, "[red]none[/red]", "", escape(r.error or ""))
                continue
            backend = r.route.backend + (f" ({r.route.detail})" if r.route.detail else "")
            why = [f"{x.backend}: {x.reason}" for x in r.route.rejected]
            why += [f"{name}: {reason}" for name, reason in r.others]
            table.add_row(op, escape(backend), escape(ideal_of(r)), escape("\n".join(why)))
        console.print(table)
    if report.can_run:
        console.print("[green]archserve can run here.[/green]")
    else:
        console.print("[red]archserve cannot run here:[/red] " + escape("; ".join(report.blockers)))


def _verdict(r, ideal: str) -> str:  # noqa: ANN001 - an OpReport
    """The op's verdict in a few words: its ideal runs, or which ideal does not, and why."""
    detail = f" ({r.route.detail})" if r.route.detail else ""
    if r.route.backend == r.route.ideal:
        return f"the ideal{detail}"
    if ideal.endswith("(rules only)"):
        return f"ideal: {ideal}"
    why = next((x.reason for x in r.route.rejected if x.backend == r.route.ideal), "")
    return f"ideal: {ideal}" + (f" ({why})" if why else "")


def _live_device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
