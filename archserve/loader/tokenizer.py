"""Tokenizer loading, chat templates, and incremental (streaming) detokenization."""

from __future__ import annotations

import os
from typing import Any

from archserve.loader.gguf_loader import find_gguf_file


def has_tokenizer(model_path: str) -> bool:
    if model_path.endswith(".gguf"):
        return True
    return any(os.path.exists(os.path.join(model_path, name))
               for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def dummy_without_tokenizer(model_path: str, load_format: str) -> bool:
    """Dummy weights of a real shape often come as a bare config.json: benchmarks and
    warm-ups feed token ids, so such a model runs without a tokenizer rather than fail."""
    return load_format == "dummy" and not has_tokenizer(model_path)


def load_tokenizer(model_path: str | None = None) -> Any:
    """The HF tokenizer of a local HF directory or GGUF file (None: the default model)."""
    from transformers import AutoTokenizer

    if model_path is None:
        from archserve.loader.default_model import default_model_path
        model_path = default_model_path()
    if not os.path.exists(model_path):
        raise ValueError(f"tokenizer path {model_path!r} does not exist")
    gguf_path = find_gguf_file(model_path)
    try:
        if gguf_path is not None:
            from archserve.loader.gguf_cache import gguf_tokenizer
            return gguf_tokenizer(gguf_path)
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"{model_path}: cannot load a tokenizer ({type(exc).__name__}: {exc})"
                         ) from exc


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, tokenize: bool = True,
                        continue_final_message: bool = False) -> list[int] | str:
    """Render ``messages`` with the tokenizer's chat template; token ids or the text.

    The template already writes any BOS it wants, so the text is encoded without adding
    special tokens again. ``continue_final_message``: the last message is left open (its
    end-of-turn cut), so generation continues its text.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
    extra = {"continue_final_message": True} if continue_final_message else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **extra)
    if not tokenize:
        return text
    return tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turn one sequence's token ids, fed a few at a time, into text deltas.

    Decoding each new token alone breaks multi-byte characters split over tokens and
    loses SentencePiece's leading spaces. Instead we decode a short window that starts a
    few tokens back (``prefix_offset``) with and without the new tokens and emit the
    difference, holding it back while it ends in an incomplete character (U+FFFD). The
    window restarts after every emitted delta, so a step costs O(window), not O(length).

    Byte-fallback tokens (``<0xE4>``, SentencePiece models) are decoded as a run: an
    invalid run turns *every* byte of it into U+FFFD, so text ending in such a token is
    held back until a normal token closes the run (skipped special tokens do not).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 prompt_ids: list[int] | None = None, context_tokens: int = 5) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens as left context make the first output token's leading
        # space come out as it would in the middle of text.
        context = list(prompt_ids[-context_tokens:]) if prompt_ids else []
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""
        self._skipped_ids = set(tokenizer.all_special_ids) if skip_special_tokens else set()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _ends_in_byte_run(self) -> bool:
        # Only the ids since the last emission can matter: text was emitted only when the
        # visible tail before them was not a byte token.
        for token_id in reversed(self.ids[self.read_offset:]):
            if token_id in self._skipped_ids:
                continue
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            return isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x")
        return False

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append generated ids; return the text they complete (may be empty)."""
        self.ids.extend(new_ids)
        if self._ends_in_byte_run():
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        delta = window_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.output_text += delta
        return delta

    def finish(self) -> str:
        """Emit what is held back, less an incomplete character at its very end: the
        output stopped inside that character (max_tokens, a stop token), and U+FFFD in
        its place would be text the model never wrote."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset:])
        delta = window_text[len(prefix_text):].rstrip("\ufffd")
        self.prefix_offset = self.read_offset = len(self.ids)
        self.output_text += delta
        return delta
