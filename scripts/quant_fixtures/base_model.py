"""The tiny base model every quantized fixture starts from, plus its calibration data.

    python base_model.py OUT_DIR        writes a bf16 LlamaForCausalLM + tokenizer to OUT_DIR

Deterministic (seed 0). Random weights, shaped to look a little like a trained model so the
quantizers have something to do: linear weights ~ N(0, 1/in_features) with a few outlier
input columns, RMSNorm weights near 1 with a few large channels (activation outliers).
Every dimension a quantization group touches (256, 512, 128 for k/v) is a multiple of 128.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, head_dim=64, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=False)


def _tiny_checkpoints():
    path = os.path.join(REPO, "tests", "tiny_checkpoints.py")
    spec = importlib.util.spec_from_file_location("_tiny_checkpoints", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_random_model(path: str, config_class, model_class, sizes: dict, init_weights,
                      seed: int = 0) -> str:
    """A ``model_class`` of ``config_class(**sizes)`` with the BPE tokenizer of
    tests/tiny_checkpoints.py, its weights set in place by ``init_weights(model, generator)``
    (under no_grad, the generator seeded with ``seed``), saved in bf16 with the tokenizer."""
    tokenizer = _tiny_checkpoints().train_tokenizer()
    torch.manual_seed(seed)
    config = config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, **sizes)
    model = model_class(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        init_weights(model, gen)
    os.makedirs(path, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build(path: str, seed: int = 0) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_random_model(path, LlamaConfig, LlamaForCausalLM, SIZES, _init_llama, seed)


def _init_llama(model, gen: torch.Generator) -> None:
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.05 * torch.randn(param.shape, generator=gen)
            outliers = torch.randperm(param.shape[0], generator=gen)[:3]
            w[outliers] *= 6.0  # a few hot hidden channels, as trained LLMs have
        elif param.dim() == 2:
            fan_in = param.shape[1]
            w = torch.randn(param.shape, generator=gen) / math.sqrt(fan_in)
            if name.endswith("embed_tokens.weight"):
                w = torch.randn(param.shape, generator=gen) * 0.5
            elif not name.endswith("lm_head.weight"):
                cols = torch.randperm(fan_in, generator=gen)[:4]
                w[:, cols] *= 4.0  # outlier input columns
        else:
            w = param + torch.randn(param.shape, generator=gen) * 0.05
        param.copy_(w)


def calibration_ids(tokenizer, n_random: int = 24, length: int = 64, seed: int = 0):
    """Token-id lists: each unique CORPUS sentence, then seeded random sequences."""
    corpus = list(dict.fromkeys(_tiny_checkpoints().CORPUS))
    samples = [tokenizer(text)["input_ids"] for text in corpus]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_random):
        samples.append(torch.randint(3, len(tokenizer), (length,), generator=gen).tolist())
    return samples


def smoke_generate(model, tokenizer, prompt: str = "The capital of France is",
                   tokens: int = 8) -> str:
    """Short greedy generation, for the load checks."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0][ids.shape[1]:])


if __name__ == "__main__":
    print(build(sys.argv[1]))


def make_each(names, root: str, make, check) -> int:
    """make(out_dir, name) then check(out_dir) for every fixture; a failure is reported and
    the others still run. Returns the process exit code."""
    results = {}
    for name in names:
        out = os.path.join(root, name)
        try:
            make(out, name)
        except Exception as exc:  # report and go on with the others
            results[name] = f"QUANTIZE FAILED: {type(exc).__name__}: {exc}"
            continue
        try:
            results[name] = f"load+generate ok: {check(out)!r}"
        except Exception as exc:
            results[name] = f"saved; LOAD FAILED: {type(exc).__name__}: {exc}"
    for name, result in results.items():
        print(f"{name}: {result}")
    return 0 if all("FAILED" not in r for r in results.values()) else 1
