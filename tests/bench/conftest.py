"""A real `archserve serve` process on a loopback port with the tiny checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


@pytest.fixture(autouse=True)
def _calibration_cache(tmp_path_factory, monkeypatch):
    # One calibration for the whole session, outside the user's cache.
    monkeypatch.setenv("ARCHSERVE_CACHE_DIR",
                       str(tmp_path_factory.getbasetemp() / "bench-cache"))


@pytest.fixture(scope="module")
def tiny_server(tiny_checkpoint, tmp_path_factory):
    """URL of a server on the tiny Llama with a small KV pool (so usage is visible)."""
    log_path = tmp_path_factory.mktemp("bench-serve") / "server.log"
    cmd = [sys.executable, "-m", "archserve.cli.main", "serve", "--port", "0",
           "--model", tiny_checkpoint("llama"), "--max-model-len", "256",
           "--kv-cache-memory-bytes", str(256 * 1024), "--max-num-seqs", "16"]
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url = _wait_healthy(process, log_path, timeout=120.0)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(process, log_path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n"
                               f"{log_path.read_text()}")
        match = _LISTENING.search(log_path.read_text(errors="replace"))
        if match:
            try:
                if httpx.get(f"{match.group(1)}/health", timeout=2).status_code == 200:
                    return match.group(1)
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"server not healthy after {timeout}s:\n{log_path.read_text()}")
