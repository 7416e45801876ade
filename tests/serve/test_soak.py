"""200 concurrent streaming requests, some cancelled by their clients mid-flight.

Every request that was not cancelled must complete; greedy ones with exactly the text
the offline LLM.generate gives. Afterwards no KV block is held and the request counters
account for every request exactly once.
"""

from __future__ import annotations

import asyncio
import random

import openai

from tests.serve.conftest import API_KEY, MAX_MODEL_LEN, read_metrics, wait_idle

NUM_REQUESTS = 200
MAX_TOKENS = 6
PROMPTS = [f"{subject} is" for subject in (
    "The capital of France", "The sun", "A good breakfast", "Python", "The ocean",
    "My favourite book", "The best way to learn", "Winter", "A computer", "Music")]
_REASONS = ("stop", "length", "abort")


def _success(metrics: dict[str, float], reason: str) -> float:
    return metrics.get(f'archserve:request_success_total{{finished_reason="{reason}"}}', 0.0)


async def _one(client: openai.AsyncOpenAI, index: int, rng: random.Random) -> dict:
    greedy = index % 2 == 0
    prompt = PROMPTS[index % len(PROMPTS)]
    cancel_after = rng.randrange(0, 4) if rng.random() < 0.25 else None
    kwargs = dict(temperature=0.0) if greedy else dict(temperature=0.9, seed=index)
    text, finish, reached = "", None, False

    async def consume():
        nonlocal text, finish, reached
        stream = await client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
            **kwargs)
        received = 0
        async for chunk in stream:
            reached = True
            if cancel_after is not None and received >= cancel_after:
                await stream.close()      # the client walks away mid-stream
                return
            received += 1
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish

    if cancel_after == 0:   # some give up before the first byte arrives
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    else:
        await consume()
    return {"prompt": prompt, "greedy": greedy, "cancelled": cancel_after is not None,
            "text": text, "finish": finish, "reached": reached}


async def _run_all(url: str) -> list[dict]:
    rng = random.Random(20240611)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0,
                                  timeout=300) as client:
        jobs = [_one(client, i, random.Random(rng.random())) for i in range(NUM_REQUESTS)]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=400)


def test_soak_concurrent_streams_with_cancellations(server):
    from archserve.engine.llm import LLM
    from archserve.engine.sampling_params import SamplingParams

    before = read_metrics(server.url)
    results = asyncio.run(_run_all(server.url))
    after = wait_idle(server.url)

    completed = [r for r in results if not r["cancelled"]]
    cancelled = [r for r in results if r["cancelled"]]
    assert cancelled and len(completed) > NUM_REQUESTS // 2
    assert all(r["finish"] in ("stop", "length") for r in completed)

    # Nothing left behind, and every request ended exactly once in the counters.
    assert after["archserve:kv_cache_used_blocks"] == 0
    assert after["archserve:num_requests_running"] == 0
    assert after["archserve:num_requests_waiting"] == 0
    ended = {r: _success(after, r) - _success(before, r) for r in _REASONS}
    # Requests cancelled before their bytes left the client never reach the server; every
    # one that streamed at least one chunk did, and must have ended exactly once.
    reached = sum(1 for r in results if r["reached"])
    assert reached <= sum(ended.values()) <= NUM_REQUESTS
    assert ended["abort"] <= len(cancelled)
    assert ended["stop"] + ended["length"] >= len(completed)

    # Greedy results equal the offline engine's for the same prompts.
    llm = LLM(max_model_len=MAX_MODEL_LEN, dtype="float32")     # as the server runs
    reference = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    expected = {p: out.outputs[0].text for p, out in zip(PROMPTS, reference, strict=True)}
    greedy = [r for r in completed if r["greedy"]]
    assert greedy
    mismatches = [(r["prompt"], r["text"], expected[r["prompt"]]) for r in greedy
                  if r["text"] != expected[r["prompt"]]]
    assert not mismatches, mismatches[:5]
