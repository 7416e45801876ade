"""One device profile emulated on this GPU, end to end (a process of its own: a process
fixes its emulation with its first GPU engine). Run by test_emulated_generations.py:

    python tests/engine/emulated_run.py PROFILE OUT.json [NAMES]   (PROFILE "native": no
    emulation; NAMES: a comma-separated part of emulated_parts.MODELS and "mechanics", default
    all of them)

For the tiny Llama (float32 and the profile's dtype), Qwen3, Qwen3-MoE, DeepSeek-V2-Lite
and the quantized fixtures (FP8, block FP8, W8A8 INT8, W4A16, GGUF) it records the route the
engine printed against ``explain --device PROFILE``'s, the CUDA graphs, and how its greedy
tokens compare with transformers in float32 on this GPU: each must be transformers'
argmax, except where the margin between the two is within twice transformers' own drift
(how far its run in the engine's 16-bit dtype moves a logit of that sequence from float32);
from there the continuations may part. The quantized fixtures against their tools' float32 reference
logits, within tests/quant/test_fixtures_end_to_end.py's 16-bit bounds. Then the emulation's
mechanics: Triton's code for the profile's architecture, and a kernel over the profile's
shared memory refused.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from emulated_parts import FIXTURES, MECHANICS, MODELS  # noqa: E402

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3", "A paged KV cache stores keys and values in fixed-size blocks."]
NUM_TOKENS = 16
# As many sequences as prompts: every decode step replays the graph of 4 rows, and the
# start-up tuners time (and compile their candidates for) the graph sizes 1, 2 and 4 only.
ENGINE = dict(kv_cache_memory_bytes=1 << 28, max_num_seqs=len(PROMPTS), max_model_len=256,
              self_check=False)
QUANT = os.path.join(TESTS, "fixtures", "quant")
GGUF = os.path.join(QUANT, "gguf-mixed", "tiny-mixed.gguf")


def checkpoints(root: str, names: set[str]) -> dict[str, str]:
    """The tiny checkpoints among ``names`` (each built only where a model asks it)."""
    from models.test_deepseek_vs_hf import GPU_MLA
    from models.test_deepseek_vs_hf import VARIANTS as DEEPSEEK
    from tiny_checkpoints import TINY_QWEN3_MOE, build_tiny_checkpoint

    h64 = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=1)
    v2_type, v2_overrides = DEEPSEEK["v2_lite"]
    builds = {
        "llama": lambda: build_tiny_checkpoint(f"{root}/llama", "llama",
                                               tie_word_embeddings=False, **h64),
        "qwen3": lambda: build_tiny_checkpoint(f"{root}/qwen3", "qwen3",
                                               tie_word_embeddings=False, **h64),
        "qwen3_moe": lambda: build_tiny_checkpoint(f"{root}/qwen3_moe", "qwen3_moe",
                                                   **TINY_QWEN3_MOE),
        "deepseek_v2": lambda: build_tiny_checkpoint(f"{root}/deepseek_v2", v2_type,
                                                     **{**GPU_MLA, **v2_overrides}),
    }
    return {name: build() for name, build in builds.items() if name in names}


def route_record(llm, path: str, profile: str, dtype: str = "auto") -> dict:
    """The engine's printed route against explain's for the profile and the dtype the
    engine was asked for (a float32 run's attention has another ideal than the profile's
    16-bit default), and its graphs."""
    from archserve.platform.profiles import get_profile
    from archserve.routing.explain import explain_model
    from archserve.routing.model_summary import read_model_summary

    report = llm.llm_engine.report
    printed = [r.to_dict() for r in report.routes]
    explained = [r.to_dict() for r in explain_model(get_profile(profile),
                                                    read_model_summary(path),
                                                    dtype=dtype).routes]
    return {"routes": {r["layer"]: r["backend"] for r in printed},
            "routes_equal_explain": printed == explained,
            "device": report.device.describe(), "dtype": str(report.dtype),
            "graph_sizes": list(report.graph_sizes), "graphs_off": report.graphs_off,
            "startup_s": {k: round(v, 1) for k, v in report.timings.items()},
            "decisions": [f"{d.what}: {d.chosen}" for d in report.decisions]}


def greedy_verdict(hf_path: str, outputs, dtype: torch.dtype, gguf_file: str | None = None
                   ) -> tuple[bool, str]:
    """Each generated token is transformers' float32 argmax, or transformers' own drift in
    ``dtype`` reaches the margin where it is not (the continuations may part there)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    fp32 = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32,
                                                **kwargs).cuda().eval()
    low = None if dtype == torch.float32 else AutoModelForCausalLM.from_pretrained(
        hf_path, dtype=dtype, **kwargs).cuda().eval()
    agreed, parted = 0, []
    for out in outputs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        start = len(out.prompt_token_ids)
        with torch.no_grad():
            want = fp32(torch.tensor([ids], device="cuda")).logits[0].float()
            # Transformers' own drift on this sequence: the most its 16-bit run moves any
            # logit of any position from its float32 run (float32: summation order only).
            drift = 1e-4 if low is None else float(
                (low(torch.tensor([ids], device="cuda")).logits[0].float() - want).abs().max())
        for pos in range(start, len(ids)):
            best, ours = int(want[pos - 1].argmax()), ids[pos]
            if best == ours:
                agreed += 1
                continue
            margin = float(want[pos - 1, best] - want[pos - 1, ours])
            if margin > 2 * drift:
                return False, (f"step {pos - start} of {out.prompt!r}: ours {ours}, "
                               f"transformers {best} by {margin:.4f}, beyond twice its own "
                               f"drift {drift:.4f}")
            parted.append(f"step {pos - start}: margin {margin:.4f} within drift {drift:.4f}")
            break
    return True, f"{agreed} tokens agree; " + ("; ".join(parted) or "no near-tie")


