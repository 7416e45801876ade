"""A server with --speculative-config answers as the default one does, frees every KV block
after 200 streams of which many are cancelled mid-way, and reports vLLM's spec_decode
counters in /metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.serve.conftest import API_KEY, read_metrics, start_server, wait_idle

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2})
TEXT = ("The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and "
        "values in fixed-size blocks, so sequences of any length share one pool.")
REQUESTS = [
    {"prompt": f"Repeat this text: {TEXT}\nRepeated:", "max_tokens": 40, "temperature": 0},
    {"prompt": f"{TEXT} {TEXT}", "max_tokens": 32, "temperature": 0, "stop": ["pool", "\n"]},
    {"prompt": f"Copy: {TEXT}\nCopy:", "max_tokens": 24, "temperature": 0.8, "seed": 7,
     "n": 2, "logprobs": 2},
    {"prompt": "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,", "max_tokens": 30, "temperature": 0,
     "ignore_eos": True},
]


@pytest.fixture(scope="module")
def tiny_spec_server(tmp_path_factory, tiny_checkpoint):
    """A tiny random model: its loops are drafted well, and 200 streams take seconds."""
    srv = start_server(tmp_path_factory.mktemp("serve-spec-tiny") / "server.log",
                       "--model", tiny_checkpoint("llama"), "--api-key", API_KEY,
                       "--max-num-seqs", "32", "--speculative-config",
                       json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1}))
    yield srv
    assert srv.stop() == 0, srv.log


# Both servers in float32: a verification step computes its rows in one batch, and
# bfloat16's rounding (auto on a CPU with native bfloat16) moves with a step's rows enough
# to flip a near-tie against plain decoding.
@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("serve-spec") / "server.log",
                       "--api-key", API_KEY, "--max-num-seqs", "32", "--dtype", "float32",
                       "--speculative-config", NGRAM)
    yield srv
    assert srv.stop() == 0, srv.log


def _complete(url: str, body: dict) -> list[tuple]:
    r = httpx.post(f"{url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", **body},
                   headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return [(c["index"], c["text"], c["finish_reason"],
             None if c["logprobs"] is None else c["logprobs"]["tokens"])
            for c in r.json()["choices"]]


@pytest.mark.parametrize("body", REQUESTS, ids=range(len(REQUESTS)))
def test_speculating_server_matches_a_plain_one(server, spec_server, body):
    # `server` is the suite's shared float32 server without speculation.
    assert _complete(spec_server.url, body) == _complete(server.url, body)


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> bool:
    """One streamed request; every third leaves after its second chunk. True if it ran
    to the end."""
    body = {"prompt": f"Repeat {i}: {TEXT}\nAgain:", "max_tokens": 12 + i % 12,
            "temperature": 0 if i % 2 else 0.7, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH,
                             timeout=300) as r:
        assert r.status_code == 200
        chunks = 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return True
            if line.startswith("data: "):
                chunks += 1
                if i % 3 == 0 and chunks == 2:
                    return False          # leaves: the server aborts the request
    return False


def test_two_hundred_streams_with_cancellations_leak_no_block(tiny_spec_server):
    url = tiny_spec_server.url
    before = wait_idle(url)

    async def run_all() -> list[bool]:
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient() as client:
            async def one(i: int) -> bool:
                async with limit:
                    return await _stream(client, url, i)
            return await asyncio.gather(*(one(i) for i in range(200)))

    finished = asyncio.run(run_all())
    assert sum(finished) >= 120 and not all(finished)
    after = wait_idle(url)
    assert after["archserve:kv_cache_used_blocks"] == 0
    assert after["archserve:num_requests_running"] == 0
    name = "archserve:spec_decode_num_accepted_tokens_total"
    assert after[name] > before[name]


def test_metrics_carry_vllms_spec_decode_counters(spec_server):
    _complete(spec_server.url, REQUESTS[0])
    m = read_metrics(spec_server.url)
    label = '{model_name="SmolLM2-135M-Instruct"}'
    drafts = m[f"vllm:spec_decode_num_drafts_total{label}"]
    draft_tokens = m[f"vllm:spec_decode_num_draft_tokens_total{label}"]
    accepted = m[f"vllm:spec_decode_num_accepted_tokens_total{label}"]
    per_pos = [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name='
                 f'"SmolLM2-135M-Instruct",position="{p}"}}'] for p in range(4)]
    assert 0 < accepted <= draft_tokens <= 4 * drafts
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert m["archserve:spec_decode_num_drafts_total"] == drafts
