"""The server's chat completions: streams, the default max_tokens, chat templates (the checkpoint's, a request's
own, their kwargs, a continued final message, echo), structured outputs (response_format, vLLM's
structured_outputs and guided_* fields, the grammars behind them) and tool calls."""
import json
import re

import pytest

from meshlab.infer import api
from meshlab.infer.server import Server
from meshlab.tokenizer import ByteTokenizer
from tests.infer.http_helpers import call, scrape, sse_text

pytestmark = [pytest.mark.xdist_group("server"), pytest.mark.cheap_codegen]   # the shared server: see test_server.py


def test_chat_stream_equals_whole(server):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "temperature": 0.8, "seed": 5}
    status, whole = call(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and whole["choices"][0]["message"]["role"] == "assistant"
    status, payload = call(server, "POST", "/v1/chat/completions", dict(body, stream=True))
    text, _ = sse_text(payload, chat=True)
    assert text == whole["choices"][0]["message"]["content"]


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(server):
    """OpenAI's chat default: no max_tokens means up to the context (the body above has a 126-token prompt)."""
    body = {"messages": [{"role": "user", "content": "x" * 110}], "stop": None}
    status, resp = call(server, "POST", "/v1/chat/completions", body)
    u = resp["usage"]
    assert status == 200 and u["prompt_tokens"] == len(ByteTokenizer().encode(f"user: {'x' * 110}\nassistant:"))
    assert resp["choices"][0]["finish_reason"] == "stop" or u["prompt_tokens"] + u["completion_tokens"] == 128


def test_chat_uses_the_tokenizers_template(server, templated_tokenizer):
    tok = templated_tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.chat_template(messages)
    assert text == "[B]<system>be brief<|eot|><user>hi<|eot|><assistant>"
    assert tok.encode(text).count(tok.stop_token_ids[0]) == 2          # the special token, not its letters
    old = server.tok, server.engine.detokenize
    server.tok, server.engine.detokenize = tok, tok.decode
    try:
        status, resp = call(server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 3})
    finally:
        server.tok, server.engine.detokenize = old
    assert status == 200 and resp["usage"]["prompt_tokens"] == len(tok.encode(text))


def test_a_requests_own_chat_template_needs_the_servers_trust(server, spare_engine):
    """vLLM's chat_template: a 400 naming --trust-request-chat-template from a server without it; from one
    with it, the request's template formats the messages (the prompt /tokenize counts and the one the
    reply is generated from), a template that does not compile or raises is a 400, and a request
    without one keeps the checkpoint's format."""
    messages = [{"role": "user", "content": "hi"}]
    mine = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
    status, err = call(server, "POST", "/v1/chat/completions", {"messages": messages, "chat_template": mine})
    assert status == 400 and "--trust-request-chat-template" in err["error"]["message"], err
    srv = Server(spare_engine, ByteTokenizer(), "tiny", "127.0.0.1", 0, trust_request_chat_template=True).start()
    try:
        count = lambda **kw: call(srv, "POST", "/tokenize", dict(messages=messages, **kw))[1]["count"]  # noqa: E731
        assert count(chat_template=mine) == len("[user]hi[bot]") and count() == len(api.plain_chat_prompt(messages))
        body = {"messages": messages, "max_tokens": 4, "temperature": 0, "chat_template": mine}
        status, chat = call(srv, "POST", "/v1/chat/completions", body)
        done = call(srv, "POST", "/v1/completions", {"prompt": "[user]hi[bot]", "max_tokens": 4, "temperature": 0})[1]
        assert status == 200 and chat["choices"][0]["message"]["content"] == done["choices"][0]["text"]
        for bad, words in (("{% for m in messages %}", "does not compile"), ("{{ raise_exception('no') }}", "refused"),
                           (7, "Jinja template string")):
            status, err = call(srv, "POST", "/v1/chat/completions", dict(body, chat_template=bad))
            assert status == 400 and words in err["error"]["message"] and err["error"]["param"] == "chat_template", err
    finally:
        srv.stop()


