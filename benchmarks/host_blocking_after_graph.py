"""How long does the host block in an eager op launched while a long CUDA graph runs?

    python benchmarks/host_blocking_after_graph.py [--graph-ms 12] [--fill 0.9]

The engine replays a decode graph and then launches the LM head and the sampler eagerly.
At batch 256 the H200 profile showed the host inside ``aten::mm`` (the LM head) for 4-7 ms
per step, while the same call at batch 1 took 0.07 ms. This script separates the suspects
(allocating the output, the cuBLAS call itself, its size) by timing each probe's host time
right after a graph replay, with the device memory free and again nearly full (as it is
once the KV cache is allocated).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch


def long_graph(target_ms: float) -> torch.cuda.CUDAGraph:
    """A graph of small matmuls that runs about ``target_ms`` on the device."""
    a = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        torch.mm(a, w)
    end.record()
    end.synchronize()
    reps = max(1, int(target_ms / (start.elapsed_time(end) / 100)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            torch.mm(a, w)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def host_ms(graph: torch.cuda.CUDAGraph, probe: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        graph.replay()
        t0 = time.perf_counter()
        probe()
        times.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
    return statistics.median(times)


def probes(vocab: int, hidden: int) -> dict[str, Callable[[], object]]:
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    x256 = torch.randn(256, hidden, device="cuda", dtype=torch.bfloat16)
    x1 = x256[:1].contiguous()
    out = torch.empty(256, vocab, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16)
    return {
        "mm 256 x vocab (new output)": lambda: torch.mm(x256, weight.t()),
        "mm 256 x vocab (out=)": lambda: torch.mm(x256, weight.t(), out=out),
        "mm 1 x vocab": lambda: torch.mm(x1, weight.t()),
        "mm 256 x hidden x hidden": lambda: torch.mm(x256, small),
        "empty 256 x vocab bf16": lambda: torch.empty(256, vocab, device="cuda",
                                                      dtype=torch.bfloat16),
        "out.float() (alloc + copy)": lambda: out.float(),
        "out.fill_(0)": lambda: out.fill_(0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph-ms", type=float, default=12.0)
    parser.add_argument("--fill", type=float, default=0.9,
                        help="then hold this fraction of free memory, as a KV cache would")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_blocking_after_graph: needs a CUDA GPU", file=sys.stderr)
        return 2
    graph = long_graph(args.graph_ms)
    cases = probes(args.vocab, args.hidden)
    for case in cases.values():  # warm: cuBLAS heuristics, allocator blocks
        case()
    torch.cuda.synchronize()
    rows = {name: [host_ms(graph, fn, args.iters)] for name, fn in cases.items()}
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(int(free * args.fill), dtype=torch.uint8, device="cuda")
    for name, fn in cases.items():
        rows[name].append(host_ms(graph, fn, args.iters))
    del hog
    print(f"graph of about {args.graph_ms} ms; host ms per probe right after its replay")
    print(f"{'probe':34s} {'memory free':>12s} {f'{args.fill:.0%} held':>12s}")
    for name, (loose, tight) in rows.items():
        print(f"{name:34s} {loose:12.3f} {tight:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
