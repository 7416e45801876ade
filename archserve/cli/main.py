"""The ``archserve`` command line. Each command lives in its own module, imported on use.

Adding a command is one line in COMMANDS: ``"name": "module:function"``, where the
function is a plain typer command (typed parameters, docstring as help). Command
modules keep heavy imports (torch, the engine) inside their functions, so
``archserve --help`` stays fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Any

import typer
from typer.core import TyperGroup

COMMANDS: dict[str, str] = {
    "doctor": "archserve.cli.doctor:doctor",
    "explain": "archserve.cli.explain:explain",
    "matrix": "archserve.cli.matrix:matrix",
    "serve": "archserve.cli.serve:serve",
    "prepare": "archserve.cli.prepare:prepare",
    "generate": "archserve.cli.generate:generate",
    "chat": "archserve.cli.generate:chat",
    "bench": "archserve.cli.bench:bench",
}


def _unavailable(name: str, error: Exception) -> Callable[[], None]:
    def command() -> None:
        typer.echo(f"archserve {name} is unavailable in this install: {error}", err=True)
        raise typer.Exit(1)

    command.__doc__ = f"(unavailable: {type(error).__name__})"
    return command


@cache
def _load_command(name: str) -> Any:
    module_name, _, attr = COMMANDS[name].partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:   # one broken command must not hide the rest
        function = _unavailable(name, exc)
    # Plain (click) help: it wraps long option names and defaults at any width, where the
    # rich panels cut them to an ellipsis at 80 columns.
    single = typer.Typer(add_completion=False, rich_markup_mode=None)
    # A command may take click's context settings (serve: values after an option that
    # takes several, as vLLM's nargs="+").
    single.command(name, context_settings=getattr(function, "context_settings", None))(function)
    return typer.main.get_command(single)


class LazyCommands(TyperGroup):
    """A group whose subcommands are imported only when listed or invoked."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(dict.fromkeys([*COMMANDS, *super().list_commands(ctx)]))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in COMMANDS:
            return _load_command(cmd_name)
        return super().get_command(ctx, cmd_name)


app = typer.Typer(cls=LazyCommands, no_args_is_help=True, add_completion=False,
                  help="archserve: a portable LLM inference engine that routes every op to "
                       "the best backend for the hardware, and explains why.")


@app.callback()
def _root() -> None:
    """archserve: a portable LLM inference engine that explains its kernel choices."""


if __name__ == "__main__":
    app()