def test_chat_template_kwargs_reach_the_template(server, templated_tokenizer):
    """vLLM's chat_template_kwargs are the template's variables (as Qwen3's enable_thinking is): a
    template that reads one renders it; one that would replace messages or the special tokens, or a
    checkpoint without a template (the plain format has no variables), is a 400 naming the field."""
    from meshlab.infer.loading import ChatTemplate
    thinking = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                            "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}", {})
    messages = [{"role": "user", "content": "hi"}]
    assert thinking(messages, None, True, False, {"enable_thinking": False}) == "hi<no_think>"
    assert thinking(messages) == thinking(messages, None, True, False, {"enable_thinking": True}) == "hi"
    old = server.tok, server.engine.detokenize, templated_tokenizer.chat_template
    server.tok, server.engine.detokenize = templated_tokenizer, templated_tokenizer.decode
    try:
        body = {"messages": messages, "max_tokens": 2}
        assert call(server, "POST", "/v1/chat/completions", dict(body, chat_template_kwargs={"x": 1}))[0] == 200
        templated_tokenizer.chat_template = thinking
        count = lambda **kw: call(server, "POST", "/tokenize", dict(messages=messages, **kw))[1]["count"]  # noqa: E731
        assert count() == len(templated_tokenizer.encode("hi"))
        assert count(chat_template_kwargs={"enable_thinking": False}) == len(templated_tokenizer.encode("hi<no_think>"))
        templated_tokenizer.chat_template = old[2]
        for bad in ({"messages": []}, {"eos_token": "!"}, ["x"]):
            status, err = call(server, "POST", "/v1/chat/completions", dict(body, chat_template_kwargs=bad))
            assert status == 400 and err["error"]["param"] == "chat_template_kwargs", err
    finally:
        server.tok, server.engine.detokenize, templated_tokenizer.chat_template = old
    status, err = call(server, "POST", "/v1/chat/completions", dict(body, chat_template_kwargs={"x": 1}))
    assert status == 400 and "no chat template" in err["error"]["message"]


def test_chat_prefill_continues_the_last_message(server, templated_tokenizer):
    """vLLM's continue_final_message (add_generation_prompt false): the prompt ends right after the last
    (assistant) message's content, with no end-of-turn, and the reply continues it, as the same text
    sent as a completion would; add_generation_prompt false alone leaves the assistant's turn unopened.
    Through the checkpoint's template and the plain format."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello wor"}]
    tok = templated_tokenizer
    assert tok.chat_template(messages, None, False, True) == "[B]<user>hi<|eot|><assistant>hello wor"
    assert tok.chat_template(messages[:1], None, False) == "[B]<user>hi<|eot|>"
    assert api.plain_chat_prompt(messages, None, False, True) == "user: hi\nassistant: hello wor"
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    status, chat = call(server, "POST", "/v1/chat/completions", body)
    text = "user: hi\nassistant: hello wor"
    done = call(server, "POST", "/v1/completions", {"prompt": text, "max_tokens": 5, "temperature": 0})[1]
    assert status == 200 and chat["usage"]["prompt_tokens"] == len(ByteTokenizer().encode(text))
    assert chat["choices"][0]["message"]["content"] == done["choices"][0]["text"]
    for bad in ({"continue_final_message": True, "add_generation_prompt": True}, {"add_generation_prompt": "no"}):
        status, err = call(server, "POST", "/v1/chat/completions", dict(body, **bad))
        assert status == 400 and err["error"]["param"] == "add_generation_prompt", err
    status, err = call(server, "POST", "/v1/chat/completions", dict(body, add_generation_prompt=None))
    assert status == 200                       # continue_final_message alone: no new turn opened


def test_chat_echo_prepends_the_last_message_in_the_replys_role(server):
    """vLLM's chat echo: continuing a prefilled assistant message, the reply (whole and streamed) begins
    with that message's content; after a user message (a new assistant turn) nothing is prepended;
    with tools a 400."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello wor"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = call(server, "POST", "/v1/chat/completions", body)[1]["choices"][0]["message"]["content"]
    status, echoed = call(server, "POST", "/v1/chat/completions", dict(body, echo=True))
    assert status == 200 and echoed["choices"][0]["message"]["content"] == "hello wor" + plain
    status, payload = call(server, "POST", "/v1/chat/completions", dict(body, echo=True, stream=True))
    assert status == 200 and sse_text(payload, chat=True)[0] == "hello wor" + plain
    turn = {"messages": messages[:1], "max_tokens": 4, "temperature": 0}
    assert call(server, "POST", "/v1/chat/completions", dict(turn, echo=True))[1]["choices"][0]["message"] == \
        call(server, "POST", "/v1/chat/completions", turn)[1]["choices"][0]["message"]
    status, err = call(server, "POST", "/v1/chat/completions", dict(turn, echo=True, tools=[
        {"type": "function", "function": {"name": "f"}}]))
    assert status == 400 and err["error"]["param"] == "echo", err


