"""Reading quantization_config: every loadable format, and a clear refusal of the rest."""

from __future__ import annotations

import pytest

from archserve.kernels.linear.quantized_weights import (
    ACT_DYNAMIC_GROUP,
    ACT_DYNAMIC_TOKEN,
    ACT_NONE,
    ACT_STATIC_TENSOR,
)
from archserve.quant.config import (
    AWQ,
    CT_FLOAT,
    CT_INT,
    CT_PACKED,
    GPTQ,
    HF_FP8,
    ONLINE_FP8,
    UnsupportedQuantization,
    parse_quant_config,
    resolve_quant_config,
)


def ct(weights: dict, acts: dict | None = None, fmt: str = "float-quantized",
       ignore=("lm_head",), targets=("Linear",)) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": list(targets), "weights": weights,
                                          "input_activations": acts}}}


FP8_W = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


@pytest.mark.parametrize("weights,acts,expect", [
    ({**FP8_W, "strategy": "tensor"}, {"num_bits": 8, "type": "float", "strategy": "tensor",
                                       "dynamic": False}, ("tensor", ACT_STATIC_TENSOR)),
    ({**FP8_W, "strategy": "channel"}, {"num_bits": 8, "type": "float", "strategy": "token",
                                        "dynamic": True}, ("channel", ACT_DYNAMIC_TOKEN)),
    ({**FP8_W, "strategy": "block", "block_structure": [128, 128]},
     {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True},
     ("block", ACT_DYNAMIC_GROUP)),
    ({**FP8_W, "strategy": "channel"}, None, ("channel", ACT_NONE)),
])
def test_compressed_tensors_fp8(weights, acts, expect) -> None:
    config = parse_quant_config(ct(weights, acts))
    layer = config.layer("model.layers.0.self_attn.q_proj")
    assert layer.layout == CT_FLOAT and (layer.strategy, layer.activation) == expect
    assert config.layer("lm_head") is None


def test_compressed_tensors_int8_and_packed() -> None:
    int8 = parse_quant_config(ct({"num_bits": 8, "type": "int", "strategy": "channel",
                                  "symmetric": True},
                                 {"num_bits": 8, "type": "int", "strategy": "token",
                                  "dynamic": True}, fmt="int-quantized"))
    assert int8.layers[0].layout == CT_INT and int8.layers[0].weight_format == "int8"
    w4 = parse_quant_config(ct({"num_bits": 4, "type": "int", "strategy": "group",
                                "group_size": 32, "symmetric": False}, fmt="pack-quantized"))
    layer = w4.layers[0]
    assert (layer.layout, layer.bits, layer.group_size, layer.symmetric) == (
        CT_PACKED, 4, 32, False)
    assert layer.describe() == "int4 asymmetric weights (group 32), 16-bit activations"


def test_targets_and_ignore_patterns() -> None:
    config = parse_quant_config(ct({**FP8_W, "strategy": "channel"}, None,
                                   ignore=["lm_head", "re:.*mlp.down_proj$"],
                                   targets=["re:.*self_attn.*", "re:.*mlp.*"]))
    assert config.layer("model.layers.3.mlp.down_proj") is None
    assert config.layer("model.layers.3.mlp.up_proj") is not None
    assert config.layer("model.layers.3.self_attn.o_proj") is not None


def test_gptq_awq_hf_fp8() -> None:
    gptq = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 32,
                               "sym": False, "desc_act": True})
    assert gptq.layers[0].layout == GPTQ and gptq.layers[0].act_order
    assert gptq.layers[0].zero_point_offset == 1          # the v1 format stores zero - 1
    v2 = parse_quant_config({"quant_method": "gptq", "bits": 8, "group_size": -1,
                             "checkpoint_format": "gptq_v2"})
    assert v2.layers[0].strategy == "channel" and v2.layers[0].zero_point_offset == 0
    awq = parse_quant_config({"quant_method": "awq", "bits": 4, "group_size": 64,
                              "zero_point": True, "version": "gemm"})
    assert awq.layers[0].layout == AWQ and not awq.layers[0].symmetric
    block = parse_quant_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                "activation_scheme": "dynamic"})
    assert block.method == "fp8_block" and block.layers[0].layout == HF_FP8
    assert block.layers[0].block == (128, 128)


def test_hf_fp8_modules_to_not_convert_covers_the_modules_under_a_name() -> None:
    """transformers skips a module named in modules_to_not_convert, any module whose name
    ends with it, and every module under it; a DeepSeek-V3 router or kv_b_proj named there
    stays 16-bit."""
    config = parse_quant_config({
        "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0", "self_attn.kv_b_proj"]})
    assert config.layer("model.layers.0.self_attn.q_a_proj") is None
    assert config.layer("model.layers.0.mlp.experts.3.up_proj") is None
    assert config.layer("model.layers.2.self_attn.kv_b_proj") is None
    assert config.layer("model.layers.1.self_attn.q_a_proj") is not None
    assert config.layer("model.layers.10.mlp.down_proj") is not None


@pytest.mark.parametrize("config,needle", [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not loadable"),
    ({"quant_method": "awq", "version": "gemv"}, "AWQ 4-bit gemv"),
    ({"quant_method": "gptq", "bits": 3}, "GPTQ 3-bit"),
    (ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}),
     "float4 weights are not loadable"),
    (ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "W4A8"),
])
def test_unloadable_configs_say_why(config, needle) -> None:
    with pytest.raises(UnsupportedQuantization, match=needle):
        parse_quant_config(config)


def test_quantization_flag_is_checked_against_the_checkpoint() -> None:
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    assert resolve_quant_config(awq, "awq_marlin").method == "awq"
    with pytest.raises(UnsupportedQuantization, match="does not match the checkpoint"):
        resolve_quant_config(awq, "gptq")
    online = resolve_quant_config(None, "fp8")
    assert online.layers[0].layout == ONLINE_FP8
    with pytest.raises(UnsupportedQuantization, match="only fp8 can be made at load"):
        resolve_quant_config(None, "awq")
    assert resolve_quant_config(None, None) is None
    assert resolve_quant_config(None, "gguf", is_gguf=True) is None
