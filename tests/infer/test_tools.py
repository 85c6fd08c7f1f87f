"""tool_choice "auto": calls read back out of a reply in each model family's format, whole and streamed
(the server's Call over replies written here, so every format and split point is exercised)."""
import json
import types

import pytest

from meshlab.infer import api
from meshlab.infer.http_call import Call
from meshlab.infer.sampler import SamplingParams
from meshlab.infer.tools import TOOL_FORMATS, ToolError, parse_tools, tool_format
from meshlab.tokenizer import ByteTokenizer

NAMES = {"weather", "clock"}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("json", '{"name": "weather", "arguments": {"city": "Oslo"}}', None, [("weather", {"city": "Oslo"})]),
    ("json", '<|python_tag|>{"name": "clock", "parameters": {"utc": true}}; {"name": "weather", "parameters": {}}',
     None, [("clock", {"utc": True}), ("weather", {})]),
    ("json", '[{"name": "clock", "arguments": "{\\"utc\\": false}"}]', None, [("clock", {"utc": False})]),
    ("json", 'It is {"name": "clock", "arguments": {}}', 'It is {"name": "clock", "arguments": {}}', None),
    ("json", '{"name": "rm", "arguments": {}}', '{"name": "rm", "arguments": {}}', None),       # not offered
    ("json", '{"name": "clock", "arguments": {}} and more', '{"name": "clock", "arguments": {}} and more', None),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>{"name": "clock", "arguments": {"utc": true}}', "Let me check.",
     [("weather", {"city": "Oslo"}), ("clock", {"utc": True})]),
    ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>',
     '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>', None),                 # cut short
    ("hermes", "no tools needed", "no tools needed", None),
    ("mistral", '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Rome"}}]', None,
     [("weather", {"city": "Rome"})]),
])
def test_formats_read_calls_and_leave_the_rest_as_content(fmt, text, content, calls):
    got_content, got = TOOL_FORMATS[fmt].read(text, NAMES)
    assert got_content == content
    if calls is None:
        assert got is None
        return
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
    assert len({c["id"] for c in got}) == len(got)


def test_the_format_follows_the_chat_template_or_the_flag():
    template = lambda source: types.SimpleNamespace(source=source)   # noqa: E731
    assert tool_format("auto", template("{{ '<tool_call>' }}")).name == "hermes"
    assert tool_format("auto", template("[TOOL_CALLS]")).name == "mistral"
    assert tool_format("auto", template("<|python_tag|>")).name == "json"
    assert tool_format("auto", None).name == "json"
    assert tool_format("hermes", template("[TOOL_CALLS]")).name == "hermes"
    with pytest.raises(ValueError, match="tool-call parser 'xml'"):
        tool_format("xml")
    choice = parse_tools([WEATHER], None)                  # OpenAI's default with tools: auto
    assert choice.auto and choice.call is None and choice.names == {"weather"}
    with pytest.raises(ToolError, match='"auto"'):
        parse_tools([WEATHER], "sometimes")


class _Reply:
    """A request whose reply is written by the test, one byte-token at a time."""

    def __init__(self, text):
        self.full, self.output, self.finish_reason, self.text_stop = text, [], "stop", None
        self.params, self.logprobs = SamplingParams(), []

    @property
    def text(self):
        return "".join(map(chr, self.output))

    def decoded(self, k):
        return "".join(map(chr, self.output[:k]))


def _call(fmt: str, text: str, plan=None):
    plan = plan or api.Plan([[1]], [""], [None], chat=True, stream=True, tool_format=TOOL_FORMATS[fmt],
                            tool_names=frozenset(NAMES))
    call = Call.__new__(Call)
    call.server, call.plan, call.n = types.SimpleNamespace(model_name="m"), plan, 1
    call.reqs, call.shown, call.lp_sent, call.counted, call.echoed = [_Reply(text)], [0], [0], [0], [False]
    call.id, call.created, call.head = "x", 0, 'data: {"choices": ['
    return call