def test_response_format_holds_the_output_to_json(server):
    """json_schema and json_object: the tiny random model's output parses as the schema asks (it never
    would unguided), sampled and greedy, whole and streamed."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    chat = {"messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 60, "response_format": fmt}
    status, resp = call(server, "POST", "/v1/chat/completions", dict(chat, temperature=0.8, seed=4))
    assert status == 200, resp
    reply = json.loads(resp["choices"][0]["message"]["content"])
    assert reply["answer"] in ("yes", "no") and 0 <= reply["n"] <= 99 and resp["choices"][0]["finish_reason"] == "stop"
    status, text = call(server, "POST", "/v1/completions", {"prompt": "data = ", "max_tokens": 60, "stream": True,
                                                          "temperature": 0, "response_format": {"type": "json_object"}})
    content, finish = sse_text(text, chat=False)
    assert status == 200 and isinstance(json.loads(content), dict) and finish == "stop"
    assert scrape(server)["meshlab_guided_requests_total"] >= 2


GBNF_LET = 'root ::= "let " [a-z] " = " [0-9]'
LARK_PAREN = 'start: "(" NUM ")"\nNUM: /[0-9]{1,3}/'


@pytest.mark.parametrize("fields,form", [
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, "red|green|blue"),
    ({"guided_choice": ["yes", "no"]}, "yes|no"),
    ({"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}, "[a-c]{3}-[0-9]{2}"),
    ({"guided_regex": "x[0-9]{4}"}, "x[0-9]{4}"),
    ({"structured_outputs": {"grammar": GBNF_LET}}, "let [a-z] = [0-9]"),
    ({"guided_grammar": LARK_PAREN}, r"\([0-9]{1,3}\)"),
    ({"guided_json": json.dumps({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2})},
     r"\[(true|false)(,(true|false))?\]"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                                      "additionalProperties": False}, "whitespace_pattern": " "}},
     r'\{ ?"a" ?: ?(true|false) ?\}'),
])
@pytest.mark.parametrize("chat", [False, True])
def test_structured_outputs_hold_the_output_to_their_form(server, fields, form, chat):
    """vLLM's structured_outputs (choice, regex, a GBNF grammar, a schema with whitespace between its
    tokens) and its older guided_* fields (choice, regex, a Lark grammar, a JSON schema as text): the tiny random model's sampled
    output takes the form whole (it never does free), completions and chat, ending with "stop"."""
    body = dict(fields, max_tokens=24, temperature=0.9, seed=3)
    if chat:
        status, resp = call(server, "POST", "/v1/chat/completions", dict(body, messages=[{"role": "user", "content": "?"}]))
        text = resp["choices"][0]["message"]["content"] if status == 200 else None
    else:
        status, resp = call(server, "POST", "/v1/completions", dict(body, prompt="answer: "))
        text = resp["choices"][0]["text"] if status == 200 else None
    assert status == 200, resp
    assert re.fullmatch(form, text, re.S) and resp["choices"][0]["finish_reason"] == "stop", text
    if "json" in str(fields):
        json.loads(text)


def test_grammar_makers_accept_and_refuse_what_their_form_says():
    """The matchers of guided.py's grammars over the byte tokenizer: which whole texts each accepts."""
    import llguidance
    from meshlab.infer import guided
    tk = guided.matcher_tokenizer(ByteTokenizer(), 260)

    def accepts(grammar, text):
        m = llguidance.LLMatcher(tk, grammar, log_level=0)
        return m.consume_tokens(list(text.encode())) and m.is_accepting()
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
    assert accepts(guided.json_grammar(schema), '{"a":true}') and not accepts(guided.json_grammar(schema), '{ "a":true}')
    assert accepts(guided.json_grammar(schema, " "), '{ "a" : true }')
    assert accepts(guided.choice_grammar(["café", 'say "hi"']), 'say "hi"') and accepts(guided.choice_grammar(["café"]), "café")
    assert not accepts(guided.choice_grammar(["red", "green"]), "gre")
    assert accepts(guided.regex_grammar("[a-c]{2}[0-9]"), "ab7") and not accepts(guided.regex_grammar("[a-c]{2}[0-9]"), "ab")
    assert accepts(guided.cfg_grammar(GBNF_LET), "let q = 4") and accepts(guided.cfg_grammar(LARK_PAREN), "(123)")
    assert not accepts(guided.cfg_grammar(LARK_PAREN), "(1234)")
    for make, bad in ((guided.regex_grammar, "(a"), (guided.cfg_grammar, "start: missing"), (guided.choice_grammar, [""]),
                      (guided.cfg_grammar, "")):
        with pytest.raises(ValueError):
            make(bad)


