"""What structured output costs the engine: the token mask per decode step at several
batch sizes, and the time to first token with a cold and a cached grammar.

    # GPU (scripts/gpu_check.sh OUT structured): a real shape with dummy weights and the
    # embedded model's tokenizer, saved by --save-tokenizer where the model is installed
    python benchmarks/structured_perf.py --save-tokenizer .tok/smollm2          # here
    python benchmarks/structured_perf.py --model benchmarks/models/qwen3-0.6b \
        --load-format dummy --dtype bfloat16 --tokenizer .tok/smollm2 \
        --batch-sizes 1,32,256 --out OUT/structured_perf.json
    # CPU smoke run (proves it runs; its numbers are a 2-core CPU's)
    python benchmarks/structured_perf.py --small

Per batch size B:
- ``fill_ms``: host time to fill B rows' bitmask (xgrammar; batch fill from 8 rows);
- ``apply_ms``: device time to copy the bitmask over and mask B rows of logits [B, V];
- ``step_free_ms`` / ``step_json_ms``: median decode step of B free sequences, and of B
  sequences under a JSON schema (steps while all B run), through ``LLMEngine.step`` with
  the engine's scheduling (async on CUDA, so host work overlaps the device);
- ``overhead_ms``: their difference, what masking adds to a step.
TTFT: a request with a schema never seen (compiled while it waits), the same schema again
(cache hit), and a free request; ``first_grammar`` is the engine's first constrained
request, which also builds xgrammar's tokenizer table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from archserve.engine.config import EngineConfig  # noqa: E402
from archserve.engine.llm_engine import LLMEngine  # noqa: E402
from archserve.engine.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from archserve.structured import StructuredOutputsParams  # noqa: E402

# An open-ended answer (a list of records), so sequences stay in the grammar for the run.
SCHEMA = {"type": "array", "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "qty", "tags"],
    "properties": {"name": {"type": "string"}, "qty": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _unpack(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(bool)


def mask_micro(engine: LLMEngine, batch: int, steps: int, rng: np.random.Generator) -> dict:
    """Host fill and device apply of B rows, the matchers advancing on random allowed
    tokens (what the engine's sampler does, without the model)."""
    from archserve.engine.batch import host_to_device
    from archserve.structured.bitmask import GrammarState, apply_bitmask, fill_bitmask
    compiled = engine.grammars.submit(StructuredOutputsParams(json=SCHEMA))
    compiled.result()
    vocab = engine.model_config.vocab_size
    stops = sorted(engine.eos_token_ids)
    device = engine.runner.device
    states = [GrammarState(compiled) for _ in range(batch)]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    logits = torch.randn(batch, vocab, device=device)
    rows = torch.arange(batch, device=device)
    fill, apply = [], []
    for step in range(steps + 2):
        for s, out in zip(states, outputs, strict=True):
            s.catch_up(out)
        t = time.perf_counter()
        mask = fill_bitmask(states, vocab, stops)
        fill_s = time.perf_counter() - t
        _sync(device)
        t = time.perf_counter()
        apply_bitmask(logits, host_to_device(mask.numpy(), device), rows)
        _sync(device)
        apply_s = time.perf_counter() - t
        if step >= 2:   # the first fills build caches
            fill.append(fill_s)
            apply.append(apply_s)
        allowed = _unpack(mask, vocab)
        for i, out in enumerate(outputs):
            choices = np.flatnonzero(allowed[i])
            out.append(int(rng.choice(choices)))
    return {"fill_ms": statistics.median(fill) * 1e3, "apply_ms": statistics.median(apply) * 1e3}


def decode_steps(engine: LLMEngine, batch: int, steps: int, input_len: int,
                 spec: StructuredOutputsParams | None, rng: np.random.Generator) -> float:
    """Median wall time of the steps while all ``batch`` sequences decode."""
    vocab = min(len(engine.tokenizer), engine.model_config.vocab_size)
    params = SamplingParams(temperature=1.0, max_tokens=steps + 8, ignore_eos=spec is None,
                            structured_outputs=spec, output_kind=RequestOutputKind.FINAL_ONLY)
    ids = []
    for _ in range(batch):
        prompt = rng.integers(100, vocab, input_len).tolist()
        ids.append(engine.add_request(None, prompt, params))
    times = []
    while engine.has_unfinished_requests():
        running = engine.scheduler.num_running
        decoding = running == batch and not engine.scheduler.waiting and all(
            s.num_uncomputed_tokens <= 1 for s in engine.scheduler.running)
        t = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t)
    times = times[2:] or times   # the first decode steps may capture or warm up
    return statistics.median(times) * 1e3 if times else float("nan")


