"""The server as a client of OpenAI's API meets it: which of two length fields wins, where a too-long
prompt's error points, the bounds and types OpenAI checks, its error types, the model card, the usage
field of a stream's chunks, and the field an engine's refusal names. Each on the shared server."""
import json

import pytest

from meshlab.infer.scheduler import AdmissionError
from tests.infer.http_helpers import call

pytestmark = [pytest.mark.xdist_group("server"), pytest.mark.cheap_codegen]   # the shared server: see test_server.py

CHAT = [{"role": "user", "content": "hi"}]


def test_max_completion_tokens_wins_over_the_deprecated_max_tokens(server):
    body = {"messages": CHAT, "max_completion_tokens": 3, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    status, resp = call(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and resp["usage"]["completion_tokens"] == 3, resp


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x" * 128, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]}, "messages"),
])
def test_a_prompt_over_the_context_names_the_prompt(server, path, body, param):
    """No max_tokens fits a prompt that fills the context (128): the error names the prompt, as OpenAI's."""
    status, resp = call(server, "POST", path, body)
    err = resp["error"]
    assert status == 400 and err["param"] == param and err["code"] == "context_length_exceeded", resp
    assert "context holds 128" in err["message"] and "max_tokens" not in err["message"]


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "x", "temperature": 2.5}', "temperature"),     # OpenAI's range is [0, 2]
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "frequency_penalty": NaN}', "frequency_penalty"),
    (b'{"prompt": "x", "user": 5}', "user"),
    (b'{"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "no"}', "parallel_tool_calls"),
])
def test_openai_bounds_and_types(server, raw, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    status, resp = call(server, "POST", path, raw=raw)
    assert status == 400 and resp["error"]["param"] == param, resp


def test_any_int64_seed_repeats_its_answer(server):
    """OpenAI takes any int64 seed (the engine's are int32: folded): a negative or huge one is served, and again
    gives the same answer."""
    body = {"prompt": "ab", "max_tokens": 4, "temperature": 1.0, "n": 2}
    for seed in (-3, 2 ** 63 - 1):
        status, first = call(server, "POST", "/v1/completions", dict(body, seed=seed))
        assert status == 200, first
        assert call(server, "POST", "/v1/completions", dict(body, seed=seed))[1]["choices"] == first["choices"]


def test_top_k_minus_one_is_vllms_off(server):
    body = {"prompt": "ab", "max_tokens": 3, "temperature": 0.7, "seed": 1}
    status, off = call(server, "POST", "/v1/completions", dict(body, top_k=-1))
    assert status == 200 and off["choices"][0]["text"] == call(server, "POST", "/v1/completions", body)[1]["choices"][0]["text"]


def test_error_types_are_openais_and_the_model_card_has_created(server):
    for method, path, body, status in (("POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
                                       ("GET", "/v1/models/gpt-9", None, 404), ("GET", "/v1/nothing", None, 404),
                                       ("GET", "/v1/completions", None, 405)):
        got, resp = call(server, method, path, body)
        assert got == status and resp["error"]["type"] == "invalid_request_error", resp
        assert set(resp["error"]) == {"message", "type", "param", "code"}
    status, resp = call(server, "GET", "/v1/models")
    card = resp["data"][0]
    assert status == 200 and card["object"] == "model" and isinstance(card["created"], int) and card["created"] > 0
    assert call(server, "GET", "/v1/models/tiny")[1] == card


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_puts_a_null_usage_in_every_other_chunk(server, chat):
    body = {"max_tokens": 4, "n": 2, "stream": True, "stream_options": {"include_usage": True},
            **({"messages": CHAT} if chat else {"prompt": "ab"})}
    status, text = call(server, "POST", "/v1/chat/completions" if chat else "/v1/completions", body)
    chunks = [json.loads(e[6:]) for e in text.splitlines() if e.startswith("data: {")]
    assert status == 200 and text.rstrip().endswith("data: [DONE]")
    assert all(c["usage"] is None and c["choices"] for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 8
    finished = {c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}


def test_an_engine_refusal_names_max_tokens(server, monkeypatch):
    """A request the engine's KV cache cannot hold (the engine's own check, after the API's): 400 naming max_tokens."""
    def refuse(*_, **__):
        raise AdmissionError("request needs 99 cache pages, the cache has 64; lower max_tokens")
    monkeypatch.setattr(server.engine, "add_request", refuse)
    status, resp = call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert status == 400 and resp["error"]["param"] == "max_tokens" and "cache pages" in resp["error"]["message"]
    assert server.inflight == 0


def test_streamed_text_offsets_equal_the_whole_answers(server):
    """Completions logprobs' text_offset in a stream goes on from the last token sent, as in the whole answer,
    also where a chunk ends inside a character (its first byte's token sent, the character held back)."""
    body = {"prompt": "ab", "max_tokens": 12, "logprobs": 0, "temperature": 0, "structured_outputs": {"regex": "(é){6}"}}
    status, whole = call(server, "POST", "/v1/completions", body)
    assert status == 200 and whole["choices"][0]["text"] == "é" * 6, whole
    status, text = call(server, "POST", "/v1/completions", dict(body, stream=True))
    chunks = [json.loads(e[6:])["choices"][0] for e in text.splitlines() if e.startswith("data: {")]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert len(chunks) > 1 and offsets == whole["choices"][0]["logprobs"]["text_offset"], chunks