def test_response_format_with_a_tokenizer_json(server, templated_tokenizer):
    """The matcher reads a tokenizer.json's tokens (byte-level BPE here) as it reads the byte tokenizer's."""
    from meshlab.infer.guided import Grammars
    tok, engine = templated_tokenizer, server.engine
    old = server.tok, engine.detokenize, engine.grammars
    server.tok, engine.detokenize, engine.grammars = tok, tok.decode, Grammars(tok, server.md.cfg.vocab_size)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    try:
        status, resp = call(server, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "where?"}], "max_tokens": 40, "temperature": 0.7, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}})
    finally:
        server.tok, engine.detokenize, engine.grammars = old
    assert status == 200, resp
    assert list(json.loads(resp["choices"][0]["message"]["content"])) == ["city"]


def test_a_structured_output_and_a_required_tool_call_conflict(server):
    body = {"messages": [{"role": "user", "content": "x"}], "guided_choice": ["a", "b"], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    status, resp = call(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and "`guided_choice` and a required tool call" in resp["error"]["message"], resp


WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}


def test_a_required_tool_call_comes_back_as_tool_calls(server):
    """tool_choice "required" and a named function: the reply is a call of one of the tools with
    arguments of its schema (even from the random model), as message.tool_calls, whole and streamed
    (finish_reason "tool_calls", and "stop" for the named function, as OpenAI's);
    a conversation carrying a call and its result is accepted back. (A chat template that leaves the
    tools out of the prompt: the plain format's tools line would not fit the tiny server's context.)"""
    from meshlab.infer.loading import ChatTemplate
    tok = ByteTokenizer()
    tok.chat_template = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:", {})
    old, server.tok = server.tok, tok
    try:
        _tool_calls_of(server)
    finally:
        server.tok = old


def _tool_calls_of(server):
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    status, resp = call(server, "POST", "/v1/chat/completions", {
        "messages": messages, "tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 60,
        "temperature": 0.8, "seed": 3})
    assert status == 200, resp
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (tc,) = choice["message"]["tool_calls"]
    args = json.loads(tc["function"]["arguments"])
    assert tc["type"] == "function" and tc["id"].startswith("call_")
    assert (tc["function"]["name"], set(args)) in (("weather", {"city"}), ("clock", {"utc"}))
    status, text = call(server, "POST", "/v1/chat/completions", {
        "messages": messages, "tools": [WEATHER, CLOCK], "max_tokens": 60, "stream": True, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "clock"}}})
    chunks = [json.loads(e[6:]) for e in text.splitlines() if e.startswith("data: {")]
    last = chunks[-1]["choices"][0]
    assert status == 200 and last["finish_reason"] == "stop"          # a call forced by name, as OpenAI's
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "clock"
    assert isinstance(json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"])["utc"], bool)
    for stream in (False, True):          # a call cut by max_tokens: no call, and none of its JSON as content
        status, resp = call(server, "POST", "/v1/chat/completions", {
            "messages": messages, "tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 5,
            "stream": stream})
        got = sse_text(resp, chat=True) if stream else (resp["choices"][0]["message"]["content"],
                                                        resp["choices"][0]["finish_reason"])
        assert status == 200 and got == ("", "length"), resp
        assert stream or "tool_calls" not in resp["choices"][0]["message"]
    status, resp = call(server, "POST", "/v1/chat/completions", {     # tools alone: "auto", the reply free
        "messages": messages, "tools": [WEATHER, CLOCK], "max_tokens": 8})
    assert status == 200 and resp["choices"][0]["finish_reason"] in ("stop", "length"), resp
    assert isinstance(resp["choices"][0]["message"]["content"], str)
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [tc]},
                          {"role": "tool", "tool_call_id": tc["id"], "content": "12 C, rain"}]
    status, resp = call(server, "POST", "/v1/chat/completions", {
        "messages": history, "tools": [WEATHER, CLOCK], "tool_choice": "none", "max_tokens": 4})
    assert status == 200 and resp["choices"][0]["message"]["content"] is not None, resp


def test_tools_reach_the_prompt_through_the_chat_template():
    """The chat template renders the request's tools (its `tools` variable); without one, a tools line."""
    from meshlab.infer.loading import ChatTemplate
    tok = ByteTokenizer()
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "required"}
    plain = api.parse(body, True, tok, "tiny", 512, [256], 1)
    assert plain.tool_call and plain.prompt_texts[0].startswith('tools: [{"name": "weather"')
    tok.chat_template = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                                     "{% for m in messages %}{{ m.content }}{% endfor %}", {})
    assert api.parse(body, True, tok, "tiny", 512, [256], 1).prompt_texts[0] == "[weather]hi"
