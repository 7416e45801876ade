"""What a CPU engine's compiled decode steps cost at start-up, against what they save.

Each case is a fresh process on the embedded model (or --model): eager (-O 0), the default
level 3 with an empty inductor cache (a model's first start: TORCHINDUCTOR_CACHE_DIR a new
directory) and level 3 again over that cache (every later start). Each prints the start-up
(process start to a ready engine, and the compile within it), the time to first token of
one greedy request and its decode rate; then the wall time of ``archserve generate`` itself
(64 tokens, its default) in each state. The load average is printed beside each case:
other processes on the machine slow every number.

    python3 benchmarks/cpu_compile_startup.py [--model PATH] [--output-len 128] [--no-cli]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPT = "The capital of France is"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def child(model: str | None, level: str, output_len: int) -> None:
    """One start and one request, in this process; prints a JSON line."""
    start = time.perf_counter()
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    from archserve.engine.sampling_params import SamplingParams
    from archserve.engine.streaming import stream_text
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=8, compilation_config=level))
    ready = time.perf_counter()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    first, tokens = None, 0
    for _, output in stream_text(engine, PROMPT, params):
        first = first or time.perf_counter()
        tokens = len(output.outputs[0].token_ids)
    end = time.perf_counter()
    decision = next(d for d in engine.report.decisions if d.what == "decode steps")
    print(json.dumps({"start_s": round(ready - start, 2),
                      "compile_s": round(engine.report.timings.get("compile_s", 0.0), 2),
                      "ttft_ms": round(1e3 * (first - ready), 1),
                      "decode_tok_s": round((tokens - 1) / (end - first), 1),
                      "decode_steps": decision.chosen}))


def run_case(args: argparse.Namespace, level: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    command = [sys.executable, __file__, "--child", "--level", level,
               "--output-len", str(args.output_len)] + (["--model", args.model] if args.model
                                                        else [])
    before = load()
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "load": f"{before} -> {load()}"}


def run_cli(args: argparse.Namespace, level: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    command = [sys.executable, "-m", "archserve.cli.main", "generate", PROMPT, "-O", level]
    command += ["--model", args.model] if args.model else []
    before, start = load(), time.perf_counter()
    subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return {"generate_wall_s": round(time.perf_counter() - start, 2),
            "load": f"{before} -> {load()}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--no-cli", action="store_true", help="skip `archserve generate`")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--level", default="3", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.level, args.output_len)
        return
    with tempfile.TemporaryDirectory(prefix="inductor-") as cold, \
            tempfile.TemporaryDirectory(prefix="inductor-") as cli_cache:
        cases = [("eager (-O 0)", "0", cold), ("-O 3, empty cache (first start)", "3", cold),
                 ("-O 3, cache filled (later starts)", "3", cold)]
        for name, level, cache in cases:
            print(f"{name}: {json.dumps(run_case(args, level, cache))}", flush=True)
        if not args.no_cli:
            for name, level in (("eager (-O 0)", "0"), ("-O 3, empty cache", "3"),
                                ("-O 3, cache filled", "3")):
                print(f"archserve generate, {name}: "
                      f"{json.dumps(run_cli(args, level, cli_cache))}", flush=True)


if __name__ == "__main__":
    main()
