"""Stream one request's text as it is generated (for terminals; the server has its own loop)."""

from __future__ import annotations

from collections.abc import Iterator

from archserve.engine.llm_engine import LLMEngine
from archserve.engine.outputs import RequestOutput
from archserve.engine.sampling_params import SamplingParams


def stream_text(engine: LLMEngine, prompt: str | list[int], params: SamplingParams
                ) -> Iterator[tuple[str, RequestOutput]]:
    """Yield (new text, latest output) for a single-sequence request until it finishes."""
    request_id = engine.add_request(None, prompt, params)
    sent = 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                yield text[sent:], output
                sent = len(text)
                if output.finished:
                    return
    finally:
        engine.abort_request(request_id)  # no-op when finished; frees blocks on Ctrl-C
