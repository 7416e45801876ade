"""`archserve bench --peer llama.cpp`: the same requests through llama-cpp-python when it
imports (benchmarks/build_llama_cpp_peer.sh builds it; CI does not), a clear refusal
before anything runs otherwise, and only for a GGUF model (llama.cpp reads nothing else)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from archserve.bench.peer_llama_cpp import llama_cpp_available
from archserve.cli.main import app

SMALL = ["--num-prompts", "3", "--input-len", "12", "--output-len", "5",
         "--max-model-len", "64"]


def _bench(*args: str):  # noqa: ANN202 - a typer Result
    return CliRunner().invoke(app, ["bench", *args, "--json"])


def test_a_model_that_is_not_gguf_is_refused_before_it_runs(tiny_checkpoint):
    result = _bench("--model", tiny_checkpoint("llama"), *SMALL, "--peer", "llama.cpp")
    assert result.exit_code == 2
    assert "--peer llama.cpp compares a GGUF model's real weights" in result.output


def test_an_unknown_peer_names_the_peers(tiny_checkpoint):
    result = _bench("--model", tiny_checkpoint("llama"), *SMALL, "--peer", "vllm")
    assert result.exit_code == 2
    assert "--peer is one of transformers, llama.cpp" in result.output


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None,
                    reason="llama_cpp is importable here")
def test_without_llama_cpp_the_refusal_says_how_to_build_it(embedded_model_path):
    assert "build_llama_cpp_peer.sh" in llama_cpp_available()
    result = _bench("--model", embedded_model_path, *SMALL, "--peer", "llama.cpp")
    assert result.exit_code == 2
    assert "llama_cpp does not import" in result.output
    assert "benchmarks/build_llama_cpp_peer.sh" in result.output


def test_llama_cpp_runs_the_same_requests(embedded_model_path):
    pytest.importorskip("llama_cpp")
    result = _bench("--model", embedded_model_path, *SMALL, "--peer", "llama.cpp")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    peer = data["peer"]
    assert peer["name"] == "llama.cpp" and peer["method"].startswith("llama.cpp batched, 3")
    # ignore_eos: both engines produce exactly the requested tokens of the same prompts
    assert peer["output_tokens"] == data["output_tokens"] == 3 * 5
    assert peer["prompt_tokens"] == 3 * 12
    assert data["speedup_vs_peer"] == pytest.approx(
        data["output_tokens_per_s"] / peer["output_tokens_per_s"])
    # Time to first token of every request, on both sides.
    assert peer["ttft_ms"]["count"] == data["ttft_ms"]["count"] == 3
    assert 0 < peer["ttft_ms"]["p50"] <= peer["elapsed_s"] * 1e3
