"""Tool calling: tools into the prompt, the grammar that enforces a call, calls out of text.

Formats, chosen from the model's chat template:

- ``hermes``: calls are ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
  (Qwen 2.5/3, Hermes, and any template that knows nothing of tools: the tools are then
  described in a system message written here, in that format);
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (Llama 3.1+
  templates that take ``tools`` and have no tag of their own).

``tool_choice`` ``required`` or a named function compiles to an xgrammar structural tag,
so the output *is* a call whose arguments validate against the function's schema.
``ToolCallParser`` reads calls incrementally: the streaming and the non-streaming
responses come from the same parser, so they agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from archserve.serve.errors import OpenAIError
from archserve.structured import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai_dict(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


def parse_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    out: list[Tool] = []
    for i, t in enumerate(tools or []):
        param = f"tools[{i}]"
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise OpenAIError("each tool must be {\"type\": \"function\", \"function\": {...}}",
                              param=param)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise OpenAIError("function.name must be 1-64 letters, digits, '_', '-' or '.'",
                              param=f"{param}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise OpenAIError("function.parameters must be a JSON schema object",
                              param=f"{param}.function.parameters")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise OpenAIError("function.description must be a string",
                              param=f"{param}.function.description")
        out.append(Tool(name, desc, params))
    if len({t.name for t in out}) != len(out):
        raise OpenAIError("function names must be unique", param="tools")
    return out


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its output."""

    tools: list[Tool]              # described in the prompt ([] when tool_choice is none)
    mode: str                      # "none", "auto", "required" or "named"
    format: str = "hermes"
    named: str | None = None

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none" and bool(self.tools)


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any,
               chat_template: str | None) -> ToolPlan:
    parsed = parse_tools(tools)
    fmt = tool_format(chat_template)
    if tool_choice is None:
        tool_choice = "auto" if parsed else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise OpenAIError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}',
                              param="tool_choice")
        if name not in {t.name for t in parsed}:
            raise OpenAIError(f"tool_choice names {name!r}, which is not among the tools",
                              param="tool_choice")
        return ToolPlan([t for t in parsed if t.name == name], "named", fmt, name)
    if tool_choice not in ("none", "auto", "required"):
        raise OpenAIError('tool_choice must be "none", "auto", "required" or a named function',
                          param="tool_choice")
    if tool_choice != "none" and not parsed:
        if tool_choice == "required":
            raise OpenAIError('tool_choice "required" needs tools', param="tool_choice")
        return ToolPlan([], "none", fmt)
    return ToolPlan(parsed if tool_choice != "none" else [], tool_choice, fmt)


def tool_format(chat_template: str | None) -> str:
    template = chat_template or ""
    if HERMES_BEGIN in template or "tools" not in template:
        return "hermes"
    return "llama3_json"


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


# -- the prompt ---------------------------------------------------------------------------

def _hermes_system_prompt(tools: list[Tool]) -> str:
    listing = "\n".join(json.dumps(t.openai_dict(), ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures, as JSON schemas, are inside "
            f"<tools></tools>:\n<tools>\n{listing}\n</tools>\n"
            "To call a function, write a JSON object with its name and arguments inside "
            "<tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n'
            "</tool_call>")


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def messages_for_template(messages: list[dict[str, Any]], plan: ToolPlan,
                          chat_template: str | None) -> tuple[list[dict[str, Any]], dict]:
    """(messages, extra template kwargs) that put the tools and the tool history in the
    prompt, natively where the template takes ``tools``, in hermes form otherwise."""
    native = template_takes_tools(chat_template)
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if native:
            if calls:
                m["tool_calls"] = [
                    {**c, "function": {**c.get("function", {}), "arguments":
                                       _arguments_object(c.get("function", {}).get("arguments"))}}
                    for c in calls]
        else:
            if calls:
                blocks = [f"{HERMES_BEGIN}\n" + json.dumps(
                    {"name": c.get("function", {}).get("name"),
                     "arguments": _arguments_object(c.get("function", {}).get("arguments"))},
                    ensure_ascii=False) + f"\n{HERMES_END}" for c in calls]
                m["content"] = "\n".join(x for x in [m.get("content") or "", *blocks] if x)
                m.pop("tool_calls")
            if m.get("role") == "tool":
                m = {"role": "user",
                     "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    if not plan.tools:
        return out, {}
    if native:
        return out, {"tools": [t.openai_dict() for t in plan.tools]}
    prompt = _hermes_system_prompt(plan.tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".strip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


# -- the grammar --------------------------------------------------------------------------

def tool_grammar(plan: ToolPlan, parallel: bool) -> StructuredOutputsParams | None:
    """The structural tag that makes the output one (or more) calls, for required/named."""
    if plan.mode not in ("required", "named"):
        return None
    if plan.format == "hermes":
        begin, end, key, sep = HERMES_BEGIN + "\n", "}\n" + HERMES_END, "arguments", "\n"
    else:
        begin, end, key, sep = "", "}", "parameters", "; "
    tags = [{"type": "tag",
             "begin": f'{begin}{{"name": {json.dumps(t.name)}, "{key}": ',
             "content": {"type": "json_schema", "json_schema": t.parameters},
             "end": end} for t in plan.tools]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": sep,
           "at_least_one": True, "stop_after_first": plan.mode == "named" or not parallel}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})


