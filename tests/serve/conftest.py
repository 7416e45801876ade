"""A real `archserve serve` process on a loopback port, shared by the serve tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "sk-archserve-test"
MAX_MODEL_LEN = 512
_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(log_path: Path, *args: str, timeout: float = 240.0) -> ServerProcess:
    """Start `archserve serve --port 0 ...`; return once /health answers 200.

    float32 unless ``args`` name a dtype: the servers of these tests are compared with each
    other and with offline engines token for token, across batch shapes and scheduling
    modes, which bfloat16 (auto on a CPU with native bf16) does not promise at near-ties."""
    dtype = () if "--dtype" in args else ("--dtype", "float32")
    cmd = [sys.executable, "-m", "archserve.cli.main", "serve", "--port", "0",
           "--max-model-len", str(MAX_MODEL_LEN), *dtype, *args]
    log_file = open(log_path, "w")  # noqa: SIM115 - the child writes to it
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        if url is None:
            match = _LISTENING.search(log_path.read_text(errors="replace"))
            url = match.group(1) if match else None
        if url is not None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return ServerProcess(process, url, log_path)
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{log_path.read_text()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> ServerProcess:
    """The embedded model behind an API key; shared by every module that needs no special flags."""
    srv = start_server(tmp_path_factory.mktemp("serve") / "server.log",
                       "--api-key", API_KEY, "--max-request-bytes", "65536",
                       "--max-num-seqs", "256")
    yield srv
    assert srv.stop() == 0, srv.log


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def read_metrics(url: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value} (samples only)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once nothing runs, waits or holds a KV block (aborts land asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url)
        idle = (m["archserve:num_requests_running"] == 0
                and m["archserve:num_requests_waiting"] == 0
                and m["archserve:kv_cache_used_blocks"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)
