"""Tokenizer loading, chat template, and the incremental detokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from archserve.loader.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def smollm_tokenizer(embedded_model_path):
    return load_tokenizer(embedded_model_path)


def sentencepiece_style_tokenizer():
    """A Llama-style tokenizer (metaspace, byte fallback) built offline from a tiny vocab."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "he", "ll", "llo", "▁hello",
              "▁world", "é", "▁é", "中", "文", "▁中文"]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁", "w"), ("h", "e"), ("l", "l"), ("ll", "o")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def stream(tokenizer, ids: list[int], chunks: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    text, start = "", 0
    for size in chunks:
        if start >= len(ids):
            break
        text += detok.add_tokens(ids[start:start + size])
        start += size
    if start < len(ids):
        text += detok.add_tokens(ids[start:])
    text += detok.finish()
    assert detok.output_text == text
    return text


def full_decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def full_text(tokenizer, ids: list[int]) -> str:
    """What a stream of ``ids`` shows: the full decode, less the U+FFFD of a character
    cut off at the end (finish() drops it: the model never wrote that character)."""
    return full_decode(tokenizer, ids).rstrip("\ufffd")


def test_chat_template_renders(smollm_tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = apply_chat_template(smollm_tokenizer, messages, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    ids = apply_chat_template(smollm_tokenizer, messages)
    assert smollm_tokenizer.decode(ids) == text
    plain = apply_chat_template(smollm_tokenizer, messages, add_generation_prompt=False,
                                tokenize=False)
    assert not plain.endswith("assistant\n")


def test_multibyte_text_streams_exactly(smollm_tokenizer):
    text = "héllo 世界 — emoji 🦙🦙 and ẞ, done."
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    assert stream(smollm_tokenizer, ids, [1] * len(ids)) == full_decode(smollm_tokenizer, ids)
    # the llama emoji is 4 bytes split over several byte tokens: no partial char leaks out
    detok = IncrementalDetokenizer(smollm_tokenizer)
    assert all("\ufffd" not in detok.add_tokens([i]) for i in ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=40),
       chunks=st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_random_byte_level_ids_stream_like_full_decode(smollm_tokenizer, ids, chunks):
    assert stream(smollm_tokenizer, ids, chunks) == full_text(smollm_tokenizer, ids)


SP = sentencepiece_style_tokenizer()


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, SP.vocab_size - 1), min_size=1, max_size=30),
       chunks=st.lists(st.integers(1, 3), min_size=1, max_size=30))
def test_random_sentencepiece_ids_stream_like_full_decode(ids, chunks):
    assert stream(SP, ids, chunks) == full_text(SP, ids)


def test_finish_drops_a_character_cut_off_at_the_end(smollm_tokenizer):
    ids = smollm_tokenizer.encode("ok 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm_tokenizer)
    text = detok.add_tokens(ids[:-1])         # the emoji's last byte never comes
    assert text + detok.finish() == "ok "


def test_sentencepiece_leading_spaces_survive_streaming():
    ids = SP.encode("hello world 中文 é", add_special_tokens=False)
    assert full_decode(SP, ids) == "hello world 中文 é"
    detok = IncrementalDetokenizer(SP)
    deltas = [detok.add_tokens([i]) for i in ids]
    assert "".join(deltas) == "hello world 中文 é"
    assert " w" in deltas  # the space of a mid-text token is not stripped like the first


def test_window_stays_short():
    detok = IncrementalDetokenizer(SP)
    for i in SP.encode("hello world " * 50, add_special_tokens=False):
        detok.add_tokens([i])
        assert len(detok.ids) - detok.prefix_offset <= 2


def test_missing_tokenizer_path():
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer("/nonexistent/tok")
