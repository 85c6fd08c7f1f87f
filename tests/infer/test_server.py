"""The OpenAI-compatible server over a real socket: completions, chat, SSE, errors, concurrency,
limits, disconnects, n, echo, logprobs, chat templates."""
import dataclasses
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import models
from meshlab.infer import api
from meshlab.infer.engine import Engine
from meshlab.infer.metrics import TOKEN_BUCKETS
from meshlab.infer.sampler import SamplingParams
from meshlab.infer.server import Server
from meshlab.tokenizer import ByteTokenizer
from models import model_def

ROOT = Path(__file__).resolve().parents[2]
# One xdist worker runs this file and test_server_load.py: each module's server compiles its engine's programs once, not
# once per worker, and the second engine (the same model and shapes) reads them from the run's compile cache
# (tests/conftest.py; make test: --dist loadgroup).
pytestmark = [pytest.mark.xdist_group("server"), pytest.mark.cheap_codegen]


@pytest.fixture(scope="module")
def server():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", init_std=0.2, n_layers=2)
    md = model_def(cfg)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
    engine = Engine(md, params, max_len=128, max_seqs=4, page_size=8, chunk=16, steps_per_call=4)
    srv = Server(engine, ByteTokenizer(), "tiny", "127.0.0.1", 0, stop_token_ids=[256], body_timeout=1.0,
                 max_body_bytes=4096).start()
    srv.md, srv.params = md, params
    yield srv
    srv.stop()


def call(srv, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    ctype = resp.getheader("Content-Type", "")
    return resp.status, (json.loads(text) if ctype.startswith("application/json") else text)


def test_the_engine_thread_warms_more_kinds_while_idle(server):
    """serve.py listens after its first warmup kinds and compiles the others (--warmup-idle-kinds) while the
    engine has no work, one program at a time: /health says warming until done, and then a sampled
    request compiles nothing."""
    from meshlab.infer.warmup import WARMUP_KINDS
    eng = Engine(server.md, server.params, max_len=128, max_seqs=4, page_size=8, chunk=16, steps_per_call=4)
    srv = Server(eng, ByteTokenizer(), "tiny", "127.0.0.1", 0, stop_token_ids=[256],
                 idle_warmup=[WARMUP_KINDS["sampled"]]).start()
    try:
        deadline = time.time() + 300
        while call(srv, "GET", "/health")[1]["warming"] and time.time() < deadline:
            time.sleep(0.1)
        assert call(srv, "GET", "/health")[1] == {"status": "ok", "warming": False}
        compiled = eng.stats["compiles"]
        assert compiled == len(eng._programs) > 0
        status, resp = call(srv, "POST", "/v1/completions", {"prompt": "hi there", "max_tokens": 6,
                                                             "temperature": 0.8, "seed": 3})
        assert status == 200 and resp["usage"]["completion_tokens"] == 6
        assert eng.stats["compiles"] == compiled, set(eng._programs)
    finally:
        srv.stop()


def sse_text(payload: str, chat: bool):
    events = [line[6:] for line in payload.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    key = (lambda c: c["choices"][0]["delta"].get("content", "")) if chat else (lambda c: c["choices"][0]["text"])
    return "".join(key(c) for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


def scrape(srv) -> dict:
    """GET /metrics parsed as Prometheus text: {sample name: value} (histogram buckets keyed by their `le`)."""
    from prometheus_client.parser import text_string_to_metric_families
    status, text = call(srv, "GET", "/metrics")
    assert status == 200
    return {s.name + (f"[{s.labels['le']}]" if "le" in s.labels else ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_health_models_metrics(server):
    assert call(server, "GET", "/health") == (200, {"status": "ok", "warming": False})
    status, body = call(server, "GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == 128
    _, text = call(server, "GET", "/metrics")
    assert "# TYPE meshlab_time_to_first_token_seconds histogram" in text
    assert "# TYPE meshlab_requests_finished_total counter" in text and "# TYPE meshlab_requests_running gauge" in text
    before = scrape(server)
    prompt = "metrics: one request of eight tokens"
    status, resp = call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 8})
    n = resp["usage"]["completion_tokens"]
    assert status == 200 and n >= 1
    after = scrape(server)
    grew = lambda name: after[name] - before.get(name, 0.0)  # noqa: E731
    # one request observed by each histogram, with its own sizes; latencies are positive and ordered
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert grew(f"meshlab_{hist}_count") == 1, hist
    assert grew("meshlab_request_generation_tokens_sum") == n
    assert grew("meshlab_request_prompt_tokens_sum") == len(prompt.encode())
    upper = min(b for b in TOKEN_BUCKETS if b >= n)          # the request lands in its bucket and every one above
    assert grew(f"meshlab_request_generation_tokens_bucket[{float(upper)}]") == 1
    assert all(grew(f"meshlab_request_generation_tokens_bucket[{float(b)}]") == 0 for b in TOKEN_BUCKETS if b < n)
    ttft, e2e = grew("meshlab_time_to_first_token_seconds_sum"), grew("meshlab_e2e_request_latency_seconds_sum")
    assert 0 < ttft < e2e
    assert grew("meshlab_requests_finished_total") == 1 and grew("meshlab_generated_tokens_total") == n
    assert grew("meshlab_prompt_tokens_computed_total") + grew("meshlab_prefix_cache_hit_tokens_total") >= len(prompt)
    assert after["meshlab_requests_running"] == 0 and after["meshlab_http_requests_inflight"] == 0
    assert after["meshlab_free_cache_pages"] == after["meshlab_cache_pages"] == server.engine.sched.pool.total
    assert after["meshlab_kv_cache_usage"] == 0 and after["meshlab_prefix_cache_pages"] >= 1
    assert "meshlab_overlapped_calls_total" in after and "meshlab_chained_calls_total" in after


def test_tokenize_and_detokenize(server):
    """vLLM's token routes: a prompt's ids and count against the context, chat messages as the chat route
    formats them, and the ids back to text."""
    text = "héllo, tokens"
    status, got = call(server, "POST", "/tokenize", {"prompt": text})
    assert status == 200 and got == {"tokens": ByteTokenizer().encode(text), "count": len(text.encode()),
                                     "max_model_len": 128}
    messages = [{"role": "user", "content": "hi"}]
    chat = call(server, "POST", "/tokenize", {"messages": messages})[1]
    assert chat["tokens"] == ByteTokenizer().encode(api.plain_chat_prompt(messages))
    echoed = call(server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1})[1]
    assert echoed["usage"]["prompt_tokens"] == chat["count"]
    assert call(server, "POST", "/detokenize", {"tokens": got["tokens"]}) == (200, {"prompt": text})
    for path, body, words in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": [1, 2]}, "string"),
                              ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"), ("/detokenize", {"tokens": "ab"}, "tokens")):
        status, resp = call(server, "POST", path, body)
        assert status == 400 and words in resp["error"]["message"], (path, body, resp)


def test_completion_stream_equals_whole(server):
    body = {"model": "tiny", "prompt": "def main(", "max_tokens": 12}
    status, whole = call(server, "POST", "/v1/completions", body)
    assert status == 200 and whole["object"] == "text_completion"
    assert whole["usage"]["prompt_tokens"] == 9 and whole["choices"][0]["finish_reason"] in ("length", "stop")
    status, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    assert status == 200
    text, finish = sse_text(payload, chat=False)
    assert text == whole["choices"][0]["text"] and finish == whole["choices"][0]["finish_reason"]
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True,
                                                              stream_options={"include_usage": True}))
    last = json.loads([e for e in payload.splitlines() if e.startswith("data: {")][-1][6:])
    assert last["choices"] == [] and last["usage"] == whole["usage"]


def test_chat_stream_equals_whole(server):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "temperature": 0.8, "seed": 5}
    status, whole = call(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and whole["choices"][0]["message"]["role"] == "assistant"
    status, payload = call(server, "POST", "/v1/chat/completions", dict(body, stream=True))
    text, _ = sse_text(payload, chat=True)
    assert text == whole["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path,body,raw,status,words", [
    ("/v1/completions", None, b"{not json", 400, "not valid JSON"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, None, 404, "unknown model"),
    ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 4}, None, 400, "exceeds the context of 128"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, None, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None, 400, "messages[0]"),
    ("/v1/nothing", {}, None, 404, "no route"),
    ("/v1/completions", {"prompt": "x", "n": 0}, None, 400, "`n`"),
    ("/v1/completions", {"prompt": "x", "n": 99}, None, 400, "`n`"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, None, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, None, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 40, "max_tokens": 8}, None, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2, "response_format": {"type": "json_object"}}, None, 400,
     "min_tokens"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, None, 400, "`structured_outputs.choice`"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": "yes"}, None, 400, "must be an object"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, None, 400, "structural_tag"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": "{not json"}}, None, 400,
     "`structured_outputs.json`"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json_object": "yes"}}, None, 400, "must be true"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= nothing"}}, None, 400, "nothing"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[a-"}, None, 400, "regex was refused"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a"], "response_format": {"type": "json_object"}}, None, 400,
     "send one"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, None, 400, "send one"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": "7"}, None, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [10 ** 6]}, None, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [97], "bad_words": ["a"]}, None, 400, "bans every one"),
    ("/v1/completions", {"prompt": "x", "bad_words": [" "]}, None, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["no"], "use_beam_search": True}, None, 400, "bad_words"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, None, 400,
     "`tools`"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": "7"}, None, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 6]}, None, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, None, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 5}}, None, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}, None, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ["a", 3]}, None, 400, "a list of those"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, None, 400, "a list of those"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, None, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, None, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None, 400,
     "logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 120}]}, None, 400, "exceeds the context"),
    ("/v1/completions", [1, 2], None, 400, "JSON object"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}, None, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, None, 400, '"auto"'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}],
                              "tool_choice": "required"}, None, 400, "tools[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {
            "name": "g"}}}, None, 400, "one of ['f']"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": "f"}},
     None, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None,
     400, "needs `tools`"),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400,
     "chat/completions"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, None, 400, "grammar"),
])
def test_bad_requests_get_4xx_and_server_keeps_serving(server, path, body, raw, status, words):
    got, resp = call(server, "POST", path, body, raw)
    assert got == status and words in resp["error"]["message"], resp
    assert call(server, "GET", "/health")[0] == 200


