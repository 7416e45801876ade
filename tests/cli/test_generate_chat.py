"""`archserve generate` and `archserve chat` on a tiny checkpoint, through typer's CliRunner."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from archserve import LLM, SamplingParams
from archserve.cli.main import app

runner = CliRunner()
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from tiny_checkpoints import build_tiny_checkpoint
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("generate")), "llama")


def _greedy(llm: LLM, prompt: str) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    return llm.generate([prompt], params)[0].outputs[0].text


def test_generate_is_a_raw_completion_by_default_and_chat_on_request(checkpoint) -> None:
    """As vLLM's generate: the prompt goes to the model as it is; --chat wraps it in the
    chat template."""
    from archserve.loader.tokenizer import apply_chat_template
    llm = LLM(checkpoint, dtype="float32")
    raw = _greedy(llm, PROMPT)
    templated = _greedy(llm, apply_chat_template(llm.get_tokenizer(),
                                                 [{"role": "user", "content": PROMPT}]))
    assert raw != templated       # else the check below could not tell them apart
    common = ["generate", PROMPT, "--model", checkpoint, "--max-tokens", "8", "--dtype",
              "float32"]
    out = runner.invoke(app, common)
    assert out.exit_code == 0, out.output
    assert out.output.rstrip("\n") == raw
    chat = runner.invoke(app, [*common, "--chat"])
    assert chat.exit_code == 0 and chat.output.rstrip("\n") == templated


def test_generate_compiles_its_decode_steps_with_o3_and_gives_the_eager_text(
        checkpoint, tmp_path, monkeypatch, caplog) -> None:
    import logging
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    caplog.set_level(logging.INFO, logger="archserve")
    common = ["generate", PROMPT, "--model", checkpoint, "--max-tokens", "8", "--dtype",
              "float32"]
    eager = runner.invoke(app, [*common, "-O", "0"])
    assert "compiled the decode step" not in caplog.text
    compiled = runner.invoke(app, [*common, "-O", "3"])
    assert eager.exit_code == 0 and compiled.exit_code == 0, compiled.output
    assert "compiled the decode step of batch size 1" in caplog.text
    assert compiled.stdout == eager.stdout


def test_chat_reset_says_so(checkpoint) -> None:
    out = runner.invoke(app, ["chat", "--model", checkpoint, "--max-tokens", "2"],
                        input="hello\n/reset\n")
    assert out.exit_code == 0, out.output
    assert "(conversation cleared)" in out.output


def test_chat_commands_are_never_sent_to_the_model_and_turns_are_separated(checkpoint):
    """/help lists the commands, an unknown /word says so, /exit quits before the last
    line; only the two messages reach the model, each reply ends with a rule."""
    out = runner.invoke(app, ["chat", "--model", checkpoint, "--max-tokens", "3",
                              "--temperature", "0"],
                        input="/help\nhello\n/nonsense here\nagain\n/exit\nnever sent\n")
    assert out.exit_code == 0, out.output
    for command in ("/help", "/reset", "/exit"):
        assert f"  {command} " in out.output, out.output
    assert "unknown command /nonsense; /help lists the commands" in out.output
    assert out.output.count("─" * 40) == 2, out.output
    llm = LLM(checkpoint, dtype="float32")
    first = llm.chat([{"role": "user", "content": "hello"}],
                     SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].text
    assert first in out.output.split("─" * 40)[0]


def test_prepare_prints_the_route_once(checkpoint) -> None:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "archserve.cli.main", "prepare", "--model",
                          checkpoint, "--max-model-len", "128"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert text.count("route attention:") == 1, text
    assert "start-up timings:" in out.stdout


def test_the_engine_and_cli_run_on_a_cpu_without_triton(checkpoint) -> None:
    """Triton is not a dependency of archserve (only of its tests): with it absent, the
    hardware commands and a generation on the CPU work."""
    import subprocess
    import sys
    hide = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None; "
            "sys.argv = ['archserve'] + sys.argv[1:]; from archserve.cli.main import app; app()")
    for args in (["doctor"], ["explain", "-d", "h100"], ["matrix"],
                 ["generate", PROMPT, "--model", checkpoint, "--max-tokens", "4"]):
        out = subprocess.run([sys.executable, "-c", hide, *args], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, (args, out.stderr[-2000:])


def test_explain_never_cuts_a_backend_name_at_80_columns() -> None:
    out = runner.invoke(app, ["explain", "-d", "h100"], terminal_width=80,
                        env={"COLUMNS": "80"})
    # Folded onto a second line if it must be, never cut to an ellipsis.
    assert out.exit_code == 0 and "…" not in out.output and "TRITON_SKINNY_GEM" in out.output
