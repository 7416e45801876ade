"""The doctor, explain and matrix commands, through typer's CliRunner (and one subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from archserve.cli.main import COMMANDS, app

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_help_lists_every_command_and_each_has_help() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for name in ("doctor", "explain", "matrix"):
        assert name in result.output
        sub = run(name, "--help")
        assert sub.exit_code == 0 and "--json" in sub.output
        assert "unavailable" not in sub.output


def test_help_at_80_columns_cuts_nothing() -> None:
    """Every command's --help fits 80 columns by wrapping: no option name or default is
    cut to an ellipsis."""
    for name in COMMANDS:
        result = runner.invoke(app, [name, "--help"], terminal_width=80, env={"COLUMNS": "80"})
        assert result.exit_code == 0, (name, result.output)
        assert "…" not in result.output, (name, result.output)
        assert max(map(len, result.output.splitlines())) <= 80, name


def test_importing_the_cli_does_not_import_torch() -> None:
    code = "import sys, archserve.cli.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_explain_v100_done_when() -> None:
    result = run("explain", "--device", "v100", "--op", "attention", "--head-size", "128",
                 "--dtype", "bfloat16", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["routes"][0]["ideal"] == "TRITON_ATTN"
    assert out["dtype"] == "float16"
    assert out["decisions"][0]["requested"] == "bfloat16"
    assert out["decisions"][0]["chosen"] == "float16"


@pytest.mark.parametrize("device,ideal", [("h100", "FLASH_ATTN"), ("b200", "FLASHINFER"),
                                          ("rtx5090", "FLASH_ATTN")])
def test_explain_profiles(device: str, ideal: str) -> None:
    result = run("explain", "-d", device, "--op", "attention", "--head-size", "128", "--json")
    out = json.loads(result.output)
    assert out["routes"][0]["ideal"] == ideal and out["libraries"] == "all"


def test_explain_libraries_none_and_text_output() -> None:
    result = run("explain", "-d", "h100", "--op", "attention", "--head-size", "128",
                 "--libraries", "none", "--json")
    out = json.loads(result.output)
    assert out["routes"][0]["backend"] == "FLEX_ATTENTION"      # triton assumed absent
    text = run("explain", "-d", "h100", "--op", "attention", "--head-size", "128")
    assert text.exit_code == 0 and "FLASH_ATTN (FA3)" in text.output


def test_explain_refuses_impossible_and_unknown_backends() -> None:
    result = run("explain", "-d", "v100", "--op", "attention", "--head-size", "128",
                 "--backend", "FLASH_ATTN")
    assert result.exit_code == 2 and "needs SM80+" in result.output
    result = run("explain", "-d", "nosuchgpu", "--op", "attention", "--head-size", "128")
    assert result.exit_code == 2 and "valid ids" in result.output
    assert run("explain", "--op", "foo").exit_code == 2
    both = run("explain", "--op", "linear", "--model", ".")
    assert both.exit_code != 0 and "not both" in both.output


def test_explain_defaults_to_the_embedded_model() -> None:
    """Like generate and bench, explain with no --model explains the embedded model."""
    result = run("explain", "-d", "h100", "--json")
    assert result.exit_code == 0, result.output
    layers = [r["layer"] for r in json.loads(result.output)["routes"]]
    assert layers[0] == "attention" and "lm_head" in layers


@pytest.mark.parametrize("device, source", [("live", "fastest of"), ("h100", "median of"),
                                            ("mi300x", "median of")])
def test_explain_and_doctor_say_where_the_serving_itl_target_comes_from(device, source):
    """serve's default target ITL and its step cost's source: timed on CPUs (the fastest
    of a few short steps) and GPUs (the median), as engine/step_budget.py measures it."""
    for command in ("explain", "doctor"):
        out = json.loads(run(command, "-d", device, "--json").output)
        itl = next(d for d in out["decisions"] if d["what"] == "target ITL (serve)")
        assert itl["chosen"] == "3x a decode step of 16 sequences", itl
        assert "measured at start-up" in itl["reason"] and source in itl["reason"], itl


def test_explain_and_doctor_say_how_a_cpus_decode_steps_run(monkeypatch) -> None:
    """On a CPU: compiled by default (level 3), eager where the level says 0; a GPU's
    decode steps follow CUDA graphs, not this level."""
    for level, requested, chosen in ((None, "level 3 (the default)", "compiled by inductor"),
                                     ("0", "level 0 ($ARCHSERVE_COMPILATION_LEVEL)", "eager")):
        if level is None:
            monkeypatch.delenv("ARCHSERVE_COMPILATION_LEVEL", raising=False)
        else:
            monkeypatch.setenv("ARCHSERVE_COMPILATION_LEVEL", level)
        for command in ("explain", "doctor"):
            out = json.loads(run(command, "-d", "cpu", "--json").output)
            (steps,) = [d for d in out["decisions"] if d["what"] == "decode steps (CPU)"]
            assert steps["requested"] == requested, steps
            assert steps["chosen"].startswith(chosen), steps
    monkeypatch.setenv("ARCHSERVE_COMPILATION_LEVEL", "fast")
    out = json.loads(run("doctor", "-d", "cpu", "--json").output)
    (steps,) = [d for d in out["decisions"] if d["what"] == "decode steps (CPU)"]
    assert steps["chosen"] == "refused" and "not an optimisation level 0-3" in steps["reason"]
    out = json.loads(run("explain", "-d", "h100", "--json").output)
    assert not [d for d in out["decisions"] if d["what"] == "decode steps (CPU)"]


def test_explain_every_op_kind() -> None:
    """--op takes every op kind the registry routes; linear and moe take --quantization;
    an op no loadable architecture has gets its ideal and the reason, never a route."""
    dense = json.loads(run("explain", "-d", "h100", "--op", "linear", "--json").output)
    assert dense["routes"][0]["backend"] and dense["not_loadable"] is None
    awq = json.loads(run("explain", "-d", "h100", "--op", "linear", "-q", "awq",
                         "--json").output)
    assert awq["routes"][0]["backend"] == "TRITON_WEIGHT_ONLY"
    # vLLM 0.33 choose_mp_linear_kernel: Machete on Hopper (group 128), Marlin elsewhere.
    assert awq["routes"][0]["ideal"] == "MACHETE"
    awq = json.loads(run("explain", "-d", "a100", "--op", "linear", "-q", "awq",
                         "--json").output)
    assert awq["routes"][0]["ideal"] == "MARLIN"
    moe = json.loads(run("explain", "-d", "h100", "--op", "moe", "--json").output)
    assert moe["routes"][0]["backend"] == "TRITON_FUSED_MOE" and moe["not_loadable"] is None
    # B200: vLLM's ideal is FlashInfer's TRT-LLM bf16 MoE (rules only here); the route runs.
    b200 = run("explain", "-d", "b200", "--op", "moe").output
    assert "TRITON_FUSED_MOE" in b200 and "TRTLLM_MOE_BF16" in b200 and "rules only" in b200
    b200 = json.loads(run("explain", "-d", "b200", "--op", "moe", "--json").output)["routes"][0]
    assert (b200["backend"], b200["ideal"]) == ("TRITON_FUSED_MOE", "TRTLLM_MOE_BF16")
    cpu = json.loads(run("explain", "-d", "cpu", "--op", "moe", "--json").output)["routes"][0]
    assert cpu["backend"] == "TORCH_MOE"
    fp8 = json.loads(run("explain", "-d", "h100", "--op", "moe", "-q", "fp8",
                         "--json").output)["routes"][0]
    # fp8 experts run in the Triton fused MoE on SM89+; vLLM's ideal, CUTLASS, is rules only.
    assert fp8["backend"] == "TRITON_FUSED_MOE" and fp8["ideal"] == "CUTLASS_MOE_FP8"
    # A scheme this build does not load: its ideal, the reason, and no route.
    bnb = json.loads(run("explain", "-d", "h100", "--op", "linear", "-q", "bitsandbytes",
                         "--json").output)
    assert "not loadable" in bnb["not_loadable"] and bnb["routes"][0]["backend"] == ""
    nvfp4 = json.loads(run("explain", "-d", "b200", "--op", "linear", "-q", "nvfp4",
                           "--json").output)
    assert nvfp4["routes"][0]["ideal"] == "FLASHINFER_CUTEDSL_NVFP4"
    refused = run("explain", "--op", "linear", "-q", "no-such-scheme")
    assert refused.exit_code == 2 and "not loadable" in refused.output


def test_explain_names_the_op_only_where_the_layer_does_not() -> None:
    text = run("explain", "-d", "h100", "--op", "attention", "--head-size", "128").output
    layer_cells = [line.split("│")[1].strip() for line in text.splitlines()
                   if line.startswith("│")]
    assert layer_cells.count("attention") == 1, layer_cells
    text = run("explain", "-d", "h100").output
    layer_cells = [line.split("│")[1].strip() for line in text.splitlines()
                   if line.startswith("│")]
    assert "lm_head" in layer_cells and "linear" in layer_cells   # lm_head's op is named


def test_explain_model_directory(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "head_dim": 128,
        "num_attention_heads": 16, "num_key_value_heads": 8,
        "quantization_config": {"quant_method": "fp8"}}))
    result = run("explain", "-d", "a100", "--model", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["routes"][1]["ideal"] == "MARLIN"


def test_explain_moe_model_shows_the_route_and_vllms_ideal() -> None:
    from pathlib import Path
    model = str(Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "qwen3-30b-a3b")
    for device, route, ideal in (("h200", "TRITON_FUSED_MOE", "TRITON_FUSED_MOE"),
                                 ("b200", "TRITON_FUSED_MOE", "TRTLLM_MOE_BF16"),
                                 ("cpu", "TORCH_MOE", "TORCH_MOE")):
        out = json.loads(run("explain", "-d", device, "--model", model, "--json").output)
        moe = next(r for r in out["routes"] if r["op"] == "moe")
        assert (moe["backend"], moe["ideal"]) == (route, ideal), device
        assert out["not_loadable"] is None


def test_doctor_live_json_can_run_here() -> None:
    from archserve.platform.detect import detect
    features = detect().features
    auto = json.loads(run("doctor", "--json").output)
    # auto: bfloat16 where this CPU multiplies it natively, else float32 (either CI machine).
    dtype = next(d for d in auto["decisions"] if d["what"] == "dtype")
    assert dtype["chosen"] == ("bfloat16" if features.cpu_bf16 else "float32")
    assert "native bfloat16" in dtype["reason"]
    result = run("doctor", "--json", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["can_run"] is True
    assert {"attention", "mla_attention", "linear", "moe"} <= set(out["ops"])
    assert out["ops"]["linear"]["backend"] == "TORCH_MATMUL"
    # Every quantized layer kind a loadable checkpoint holds has a route that runs here.
    # float32 stays exact: every quantized weight is dequantized, a GGUF file expanded at
    # load (the dense route).
    quantized = {op: r["backend"] for op, r in out["ops"].items() if op.startswith("linear ")}
    assert quantized == {"linear fp8 W8A8": "TORCH_DEQUANT", "linear fp8 block": "TORCH_DEQUANT",
                         "linear int8 W8A8": "TORCH_DEQUANT",
                         "linear int4 W4A16 (AWQ/GPTQ)": "TORCH_DEQUANT",
                         "linear GGUF blocks": "TORCH_MATMUL", "linear LM head": "TORCH_MATMUL"}
    # A bfloat16 model keeps integer-group weights packed where torch's CPU weight-only
    # kernels vectorise (AVX2, which doctor lists with the CPU's other vector extensions).
    packed = features.avx2
    bf16 = json.loads(run("doctor", "--json", "--dtype", "bfloat16").output)
    weight_only = {op: r["backend"] for op, r in bf16["ops"].items()
                   if op in ("linear int4 W4A16 (AWQ/GPTQ)", "linear GGUF blocks",
                             "linear LM head")}
    # The LM head: CPU_WEIGHT_ONLY's int8 copy is a candidate where it runs, and says so.
    assert weight_only == {"linear int4 W4A16 (AWQ/GPTQ)":
                           "CPU_WEIGHT_ONLY" if packed else "TORCH_DEQUANT",
                           "linear GGUF blocks": "CPU_WEIGHT_ONLY" if packed else "TORCH_MATMUL",
                           "linear LM head": "CPU_WEIGHT_ONLY" if packed else "TORCH_MATMUL"}
    head = [d for d in bf16["decisions"] if d["what"] == "LM head"]
    assert [d["chosen"] for d in head] == (["CPU_WEIGHT_ONLY"] if packed else [])
    assert not [d for d in out["decisions"] if d["what"] == "LM head"]     # float32: dense
    assert ("AVX2" in out["device"]["cpu_isa"]) == packed
    refused = {o["backend"]: o["reason"]
               for o in out["ops"]["linear int4 W4A16 (AWQ/GPTQ)"]["rejected"]}
    if packed:
        assert "takes bfloat16 activations" in refused["CPU_WEIGHT_ONLY"]
    # MLA runs the torch fallback over the latent cache; MoE runs the loop.
    assert out["ops"]["mla_attention"]["backend"] == "TORCH_REFERENCE"
    assert out["ops"]["moe"]["backend"] == "TORCH_MOE"
    reasons = {o["backend"]: o["reason"] for o in out["ops"]["attention"]["others"]}
    reasons.update({r["backend"]: r["reason"] for r in out["ops"]["attention"]["rejected"]})
    assert "FLASH_ATTN" in reasons


def test_doctor_profile_text() -> None:
    result = run("doctor", "-d", "t4")
    assert result.exit_code == 0, result.output
    assert "Tesla T4" in result.output and "can run here" in result.output
    # The bracketed platform and capability are text, not swallowed as rich markup.
    assert "[cuda, capability SM75 (sm_75)]" in result.output


def test_matrix_json() -> None:
    result = run("matrix", "--json")
    assert result.exit_code == 0
    out = json.loads(result.output)
    assert "h100" in out["profiles"] and "cpu" in out["profiles"]
    fa = next(f for f in out["features"] if f["name"] == "FlashAttention")
    assert fa["support"]["h100"] and not fa["support"]["v100"] and not fa["implemented"]
    assert fa["notes"]["h100"] == "FA3"
    text = run("matrix", "-d", "sm90", "-d", "sm100")
    assert text.exit_code == 0 and "FA4" in text.output


def test_matrix_marks_schemes_archserve_runs_where_it_runs_them() -> None:
    """The embedded model is GGUF and runs on the CPU: its row says so, with the route;
    a scheme this build does not load keeps vLLM's rule (no CPU kernels)."""
    out = json.loads(run("matrix", "--json").output)
    rows = {f["name"]: f for f in out["features"]}
    # The cpu profile has AVX-512 BF16: bfloat16 by default, so its GGUF weights stay packed.
    assert rows["GGUF"]["support"]["cpu"] and rows["GGUF"]["notes"]["cpu"] == "CPU_WEIGHT_ONLY"
    assert rows["AWQ"]["support"]["cpu"] and rows["AWQ"]["notes"]["cpu"] == "CPU_WEIGHT_ONLY"
    assert rows["AWQ"]["notes"]["h100"] == "TRITON_WEIGHT_ONLY"
    assert not rows["BitsAndBytes"]["support"]["cpu"] and not rows["BitsAndBytes"]["implemented"]


