"""A step's memo of what its layers derive alike from the step's metadata."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:    # a hint only: the attention package imports this module
    from archserve.kernels.attention.interface import AttentionMetadata


class StepMemo:
    """What a step's layers derive alike from its metadata (the slots to write, the cache
    rows to gather, the padding mask, a step's decode rows), computed by the first layer
    and reused by the others: a decode step of a small model spends more in such small
    ops than in attention itself. An attention backend keeps one and begins it at its
    entry point of each layer's call. Keyed by the metadata object (held, so its id
    cannot be reused; the engine builds one per step, while the tensors in it may be views
    it reuses across steps) and a plain key; a step's metadata is not changed once its
    forward began."""

    def __init__(self) -> None:
        self.meta: AttentionMetadata | None = None
        self.entries: dict[tuple, object] = {}

    def begin(self, meta: AttentionMetadata) -> None:
        if meta is not self.meta:
            self.meta, self.entries = meta, {}

    def get(self, key: tuple, compute: Callable[[], object]) -> object:
        if key not in self.entries:
            self.entries[key] = compute()
        return self.entries[key]
