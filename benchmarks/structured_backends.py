"""xgrammar against llguidance on this machine: what archserve's structured output pays.

    python benchmarks/structured_backends.py [--tokenizer PATH] [--rows 1,32] [--json OUT]

For each library, with the embedded model's tokenizer (or ``--tokenizer``):
- ``init_s``: the tokenizer table (once per engine);
- ``compile_ms``: a cold compile of each schema (median over the schemas);
- ``mask_us``: the host time to fill one row's next-token bitmask and accept the token,
  per token, while following a valid answer token by token; with ``rows`` sequences
  each step (the batch fill where the library has one).

The answers are fixed JSON documents valid against their schemas, so both libraries
walk the same token path. Decides the library; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
      "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36}),
    ({"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
        "price": {"type": "number"}, "in_stock": {"type": "boolean"},
        "kind": {"enum": ["book", "pen", "lamp"]},
        "dims": {"type": "object", "properties": {"w": {"type": "number"},
                                                  "h": {"type": "number"}},
                 "required": ["w", "h"]}},
      "required": ["id", "tags", "price", "in_stock", "kind", "dims"]},
     {"id": 7, "tags": ["red", "small", "sale"], "price": 12.5, "in_stock": True,
      "kind": "lamp", "dims": {"w": 10.25, "h": 30}}),
    ({"type": "array", "items": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "temp": {"type": "number", "minimum": -90, "maximum": 60}},
        "required": ["city", "temp"]}, "minItems": 1, "maxItems": 5},
     [{"city": "Oslo", "temp": -3.5}, {"city": "Lima", "temp": 19}]),
]


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.vocab_size = vocab_size
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                    separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows):
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask):
        if len(matchers) >= 8:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

    @staticmethod
    def accept(m, token):
        assert m.accept_token(token), token


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                eos_token=stop_ids[0])
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ",",
                                        "key_separator": ":"})
        m = self.llg.LLMatcher(self.tok, grammar)   # compiles lazily: the first mask pays
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar)

    def bitmask(self, rows):
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask):
        if len(matchers) >= 8:
            self.llg.torch.fill_next_token_bitmask_par(
                self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        else:
            for i, m in enumerate(matchers):
                self.llg.torch.fill_next_token_bitmask(m, bitmask, i)

    @staticmethod
    def accept(m, token):
        assert m.consume_token(token), (token, m.get_error())


def measure(lib, tokenizer, rows_list: list[int]) -> dict:
    out = {"compile_ms": [], "first_mask_ms": [], "mask_us": {}}
    for schema, _answer in SCHEMAS:
        t = time.perf_counter()
        compiled = lib.compile(schema)
        out["compile_ms"].append((time.perf_counter() - t) * 1e3)
        m = lib.matcher(compiled)
        bm = lib.bitmask(1)
        t = time.perf_counter()
        lib.fill([m], bm)
        out["first_mask_ms"].append((time.perf_counter() - t) * 1e3)
    for rows in rows_list:
        per_token = []
        for schema, answer in SCHEMAS:
            compiled = lib.compile(schema)
            tokens = tokenizer.encode(json.dumps(answer, separators=(",", ":")),
                                      add_special_tokens=False)
            matchers = [lib.matcher(compiled) for _ in range(rows)]
            bm = lib.bitmask(rows)
            lib.fill(matchers, bm)   # warm
            matchers = [lib.matcher(compiled) for _ in range(rows)]
            t = time.perf_counter()
            for token in tokens:
                lib.fill(matchers, bm)
                for m in matchers:
                    lib.accept(m, token)
            per_token.append((time.perf_counter() - t) / len(tokens) * 1e6)
        out["mask_us"][rows] = statistics.median(per_token)
    out["compile_ms"] = statistics.median(out["compile_ms"])
    out["first_mask_ms"] = statistics.median(out["first_mask_ms"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer folder or GGUF file "
                    "(default: the embedded model's)")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from archserve.loader.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(args.tokenizer)
    vocab = len(tokenizer)
    stop = [tokenizer.eos_token_id]
    rows = [int(x) for x in args.rows.split(",")]
    results = {}
    for cls in (XGrammar, LLGuidance):
        t = time.perf_counter()
        lib = cls(tokenizer, vocab, stop)
        init_s = time.perf_counter() - t
        r = measure(lib, tokenizer, rows)
        r["init_s"] = init_s
        results[cls.name] = r
        mask = "  ".join(f"rows {k}: {v:8.1f} us/token" for k, v in r["mask_us"].items())
        print(f"{cls.name:11s} init {init_s:6.2f} s  compile {r['compile_ms']:7.2f} ms  "
              f"first mask {r['first_mask_ms']:7.2f} ms  {mask}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
