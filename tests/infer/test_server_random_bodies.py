"""Random request bodies against the shared server: every field the API reads (and some it does not), set to
values of every JSON type and out-of-range numbers, on the completion, chat and token routes. Each answer is
a 200 or a 4xx with OpenAI's error shape, never a 5xx, and the engine keeps serving: a value that passes the
checks must not fail later in the engine thread, where it would stop the server for every request."""
import json
import random

import pytest

from tests.infer.http_helpers import call

pytestmark = [pytest.mark.xdist_group("server"), pytest.mark.cheap_codegen]

VALUES = [None, True, False, 0, 1, -1, 7, 10 ** 12, -10 ** 12, 10 ** 30, 0.5, -0.5, 1e300, "", "x", [], [1], [1, 2],
          ["a"], [[1]], [0] * 300, {}, {"a": 1}, {"5": 1.0}, {"type": "json_object"}, {"type": "json_schema"},
          {"type": "json_schema", "json_schema": {"schema": 1}}, {"include_usage": True}, {"choice": ["a", "b"]},
          {"regex": "[a"}, [{"type": "text", "text": "a"}], [{"type": "image_url", "image_url": {"url": "x"}}],
          [{"type": "function", "function": {"name": "f", "parameters": 1}}], "auto", "none"]
FIELDS = ["prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "logprobs",
          "top_logprobs", "echo", "stop", "seed", "stream", "stream_options", "logit_bias", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "best_of", "suffix",
          "user", "model", "response_format", "include_stop_str_in_output", "prompt_logprobs", "allowed_token_ids",
          "bad_words", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "skip_special_tokens",
          "messages", "tools", "tool_choice", "add_generation_prompt", "chat_template_kwargs", "tokens"]
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def random_body(rng: random.Random, path: str) -> dict:
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    else:
        body = {"prompt": "hi", "max_tokens": 4}
    for _ in range(rng.randint(1, 4)):
        body[rng.choice(FIELDS)] = rng.choice(VALUES)
    if rng.random() < 0.2:
        body["messages"] = rng.choice([[{"role": rng.choice(["user", "system", "tool", "x", 1]),
                                         "content": rng.choice(VALUES)}],
                                       [{"role": "assistant", "content": None, "tool_calls": rng.choice(VALUES)}],
                                       [{}], "hi", [[]]])
    return body


def check(server, path, body):
    """One request: a 200 or a 4xx with OpenAI's error shape; its status."""
    status, resp = call(server, "POST", path, raw=json.dumps(body).encode())
    assert status < 500, (path, body, resp)
    if status >= 400:
        assert set(resp["error"]) >= {"message", "type", "param"}, resp
    return status


@pytest.mark.parametrize("path", ROUTES[:2])
def test_each_field_with_each_value(server, path):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    statuses = [check(server, path, {**base, "max_tokens": 2, field: value}) for field in FIELDS for value in VALUES]
    assert 200 in statuses and 400 in statuses
    assert call(server, "GET", "/health")[1]["status"] == "ok"


@pytest.mark.parametrize("seed", range(2))
def test_random_bodies_get_a_200_or_a_4xx_and_the_engine_keeps_serving(server, seed):
    rng = random.Random(seed)
    statuses = {}
    for _ in range(150):
        path = rng.choice(ROUTES)
        body = random_body(rng, path)
        status = check(server, path, body)
        statuses[status // 100] = statuses.get(status // 100, 0) + 1
    assert statuses.get(2) and statuses.get(4)                # both kinds met: the bodies reach the engine
    status, health = call(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok"
