"""An OpenAI-compatible HTTP server over the continuous-batching engine (stdlib only).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` for
server-sent events), GET /v1/models, /health, /metrics (Prometheus text). HTTP handler threads
parse and validate, then queue the request; one engine thread runs `Engine.step` while there is
work, so concurrent requests share decode steps. Every bad request is a 4xx JSON error
{"error": {"message", "type", "param"}} and the server keeps serving.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from meshlab.infer.sampler import SamplingParams
from meshlab.infer.scheduler import AdmissionError

SAMPLING_FIELDS = {"max_tokens": int, "temperature": (int, float), "top_k": int, "top_p": (int, float),
                   "repetition_penalty": (int, float), "seed": int}


class BadRequest(Exception):
    def __init__(self, message, status=400, param=None):
        super().__init__(message)
        self.status, self.param = status, param


def chat_prompt(messages) -> str:
    """A plain chat template (the byte tokenizer has none): 'role: content' lines, then 'assistant:'."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list of {role, content} objects", param="messages")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}] must be {{\"role\": system|user|assistant, \"content\": string}}",
                             param="messages")
        lines.append(f"{m['role']}: {m['content']}")
    return "\n".join(lines) + "\nassistant:"


def sampling_from(body: dict, default_stop: tuple) -> SamplingParams:
    kw = {}
    for name, typ in SAMPLING_FIELDS.items():
        if body.get(name) is not None:
            if isinstance(body[name], bool) or not isinstance(body[name], typ):
                raise BadRequest(f"`{name}` must be a {'number' if typ != int else 'integer'}", param=name)
            kw[name] = body[name]
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        return SamplingParams(**kw, stop=stop, stop_token_ids=default_stop).validate()
    except ValueError as e:
        raise BadRequest(str(e)) from None


class Server:
    """Owns the engine thread and the HTTP server; `start()` returns once it is listening."""

    def __init__(self, engine, tokenizer, model_name: str = "meshlab", host: str = "127.0.0.1", port: int = 8000,
                 stop_token_ids=()):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.stop_token_ids = tuple(stop_token_ids)
        engine.detokenize = tokenizer.decode
        self.wake = threading.Event()
        self.running = True
        self.finished: list = []            # metrics of finished requests (ttft, tpot)
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]

    # -- engine thread --------------------------------------------------------------------
    def _engine_loop(self):
        while self.running:
            if not self.engine.has_work():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            self.engine.step()

    def start(self):
        self.threads = [threading.Thread(target=self._engine_loop, daemon=True, name="engine"),
                        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="http")]
        for t in self.threads:
            t.start()
        return self

    def stop(self):
        self.running = False
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- requests -------------------------------------------------------------------------
    def submit(self, body: dict, chat: bool):
        """Validate, queue; returns (request, queue of (new_text, finished) events)."""
        if body.get("model") not in (None, self.model_name):
            raise BadRequest(f"unknown model {body.get('model')!r}; this server serves {self.model_name!r}",
                             status=404, param="model")
        if chat:
            text = chat_prompt(body.get("messages"))
        else:
            text = body.get("prompt")
            if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
                text = text[0]
            if not isinstance(text, str) or not text:
                raise BadRequest("`prompt` must be a non-empty string", param="prompt")
        params = sampling_from(body, self.stop_token_ids)
        events: queue.Queue = queue.Queue()
        try:
            req = self.engine.add_request(self.tok.encode(text), params,
                                          on_event=lambda r, new, done: events.put((r, done)))
        except (AdmissionError, ValueError) as e:
            raise BadRequest(str(e)) from None
        self.wake.set()
        return req, events

    def metrics_text(self) -> str:
        s, sched = self.engine.stats, self.engine.sched
        done = self.finished[-1000:]
        ttft = [m["ttft_s"] for m in done if m["ttft_s"] is not None]
        tpot = [m["tpot_s"] for m in done if m["tpot_s"] is not None]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
        rows = [("requests_finished_total", s["requests_finished"]), ("prompt_tokens_total", s["prompt_tokens"]),
                ("generated_tokens_total", s["generated_tokens"]), ("engine_steps_total", s["steps"]),
                ("device_calls_total", s["device_calls"]), ("preemptions_total", s["preemptions"]),
                ("requests_running", len(sched.running())), ("requests_waiting", len(sched.waiting)),
                ("free_cache_pages", len(sched.pool.free)), ("ttft_seconds_mean", mean(ttft)),
                ("tpot_seconds_mean", mean(tpot)),
                ("generation_tokens_per_second", s["generated_tokens"] / s["busy_s"] if s["busy_s"] else 0.0)]
        return "".join(f"meshlab_{k} {v}\n" for k, v in rows)


def _visible(req, final: bool) -> str:
    """Text safe to show so far: never a half UTF-8 character, never a possible stop-string prefix."""
    text = req.text
    if final:
        return text
    text = text.rstrip("\ufffd")
    hold = max((len(s) - 1 for s in req.params.stop), default=0)
    return text[:len(text) - hold] if hold else text


def _handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):            # quiet: tests and benchmarks read stdout
            pass

        def _json(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status, message, param=None):
            kind = "not_found_error" if status == 404 else "invalid_request_error"
            self._json(status, {"error": {"message": message, "type": kind, "param": param}})

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/metrics":
                data = server.metrics_text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": server.model_name, "object": "model"}]})
            else:
                self._error(404, f"no route GET {self.path}; try /health, /metrics, /v1/models")

        def do_POST(self):
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                return self._error(404, f"no route POST {self.path}; try /v1/completions or /v1/chat/completions")
            try:
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadRequest(f"request body is not valid JSON: {e}") from None
                if not isinstance(body, dict):
                    raise BadRequest("request body must be a JSON object")
                chat = self.path.endswith("chat/completions")
                req, events = server.submit(body, chat)
            except BadRequest as e:
                return self._error(e.status, str(e), e.param)
            if body.get("stream"):
                self._stream(req, events, chat)
            else:
                self._whole(req, events, chat)

        def _wait(self, events):
            while True:
                req, done = events.get()
                if done:
                    server.finished.append(req.metrics)
                    return req

        def _whole(self, req, events, chat):
            req = self._wait(events)
            choice = {"index": 0, "finish_reason": req.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": req.text}
            else:
                choice.update(text=req.text, logprobs=None)
            self._json(200, {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "created": int(time.time()),
                             "object": "chat.completion" if chat else "text_completion", "model": server.model_name,
                             "choices": [choice], "usage": _usage(req)})

        def _stream(self, req, events, chat):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            rid, sent = f"cmpl-{uuid.uuid4().hex[:12]}", 0
            kind = "chat.completion.chunk" if chat else "text_completion"

            def send(delta_text, finish):
                choice = {"index": 0, "finish_reason": finish}
                if chat:
                    choice["delta"] = {"content": delta_text} if delta_text or finish else {"role": "assistant"}
                else:
                    choice["text"] = delta_text
                chunk = {"id": rid, "object": kind, "created": int(time.time()), "model": server.model_name,
                         "choices": [choice]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()

            if chat:
                send("", None)
            while True:
                r, done = events.get()
                text = _visible(r, done)
                if len(text) > sent or done:
                    send(text[sent:], r.finish_reason if done else None)
                    sent = len(text)
                if done:
                    server.finished.append(r.metrics)
                    break
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


def _usage(req) -> dict:
    p, c = len(req.prompt), len(req.output)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