def test_concurrent_equals_one_at_a_time(server):
    bodies = [{"prompt": p, "max_tokens": m, "temperature": t, "seed": i, "top_k": 30}
              for i, (p, m, t) in enumerate([("import os", 14, 0.0), ("x = [", 6, 0.9), ("class A:", 20, 0.0),
                                             ("# a comment that is a bit longer than one chunk", 9, 1.1),
                                             ("for i in", 11, 0.0), ("return", 7, 0.7)])]
    alone = [call(server, "POST", "/v1/completions", b)[1]["choices"][0]["text"] for b in bodies]
    together = [None] * len(bodies)

    def run(i):
        together[i] = call(server, "POST", "/v1/completions", bodies[i])[1]["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_generate_script_streams(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/generate.py"), "--checkpoint", "random:tiny",
                          "--dtype", "float32", "--prompt", "abc", "--max-new-tokens", "5", "--chunk", "16"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("abc")
    bad = subprocess.run([sys.executable, str(ROOT / "scripts/generate.py"), "--checkpoint", str(tmp_path / "nope"),
                          "--prompt", "x"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "does not exist" in bad.stderr


def test_stop_string_truncates(server):
    body = {"prompt": "while True:", "max_tokens": 16}
    text = call(server, "POST", "/v1/completions", body)[1]["choices"][0]["text"]
    i = next((i for i in range(2, len(text)) if text[i] not in "\ufffd"), None)
    if i is None:
        pytest.skip("no plain character in this model's output to stop on")
    stop = text[i]
    got = call(server, "POST", "/v1/completions", dict(body, stop=[stop]))[1]["choices"][0]
    assert got["text"] == text[:text.index(stop)] and got["finish_reason"] == "stop"
    kept = call(server, "POST", "/v1/completions", dict(body, stop=[stop], include_stop_str_in_output=True))[1]
    assert kept["choices"][0]["text"] == text[:text.index(stop) + 1]          # vLLM's: the stop string kept
    _, payload = call(server, "POST", "/v1/completions", dict(body, stop=stop, stream=True))
    assert sse_text(payload, chat=False) == (got["text"], "stop")


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(server):
    """OpenAI's chat default: no max_tokens means up to the context (the body above has a 126-token prompt)."""
    body = {"messages": [{"role": "user", "content": "x" * 110}], "stop": None}
    status, resp = call(server, "POST", "/v1/chat/completions", body)
    u = resp["usage"]
    assert status == 200 and u["prompt_tokens"] == len(ByteTokenizer().encode(f"user: {'x' * 110}\nassistant:"))
    assert resp["choices"][0]["finish_reason"] == "stop" or u["prompt_tokens"] + u["completion_tokens"] == 128


def test_echo_and_zero_max_tokens(server):
    body = {"prompt": "def f(x):", "max_tokens": 6}
    plain = call(server, "POST", "/v1/completions", body)[1]["choices"][0]["text"]
    echoed = call(server, "POST", "/v1/completions", dict(body, echo=True))[1]
    assert echoed["choices"][0]["text"] == "def f(x):" + plain
    _, payload = call(server, "POST", "/v1/completions", dict(body, echo=True, stream=True))
    assert sse_text(payload, chat=False)[0] == "def f(x):" + plain
    status, zero = call(server, "POST", "/v1/completions", dict(body, echo=True, max_tokens=0))
    assert status == 200 and zero["choices"][0]["text"] == "def f(x):" and zero["usage"]["completion_tokens"] == 0
    default = call(server, "POST", "/v1/completions", {"prompt": "def f(x):"})[1]          # OpenAI's default: 16
    assert default["usage"]["completion_tokens"] == 16 or default["choices"][0]["finish_reason"] == "stop"
    assert default["usage"]["completion_tokens"] <= 16


def test_n_choices_are_seeded_copies(server):
    """n=3 gives three choices; choice i is what the same request alone gives with seed + i; the
    copies take the prompt's full pages (3 of 8 tokens) from the prefix cache instead of prefilling."""
    body = {"prompt": "import os, sys, json, time, re", "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3}
    hits = server.engine.stats["prefix_hit_tokens"]
    status, resp = call(server, "POST", "/v1/completions", body)
    assert status == 200 and [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert server.engine.stats["prefix_hit_tokens"] - hits >= 2 * 24
    alone = [call(server, "POST", "/v1/completions", dict(body, n=1, seed=11 + i))[1]["choices"][0]["text"]
             for i in range(3)]
    assert [c["text"] for c in resp["choices"]] == alone and len(set(alone)) > 1
    assert resp["usage"]["completion_tokens"] == 3 * 8 or any(c["finish_reason"] == "stop" for c in resp["choices"])
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    chunks = [json.loads(e[6:]) for e in payload.splitlines() if e.startswith("data: {")]
    per = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)]
    assert per == alone


def _raw(srv, data: bytes, read=True, timeout=10.0):
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
    s.sendall(data)
    if not read:
        return s
    out = b""
    try:                       # the head, then content-length bytes of body
        while b"\r\n\r\n" not in out or len(out.split(b"\r\n\r\n", 1)[1]) < int(
                out.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
            got = s.recv(65536)
            if not got:
                break
            out += got
    finally:
        s.close()
    return out.decode(errors="replace")


def test_short_body_is_400_and_others_are_served_meanwhile(server):
    t0 = time.perf_counter()
    stuck = []
    thread = threading.Thread(target=lambda: stuck.append(_raw(server, (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{\"prompt\": \"ab"))))
    thread.start()
    status, resp = call(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200                                 # not held behind the short body
    thread.join(timeout=30)
    assert stuck and stuck[0].startswith("HTTP/1.1 400") and "not received within" in stuck[0]
    assert time.perf_counter() - t0 < 15


def test_size_and_load_limits(server):
    status, resp = call(server, "POST", "/v1/completions", raw=json.dumps({"prompt": "x" * 5000}).encode())
    assert status == 413 and "over the limit" in resp["error"]["message"]
    chunked = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + b"".join(b"400\r\n" + b" " * 1024 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n")
    assert chunked.startswith("HTTP/1.1 413")
    for attr, code in (("max_concurrent", 429), ("max_waiting", 503)):
        old = getattr(server, attr)
        setattr(server, attr, 0)
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x"}))
            resp = conn.getresponse()
            assert resp.status == code and int(resp.getheader("Retry-After")) >= 1
            assert "retry later" in json.loads(resp.read())["error"]["message"]
            conn.close()
        finally:
            setattr(server, attr, old)
    assert call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    m = scrape(server)
    assert m["meshlab_http_requests_rejected_total"] >= 2 and m["meshlab_http_requests_inflight"] == 0


@pytest.fixture(scope="module")
def spare_engine(server):
    """An engine for servers a test changes for good (an API key, a drain), compiled like the module's."""
    return Engine(server.md, server.params, max_len=128, max_seqs=4, page_size=8, chunk=16, steps_per_call=4)


def test_api_key_guards_the_v1_routes_only(spare_engine):
    srv = Server(spare_engine, ByteTokenizer(), "tiny", "127.0.0.1", 0, api_key="sesame").start()
    try:
        body = json.dumps({"prompt": "x", "max_tokens": 2})
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
                conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
                conn.request(method, path, body=body if method == "POST" else None, headers=headers)
                resp = conn.getresponse()
                err = json.loads(resp.read())["error"]
                assert resp.status == 401 and err["type"] == "authentication_error" and "Bearer" in err["message"]
                conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/v1/completions", body=body, headers={"Authorization": "Bearer sesame"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] >= 1
        conn.close()
        assert call(srv, "GET", "/health")[0] == 200 and call(srv, "GET", "/metrics")[0] == 200   # probes need no key
    finally:
        srv.stop()


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


def test_stats_lines_while_working_and_quiet_when_idle(spare_engine):
    lines = []
    srv = Server(spare_engine, ByteTokenizer(), "tiny", "127.0.0.1", 0, stats_interval=0.05, log=lines.append).start()
    try:
        time.sleep(0.3)
        assert lines == []                                         # nothing happened: nothing said
        assert call(srv, "POST", "/v1/completions", {"prompt": "stats", "max_tokens": 6})[0] == 200
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lines and lines[0].startswith("meshlab: prompt ") and "generation" in lines[0], lines
        time.sleep(0.3)
        said = len(lines)
        time.sleep(0.3)
        assert len(lines) == said                                  # idle again: quiet
    finally:
        srv.stop()


def test_stats_line_reads_the_counters_growth():
    from types import SimpleNamespace
    from meshlab.infer.metrics import stats_line
    sched = SimpleNamespace(pool=SimpleNamespace(held=0.25), running=lambda: [1, 2], waiting=[3])
    before = {"prompt_tokens": 0, "generated_tokens": 10, "prefill_tokens": 0, "prefix_hit_tokens": 0, "preemptions": 0}
    after = {"prompt_tokens": 200, "generated_tokens": 110, "prefill_tokens": 50, "prefix_hit_tokens": 150,
             "preemptions": 1}
    assert stats_line(after, before, 2.0, sched) == (
        "meshlab: prompt 100.0 tok/s (computed 25.0), generation 50.0 tok/s; 2 running, 1 waiting, 1 preempted; "
        "KV cache 25.0% used; prefix cache 75% of prompt tokens")


def test_drain_finishes_the_requests_in_flight_and_refuses_new_ones(spare_engine):
    """What serve.py does on SIGTERM: a stream started before the drain gets every token it asked for, the
    drain returns only after it finished, and meanwhile new requests and /health get 503."""
    srv = Server(spare_engine, ByteTokenizer(), "tiny", "127.0.0.1", 0).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "prompt": "drain me", "max_tokens": 48, "stream": True, "stream_options": {"include_usage": True}}))
        resp = conn.getresponse()
        lines = [resp.readline().decode()]
        while not lines[-1].startswith("data: "):            # the stream has begun: the request is in flight
            lines.append(resp.readline().decode())
        finished = srv.engine.stats["requests_finished"]
        drained = {}
        drainer = threading.Thread(target=lambda: drained.update(ok=srv.drain(60),
                                                                 finished=srv.engine.stats["requests_finished"]))
        drainer.start()
        while not srv.draining:
            time.sleep(0.001)
        status, body = call(srv, "POST", "/v1/completions", {"prompt": "late", "max_tokens": 2})
        assert status == 503 and "shutting down" in body["error"]["message"]
        assert call(srv, "GET", "/health") == (503, {"status": "draining"})
        rest = resp.read().decode()
        events = [e[6:] for e in ("".join(lines) + rest).splitlines() if e.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 48
        conn.close()
        drainer.join(timeout=60)
        assert drained == {"ok": True, "finished": finished + 1}      # it waited for the stream's request
        # a drain cut short: a request still in the engine when the time is up, or when told to stop now
        left = spare_engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=100))
        assert srv.drain(0.0) is False
        stop_now = threading.Event()
        stop_now.set()
        assert srv.drain(60, cancel=stop_now) is False
        spare_engine.abort(left)                                    # the engine left idle for the next test
        assert srv.drain(60) is True
    finally:
        srv.stop()


def _idle(srv, pages_free, timeout=20.0):
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        s = srv.engine.sched
        if not s.running() and not s.waiting and srv.engine.inbox.empty() and len(s.pool.free) == pages_free:
            return time.perf_counter()
        time.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout} s: running {len(srv.engine.sched.running())}, "
                         f"free pages {len(srv.engine.sched.pool.free)} of {pages_free}")


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_the_slot(server, stream):
    """A client that goes away mid-generation: its request is aborted, its row and pages freed at once,
    not after the remaining ~100 tokens."""
    free = len(server.engine.sched.pool.free)
    body = json.dumps({"prompt": "x", "max_tokens": 120, "temperature": 0.5, "stream": stream}).encode()
    s = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body, read=False)
    if stream:
        assert s.recv(4096).startswith(b"HTTP/1.1 200")     # streaming has begun
    else:
        deadline = time.perf_counter() + 20
        while not server.engine.sched.running() and time.perf_counter() < deadline:
            time.sleep(0.01)
    generated = server.engine.stats["generated_tokens"]
    s.close()
    _idle(server, free)
    assert server.engine.stats["generated_tokens"] - generated < 100
    assert call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3})[0] == 200


