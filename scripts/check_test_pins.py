"""Fail loudly when an installed test tool is not the version pyproject's `test` extra pins.

    python3 scripts/check_test_pins.py                  the `test` extra of installed archserve
    python3 scripts/check_test_pins.py "pytest==9.0.3"  the given requirements instead

install.sh --test runs it right after installing, so a resolver (or a later `pip install`)
that picked another release than the tested one stops the run here, naming the package,
instead of as a puzzling failure deep in the test suite.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement


def _applies(req: Requirement, extra: str) -> bool:
    return req.marker is None or req.marker.evaluate({**default_environment(), "extra": extra})


def test_extra_requirements() -> list[str]:
    """The `test` extra's requirements that apply on this machine, as installed archserve
    declares them (an extra's requirement carries an `extra == "test"` marker)."""
    found = []
    for text in metadata.requires("archserve") or []:
        req = Requirement(text)
        if _applies(req, "test") and not _applies(req, ""):
            found.append(text)
    return found


def mismatches(requirements: list[str]) -> list[str]:
    """One line per requirement that applies here and is missing or outside its range."""
    problems = []
    for text in requirements:
        req = Requirement(text)
        if not _applies(req, "test"):
            continue  # e.g. triton off Linux x86_64
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req.name}: not installed (want {req.specifier})")
            continue
        if not req.specifier.contains(installed, prereleases=True):
            problems.append(f"{req.name}: {installed} installed, the tested version is "
                            f"{req.specifier}")
    return problems


def main(argv: list[str]) -> int:
    requirements = argv or test_extra_requirements()
    if not requirements:
        print("check_test_pins: archserve's `test` extra is not installed", file=sys.stderr)
        return 1
    problems = mismatches(requirements)
    for line in problems:
        print(f"check_test_pins: {line}", file=sys.stderr)
    if problems:
        print("check_test_pins: the test tools above are not the versions the suite was "
              "tested with (pyproject.toml, `test` extra); install those versions, or move "
              "the pin after the whole suite passes with the new one", file=sys.stderr)
        return 1
    print(f"check_test_pins: {len(requirements)} test tools at their pinned versions")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