def _stream(call) -> list:
    """The choice's chunks as its reply grows a character at a time, then ends."""
    r, chunks = call.reqs[0], []
    for ch in r.full:
        r.output.append(ord(ch))
        c = call._delta(0, False)
        chunks += [c] if c else []
    chunks.append(call._delta(0, True))
    return [json.loads(e[6:])["choices"][0] for c in chunks for e in c.decode().split("\n\n") if e]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", 'Checking <tool>s first.\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    ("json", ' {"name": "clock", "arguments": {"utc": true}}'),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "clock", "arguments": {}}]'),
])
def test_a_stream_sends_the_text_before_a_call_and_then_the_call(fmt, text):
    call = _call(fmt, text)
    chunks = _stream(call)
    content, calls = TOOL_FORMATS[fmt].read(text, NAMES)
    streamed = "".join(c["delta"].get("content", "") for c in chunks)
    assert streamed.rstrip() == (content or "")
    marker = text.find(TOOL_FORMATS[fmt].markers[0 if fmt != "json" else 1])
    assert len(streamed) <= marker            # no piece of a marker or of the call's JSON went out as content
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls" and "content" not in last["delta"]
    assert [t["function"]["name"] for t in last["delta"]["tool_calls"]] == [c["function"]["name"] for c in calls]
    assert [t["index"] for t in last["delta"]["tool_calls"]] == list(range(len(calls)))
    whole = _call(fmt, text)
    whole.reqs[0].output = [ord(c) for c in text]
    msg = whole.whole()["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] == content
    assert json.loads(msg["message"]["tool_calls"][0]["function"]["arguments"]) == \
        json.loads(calls[0]["function"]["arguments"])


@pytest.mark.parametrize("fmt, text", [("hermes", "a <tool_cal"), ("hermes", "plain words"),
                                       ("json", "{not json at all"), ("json", "  words first")])
def test_a_stream_without_a_call_sends_all_its_text(fmt, text):
    chunks = _stream(_call(fmt, text))
    assert "".join(c["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["finish_reason"] == "stop" and all("tool_calls" not in c["delta"] for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(stream):
    """OpenAI's parallel_tool_calls false: at most one call, whichever way the reply comes back."""
    text = '{"name": "clock", "arguments": {"utc": true}}; {"name": "weather", "arguments": {}}'
    call = _call("json", text)
    call.plan.one_call = True
    if stream:
        calls = _stream(call)[-1]["delta"]["tool_calls"]
    else:
        call.reqs[0].output = [ord(c) for c in text]
        calls = call.whole()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["clock"]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    assert api.parse(dict(body, parallel_tool_calls=False), True, ByteTokenizer(), "m", 512, [256], 1).one_call
    assert not api.parse(body, True, ByteTokenizer(), "m", 512, [256], 1).one_call


@pytest.mark.parametrize("choice,finish", [({"type": "function", "function": {"name": "clock"}}, "stop"),
                                           ("required", "tool_calls")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_forced_by_name_finishes_stop(choice, finish, stream):
    """As OpenAI's and vLLM's: a call of the function tool_choice named ends "stop"; one the model picked
    under "required" (or "auto") ends "tool_calls"."""
    clock = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, clock], "tool_choice": choice,
            "stream": stream}
    plan = api.parse(body, True, ByteTokenizer(), "m", 512, [256], 1)
    text = '{"name": "clock", "arguments": {"utc": true}}'
    call = _call("json", text, plan)
    call.reqs[0].params = plan.params[0]
    if stream:
        last = _stream(call)[-1]
        calls = last["delta"]["tool_calls"]
    else:
        call.reqs[0].output = [ord(c) for c in text]
        last = call.whole()["choices"][0]
        calls = last["message"]["tool_calls"]
    assert last["finish_reason"] == finish and [c["function"]["name"] for c in calls] == ["clock"]