def test_disconnect_ends_a_beam_search(server):
    """A client that goes away during a beam search: its round is aborted and no round follows (not
    the ~100 rounds left), and the pages are freed."""
    free = len(server.engine.sched.pool.free)
    body = json.dumps({"prompt": "x", "max_tokens": 120, "n": 3, "use_beam_search": True}).encode()
    s = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body, read=False)
    deadline = time.perf_counter() + 20
    while server.engine.stats["generated_tokens"] < 12 and time.perf_counter() < deadline:   # a few rounds ran
        time.sleep(0.01)
    generated = server.engine.stats["generated_tokens"]
    s.close()
    _idle(server, free)
    assert server.engine.stats["generated_tokens"] - generated < 3 * 100
    assert call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3})[0] == 200


def _reference_logprobs(srv, prompt_ids, output_ids):
    """log_softmax of the model's fp32 logits over the real vocabulary, position by position."""
    ids = np.array([prompt_ids + output_ids], np.int32)
    logits = srv.md.bind(srv.params)(ids)[0, :, :srv.md.cfg.vocab_size]
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return [lp[len(prompt_ids) - 1 + k] for k in range(len(output_ids))]


def test_prompt_logprobs_list_each_prompt_tokens_rank_and_alternatives(server):
    """vLLM's prompt_logprobs k: per prompt token (the first null) the token's logprob and rank and its k
    most likely alternatives with ranks 1..k, as the model computes them in fp32; in every completion
    choice (n = 2 shares the first copy's scores), once beside a chat reply; with stream a 400."""
    tok = ByteTokenizer()
    ids = tok.encode("def f(x): return x  # twenty-five")                              # crosses chunks of 16
    status, resp = call(server, "POST", "/v1/completions", {"prompt": [ids], "max_tokens": 2, "prompt_logprobs": 2,
                                                            "temperature": 0.7, "n": 2})
    assert status == 200, resp
    ref = _reference_logprobs(server, ids[:1], ids[1:])                                  # row k - 1: before ids[k]
    assert resp["choices"][0]["prompt_logprobs"] == resp["choices"][1]["prompt_logprobs"]
    listed = resp["choices"][0]["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None
    for k in range(1, len(ids)):
        row, entry, t = ref[k - 1], listed[k], ids[k]
        best = np.argsort(-row)[:2].tolist()
        assert [int(a) for a in entry][:2] == best and set(entry) == {str(a) for a in best + [t]}
        assert [entry[str(a)]["rank"] for a in best] == [1, 2]
        assert entry[str(t)]["logprob"] == pytest.approx(row[t], abs=1e-4)
        assert 1 + np.sum(row > row[t] + 1e-4) <= entry[str(t)]["rank"] <= 1 + np.sum(row > row[t] - 1e-4)   # ties
        assert entry[str(t)]["decoded_token"] == tok.decode([t])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    status, resp = call(server, "POST", "/v1/chat/completions", chat)
    assert status == 200 and len(resp["prompt_logprobs"]) == resp["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in resp["prompt_logprobs"][1:])
    for bad in ({"stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        status, err = call(server, "POST", "/v1/chat/completions", dict(chat, **bad))
        assert status == 400 and err["error"]["param"] == "prompt_logprobs", err


def _reference_beam_search(srv, prompt, width, steps, stops, penalty):
    """Beam search over the model's fp32 log-softmax, written out: each live beam's 2 x width best next
    tokens, a stop token finishing its beam, the width best live ones kept; ranked by summed logprob /
    (prompt + output length) ** penalty. [(output, finish_reason)] best first."""
    live, done = [([], 0.0)], []
    for _ in range(steps):
        grown = []
        for out, total in live:
            row = _reference_logprobs(srv, prompt + out, [0])[0]
            for t in np.argsort(-row, kind="stable")[:2 * width].tolist():
                (done if t in stops else grown).append((out if t in stops else out + [t], total + float(row[t])))
        live = sorted(grown, key=lambda b: -b[1])[:width]
    ranked = [(o, lp, "stop") for o, lp in done] + [(o, lp, "length") for o, lp in live]
    ranked.sort(key=lambda b: -b[1] / (len(prompt) + len(b[0])) ** penalty)
    return [(o, reason) for o, _, reason in ranked[:width]]


def test_beam_ranking_divides_by_the_length_to_the_penalty():
    """best_beams and next_beams as vLLM ranks: summed logprob / (prompt + output) ** length_penalty over
    finished and live beams (a kept stop token not counted); a round keeps the width best live beams
    and finishes those a stop token extends."""
    from meshlab.infer.beam import Beam, best_beams, next_beams
    short, long = Beam([1], -2.0, "stop"), Beam([1, 2, 3], -2.5)           # lengths 5 and 7 after 4 prompt tokens
    assert [b.output for b in best_beams([short], [long], 2, 4, 1.0)] == [[1, 2, 3], [1]]      # -0.357 > -0.4
    assert [b.output for b in best_beams([Beam([1], -2.0, "stop")], [Beam([1, 2, 3], -2.5)], 2, 4, 0.0)] == \
        [[1], [1, 2, 3]]                                                   # no penalty: the summed logprob
    assert Beam([1, 9], -2.0, "stop", kept_stop=True).score(4, 1.0) == short.score(4, 1.0)
    live, done = next_beams([Beam([5], -1.0), Beam([6], -1.5)], [{7: -0.1, 9: -0.2}, {8: -0.05, 9: -3.0}], 2, {9}, False)
    assert [(b.output, b.logprob) for b in live] == [([5, 7], -1.1), ([6, 8], -1.55)]
    assert [(b.output, b.finish_reason) for b in done] == [([5], "stop"), ([6], "stop")]


@pytest.mark.parametrize("width,penalty", [(3, 1.0), (2, 0.5)])
def test_beam_search_equals_the_reference(server, width, penalty):
    """vLLM's use_beam_search (width n, length_penalty): the choices are the reference search's beams in
    its order, with their finish reasons (a stop token among the candidates ends a beam); usage counts
    every beam's tokens; the engine holds nothing afterwards."""
    tok = ByteTokenizer()
    prompt = tok.encode("def beam(")
    status, resp = call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5, "n": width,
                                                            "use_beam_search": True, "length_penalty": penalty})
    assert status == 200, resp
    want = _reference_beam_search(server, prompt, width, 5, {256}, penalty)
    got = [(c["text"], c["finish_reason"]) for c in resp["choices"]]
    assert got == [(tok.decode(o), reason) for o, reason in want]
    assert resp["usage"]["completion_tokens"] == sum(len(o) for o, _ in want)
    assert not server.engine.has_work()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "use_beam_search": True}
    status, resp = call(server, "POST", "/v1/chat/completions", chat)
    assert status == 200 and len(resp["choices"]) == 2 and resp["choices"][0]["message"]["content"] != \
        resp["choices"][1]["message"]["content"]
    for bad, param in (({"temperature": 0.7}, "use_beam_search"), ({"stream": True}, "use_beam_search"),
                       ({"n": 11}, "n"), ({"logprobs": True}, "use_beam_search"), ({"stop": ["x"]}, "use_beam_search")):
        status, err = call(server, "POST", "/v1/chat/completions", dict(chat, **bad))
        assert status == 400 and err["error"]["param"] == param, err


def test_completion_logprobs_match_the_model(server):
    body = {"prompt": "def g(", "max_tokens": 6, "logprobs": 3}
    status, resp = call(server, "POST", "/v1/completions", body)
    choice = resp["choices"][0]
    lp = choice["logprobs"]
    assert status == 200 and len(lp["tokens"]) == resp["usage"]["completion_tokens"] == 6
    out = [int(t[6:], 16) if t.startswith("bytes:") else (ByteTokenizer().encode(t) or [256])[0] for t in
           (t.replace("\\x", "") for t in lp["tokens"])]
    ref = _reference_logprobs(server, ByteTokenizer().encode("def g("), out)
    for k, (t, row) in enumerate(zip(out, ref)):
        assert abs(lp["token_logprobs"][k] - row[t]) < 1e-4
        top = sorted(row, reverse=True)[:3]
        assert np.allclose(sorted(lp["top_logprobs"][k].values(), reverse=True), top, atol=1e-4)
        assert lp["token_logprobs"][k] == pytest.approx(max(lp["top_logprobs"][k].values()), abs=1e-5)  # greedy
    assert ByteTokenizer().decode(out) == choice["text"] and lp["text_offset"][0] == 0
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    chunks = [json.loads(e[6:])["choices"][0] for e in payload.splitlines() if e.startswith("data: {")]
    streamed = sum((c["logprobs"]["token_logprobs"] for c in chunks if c["logprobs"]), [])
    assert np.allclose(streamed, lp["token_logprobs"], atol=1e-6)


def test_logprobs_name_token_ids_when_asked(server):
    """vLLM's return_tokens_as_token_ids: tokens and their alternatives as "token_id:<id>", so ids whose
    texts are equal stay apart (ids >= 256 all decode to "" under the byte tokenizer: as text they
    would share one top_logprobs key); each named id's logprob is the model's at that id."""
    prompt = ByteTokenizer().encode("def g(")
    body = {"prompt": "def g(", "max_tokens": 6, "logprobs": 3, "return_tokens_as_token_ids": True}
    status, resp = call(server, "POST", "/v1/completions", body)
    lp = resp["choices"][0]["logprobs"]
    assert status == 200 and all(t.startswith("token_id:") for t in lp["tokens"])
    out = [int(t[len("token_id:"):]) for t in lp["tokens"]]
    assert ByteTokenizer().decode(out) == resp["choices"][0]["text"]
    for k, row in enumerate(_reference_logprobs(server, prompt, out)):
        assert abs(lp["token_logprobs"][k] - row[out[k]]) < 1e-4
        alts = {int(key[len("token_id:"):]): v for key, v in lp["top_logprobs"][k].items()}
        assert sorted(alts) == sorted(np.argsort(row)[-3:].tolist())
        assert all(abs(v - row[i]) < 1e-4 for i, v in alts.items())
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True}
    content = call(server, "POST", "/v1/chat/completions", chat)[1]["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") and all(a["token"].startswith("token_id:") for a in e["top_logprobs"])
               for e in content)
    status, err = call(server, "POST", "/v1/completions", dict(body, return_tokens_as_token_ids="yes"))
    assert status == 400 and err["error"]["param"] == "return_tokens_as_token_ids"


