"""The OpenAI-compatible server over a real socket as a service: health, models, metrics and token routes,
bad requests, concurrency, body and load limits, the API key, CORS origins, stats lines, drain, client disconnects, an
engine that fails, and idle warmup. The HTTP helpers here serve test_server_outputs.py and test_server_chat.py."""
import http.client
import json
import socket
import threading
import time

import pytest

from meshlab.infer import api
from meshlab.infer.engine import Engine
from meshlab.infer.metrics import TOKEN_BUCKETS
from meshlab.infer.sampler import SamplingParams
from meshlab.infer.server import Server
from meshlab.tokenizer import ByteTokenizer
from tests.infer.http_helpers import call, scrape

# The "server" group: one xdist worker runs every test_server*.py file, so the session's server (conftest.py)
# compiles its engine's programs once, and test_server_load.py's engine (the same model and shapes) reads them
# from the run's compile cache (tests/conftest.py; make test: --dist loadgroup).
pytestmark = [pytest.mark.xdist_group("server"), pytest.mark.cheap_codegen]



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




def test_health_models_metrics(server):
    assert call(server, "GET", "/health") == (200, {"status": "ok", "warming": False})
    status, body = call(server, "GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == 128
    assert call(server, "GET", "/v1/models/tiny") == (200, body["data"][0])        # OpenAI's models.retrieve
    status, err = call(server, "GET", "/v1/models/gpt-4")
    assert status == 404 and "unknown model 'gpt-4'" in err["error"]["message"]
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


@pytest.mark.parametrize("path,body,raw,status,words", [
    ("/v1/completions", None, b"{not json", 400, "not valid JSON"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, None, 404, "unknown model"),
    ("/v1/completions", {"model": ["meshlab"], "prompt": "x"}, None, 400, "`model` must be a string"),
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 40}, None, 400, "exceeds the context of 128"),
    ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 4}, None, 400, "the context holds 128"),
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
    ("/v1/completions", {"prompt": "x", "stop": ""}, None, 400, "non-empty string"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["  "]}, None, 400, "non-blank"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, None, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None, 400,
     "logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 120}]}, None, 400, "the context holds"),
    ("/v1/completions", [1, 2], None, 400, "JSON object"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}, None, 400, "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": 0}, None, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": ["json_object"]}, None,
     400, "response_format"),
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


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_tokens": 40, "max_tokens": 8}, "min_tokens"), ({"min_tokens": 2, "guided_choice": ["a"]}, "min_tokens"),
    ({"logit_bias": {"1": 500}}, "logit_bias"), ({"logit_bias": {"300": 1}}, "logit_bias"),
    ({"stop_token_ids": [300]}, "stop_token_ids"), ({"allowed_token_ids": [300]}, "allowed_token_ids"),
    ({"prompt": [1, 300]}, "prompt"), ({"prompt": [[1], [-1]]}, "prompt"), ({"stop": ""}, "stop"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"seed": 2 ** 63}, "seed"), ({"seed": 1.5}, "seed"),
])
def test_error_bodies_name_the_field_at_fault(server, body, param):
    """OpenAI's error body: message, type, param (the field at fault, here the sampling fields and token ids
    the sampler's checks refuse; ids against the model's vocabulary of 257) and code (null unless a known
    reason)."""
    status, resp = call(server, "POST", "/v1/completions", {"prompt": "x", **body})
    assert status == 400 and resp["error"]["param"] == param, resp
    assert resp["error"]["type"] == "invalid_request_error" and resp["error"]["code"] is None


