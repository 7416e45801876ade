"""Iterate a Hugging Face checkpoint's tensors one at a time (``*.safetensors``).

Lazy per tensor (``safe_open`` memory-maps the file), so peak memory is one tensor, not
the checkpoint. A sharded checkpoint is read in the order its index lists the shards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files of ``model_dir``: the index's shards, or every *.safetensors."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path}: not a valid safetensors index ({exc})") from exc
        files = sorted(set(weight_map.values()))
        absent = [name for name in files if not os.path.isfile(os.path.join(model_dir, name))]
        if absent:
            raise ValueError(f"{index_path} lists shards that are missing: {', '.join(absent)}")
        return [os.path.join(model_dir, name) for name in files]
    files = sorted(name for name in os.listdir(model_dir) if name.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files")
    return [os.path.join(model_dir, name) for name in files]


def iterate_safetensors(model_dir: str, wanted: Callable[[str], bool] | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) on the CPU for every tensor of every checkpoint file (only
    those ``wanted`` accepts by name: the others are never read)."""
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys() but no __iter__
                if wanted is not None and not wanted(name):
                    continue
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise ValueError(f"{path}: tensor {name!r} cannot be read ({exc})") from exc
                yield name, tensor
