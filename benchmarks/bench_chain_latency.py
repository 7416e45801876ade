"""What each of a batch-1 decode layer's byte-less kernels costs in a chain of launches.

    python benchmarks/bench_chain_latency.py --out OUT/chain.json [--cases route,merge]

At batch 1 most kernels of a MoE or MLA decode layer read a few KB (the norms, the q/k
preamble, decode attention over a short context, the split merge, the routing): their time
is latency, not bytes. In the decode graph each waits (PDL) for the kernel before it, so
what one adds to a step is its time in such a chain, not its time alone. Here each case is
one kernel (or one wrapper's launches) on the real shapes of Qwen3-30B-A3B or
DeepSeek-V2-Lite at batch 1, captured ``--reps`` times back to back in a CUDA graph and
replayed: µs per launch in a chain. ``trivial`` is the floor: one program that waits, loads
one value and stores it.

To compare two versions of a kernel, run this script under each tree (PYTHONPATH) on the
same machine, alternating; the cases take their wrappers from ``archserve`` as imported. A
module's launch constant can be swept with ``--set``, e.g.
``--set archserve.kernels.attention.triton_decode:MERGE_ONE_WARP_VALUES=0``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runnable from a checkout

import torch  # noqa: E402

CONTEXT = 384            # tokens in the cache: the end of a 128 in / 256 out request
BLOCK_SIZE = 16
MAX_LEN = {"qwen3.": 1024, "v2lite.": 4224}    # each model's cases' max_model_len


def _trivial() -> Callable[[], object]:
    import triton
    import triton.language as tl

    from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start

    @triton.jit
    def _one_value(ptr, PDL: tl.constexpr):
        pdl_start(PDL)
        tl.store(ptr + 1, tl.load(ptr) + 1.0)

    buf = torch.zeros(2, device="cuda")
    pdl = pdl_enabled(buf.device)
    return lambda: _one_value[(1,)](buf, PDL=pdl, num_warps=1, **pdl_launch_options(pdl))


def _paged(planes: int, heads: int, head_size: int, max_len: int):
    blocks = -(-max_len // BLOCK_SIZE)
    cache = torch.randn(planes, blocks, BLOCK_SIZE, heads, head_size, device="cuda",
                        dtype=torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32, device="cuda")[None]
    seq_lens = torch.tensor([CONTEXT], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    return cache, table, seq_lens, starts


def gemv_cases(model: str, hidden: int, shapes: list[tuple[str, int, str]]
               ) -> dict[str, Callable[[], Callable[[], object]]]:
    """Per (name, rows, tile): the GEMV alone, the norm kernel then the GEMV, and the GEMV
    with the (folded) norm in its prologue, keeping the normalised row; each launch reads
    the next of enough weights to pass twice the L2, as a step's layers do."""
    from archserve.kernels.elementwise.triton_rms_norm import rms_norm_triton
    from archserve.kernels.linear.triton_skinny_gemm import (
        SkinnyConfig,
        rms_norm_skinny_gemm,
        skinny_gemm,
    )
    l2 = torch.cuda.get_device_properties(0).L2_cache_size

    def build(rows: int, tile: str, form: str) -> Callable[[], object]:
        config = SkinnyConfig.from_key(tile)
        copies = max(2, -(-2 * l2 // (rows * hidden * 2)))
        weights = [torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
                   for _ in range(copies)]
        x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
        norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
        turn = iter(range(1 << 30))

        def launch():
            w = weights[next(turn) % copies]
            if form == "gemv":
                return skinny_gemm(x, w, None, config)
            if form == "norm+gemv":
                return skinny_gemm(rms_norm_triton(x, norm_w, 1e-6)[0], w, None, config)
            return rms_norm_skinny_gemm(x, None, None, 1e-6, w, None, config,
                                        keep_normed=True)
        return launch

    cases = {}
    for name, rows, tile in shapes:
        for form in ("gemv", "norm+gemv", "gemv_norm"):
            cases[f"{model}.{name}.{form}"] = (
                lambda rows=rows, tile=tile, form=form: build(rows, tile, form))
    return cases


def qwen3_cases() -> dict[str, Callable[[], Callable[[], object]]]:
    """Qwen3-30B-A3B: hidden 2048, 32 q / 4 kv heads of 128, 128 experts top 8."""
    heads, kv_heads, d, hidden, max_len = 32, 4, 128, 2048, MAX_LEN["qwen3."]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def rms_norm():
        from archserve.kernels.elementwise.triton_rms_norm import rms_norm_triton
        x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        return lambda: rms_norm_triton(x, w, 1e-6, r)

    def preamble():
        from archserve.kernels.attention.triton_qk_norm_rope_cache import qk_norm_rope_cache
        qkv = torch.randn(1, (heads + 2 * kv_heads) * d, device="cuda", dtype=torch.bfloat16)
        cache, _, _, _ = _paged(2, kv_heads, d, max_len)
        cos = torch.randn(max_len, d // 2, device="cuda", dtype=torch.bfloat16)
        sin = torch.randn_like(cos)
        w = (torch.randn(d, device="cuda", dtype=torch.bfloat16),
             torch.randn(d, device="cuda", dtype=torch.bfloat16))
        pos = torch.tensor([CONTEXT - 1], device="cuda")
        slots = torch.tensor([CONTEXT - 1], device="cuda")
        return lambda: qk_norm_rope_cache(qkv, pos, cos, sin, w, 1e-6, cache, slots, heads,
                                          kv_heads)

    def decode_and_merge(tiles=None):
        from archserve.kernels.attention.triton_decode import decode_attention
        q = torch.randn(1, heads, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        cache, table, seq_lens, starts = _paged(2, kv_heads, d, max_len)
        return lambda: decode_attention(q, cache, table, seq_lens, starts, out, num_seqs=1,
                                        max_seq_len=max_len, scale=d ** -0.5,
                                        num_sms=num_sms, tiles=tiles)

    def merge():
        from archserve.kernels.attention.triton_decode import (
            choose_num_splits,
            decode_tiles,
            merge_splits,
        )
        splits = choose_num_splits(1, kv_heads, max_len, num_sms)
        part = torch.randn(1, heads, splits, d, device="cuda")
        lse = torch.randn(1, heads, splits, device="cuda")
        out = torch.empty(1, heads, d, device="cuda", dtype=torch.bfloat16)
        _, _, seq_lens, starts = _paged(1, 1, 1, 16)
        block_n = decode_tiles(d, heads // kv_heads, -(-max_len // splits))[0]
        return lambda: merge_splits(part, lse, starts, seq_lens, out, 1.0,
                                    split_block_n=block_n)

    def route(dtype=torch.bfloat16):
        from archserve.kernels.moe.triton_routing import triton_route
        logits = torch.randn(1, 128, device="cuda", dtype=dtype)
        return lambda: triton_route(logits, 8, True)

    return {"qwen3.rms_norm": rms_norm, "qwen3.preamble": preamble,
            **gemv_cases("qwen3", hidden, [("qkv", (heads + 2 * kv_heads) * d, "n4_k512_w4"),
                                           ("router", 128, "n2_k1024_w4")]),
            "qwen3.decode+merge": decode_and_merge,
            "qwen3.decode+merge@n32": lambda: decode_and_merge((32, 4, 2)),
            "qwen3.decode+merge@n16": lambda: decode_and_merge((16, 4, 2)),
            "qwen3.merge": merge,
            "qwen3.route": route,
            "qwen3.route@fp32": lambda: route(torch.float32)}


def v2_lite_cases() -> dict[str, Callable[[], Callable[[], object]]]:
    """DeepSeek-V2-Lite: 16 heads, nope 128, rope 64, latent 512, v 128; 64 experts top 6
    (softmax, not renormalised) and 2 shared experts."""
    heads, nope, rope, rank, v, max_len = 16, 128, 64, 512, 128, MAX_LEN["v2lite."]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def inputs():
        from archserve.kernels.mla.triton_mla_decode_inputs import mla_decode_inputs
        q = torch.randn(1, heads * (nope + rope), **bf16)
        kv_a = torch.randn(1, rank + rope, **bf16)
        cos = torch.randn(max_len, rope // 2, **bf16)
        sin = torch.randn_like(cos)
        norm_w = torch.randn(rank, **bf16)
        w_uk = torch.randn(heads, nope, rank, **bf16)
        cache, _, _, _ = _paged(1, 1, rank + rope, max_len)
        pos = torch.tensor([CONTEXT - 1], device="cuda")
        slots = torch.tensor([CONTEXT - 1], device="cuda")
        return lambda: mla_decode_inputs(q, kv_a, pos, cos, sin, norm_w, 1e-6, w_uk, cache,
                                         slots, True)

    def decode_to_heads(tiles=None):
        from archserve.kernels.mla.triton_mla_decode import mla_decode
        q = torch.randn(1, heads, rank + rope, **bf16)
        out = torch.empty(1, heads, rank, **bf16)
        w_uv = torch.randn(heads, v, rank, **bf16)
        cache, table, seq_lens, starts = _paged(1, 1, rank + rope, max_len)
        return lambda: mla_decode(q, cache, table, seq_lens, starts, out, num_seqs=1,
                                  max_seq_len=max_len, scale=0.1, num_sms=num_sms, w_uv=w_uv,
                                  tiles=tiles)

    def decode_alone(tiles=None):
        # The decode kernel's launch only: the wrapper's merge of the splits left out.
        from archserve.kernels.mla import triton_mla_decode
        run = decode_to_heads(tiles)

        def launch():
            merge = triton_mla_decode.latent_output_to_heads_triton
            triton_mla_decode.latent_output_to_heads_triton = lambda *a, **k: None
            try:
                run()
            finally:
                triton_mla_decode.latent_output_to_heads_triton = merge
        return launch

    def to_heads():
        # The merge of the splits with W_UV alone, over the splits the context fills.
        from archserve.kernels.mla.triton_mla_decode import mla_decode_tiles, mla_num_splits
        from archserve.kernels.mla.triton_mla_output import latent_output_to_heads_triton
        splits = mla_num_splits(1, heads, max_len, num_sms, 16)
        block_n = mla_decode_tiles(heads, splits, max_len)[1]
        part = torch.randn(1, heads, splits, rank, device="cuda")
        lse = torch.randn(1, heads, splits, device="cuda")
        w_uv = torch.randn(heads, v, rank, **bf16)
        _, _, seq_lens, starts = _paged(1, 1, 1, 16)
        return lambda: latent_output_to_heads_triton(part, lse, starts, 1, 1, w_uv,
                                                     seq_lens=seq_lens, split_block_n=block_n)

    def route():
        from archserve.kernels.moe.triton_routing import triton_route
        logits = torch.randn(1, 64, device="cuda")
        return lambda: triton_route(logits, 6, False, shared_experts=2)

    return {"v2lite.mla_inputs": inputs,
            **gemv_cases("v2lite", 2048, [("kv_a", rank + rope, "n2_k1024_w4"),
                                          ("q", heads * (nope + rope), "n2_k1024_w4")]),
            "v2lite.mla_decode+to_heads": decode_to_heads,
            "v2lite.mla_decode+to_heads@n64": lambda: decode_to_heads((16, 64, 4, 2, False)),
            "v2lite.mla_decode": decode_alone,
            "v2lite.mla_decode@n16": lambda: decode_alone((16, 16, 4, 2, False)),
            "v2lite.mla_decode@rows": lambda: decode_alone((16, 32, 4, 2, True)),
            "v2lite.to_heads": to_heads,
            "v2lite.route": route}


def all_cases() -> dict[str, Callable[[], Callable[[], object]]]:
    return {"trivial": _trivial, **qwen3_cases(), **v2_lite_cases()}


def main(argv: list[str] | None = None) -> int:
    global CONTEXT
    from archserve.bench.module_settings import set_module_constants
    from archserve.kernels.cuda_timing import graph_median_us

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--reps", type=int, default=200, help="launches in the captured chain")
    ap.add_argument("--iters", type=int, default=50, help="timed replays (median)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=INT",
                    help="set an integer constant of a module before the cases are built")
    ap.add_argument("--context", type=int, default=CONTEXT, help="tokens in the cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    CONTEXT = args.context
    set_module_constants(args.set)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cases = all_cases()
    names = args.cases.split(",") if args.cases else list(cases)
    for prefix, max_len in MAX_LEN.items():   # the caches hold at most max_len tokens
        if CONTEXT > max_len and any(name.startswith(prefix) for name in names):
            raise SystemExit(f"--context {CONTEXT} is past the {prefix} cases' {max_len}")
    unknown = set(names) - set(cases)
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; known: {', '.join(cases)}")
    rows = []
    for name in names:
        us, how = graph_median_us(cases[name](), args.iters, warmup=3, reps=args.reps)
        rows.append({"case": name, "us_per_launch": us, "timed_as": how, "set": args.set,
                     "context": CONTEXT})
        print(f"{name:28s} {us:7.2f} µs a launch ({how})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
