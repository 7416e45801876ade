"""`archserve matrix`: the SM x feature table, generated from the selection rules."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def matrix(
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    device: Annotated[list[str] | None, typer.Option(
        "--device", "-d", help="Profile ids or SM aliases for the columns (repeatable); "
                               "default: every profile.")] = None,
) -> None:
    """Print the SM x feature support matrix (data types, attention, MLA, GEMM, MoE, quantization)."""
    from archserve.platform.profiles import all_profiles, get_profile

    try:   # before the selection rules (and torch) are imported: a typo is answered at once
        devices = [get_profile(d) for d in device] if device else all_profiles()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from exc
    from archserve.routing.matrix import build_matrix

    data = build_matrix(devices)
    if json_output:
        typer.echo(json.dumps(data, indent=2))
        return
    _print_table(data, devices)


def _print_table(data: dict, devices: list) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="archserve support matrix (generated from the selection rules)")
    table.add_column("feature", no_wrap=True)
    for d in devices:
        sm = str(d.capability) if d.capability else (d.gcn_arch or d.platform)
        # As wide as the device's name, never less: a long note in a cell folds instead.
        table.add_column(f"{d.id}\n{sm}", justify="center", overflow="fold",
                         width=max(len(d.id), len(sm), 6))
    group = None
    for feature in data["features"]:
        if feature["group"] != group:
            group = feature["group"]
            table.add_row(f"[bold]{group}[/bold]", *[""] * len(devices))
        name = feature["name"] + ("" if feature["implemented"] else " [dim](rules only)[/dim]")
        cells = []
        for d in devices:
            ok = feature["support"][d.id]
            note = feature["notes"].get(d.id, "")
            cells.append(f"[green]✓{note}[/green]" if ok else "[red]✗[/red]")
        table.add_row("  " + name, *cells)
    # A matrix is read across: never let a narrow (or absent) terminal squeeze its columns
    # (rich would cut a device's name short); the table gets the width it measures.
    from rich.measure import Measurement

    wide = Console(width=1 << 16)
    needed = Measurement.get(wide, wide.options, table).maximum
    console = Console(width=max(Console().width, needed))
    console.print(table)
    console.print("✓ supported by the hardware rules  ✗ not supported  "
                  "(rules only) = archserve does not ship this kernel yet")