def ttft(engine: LLMEngine, spec: StructuredOutputsParams | None, input_len: int,
         rng: np.random.Generator) -> float:
    """Seconds from add_request (its compile included) to the first token."""
    vocab = min(len(engine.tokenizer), engine.model_config.vocab_size)
    prompt = rng.integers(100, vocab, input_len).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=2, structured_outputs=spec,
                            output_kind=RequestOutputKind.DELTA)
    t = time.perf_counter()
    rid = engine.add_request(None, prompt, params)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.request_id == rid and out.outputs[0].token_ids:
                first = time.perf_counter() - t
    return first


def fresh_schema() -> StructuredOutputsParams:
    """A schema no cache has seen (a new property name), as heavy as SCHEMA."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["items"]["properties"][f"k{uuid.uuid4().hex[:8]}"] = {"type": "number"}
    return StructuredOutputsParams(json=schema)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder or GGUF (default: "
                    "the model's)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,32,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--ttft-repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true",
                    help="CPU smoke run: embedded model, batches 1 and 4, a few steps")
    ap.add_argument("--save-tokenizer", default=None, metavar="DIR",
                    help="save the embedded model's tokenizer to DIR (to carry) and exit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    if args.save_tokenizer:
        from archserve.loader.tokenizer import load_tokenizer
        load_tokenizer(args.tokenizer).save_pretrained(args.save_tokenizer)
        print(f"saved the tokenizer to {args.save_tokenizer}")
        return 0
    if args.small:
        args.batch_sizes, args.steps, args.input_len, args.ttft_repeats = "1,4", 4, 8, 1
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = LLMEngine(EngineConfig(
        model=args.model, tokenizer=args.tokenizer, load_format=args.load_format,
        dtype=args.dtype, max_model_len=args.input_len + args.steps + 64,
        max_num_seqs=max(batches)))
    print(f"device {engine.runner.device}, vocab {engine.model_config.vocab_size}, "
          f"async scheduling {engine.config.async_scheduling}", flush=True)
    result: dict = {"device": str(engine.runner.device), "model": args.model,
                    "vocab_size": engine.model_config.vocab_size,
                    "async_scheduling": engine.config.async_scheduling, "batches": [],
                    "command": " ".join(sys.argv)}
    first = ttft(engine, fresh_schema(), args.input_len, rng)
    cold = [ttft(engine, fresh_schema(), args.input_len, rng) for _ in range(args.ttft_repeats)]
    spec = fresh_schema()
    ttft(engine, spec, args.input_len, rng)
    cached = [ttft(engine, spec, args.input_len, rng) for _ in range(args.ttft_repeats)]
    free = [ttft(engine, None, args.input_len, rng) for _ in range(args.ttft_repeats)]
    result["ttft_ms"] = {"first_grammar": first * 1e3,
                         "cold": statistics.median(cold) * 1e3,
                         "cached": statistics.median(cached) * 1e3,
                         "free": statistics.median(free) * 1e3}
    print("TTFT ms: " + ", ".join(f"{k} {v:.1f}" for k, v in result["ttft_ms"].items()),
          flush=True)
    json_spec = StructuredOutputsParams(json=SCHEMA)
    for batch in batches:
        row = {"batch": batch, **mask_micro(engine, batch, args.steps, rng)}
        row["step_free_ms"] = decode_steps(engine, batch, args.steps, args.input_len, None, rng)
        row["step_json_ms"] = decode_steps(engine, batch, args.steps, args.input_len,
                                           json_spec, rng)
        row["overhead_ms"] = row["step_json_ms"] - row["step_free_ms"]
        result["batches"].append(row)
        print(f"batch {batch:4d}: fill {row['fill_ms']:.3f} ms, apply {row['apply_ms']:.3f} ms;"
              f" step free {row['step_free_ms']:.2f} ms, json {row['step_json_ms']:.2f} ms "
              f"(+{row['overhead_ms']:.2f})", flush=True)
        gc.collect()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