def test_commands_table_points_at_real_functions() -> None:
    import importlib

    for name, target in COMMANDS.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


_WITHOUT_TORCH = """
import sys
from archserve.cli.main import app
try:
    app(sys.argv[1:])
except SystemExit as exit:
    print("exit", exit.code, "torch imported:", "torch" in sys.modules, flush=True)
"""


@pytest.mark.parametrize("args, message", [
    (["explain", "--device", "nosuchgpu"], "unknown device profile 'nosuchgpu'"),
    (["explain", "--op", "atention", "-d", "h100"], "--op must be one of attention"),
    (["explain", "--op", "attention", "--model", "x"], "not both"),
    (["explain", "--model", "/no/such/model"], "does not exist"),
    (["explain", "--op", "attention", "--attn-type", "decodr"], "attention type must be"),
    (["explain", "--op", "vit_attention", "-d", "h100"], "needs --head-size"),
    (["matrix", "--device", "nosuchgpu"], "unknown device profile"),
    (["doctor", "--device", "nosuchgpu"], "unknown device profile"),
    (["doctor", "-d", "h100", "-tp", "2", "--model", "/no/such/model"], "does not exist"),
])
def test_argument_errors_come_before_torch_is_imported(args, message) -> None:
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *args], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert "exit 2 torch imported: False" in out.stdout, out.stdout + out.stderr
    assert message in " ".join((out.stdout + out.stderr).split()), out.stderr


