"""``--set MODULE:NAME=INT`` for benchmark scripts: an integer launch constant of a module,
set before anything is built, so one script sweeps a rule's constant without a code edit."""

from __future__ import annotations

import importlib


def set_module_constants(settings: list[str]) -> None:
    """Apply each "module.path:NAME=INT"; a module without that name is an error."""
    for setting in settings:
        target, value = setting.split("=")
        module, name = target.split(":")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"{module} has no {name}")
        setattr(mod, name, int(value))
