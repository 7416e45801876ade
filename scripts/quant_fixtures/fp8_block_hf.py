"""Write an HF ``quant_method: fp8`` block-quantized checkpoint (DeepSeek-V3 / Qwen3-FP8 layout).

    python fp8_block_hf.py BASE_DIR OUT_DIR [BLOCK_N BLOCK_K]

Each q/k/v/o/gate/up/down ``weight`` [N, K] (or those of ``linears``) becomes float8_e4m3fn plus a float32
``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)] with scale_inv = block absmax / 448, so that
dequantized weight = fp8 value * weight_scale_inv of its block. Everything else stays bf16.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_block(weight: torch.Tensor, bn: int, bk: int):
    n, k = weight.shape
    rn, rk = -(-n // bn), -(-k // bk)
    w = torch.zeros(rn * bn, rk * bk, dtype=torch.float32)
    w[:n, :k] = weight.float()
    blocks = w.reshape(rn, bn, rk, bk)
    absmax = blocks.abs().amax(dim=(1, 3))
    scale_inv = (absmax / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(rn * bn, rk * bk)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.float().contiguous()


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, bn: int, bk: int):
    n, k = q.shape
    s = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * s


def write(base: str, out: str, block=(128, 128), linears=LINEARS) -> str:
    bn, bk = block
    os.makedirs(out, exist_ok=True)
    state = load_file(os.path.join(base, "model.safetensors"))
    tensors = {}
    for name, t in state.items():
        if name.endswith(".weight") and name.split(".")[-2] in linears:
            q, s = quantize_block(t, bn, bk)
            err = (dequantize_block(q, s, bn, bk) - t.float()).abs().max() / t.float().abs().max()
            assert err < 0.07, (name, float(err))
            tensors[name] = q
            tensors[name[:-len("weight")] + "weight_scale_inv"] = s
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": [bn, bk]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    for extra in os.listdir(base):
        if extra.startswith("tokenizer") or extra in ("generation_config.json",
                                                       "chat_template.jinja",
                                                       "special_tokens_map.json"):
            shutil.copy(os.path.join(base, extra), os.path.join(out, extra))
    return out


def check(path: str) -> str:
    """Load with transformers (it dequantizes fp8 to bf16 when no GPU is present), generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import base_model
    model = AutoModelForCausalLM.from_pretrained(path)
    return base_model.smoke_generate(model, AutoTokenizer.from_pretrained(path))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--check"]
    out = write(args[0], args[1], (int(args[2]), int(args[3])) if len(args) > 3 else (128, 128))
    name = os.path.basename(out.rstrip("/"))
    if "--check" in sys.argv:
        try:
            print(f"{name}: load+generate ok: {check(out)!r}")
        except Exception as exc:
            print(f"{name}: saved; LOAD FAILED: {type(exc).__name__}: {exc}")
            sys.exit(1)
    else:
        print(f"{name}: saved")
