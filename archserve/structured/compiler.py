"""Grammar compilation with xgrammar: cached by spec, done on a worker thread.

``GrammarCompiler.submit`` starts (or finds) the compilation of a spec and returns a
future; the server awaits it before it hands the request to the engine, so the engine's
step never waits for a compiler. ``compile`` is the blocking form (the offline API and
the engine's own check). A spec that does not compile raises ``GrammarError`` (a
ValueError) whose message names the problem; failures are cached like successes, so a
client repeating a bad schema costs nothing.

xgrammar and its tokenizer table are loaded on first use (importing it takes seconds),
so engines that never see a constrained request never pay for it.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from archserve.structured.params import StructuredOutputsParams
from archserve.structured.schema_recursion import no_finite_instance

CACHE_SIZE = 256
# Whitespace allowed between JSON tokens when any is allowed: enough for indented output,
# never an endless run of newlines.
MAX_JSON_WHITESPACE = 16
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """The spec does not compile; the message says why (the client's 400)."""


def _clean(exc: Exception) -> str:
    text = str(exc).strip()
    text = _CPP_PREFIX.sub("", text)
    return text.split("\n")[0][:500]


def choice_grammar(choices: list[str] | tuple[str, ...]) -> str:
    """EBNF matching exactly one of ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 2) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._xgr_compiler = None
        self._init_lock = threading.Lock()

    # -- public -------------------------------------------------------------------------
    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The future compiled grammar of ``spec`` (started now, or found in the cache)."""
        key = spec.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers,
                                                thread_name_prefix="archserve-grammar")
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of ``spec``; GrammarError when it does not compile."""
        return self.submit(spec).result()

    def is_cached(self, spec: StructuredOutputsParams) -> bool:
        with self._lock:
            future = self._cache.get(spec.cache_key())
        return future is not None and future.done()

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    # -- compilation --------------------------------------------------------------------
    def _compiler(self):
        with self._init_lock:
            if self._xgr_compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError as exc:
                    raise GrammarError(
                        f"structured output needs xgrammar, which is not installed here "
                        f"({exc}); scripts/install.sh installs it") from None
                # A copy: the engine thread keeps using its tokenizer meanwhile.
                tokenizer = copy.deepcopy(self._tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=self._max_workers)
            return self._xgr_compiler

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._compiler()
        kind = spec.kind
        value = getattr(spec, kind)
        try:
            if kind == "json":
                parsed = json.loads(value) if isinstance(value, str) else value
                reason = no_finite_instance(parsed)
                if reason is not None:
                    raise GrammarError(f"structured output json: {reason}")
                schema = value if isinstance(value, str) else json.dumps(value)
                if spec.disable_any_whitespace:
                    return compiler.compile_json_schema(schema, any_whitespace=False)
                return compiler.compile_json_schema(schema, any_whitespace=True,
                                                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(value))
            if kind == "grammar":
                if "::=" in value:
                    return compiler.compile_grammar(value)
                return compiler.compile_lark(value)
            tag = value if isinstance(value, str) else json.dumps(value)
            return compiler.compile_structural_tag(tag)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
            raise GrammarError(f"structured output {kind} does not compile: "
                               f"{_clean(exc)}") from None
