"""The OpenAI-compatible server over a real socket: completions, chat, SSE, errors, concurrency."""
import dataclasses
import http.client
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from flax import nnx

import models
from meshlab.infer.engine import Engine
from meshlab.infer.server import Server
from meshlab.train.data import ByteTokenizer
from meshlab.train.state import model_def

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", init_std=0.2, n_layers=2)
    md = model_def(cfg)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
    engine = Engine(md, params, max_len=128, max_seqs=4, page_size=8, chunk=16, steps_per_call=4)
    srv = Server(engine, ByteTokenizer(), "tiny", "127.0.0.1", 0, stop_token_ids=[256]).start()
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


def sse_text(payload: str, chat: bool):
    events = [line[6:] for line in payload.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    key = (lambda c: c["choices"][0]["delta"].get("content", "")) if chat else (lambda c: c["choices"][0]["text"])
    return "".join(key(c) for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


def test_health_models_metrics(server):
    assert call(server, "GET", "/health") == (200, {"status": "ok"})
    status, body = call(server, "GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "tiny"
    status, text = call(server, "GET", "/metrics")
    assert status == 200 and "meshlab_requests_finished_total" in text and "meshlab_ttft_seconds_mean" in text


def test_completion_stream_equals_whole(server):
    body = {"model": "tiny", "prompt": "def main(", "max_tokens": 12}
    status, whole = call(server, "POST", "/v1/completions", body)
    assert status == 200 and whole["object"] == "text_completion"
    assert whole["usage"]["prompt_tokens"] == 9 and whole["choices"][0]["finish_reason"] in ("length", "stop")
    status, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    assert status == 200
    text, finish = sse_text(payload, chat=False)
    assert text == whole["choices"][0]["text"] and finish == whole["choices"][0]["finish_reason"]


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
])
def test_bad_requests_get_4xx_and_server_keeps_serving(server, path, body, raw, status, words):
    got, resp = call(server, "POST", path, body, raw)
    assert got == status and words in resp["error"]["message"]
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
    _, payload = call(server, "POST", "/v1/completions", dict(body, stop=stop, stream=True))
    assert sse_text(payload, chat=False) == (got["text"], "stop")
