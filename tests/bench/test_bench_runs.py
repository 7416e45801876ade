"""`archserve bench` end to end on CPU with the tiny checkpoint: offline (with and
without the transformers peer) and serve mode against a real server process. These
check structure and bookkeeping, never speed."""

from __future__ import annotations

import json
import os
import re

import pytest
from typer.testing import CliRunner

from archserve.bench.offline import run_offline
from archserve.bench.workload import random_requests
from archserve.cli.main import app

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(*args: str) -> dict:
    result = CliRunner().invoke(app, ["bench", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _assert_png(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, path


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_offline_step_trace_accounts_for_every_token(tiny_checkpoint, async_scheduling):
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=tiny_checkpoint("llama"), max_model_len=128,
                                    max_num_seqs=4, max_num_batched_tokens=64,
                                    async_scheduling=async_scheduling))
    requests = random_requests(6, 40, 7, vocab_size=384, special_token_ids={0, 1, 2},
                               range_ratio=0.5, seed=1)
    result, trace = run_offline(engine, requests, ignore_eos=True, show_progress=False)
    assert result.output_tokens == sum(r.output_len for r in requests)
    # Every request's time to first token, each within the run.
    assert len(result.ttft_s) == 6 and all(0 < t <= result.elapsed_s for t in result.ttft_s)
    assert result.to_json()["ttft_ms"]["count"] == 6
    # Each prompt token runs once; each output token except the last is fed back once.
    fed = sum(r.input_len + r.output_len - 1 for r in requests)
    assert sum(step.num_tokens for step in trace.steps) == fed
    assert all(len(step.work) <= 4 and step.num_tokens <= 64 for step in trace.steps)
    assert any(step.is_decode for step in trace.steps)
    longest = max(r.input_len + r.output_len for r in requests)
    assert all(w.context_len + w.num_new_tokens <= longest
               for step in trace.steps for w in step.work)
    assert "step" not in vars(engine) and "schedule" not in vars(engine.scheduler)
    # Every call's time is in the trace, also the async engine's resolve-only calls.
    assert 0.5 * result.elapsed_s <= trace.seconds <= result.elapsed_s
    # The engine's phases timed by the clock fit inside their calls.
    assert all(sum(step.phases.values()) <= step.seconds for step in trace.steps)
    host = trace.host_ms_per_decode_step()
    assert {"schedule", "build_batch", "forward", "sample", "wait_for_device",
            "outputs"} <= set(host)
    assert host["busy"] == pytest.approx(host["step"] - host["wait_for_device"])
    assert all(ms >= 0 for ms in host.values())


def test_offline_bench_takes_vllm_scheduling_flags(tiny_checkpoint):
    data = _bench("--model", tiny_checkpoint("llama"), "--num-prompts", "2",
                  "--input-len", "24", "--output-len", "4", "--max-model-len", "128",
                  "--max-num-batched-tokens", "16", "--no-enable-prefix-caching")
    assert data["max_num_batched_tokens"] == 16
    assert data["enable_prefix_caching"] is False and data["enable_chunked_prefill"] is True
    assert data["output_tokens"] == 8


def test_offline_bench_json_and_plot(tiny_checkpoint, tmp_path):
    out = tmp_path / "result.json"
    data = _bench("--model", tiny_checkpoint("llama"), "--num-prompts", "6",
                  "--input-len", "24", "--output-len", "8", "--random-range", "0.25",
                  "--seed", "3", "--max-model-len", "128", "--plots", str(tmp_path / "plots"),
                  "--output-json", str(out))
    assert json.loads(out.read_text()) == data
    for key in ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s",
                "roofline_efficiency", "mbu", "roofline", "ceilings", "model_facts"):
        assert key in data, key
    assert data["num_requests"] == 6 and data["mode"] == "offline"
    assert data["output_tokens_per_s"] == pytest.approx(
        data["output_tokens"] / data["elapsed_s"])
    assert data["total_tokens_per_s"] == pytest.approx(
        (data["prompt_tokens"] + data["output_tokens"]) / data["elapsed_s"])
    assert 0 < data["roofline_efficiency"] <= 1.0      # the floor is a lower bound
    assert data["roofline"]["floor_s"] < data["roofline"]["measured_s"]
    assert data["model_facts"]["num_layers"] == 2
    assert "peer" not in data
    assert data["compiled_while_running"] == {}   # no Triton on a CPU: nothing compiled
    # The start-up's choices travel with the row (here: the CPU's dtype and budget).
    assert data["decisions"]["dtype"] == data["dtype"]
    assert data["decisions"]["max_num_batched_tokens"] == "8192 every step"
    assert len(data["plots"]) == 1
    _assert_png(data["plots"][0])