def test_truncate_prompt_tokens_keeps_the_prompts_end(server):
    """vLLM's truncate_prompt_tokens k: the prompt's last k tokens only (left truncation), as if sent
    alone (usage, greedy answer, echo); -1 keeps as many as the context holds; a prompt already short is kept."""
    ids = ByteTokenizer().encode("the first part is dropped; the end is kept")
    body = {"prompt": "the first part is dropped; the end is kept", "max_tokens": 6, "temperature": 0}
    status, cut = call(server, "POST", "/v1/completions", dict(body, truncate_prompt_tokens=10, echo=True))
    alone = call(server, "POST", "/v1/completions", dict(body, prompt=ids[-10:]))[1]
    assert status == 200 and cut["usage"]["prompt_tokens"] == 10
    assert cut["choices"][0]["text"] == ByteTokenizer().decode(ids[-10:]) + alone["choices"][0]["text"]
    full = call(server, "POST", "/v1/completions", body)[1]
    for keep in (-1, len(ids), 100):
        same = call(server, "POST", "/v1/completions", dict(body, truncate_prompt_tokens=keep))[1]
        assert same["usage"] == full["usage"] and same["choices"][0]["text"] == full["choices"][0]["text"]
    for bad in (0, -2, "10"):
        status, err = call(server, "POST", "/v1/completions", dict(body, truncate_prompt_tokens=bad))
        assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens", err


