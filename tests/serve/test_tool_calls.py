"""Tool calling: the parsers (hermes, Llama 3 JSON) alone, then tools, tool_choice and
streamed tool_calls through the openai client against a real server."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from archserve.serve.tool_calls import ToolCallParser, plan_tools, tool_format

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"type": "string", "enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 8}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed_calls(parser: ToolCallParser, text: str, step: int) -> tuple[str, list[dict]]:
    """Feed ``text`` ``step`` characters at a time; assemble the deltas as a client does."""
    content, calls = "", {}
    for end in range(step, len(text) + step, step):
        ev = parser.feed(text[:end], final=end >= len(text))
        content += ev.content
        for d in ev.calls:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d["function"].get("name") or call["name"]
            call["arguments"] += d["function"].get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_stream_as_they_parse_whole(step):
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris", "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
            '"arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = _streamed_calls(ToolCallParser("hermes"), text, step)
    assert content == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris", "unit": "C"},
                                                          {"zone": "CET"}]
    whole = ToolCallParser("hermes")
    whole.feed(text, final=True)
    assert [(c.name, c.arguments) for c in whole.complete_calls] == [
        (c["name"], c["arguments"]) for c in calls]


def test_hermes_text_without_a_call_and_a_cut_off_call():
    content, calls = _streamed_calls(ToolCallParser("hermes"), "Just text <tool", 2)
    assert content == "Just text <tool" and calls == []
    cut = ToolCallParser("hermes")
    cut.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', final=True)
    assert [c.name for c in cut.calls] == ["get_weather"] and cut.complete_calls == []


def test_a_call_that_does_not_parse_is_text_and_not_a_tool_calls_finish():
    """A closed call whose arguments are no JSON object, then a normal stop: no
    tool_calls, the raw text as content, and finish_reason "stop", not "tool_calls"
    (vLLM says tool_calls only for calls that parsed)."""
    from types import SimpleNamespace

    from archserve.engine.outputs import CompletionOutput
    from archserve.serve.chat import _ChatView
    from archserve.serve.tool_calls import ToolPlan

    text = '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>'
    req = SimpleNamespace(messages=[SimpleNamespace(role="user")], echo=False,
                          add_generation_prompt=True)
    view = _ChatView(SimpleNamespace(), req, "id", [1, 2], "model",
                     ToolPlan([WEATHER["function"]], "auto", "hermes"))
    message, finish = view._message(CompletionOutput(index=0, text=text, token_ids=[1],
                                                     cumulative_logprob=None, logprobs=None,
                                                     finish_reason="stop"))
    assert message.tool_calls is None and message.content == text and finish == "stop"


def test_llama3_json_calls():
    parser = ToolCallParser("llama3_json")
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parser.feed(text[:10]).calls == []          # read whole at the end
    ev = parser.feed(text, final=True)
    assert [c["function"]["name"] for c in ev.calls] == ["get_weather"]
    assert json.loads(parser.complete_calls[0].arguments) == {"city": "Oslo"}
    plain = ToolCallParser("llama3_json")
    assert plain.feed("Hello there", final=True).content == "Hello there"


def test_the_format_follows_the_chat_template():
    qwen = "{% for tool in tools %}{{ tool }}{% endfor %}<tool_call>\n{{ call }}</tool_call>"
    llama = ('{%- if tools is not none %}Given the following functions, respond with a '
             'JSON for a function call{%- endif %}')
    smollm2 = "{% for message in messages %}<|im_start|>{{ message['content'] }}{% endfor %}"
    assert tool_format(qwen) == "hermes"
    assert tool_format(llama) == "llama3_json"
    assert tool_format(smollm2) == "hermes"     # no tools in the template: hermes prompt
    assert plan_tools([WEATHER], None, smollm2).mode == "auto"


# -- through the server ---------------------------------------------------------------

def _check_call(call, tool):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_function_is_called_streaming_and_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                  tools=[WEATHER, TIME], tool_choice=named)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], WEATHER)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == choice.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_makes_one_call_among_the_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64,
                                       temperature=0, tools=[TIME, WEATHER],
                                       tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_call(calls[0], {t["function"]["name"]: t for t in (TIME, WEATHER)}[
        calls[0].function.name])


def test_a_call_cut_off_by_max_tokens_keeps_its_text(client):
    """A call max_tokens cuts off has no whole arguments: no tool_calls, and the text the
    model wrote is the content (as vLLM returns text it cannot parse), not nothing."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16,
                                       temperature=0, tools=[WEATHER],
                                       tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content and "get_weather" in choice.message.content
    assert r.usage.completion_tokens == 16


def test_auto_and_none_put_tools_in_the_prompt_or_leave_them_out(client):
    base = dict(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**base)
    auto = client.chat.completions.create(tools=[WEATHER], **base)
    none = client.chat.completions.create(tools=[WEATHER], tool_choice="none", **base)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens   # tools described
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_a_tool_result_conversation_renders(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4,
                                       temperature=0, tools=[WEATHER])
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
     "tools[0].function.name"),
    (dict(tools=[WEATHER], tool_choice="required",
          response_format={"type": "json_object"}), "response_format"),
])
def test_bad_tool_requests_are_a_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param, info.value.body


@pytest.fixture(scope="module")
def grammar_compiler(embedded_model_path):
    from archserve.loader.tokenizer import load_tokenizer
    from archserve.structured import GrammarCompiler
    tokenizer = load_tokenizer(embedded_model_path)
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
               '</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
])
def test_the_required_grammar_accepts_what_the_parser_reads(grammar_compiler, fmt, text):
    """The grammar of tool_choice required/named and the parser agree on the format."""
    import xgrammar as xgr

    from archserve.serve.tool_calls import ToolPlan, parse_tools, tool_grammar
    tokenizer, compiler = grammar_compiler
    tools = parse_tools([WEATHER, TIME])
    for plan in (ToolPlan(tools, "required", fmt), ToolPlan(tools[:1], "named", fmt,
                                                             "get_weather")):
        matcher = xgr.GrammarMatcher(compiler.compile(tool_grammar(plan, parallel=False)))
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(token), (plan.mode, tokenizer.decode([token]))
        assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
        bad = xgr.GrammarMatcher(compiler.compile(tool_grammar(plan, parallel=False)))
        wrong = text.replace('"city"', '"town"')   # not the function's parameters
        assert not all(bad.accept_token(t)
                       for t in tokenizer.encode(wrong, add_special_tokens=False))
    parser = ToolCallParser(fmt)
    parser.feed(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parser.complete_calls] == [
        ("get_weather", {"city": "Oslo"})]


def test_native_templates_get_tools_and_object_arguments():
    from archserve.serve.tool_calls import messages_for_template
    qwen_like = "{% if tools %}{{ tools }}{% endif %}<tool_call>"
    plan = plan_tools([WEATHER], "auto", qwen_like)
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]
    messages, extra = messages_for_template(history, plan, qwen_like)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    plain, extra = messages_for_template(
        history + [{"role": "tool", "content": "21C"}], plan, "{{ messages }}")
    assert extra == {} and plain[0]["role"] == "system" and "<tools>" in plain[0]["content"]
    assert "<tool_call>" in plain[1]["content"] and plain[2] == {
        "role": "user", "content": "<tool_response>\n21C\n</tool_response>"}