def test_error_codes_name_known_reasons(server):
    status, resp = call(server, "POST", "/v1/completions", {"prompt": "x" * 100, "max_tokens": 40})
    assert status == 400 and resp["error"]["code"] == "context_length_exceeded" and resp["error"]["param"] == "max_tokens"
    status, resp = call(server, "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and resp["error"]["code"] == "model_not_found" and resp["error"]["param"] == "model"


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


def test_size_and_load_limits(server, monkeypatch):
    """Bodies over the size limit get 413; more requests in flight than max_concurrent 429, and more engine
    requests than max_waiting can queue beside those waiting 503, both with Retry-After; a request that alone
    makes more engine requests than max_waiting (n, prompts) can never be queued: 400 naming n."""
    status, resp = call(server, "POST", "/v1/completions", raw=json.dumps({"prompt": "x" * 5000}).encode())
    assert status == 413 and "over the limit" in resp["error"]["message"]
    chunked = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + b"".join(b"400\r\n" + b" " * 1024 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n")
    assert chunked.startswith("HTTP/1.1 413")
    monkeypatch.setattr(server, "max_waiting", 2)
    status, err = call(server, "POST", "/v1/completions", {"prompt": ["x", "y"], "n": 2, "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "n" and "4 engine requests" in err["error"]["message"]
    assert "max_waiting 2" in err["error"]["message"]
    monkeypatch.setattr(server.engine.inbox, "qsize", lambda: 1)      # one engine request already waiting
    for attr, code in (("max_concurrent", 429), ("max_waiting", 503)):
        old = getattr(server, attr)
        setattr(server, attr, 0 if attr == "max_concurrent" else 2)
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "n": 2}))
            resp = conn.getresponse()
            assert resp.status == code and int(resp.getheader("Retry-After")) >= 1
            assert "retry later" in json.loads(resp.read())["error"]["message"]
            conn.close()
        finally:
            setattr(server, attr, old)
    assert call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    m = scrape(server)
    assert m["meshlab_http_requests_rejected_total"] >= 2 and m["meshlab_http_requests_inflight"] == 0


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
                assert resp.status == 401 and err["type"] == "invalid_request_error" and "Bearer" in err["message"]
                assert err["code"] == "invalid_api_key"
                conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/v1/completions", body=body, headers={"Authorization": "Bearer sesame"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] >= 1
        conn.close()
        assert call(srv, "GET", "/health")[0] == 200 and call(srv, "GET", "/metrics")[0] == 200   # probes need no key
    finally:
        srv.stop()


def _preflight(srv, origin: str):
    """A browser's CORS preflight for a chat request from a page of `origin`: (status, headers lowercased)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}


def test_allowed_origins_answer_cors_preflights(server, spare_engine):
    """serve.py --allowed-origins: a listed origin's preflight gets the CORS headers (before the API key, which
    a preflight never carries) and its answers name it; another origin gets none; without the flag OPTIONS is 405."""
    from meshlab.infer.serve_cli import serve_parser
    args = serve_parser().parse_args(["--checkpoint", "random:tiny", "--allowed-origins", "https://app.example, http://localhost:3000"])
    assert args.allowed_origins == ["https://app.example", "http://localhost:3000"]
    assert serve_parser().parse_args(["--checkpoint", "random:tiny"]).allowed_origins == []
    srv = Server(spare_engine, ByteTokenizer(), "tiny", "127.0.0.1", 0, api_key="sesame",
                 allowed_origins=args.allowed_origins).start()
    try:
        status, headers = _preflight(srv, "https://app.example")
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example", headers
        assert {m.strip() for m in headers["access-control-allow-methods"].split(",")} == {"GET", "POST", "OPTIONS"}
        assert {h.strip() for h in headers["access-control-allow-headers"].lower().split(",")} >= {"authorization", "content-type"}
        status, headers = _preflight(srv, "https://elsewhere.example")
        assert status == 400 and "access-control-allow-origin" not in headers
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 2}),
                     headers={"Origin": "http://localhost:3000", "Authorization": "Bearer sesame"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Access-Control-Allow-Origin") == "http://localhost:3000"
        resp.read()
        conn.close()
    finally:
        srv.stop()
    status, headers = _preflight(server, "https://app.example")
    assert status == 405 and "access-control-allow-origin" not in headers


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
        if stream:                    # the last event is OpenAI's error object, every field present
            err = json.loads([e for e in resp.splitlines() if e.startswith("data: {")][-1][6:])["error"]
            assert status == 200 and "engine failed" in err["message"]
            assert err["type"] == "server_error" and err["param"] is None and err["code"] is None
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
    bodies = [{"prompt": p, "max_tokens": 12, "logprobs": 0, "temperature": 0} for p in ("a = ", "def f", "import", "x")]
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
