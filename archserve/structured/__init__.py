"""Structured output: grammars (JSON schema, regex, choice, EBNF/Lark, structural tags)
compiled with xgrammar, and the per-step token mask of the sequences that use them.

- ``params``: ``StructuredOutputsParams``, the request's spec (vLLM's names);
- ``compiler``: compilation on worker threads, cached by spec; errors name the problem;
- ``bitmask``: per-sequence grammar state, the packed mask of a step, applying it.

The engine starts compiling when a request is prepared (``attach_grammars``) and the
scheduler admits the request once its grammar is ready; the sampler fills and applies
the mask of the constrained rows of each step. xgrammar is imported on first use only.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from concurrent.futures import Future
from typing import Any

from archserve.structured.compiler import GrammarCompiler, GrammarError
from archserve.structured.params import StructuredOutputsParams

__all__ = ["GrammarCompiler", "GrammarError", "StructuredOutputsParams", "attach_grammars",
           "grammar_error"]


def attach_grammars(compiler: GrammarCompiler | None, seqs: SequenceOf[Any]) -> Future | None:
    """Start compiling the grammar of one request's sequences (all share one spec) and
    give each its grammar state; returns the compilation's future (None for a free
    request). The future is each sequence's ``gate``: the scheduler admits it once the
    grammar is ready, and other requests run meanwhile.
    """
    if not seqs:
        return None
    spec = seqs[0].sampling_params.structured_outputs
    if spec is None:
        return None
    if compiler is None:
        raise ValueError("structured output needs the model's tokenizer; this engine has "
                         "none (skip_tokenizer_init)")
    future = compiler.submit(spec)
    from archserve.structured.bitmask import GrammarState
    for seq in seqs:
        seq.extra["grammar"] = GrammarState(future)
        seq.gate = future
    return future


def grammar_error(future: Future | None) -> GrammarError | None:
    """The error of a finished compilation, None while it runs or when it succeeded."""
    if future is None or not future.done():
        return None
    exc = future.exception()
    if exc is None:
        return None
    if isinstance(exc, GrammarError):
        return exc
    return GrammarError(f"structured output does not compile: {type(exc).__name__}: {exc}")
