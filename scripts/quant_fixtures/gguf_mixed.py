"""A tiny GGUF whose linear weights use every block type archserve keeps quantized, mixed
inside fused layers (q/k Q4_K with v Q6_K, gate Q4_0 with up Q5_0 ...), as Q4_K_M files do.

    python scripts/quant_fixtures/gguf_mixed.py OUT_DIR

The base model is base_model.py's; the legacy types are quantized by the gguf package,
the K-quants by libgguf (llama.cpp's quantizer): `pip install gguf libgguf`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

# layer -> projection -> GGUF type; both layers together use all seven kept types.
TYPES = {
    0: {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q8_0",
        "gate_proj": "Q4_0", "up_proj": "Q5_0", "down_proj": "Q5_K"},
    1: {"q_proj": "Q4_1", "k_proj": "Q8_0", "v_proj": "Q4_K", "o_proj": "Q6_K",
        "gate_proj": "Q5_K", "up_proj": "Q4_K", "down_proj": "Q4_0"},
}


def linear_type(hf_name: str) -> str | None:
    parts = hf_name.split(".")
    return TYPES[int(parts[2])][parts[-2]]


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out_dir: str) -> None:
    base = _load("base_model", os.path.join(HERE, "base_model.py"))
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from tiny_checkpoints import write_tiny_gguf

    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as hf_dir:
        base.build(hf_dir)
        write_tiny_gguf(hf_dir, os.path.join(out_dir, "tiny-mixed.gguf"), linear_type)


if __name__ == "__main__":
    main(sys.argv[1])
