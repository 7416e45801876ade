"""`archserve bench --speculative-config`: the run's speculative decoding figures (vLLM's:
drafts, draft and accepted tokens, mean acceptance length, acceptance by position) in the
JSON and the table, offline from the engine's counters and in serve mode from /metrics."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from archserve.bench.report import summary_rows
from archserve.bench.server_metrics import parse_metrics, sample_from, summarize_samples
from archserve.cli.main import app

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                    "prompt_lookup_min": 1})


def test_offline_bench_reports_acceptance(tiny_checkpoint):
    out = CliRunner().invoke(app, ["bench", "--model", tiny_checkpoint("llama"),
                                   "--num-prompts", "4", "--input-len", "16",
                                   "--output-len", "32", "--max-model-len", "128",
                                   "--speculative-config", NGRAM, "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    spec = result["spec_decode"]
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
    assert len(spec["acceptance_rate_per_pos"]) == 3
    assert result["output_tokens"] == 4 * 32 and result["decisions"]["speculative decoding"]
    row = dict(summary_rows(result))["spec decode: acceptance length, rate (per position)"]
    assert row.startswith(f"{spec['mean_acceptance_length']:.2f}")


def test_serve_bench_reads_the_counters_from_metrics():
    def scrape(drafts: int, draft_tokens: int, accepted: int) -> str:
        return "\n".join([
            f"vllm:spec_decode_num_drafts_total{{model_name=\"m\"}} {drafts}",
            f"vllm:spec_decode_num_draft_tokens_total{{model_name=\"m\"}} {draft_tokens}",
            f"vllm:spec_decode_num_accepted_tokens_total{{model_name=\"m\"}} {accepted}",
            "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5", ""])

    samples = [sample_from(parse_metrics(scrape(*counts)), t)
               for t, counts in enumerate([(10, 30, 12), (20, 60, 30), (40, 120, 72)])]
    spec = summarize_samples(samples)["spec_decode"]
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == \
        (30, 90, 60)
    assert spec["mean_acceptance_length"] == 1 + 60 / 30
    assert summarize_samples([sample_from({}, 0.0)])["spec_decode"] is None
