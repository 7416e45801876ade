"""SIGTERM with requests still running past --shutdown-timeout: every open request ends as
an OpenAI client expects (a stream with a final finish_reason "abort" chunk and [DONE], a
non-streaming request with a 503 error object), the log says what happened, and the
process exits 0."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.serve.conftest import read_metrics, start_server

# Far more tokens than a CPU generates in the one-second shutdown timeout.
LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0}


def _events(lines) -> list:
    """The SSE payloads of a stream: decoded JSON objects, and the string "[DONE]"."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_sigterm_past_the_shutdown_timeout_ends_every_request_openai_shaped(tmp_path):
    srv = start_server(tmp_path / "server.log", "--max-num-seqs", "4",
                       "--shutdown-timeout", "1")
    url = srv.url
    plain: dict = {}

    def non_streaming() -> None:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Count:", **LONG},
                       timeout=120)
        plain["status"], plain["text"] = r.status_code, r.text

    try:
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", f"{url}/v1/completions",
                             json={"prompt": "Say something:", "stream": True,
                                   "stream_options": {"include_usage": True}, **LONG}
                             ) as completion, \
                    http.stream("POST", f"{url}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "Hi"}],
                                      "stream": True, **LONG}) as chat:
                completion_lines, chat_lines = completion.iter_lines(), chat.iter_lines()
                first = [next(completion_lines), next(chat_lines)]
                worker = threading.Thread(target=non_streaming)
                worker.start()
                deadline = time.monotonic() + 60
                while read_metrics(url)["archserve:num_requests_running"] < 3:
                    assert time.monotonic() < deadline, "the three requests never ran"
                    time.sleep(0.05)
                srv.process.terminate()
                completion_events = _events([first[0], *completion_lines])
                chat_events = _events([first[1], *chat_lines])
        worker.join(60)
        assert srv.process.wait(60) == 0, srv.log
    finally:
        srv.stop()
    for events in (completion_events, chat_events):
        assert events[-1] == "[DONE]", events[-3:]
        finishing = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
        assert [e["choices"][0]["finish_reason"] for e in finishing] == ["abort"], events[-4:]
    usage = completion_events[-2]["usage"]          # include_usage still closes the stream
    assert 0 < usage["completion_tokens"] < LONG["max_tokens"]
    assert plain["status"] == 503, plain
    error = json.loads(plain["text"])["error"]
    assert error["code"] == 503 and "shut" in error["message"], error
    log = srv.log
    assert "Traceback" not in log, log
    assert "disconnected" not in log, log
    assert "shutdown timeout" in log and "3 request(s) still running" in log, log
