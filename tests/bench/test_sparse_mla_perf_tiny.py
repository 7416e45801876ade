"""benchmarks/sparse_mla_perf.py's kernel part on tiny shapes under Triton's interpreter:
the script calls the sparse MLA impl's internals (its rows and top-k selection), so a
change to them must keep the GPU benchmark running (its kernel part failed on the GPU
once when the impl's row helper gained an argument)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kernel_part_runs_on_tiny_shapes(tmp_path):
    out = tmp_path / "kernel.json"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "sparse_mla_perf.py"), "--tiny",
         "--part", "kernel", "--out", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sparse decode" in result.stdout and "indexer" in result.stdout
    assert out.exists()
