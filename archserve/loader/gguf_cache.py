"""Pay for GGUF metadata parsing once: the HF config and tokenizer transformers derives
from a GGUF file are saved on disk and reused while the file is unchanged.

Parsing a GGUF's metadata through transformers takes seconds per call (the gguf reader
walks every vocabulary entry), and start-up needs the config and the tokenizer. The
cache key is the file's content (its sha256) plus the transformers version: copies of one
file in several installs share one entry, and an edited file or an upgrade re-derives.
The content hash itself is remembered per (path, size, modification time), so a file is
read for hashing once. A cache that cannot be written (read-only home) or read (corrupt)
silently falls back to parsing.
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


@functools.lru_cache(maxsize=16)
def _content_digest(gguf_path: str, size: int, mtime_ns: int) -> str:
    """sha256 of the file, looked up by (path, size, mtime) before it is computed."""
    where = f"{os.path.abspath(gguf_path)}|{size}|{mtime_ns}"
    index = os.path.join(cache_root(), "by-path", hashlib.sha256(where.encode()).hexdigest()[:24])
    try:
        with open(index, encoding="utf-8") as f:
            digest = f.read().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    sha = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        while chunk := f.read(8 << 20):
            sha.update(chunk)
    digest = sha.hexdigest()
    _save(lambda directory: _write_text(index, digest), os.path.dirname(index), "file hash")
    return digest


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# Raised whenever _correct_config changes, so configs derived by an older rule are redone.
_DERIVATION = 2


def _entry_dir(gguf_path: str) -> str:
    import transformers
    stat = os.stat(gguf_path)
    key = (f"{_content_digest(gguf_path, stat.st_size, stat.st_mtime_ns)}|"
           f"{transformers.__version__}|{_DERIVATION}")
    return os.path.join(cache_root(), hashlib.sha256(key.encode()).hexdigest()[:24])


def _save(save_fn, directory: str, what: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        save_fn(directory)
    except Exception as exc:   # a cache that cannot be written must never stop a load
        log.warning("could not cache the GGUF %s in %s: %s", what, directory, exc)


def _derived(gguf_path: str, kind: str, marker: str, auto_class, fix=None) -> Any:
    """``auto_class`` (AutoConfig / AutoTokenizer) from the cache, else from the GGUF + save.

    ``fix(derived, gguf_path)`` returns it corrected where transformers' conversion gets
    it wrong, once, before the result is cached."""
    entry = os.path.join(_entry_dir(gguf_path), kind)
    if os.path.isfile(os.path.join(entry, marker)):
        try:
            return auto_class.from_pretrained(entry, local_files_only=True)
        except (OSError, ValueError) as exc:
            log.debug("ignoring unreadable cached %s %s: %s", kind, entry, exc)
    directory, name = os.path.split(os.path.abspath(gguf_path))
    derived = auto_class.from_pretrained(directory, gguf_file=name, local_files_only=True)
    if fix is not None:
        derived = fix(derived, gguf_path)
    _save(derived.save_pretrained, entry, kind)
    return derived


@functools.lru_cache(maxsize=8)
def gguf_hf_config(gguf_path: str) -> Any:
    """The transformers config of a GGUF file (parsed once per file version)."""
    from transformers import AutoConfig
    return _derived(gguf_path, "config", "config.json", AutoConfig, _correct_config)


# Metadata transformers does not map for every architecture: it falls back to the config
# class's defaults (Qwen3: head_dim 128; Qwen2/3-MoE: the released models' expert widths).
_METADATA_FIELDS = {".attention.key_length": "head_dim",
                    ".expert_feed_forward_length": "moe_intermediate_size",
                    ".expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


def _correct_config(config: Any, gguf_path: str) -> Any:
    """The config with what the file says where transformers' conversion differs, and
    Mixtral's: llama.cpp writes Mixtral as "llama" with experts, which transformers reads
    as a dense Llama (or Mistral)."""
    from archserve.loader.gguf_loader import read_metadata_ints
    found = read_metadata_ints(gguf_path, *_METADATA_FIELDS, ".expert_count",
                               ".expert_used_count")
    if found.get(".expert_count") and config.model_type in ("llama", "mistral"):
        from transformers import MixtralConfig
        fields = {k: v for k, v in config.to_dict().items()
                  if k not in ("model_type", "architectures", "transformers_version")}
        config = MixtralConfig(**fields, num_local_experts=found[".expert_count"],
                               num_experts_per_tok=found[".expert_used_count"])
    for suffix, name in _METADATA_FIELDS.items():
        value = found.get(suffix)
        # Every decoder has a head dim; only MoE configs have expert widths.
        applies = name == "head_dim" or hasattr(config, name)
        if value and applies and getattr(config, name, None) != value:
            setattr(config, name, value)
    return config


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
    if os.path.isfile(path):
        # Said once, when it is written: the cache is much larger than the GGUF file.
        log.info("cached the dequantized weights of %s (%.0f MB) in %s, shared by every copy "
                 "of this file; set ARCHSERVE_CACHE_DIR to keep it elsewhere, delete it to "
                 "free the space", os.path.basename(gguf_path),
                 os.path.getsize(path) / 1e6, os.path.dirname(path))
