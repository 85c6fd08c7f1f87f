"""Check scripts/serve.py end to end as a client sees it: python scripts/check_serve.py [SERVE ARGS...].

Starts the server (default: --checkpoint random:llama3_1b --dtype bfloat16), then checks that a
streamed completion arrives as server-sent events ending in [DONE] with every token counted; that a
streaming client which disconnects after a few chunks has its request aborted (requests_running back
to 0 and every cache page free within seconds, far fewer tokens generated than it asked for); that
n=2 with logprobs answers; that a `structured_outputs` choice, a beam search, vLLM's
`prompt_logprobs` (with ranks), and its allowed_token_ids with bad_words answer in their forms.
Random weights with a byte tokenizer sample mostly ids past its 256 bytes, which have no text: the
checks count tokens (usage in every chunk, logprobs by token id), not text.
Prints one line per check and exits non-zero if any fails. Meant for the GPU machine (the CPU tests
cover the same behaviours on a tiny model: tests/infer/test_server.py).
"""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def metrics(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if line and not line.startswith("#"))
            if "{" not in k}                                 # plain samples; histogram buckets carry labels


def post(port: int, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read().decode()


def check_stream(port: int) -> str:
    """Usage in every chunk (vLLM's continuous_usage_stats): a random model's tokens are mostly ids
    without text under the byte tokenizer, and a chunk without new text is not sent otherwise."""
    t0 = time.perf_counter()
    status, payload = post(port, {"prompt": "def fibonacci(n):", "max_tokens": 64, "stream": True, "temperature": 0,
                                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = [e[6:] for e in payload.splitlines() if e.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", (status, payload[:300])
    chunks = [json.loads(e) for e in events[:-1]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    made = chunks[-1]["usage"]["completion_tokens"]
    assert finish[-1] in ("length", "stop") and (made == 64 or finish[-1] == "stop"), (finish[-1], made)
    return f"{len(chunks)} chunks, {made} tokens in {time.perf_counter() - t0:.2f} s"


def check_disconnect(port: int, max_tokens: int = 1500) -> str:
    base = metrics(port)
    body = json.dumps({"prompt": "x" * 100, "max_tokens": max_tokens, "temperature": 0.7, "stream": True,
                       "ignore_eos": True, "stream_options": {"continuous_usage_stats": True}}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=600)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(65536)
    gen0 = metrics(port)["meshlab_generated_tokens_total"]
    s.close()
    t0 = time.perf_counter()
    while True:
        m = metrics(port)
        if m["meshlab_requests_running"] == 0 and m["meshlab_free_cache_pages"] == base["meshlab_free_cache_pages"]:
            break
        assert time.perf_counter() - t0 < 30, f"not idle 30 s after the disconnect: {m}"
        time.sleep(0.05)
    after = m["meshlab_generated_tokens_total"] - gen0
    assert after < max_tokens // 2, f"{after} tokens generated after the disconnect"
    assert m["meshlab_requests_aborted_total"] >= 1, m
    return f"idle {time.perf_counter() - t0:.3f} s after the disconnect, {after:.0f} tokens generated after it"


def check_n_logprobs(port: int) -> str:
    """Tokens named by id (vLLM's return_tokens_as_token_ids): ids without text would share one
    top_logprobs key."""
    status, payload = post(port, {"prompt": "import ", "max_tokens": 8, "n": 2, "logprobs": 2, "temperature": 1.0,
                                  "ignore_eos": True, "return_tokens_as_token_ids": True})
    body = json.loads(payload)
    assert status == 200 and len(body["choices"]) == 2, payload[:300]
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == 8, lp
    # OpenAI's completions: the 2 most likely, and the sampled token beside them when it is not one
    assert all(tok in top and len(top) in (2, 3) for tok, top in zip(lp["tokens"], lp["top_logprobs"])), lp
    return f"2 choices, logprobs of {len(lp['tokens'])} tokens"


def check_forms(port: int) -> str:
    """A choice held by the grammar (greedy over the allowed bytes), a beam search of width 2, and each
    prompt token's logprob and rank."""
    status, payload = post(port, {"prompt": "colour: ", "max_tokens": 8, "structured_outputs": {"choice": ["red", "green"]}})
    choice = json.loads(payload)["choices"][0] if status == 200 else None
    assert choice is not None and choice["text"] in ("red", "green") and choice["finish_reason"] == "stop", payload[:300]
    status, payload = post(port, {"prompt": "def ", "max_tokens": 4, "n": 2, "use_beam_search": True})
    beams = json.loads(payload) if status == 200 else None
    assert beams is not None and len(beams["choices"]) == 2 and beams["usage"]["completion_tokens"] >= 2, payload[:300]
    status, payload = post(port, {"prompt": "def f(x):", "max_tokens": 1, "prompt_logprobs": 1})
    body = json.loads(payload) if status == 200 else None
    listed = body["choices"][0]["prompt_logprobs"] if body else None
    assert listed and len(listed) == body["usage"]["prompt_tokens"] and listed[0] is None and all(
        min(e["rank"] for e in entry.values()) >= 1 for entry in listed[1:]), payload[:300]
    status, payload = post(port, {"prompt": "def ", "max_tokens": 8, "allowed_token_ids": [97, 98, 99], "logprobs": 0,
                                  "return_tokens_as_token_ids": True, "bad_words": ["ab"]})
    tokens = json.loads(payload)["choices"][0]["logprobs"]["tokens"] if status == 200 else None
    ids = [int(t[len("token_id:"):]) for t in tokens or []]
    assert len(ids) == 8 and set(ids) <= {97, 98, 99} and [97, 98] not in [ids[i:i + 2] for i in range(7)], payload[:300]
    return (f"choice {choice['text']!r}, {len(beams['choices'])} beams, {len(listed)} prompt logprobs, "
            f"{bytes(ids).decode()!r} from 3 allowed tokens without 'ab'")


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:    # this script's own help (serve.py's flags: scripts/serve.py --help)
        print(__doc__.rstrip() + "\nSERVE ARGS are scripts/serve.py's flags (scripts/serve.py --help lists them).")
        sys.exit(0)
    if not any(a == "--checkpoint" or a.startswith("--checkpoint=") for a in args):   # --checkpoint=PATH is one too
        args += ["--checkpoint", "random:llama3_1b", "--dtype", "bfloat16"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/serve.py"), "--port", "0", *args],
                            stdout=subprocess.PIPE, text=True)
    failed = False
    try:
        line = proc.stdout.readline()
        if "serving" not in line:
            sys.exit(f"serve.py did not start (exit {proc.wait()}): {line}")
        port = int(line.rsplit(":", 1)[1])
        post(port, {"prompt": "warm up", "max_tokens": 16, "temperature": 0})          # compiles before the timed checks
        for name, check in (("stream", check_stream), ("disconnect", check_disconnect),
                            ("n=2 logprobs", check_n_logprobs), ("output forms", check_forms)):
            try:
                print(f"PASS {name}: {check(port)}", flush=True)
            except Exception as e:  # noqa: BLE001 - report every check, then fail
                failed = True
                print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
