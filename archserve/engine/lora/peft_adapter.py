"""Read a PEFT LoRA adapter directory: ``adapter_config.json`` and its weights.

What PEFT saves: per adapted linear ``base_model.model.<module>.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r]; the delta of input x is (x A^T) B^T times ``lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``), r and alpha per module where
``rank_pattern`` / ``alpha_pattern`` name it (a key matches a module whose name ends with
it, as PEFT matches). Everything else an adapter may carry (DoRA, LoRA biases, fully
trained ``modules_to_save``, embedding adapters, expert parameters) is refused with the
reason: serving it without its part would give other outputs than the adapter's.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

ADAPTER_CONFIG = "adapter_config.json"
SAFETENSORS_WEIGHTS = "adapter_model.safetensors"
PICKLE_WEIGHTS = "adapter_model.bin"
# vLLM's accepted --max-lora-rank values.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

_PEFT_PREFIX = "base_model.model."
_LORA_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(\.[^.]+)?\.weight$")
# Config switches whose features the delta (x A^T) B^T * scaling does not cover, with the
# value that means "off".
_UNSUPPORTED = {
    "use_dora": (False, "DoRA adapters (use_dora) are not supported"),
    "lora_bias": (False, "LoRA biases (lora_bias) are not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D weights) is not supported"),
    "modules_to_save": (None, "modules_to_save (fully trained modules) is not supported: an "
                              "adapter may only add LoRA deltas to linear layers"),
    "target_parameters": (None, "adapters of parameters (target_parameters: MoE experts) "
                                "are not supported: MoE experts take no LoRA adapters, one "
                                "fused kernel runs them all"),
    "trainable_token_indices": (None, "trainable_token_indices is not supported"),
    "layer_replication": (None, "layer_replication is not supported"),
}


@dataclass(frozen=True)
class LoRAModule:
    """One adapted linear of the adapter: x -> (x A^T) B^T * scaling."""

    a: torch.Tensor          # [r, in_features]
    b: torch.Tensor          # [out_features, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    path: str
    modules: dict[str, LoRAModule]     # by the base model's module name
    rank: int                          # the largest rank of its modules
    weights_file: str

    @property
    def target_modules(self) -> list[str]:
        return sorted(self.modules)


def read_peft_adapter(path: str, max_lora_rank: int) -> PeftAdapter:
    """The adapter at ``path``; ValueError naming the problem when it is not a LoRA adapter
    this engine serves, or its rank exceeds ``max_lora_rank``."""
    where = f"LoRA adapter {path!r}"
    if not path or not os.path.isdir(path):
        raise ValueError(f"{where}: no such directory")
    config = _read_config(path, where)
    weights_file, tensors = _read_tensors(path, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _LORA_TENSOR.match(name)
        if match is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA matrix of a linear "
                             f"layer (embedding adapters, DoRA magnitudes and saved modules "
                             f"are not supported)")
        module = match["module"].removeprefix(_PEFT_PREFIX)
        pairs.setdefault(module, {})[match["which"]] = tensor
    if not pairs:
        raise ValueError(f"{where}: {weights_file} holds no LoRA matrices")
    modules = {module: _module(module, pair, config, where)
               for module, pair in sorted(pairs.items())}
    rank = max(m.rank for m in modules.values())
    if rank > max_lora_rank:
        raise ValueError(f"{where}: LoRA rank {rank} is greater than max_lora_rank "
                         f"{max_lora_rank}; start the engine with a larger --max-lora-rank")
    return PeftAdapter(os.path.abspath(path), modules, rank, weights_file)


def _read_config(path: str, where: str) -> dict:
    file = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{where}: no {ADAPTER_CONFIG}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"{where}: a {kind} adapter; only LoRA adapters are served")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: {ADAPTER_CONFIG} needs a positive {key!r}, got "
                             f"{value!r}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: LoRA biases (bias={config['bias']!r}) are not supported")
    for key, (off, reason) in _UNSUPPORTED.items():
        value = config.get(key, off)
        if value not in (off, [], {}, "", False, None):
            raise ValueError(f"{where}: {reason} ({key}={value!r})")
    return config


def _read_tensors(path: str, where: str) -> tuple[str, dict[str, torch.Tensor]]:
    safetensors_file = os.path.join(path, SAFETENSORS_WEIGHTS)
    pickle_file = os.path.join(path, PICKLE_WEIGHTS)
    try:
        if os.path.isfile(safetensors_file):
            from safetensors.torch import load_file
            return SAFETENSORS_WEIGHTS, load_file(safetensors_file)
        if os.path.isfile(pickle_file):
            # Tensors only: a pickle that holds anything else is refused by torch.
            return PICKLE_WEIGHTS, torch.load(pickle_file, map_location="cpu",
                                              weights_only=True)
    except Exception as exc:   # a damaged file: its reader's reason, as a bad input
        raise ValueError(f"{where}: cannot read its weights ({type(exc).__name__}: "
                         f"{exc})") from None
    raise ValueError(f"{where}: no {SAFETENSORS_WEIGHTS} (or {PICKLE_WEIGHTS})")


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank/alpha pattern rule: the first key that the module name ends with (as a
    regular expression over whole name segments)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _module(module: str, pair: dict[str, torch.Tensor], config: dict, where: str
            ) -> LoRAModule:
    if set(pair) != {"A", "B"}:
        missing = "lora_B" if "A" in pair else "lora_A"
        raise ValueError(f"{where}: {module} has no {missing} matrix")
    a, b = pair["A"], pair["B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B "
                         f"{tuple(b.shape)} are not [r, in] and [out, r]")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise ValueError(f"{where}: {module}: LoRA matrices must be floating point")
    rank = a.shape[0]
    alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    pattern_rank = _pattern_value(config.get("rank_pattern"), module, config["r"])
    if pattern_rank != rank:
        raise ValueError(f"{where}: {module} has rank {rank}, its config says {pattern_rank}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return LoRAModule(a, b, float(scaling))
