"""Iterate a GGUF file's tensors dequantized, under Hugging Face names.

Reading and dequantizing use the ``gguf`` package; names come from its HF->GGUF tensor
name map, asked once for the names the model expects. llama.cpp's converter permutes the
rows of q and k for the "llama" architecture (its RoPE kernel pairs adjacent elements,
HF pairs the two halves); we undo that here so the model keeps one (neox) RoPE layout.
For Gemma it stores every norm weight with 1 added (ggml's norm multiplies by the
weight, Gemma's by 1 + weight); we subtract it again, so a GGUF loads like its HF original.

transformers' ``load_gguf_checkpoint`` does the same but rebuilds the name map for every
submodule of a full HF model (about 6 s on SmolLM2-135M) before dequantizing everything
into one dict; this reader streams tensor by tensor.
"""

from __future__ import annotations

import os
from collections.abc import Container, Iterable, Iterator

import numpy as np
import torch

# GGUF architectures whose q/k rows were permuted by llama.cpp's converter.
_PERMUTED_QK_ARCHITECTURES = {"llama"}
# GGUF architectures whose "*_norm.weight" tensors were stored as 1 + weight.
_UNIT_OFFSET_NORM_ARCHITECTURES = {"gemma", "gemma2", "gemma3"}


def _open_reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct or numpy errors
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"
                         ) from exc


def _architecture(reader, path: str) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def gguf_to_hf_names(gguf_architecture: str, num_layers: int, hf_names: Iterable[str]
                     ) -> dict[str, str]:
    """Map GGUF tensor names to the given HF names (those the model expects)."""
    import gguf

    arch = next((key for key, value in gguf.MODEL_ARCH_NAMES.items()
                 if value == gguf_architecture), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {gguf_architecture!r} is unknown to the gguf "
                         "package")
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    mapping = {}
    for hf_name in hf_names:
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            mapping[f"{gguf_base}.{suffix}"] = hf_name
    return mapping


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # The converter stored each head's rows as interleaved pairs (r0, r_half, r1, ...);
    # regroup them into the two halves again.
    half = weight.shape[0] // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _kept_quantized(tensor, hf_name: str, keep_quantized: Container[str], num_heads: int,
                    num_kv_heads: int, permuted: bool):
    """The tensor as integer groups (GgufGroups), or None when it is to be dequantized."""
    import gguf

    from archserve.quant.gguf_blocks import KEPT_QUANTIZED, GgufGroups, split_blocks

    type_name = tensor.tensor_type.name
    if hf_name not in keep_quantized or type_name not in KEPT_QUANTIZED:
        return None
    rows, cols = gguf.quants.quant_shape_from_byte_shape(tensor.data.shape, tensor.tensor_type)
    weight = GgufGroups(split_blocks(type_name, np.asarray(tensor.data), rows, cols))
    heads = {".attn_q.": num_heads, ".attn_k.": num_kv_heads}
    for part, count in heads.items():
        if permuted and part in tensor.name:
            order = _unpermute_rows(np.arange(rows).reshape(rows, 1), count)[:, 0]
            weight = weight.permute_rows(order)
    return weight


def iterate_gguf(path: str, hf_names: Iterable[str], num_layers: int, num_heads: int,
                 num_kv_heads: int, keep_quantized: Container[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, float32 tensor) for every GGUF tensor the model knows.

    Tensors with no HF counterpart among ``hf_names`` are yielded under their GGUF name,
    so the model's loader reports them as unexpected instead of silently dropping them.
    Tensors named in ``keep_quantized`` whose type archserve keeps quantized come as
    GgufGroups (integer groups, archserve.quant.gguf_blocks) instead.
    """
    import gguf

    reader = _open_reader(path)
    architecture = _architecture(reader, path)
    names = gguf_to_hf_names(architecture, num_layers, hf_names)
    permuted = architecture in _PERMUTED_QK_ARCHITECTURES
    norm_offset = architecture in _UNIT_OFFSET_NORM_ARCHITECTURES
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name, tensor.name)
        kept = _kept_quantized(tensor, hf_name, keep_quantized, num_heads, num_kv_heads,
                               permuted)
        if kept is not None:
            yield hf_name, kept
            continue
        try:
            weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ValueError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) "
                             f"cannot be dequantized ({exc})") from exc
        if permuted and ".attn_q." in tensor.name:
            weight = _unpermute_rows(weight, num_heads)
        elif permuted and ".attn_k." in tensor.name:
            weight = _unpermute_rows(weight, num_kv_heads)
        if norm_offset and tensor.name.endswith("_norm.weight"):
            weight = weight - 1.0
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if not weight.flags.writeable:  # unquantized tensors are views of the read-only map
            weight = weight.copy()
        yield hf_name, torch.from_numpy(weight)


def read_metadata_int(path: str, key_suffix: str) -> int | None:
    """The integer metadata value whose key ends with ``key_suffix`` (e.g.
    ".attention.key_length" matches "qwen3.attention.key_length"), or None."""
    reader = _open_reader(path)
    for key, field in reader.fields.items():
        if key.endswith(key_suffix) and field.data:
            return int(field.parts[field.data[0]][0])
    return None


def split_gguf_path(path: str) -> tuple[str, str]:
    """(directory, file name): the form transformers' ``gguf_file=`` arguments want."""
    directory, name = os.path.split(os.path.abspath(path))
    return directory, name


def find_gguf_file(path: str) -> str | None:
    """``path`` itself if it is a .gguf file, the only .gguf in a directory, else None."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path):
        found = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(found) > 1:
            raise ValueError(f"{path} holds several GGUF files ({', '.join(found)}); "
                             "pass the one to load")
        if found:
            return os.path.join(path, found[0])
    return None
