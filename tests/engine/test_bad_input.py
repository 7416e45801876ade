"""Bad input gets a clear ValueError, changes nothing, and never stops other requests."""

from __future__ import annotations

import os

import pytest

from archserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), max_model_len=64)


@pytest.mark.parametrize("prompt, message", [
    ("", "empty"),
    ([], "empty"),
    ([1, 2, 10**9], "token ids"),
    ("word " * 200, "maximum context length"),
])
def test_bad_prompts_are_rejected_and_others_keep_running(llm, prompt, message):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    good = engine.add_request(None, "Hello world", params)
    with pytest.raises(ValueError, match=message):
        engine.add_request(None, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == [good]
    assert len(finished[good].outputs[0].token_ids) == 6
    assert engine.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(n=0), "n must"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logprobs=-1), "logprobs"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generate_validates_every_prompt_before_queueing(llm):
    with pytest.raises(ValueError):
        llm.generate(["Hello", ""], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    rid = engine.add_request(None, "Hello world, " * 5, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.block_pool.num_used_blocks > 0
    assert engine.abort_request(rid)
    assert engine.block_pool.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_corrupt_safetensors(tiny_checkpoint, tmp_path):
    import shutil
    src = tiny_checkpoint("llama")
    dst = tmp_path / "corrupt"
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(dst))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad))


def test_unknown_architecture(tiny_checkpoint, tmp_path):
    import json
    import shutil
    dst = tmp_path / "unknown-arch"
    shutil.copytree(tiny_checkpoint("llama"), dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MadeUpForCausalLM"):
        LLM(str(dst))


def test_impossible_attention_override(tiny_checkpoint):
    with pytest.raises(ValueError, match="FLASH_ATTN"):
        LLM(tiny_checkpoint("llama"), attention_backend="FLASH_ATTN")
    with pytest.raises(ValueError, match="valid choices"):
        LLM(tiny_checkpoint("llama"), attention_backend="NOPE")


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_logprobs=60000), "prompt_logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(seed=1.5), "seed"),
    (dict(min_tokens=2.5), "min_tokens"),
])
def test_more_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_vllm_arguments_are_accepted_or_refused_clearly(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), tensor_parallel_size=1, trust_remote_code=True,
              disable_log_stats=True)
    assert llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    # Refused before any worker starts: 4 heads do not split over 3 ranks.
    with pytest.raises(ValueError, match="tensor_parallel_size=3: 4 attention heads"):
        LLM(tiny_checkpoint("llama"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="awq"):
        LLM(tiny_checkpoint("llama"), quantization="awq")
    with pytest.raises(TypeError, match="unknown LLM argument"):
        LLM(tiny_checkpoint("llama"), not_a_real_option=3)


def test_a_long_prompt_that_truncation_makes_valid_is_accepted(llm):
    long_ids = list(range(3, 203))               # 200 tokens, max_model_len 64
    out = llm.generate([{"prompt_token_ids": long_ids}],
                       SamplingParams(max_tokens=2, truncate_prompt_tokens=16))
    assert out[0].prompt_token_ids == long_ids[-16:]
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([{"prompt_token_ids": long_ids}], SamplingParams(max_tokens=2))


def test_generate_tokenizes_each_prompt_once(llm, monkeypatch):
    tokenizer = llm.get_tokenizer()
    calls = []
    original = type(tokenizer).encode

    def counting_encode(self, *args, **kwargs):
        calls.append(args[0] if args else kwargs.get("text"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "encode", counting_encode)
    llm.generate(["Hello there", "General Kenobi"], SamplingParams(max_tokens=1))
    assert sorted(c for c in calls if c in ("Hello there", "General Kenobi")) == \
        ["General Kenobi", "Hello there"]
