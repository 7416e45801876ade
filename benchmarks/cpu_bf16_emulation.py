"""Whether bfloat16 pays on a CPU without native bfloat16: one decode step's dense linears
(the embedded SmolLM2-135M's shapes, the LM head included, at 1 and 16 rows) in float32 and in
bfloat16, with oneDNN's instruction set capped below AVX-512 BF16 to stand for a CPU
without it.

dtype "auto" on a CPU is bfloat16 only where AVX-512 BF16 or AMX multiply it
(routing/dtypes.py's ``cpu_auto_dtype``): elsewhere oneDNN converts every bfloat16 operand
to float32 in software, and the step reads half the bytes but computes more. oneDNN reads
``ONEDNN_MAX_CPU_ISA`` once, at its first call, so each setting runs in its own process;
the settings take turns over ``--rounds`` and each keeps its best step.

    python3 benchmarks/cpu_bf16_emulation.py [--rounds 3] [--threads 2] [--rows 1,16]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# (out, in) of a SmolLM2-135M layer's fused qkv, o, gate-up and down projections.
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30
LM_HEAD = (49152, 576)
# name -> (dtype, ONEDNN_MAX_CPU_ISA; "" leaves oneDNN the CPU's own)
SETTINGS = {
    "float32": ("float32", ""),
    "bfloat16, native ISA": ("bfloat16", ""),
    "bfloat16, oneDNN capped at AVX-512 (no BF16)": ("bfloat16", "AVX512_CORE"),
    "bfloat16, oneDNN capped at AVX2": ("bfloat16", "AVX2"),
}


def time_step(dtype_name: str, threads: int, reps: int, rows: int) -> float:
    """Best of ``reps`` steps in ms (runs in the child process)."""
    import time

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=dtype) for _ in range(LAYERS) for n, k in LAYER]
    weights.append(torch.randn(*LM_HEAD, dtype=dtype))
    inputs = {k: torch.randn(rows, k, dtype=dtype) for _n, k in LAYER}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps + 1):            # the first step warms oneDNN's kernels up
            start = time.perf_counter()
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rows", default="1,16", help="batch rows, comma-separated")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(time_step(args.child, args.threads, args.reps, int(args.rows)))
        return
    rows = [int(r) for r in args.rows.split(",")]
    best = {(name, r): float("inf") for name in SETTINGS for r in rows}
    for _ in range(args.rounds):
        for (name, r) in best:
            dtype, isa = SETTINGS[name]
            env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
            if isa:
                env["ONEDNN_MAX_CPU_ISA"] = isa
            out = subprocess.run([sys.executable, __file__, "--child", dtype, "--threads",
                                  str(args.threads), "--reps", str(args.reps), "--rows", str(r)],
                                 env=env, capture_output=True, text=True, check=True)
            best[name, r] = min(best[name, r], float(out.stdout.strip().splitlines()[-1]))
    load = os.getloadavg()[0]
    print(f"one decode step's linears ({LAYERS} layers + LM head), {args.threads} threads, "
          f"best of {args.rounds} rounds x {args.reps}; load average {load:.2f}")
    print(f"  {'':48s} " + " ".join(f"{f'{r} rows':>10s}" for r in rows))
    for name in SETTINGS:
        print(f"  {name:48s} " + " ".join(f"{best[name, r]:7.2f} ms" for r in rows))


if __name__ == "__main__":
    main()
