"""Structured output: grammars (JSON schema, regex, choice, EBNF/Lark, structural tags)
compiled with xgrammar, and the per-step token mask of the sequences that use them.

- ``params``: ``StructuredOutputsParams``, the request's spec (vLLM's names);
- ``compiler``: compilation on worker threads, cached by spec; errors name the problem;
- ``bitmask``: per-sequence grammar state, the packed mask of a step, applying it.

The engine compiles when a request is prepared (``attach_grammars``); the sampler fills
and applies the mask of the constrained rows of each step.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Any

from archserve.structured.compiler import GrammarCompiler, GrammarError
from archserve.structured.params import StructuredOutputsParams

__all__ = ["GrammarCompiler", "GrammarError", "StructuredOutputsParams", "attach_grammars"]


def attach_grammars(compiler: GrammarCompiler | None, seqs: SequenceOf[Any]) -> None:
    """Give each sequence of one request its grammar state (nothing for a free request).

    Raises ValueError (GrammarError) when the spec does not compile: the request is
    refused before it is queued. With the server's compile-ahead this is a cache hit.
    """
    if not seqs:
        return
    spec = seqs[0].sampling_params.structured_outputs
    if spec is None:
        return
    if compiler is None:
        raise ValueError("structured output needs the model's tokenizer; this engine has "
                         "none (skip_tokenizer_init)")
    compiled = compiler.compile(spec)
    from archserve.structured.bitmask import GrammarState
    for seq in seqs:
        seq.extra["grammar"] = GrammarState(compiled)
