"""Host time of an eager step (what every prefill and mixed step of a server costs the host).

    python benchmarks/eager_step_host.py --model benchmarks/models/qwen3-0.6b \
        --load-format dummy --dtype bfloat16 --out OUT/eager_host.json
    python benchmarks/eager_step_host.py ... --cuda-profile-first    # CUPTI attached first

Builds an engine, then runs ``ModelRunner.run_prefill_probe`` (one eager forward of a
prompt, nothing written to the cache; under ``--compilation-config '{"cudagraph_mode":
"FULL"}'`` the replay of the bucket's graph where one fits) at each --lengths, plus one
mixed batch (--mixed: 32 one-token rows and a 256-token chunk), and reports per step:

- ``host_ms``: the time until the call returns to Python, i.e. until every kernel of the
  step is launched;
- ``wall_ms``: the time until the device has finished them.

When ``host_ms`` is close to ``wall_ms`` at every length, the step is bound by launching
its kernels, not by running them. ``--cuda-profile-first`` runs one step under
torch.profiler with CUDA activity before timing, as the start-up self-check did before
``self_check_profile`` (engine/self_check.py): kineto leaves CUPTI attached afterwards, and
the two runs compare the launch cost with and without it. ``--cprofile N`` adds the top N
Python functions of the 128-token step by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(runner, lengths, repeats: int, sync) -> tuple[float, float]:
    runner.run_prefill_probe(lengths)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        runner.run_prefill_probe(lengths)
    launched = time.perf_counter()
    sync()
    done = time.perf_counter()
    return (launched - t0) / repeats * 1e3, (done - t0) / repeats * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--lengths", default="1,16,128,512,2048")
    ap.add_argument("--mixed", default="32x1+256",
                    help="one batch of ROWSx1+CHUNK: decode-like rows and one prompt chunk")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cuda-profile-first", action="store_true")
    ap.add_argument("--compilation-config", default=None,
                    help='e.g. \'{"cudagraph_mode": "FULL"}\': steps that fit a captured '
                         'bucket then replay its graph (the host time of a replay)')
    ap.add_argument("--cprofile", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    from archserve.kernels import jit_watch
    from archserve.loader.loader import resolve_model_path
    from archserve.loader.tokenizer import dummy_without_tokenizer

    path = resolve_model_path(args.model)
    engine = LLMEngine(EngineConfig(
        model=path, load_format=args.load_format, dtype=args.dtype,
        max_model_len=args.max_model_len, max_num_seqs=64,
        compilation_config=args.compilation_config,
        skip_tokenizer_init=dummy_without_tokenizer(path, args.load_format)))
    runner = engine.runner
    cuda = runner.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(runner.device)

    if args.cuda_profile_first and cuda:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]):
            runner.run_prefill_probe(1)
            sync()
    rows = []
    rows_spec, chunk = args.mixed.split("+")
    mixed = [1] * int(rows_spec.split("x")[0]) + [int(chunk)]
    cases = [([int(n)], n) for n in args.lengths.split(",")] + [(mixed, args.mixed)]
    for lengths, label in cases:
        if max(lengths) > args.max_model_len:
            continue
        host_ms, wall_ms = _timed(runner, lengths, args.repeats, sync)
        rows.append({"step": label, "tokens": sum(lengths), "host_ms": host_ms,
                     "wall_ms": wall_ms})
        print(f"{label:>10} tokens {sum(lengths):5d}: host {host_ms:8.2f} ms   "
              f"wall {wall_ms:8.2f} ms", flush=True)
    result = {"model": args.model, "device": str(runner.device),
              "cuda_profile_first": args.cuda_profile_first,
              "compilation_config": args.compilation_config,
              "mixed_graph_buckets": runner.mixed_graphs.set.sizes if runner.mixed_graphs else [],
              # Triton variants the steps above compiled (their first run waited for it).
              "compiled_while_running": jit_watch.compiled_after_startup(),
              "steps": rows}
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.repeats):
            runner.run_prefill_probe(128)
        prof.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        result["cprofile_128"] = text.getvalue()
        print(text.getvalue(), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
