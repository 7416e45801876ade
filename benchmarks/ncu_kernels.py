"""One kernel launched a few times on its own, for Nsight Compute (ncu) to read its counters.

The speed rows (h200_speed.sh) time whole steps; when one kernel sits well above its bytes,
its hardware counters say why (DRAM throughput, occupancy, what the warps stall on). Each
case launches its kernel ``--launches`` times on the shapes the speed rows use, cycling
through enough copies of the weights that L2 cannot hold them (ncu also flushes caches
before each profiled launch by default):

- ``mla``: MLA decode, 64 sequences x 4096 tokens, 16 heads, bf16 latent (the MLA kernel row's
  kernel row), the rule's tiles and splits;
- ``gemv:N:K:CONFIG``: the skinny GEMV of one row against an N x K bf16 weight with the
  config key (e.g. ``gemv:5120:2048:n2_k1024_w4``, Qwen3-30B-A3B's QKV);
- ``moe:TILE``: Qwen3-30B-A3B's experts for one token (128 experts, top 8, 2048 x 768),
  gate/up and down, with a MoE tile key (``default``: ``choose_tile``'s).

    ncu --clock-control none --set full -k regex:_mla_decode --launch-skip 2 --launch-count 1 \\
        python3 benchmarks/ncu_kernels.py mla
    python3 benchmarks/ncu_kernels.py gemv:5120:2048:n2_k1024_w4     # runs without ncu too
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

L2_CLEAR_BYTES = 256 << 20   # weights cycled per case: several times an H200's L2


def run_mla(launches: int) -> None:
    from archserve.kernels.mla.cases import make_mla_case
    from archserve.kernels.mla.triton_mla_decode import mla_decode

    batch, context, heads, rank = 64, 4096, 16, 512
    case = make_mla_case([(1, context)] * batch, num_heads=heads, kv_lora_rank=rank, rope=64,
                         nope=128, v_head=128, block_size=16, dtype=torch.bfloat16,
                         device="cuda", seed=0, fp8_exact_kv=False)
    meta, query = case.meta, case.absorbed_query.contiguous()
    out = torch.empty(batch, heads, rank, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for _ in range(launches):
        mla_decode(query, case.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                   out, num_seqs=batch, max_seq_len=context, scale=case.scale,
                   k_scale=case.k_scale, num_sms=sms)


def run_gemv(n: int, k: int, config: str, launches: int) -> None:
    from archserve.kernels.linear.triton_skinny_gemm import SkinnyConfig, skinny_gemm

    copies = max(1, -(-L2_CLEAR_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for i in range(launches):
        skinny_gemm(x, weights[i % copies], None, SkinnyConfig.from_key(config))


def run_moe(tile_key: str, launches: int) -> None:
    from archserve.kernels.moe.triton_fused_moe import MoETile, fused_experts

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    tile = None if tile_key == "default" else MoETile.from_key(tile_key)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(launches):   # different experts each launch, as layers differ
        chosen = torch.randperm(experts, device="cuda", generator=gen)[:top_k].view(1, top_k)
        weights = torch.full((1, top_k), 1.0 / top_k, device="cuda")
        fused_experts(x, weights, chosen.to(torch.int32), w13, w2, tile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", help="mla | gemv:N:K:CONFIG | moe:TILE")
    parser.add_argument("--launches", type=int, default=4)
    args = parser.parse_args()
    name, *params = args.case.split(":")
    if name == "mla":
        run_mla(args.launches)
    elif name == "gemv":
        run_gemv(int(params[0]), int(params[1]), params[2], args.launches)
    elif name == "moe":
        run_moe(params[0] if params else "default", args.launches)
    else:
        parser.error(f"unknown case {args.case}")
    torch.cuda.synchronize()
    print(f"{args.case}: {args.launches} launches done")


if __name__ == "__main__":
    main()
