"""Tool calls in chat completions: OpenAI's `tools` with `tool_choice`.

`tool_choice` "required" (one of the tools) or a named function holds the reply to a JSON call,
{"name": ..., "arguments": {...}}, by the grammar of the tools' parameter schemas
(meshlab.infer.guided), and returns it as the message's `tool_calls` (finish_reason "tool_calls");
"none" answers in text. "auto" (OpenAI's default when tools are sent) would need the model's own
tool-call format read back out of free text (each model family writes its own), so it is refused
with a 400 that names the choices that work. The tools reach the prompt through the checkpoint's
chat template (its `tools` variable), or, without one, a `tools:` line before the messages; tool
results come back as messages of role "tool", and an assistant message may carry `tool_calls`.
"""
from __future__ import annotations

import dataclasses
import json
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
        raise ToolError('`tool_choice` "auto" (the default with tools) is not supported: the model\'s own tool-call '
                        'format is not read back; send "required", {"type": "function", "function": {"name": ...}} '
                        'or "none"', "tool_choice")
    if choice == "none":
        return ToolChoice(tools)
    if choice == "required":
        return ToolChoice(tools, functions)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise ToolError(f'`tool_choice` must be "none", "required" or {{"type": "function", "function": {{"name": '
                        f'one of {[f["name"] for f in functions]}}}}}', "tool_choice")
    return ToolChoice(tools, named)


def tool_calls(text: str) -> Optional[list]:
    """The message's tool_calls for a reply held to a ToolChoice grammar, or None when the text is not
    a whole call (the reply ran out of max_tokens first)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not {"name", "arguments"} <= set(call):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]


def plain_tools_line(tools: list) -> str:
    """The tools as a prompt line, for tokenizers without a chat template."""
    return "tools: " + json.dumps([t["function"] for t in tools])
