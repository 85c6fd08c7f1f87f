"""The server under concurrent streams: the engine thread's host work and the event loop's chunk
formatting never interleave, chunks can carry usage (continuous_usage_stats), a finished request's
objects go without the cycle collector, and each token's logprob text is worked out once."""
import dataclasses
import gc
import http.client
import json
import threading
import time

import numpy as np
import pytest
from flax import nnx

import models
from meshlab.infer import api_responses
from meshlab.infer import server as server_mod
from meshlab.infer.calls import logprob_rows
from meshlab.infer.engine import Engine
from meshlab.infer.server import Server
from meshlab.tokenizer import ByteTokenizer
from models import model_def

# One xdist worker runs this file and test_server.py: the same engine, its programs compiled once (see there).
pytestmark = [pytest.mark.xdist_group("server"), pytest.mark.cheap_codegen]


@pytest.fixture(scope="module")
def server():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", init_std=0.2, n_layers=2)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
    engine = Engine(model_def(cfg), params, max_len=128, max_seqs=4, page_size=8, chunk=16, steps_per_call=4)
    srv = Server(engine, ByteTokenizer(), "tiny", "127.0.0.1", 0, stop_token_ids=[256]).start()
    yield srv
    srv.stop()


def post(srv, body):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def events(payload: str) -> list:
    return [json.loads(e[6:]) for e in payload.splitlines() if e.startswith("data: {")]


def concurrently(fn, args):
    out = [None] * len(args)
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(*args[i]))) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_engine_host_work_and_chunk_formatting_never_interleave(server, monkeypatch):
    """While the engine thread emits tokens (host work the device may be waiting for), the event loop
    formats no chunk, and the other way round: they take turns at host_lock, the engine letting go
    only while it waits for the device."""
    eng, spans = server.engine, {"engine": [], "loop": []}

    def timed(name, fn):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans[name].append((t, time.perf_counter()))
        return run
    monkeypatch.setattr(eng, "_emit", timed("engine", eng._emit))
    monkeypatch.setattr(server_mod.Call, "_delta", timed("loop", server_mod.Call._delta))
    bodies = [({"prompt": p, "max_tokens": 40, "stream": True, "logprobs": 1},) for p in ("a", "bb", "ccc", "d", "e")]
    for status, payload in concurrently(lambda b: post(server, b), bodies):
        assert status == 200 and payload.endswith("data: [DONE]\n\n")
    assert len(spans["engine"]) > 10 and len(spans["loop"]) > 10
    loop = sorted(spans["loop"])
    starts = [s for s, _ in loop]
    for a, b in spans["engine"]:
        j = int(np.searchsorted(starts, b))              # loop spans starting before this engine span ends
        assert all(e <= a for _, e in loop[max(j - 50, 0):j]), "a chunk was formatted while the engine emitted"


def test_continuous_usage_counts_every_token(server):
    """stream_options.continuous_usage_stats (vLLM's): each chunk carries the choice's tokens so far, and
    a chunk goes out for every step that added tokens, even one that adds no visible text."""
    body = {"prompt": "def f(x):", "max_tokens": 24, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, payload = post(server, body)
    chunks = events(payload)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    final = chunks[-1]["usage"]
    assert status == 200 and chunks[-1]["choices"] == [] and final["completion_tokens"] == counts[-1]
    assert counts == sorted(counts) and counts[0] >= 1 and len(counts) >= 2
    assert all(c["usage"]["prompt_tokens"] == 9 for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        json.loads(post(server, dict(body, stream=False, stream_options=None))[1])["choices"][0]["text"]
    assert post(server, dict(body, stream_options={"continuous_usage_stats": "yes"}))[0] == 400
    plain = events(post(server, dict(body, stream_options=None))[1])
    assert all("usage" not in c for c in plain)


def test_finished_requests_go_without_the_cycle_collector(server):
    """A finished call's engine requests no longer hold it through their callbacks: with the collector
    off, no Call (nor its requests' token logprobs) outlives its HTTP request."""
    gc.collect()
    gc.disable()
    try:
        bodies = [({"prompt": "x" * k, "max_tokens": 8, "logprobs": 0, "stream": k % 2 == 0},) for k in range(1, 5)]
        assert all(s == 200 for s, _ in concurrently(lambda b: post(server, b), bodies))
        deadline = time.monotonic() + 10
        while server.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert [o for o in gc.get_objects() if isinstance(o, server_mod.Call)] == []
    finally:
        gc.enable()


def test_token_text_decodes_each_token_once():
    tok, seen = ByteTokenizer(), []

    class Counting:
        def decode(self, ids):
            seen.append(list(ids))
            return tok.decode(ids)
    text = api_responses.TokenText(Counting())
    out, entries = list(b"aab") + [0xE2], [(-0.5, {97: -0.5, 98: -1.0})] * 4
    first = api_responses.completion_logprobs(text, out, entries, offset=3)
    assert api_responses.completion_logprobs(text, out, entries, offset=3) == first
    assert sorted(map(tuple, seen)) == [(97,), (98,), (0xE2,)]
    assert first["tokens"] == ["a", "a", "b", "bytes:\\xe2"] and first["text_offset"] == [3, 4, 5, 6]
    assert first["top_logprobs"][0] == {"a": -0.5, "b": -1.0}
    chat = api_responses.chat_logprobs(text, out[3:], entries[3:])["content"][0]
    assert chat["token"] == "bytes:\\xe2" and list(chat["bytes"]) == [0xE2]


def test_logprob_rows_per_row_python_numbers():
    """The engine's logprob outputs of a call, per row: decode calls [n, b, ...] and packed steps [r, ...]."""
    lp = np.array([[-0.1, -0.2], [-0.3, -0.4]], np.float32)                           # [n=2, b=2]
    ids, vals = np.arange(8).reshape(2, 2, 2), -np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    rows = logprob_rows({"logprob": lp, "top_id": ids, "top_logprob": vals}, 1)
    assert rows[1] == [(float(lp[0, 1]), [2, 3], [-2.0, -3.0]), (float(lp[1, 1]), [6, 7], [-6.0, -7.0])]
    assert all(type(x) is float for row in rows for x, _, _ in row)
    packed = logprob_rows({"logprob": lp[0], "top_id": ids[0, :, :0], "top_logprob": vals[0, :, :0]}, 0)
    assert packed == [[(float(lp[0, 0]), (), ())], [(float(lp[0, 1]), (), ())]]


def test_token_id_prompts_are_decoded_only_for_echo(server):
    """A prompt of token ids is decoded only when echo shows it back (the load test's prompts are ids)."""
    ids = list(b"def f(x):")
    status, text = post(server, {"prompt": ids, "max_tokens": 0, "echo": True})
    assert status == 200 and json.loads(text)["choices"][0]["text"] == "def f(x):"
    whole = json.loads(post(server, {"prompt": ids, "max_tokens": 6, "temperature": 0})[1])["choices"][0]["text"]
    assert whole == json.loads(post(server, {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0})[1])["choices"][0]["text"]
    assert post(server, {"prompt": ids[:3] + [True], "max_tokens": 2})[0] == 400
