"""Pay for GGUF metadata parsing once: the HF config and tokenizer transformers derives
from a GGUF file are saved on disk and reused while the file is unchanged.

Parsing a GGUF's metadata through transformers takes seconds per call (the gguf reader
walks every vocabulary entry), and start-up needs the config and the tokenizer. The
cache key is the file's absolute path, size and modification time plus the transformers
version, so an edited file or an upgrade re-derives. A cache that cannot be written
(read-only home) or read (corrupt) silently falls back to parsing.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Any

from archserve.cache import cache_dir

log = logging.getLogger(__name__)


def cache_root() -> str:
    return cache_dir("gguf")


def _entry_dir(gguf_path: str) -> str:
    import transformers
    stat = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(cache_root(), hashlib.sha256(key.encode()).hexdigest()[:24])


def _save(save_fn, directory: str, what: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        save_fn(directory)
    except Exception as exc:   # a cache that cannot be written must never stop a load
        log.warning("could not cache the GGUF %s in %s: %s", what, directory, exc)


def _derived(gguf_path: str, kind: str, marker: str, auto_class, fix=None) -> Any:
    """``auto_class`` (AutoConfig / AutoTokenizer) from the cache, else from the GGUF + save.

    ``fix(derived, gguf_path)`` corrects what transformers' conversion gets wrong, once,
    before the result is cached."""
    entry = os.path.join(_entry_dir(gguf_path), kind)
    if os.path.isfile(os.path.join(entry, marker)):
        try:
            return auto_class.from_pretrained(entry, local_files_only=True)
        except (OSError, ValueError) as exc:
            log.debug("ignoring unreadable cached %s %s: %s", kind, entry, exc)
    directory, name = os.path.split(os.path.abspath(gguf_path))
    derived = auto_class.from_pretrained(directory, gguf_file=name, local_files_only=True)
    if fix is not None:
        fix(derived, gguf_path)
    _save(derived.save_pretrained, entry, kind)
    return derived


@functools.lru_cache(maxsize=8)
def gguf_hf_config(gguf_path: str) -> Any:
    """The transformers config of a GGUF file (parsed once per file version)."""
    from transformers import AutoConfig
    return _derived(gguf_path, "config", "config.json", AutoConfig, _head_dim_from_metadata)


def _head_dim_from_metadata(config: Any, gguf_path: str) -> None:
    """transformers does not map ``<arch>.attention.key_length`` for every architecture and
    falls back to the config class's default (Qwen3: 128). The file says what it is."""
    from archserve.loader.gguf_loader import read_metadata_int
    key_length = read_metadata_int(gguf_path, ".attention.key_length")
    if key_length and getattr(config, "head_dim", None) != key_length:
        config.head_dim = key_length


def gguf_tokenizer(gguf_path: str) -> Any:
    """The transformers tokenizer of a GGUF file (converted once per file version)."""
    from transformers import AutoTokenizer
    return _derived(gguf_path, "tokenizer", "tokenizer_config.json", AutoTokenizer)


# Dequantized weights are cached only for small files: a 7B GGUF would become ~28 GB of fp32.
MAX_WEIGHT_CACHE_SOURCE_BYTES = 512 << 20


def _weights_file(gguf_path: str) -> str:
    return os.path.join(_entry_dir(gguf_path), "weights", "model.safetensors")


def cached_gguf_weights(gguf_path: str):
    """Iterator of (hf_name, tensor) from the dequantized-weights cache, or None."""
    path = _weights_file(gguf_path)
    if not os.path.isfile(path):
        return None
    from archserve.loader.safetensors_loader import iterate_safetensors
    return iterate_safetensors(os.path.dirname(path))


def caching_gguf_weights(gguf_path: str, weights):
    """Pass ``weights`` through; once all were read, save them for the next start."""
    if os.path.getsize(gguf_path) > MAX_WEIGHT_CACHE_SOURCE_BYTES:
        yield from weights
        return
    seen: dict = {}
    for name, tensor in weights:
        seen[name] = tensor
        yield name, tensor
    path = _weights_file(gguf_path)

    def save(directory: str) -> None:
        from safetensors.torch import save_file
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            save_file({k: v.contiguous() for k, v in seen.items()}, tmp)
            os.replace(tmp, path)   # atomic: a reader never sees half a file
        except BaseException:
            # A full disk must not keep half a file around.
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    _save(save, os.path.dirname(path), "weights")
