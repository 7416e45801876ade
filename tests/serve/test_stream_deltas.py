"""Streams are built from the engine's deltas: no step copies what was already sent."""

from archserve.engine.sampling_params import RequestOutputKind
from archserve.serve.protocol import ChatCompletionRequest, CompletionRequest
from archserve.serve.sampling import sampling_params_for
from archserve.serve.streams import PendingTokens


def test_streamed_requests_take_deltas_and_plain_ones_only_the_end():
    bodies = [(CompletionRequest, {"prompt": "x"}),
              (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})]
    for request, body in bodies:
        for stream, kind in ((True, RequestOutputKind.DELTA),
                             (False, RequestOutputKind.FINAL_ONLY)):
            req = request(model="m", stream=stream, **body)
            assert sampling_params_for(req, 8, None, None, 100).output_kind is kind


def test_tokens_without_text_wait_for_the_chunk_that_carries_it():
    pending = PendingTokens()
    pending.add([7], [{"lp": 1}])          # half a character: no text yet
    pending.add([8], [{"lp": 2}])
    assert pending.take("é") == ([7, 8], [{"lp": 1}, {"lp": 2}], 0)
    pending.add([9], None)
    assert pending.take("ab") == ([9], [], 1)
    assert pending.num_tokens == 3 and pending.text_sent == 3
