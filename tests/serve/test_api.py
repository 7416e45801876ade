"""Completions, chat and the helper endpoints, through the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY, MAX_MODEL_LEN

PROMPT = "The capital of France is"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_completion_greedy_and_usage(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8,
                                  temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    choice = r.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == 13
    again = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                      max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text


def test_completion_streaming_equals_non_streaming(client):
    full = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=8, temperature=0)
    chunks = list(client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_n_multiple_prompts_and_token_ids(client, server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=[PROMPT, "Hello"],
                                  max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]   # greedy: the n samples agree
    assert texts[0] != texts[2]                             # each prompt has its own choices
    assert r.usage.prompt_tokens == len(ids) + 1
    assert r.usage.completion_tokens == 16
    batch = client.completions.create(model="SmolLM2-135M-Instruct", prompt=[ids, ids],
                                      max_tokens=4, temperature=0)
    assert [c.text for c in batch.choices] == [texts[0], texts[0]]
    single = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids,
                                       max_tokens=4, temperature=0)
    assert single.choices[0].text == texts[0]


def test_sampled_n_with_seed_is_reproducible(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=8,
                  temperature=1.0, top_p=0.95, n=3, seed=1234)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1     # the n samples are distinct draws
    c = client.completions.create(**{**kwargs, "seed": 4321})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_stop_string_and_echo(client):
    base = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=8, temperature=0).choices[0].text
    assert "." in base
    stopped = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                        max_tokens=8, temperature=0, stop=["."])
    choice = stopped.choices[0]
    assert choice.text == base[:base.index(".")]
    assert choice.finish_reason == "stop"
    echoed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT)
    assert echoed.choices[0].text[len(PROMPT):] == base[:len(echoed.choices[0].text) - len(PROMPT)]


def test_completion_logprobs_format(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        assert 3 <= len(top) <= 4 and token in top
        assert max(top.values()) == pytest.approx(logprob)   # greedy picks the best
    echoed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=2, temperature=0, logprobs=1, echo=True)
    elp = echoed.choices[0].logprobs
    assert len(elp.tokens) == 5 + 2 and elp.token_logprobs[0] is None
    assert all(v is not None for v in elp.token_logprobs[1:])


def test_chat_completion_and_streaming(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                       max_completion_tokens=8, temperature=0)
    message = r.choices[0].message
    assert message.role == "assistant" and message.content
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=4, temperature=0.8, seed=7, n=2, logprobs=True, top_logprobs=2)
    assert len(r.choices) == 2
    for choice in r.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        for token in content:
            assert token.logprob <= 0 and len(token.top_logprobs) == 2
            assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob


def test_models_health_version_tokenize(server):
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) == 5 and tok["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert text["prompt"] == PROMPT
    chat = httpx.post(f"{server.url}/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 5


def test_metrics_exposition(server, client):
    from tests.serve.conftest import read_metrics, wait_idle
    before = read_metrics(server.url)
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=3,
                              temperature=0, extra_body={"ignore_eos": True})
    after = wait_idle(server.url)
    key = 'archserve:request_success_total{finished_reason="length"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["archserve:generation_tokens_total"] == before["archserve:generation_tokens_total"] + 3
    assert after["archserve:prompt_tokens_total"] == before["archserve:prompt_tokens_total"] + 5
    assert after["archserve:time_to_first_token_seconds_count"] == \
        before["archserve:time_to_first_token_seconds_count"] + 1
    assert after['archserve:http_requests_total{status="200"}'] > 0
    assert after["archserve:prefix_cache_queries_total"] >= after["archserve:prefix_cache_hits_total"] > 0
    assert after["archserve:kv_cache_usage_perc"] == 0
    # vLLM's names for the same metrics, with its model_name label (dashboards built for
    # vLLM read them unchanged)
    label = 'model_name="SmolLM2-135M-Instruct"'
    assert after[f"vllm:generation_tokens_total{{{label}}}"] == \
        after["archserve:generation_tokens_total"]
    assert after[f'vllm:request_success_total{{finished_reason="length",{label}}}'] == \
        after[key]
    assert after[f"vllm:num_requests_running{{{label}}}"] == 0
    assert after[f"vllm:time_to_first_token_seconds_count{{{label}}}"] == \
        after["archserve:time_to_first_token_seconds_count"]
    # a request's mean time per token: vLLM's request_time_per_output_token_seconds (its
    # time_per_output_token_seconds observes every token)
    assert after[f"vllm:request_time_per_output_token_seconds_count{{{label}}}"] == \
        after["archserve:time_per_output_token_seconds_count"] > 0
    assert not any(name.startswith("vllm:time_per_output_token") for name in after)
    assert not any(name.startswith("vllm:http_requests") for name in after)



def test_logit_bias_forces_a_token(client, server):
    auth = AUTH
    ids = httpx.post(f"{server.url}/tokenize", headers=auth,
                     json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"]
    plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                      max_tokens=1, temperature=0, logprobs=0)
    forced = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(ids[0]): 100})
    first = httpx.post(f"{server.url}/detokenize", headers=auth,
                       json={"tokens": ids[:1]}).json()["prompt"]
    assert forced.choices[0].text == first != plain.choices[0].text


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
])
def test_invalid_extras_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body=extra)
    assert info.value.body["param"] == param



def test_vllm_extensions_allowed_tokens_and_prompt_truncation(client, server):
    allowed = [28, 30]
    names = {httpx.post(f"{server.url}/detokenize", headers=AUTH,
                        json={"tokens": [t]}).json()["prompt"] for t in allowed}
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="word " * 600,
                                  max_tokens=4, temperature=1.0, seed=3, logprobs=0,
                                  extra_body={"allowed_token_ids": allowed,
                                              "truncate_prompt_tokens": 50})
    assert r.usage.prompt_tokens == 50
    assert r.choices[0].logprobs.tokens and set(r.choices[0].logprobs.tokens) <= names


def test_continue_final_message_and_chat_echo(client, server):
    """vLLM's assistant prefill: with continue_final_message the last (assistant) message is
    rendered open, so the prompt ends with its text, not an end-of-turn, and the reply
    continues it; with echo the reply repeats that text first, streamed or not."""
    messages = [{"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "My favorite color is"}]
    closed = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                        json={"messages": messages, "add_generation_prompt": False}).json()
    opened = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                        json={"messages": messages, "add_generation_prompt": False,
                              "continue_final_message": True}).json()
    assert opened["tokens"] == closed["tokens"][:opened["count"]]
    assert opened["count"] < closed["count"]           # the end-of-turn tokens are cut
    prefix = httpx.post(f"{server.url}/detokenize", headers=AUTH,
                        json={"tokens": opened["tokens"]}).json()["prompt"]
    assert prefix.endswith("My favorite color is")
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                           max_tokens=4, temperature=0, extra_body=extra)
    continuation = client.completions.create(model="SmolLM2-135M-Instruct",
                                             prompt=opened["tokens"], max_tokens=4,
                                             temperature=0)
    assert plain.choices[0].message.content == continuation.choices[0].text != ""
    echoed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                            max_tokens=4, temperature=0,
                                            extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == \
        "My favorite color is" + plain.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=4, temperature=0,
        stream=True, extra_body={**extra, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        echoed.choices[0].message.content
    # echo of a last message that is not the assistant's: only where no generation prompt
    # follows it (the reply then has its role), as in vLLM
    question = messages[:1]
    asked = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question,
                                           max_tokens=2, temperature=0,
                                           extra_body={"echo": True})
    assert not asked.choices[0].message.content.startswith("Name a color.")
    raw = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question,
                                         max_tokens=2, temperature=0,
                                         extra_body={"echo": True,
                                                     "add_generation_prompt": False})
    assert raw.choices[0].message.content.startswith("Name a color.")
    with pytest.raises(openai.BadRequestError) as info:     # both: vLLM refuses it too
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                       max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"


def test_prompt_logprobs(client, server):
    """vLLM's prompt_logprobs: per prompt token (None for the first) its own entry and the
    k most likely there, on completions (per choice) and chat (per response); refused
    with stream=true."""
    ids = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                     json={"prompt": PROMPT}).json()["tokens"]
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={
        "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}).json()
    lps = r["choices"][0]["prompt_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    echoed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=1, temperature=0, echo=True, logprobs=1)
    for position, (token, entry) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert all(e["rank"] <= 2 for t, e in entry.items() if t != str(token))
        # the prompt token's log-prob is echo's for the same position
        assert entry[str(token)]["logprob"] == \
            pytest.approx(echoed.choices[0].logprobs.token_logprobs[position], abs=1e-5)
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 5
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    # several prompts, n=2, and echo's logprobs (3) above prompt_logprobs (1) in one request:
    # each choice its own prompt's entries, cut to its own k
    both = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={
        "prompt": [PROMPT, "Hello"], "n": 2, "max_tokens": 1, "temperature": 0,
        "echo": True, "logprobs": 3, "prompt_logprobs": 1}).json()["choices"]
    hello = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                       json={"prompt": "Hello"}).json()["tokens"]
    assert [len(c["prompt_logprobs"]) for c in both] == [len(ids)] * 2 + [len(hello)] * 2
    top1 = [None] + [{t: e for t, e in entry.items() if t == str(token) or e["rank"] <= 1}
                     for token, entry in zip(ids[1:], lps[1:], strict=True)]
    # the same tokens and ranks; the values to rounding (the prompts share one batched step,
    # whose GEMMs need not round as one prompt's alone do)
    for choice in both[:2]:
        assert choice["prompt_logprobs"][0] is None
        for got, want in zip(choice["prompt_logprobs"][1:], top1[1:], strict=True):
            assert {t: (e["rank"], e["decoded_token"]) for t, e in got.items()} == \
                {t: (e["rank"], e["decoded_token"]) for t, e in want.items()}
            assert all(got[t]["logprob"] == pytest.approx(e["logprob"], abs=1e-5)
                       for t, e in want.items())
    for choice in both:     # echo's prompt entries keep their own 3 (and the token's)
        assert all(3 <= len(top) <= 4 for top in choice["logprobs"]["top_logprobs"][1:])
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                              "content": "hi"}]})):
        bad = httpx.post(f"{server.url}{path}", headers=AUTH, json={
            **body, "max_tokens": 1, "prompt_logprobs": 1, "stream": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
        zero = httpx.post(f"{server.url}{path}", headers=AUTH, json={   # 0 asks for none
            **body, "max_tokens": 1, "prompt_logprobs": 0, "stream": True})
        assert zero.status_code == 200
