"""--speculative-config on the command line: generate speculates and prints plain
decoding's text; explain and doctor say what would draft and how its verification steps
run (CUDA graphs or eagerly), and refuse what cannot."""

from __future__ import annotations

import json

import pytest
from tiny_checkpoints import build_tiny_mtp_checkpoint
from typer.testing import CliRunner

from archserve.cli.main import app

runner = CliRunner()
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                    "prompt_lookup_min": 1})


def test_generate_with_speculation_prints_the_plain_text(tiny_checkpoint):
    common = ["generate", "1 2 3 1 2 3 1 2", "--model", tiny_checkpoint("llama"),
              "--max-tokens", "24", "--dtype", "float32"]
    plain = runner.invoke(app, common)
    spec = runner.invoke(app, [*common, "--speculative-config", NGRAM])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.output == plain.output
    bad = runner.invoke(app, [*common, "--speculative-config", '{"method": "medusa"}'])
    assert bad.exit_code == 2 and "method must be one of" in bad.output


def test_explain_says_what_drafts(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    draft = json.dumps({"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    out = runner.invoke(app, ["explain", "--model", path, "--speculative-config", draft,
                              "--json"])
    assert out.exit_code == 0, out.output
    decision = next(d for d in json.loads(out.output)["decisions"]
                    if d["what"] == "speculative decoding")
    assert decision["chosen"] == "draft_model" and "its tokenizer the target's" in \
        decision["reason"]
    mtp = runner.invoke(app, ["explain", "--model", path, "--speculative-config",
                              '{"method": "mtp"}'])
    assert mtp.exit_code == 2 and "no multi-token-prediction layers" in mtp.output


def test_doctor_refuses_a_draft_with_another_tokenizer(tiny_checkpoint, embedded_model_path):
    other = json.dumps({"method": "draft_model", "model": tiny_checkpoint("llama"),
                        "num_speculative_tokens": 2})
    out = runner.invoke(app, ["doctor", "--model", embedded_model_path,
                              "--speculative-config", other])
    # rich wraps the reason at the console's width, which the checkpoint's path lengthens
    assert out.exit_code == 1
    assert "its tokenizer is not the target's" in " ".join(out.output.split()), out.output


@pytest.mark.parametrize("device, says", [
    ("h200", "verification steps run as decode rows, each of a sequence's 4 tokens a row of "
             "TRITON_MLA's decode kernel with its own causal length, in the decode CUDA graph "
             "of (sequences x 4) rows; a step of more rows than the largest graph replays "
             "mixed-step CUDA graphs per token bucket"),
    ("cpu", "verification steps run eagerly (TORCH_REFERENCE is not captured in CUDA graphs)"),
])
def test_explain_and_doctor_say_how_an_mla_targets_verification_steps_run(tmp_path, device, says):
    # An MTP target's attention is MLA: on a GPU its verification steps (k + 1 = 4 tokens a
    # sequence) run as decode rows in decode graphs; the CPU's reference runs them eagerly.
    path = build_tiny_mtp_checkpoint(str(tmp_path / "v3"), kv_lora_rank=256,
                                     qk_rope_head_dim=64, head_dim=64, qk_nope_head_dim=128,
                                     v_head_dim=128)
    for command in ("explain", "doctor"):
        out = runner.invoke(app, [command, "--model", path, "--device", device, "--json",
                                  "--speculative-config",
                                  '{"method": "mtp", "num_speculative_tokens": 3}'])
        assert out.exit_code == 0, out.output
        decision = next(d for d in json.loads(out.output)["decisions"]
                        if d["what"] == "speculative decoding")
        assert decision["chosen"] == "mtp" and says in decision["reason"], \
            (command, decision["reason"])


@pytest.mark.parametrize("drafts, says", [
    (3, "verification steps run as decode rows, each of a sequence's 4 tokens a row of "
        "TRITON_ATTN's decode kernel with its own causal length, in the decode CUDA graph of "
        "(sequences x 4) rows"),
    (16, "verification steps replay mixed-step CUDA graphs per token bucket (cudagraph_mode "
         "FULL) (TRITON_ATTN; TRITON_ATTN runs at most 16 query tokens a sequence as decode "
         "rows)"),
])
def test_explain_says_a_dense_targets_verification_steps_run_as_decode_rows(tiny_checkpoint,
                                                                           drafts, says):
    # A Llama on an A100 routes attention to TRITON_ATTN: its verification steps run as
    # decode rows of its decode kernel up to 15 drafts, in its mixed-step buckets beyond.
    config = json.dumps({"method": "ngram", "num_speculative_tokens": drafts,
                         "prompt_lookup_max": 2})
    out = runner.invoke(app, ["explain", "--model", tiny_checkpoint("llama-h64"), "--device",
                              "a100", "--json", "--speculative-config", config])
    assert out.exit_code == 0, out.output
    decision = next(d for d in json.loads(out.output)["decisions"]
                    if d["what"] == "speculative decoding")
    assert says in decision["reason"], decision["reason"]
