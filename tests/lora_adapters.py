"""PEFT LoRA adapters of tiny checkpoints, made by ``peft`` itself (random weights), and
transformers + peft's greedy reference for them. Shared by the engine, server and GPU tests."""

from __future__ import annotations

import json
import os

import torch

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(base_path: str, out_path: str, target_modules, r: int = 8,
                      lora_alpha: float = 16, seed: int = 0, scale: float = 0.1,
                      **config) -> str:
    """A LoRA adapter of the checkpoint at ``base_path`` with random A and B (normal *
    ``scale``: a visible change, not noise), saved by peft under ``out_path``. ``config``:
    more LoraConfig fields (use_rslora, rank_pattern, alpha_pattern, use_dora ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules,
                      init_lora_weights=False, **config)
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(out_path)
    return out_path


def peft_model(base_path: str, adapter_path: str | None, dtype: torch.dtype = torch.float32,
               device: str = "cpu"):
    """transformers' model of ``base_path`` with the adapter applied by peft (None: base)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype).to(device).eval()
    if adapter_path is None:
        return model
    from peft import PeftModel
    return PeftModel.from_pretrained(model, adapter_path).to(device).eval()


def greedy_reference(model, prompt_ids: list[int], num_tokens: int
                     ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens with a full forward per step, and each step's log-softmax (float32)."""
    ids = list(prompt_ids)
    logprobs = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].float()
            logprobs.append(torch.log_softmax(logits, -1).cpu())
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):], logprobs


def write_adapter(path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> str:
    """An adapter directory written by hand, as peft lays it out (``config`` None: without
    adapter_config.json), for what peft will not make."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    if config is not None:
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def lora_pair(module: str, rank: int, in_features: int, out_features: int
              ) -> dict[str, torch.Tensor]:
    """Zero lora_A / lora_B tensors of ``module`` under peft's names."""
    prefix = f"base_model.model.{module}"
    return {f"{prefix}.lora_A.weight": torch.zeros(rank, in_features),
            f"{prefix}.lora_B.weight": torch.zeros(out_features, rank)}