def run_model(name: str, path: str, profile: str, dtype: str) -> dict:
    from archserve import LLM, SamplingParams

    llm = LLM(path, emulate_device=profile, dtype=dtype, **ENGINE)
    record = route_record(llm, path, profile, dtype)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    torch_dtype = llm.llm_engine.report.dtype
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    record["ok"], record["detail"] = greedy_verdict(path, outputs, torch_dtype)
    return record


def run_fixture(name: str, profile: str) -> dict:
    from quant.test_fixtures_end_to_end import bf16_bounds, compare

    from archserve import LLM

    path = os.path.join(QUANT, name)
    llm = LLM(path, emulate_device=profile, **ENGINE)
    record = route_record(llm, path, profile)
    mean_delta, top1 = compare(llm, name)
    bound, min_top1 = bf16_bounds(name)
    record["ok"] = mean_delta < bound and top1 >= min_top1
    record["detail"] = (f"mean |delta logprob| {mean_delta:.4f} (< {bound}), top-1 "
                        f"{top1:.3f} (>= {min_top1}) against the tool's float32 reference")
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return record


def run_gguf(profile: str) -> dict:
    from archserve import LLM, SamplingParams

    llm = LLM(GGUF, emulate_device=profile, **ENGINE)
    record = route_record(llm, GGUF, profile)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                                   ignore_eos=True))
    torch_dtype = llm.llm_engine.report.dtype
    del llm
    gc.collect()
    record["ok"], record["detail"] = greedy_verdict(os.path.dirname(GGUF), outputs,
                                                    torch_dtype, os.path.basename(GGUF))
    return record


@triton.jit
def tile_product(a, b, c, K: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """c = a @ b for one BLOCK x BLOCK tile, K deep, pipelined over STAGES."""
    rows, cols = tl.arange(0, BLOCK), tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK, num_stages=STAGES):
        x = tl.load(a + rows[:, None] * K + k + cols[None, :])
        y = tl.load(b + (k + rows[:, None]) * BLOCK + cols[None, :])
        acc += tl.dot(x, y)
    tl.store(c + rows[:, None] * BLOCK + cols[None, :], acc.to(c.dtype.element_ty))


def mechanics(profile: str) -> dict:
    """Triton builds for the profile's architecture, and holds kernels to its shared
    memory: a tile needing more than it has fails as on that GPU (and one that fits runs)."""
    from triton.runtime.errors import OutOfResources

    from archserve.platform import detect

    def operands(block: int, depth: int) -> tuple:
        return (torch.randn(block, depth, dtype=torch.float16, device="cuda"),
                torch.randn(depth, block, dtype=torch.float16, device="cuda"),
                torch.empty(block, block, dtype=torch.float16, device="cuda"))

    result = {"shared_memory_limit": detect().shared_memory_per_block_bytes,
              "triton_arch": os.environ.get("TRITON_OVERRIDE_ARCH")}
    kernel = tile_product[(1,)](*operands(64, 256), K=256, BLOCK=64, STAGES=2, num_warps=4)
    ptx = kernel.asm["ptx"]
    result["wgmma"] = "wgmma" in ptx
    result["mma_sync"] = "mma.sync" in ptx
    # 128 x 128 fp16 tiles three stages deep, 64 KiB a buffer. Triton 3.6 keeps one buffer
    # for SM70/SM75 (no cp.async: 65,536 bytes, which a T4 and a V100 hold), two from SM80
    # (131,072: an A100 holds them, SM86/SM89's 101,376 do not) and three on SM90 (196,608,
    # under an H100's 232,448; four stages asked 256 KiB).
    try:
        kernel = tile_product[(1,)](*operands(128, 512), K=512, BLOCK=128, STAGES=3,
                                    num_warps=8)
        torch.cuda.synchronize()
        result["large_tile"], result["large_tile_shared"] = "ran", kernel.metadata.shared
    except OutOfResources as exc:
        result["large_tile"], result["large_tile_shared"] = f"refused: {exc}", exc.required
    return result


def main() -> None:
    import tempfile

    profile, out_path = sys.argv[1], sys.argv[2]
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else [*MODELS, MECHANICS]
    unknown = set(names) - {*MODELS, MECHANICS}
    if unknown:
        raise SystemExit(f"unknown names {sorted(unknown)}: not in emulated_parts.MODELS")
    results: dict[str, dict] = {}

    def attempt(key: str, fn, *args) -> None:  # noqa: ANN001
        start = time.perf_counter()
        try:
            results[key] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - recorded, and the next model runs
            results[key] = {"ok": False, "detail": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-3000:]}
        # Where a part's time goes: this model's start (its tuners, graphs) and its run.
        results[key]["seconds"] = round(time.perf_counter() - start, 1)
        with open(f"{out_path}.tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(f"{out_path}.tmp", out_path)   # a part killed mid-write: the last file stays

    if profile == "native":     # the control: the GPU as it is
        attempt(MECHANICS, mechanics, profile)
        return
    with tempfile.TemporaryDirectory() as root:
        wanted = set(names)
        paths = checkpoints(root, wanted | ({"llama"} if "llama float32" in wanted else set()))
        for name in names:      # in the order given
            if name == "llama float32":
                attempt(name, run_model, "llama", paths["llama"], profile, "float32")
            elif name in paths:
                attempt(name, run_model, name, paths[name], profile, "auto")
            elif name in FIXTURES:
                attempt(name, run_fixture, name, profile)
            elif name == "gguf-mixed":
                attempt(name, run_gguf, profile)
            else:
                attempt(name, mechanics, profile)


if __name__ == "__main__":
    main()
