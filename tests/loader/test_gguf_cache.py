"""The GGUF cache: entries keyed by the file's content, the dense weights' size said once."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant", "gguf-mixed",
                       "tiny-mixed.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    from archserve.loader import gguf_cache
    gguf_cache._content_digest.cache_clear()
    return gguf_cache


def test_copies_of_one_file_share_one_entry_and_an_edit_gets_its_own(cache, tmp_path):
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "other-name.gguf"
    for path in (first, second):
        path.parent.mkdir()
        shutil.copy(FIXTURE, path)
    assert cache._entry_dir(str(first)) == cache._entry_dir(str(second))
    with open(second, "ab") as f:
        f.write(b"\0")
    assert cache._entry_dir(str(first)) != cache._entry_dir(str(second))


def test_the_dense_weights_cache_says_where_and_how_big(cache, tmp_path, caplog):
    import torch
    path = tmp_path / "m.gguf"
    shutil.copy(FIXTURE, path)
    weights = [("w", torch.zeros(1000, dtype=torch.float32))]
    with caplog.at_level(logging.INFO, logger="archserve.loader.gguf_cache"):
        assert list(cache.caching_gguf_weights(str(path), iter(weights)))[0][0] == "w"
    (message,) = [r.getMessage() for r in caplog.records if "dequantized weights" in r.message]
    assert "MB" in message and str(tmp_path / "cache") in message
    assert [name for name, _ in cache.cached_gguf_weights(str(path))] == ["w"]


def test_open_gguf_reads_what_ggufs_reader_reads_without_memmap_slices(embedded_model_path):
    """The embedded model (a 49k-entry vocabulary): the same fields and tensor bytes as
    gguf's own reader; its slices are plain ndarrays (cheap), not numpy.memmap ones."""
    import gguf
    import numpy as np

    from archserve.loader.gguf_loader import open_gguf
    ours, theirs = open_gguf(embedded_model_path), gguf.GGUFReader(embedded_model_path)
    assert type(ours.data) is np.ndarray
    assert list(ours.fields) == list(theirs.fields)
    for name in ("general.architecture", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert ours.fields[name].contents() == theirs.fields[name].contents()
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == [
        (t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors,
                                                              strict=True))