def test_explain_attention_without_a_head_size_takes_llama_3_8bs() -> None:
    result = run("explain", "-d", "h100", "--op", "attention", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    decision = next(d for d in out["decisions"] if d["what"] == "head size")
    assert decision["chosen"] == "128" and "--head-size" in decision["reason"]
    given = json.loads(run("explain", "-d", "h100", "--op", "attention", "--head-size", "128",
                           "--json").output)
    assert out["routes"] == given["routes"]


def test_doctor_fits_a_screen_and_verbose_gives_every_rejection() -> None:
    for device in ("h100", "cpu", "v100", "mi300x"):
        brief = runner.invoke(app, ["doctor", "-d", device], terminal_width=80,
                              env={"COLUMNS": "80"})
        assert brief.exit_code == 0, brief.output
        lines = brief.output.splitlines()
        assert len(lines) <= 40 and max(map(len, lines)) <= 80, brief.output
        assert "…" not in brief.output, brief.output
    assert "attention" in brief.output and "--verbose" in brief.output
    verbose = runner.invoke(app, ["doctor", "-d", "h100", "--verbose"], terminal_width=80,
                            env={"COLUMNS": "80"})
    assert verbose.exit_code == 0
    flat = " ".join(verbose.output.replace("│", " ").split())
    assert "FLASHINFER:" in flat and "TRITON_ATTN" in flat and len(verbose.output.splitlines()) > 100


def test_matrix_never_cuts_a_device_name() -> None:
    text = runner.invoke(app, ["matrix"], terminal_width=80, env={"COLUMNS": "80"}).output
    assert "…" not in text
    from archserve.platform.profiles import all_profiles
    header = text.split("feature")[0]
    for profile in all_profiles():
        assert f" {profile.id} " in header, profile.id


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "prepare"])
def test_every_command_that_builds_an_engine_takes_emulate_device(command) -> None:
    result = runner.invoke(app, [command, "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--emulate-device" in result.output
    assert "--compilation-config" in result.output


def test_doctor_on_an_h200_emulating_a_t4_and_refusing_a_b200() -> None:
    result = run("doctor", "--device", "h200", "--emulate-device", "t4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["device"]["id"] == "t4" and data["device"]["emulated_on"]["id"] == "h200"
    assert data["decisions"][0]["what"] == "device" and data["can_run"]
    text = run("doctor", "--device", "h200", "--emulate-device", "t4")
    assert "emulated on NVIDIA H200" in " ".join(text.output.split())
    refused = run("doctor", "--device", "h200", "--emulate-device", "b200")
    assert refused.exit_code == 1
    assert "cannot emulate b200" in " ".join(refused.output.split())
    unknown = run("doctor", "--emulate-device", "k80")
    assert unknown.exit_code == 2 and "unknown device profile" in unknown.output


def test_explain_on_a_cpu_names_its_isa_and_the_bf16_route() -> None:
    text = run("explain", "-d", "cpu", "--dtype", "bfloat16")
    assert text.exit_code == 0, text.output
    assert "ISA: AVX2, AVX-512, AVX-512 VNNI, AVX-512 BF16" in text.output
    out = json.loads(run("explain", "-d", "cpu", "--dtype", "bfloat16", "--json").output)
    linear = next(r for r in out["routes"] if r["layer"].startswith("linear"))
    assert linear["backend"] == "CPU_WEIGHT_ONLY"      # the embedded GGUF kept packed
    assert out["device"]["cpu_isa"] == ["AVX2", "AVX-512", "AVX-512 VNNI", "AVX-512 BF16"]
