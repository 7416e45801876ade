"""Iterate a GGUF file's tensors dequantized, under Hugging Face names.

Reading and dequantizing use the ``gguf`` package; names come from its HF->GGUF tensor
name map, asked once for the names the model expects. llama.cpp's converter permutes the
rows of q and k for the "llama" architecture (its RoPE kernel pairs adjacent elements,
HF pairs the two halves); we undo that here so the model keeps one (neox) RoPE layout.
For Gemma it stores every norm weight with 1 added (ggml's norm multiplies by the
weight, Gemma's by 1 + weight); we subtract it again, so a GGUF loads like its HF original.
MoE files stack a layer's routed experts in one tensor per projection
(``blk.N.ffn_gate_exps`` [E, I, H], ``ffn_up_exps``, ``ffn_down_exps`` [E, H, I]); each
expert's slice is dequantized on its own and yielded under that expert's HF name, so a
layer's experts never sit in float32 all at once.

transformers' ``load_gguf_checkpoint`` does the same but rebuilds the name map for every
submodule of a full HF model (about 6 s on SmolLM2-135M) before dequantizing everything
into one dict; this reader streams tensor by tensor.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Container, Iterable, Iterator

import numpy as np
import torch

# GGUF architectures whose q/k rows were permuted by llama.cpp's converter.
_PERMUTED_QK_ARCHITECTURES = {"llama"}
# GGUF architectures whose "*_norm.weight" tensors were stored as 1 + weight.
_UNIT_OFFSET_NORM_ARCHITECTURES = {"gemma", "gemma2", "gemma3"}
# GGUF architecture -> transformers model type, where they differ (Mixtral: gguf_model_type).
_GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# One expert's matrix in an HF name ("mlp.experts.3.gate_proj"): its index is dropped to
# ask the gguf name map for the layer's stacked tensor ("mlp.experts.gate_proj").
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def gguf_model_type(architecture: str, expert_count: int) -> str:
    """The transformers model type of a GGUF architecture: llama.cpp writes Mixtral as
    "llama" with experts."""
    if architecture == "llama" and expert_count:
        return "mixtral"
    return _GGUF_MODEL_TYPES.get(architecture, architecture)


@functools.cache
def _reader_class():
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        """gguf's reader over a plain ndarray view of its memory map. It slices the map
        once per metadata element (a 262k-entry vocabulary: millions of slices), and a
        numpy.memmap slice pays the memmap subclass's bookkeeping each time: the parse
        takes 3.5x the CPU time (Gemma-3-270M: 9.2 s against 2.6 s)."""

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray)

    return PlainArrayReader


def open_gguf(path: str):
    """gguf's GGUFReader for ``path`` (metadata parsed, tensors mapped, not read); a file
    it cannot read is a ValueError naming it."""
    try:
        return _reader_class()(path)
    except Exception as exc:  # the reader raises ValueError, struct or numpy errors
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"
                         ) from exc


def _architecture(reader, path: str) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def gguf_to_hf_names(gguf_architecture: str, num_layers: int, hf_names: Iterable[str]
                     ) -> dict[str, str | tuple[str, ...]]:
    """Map GGUF tensor names to the given HF names (those the model expects). A stacked
    expert tensor maps to the tuple of its experts' HF names, in expert order."""
    import gguf

    arch = next((key for key, value in gguf.MODEL_ARCH_NAMES.items()
                 if value == gguf_architecture), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {gguf_architecture!r} is unknown to the gguf "
                         "package")
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    mapping: dict[str, str | tuple[str, ...]] = {}
    experts: dict[str, dict[int, str]] = {}
    for hf_name in hf_names:
        base, _, suffix = hf_name.rpartition(".")
        expert = _EXPERT_INDEX.search(base)
        if expert is not None:
            stacked = f"{base[:expert.start()]}.experts.{base[expert.end():]}"
            gguf_base = name_map.get_name(stacked)
            if gguf_base is not None:
                experts.setdefault(f"{gguf_base}.{suffix}", {})[int(expert[1])] = hf_name
            continue
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            mapping[f"{gguf_base}.{suffix}"] = hf_name
    for gguf_name, by_index in experts.items():
        mapping[gguf_name] = tuple(by_index[e] for e in sorted(by_index))
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
    reader = open_gguf(path)
    architecture = _architecture(reader, path)
    names = gguf_to_hf_names(architecture, num_layers, hf_names)
    permuted = architecture in _PERMUTED_QK_ARCHITECTURES
    norm_offset = architecture in _UNIT_OFFSET_NORM_ARCHITECTURES
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name, tensor.name)
        if isinstance(hf_name, tuple):
            yield from _split_experts(path, tensor, hf_name)
            continue
        kept = _kept_quantized(tensor, hf_name, keep_quantized, num_heads, num_kv_heads,
                               permuted)
        if kept is not None:
            yield hf_name, kept
            continue
        weight = _dequantize(path, tensor, tensor.data)
        if permuted and ".attn_q." in tensor.name:
            weight = _unpermute_rows(weight, num_heads)
        elif permuted and ".attn_k." in tensor.name:
            weight = _unpermute_rows(weight, num_kv_heads)
        if norm_offset and tensor.name.endswith("_norm.weight"):
            weight = weight - 1.0
        if tensor.name.endswith(".ffn_gate_inp_shexp.weight") and weight.ndim == 1:
            weight = weight[None]     # llama.cpp stores Qwen2-MoE's shared gate as [H], HF [1, H]
        yield hf_name, _as_torch(weight)


def _dequantize(path: str, tensor, data) -> np.ndarray:
    import gguf

    try:
        return gguf.quants.dequantize(data, tensor.tensor_type)
    except Exception as exc:
        raise ValueError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) "
                         f"cannot be dequantized ({exc})") from exc


def _as_torch(weight: np.ndarray) -> torch.Tensor:
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if not weight.flags.writeable:  # unquantized tensors are views of the read-only map
        weight = weight.copy()
    return torch.from_numpy(weight)


def _split_experts(path: str, tensor, hf_names: tuple[str, ...]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expert of a stacked expert tensor, dequantized (the MoE kernels read no GGUF
    blocks: experts are never kept quantized)."""
    if tensor.data.shape[0] != len(hf_names):
        raise ValueError(f"{path}: tensor {tensor.name} stacks {tensor.data.shape[0]} experts, "
                         f"the model config has {len(hf_names)}")
    for expert, hf_name in enumerate(hf_names):
        yield hf_name, _as_torch(_dequantize(path, tensor, tensor.data[expert]))


def read_metadata_ints(path: str, *key_suffixes: str) -> dict[str, int]:
    """The integer metadata values whose keys end with the given suffixes (e.g.
    ".attention.key_length" matches "qwen3.attention.key_length"), by suffix; the file's
    metadata is parsed once for all of them."""
    reader = open_gguf(path)
    found = {}
    for key, field in reader.fields.items():
        for suffix in key_suffixes:
            if key.endswith(suffix) and field.data:
                found[suffix] = int(field.parts[field.data[0]][0])
    return found


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
