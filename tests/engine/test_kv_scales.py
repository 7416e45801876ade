"""FP8 KV-cache scales: read from the checkpoint, or measured on the first prefill.

The tiny model is rescaled so its keys and values are in the thousands (k_proj and v_proj
times 1000, q_proj and o_proj divided by 1000: the same function), far beyond e4m3's 448.
With scales of 1.0 the fp8 cache saturates and the output is wrong; with the checkpoint's
scales, or calibrated ones, it matches the 16-bit cache's output within fp8 rounding.

On the CPU (where the engine keeps a 16-bit cache: no fp8 arithmetic) the model is stepped
by hand over an fp8 cache with the reference attention; on a GPU the whole engine runs,
graphs included.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from archserve.loader.loader import load_model
from tests.models.helpers import PROMPTS, PagedSequences, tiny_hf_model

GAIN = 1000.0


def _rescaled_checkpoint(path, scales: dict[str, torch.Tensor] | None = None,
                         **overrides) -> str:
    hf = tiny_hf_model("llama", **overrides)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj, gain in ((layer.self_attn.k_proj, GAIN), (layer.self_attn.v_proj, GAIN),
                               (layer.self_attn.q_proj, 1 / GAIN),
                               (layer.self_attn.o_proj, 1 / GAIN)):
                proj.weight.mul_(gain)
    hf.save_pretrained(path)
    if scales:
        file = os.path.join(path, "model.safetensors")
        save_file({**load_file(file), **scales}, file, metadata={"format": "pt"})
    return str(path)


def _kv_amax(path: str) -> list[tuple[float, float]]:
    """Per layer, the largest |k| and |v| over PROMPTS: the largest entries of a 16-bit
    cache after a prefill (rotary keeps the norm of each pair, not each entry, so the
    test's headroom of 200 / 448 covers the difference)."""
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    cache = PagedSequences.for_config(config)
    cache.run(model, dict(enumerate(PROMPTS)))
    return [(float(kv[0].abs().max()), float(kv[1].abs().max())) for kv in cache.kv_caches]


def _attention_layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "kv_scales_from")]


def _decode_logits(model, config, kv_cache_dtype: str, calibrate: bool = False,
                   steps: int = 4) -> torch.Tensor:
    """Prefill PROMPTS, then ``steps`` decode steps of fixed tokens: the decode logits."""
    cache = PagedSequences.for_config(config, kv_cache_dtype=kv_cache_dtype)
    cache.run(model, dict(enumerate(PROMPTS)), calibrate_kv_scales=calibrate)
    out = []
    for step in range(steps):
        out.append(cache.run(model, {i: [10 + step + i] for i in range(len(PROMPTS))}))
    return torch.stack(out)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> str:
    return _rescaled_checkpoint(tmp_path_factory.mktemp("kv-plain"))


@pytest.fixture(scope="module")
def reference(plain) -> torch.Tensor:
    model, config = load_model(plain, dtype=torch.float32, device="cpu")
    return _decode_logits(model, config, "auto")


def _error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits - reference).abs().max() / reference.abs().max())


def test_unit_scales_saturate_the_rescaled_model(plain, reference):
    """The premise: without scales an fp8 cache gets this model wrong."""
    model, config = load_model(plain, dtype=torch.float32, device="cpu")
    assert {layer.kv_scales_from for layer in _attention_layers(model)} == {"default"}
    assert _error(_decode_logits(model, config, "fp8_e4m3"), reference) > 0.3


def test_checkpoint_kv_scales_are_read_and_used(plain, reference, tmp_path):
    amax = _kv_amax(plain)
    # llm-compressor's names on layer 0, ModelOpt's on layer 1: both are read.
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(amax[0][0] / 200),
              "model.layers.0.self_attn.v_scale": torch.tensor(amax[0][1] / 200),
              "model.layers.1.self_attn.k_proj.k_scale": torch.tensor([amax[1][0] / 200]),
              "model.layers.1.self_attn.v_proj.v_scale": torch.tensor([amax[1][1] / 200])}
    model, config = load_model(_rescaled_checkpoint(tmp_path, scales), dtype=torch.float32,
                               device="cpu")
    layers = _attention_layers(model)
    assert [layer.kv_scales_from for layer in layers] == ["checkpoint", "checkpoint"]
    assert layers[1].v_scale == pytest.approx(amax[1][1] / 200, rel=1e-6)
    assert _error(_decode_logits(model, config, "fp8_e4m3"), reference) < 0.05
    # A 16-bit cache ignores them: exactly the model without them.
    torch.testing.assert_close(_decode_logits(model, config, "auto"), reference)


def test_calculate_kv_scales_measures_them_on_the_first_prefill(plain, reference):
    model, config = load_model(plain, dtype=torch.float32, device="cpu")
    logits = _decode_logits(model, config, "fp8_e4m3", calibrate=True)
    layers = _attention_layers(model)
    assert {layer.kv_scales_from for layer in layers} == {"calibrated"}
    assert all(layer.k_scale > 1.0 and layer.v_scale > 1.0 for layer in layers)
    assert _error(logits, reference) < 0.05


def test_a_bad_checkpoint_scale_is_a_clear_error(tmp_path):
    bad = _rescaled_checkpoint(tmp_path, {"model.layers.0.self_attn.k_scale":
                                          torch.tensor(-1.0)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale.*positive"):
        load_model(bad, dtype=torch.float32, device="cpu")


@pytest.mark.gpu
def test_engine_calibrates_fp8_kv_scales_then_captures_graphs(tmp_path):
    """The whole engine on a GPU: calculate_kv_scales defers the decode graphs to after the
    first prefill, and the fp8 run's prompt log-probabilities (the first prefill, which
    reads the cache it calibrated) match the 16-bit cache's; without the scales they do
    not. On the CPU the same model gives 0.05 with calibrated scales, 0.70 without."""
    from archserve import LLM, SamplingParams

    # Head size 64: TRITON_ATTN's (graph-capturable) range; bf16, the GPU's dtype.
    plain = _rescaled_checkpoint(tmp_path, hidden_size=256, head_dim=64,
                                 num_attention_heads=4, num_key_value_heads=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = {}
    for name, kwargs in (("auto", {}), ("unscaled", dict(kv_cache_dtype="fp8_e4m3")),
                         ("fp8", dict(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True))):
        llm = LLM(plain, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64,
                  max_num_seqs=4, kv_cache_memory_bytes=1 << 26, **kwargs)
        runner = llm.llm_engine.runner
        assert (runner.graphs is None) == (name == "fp8"), name   # deferred until calibrated
        outs = llm.generate(prompts, params)
        runs[name] = torch.tensor([o.prompt_logprobs[pos][o.prompt_token_ids[pos]].logprob
                                   for o in outs for pos in range(1, len(o.prompt_token_ids))])
        if name == "fp8":
            assert runner.graphs is not None and runner.graphs.set.sizes, \
                runner.graphs and runner.graphs.set.demoted
            layers = _attention_layers(llm.llm_engine.model)
            assert {layer.kv_scales_from for layer in layers} == {"calibrated"}, \
                [(layer.kv_scales_from, layer.k_scale, layer.v_scale) for layer in layers]
            assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        del llm, runner
        torch.cuda.empty_cache()
    errors = {name: float((runs[name] - runs["auto"]).abs().max()) for name in runs}
    assert errors["fp8"] < 0.2, errors
    assert errors["unscaled"] > 0.3, errors
