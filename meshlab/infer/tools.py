"""Tool calls in chat completions: OpenAI's `tools` with `tool_choice`.

`tool_choice` "required" (one of the tools) or a named function holds the reply to a JSON call,
{"name": ..., "arguments": {...}}, by the grammar of the tools' parameter schemas
(meshlab.infer.guided), and returns it as the message's `tool_calls` (finish_reason "tool_calls", or
"stop" for a named function, as OpenAI and vLLM answer it; a call cut short by max_tokens is no call and
shows none of its JSON: finish_reason "length", content empty, meshlab.infer.api_responses.ToolCallParams);
"none" answers in text. "auto" (OpenAI's default when tools are sent) lets the model answer freely
and reads its calls back out of the text in the format its family writes (`ToolFormat`: bare
JSON objects, Llama 3's included; Hermes / Qwen's <tool_call> blocks; Mistral's [TOOL_CALLS] list),
picked from the chat template or named by `serve.py --tool-call-parser` (a held call is read back as
bare JSON). A call of a function the request did not offer, or text that does not parse, stays the
message's content. A stream sends the text before a call as it comes and holds back what may open
one. The tools reach the prompt through the checkpoint's chat template (its `tools` variable), or,
without one, a `tools:` line before the messages; tool results come back as messages of role
"tool", and an assistant message may carry `tool_calls`.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Optional


class ToolError(ValueError):
    """A bad `tools` or `tool_choice` (the API answers 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class ToolChoice:
    tools: list                       # the request's tools, as sent (the chat template renders them)
    call: Optional[list] = None       # the functions a reply must call one of; None: a text reply
    auto: bool = False                # tool_choice "auto": the reply may call the tools in the model's own format

    @property
    def names(self) -> set:
        return {t["function"]["name"] for t in self.tools}

    def grammar(self) -> Optional[str]:
        """The reply's grammar: one JSON call of a function in `call` (its name, its parameters' schema)."""
        if self.call is None:
            return None
        from meshlab.infer.guided import json_grammar
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in self.call]
        return json_grammar(calls[0] if len(calls) == 1 else {"anyOf": calls})


def _function(tool, i: int) -> dict:
    f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                        '{...}}}', "tools")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return {"name": f["name"], "parameters": params}


def parse_tools(tools, choice) -> Optional[ToolChoice]:
    """A chat request's tools and tool_choice, checked (raises ToolError); None when it has none."""
    if tools is None:
        if choice is not None and choice != "none":
            raise ToolError("`tool_choice` needs `tools`", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolError("`tools` must be a non-empty list of functions", "tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    if choice in (None, "auto"):
        return ToolChoice(tools, auto=True)
    if choice == "none":
        return ToolChoice(tools)
    if choice == "required":
        return ToolChoice(tools, functions)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise ToolError(f'`tool_choice` must be "auto", "none", "required" or {{"type": "function", "function": {{"name": '
                        f'one of {[f["name"] for f in functions]}}}}}', "tool_choice")
    return ToolChoice(tools, named)


def _call(name: str, arguments) -> dict:
    """One entry of a message's tool_calls; arguments as a JSON string (OpenAI's form)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


# -- tool_choice "auto": calls read back out of free text ------------------------------------------
def _json_calls(text: str, names: set) -> Optional[list]:
    """Every call in text made only of JSON calls ({"name", "arguments" or Llama 3's "parameters"},
    or a list of them), separated by blanks, ';' or ','; None when anything else is in it or a
    name is not one of the request's tools."""
    decoder, at, calls = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at == len(text):
            break
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        for c in value if isinstance(value, list) else [value]:
            args = c.get("arguments", c.get("parameters")) if isinstance(c, dict) else None
            if not isinstance(args, (dict, str)) or c.get("name") not in names:
                return None
            calls.append(_call(c["name"], args))
    return calls or None


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """How a model family writes its tool calls into a reply (read back under tool_choice "auto")."""
    name: str
    markers: tuple          # text that opens the calls
    leading: bool           # True: calls only make up a whole reply; False: they may follow some text

    def _first_marker(self, text: str) -> int:
        """Where the first marker in text starts, or -1."""
        return min((i for i in (text.find(m) for m in self.markers) if i >= 0), default=-1)

    def streamable(self, text: str) -> int:
        """How much of a reply so far is content for sure: the text before where a call opens or may."""
        if self.leading:
            head = text.lstrip()
            return 0 if any(m.startswith(head) or head.startswith(m) for m in self.markers) else len(text)
        found = self._first_marker(text)
        if found >= 0:
            return found
        held = max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        return len(text) - held

    def read(self, text: str, names: set) -> tuple[Optional[str], Optional[list]]:
        """(content, tool_calls) of a whole reply: with calls, the content is the text before them
        (None when blank; as streamed, less trailing blanks); without (none there, or they do not
        parse or name no offered tool), (text, None)."""
        if self.leading:
            cut, body = 0, text.strip().removeprefix("<|python_tag|>")
        else:
            cut = self._first_marker(text)
            if cut < 0:
                return text, None
            if self.name == "hermes":  # <tool_call>{...}</tool_call> blocks, the last one's closing tag optional
                body = ";".join(re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[cut:], flags=re.S))
            else:
                body = text[cut:].removeprefix(self.markers[0])
        calls = _json_calls(body, names)
        if calls is None:
            return text, None
        return (text[:cut].rstrip() or None), calls


TOOL_FORMATS = {
    "json": ToolFormat("json", ("<|python_tag|>", "{", "["), leading=True),   # bare JSON calls; Llama 3's too
    "hermes": ToolFormat("hermes", ("<tool_call>",), leading=False),          # Hermes, Qwen 2.5 / 3
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), leading=False),       # Mistral's [TOOL_CALLS][{...}]
}


def tool_format(name: str, chat_template=None) -> ToolFormat:
    """The ToolFormat named (serve.py --tool-call-parser), or for "auto" the one the checkpoint's
    chat template writes calls in (its source names the markers), else bare JSON: the format of
    tool_choice "required" and of the plain tools line."""
    if name != "auto":
        if name not in TOOL_FORMATS:
            raise ValueError(f"tool-call parser {name!r} must be auto or one of {sorted(TOOL_FORMATS)}")
        return TOOL_FORMATS[name]
    source = getattr(chat_template, "source", "") or ""
    return next((f for f in TOOL_FORMATS.values() if not f.leading and f.markers[0] in source), TOOL_FORMATS["json"])


def plain_tools_line(tools: list) -> str:
    """The tools as a prompt line, for tokenizers without a chat template."""
    return "tools: " + json.dumps([t["function"] for t in tools])