def test_the_table_names_kernels_compiled_while_running():
    from archserve.bench.report import summary_rows
    result = {"mode": "offline", "model": "m", "num_requests": 1, "output_tokens_per_s": 1.0,
              "total_tokens_per_s": 1.0, "requests_per_s": 1.0, "roofline_efficiency": 0.5,
              "mbu": 0.5, "roofline": {"floor_s": 1.0, "measured_s": 2.0,
                                       "decode_step_s_mean": 0.002,
                                       "decode_floor_s_mean": 0.001, "num_steps": 3,
                                       "num_decode_steps": 2, "compute_bound_steps": 0}}
    assert not any("compiled" in name for name, _ in summary_rows(result))
    result["compiled_while_running"] = {"_gate_up_kernel": 2}
    assert ("Triton kernels compiled while running", "_gate_up_kernel x2") in \
        summary_rows(result)


def test_offline_bench_with_transformers_peer(tiny_checkpoint, caplog):
    import logging
    # transformers' continuous-batching logger does not propagate: listen to it directly.
    peer_logger = logging.getLogger("ContinuousBatchingLogger")
    peer_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            data = _bench("--model", tiny_checkpoint("llama"), "--num-prompts", "4",
                          "--input-len", "16", "--output-len", "6", "--max-model-len", "128",
                          "--peer", "transformers")
    finally:
        peer_logger.removeHandler(caplog.handler)
    # The peer's own logging stays quiet (it logged an ERROR when psutil was missing).
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
    peer = data["peer"]
    assert peer["method"] in ("continuous_batching", "generate_left_padded")
    # ignore_eos: both engines produce exactly the requested tokens
    assert peer["output_tokens"] == data["output_tokens"] == 4 * 6
    assert data["speedup_vs_peer"] == pytest.approx(
        data["output_tokens_per_s"] / peer["output_tokens_per_s"])


def test_offline_bench_rejects_requests_longer_than_the_context(tiny_checkpoint):
    result = CliRunner().invoke(app, ["bench", "--model", tiny_checkpoint("llama"),
                                      "--num-prompts", "2", "--input-len", "100",
                                      "--output-len", "50", "--max-model-len", "128"])
    assert result.exit_code == 2
    assert "context length is 128" in result.output


