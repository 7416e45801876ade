"""A Hugging Face transformers model loaded from a GGUF file by transformers' own code.

It is the reference archserve is compared with (tests, `bench --peer transformers`).
``from_pretrained(gguf_file=...)`` would do, but it requires ``accelerate``, which
archserve does not otherwise need; this is the same load without it.
"""

from __future__ import annotations

from typing import Any

import torch


class _ParametersOnly:
    """What transformers' GGUF name mapping reads from a model: config and parameter names.

    Handing it the full model makes it rebuild the name table for each of ~400 submodules
    (about 6 s on a 135M model); the names are the same either way.
    """

    def __init__(self, model: Any) -> None:
        self.config = model.config
        self._state = model.state_dict()

    def state_dict(self) -> dict:
        return self._state

    def named_children(self):
        return iter(())


def transformers_model_from_gguf(path: str, hf_config: Any = None,
                                 dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model for the GGUF file at ``path`` (on the CPU, eval mode)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from archserve.loader.gguf_cache import gguf_hf_config
    hf_config = hf_config if hf_config is not None else gguf_hf_config(path)
    with torch.device("meta"):  # no random init of weights that are overwritten anyway
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    tensors = load_gguf_checkpoint(path, return_tensors=True,
                                   model_to_load=_ParametersOnly(model))["tensors"]
    tensors = {name: t.to(dtype) for name, t in tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"{path}: transformers could not map every GGUF tensor "
                         f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    model.tie_weights()
    # Buffers built in __init__ were left on the meta device: the rotary inverse
    # frequencies, and Gemma's embedding scale (sqrt(hidden_size)).
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_config)
    embed = model.get_input_embeddings()
    if hasattr(embed, "scalar_embed_scale"):
        embed.embed_scale = torch.tensor(embed.scalar_embed_scale)
    left = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if left:
        raise ValueError(f"{path}: transformers' model kept buffers on the meta device: {left}")
    return model.eval()
