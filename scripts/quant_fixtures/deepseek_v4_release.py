"""Write a tiny DeepSeek V4 checkpoint in DeepSeek's release layout from a transformers one.

    python deepseek_v4_release.py BASE_DIR OUT_DIR [--fp4-experts]

The release's names (no ``model.`` prefix; ``embed``, ``head``, ``hc_head_fn``, the layers'
``attn.wq_a`` ... as transformers' conversion maps them back) and its FP8: the attention's and
the dense projections (``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, the indexer's
``wq_b``, the experts' and the shared experts' ``w1``/``w2``/``w3``) as e4m3 with a ue8m0
(power of two, float8_e8m0fnu) ``scale`` per 128 x 128 block; the compressors' ``wkv`` and
``wgate``, the indexer's ``weights_proj``, the router, the norms, the sinks and the
hyper-connections stay as they are. With ``--fp4-experts`` the routed experts are FP4 as
the V4 release ships them (``expert_dtype: fp4``): int8 bytes of two e2m1 values (low nibble
first) and a float8_e8m0fnu ``scale`` per 32 input channels. Also writes
``dense.safetensors`` beside the base's config: the dequantized weights under transformers'
names, for the comparison.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
QUANTIZED = re.compile(r"\.(wq_a|wq_b|wkv|wo_a|wo_b|w1|w2|w3)\.weight$")
NOT_QUANTIZED = re.compile(r"\.compressor\.(wkv|wgate)\.weight$")
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def quantize_ue8m0(weight: torch.Tensor, block: int = 128
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], ue8m0 scales [ceil(N/128), ceil(K/128)]): each block's scale the power
    of two at or above its absmax / 448."""
    n, k = weight.shape
    rn, rk = -(-n // block), -(-k // block)
    w = torch.zeros(rn * block, rk * block)
    w[:n, :k] = weight.float()
    blocks = w.reshape(rn, block, rk, block)
    absmax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(absmax / FP8_MAX)))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.reshape(rn * block, rk * block)[:n, :k].to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    n, k = q.shape
    s = scale.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s


def release_name(name: str) -> str:
    name = name.removeprefix("model.")
    name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
    return re.sub(r"^hc_head\.hc_", "hc_head_", name)


def write(base: str, out: str, fp4_experts: bool = False) -> str:
    from archserve.kernels.linear.quantized_weights import dequantize_mxfp4, quantize_mxfp4

    os.makedirs(out, exist_ok=True)
    state = load_file(os.path.join(base, "model.safetensors"))
    release, dense = {}, {}
    for name, tensor in state.items():
        new = release_name(name)
        if fp4_experts and ROUTED_EXPERT.search(new):
            q = quantize_mxfp4(tensor)
            release[new] = q.blocks.view(torch.int8)
            release[new.removesuffix("weight") + "scale"] = q.scales.view(torch.float8_e8m0fnu)
            dense[name] = dequantize_mxfp4(q)
        elif QUANTIZED.search(new) and not NOT_QUANTIZED.search(new):
            q, scale = quantize_ue8m0(tensor)
            release[new] = q
            release[new.removesuffix("weight") + "scale"] = scale.to(torch.float8_e8m0fnu)
            dense[name] = dequantize(q, scale)
        else:
            release[new] = tensor.contiguous()
            dense[name] = tensor.float()
    save_file(release, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    # Beside the base's config, not in the release: a loader reads every *.safetensors of
    # a checkpoint folder.
    save_file(dense, os.path.join(base, "dense.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128]}
    if fp4_experts:
        config["expert_dtype"] = "fp4"          # top-level, as the release writes it
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for extra in os.listdir(base):
        if extra.startswith("tokenizer") or extra.endswith(".json") and extra != "config.json":
            shutil.copy(os.path.join(base, extra), out)
    return out


if __name__ == "__main__":
    write(sys.argv[1], sys.argv[2], fp4_experts="--fp4-experts" in sys.argv[3:])