def test_serve_bench_latency_memory_and_plots(tiny_server, tiny_checkpoint, tmp_path):
    data = _bench("--mode", "serve", "--url", tiny_server, "--model", tiny_checkpoint("llama"),
                  "--num-prompts", "8", "--input-len", "24", "--output-len", "64",
                  "--concurrency", "1,4", "--metrics-interval", "0.05",
                  "--plots", str(tmp_path / "plots"))
    assert [run["concurrency"] for run in data["runs"]] == [1, 4]
    for run in data["runs"]:
        assert run["failed"] == 0 and run["completed"] == 8, run["errors"]
        assert run["output_tokens"] == 8 * 64
        assert run["output_tokens_per_s"] == pytest.approx(
            run["output_tokens"] / run["elapsed_s"])
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = run[metric]
            assert s["count"] > 0 and 0 < s["p50"] <= s["p90"] <= s["p99"], (metric, s)
        assert run["ttft_ms"]["p50"] < run["e2e_ms"]["p50"]
        assert run["server"]["num_samples"] >= 2
    assert data["output_tokens_per_s"] == data["runs"][-1]["output_tokens_per_s"]
    server = data["server"]
    assert server["memory_peak_bytes"] > 0
    # 4 x 88 tokens of a 512-token pool; a request holds its blocks while it runs (64
    # tokens keep the engine busy for most of a run, so the 50 ms samples see it)
    running = [s for s in server["timeline"] if s["num_running"]]
    assert running and all(0 < s["kv_cache_usage"] <= 1.0 for s in running), running
    assert 0 < server["kv_cache_usage_max"] <= 4 * 96 / 512
    assert data["roofline_efficiency"] is None and "roofline_note" in data
    names = sorted(p.rsplit("/", 1)[-1] for p in data["plots"])
    assert names == ["latency_cdf.png", "memory_kv_over_time.png",
                     "throughput_vs_concurrency.png"]
    for path in data["plots"]:
        _assert_png(path)


def test_serve_bench_poisson_arrivals(tiny_server, tiny_checkpoint):
    data = _bench("--mode", "serve", "--url", tiny_server, "--model", tiny_checkpoint("llama"),
                  "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                  "--request-rate", "40", "--seed", "1")
    run = data["runs"][0]
    assert run["request_rate"] == 40 and run["concurrency"] is None
    assert run["completed"] == 4 and run["output_tokens"] == 16
    # The model is the name the server answers to, in the JSON and in the text report.
    served = os.path.basename(tiny_checkpoint("llama"))
    assert data["model"] == run["model"] == served
    text = CliRunner().invoke(app, ["bench", "--mode", "serve", "--url", tiny_server,
                                    "--num-prompts", "2", "--input-len", "8",
                                    "--output-len", "2", "--model", tiny_checkpoint("llama")])
    assert text.exit_code == 0, text.output
    assert re.search(rf"model\W+{re.escape(served)} ", text.output), text.output


def test_dummy_weights_of_a_bare_config_need_no_tokenizer(tiny_checkpoint, tmp_path):
    import shutil
    shutil.copy(f"{tiny_checkpoint('qwen3')}/config.json", tmp_path / "config.json")
    data = _bench("--model", str(tmp_path), "--load-format", "dummy", "--num-prompts", "3",
                  "--input-len", "12", "--output-len", "5", "--max-model-len", "64",
                  "--peer", "transformers")
    assert data["output_tokens"] == data["peer"]["output_tokens"] == 15


def test_shipped_benchmark_shapes_load_as_configs():
    from pathlib import Path

    from archserve.loader.config import load_hf_model_config
    root = Path(__file__).resolve().parents[2] / "benchmarks" / "models"
    llama = load_hf_model_config(str(root / "llama-3-8b"))
    qwen3 = load_hf_model_config(str(root / "qwen3-0.6b"))
    assert (llama.num_layers, llama.num_kv_heads, llama.vocab_size) == (32, 8, 128256)
    l70 = load_hf_model_config(str(root / "llama-3-70b"))
    assert (l70.num_layers, l70.hidden_size, l70.num_heads, l70.num_kv_heads,
            l70.intermediate_size, l70.vocab_size, l70.rope_theta,
            l70.max_position_embeddings) == (80, 8192, 64, 8, 28672, 128256, 500000.0, 8192)
    assert qwen3.qk_norm and qwen3.tie_word_embeddings and qwen3.head_dim == 128


def test_serve_bench_without_a_server_exits_nonzero_and_says_why(tiny_checkpoint):
    import socket
    with socket.socket() as s:        # a port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        result = CliRunner().invoke(app, ["bench", "--mode", "serve", "--url",
                                          f"http://127.0.0.1:{port}", "--model",
                                          tiny_checkpoint("llama"), "--num-prompts", "3",
                                          "--json"])
    assert result.exit_code == 2, result.output
    assert "no server answers at http://127.0.0.1:" in result.output
