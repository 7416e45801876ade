"""Kernel test files with an interpreted half: on a CPU-only machine, each runs once more in
a child process under Triton's interpreter (one child for all of a session's files).

The interpreter must be switched on before triton is imported, which a running pytest
process has already done; so the files are re-executed with ``TRITON_INTERPRET=1``
(tests/triton_interpreter.py), and their ``if INTERPRETED:`` halves run there. A file opts in
with a module-level ``INTERPRETER_TIMEOUT_S = <seconds>``; this conftest adds its
``test_under_interpreter`` item. On a GPU the compiled kernels are tested instead (the
files' gpu-marked tests), so the item skips there.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
import torch

# The helpers beside these tests (attention_cases, quantized_moe_cases, rounding_kernel, ...)
# import by name; tests/conftest.py puts tests/ itself (triton_interpreter, triton_compile)
# on the path.
sys.path.insert(0, os.path.dirname(__file__))

TIMEOUT_NAME = "INTERPRETER_TIMEOUT_S"


def interpreter_timeout(path: Path) -> int | None:
    """The file's ``INTERPRETER_TIMEOUT_S`` (a module-level integer), or None."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == TIMEOUT_NAME
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)):
            return node.value.value
    return None


class InterpreterRerun(pytest.Item):
    """This file's interpreted half, in a child process under TRITON_INTERPRET=1."""

    def __init__(self, *, timeout: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.timeout = timeout
        if torch.cuda.is_available():
            self.add_marker(pytest.mark.skip(reason="on a GPU the compiled kernels are tested"))

    def runtest(self) -> None:
        pytest.importorskip("triton")
        from triton_interpreter import assert_file_passed
        assert_file_passed(_interpreted_outcomes(self.session)[str(self.path)])

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.path.name} under Triton's interpreter"


_run: list = []     # the session's one interpreter run: each file's outcome, or its error


def _interpreted_outcomes(session: pytest.Session) -> dict:
    """Every interpreted half this session runs, in one child process (each child pays
    seconds of imports) the first time one is asked for; its limit is the files' limits
    together. A run that failed as a whole (its limit passed) fails each file's item with
    its error, without running again."""
    if not _run:
        from triton_interpreter import run_under_interpreter
        items = [item for item in session.items if isinstance(item, InterpreterRerun)]
        try:
            _run.append(run_under_interpreter([str(item.path) for item in items],
                                              sum(item.timeout for item in items)))
        except Exception as exc:  # noqa: BLE001 - each item reports it
            _run.append(exc)
    if isinstance(_run[0], Exception):
        raise _run[0]
    return _run[0]


class InterpretedHalf(pytest.File):
    def collect(self):
        timeout = interpreter_timeout(self.path)
        yield InterpreterRerun.from_parent(self, name="test_under_interpreter",
                                           timeout=timeout)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.File | None:
    if (os.environ.get("TRITON_INTERPRET") == "1" or not file_path.name.startswith("test_")
            or file_path.suffix != ".py" or interpreter_timeout(file_path) is None):
        return None
    return InterpretedHalf.from_parent(parent, path=file_path)
