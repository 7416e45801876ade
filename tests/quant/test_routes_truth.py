"""Routes tell the truth: what explain and doctor print as the route is code that runs.

For every scheme ``explain`` knows and every device profile, either the printed route of
every layer is a backend implemented in this build, or explain says the model is not
loadable (and prints no route). A scheme explain calls loadable has a tiny real
checkpoint that loads and generates (test_fixtures_end_to_end.py).
"""

from __future__ import annotations

import pytest

from archserve.kernels.catalog import default_registry
from archserve.platform.profiles import all_profiles, get_profile
from archserve.quant.schemes import SCHEMES
from archserve.routing.doctor import run_doctor
from archserve.routing.explain import explain_model
from archserve.routing.model_summary import summary_from_hf_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}

# Scheme -> the fixture(s) under tests/fixtures/quant that prove it loads and generates.
FIXTURES = {
    "compressed-tensors": ["ct-fp8-tensor-static", "ct-fp8-channel-dynamic", "ct-fp8-block",
                           "ct-int8-w8a8", "ct-w4a16-g128-sym", "ct-w4a16-g32-asym",
                           "ct-w8a16-g128"],
    "gptq": ["gptq-w4-g128-sym", "gptq-w4-g32-asym-actorder", "gptq-w8-g128"],
    "gptq_marlin": ["gptq-w4-g128-sym"], "awq": ["awq-w4-g64"], "awq_marlin": ["awq-w4-g64"],
    "fp8": ["online fp8 of a dense checkpoint"], "fp8_block": ["hf-fp8-block"],
    "gguf": ["gguf-mixed"], "w8a8_int8": ["ct-int8-w8a8"], "mxfp4": ["gpt-oss-mxfp4"],
}


def _explain(profile: str, scheme: str):
    summary = summary_from_hf_config(LLAMA)
    return explain_model(get_profile(profile), summary, quantization=scheme,
                         libraries="installed")


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("profile", ["v100", "t4", "a100", "h100", "b200", "mi300x", "cpu"])
def test_every_printed_route_runs_in_this_build(profile: str, scheme: str) -> None:
    out = _explain(profile, scheme)
    registry = default_registry()
    if out.not_loadable:
        assert all(r.backend == "" for r in out.routes)
        # Only vLLM's refusal may be said of a scheme that does not load: never a route.
        assert not [d for d in out.decisions if d.what == "quantization"
                    and not d.reason.startswith("vLLM 0.33 refuses")]
        return
    for route in out.routes:
        assert registry.get(route.op, route.backend).implemented, (route.layer, route.backend)
    for decision in out.decisions:
        if decision.what == "quantization" and decision.chosen.isupper():
            assert registry.get("linear", decision.chosen).implemented


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_scheme_is_loadable_only_with_a_real_checkpoint_to_show_it(scheme: str) -> None:
    loadable = _explain("cpu", scheme).not_loadable is None
    assert loadable == (scheme in FIXTURES), _explain("cpu", scheme).not_loadable


@pytest.mark.parametrize("profile", [p.id for p in all_profiles()])
def test_doctor_routes_run_in_this_build(profile: str) -> None:
    report = run_doctor(get_profile(profile))
    registry = default_registry()
    for op, r in report.ops.items():
        if r.route is not None:
            base_op = op.split()[0]   # "linear fp8", "mla_attention sparse (DSA)": the op's row
            assert registry.get(base_op, r.route.backend).implemented, (op, r.route.backend)


@pytest.mark.parametrize("config,needle", [
    ({**LLAMA, "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"},
     "architecture 'Olmo2ForCausalLM' is not supported in this build"),
    ({**LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
      "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
      "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                              "desc_act": True}},
     "with GPTQ act order"),
    ({**LLAMA, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "quantization method 'bitsandbytes' is not loadable in this build"),
    ({**LLAMA, "quantization_config": {"quant_method": "gptq", "bits": 3, "group_size": 128}},
     "GPTQ 3-bit"),
])
def test_unloadable_checkpoint_is_refused_before_any_weight_is_read(tmp_path, config,
                                                                     needle) -> None:
    import json

    from archserve import LLM

    small = {**config, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 64,
             "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(small))
    # Not a safetensors file: reading any weight would fail with another message.
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ValueError, match=needle):
        LLM(str(tmp_path), skip_tokenizer_init=True)
    out = explain_model(get_profile("cpu"), summary_from_hf_config(small))
    assert needle.split(" (")[0] in out.not_loadable


def test_moe_refusals_name_what_this_build_lacks() -> None:
    """Int8 W8A8 and act-order experts are refused up front; fp8, W4A16, online fp8 and
    GGUF experts (which the GGUF config leaves to be dequantized) load."""
    from archserve.quant.config import gguf_quant_config, online_quant_config, parse_quant_config
    from archserve.quant.plan import expert_quant, quantized_experts_refusal
    assert expert_quant(gguf_quant_config()) is None
    assert quantized_experts_refusal(gguf_quant_config(), has_moe=True) is None
    assert quantized_experts_refusal(online_quant_config("fp8"), has_moe=True) is None
    w4 = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 128})
    assert quantized_experts_refusal(w4, has_moe=True) is None
    act_order = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 128,
                                    "desc_act": True})
    assert "act order" in quantized_experts_refusal(act_order, has_moe=True)
    int8 = parse_quant_config({"quant_method": "compressed-tensors", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                 "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                    "dynamic": True}}}})
    assert "not int8" in quantized_experts_refusal(int8, has_moe=True)
    assert quantized_experts_refusal(w4, has_moe=False) is None
