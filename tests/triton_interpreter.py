"""Run a Triton test file again in a child process with TRITON_INTERPRET=1.

The interpreter must be switched on before triton is imported, which a running pytest
process has already done; so a CPU run re-executes the file, and the file's interpreted
half runs there.
"""

from __future__ import annotations

import os
import subprocess
import sys


def assert_passes_under_interpreter(test_file: str, timeout: int = 900) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-x", "-p", "no:cacheprovider"],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
