"""load_model: path (or None for the default model) -> (model on device in dtype, config)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from archserve.loader.config import load_gguf_model_config, load_hf_model_config
from archserve.loader.default_model import resolve_model_path  # noqa: F401 - re-exported
from archserve.loader.dummy import initialize_dummy_weights
from archserve.loader.gguf_cache import cached_gguf_weights, caching_gguf_weights
from archserve.loader.gguf_loader import find_gguf_file, iterate_gguf
from archserve.loader.quantized_model import attach_quantization, finalize_quantization
from archserve.loader.safetensors_loader import iterate_safetensors
from archserve.models.config import ModelConfig
from archserve.models.layers.linear import deferred_linear_weights
from archserve.models.layers.norm_folding import fold_norm_weights
from archserve.models.registry import model_class_for
from archserve.quant.config import QuantConfig, resolve_quant_config

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def load_model_config(model_path: str) -> tuple[ModelConfig, str | None]:
    """(config, the GGUF file or None) for a local HF directory or GGUF file/directory."""
    gguf_path = find_gguf_file(model_path)
    if gguf_path is not None:
        return load_gguf_model_config(gguf_path), gguf_path
    if os.path.isdir(model_path):
        return load_hf_model_config(model_path), None
    raise ValueError(f"{model_path}: neither a Hugging Face model directory nor a .gguf file")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _with_progress(weights: Iterable[tuple[str, torch.Tensor]], description: str
                   ) -> Iterable[tuple[str, torch.Tensor]]:
    from tqdm.auto import tqdm

    # disable=None: a bar on a terminal, silence in logs and tests.
    return tqdm(weights, desc=description, unit=" tensors", disable=None)


def load_model(model_path: str | None, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", load_format: str = "auto",
               quantization: str | QuantConfig | None = None,
               model_class: type[nn.Module] | None = None
               ) -> tuple[nn.Module, ModelConfig]:
    """Build the model for ``model_path`` on ``device`` in ``dtype`` and fill its weights.

    ``dtype`` None means the checkpoint's dtype (float32 when it names none, e.g. GGUF).
    ``load_format``: "auto" (GGUF for a .gguf file or a directory holding one, else
    safetensors), "safetensors", "gguf", or "dummy" (random weights of the real shapes).
    ``quantization``: None (the checkpoint's own), a scheme name to check it against
    ("fp8" on a 16-bit checkpoint quantizes it at load), or the QuantConfig the engine
    resolved (archserve.quant.config.resolve_quant_config: it decides, for instance,
    whether a GGUF file stays quantized). Quantized layers come back holding their
    weights in the kernels' layout, ready for a kernel (engine start-up installs it).
    ``model_class``: another network over the checkpoint than its architecture's (the
    MTP layers of a DeepSeek-V3 checkpoint); one with ``reads_checkpoint_tensor(name)``
    is given only those tensors.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    path = resolve_model_path(model_path)
    config, gguf_path = load_model_config(path)
    if load_format == "gguf" and gguf_path is None:
        raise ValueError(f"{path}: load_format 'gguf' but no .gguf file there")
    if load_format == "safetensors" and gguf_path is not None:
        raise ValueError(f"{path}: load_format 'safetensors' but this is a GGUF model")
    quant = (quantization if isinstance(quantization, QuantConfig) else
             resolve_quant_config(config.quantization_config, quantization,
                                  gguf_path is not None))
    dtype = dtype or config.torch_dtype or torch.float32
    device = torch.device(device)
    if model_class is not None and gguf_path is not None:
        raise ValueError(f"{path}: {model_class.__name__} reads safetensors checkpoints, "
                         f"not GGUF files")
    model_class = model_class or model_class_for(config.architecture)
    deferred = deferred_linear_weights() if quant else contextlib.nullcontext()
    with torch.device(device), _default_dtype(dtype), deferred:
        model = model_class(config)
    if quant is not None:
        attach_quantization(model, quant, device, dtype)
    if load_format == "dummy":
        initialize_dummy_weights(model)
    elif gguf_path is not None:
        args = (gguf_path, model.checkpoint_shapes(), config.num_layers, config.num_heads,
                config.num_kv_heads)
        if quant is not None:       # kept quantized: the dense-weights cache does not apply
            kept = {f"{name}.weight" for name in model.linear_checkpoint_modules()}
            weights = iterate_gguf(*args, keep_quantized=kept)
        else:
            weights = (cached_gguf_weights(gguf_path)
                       or caching_gguf_weights(gguf_path, iterate_gguf(*args)))
        model.load_weights(_with_progress(weights, f"Loading {os.path.basename(gguf_path)}"))
    else:
        wanted = getattr(model, "reads_checkpoint_tensor", None)
        model.load_weights(_with_progress(iterate_safetensors(path, wanted),
                                          "Loading safetensors"))
    if quant is not None:
        finalize_quantization(model, dtype)
    fold_norm_weights(model)
    return model.eval(), config