# -- parsing ------------------------------------------------------------------------------

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    index: int
    id: str
    name: str | None = None
    arguments: str = ""
    start: int = 0                 # where its block's text starts in the output
    args_start: int = 0            # where its arguments start in the block
    done: bool = False


@dataclass
class ParserEvents:
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)   # OpenAI delta tool_calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_NAME_FIELD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class ToolCallParser:
    """Reads one choice's output text as it grows; ``feed`` returns what is new.

    Content before, between and after calls is the output's text outside the blocks,
    with leading and trailing whitespace dropped. A call's name is sent once known, then
    its arguments (the model's own JSON text) as they arrive.
    """

    def __init__(self, fmt: str = "hermes") -> None:
        self.format = fmt
        self.calls: list[ParsedCall] = []
        self._pos = 0                 # text consumed
        self._content_started = False
        self._pending_ws = ""         # whitespace held until more content follows
        self._in_block: ParsedCall | None = None
        self._decoder = json.JSONDecoder()

    @property
    def complete_calls(self) -> list[ParsedCall]:
        """The calls with a name and a whole JSON object of arguments."""
        out = []
        for call in self.calls:
            if call.name is None:
                continue
            try:
                if isinstance(json.loads(call.arguments), dict):
                    out.append(call)
            except ValueError:
                pass
        return out

    def feed(self, text: str, final: bool = False) -> ParserEvents:
        ev = ParserEvents()
        if self.format == "llama3_json":
            return self._feed_json(text, final, ev)
        while True:
            if self._in_block is None:
                i = text.find(HERMES_BEGIN, self._pos)
                if i < 0:
                    end = len(text) if final else len(text) - _partial_suffix(
                        text[self._pos:], HERMES_BEGIN)
                    self._content(text[self._pos:end], ev, final)
                    self._pos = max(self._pos, end)
                    return ev
                self._content(text[self._pos:i], ev, False)
                call = ParsedCall(len(self.calls), new_call_id(), start=i + len(HERMES_BEGIN))
                self.calls.append(call)
                self._in_block = call
                self._pos = call.start
            call = self._in_block
            close = text.find(HERMES_END, call.start)
            body_end = close if close >= 0 else len(text)
            self._advance_call(call, text[call.start:body_end], close >= 0, final, ev)
            if close < 0:
                self._pos = len(text) if final else self._pos
                return ev
            self._in_block = None
            self._pos = close + len(HERMES_END)

    def _content(self, piece: str, ev: ParserEvents, final: bool) -> None:
        if not self._content_started:
            piece = piece.lstrip()
            if not piece:
                return
            self._content_started = True
        piece = self._pending_ws + piece
        stripped = piece.rstrip()
        self._pending_ws = "" if final else piece[len(stripped):]
        ev.content += stripped

    def _advance_call(self, call: ParsedCall, body: str, closed: bool, final: bool,
                      ev: ParserEvents) -> None:
        if call.name is None:
            m = _NAME_FIELD.match(body)
            if m is None:
                if closed:   # not a call after all: its text is content
                    self._fallback(call, body, ev)
                elif final:  # a call cut off before its name (max_tokens): nothing to show
                    self.calls.remove(call)
                return
            try:
                call.name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                self._fallback(call, body, ev)
                return
            call.args_start = m.end()
            ev.calls.append({"index": call.index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}})
        args_text = body[call.args_start:].lstrip()
        if closed or final:
            try:
                _, end = self._decoder.raw_decode(args_text)
                args_text = args_text[:end]
            except ValueError:
                args_text = args_text.rstrip().removesuffix("}").rstrip()
            call.done = True
        else:
            cut = len(args_text) - _partial_suffix(args_text, HERMES_END)
            args_text = args_text[:cut].rstrip(" \t\r\n}")
        if len(args_text) > len(call.arguments) and args_text.startswith(call.arguments):
            ev.calls.append({"index": call.index,
                             "function": {"arguments": args_text[len(call.arguments):]}})
            call.arguments = args_text

    def _fallback(self, call: ParsedCall, body: str, ev: ParserEvents) -> None:
        self.calls.remove(call)
        self._content(HERMES_BEGIN + body, ev, False)

    def _feed_json(self, text: str, final: bool, ev: ParserEvents) -> ParserEvents:
        """Llama 3 style: the whole answer is the call(s), so it is read at the end."""
        head = text.lstrip().removeprefix("<|python_tag|>").lstrip()
        looks_like_call = head.startswith("{") or (not final and "{".startswith(head[:1]))
        if not looks_like_call:
            self._content(text[self._pos:], ev, final)
            self._pos = len(text)
            return ev
        if not final:
            return ev
        pos, calls = 0, []
        while pos < len(head):
            try:
                obj, end = self._decoder.raw_decode(head, pos)
            except ValueError:
                calls = []
                break
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
                calls = []
                break
            calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
            pos = end
            while pos < len(head) and head[pos] in " \t\r\n;":
                pos += 1
        if not calls:
            self._content(text, ev, True)
            return ev
        for name, args in calls:
            call = ParsedCall(len(self.calls), new_call_id(), name, args, done=True)
            self.calls.append(call)
            ev.calls.append({"index": call.index, "id": call.id, "type": "function",
                             "function": {"name": name, "arguments": args}})
        return ev
