"""The quantized decode targets' table from benchmarks/h200_quant_targets.sh's results.

Reads the `archserve bench --output-json` files of one run (bf16 and the quantized rows on
the same GPU) and prints, per row: output tok/s, the decode step's mean time and its floor
(the step's bytes over the measured copy bandwidth), their ratio, the throughput against
bf16's in the same run, the target it is held to and whether it is met, and what the
start-up tuner chose for the quantized decode GEMMs (the "quantized decode GEMMs"
decision's routes). With the start-up tuner's cache of the run (DIR/quantized_gemms.json,
copied there by the script), one line per kind of quantized decode GEMM it timed: the
default's and the best candidate's µs per call and the config it kept.

    python3 benchmarks/quant_targets_table.py DIR [--out table.json]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    max_over_floor: float | None = None     # batch-1 step / floor at most this
    min_tok_s: float | None = None          # batch-1 output tok/s at least this
    min_vs_bf16: float | None = None        # throughput at least this x bf16's


# row name (the JSON file's stem) -> its target (None: a reference row)
TARGETS: dict[str, Target | None] = {
    "bf16_b1": None,
    "fp8_b1": Target(max_over_floor=1.25, min_tok_s=400),
    "w4a16_b1": Target(max_over_floor=1.4, min_tok_s=550),
    "q4k_form_b1": Target(max_over_floor=1.5),
    "int8_b1": None,
    "qwen3_30b_fp8_b1": Target(max_over_floor=1.5),
    "bf16_256": None,
    "fp8_256": Target(min_vs_bf16=1.4),
    "w4a16_256": Target(min_vs_bf16=1.0),
    "int8_256": Target(min_vs_bf16=1.2),
}
QUANTIZED_GEMMS = "quantized decode GEMMs"


def row_of(name: str, result: dict, bf16: dict | None) -> dict:
    roof = result.get("roofline") or {}
    step_ms = (roof.get("decode_step_s_mean") or float("nan")) * 1e3
    floor_ms = (roof.get("decode_floor_s_mean") or float("nan")) * 1e3
    tok_s = result.get("output_tokens_per_s") or float("nan")
    vs_bf16 = tok_s / bf16["output_tokens_per_s"] if bf16 else float("nan")
    row = dict(row=name, tok_s=tok_s, step_ms=step_ms, floor_ms=floor_ms,
               over_floor=step_ms / floor_ms if floor_ms else float("nan"), vs_bf16=vs_bf16,
               tuner=(result.get("decisions") or {}).get(QUANTIZED_GEMMS, ""))
    target = TARGETS.get(name)
    checks = []
    if target is not None:
        if target.max_over_floor is not None:
            checks.append((f"<= {target.max_over_floor}x floor",
                           row["over_floor"] <= target.max_over_floor))
        if target.min_tok_s is not None:
            checks.append((f">= {target.min_tok_s:g} tok/s", tok_s >= target.min_tok_s))
        if target.min_vs_bf16 is not None:
            checks.append((f">= {target.min_vs_bf16}x bf16", vs_bf16 >= target.min_vs_bf16))
    row["target"] = ", ".join(text for text, _ in checks)
    row["met"] = all(ok for _, ok in checks) if checks else None
    return row


def load(directory: str) -> dict[str, dict]:
    results = {}
    for name in TARGETS:
        path = os.path.join(directory, f"{name}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                results[name] = json.load(f)
    return results


def table(results: dict[str, dict]) -> list[dict]:
    rows = []
    for name, result in results.items():
        bf16 = results.get("bf16_256" if name.endswith("_256") else "bf16_b1")
        if name.startswith("qwen3"):
            bf16 = None                    # not the 8B's bf16 row
        rows.append(row_of(name, result, bf16))
    return rows


def print_table(rows: list[dict], missing: list[str]) -> None:
    print(f"{'row':18s} {'out tok/s':>10s} {'step ms':>8s} {'floor ms':>8s} {'x floor':>7s} "
          f"{'vs bf16':>7s}  {'target':36s} met")
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['row']:18s} {r['tok_s']:10.1f} {r['step_ms']:8.3f} {r['floor_ms']:8.3f} "
              f"{r['over_floor']:7.2f} {r['vs_bf16']:7.2f}  {r['target']:36s} {met}")
    for r in rows:
        if r["tuner"]:
            print(f"  {r['row']}: {QUANTIZED_GEMMS}: {r['tuner']}")
    for name in missing:
        print(f"  {name}: no result (the run failed or was not made; see its .log)")


def print_tuner(path: str) -> None:
    """The start-up tuner's choices (kernels/linear/quantized_tuning.py's cache file)."""
    if not os.path.exists(path):
        print(f"  (no tuner cache at {path})")
        return
    with open(path, encoding="utf-8") as f:
        kinds = json.load(f).get("kinds", {})
    print(f"quantized decode GEMM tuner ({len(kinds)} kinds): default -> best us per call, "
          f"kept config")
    for key, t in sorted(kinds.items()):
        chosen = "default" if t.get("chosen") == "default" else t.get("chosen")
        print(f"  {key:64s} {t.get('default_us', 0):8.1f} -> {t.get('best_us', 0):8.1f} "
              f"x{t.get('calls', 1):<3d} {chosen}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = load(args.directory)
    rows = table(results)
    print_table(rows, [name for name in TARGETS if name not in results])
    print_tuner(os.path.join(args.directory, "quantized_gemms.json"))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
