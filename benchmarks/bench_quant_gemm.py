"""Quantized GEMMs against cuBLAS bf16 and torch._scaled_mm, at decode and prefill sizes.

For each Llama-3-8B weight shape and each M (rows of activations), times every quantized
kernel this build runs (the weight-only Triton kernel on int4 group 128, int4 group 32
with offsets (GGUF Q4_K's repacked form), int8 per channel and fp8 per channel; the W8A8
kernels: torch._scaled_mm fp8, Triton block fp8, Triton int8) beside dense cuBLAS bf16,
each timed as CUDA-graph replays cycling through enough copies of the weight that L2
cannot hold them (as a decode step's layers do). Each kernel is called through the
layer routine the engine installs (its `prepare`, then calls), so activation
quantization is inside the time. Prints µs, GB/s (weight bytes / time), TFLOP/s and the
bytes' floor: the weight's bytes over the measured copy bandwidth (engine/ceilings.py, as
the engine rows' floor), and the time over it.

Where the routine has a start-up tuner (rows up to --tune-rows), a second row "[tuned]"
runs the start-up tuner on the same weights first (quantized_tuning.tune_quantized: every
candidate timed against the default, kept only where it wins by its margin and agrees)
and times the routine with what it installed; the row names the config it chose
("default": none won). For the W8A8 routines (FP8, INT8) the candidates include the GEMV
with the activations quantized in its registers; its first candidate is also timed on its
own ("GEMV, x quantized in it"), whether it wins or not.

    python3 benchmarks/bench_quant_gemm.py [--m 1,16,256,4096] [--shapes qkv,o,gate_up,down]
        [--iters 20] [--tune-rows 16] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from archserve.kernels.cuda_timing import graph_median_us  # noqa: E402
from archserve.kernels.linear.quantized_weights import (  # noqa: E402
    ACT_DYNAMIC_GROUP,
    ACT_DYNAMIC_TOKEN,
    ACT_NONE,
    FP8_DTYPE,
    Fp8Weight,
    Int8Weight,
    IntGroupWeight,
    pack_int_rows,
)
from archserve.kernels.linear.triton_weight_only import (  # noqa: E402
    w8a8_gemv_candidates,
    weight_only_gemm,
)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
L2_BYTES = 256 << 20        # cycle through at least this much weight


def int_group(n: int, k: int, bits: int, group: int, offsets: bool) -> IntGroupWeight:
    q = torch.randint(0, 2 ** bits, (k, n), device="cuda", dtype=torch.int32)
    scales = torch.rand(k // group, n, device="cuda") * 1e-3
    offs = -scales * torch.randint(0, 2 ** bits, scales.shape, device="cuda") if offsets else None
    return IntGroupWeight(pack_int_rows(q, bits), scales, offs, bits, group, k, n)


def fp8(n: int, k: int, activation: str, block: bool) -> Fp8Weight:
    w = torch.randn(n, k, device="cuda").clamp(-4, 4).to(FP8_DTYPE)
    if block:
        scale = torch.rand((n + 127) // 128, (k + 127) // 128, device="cuda") * 1e-3
        return Fp8Weight(w, scale, activation, block=(128, 128))
    return Fp8Weight(w, torch.rand(n, device="cuda") * 1e-3, activation)


def int8(n: int, k: int) -> Int8Weight:
    w = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    return Int8Weight(w, torch.rand(n, device="cuda") * 1e-3, ACT_DYNAMIC_TOKEN)


def weight_bytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in vars(w).values()
               if isinstance(t, torch.Tensor))


# name -> (backend impl class path, weight factory)
KERNELS = {
    "w4a16 g128 (TRITON_WEIGHT_ONLY)":
        ("triton_weight_only:WeightOnlyLinear", lambda n, k: int_group(n, k, 4, 128, False)),
    "int4 g32+offset = Q4_K form (TRITON_WEIGHT_ONLY)":
        ("triton_weight_only:WeightOnlyLinear", lambda n, k: int_group(n, k, 4, 32, True)),
    "w8a16 channel (TRITON_WEIGHT_ONLY)":
        ("triton_weight_only:WeightOnlyLinear", lambda n, k: int_group(n, k, 8, k, False)),
    "fp8 weight-only (TRITON_WEIGHT_ONLY)":
        ("triton_weight_only:WeightOnlyLinear", lambda n, k: fp8(n, k, ACT_NONE, False)),
    "fp8 W8A8 channel (TORCH_SCALED_MM)":
        ("fp8_gemm:ScaledMmFp8Linear", lambda n, k: fp8(n, k, ACT_DYNAMIC_TOKEN, False)),
    "fp8 W8A8 block (TRITON_BLOCK_FP8)":
        ("fp8_gemm:BlockFp8Linear", lambda n, k: fp8(n, k, ACT_DYNAMIC_GROUP, True)),
    "int8 W8A8 (TRITON_INT8)": ("int8_gemm:Int8Linear", lambda n, k: int8(n, k)),
}


def impl(path: str):
    import importlib
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(f"archserve.kernels.linear.{module}"), cls)()


def time_cycled(call, weights: list, x: torch.Tensor, iters: int) -> float:
    state = {"i": 0}

    def run():
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return call(x, w)

    # One graph replays every copy once per `reps` calls, so L2 never holds the weight.
    us, _mode = graph_median_us(run, iters, reps=len(weights))
    return us


def tuned_routine(routine, weights: list, m: int) -> str | None:
    """Run the start-up tuner of ``routine`` on ``weights`` at ``m`` rows (no cache);
    the chosen config's description, or None where the routine has nothing to tune."""
    candidates = getattr(routine, "candidates", None)
    if candidates is None or not candidates(m, weights[0]):
        return None
    from archserve.kernels.linear.quantized_tuning import DEFAULT, tune_quantized
    report = tune_quantized([(routine, type(routine).__name__, weights)], [m],
                            torch.bfloat16, None)
    timing = next(iter(report.timings.values()))
    if timing.chosen == DEFAULT:
        return f"default ({timing.note[:80] or 'no candidate won'})"
    chosen = routine.config_from(json.loads(timing.chosen))
    return getattr(chosen, "key", lambda: str(chosen))()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default="1,16,256,4096")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kernels", default="", help="substring filter on kernel names")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tune-rows", type=int, default=16,
                        help="run the start-up tuner at up to this many rows ([tuned] rows)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    from archserve.engine.ceilings import load_or_measure
    ceilings = load_or_measure(torch.device("cuda"))
    print(f"floor: weight bytes / {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s (measured copy "
          f"bandwidth, {ceilings.describe()})")
    rows = []
    header = (f"{'shape':8s} {'M':>5s} {'kernel':56s} {'us':>9s} {'GB/s':>7s} {'TFLOP/s':>8s} "
              f"{'floor':>7s} {'x floor':>7s}  config")
    print(header)
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flops = 2.0 * m * n * k
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.01
            copies = max(1, L2_BYTES // weight_bytes(dense))
            dense_list = [dense.clone() for _ in range(copies)]
            entries = [("bf16 dense (cuBLAS)", lambda a, w: F.linear(a, w), dense_list)]
            for name, (path, make) in KERNELS.items():
                if args.kernels and args.kernels not in name:
                    continue
                routine = impl(path)
                prepare = getattr(routine, "prepare", lambda w, dtype: w)
                one = prepare(make(n, k), torch.bfloat16)
                copies = max(1, L2_BYTES // weight_bytes(one))
                prepared = [one] + [prepare(make(n, k), torch.bfloat16)
                                    for _ in range(min(copies, 64) - 1)]
                entries.append((name, lambda a, w, r=routine: r(a, w), prepared))
                if m <= args.tune_rows and getattr(routine, "candidates", None) is not None:
                    entries.append((f"{name} [tuned]", routine, prepared))
                gemvs = w8a8_gemv_candidates(m, one) if isinstance(one, (Fp8Weight, Int8Weight)) and \
                    one.activation != ACT_NONE else []
                if gemvs:       # the W8A8 GEMV's first candidate, whether it wins or not
                    entries.append((f"{name.split(' (')[0]}: GEMV, x quantized in it",
                                    lambda a, w, c=gemvs[0]: weight_only_gemm(a, w, None, c,
                                                                              w8a8=True),
                                    prepared))
            for name, call, weights in entries:
                config = ""
                try:
                    if name.endswith("[tuned]"):
                        config = tuned_routine(call, weights, m)
                        if config is None:
                            continue
                        call = lambda a, w, r=call: r(a, w)  # noqa: E731 - the tuned routine
                    us = time_cycled(call, weights, x, args.iters)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"{shape:8s} {m:5d} {name:56s} failed: {type(exc).__name__}: "
                          f"{str(exc)[:120]}")
                    continue
                nbytes = weight_bytes(weights[0])
                floor_us = nbytes / ceilings.copy_bytes_per_s * 1e6
                row = dict(shape=shape, m=m, kernel=name, us=us, gb_s=nbytes / us / 1e3,
                           tflops=flops / us / 1e6, floor_us=floor_us,
                           over_floor=us / floor_us, config=config)
                rows.append(row)
                print(f"{shape:8s} {m:5d} {name:56s} {us:9.1f} {row['gb_s']:7.0f} "
                      f"{row['tflops']:8.1f} {floor_us:7.1f} {row['over_floor']:7.2f}  {config}",
                      flush=True)
            del entries
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