def test_echo_with_logprobs_scores_the_prompt(server):
    """What evaluation harnesses send to score a continuation (lm-evaluation-harness's local-completions:
    the prompt as one list of ids, echo, logprobs 1, max_tokens 1): every prompt token's logprob given
    the ones before it (the first null), then the generated token's, each as the model computes it in
    fp32. max_tokens 0 gives the prompt's alone; streaming gives the same values; a prompt met again
    is served its full pages' stored scores and computes the rest, in other chunks than the first
    time: the same values within fp32 rounding."""
    ids = ByteTokenizer().encode("def score(x): return x * 2  # forty tokens")       # crosses chunks of 16
    body = {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    status, resp = call(server, "POST", "/v1/completions", body)
    choice, n = resp["choices"][0], len(ids)
    lp = choice["logprobs"]
    assert status == 200 and len(lp["tokens"]) == n + 1 and resp["usage"]["completion_tokens"] == 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _reference_logprobs(server, ids[:1], ids[1:])                               # row k: after ids[:k + 1]
    for k in range(1, n):
        assert abs(lp["token_logprobs"][k] - ref[k - 1][ids[k]]) < 1e-4
        (best,) = lp["top_logprobs"][k].values()
        assert best == pytest.approx(ref[k - 1].max(), abs=1e-4) and best >= lp["token_logprobs"][k] - 1e-6
    assert lp["text_offset"][:3] == [0, 1, 2] and lp["text_offset"][n] == len(choice["text"]) - 1
    assert lp["token_logprobs"][n] == pytest.approx(max(lp["top_logprobs"][n].values()), abs=1e-5)   # greedy
    plain = call(server, "POST", "/v1/completions", {"prompt": [ids], "max_tokens": 1})[1]["choices"][0]["text"]
    assert choice["text"] == ByteTokenizer().decode(ids) + plain      # the token the scoring pass answered with
    stored = lambda: scrape(server)["meshlab_prompt_tokens_score_cached_total"]   # noqa: E731
    before = stored()
    again = call(server, "POST", "/v1/completions", body)[1]["choices"][0]["logprobs"]["token_logprobs"]
    assert np.allclose(again[1:], lp["token_logprobs"][1:], atol=1e-6)
    assert stored() - before == (n // 8 - 1) * 8         # all but its last full page of 8 from the store
    status, zero = call(server, "POST", "/v1/completions", dict(body, max_tokens=0))
    zl = zero["choices"][0]["logprobs"]
    assert status == 200 and zero["usage"]["completion_tokens"] == 0 and len(zl["tokens"]) == n
    assert zero["choices"][0]["text"] == ByteTokenizer().decode(ids)
    assert np.allclose(zl["token_logprobs"][1:], lp["token_logprobs"][1:n], atol=1e-6)
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    chunks = [json.loads(e[6:])["choices"][0] for e in payload.splitlines() if e.startswith("data: {")]
    streamed = sum((c["logprobs"]["token_logprobs"] for c in chunks if c["logprobs"]), [])
    assert streamed[0] is None and np.allclose(streamed[1:], lp["token_logprobs"][1:], atol=1e-6)
    assert "".join(c["text"] for c in chunks) == choice["text"]


def test_logit_bias_and_penalties_reach_the_sampler(server):
    """logit_bias of +100 on one token makes greedy answer with it every time; the presence and frequency
    penalties are accepted (the engine tests check their values)."""
    body = {"prompt": "def f(x):", "max_tokens": 4, "logit_bias": {str(ord("z")): 100}}
    status, resp = call(server, "POST", "/v1/completions", body)
    assert status == 200 and resp["choices"][0]["text"] == "zzzz"
    status, resp = call(server, "POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4,
                                                            "presence_penalty": 1.0, "frequency_penalty": 0.5})
    assert status == 200 and resp["usage"]["completion_tokens"] >= 1


def test_allowed_token_ids_and_bad_words_hold_the_output(server):
    """vLLM's allowed_token_ids keeps every output token among them, greedy and drawn; its bad_words keeps
    a one-token word out of the output, and a longer word's last token out after the rest of it (the
    greedy answer's first two tokens as the word: the answer begins with the first, then turns away)."""
    body = {"prompt": "def f(x):", "max_tokens": 8, "logprobs": 0, "return_tokens_as_token_ids": True}

    def ids(extra):
        status, resp = call(server, "POST", "/v1/completions", dict(body, **extra))
        assert status == 200, resp
        return [int(t[len("token_id:"):]) for t in resp["choices"][0]["logprobs"]["tokens"]]
    greedy = ids({})
    for extra in ({}, {"temperature": 1.0, "seed": 5}):
        assert set(ids(dict(extra, allowed_token_ids=[97, 98]))) <= {97, 98}
    text = ByteTokenizer().decode(greedy[:2])
    assert len(greedy) == 8 and max(greedy[:2]) < 128 and len(text) == 2            # two ASCII bytes: one word
    turned = ids({"bad_words": [text]})
    assert turned[0] == greedy[0] and turned[1] != greedy[1]
    assert greedy[0] not in ids({"bad_words": [text[0]]})


def test_vllm_sampling_extras(server):
    """min_p, ignore_eos, stop_token_ids and min_tokens (vLLM's extras, which its clients send) change the
    answer as they say: min_p 1 keeps only the best token, so a draw at temperature 1 answers as greedy;
    a token forced by logit_bias stops the answer when it is the model's end token or in stop_token_ids,
    not when ignore_eos drops the end token, and only after min_tokens others."""
    body = {"prompt": "def f(x):", "max_tokens": 8}
    greedy = call(server, "POST", "/v1/completions", body)[1]["choices"][0]["text"]
    for seed in (1, 2):
        drawn = call(server, "POST", "/v1/completions", dict(body, temperature=1.0, min_p=1.0, seed=seed))[1]
        assert drawn["choices"][0]["text"] == greedy
    eos = dict(body, logit_bias={"256": 100})                # the server's end token (stop_token_ids=[256])
    stopped = call(server, "POST", "/v1/completions", eos)[1]
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    ignored = call(server, "POST", "/v1/completions", dict(eos, ignore_eos=True))[1]
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 8
    held = call(server, "POST", "/v1/completions", dict(eos, min_tokens=5))[1]         # the end token held back 5
    assert held["choices"][0]["finish_reason"] == "stop" and held["usage"]["completion_tokens"] == 6
    again = call(server, "POST", "/v1/completions", eos)[1]                          # the slot's held stops cleared
    assert again["usage"]["completion_tokens"] == 1
    z = dict(body, logit_bias={str(ord("z")): 100})
    assert call(server, "POST", "/v1/completions", z)[1]["choices"][0]["text"] == "z" * 8
    got = call(server, "POST", "/v1/completions", dict(z, stop_token_ids=[ord("z")]))[1]["choices"][0]
    assert got["text"] == "z" and got["finish_reason"] == "stop"


def test_several_prompts_answer_in_prompt_order(server):
    """A list of prompts (strings or token-id lists, as evaluation harnesses batch them) gets n choices
    per prompt, in OpenAI's order (index = prompt * n + copy), each what its prompt alone gets; usage
    counts each prompt once; streaming gives the same texts; echo with logprobs scores each prompt."""
    prompts = ["def f(x):", "import os", [100, 101, 102]]
    body = {"prompt": prompts, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3}
    status, resp = call(server, "POST", "/v1/completions", body)
    assert status == 200 and [c["index"] for c in resp["choices"]] == list(range(6))
    for i, c in enumerate(resp["choices"]):
        alone = call(server, "POST", "/v1/completions", dict(body, prompt=prompts[i // 2], n=1, seed=3 + i % 2))[1]
        assert c["text"] == alone["choices"][0]["text"]
    assert resp["usage"]["prompt_tokens"] == 9 + 9 + 3
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    texts = [""] * 6
    for e in payload.splitlines():
        if e.startswith("data: {"):
            for c in json.loads(e[6:])["choices"]:
                texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in resp["choices"]]
    scored = call(server, "POST", "/v1/completions", dict(body, n=1, echo=True, logprobs=0, max_tokens=1,
                                                           temperature=0))[1]["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in scored] == [10, 10, 4]
    assert [c["text"][:-1] for c in scored] == ["def f(x):", "import os", "def"]


def test_chat_logprobs_format(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    status, resp = call(server, "POST", "/v1/chat/completions", body)
    content = resp["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == resp["usage"]["completion_tokens"] == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["logprob"] <= 0 and entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    plain = call(server, "POST", "/v1/chat/completions", dict(body, logprobs=False, top_logprobs=None))[1]
    assert plain["choices"][0]["logprobs"] is None


@pytest.fixture(scope="module")
def templated_tokenizer(tmp_path_factory):
    """A byte-level tokenizer.json (ids < 257, the tiny model's vocabulary) with a chat template."""
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers, decoders, trainers
    from meshlab.infer.loading import HFTokenizer
    d = tmp_path_factory.mktemp("tok")
    tk = Tokenizer(tk_models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["hello world"], trainers.BpeTrainer(
        vocab_size=257, special_tokens=["<|eot|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(d / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "[B]",
                                                         "eos_token": {"content": "<|eot|>"}}))
    return HFTokenizer(d / "tokenizer.json", stop_token_ids=[tk.token_to_id("<|eot|>")])


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


def test_skip_special_tokens_false_shows_them(server, templated_tokenizer):
    """vLLM's skip_special_tokens false: special tokens (a logit bias makes the model say <|eot|>) show
    in the text, whole and streamed, in the logprobs' tokens and offsets, and in an echoed prompt of
    token ids; a stop token that ends the output stays out unless include_stop_str_in_output."""
    tok = templated_tokenizer
    eot = tok.stop_token_ids[0]
    old = server.tok, server.engine.detokenize, server.token_text, server.special_token_text
    server.tok, server.engine.detokenize = tok, tok.decode
    server.token_text, server.special_token_text = api.TokenText(tok), api.TokenText(tok, skip_special_tokens=False)
    body = {"prompt": "hello", "max_tokens": 3, "logit_bias": {str(eot): 100}, "logprobs": 1}
    try:
        texts = {skip: call(server, "POST", "/v1/completions", dict(body, skip_special_tokens=skip))[1]["choices"][0]
                 for skip in (True, False)}
        status, streamed = call(server, "POST", "/v1/completions", dict(body, skip_special_tokens=False, stream=True))
        ended = {keep: call(server, "POST", "/v1/completions", dict(
            body, skip_special_tokens=False, stop_token_ids=[eot], include_stop_str_in_output=keep))[1]["choices"][0]
            for keep in (False, True)}
        echo = call(server, "POST", "/v1/completions", {"prompt": [eot] + tok.encode("hi"), "max_tokens": 0, "echo": True,
                                                        "skip_special_tokens": False})[1]["choices"][0]["text"]
        bad = call(server, "POST", "/v1/completions", dict(body, skip_special_tokens="no"))
    finally:
        server.tok, server.engine.detokenize, server.token_text, server.special_token_text = old
    assert texts[True]["text"] == "" and texts[False]["text"] == "<|eot|>" * 3
    assert texts[False]["logprobs"]["tokens"] == ["<|eot|>"] * 3 and texts[False]["logprobs"]["text_offset"] == [0, 7, 14]
    assert status == 200 and sse_text(streamed, chat=False)[0] == "<|eot|>" * 3
    assert ended[False]["text"] == "" and ended[True]["text"] == "<|eot|>"
    assert ended[False]["finish_reason"] == ended[True]["finish_reason"] == "stop"
    assert echo == "<|eot|>hi"
    assert bad[0] == 400 and bad[1]["error"]["param"] == "skip_special_tokens"


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


class _BrokenEngine:
    """Enough of Engine for the server, whose step fails: requests in flight must not hang."""

    def __init__(self):
        import collections
        import queue
        from meshlab.infer.scheduler import Request
        self.Request, self.inbox, self.aborts = Request, queue.Queue(), []
        self.md = type("M", (), {"cfg": type("C", (), {"vocab_size": 257})()})()
        self.sched = type("S", (), {"max_len": 64, "waiting": collections.deque(), "running": lambda s: [],
                                    "pool": type("P", (), {"free": []})()})()
        self.stats = dict.fromkeys(("requests_finished", "prompt_tokens", "generated_tokens", "steps",
                                    "device_calls", "preemptions", "busy_s"), 0)

    def add_request(self, prompt, params, on_event=None):
        req = self.Request(list(prompt), params, on_event=on_event)
        self.inbox.put(req)
        return req

    def has_work(self):
        return not self.inbox.empty()

    def step(self):
        raise RuntimeError("device lost")

    def abort(self, req):
        self.aborts.append(req)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_ends_requests_in_flight(stream):
    srv = Server(_BrokenEngine(), ByteTokenizer(), "tiny", "127.0.0.1", 0).start()
    try:
        status, resp = call(srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": stream})
        if stream:
            assert status == 200 and '"the engine failed"' in resp
        else:
            assert status == 500 and "engine failed" in resp["error"]["message"]
        assert call(srv, "GET", "/health")[0] == 503
        assert call(srv, "POST", "/v1/completions", {"prompt": "x"})[0] == 503
    finally:
        srv.stop()


def test_streams_wake_the_event_loop_at_most_once_per_engine_step(server, monkeypatch):
    """Concurrent streams: the engine thread hands a step's events to the event loop at once (one
    wake-up of the loop per step, not one per stream and step), and every stream still gets the
    text and logprobs of its whole answer."""
    eng, steps = server.engine, [0]
    step = eng.step
    monkeypatch.setattr(eng, "step", lambda: steps.__setitem__(0, steps[0] + 1) or step())
    bodies = [{"prompt": p, "max_tokens": 12, "logprobs": 0} for p in ("a = ", "def f", "import", "x")]
    whole = [call(server, "POST", "/v1/completions", b)[1]["choices"][0] for b in bodies]
    before, streamed = server.deliveries, [None] * len(bodies)

    def run(i):
        streamed[i] = call(server, "POST", "/v1/completions", dict(bodies[i], stream=True))[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < server.deliveries - before <= steps[0]
    for payload, w in zip(streamed, whole):
        chunks = [json.loads(e[6:]) for e in payload.splitlines() if e.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == w["text"]
        tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
        assert tokens == w["logprobs"]["tokens"]


def test_covered_tokens_decode_once_when_the_text_shows_them_all():
    """The tokens a streamed chunk's logprobs cover: one decoding when the shown text holds all of
    them (the usual case), not one per new token; a held-back tail still bounds them."""
    tok, lengths = ByteTokenizer(), []
    decode = lambda ids: lengths.append(len(ids)) or tok.decode(ids)   # noqa: E731
    out = list(b"hello world")
    assert api.covered_tokens(decode, out, "hello world", False, start=3) == 11 and lengths == [11]
    assert api.covered_tokens(decode, out, "hello wo", False, start=3) == 8
    assert api.covered_tokens(decode, out + [0xE2, 0x82], "hello world", False, start=3) == 13   # half a character


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
                                                          "response_format": {"type": "json_object"}})
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


def test_a_structured_output_and_a_required_tool_call_conflict(server):
    body = {"messages": [{"role": "user", "content": "x"}], "guided_choice": ["a", "b"], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    status, resp = call(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and "`guided_choice` and a required tool call" in resp["error"]["message"], resp


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


WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}


def test_a_required_tool_call_comes_back_as_tool_calls(server):
    """tool_choice "required" and a named function: the reply is a call of one of the tools with
    arguments of its schema (even from the random model), as message.tool_calls, whole and streamed;
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
        "messages": messages, "tools": [WEATHER, CLOCK], "max_tokens": 60, "stream": True,
        "tool_choice": {"type": "function", "function": {"name": "clock"}}})
    chunks = [json.loads(e[6:]) for e in text.splitlines() if e.startswith("data: {")]
    last = chunks[-1]["choices"][0]
    assert status == 200 and last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "clock"
    assert isinstance(json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"])["utc"], bool)
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
