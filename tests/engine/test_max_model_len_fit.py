"""The context length against the KV pool, checked before any weight is read: the model's
own length is lowered to what fits (with a one-line notice), an explicit one that does not
fit is an error that comes before the load."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from archserve import LLM, SamplingParams
from archserve.engine import startup
from archserve.engine.config import EngineConfig
from archserve.engine.kv_cache import DEFAULT_CPU_KV_BYTES
from archserve.engine.llm_engine import LLMEngine
from archserve.loader.loader import load_model_config

# The tiny checkpoint in float32: 2 layers x keys and values x 2 KV heads x 16 x 4 = 512 bytes a
# token; blocks of 16 tokens. Ten blocks' worth of memory holds 160 tokens, fewer than its
# 256 positions.
TEN_BLOCKS = 10 * 16 * 512


def test_the_models_length_is_lowered_to_what_fits_with_a_notice(tiny_checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="archserve"):
        llm = LLM(tiny_checkpoint("llama"), kv_cache_memory_bytes=TEN_BLOCKS, dtype="float32")
    engine = llm.llm_engine
    assert engine.max_model_len == 160 and engine.report.max_model_len == 160
    notices = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(notices) == 1 and "256 tokens do not fit" in notices[0], notices
    decision = next(d for d in engine.report.decisions if d.what == "max_model_len")
    assert (decision.requested, decision.chosen) == ("auto", "160")
    assert "decision: max_model_len: auto -> 160" in engine.describe_route()
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.outputs[0].finish_reason == "length"


def test_an_explicit_length_that_does_not_fit_fails_before_the_weights_load(
        tiny_checkpoint, tmp_path):
    # The weights are unreadable: an error about them would mean the load came first.
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("llama"), broken)
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            (broken / name).write_bytes(b"not safetensors")
    config = EngineConfig(model=str(broken), max_model_len=200, dtype="float32",
                          kv_cache_memory_bytes=TEN_BLOCKS)
    with pytest.raises(ValueError, match=r"max_model_len=200 does not fit: the KV cache has "
                                         r"room for 160 tokens \(kv_cache_memory_bytes="):
        LLMEngine(config)
    # The same checkpoint with a length that fits does reach the load, and fails there.
    with pytest.raises(Exception) as info:
        LLMEngine(EngineConfig(model=str(broken), max_model_len=160, dtype="float32",
                               kv_cache_memory_bytes=TEN_BLOCKS))
    assert "does not fit" not in str(info.value)


def test_a_cpus_default_budget_is_known_exactly_before_the_load(tiny_checkpoint):
    config, _ = load_model_config(tiny_checkpoint("llama"))
    capacity, sizing, exact = startup.kv_capacity_before_load(
        EngineConfig(), config, None, torch.float32, 16, torch.device("cpu"))
    assert exact and capacity == DEFAULT_CPU_KV_BYTES // 512 and "CPU default budget" in sizing
    with pytest.raises(ValueError, match=f"lower max_model_len \\(to {capacity} or less\\)"):
        startup.fit_max_model_len(capacity + 1, capacity + 1, capacity, sizing)
