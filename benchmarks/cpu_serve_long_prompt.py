"""A long prompt arriving beside running streams, through a real `archserve serve`: the
running streams' inter-token latency and the long prompt's time to first token, for each
`--target-itl-ms` setting given (one server each, the same requests).

    python3 benchmarks/cpu_serve_long_prompt.py --itl auto,off          # embedded model, CPU

15 streams (48 prompt tokens, 160 output tokens, greedy, ignore_eos) start together; once
they decode (--delay-s), one 2048-token prompt arrives (16 output tokens). Per setting it
prints the step budget the server chose, the running streams' ITL P50/P99/max, the long
prompt's TTFT, output tok/s of the streams and the load average (others share the cores).
Writes OUT/long_prompt.json when --out is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_budget_sweep import budget_decision_line, start_server, stop_server  # noqa: E402


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


async def one_round(url: str, args) -> dict:
    import httpx

    from archserve.bench.serving import discover_model_name, send_one
    from archserve.bench.stats import summarize
    from archserve.bench.workload import random_requests

    streams = random_requests(args.streams, args.stream_input_len, args.stream_output_len,
                              args.vocab_size, seed=1)
    long_prompt = random_requests(1, args.long_input_len, args.long_output_len,
                                  args.vocab_size, seed=2)[0]
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        model = await discover_model_name(client, url)
        t0 = time.perf_counter()
        running = [asyncio.create_task(send_one(client, url, model, r, True)) for r in streams]
        await asyncio.sleep(args.delay_s)
        long_timing = await send_one(client, url, model, long_prompt, True)
        timings = await asyncio.gather(*running)
        elapsed = time.perf_counter() - t0
    failed = [t.error for t in [*timings, long_timing] if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
    itl = summarize([x * 1e3 for t in timings for x in t.itl_s])
    return {"itl_ms": {**itl, "max": max(x * 1e3 for t in timings for x in t.itl_s)},
            "long_ttft_ms": long_timing.ttft_s * 1e3,
            "stream_ttft_ms_max": max(t.ttft_s for t in timings) * 1e3,
            "stream_output_tokens_per_s": sum(t.output_tokens for t in timings) / elapsed,
            "load": load_average()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--itl", default="auto,off", help="--target-itl-ms values, one server each")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--streams", type=int, default=15)
    ap.add_argument("--stream-input-len", type=int, default=48)
    ap.add_argument("--stream-output-len", type=int, default=160)
    ap.add_argument("--long-input-len", type=int, default=2048)
    ap.add_argument("--long-output-len", type=int, default=16)
    ap.add_argument("--delay-s", type=float, default=2.0,
                    help="seconds between the streams' start and the long prompt")
    ap.add_argument("--vocab-size", type=int, default=32000,
                    help="prompt token ids are drawn below this")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--server-args", default="", help="more `archserve serve` flags")
    ap.add_argument("--server-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model is None:
        from archserve.loader.default_model import default_model_path
        args.model = str(default_model_path())
    # start_server's flags (serve_budget_sweep.py): the model's own dtype and context.
    args.load_format, args.dtype, args.tokenizer = "auto", "auto", None
    args.max_model_len = args.long_input_len + args.long_output_len + 64
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for itl in args.itl.split(","):
            log_path = os.path.join(args.out or scratch, f"long_prompt_{itl}.log")
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
            process, url = start_server(args, f"itl:{itl}", log_path)
            try:
                result = asyncio.run(one_round(url, args))
            finally:
                stop_server(process)
            result["budget"] = budget_decision_line(log_path)
            results[itl] = result
            itl_ms = result["itl_ms"]
            print(f"{itl:>6}: streams ITL p50/p99/max {itl_ms['p50']:.1f}/{itl_ms['p99']:.1f}/"
                  f"{itl_ms['max']:.0f} ms, long prompt TTFT {result['long_ttft_ms']:.0f} ms, "
                  f"streams {result['stream_output_tokens_per_s']:.1f} out tok/s, "
                  f"load {result['load']}", flush=True)
    if args.out:
        with open(os.path.join(args.out, "long_prompt.json"), "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
