"""The test tools are pinned to versions tested together, and install.sh --test fails loudly,
naming the package, when the installed version is not the pinned one."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(__file__))
CHECK = os.path.join(ROOT, "scripts", "check_test_pins.py")


def test_every_test_tool_is_pinned_or_bounded() -> None:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    loose = []
    for text in extra:
        ops = {spec.operator for spec in Requirement(text).specifier}
        # An exact pin, or (triton, whose GPU builds torch pins) a range with an upper bound.
        if "==" not in ops and not ({"<", "<="} & ops):
            loose.append(text)
    assert not loose, f"test tools without a tested version: {loose}"


def test_install_sh_runs_the_check_after_installing_the_test_extra() -> None:
    with open(os.path.join(ROOT, "scripts", "install.sh")) as f:
        script = f.read()
    assert script.index('-e ".${extra}"') < script.index("scripts/check_test_pins.py")


def _check(*requirements: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHECK, *requirements], capture_output=True,
                          text=True, timeout=60)


def test_check_passes_on_the_installed_versions() -> None:
    out = _check(f"pytest=={metadata.version('pytest')}", "packaging>=1")
    assert out.returncode == 0, out.stderr


def test_check_fails_naming_the_package_outside_its_pin() -> None:
    installed = metadata.version("pytest")
    out = _check("pytest==0.0.1", f"packaging=={metadata.version('packaging')}",
                 "archserve-no-such-tool==1.0")
    assert out.returncode == 1
    assert f"pytest: {installed} installed, the tested version is ==0.0.1" in out.stderr
    assert "archserve-no-such-tool: not installed" in out.stderr
    assert "packaging" not in out.stderr.split("the test tools above")[0]
