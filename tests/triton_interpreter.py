"""Run Triton test files again in a child process with TRITON_INTERPRET=1.

The interpreter must be switched on before triton is imported, which a running pytest
process has already done; so a CPU run re-executes the files, and their interpreted halves
run there. Several files run in one child: each child pays for importing torch, triton and
archserve (seconds on a CI core), and the files' outcomes are told apart by their node ids.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field


@dataclass
class FileOutcome:
    """What one file's tests did in the child: counts by outcome, and each failure's text."""

    passed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)


class _Recorder:
    """A pytest plugin (in the child) that keeps each report's node id and outcome."""

    def __init__(self, path: str) -> None:
        self.path, self.reports, self.root = path, [], "."

    def pytest_sessionstart(self, session) -> None:  # noqa: ANN001 - a pytest Session
        self.root = str(session.config.rootpath)     # node ids are relative to it

    def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001 - a TestReport
        if report.when == "call" or report.outcome != "passed":
            self.reports.append((self._absolute(report.nodeid), report.when, report.outcome,
                                 report.longreprtext[-6000:] if report.failed else ""))

    def pytest_collectreport(self, report) -> None:  # noqa: ANN001 - a CollectReport
        if report.failed:
            self.reports.append((self._absolute(report.nodeid), "collect", "failed",
                                 report.longreprtext[-6000:]))

    def _absolute(self, nodeid: str) -> str:
        return os.path.join(self.root, nodeid) if nodeid else nodeid

    def pytest_sessionfinish(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.reports, f)


def _child(reports_path: str, args: list[str]) -> int:
    import pytest
    return int(pytest.main(args, plugins=[_Recorder(reports_path)]))


def run_under_interpreter(test_files: list[str], timeout: int) -> dict[str, FileOutcome]:
    """Run ``test_files`` in one pytest child under the interpreter; each file's outcome,
    by the path as given. ``timeout``: the files' limit one after another (a worker's
    share of it with several). The interpreter runs a kernel's programs one after another in
    Python, on one core: the child spreads the files over a worker per core (pytest-xdist,
    a file's tests together on one worker, as a run of the file alone has them)."""
    with tempfile.TemporaryDirectory() as tmp:
        reports_path = os.path.join(tmp, "reports.json")
        # A file that fails to import fails its own item; the other files still run.
        args = [*test_files, "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
        workers = min(len(test_files), os.cpu_count() or 1)
        if workers > 1 and importlib.util.find_spec("xdist"):   # the test extra has it
            args += ["-n", str(workers), "--dist", "loadfile"]
            timeout = -(-timeout // workers)
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                "import triton_interpreter as t; "
                f"sys.exit(t._child({reports_path!r}, {args!r}))")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, timeout=timeout)
        if not os.path.exists(reports_path):
            raise AssertionError("the interpreter's pytest ended without its reports:\n"
                                 + result.stdout[-6000:] + result.stderr[-3000:])
        with open(reports_path) as f:
            reports = json.load(f)
    outcomes = {path: FileOutcome() for path in test_files}
    for nodeid, when, outcome, text in reports:
        path = _file_of(nodeid, test_files)
        if path is None:        # a report no file owns (a session error): every file's
            for each in outcomes.values():
                each.failures.append(f"{nodeid} ({when}): {text}")
            continue
        if outcome == "failed":
            outcomes[path].failures.append(f"{nodeid} ({when}): {text}")
        elif outcome == "passed":
            outcomes[path].passed += 1
        elif outcome == "skipped" and when in ("setup", "call"):
            outcomes[path].skipped += 1
    return outcomes


def _file_of(nodeid: str, test_files: list[str]) -> str | None:
    node_path = os.path.realpath(nodeid.split("::", 1)[0])
    return next((path for path in test_files if os.path.realpath(path) == node_path), None)


def assert_passes_under_interpreter(test_file: str, timeout: int = 900) -> None:
    """``test_file``'s interpreted half passes: some test passed, none failed."""
    assert_file_passed(run_under_interpreter([test_file], timeout)[test_file])


def assert_file_passed(outcome: FileOutcome) -> None:
    assert not outcome.failures, "\n\n".join(outcome.failures)[-9000:]
    assert outcome.passed, "no test of the file passed under the interpreter"
