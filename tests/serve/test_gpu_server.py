"""`archserve serve` on a CUDA GPU: a real server process (CUDA graphs, async scheduling) with
a tiny bf16 model, driven by the openai client. The CPU server tests use the embedded model,
which is too large to travel to the device machine; this module covers the GPU path."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from tests.serve.conftest import MAX_MODEL_LEN, read_metrics, start_server, wait_idle

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "Once upon a time there was", "def main():"]


@pytest.fixture(scope="module")
def gpu_server(tiny_checkpoint, tmp_path_factory):
    path = tiny_checkpoint("llama-h64")
    srv = start_server(tmp_path_factory.mktemp("gpu-serve") / "server.log",
                       "--model", path, "--served-model-name", "tiny", "--dtype", "bfloat16",
                       "--kv-cache-memory-bytes", str(1 << 28), "--max-num-seqs", "64")
    yield srv, path
    assert srv.stop() == 0, srv.log


@pytest.fixture(scope="module")
def gpu_client(gpu_server):
    return openai.OpenAI(base_url=f"{gpu_server[0].url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_server_runs_on_the_gpu_with_graphs(gpu_server):
    srv, _ = gpu_server
    assert "cuda" in srv.log.lower(), srv.log
    assert "graph" in srv.log.lower(), srv.log
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200


def test_greedy_completions_equal_the_offline_engine(gpu_server, gpu_client):
    from archserve import LLM, SamplingParams
    _, path = gpu_server
    served = [gpu_client.completions.create(model="tiny", prompt=p, max_tokens=12,
                                            temperature=0).choices[0].text for p in PROMPTS]
    # The server saw one request at a time: so does the engine here, with the server's
    # settings. Batched, its steps would run other kernels (GEMMs of 4 rows, not 1), and
    # this model's bf16 greedy steps are as close as one ulp (top-2 log-probs 0.0078 apart,
    # measured on the CPU), where a last-bit difference picks the other token.
    llm = LLM(path, dtype="bfloat16", kv_cache_memory_bytes=1 << 28, max_num_seqs=64,
              max_model_len=MAX_MODEL_LEN, self_check=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    offline = [llm.generate([p], greedy)[0].outputs[0].text for p in PROMPTS]
    assert served == offline


def test_streaming_equals_non_streaming(gpu_client):
    full = gpu_client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                         temperature=0, extra_body={"ignore_eos": True})
    chunks = list(gpu_client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16


def test_chat_completion(gpu_client):
    r = gpu_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
        temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 8


def test_many_concurrent_requests_all_finish_and_free_their_blocks(gpu_server, gpu_client):
    srv, _ = gpu_server

    def one(i: int) -> int:
        r = gpu_client.completions.create(model="tiny", prompt=PROMPTS[i % len(PROMPTS)],
                                          max_tokens=8 + i % 24, temperature=0.8, seed=i,
                                          extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        counts = list(pool.map(one, range(96)))
    assert counts == [8 + i % 24 for i in range(96)]
    metrics = wait_idle(srv.url)
    assert metrics["archserve:kv_cache_used_blocks"] == 0
    assert read_metrics(srv.url)["archserve:num_requests_running"] == 0
