"""One decode step's linear layers of the embedded model on this CPU, in each storage
format CPU_WEIGHT_ONLY can keep them (archserve/kernels/linear/cpu_weight_only.py).

Every layer of the model gets its own random Q4_1-like weight (4-bit, groups of 32, a scale
and an offset), so a pass reads all 30 layers' weights from memory as a step does; each
format's best pass of ``--reps`` (cpu_timing.best_times: the formats take turns). The last
column is torch's int4 kernel fed float32 activations, the scalar path that once made
packed int4 look 8-20x slower than float32 here; CPU_WEIGHT_ONLY feeds it bfloat16.

The LM head's forms follow (kernels/linear/cpu_lm_head.py): the dense bfloat16 head, and
8-bit copies of it with per-output-channel scales (one ``_weight_int8pack_mm``) and with a
scale per group of 32 input channels (Q8_0's groups: one call per group, the form
start-up may keep), each at the decode row counts.

    python3 benchmarks/cpu_gguf_kept_quantized.py [--rows 1,4,16] [--threads N]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from archserve.kernels.linear.cpu_lm_head import int8_groups, int8_groups_linear
from archserve.kernels.linear.cpu_timing import best_times
from archserve.kernels.linear.cpu_weight_only import (
    BF16,
    FP32,
    INT4,
    CpuWeight,
    cpu_linear,
    to_format,
)
from archserve.kernels.linear.quantized_weights import IntGroupWeight, pack_int_rows
from archserve.loader.default_model import default_model_path
from archserve.loader.loader import load_model_config

GROUP = 32
FORMATS = (FP32, BF16, INT4)


def layer_shapes(cfg) -> list[tuple[int, int]]:  # noqa: ANN001 - a ModelConfig
    kv = cfg.num_kv_heads * cfg.head_dim
    return [(cfg.num_heads * cfg.head_dim + 2 * kv, cfg.hidden_size),     # qkv
            (cfg.hidden_size, cfg.num_heads * cfg.head_dim),              # o
            (2 * cfg.intermediate_size, cfg.hidden_size),                 # gate_up
            (cfg.hidden_size, cfg.intermediate_size)]                     # down


def q4_1_weight(n: int, k: int) -> IntGroupWeight:
    q = torch.randint(0, 16, (k, n))
    scales = torch.rand(k // GROUP, n) * 0.01
    return IntGroupWeight(pack_int_rows(q, 4), scales, -8 * scales, 4, GROUP, k, n)


def int4_float32_x(x: torch.Tensor, w: CpuWeight) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.weight, w.group_size,
                                                      w.scales.float())


def one_step(layers: list[CpuWeight], inputs: dict[int, torch.Tensor], linear) -> None:  # noqa: ANN001
    for w in layers:
        linear(inputs[w.in_features], w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16", help="sequences in the decode step")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, _ = load_model_config(default_model_path())
    weights = [q4_1_weight(n, k) for _ in range(cfg.num_layers) for n, k in layer_shapes(cfg)]
    stored = {f: [to_format(w, f) for w in weights] for f in FORMATS}
    print(f"{cfg.architecture}: {cfg.num_layers} layers' linears, "
          f"{torch.get_num_threads()} threads; ms a step (best of {args.reps})")
    print("| rows | " + " | ".join(FORMATS) + " | int4, float32 x |")
    for rows in map(int, args.rows.split(",")):
        inputs = {k: torch.randn(rows, k) for k in {w.in_features for w in weights}}
        candidates = {f: partial(one_step, stored[f], inputs, cpu_linear) for f in FORMATS}
        candidates["int4, float32 x"] = partial(one_step, stored[INT4], inputs, int4_float32_x)
        best = best_times(candidates, args.reps)
        print(f"| {rows} | " + " | ".join(f"{best[f] * 1e3:.1f}" for f in candidates) + " |",
              flush=True)
    time_lm_head(cfg, args.rows, args.reps)


def time_lm_head(cfg, rows_list: str, reps: int) -> None:  # noqa: ANN001 - a ModelConfig
    head = (torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.05).to(torch.bfloat16)
    forms = {"bf16 (dense)": partial(torch.nn.functional.linear, weight=head),
             "int8 per channel": partial(int8_groups_linear,
                                         w=int8_groups(head, cfg.hidden_size)),
             "int8 groups of 32": partial(int8_groups_linear, w=int8_groups(head, GROUP))}
    print(f"LM head {cfg.vocab_size} x {cfg.hidden_size}: ms a product (best of {reps * 4})")
    print("| rows | " + " | ".join(forms) + " |")
    for rows in map(int, rows_list.split(",")):
        x = torch.randn(rows, cfg.hidden_size).to(torch.bfloat16)
        best = best_times({name: partial(form, x) for name, form in forms.items()}, reps * 4)
        print(f"| {rows} | " + " | ".join(f"{best[f] * 1e3:.2f}" for f in forms) + " |",
              flush=True)


if __name__ == "__main__":
    main()
