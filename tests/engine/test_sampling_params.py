"""SamplingParams: vLLM defaults, normalisation and validation errors that name the field."""

from __future__ import annotations

import pytest

from archserve.engine.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.max_tokens == 16 and p.stop_strings == [] and p.stop_token_ids == []
    assert not p.greedy


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("kwargs,field", [
    ({"n": 0}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -3}, "prompt_logprobs"),
    ({"stop": [""]}, "stop strings"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"top_p": 1.0}, {"top_k": 1}, {"min_p": 1.0}, {"presence_penalty": -2.0},
    {"frequency_penalty": 2.0}, {"min_tokens": 16}, {"logprobs": 0}, {"max_tokens": 1},
    {"min_tokens": 1000, "max_tokens": None},
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)
