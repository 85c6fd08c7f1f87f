"""An OpenAI-compatible HTTP server over the continuous-batching engine (Starlette on uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (with `"stream": true` for server-sent
events), GET /v1/models (and /v1/models/<name>), /health, /metrics (Prometheus text: meshlab/infer/metrics.py), and vLLM's
POST /tokenize and /detokenize (a prompt's token count against the context). The request schemas are in
meshlab/infer/api.py; one request's choices and their answer (whole or streamed) are
meshlab/infer/http_call.py's `Call`. One engine thread runs `Engine.step` while there is work, so
concurrent requests share decode steps; the HTTP side is one asyncio loop, so a slow client holds no
thread.

Limits, each answered at once: a body over `max_body_bytes` is 413; a body not received within
`body_timeout` seconds (shorter than its Content-Length) is 400; more than `max_concurrent` requests in
flight is 429, and more than `max_waiting` engine requests not yet admitted is 503 (both with a Retry-After;
a request that alone makes more than `max_waiting` engine requests is 400: no retry fits it). With
`api_key`, the /v1 and token routes want `Authorization: Bearer <key>` (else 401). With `allowed_origins`,
browser pages of those origins may call it (CORS: their preflight OPTIONS are answered). `drain` refuses new
requests and lets those in flight finish (SIGTERM in scripts/serve.py). A client that disconnects has its
requests aborted (`Engine.abort`: slot and pages freed at the next step). Every error is JSON {"error":
{"message", "type", "param", "code"}}, as OpenAI's (type: invalid_request_error for the client's fault, 401 and
404 included, "requests" for 429, server_error for 5xx; param: the request field at fault, code: a reason such
as "context_length_exceeded"; each may be null).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import sys
import threading
import time
import traceback

from meshlab.infer import api
from meshlab.infer.api import BadRequest
from meshlab.infer.api_responses import TokenText
from meshlab.infer.guided import Grammars
from meshlab.infer.beam_call import BeamCall
from meshlab.infer.http_call import ENGINE_FAILED, Call
from meshlab.infer.metrics import CONTENT_TYPE, ServerMetrics, StatsLog


class Server:
    """Owns the engine thread and the ASGI server; `start()` returns once it is listening."""

    def __init__(self, engine, tokenizer, model_name: str = "meshlab", host: str = "127.0.0.1", port: int = 8000,
                 stop_token_ids=(), *, max_body_bytes: int = 1 << 20, body_timeout: float = 10.0,
                 max_concurrent: int = 512, max_waiting: int = 1024, max_n: int = 16, tool_format=None,
                 idle_warmup=(), api_key: str | None = None, stats_interval: float = 0.0, log=None,
                 trust_request_chat_template: bool = False, allowed_origins=()):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.created = int(time.time())       # /v1/models' `created`: when this server loaded the model
        self.tool_format = tool_format        # tool_choice "auto"'s tools.ToolFormat; None: the chat template's
        self.trust_templates = trust_request_chat_template   # a chat request's own chat_template formats it
        self.allowed_origins = list(allowed_origins)         # browser pages that may call the API (CORS)
        # warmup.WARMUP_KINDS' flags whose programs the engine thread compiles while it has no work, one
        # program at a time (a request then waits at most for the one being compiled)
        self.idle_warmup = list(idle_warmup)
        self.host, self.port = host, port
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.max_concurrent, self.max_waiting, self.max_n = max_concurrent, max_waiting, max_n
        engine.detokenize = tokenizer.decode
        engine.grammars = Grammars(tokenizer, engine.md.cfg.vocab_size)     # response_format's matchers
        self.token_text = TokenText(tokenizer)
        self.special_token_text = TokenText(tokenizer, skip_special_tokens=False)
        self.wake = threading.Event()
        self.running = True
        self.draining = False                 # drain(): new requests refused, those in flight finish
        self.api_key = api_key
        self.engine_error: str | None = None
        self.inflight = 0                     # HTTP generation requests being answered (event loop only)
        self.calls: set = set()               # their Call objects (event loop only)
        self.loop = None                      # the event loop, once a request came
        self.counts = {"rejected": 0, "aborted": 0}
        self.metrics = ServerMetrics(self)    # /metrics (meshlab/infer/metrics.py)
        # a throughput line every stats_interval seconds of work (0: none), to `log` (default: stderr)
        self.stats_log = StatsLog(engine, stats_interval, log or (lambda line: print(line, file=sys.stderr, flush=True)))
        self.pending: list = []               # (call, choice, done) events of the engine step running now
        self.deliveries = 0                   # hand-overs of events from the engine thread to the loop
        # Held by the engine thread while it works on the host (between its waits for the device), and by
        # the event loop while it formats chunks: see _engine_loop.
        self.host_lock = threading.Lock()
        self.engine_thread: int | None = None
        engine.device_wait = self._device_wait
        self.app = self._app()

    # -- engine thread --------------------------------------------------------------------
    def _engine_loop(self):
        """Steps the engine while it has work. The engine thread and the event loop share one interpreter
        lock, and a step's host work (scheduling, inputs, emitting tokens) is what the device waits for
        whenever the next call cannot be chained. So the engine thread holds `host_lock` for its host
        work and lets go only while it waits for the device (`_device_wait`), and the loop formats its
        chunks under the same lock: then, rather than both threads taking turns at the interpreter every
        switch interval, the engine's host work runs at its offline speed and the loop's fills the device
        waits."""
        self.engine_thread = threading.get_ident()
        while self.running:
            if not self.engine.has_work() and self.idle_warmup:
                try:
                    with self.host_lock:
                        if not self.engine.warmup(**self.idle_warmup[0], limit=1):
                            self.idle_warmup.pop(0)
                except Exception:  # noqa: BLE001 - a program that does not build now fails its first request instead
                    print(f"meshlab serve: warming while idle failed:\n{traceback.format_exc()}", file=sys.stderr,
                          flush=True)
                    self.idle_warmup = []
                continue
            if not self.engine.has_work():
                self.stats_log.maybe_log(time.monotonic())      # the last busy interval's line
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                with self.host_lock:
                    self.engine.step()
                    self._deliver_events()
                    self.stats_log.maybe_log(time.monotonic())
            except Exception:  # noqa: BLE001 - reported to every request and on /health, not swallowed
                self.engine_error = traceback.format_exc()
                print(f"meshlab serve: the engine failed:\n{self.engine_error}", file=sys.stderr, flush=True)
                if self.loop is not None:
                    self.loop.call_soon_threadsafe(self._fail_all)
                return

    @contextlib.contextmanager
    def _device_wait(self):
        """Engine.device_wait: the engine thread lets the event loop have host_lock while it waits."""
        mine = threading.get_ident() == self.engine_thread
        if mine:
            self.host_lock.release()
        try:
            yield
        finally:
            if mine:
                self.host_lock.acquire()

    def _deliver_events(self):
        """Hand the step's events to the event loop at once (engine thread): one wake-up of the loop per
        step, not one per request and step (each a write to the loop's self-pipe and a GIL hand-over
        while 128 streams decode)."""
        if not self.pending:
            return
        events, self.pending = self.pending, []
        if self.loop is None:                 # no HTTP request has come: nobody listens
            return
        self.deliveries += 1
        try:
            self.loop.call_soon_threadsafe(_put_events, events)
        except RuntimeError:                  # the loop is gone (server stopping)
            pass

    def _fail_all(self):
        """The engine is gone: every request in flight ends now with a 500 (or an error event)."""
        for call in list(self.calls):
            call.failed = True
            for i in range(len(call.done)):
                call.events.put_nowait((i, True))

    def start(self):
        import uvicorn
        # The engine thread and the event loop share one interpreter: the engine waits for the GIL after
        # each device call while the loop streams chunks; at the default 5 ms switch interval each such
        # handoff can wait 5 ms (the HTTP load test's TPOT was 9.9 ms against 7.0 offline). 0.2 ms bounds it.
        sys.setswitchinterval(2e-4)
        # What exists now (the engine, its compiled programs, the libraries) lives as long as the server:
        # out of the collector's way, a full collection no longer walks it (pauses of ~0.2-0.4 s under load
        # on the CPU here, every thread stopped).
        gc.collect()
        gc.freeze()
        # httptools / uvloop (the serve extra) when installed: the C parser and loop spend less of that
        # shared interpreter per streamed chunk than h11 / asyncio.
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", http="auto",
                                loop="auto", lifespan="off", timeout_keep_alive=5)
        self.uv = uvicorn.Server(config)
        self.threads = [threading.Thread(target=self._engine_loop, daemon=True, name="engine"),
                        threading.Thread(target=self.uv.run, daemon=True, name="http")]
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while not self.uv.started:
            if not self.threads[1].is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server did not start on {self.host}:{self.port} (port in use?)")
            time.sleep(0.01)
        self.port = self.uv.servers[0].sockets[0].getsockname()[1]
        return self

    def drain(self, timeout: float, cancel: threading.Event | None = None) -> bool:
        """Refuse new requests (503; /health answers 503 "draining", so a load balancer stops sending)
        and let those in flight finish, for at most `timeout` seconds or until `cancel` is set; True when
        all finished. What a server does on SIGTERM before it stops (scripts/serve.py): a rolling restart
        loses no answer."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.inflight or self.engine.has_work():
            if time.monotonic() > deadline or self.engine_error or (cancel is not None and cancel.is_set()):
                return False
            time.sleep(0.02)
        return True

    def stop(self):
        self.running = False
        self.uv.should_exit = True
        for t in self.threads:
            t.join(timeout=10)

    # -- the app --------------------------------------------------------------------------
    def _app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware
        from starlette.responses import JSONResponse, PlainTextResponse
        from starlette.routing import Route

        async def health(_):
            if self.engine_error:
                return JSONResponse({"status": "engine failed"}, 503)
            if self.draining:
                return JSONResponse({"status": "draining"}, 503)
            return JSONResponse({"status": "ok", "warming": bool(self.idle_warmup)})

        async def metrics(_):
            return PlainTextResponse(self.metrics.text(), media_type=CONTENT_TYPE)

        async def models(request):
            try:
                self._authorize(request)
            except BadRequest as e:
                return error(e)
            card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "meshlab",
                    "max_model_len": self.engine.sched.max_len}
            name = request.path_params.get("model")
            if name is None:
                return JSONResponse({"object": "list", "data": [card]})
            if name != self.model_name:                     # the route OpenAI's client.models.retrieve(name) calls
                return error(BadRequest(f"unknown model {name!r}; this server serves {self.model_name!r}", status=404,
                                        param="model", code="model_not_found"))
            return JSONResponse(card)

        async def tokens(request):
            try:
                self._authorize(request)
                body = await self._body(request)
                if request.url.path == "/tokenize":
                    return JSONResponse(api.tokenize(body, self.tok, self.engine.sched.max_len, self.trust_templates))
                return JSONResponse(api.detokenize(body, self.tok))
            except BadRequest as e:
                return error(e)

        async def completions(request):
            return await self._generate(request, chat=False)

        async def chat(request):
            return await self._generate(request, chat=True)

        async def not_found(request, exc):
            if exc.status_code == 405:
                return error(BadRequest(f"{request.method} {request.url.path} is not allowed", status=405))
            return error(BadRequest(f"no route {request.method} {request.url.path}; try /v1/completions, "
                                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health or /metrics",
                                    status=404))
        # A browser page of another origin may call the API only when its origin is listed: the middleware
        # answers its preflight OPTIONS (before the API key check, which a preflight cannot pass: browsers send
        # no Authorization with it) and marks the answers; unlisted, OPTIONS is the routes' 405 as before.
        cors = [Middleware(CORSMiddleware, allow_origins=self.allowed_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])] if self.allowed_origins else []
        return Starlette(routes=[Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
                                 Route("/v1/models/{model:path}", models),
                                 Route("/v1/completions", completions, methods=["POST"]),
                                 Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/tokenize", tokens, methods=["POST"]), Route("/detokenize", tokens, methods=["POST"])],
                         exception_handlers={HTTPException: not_found}, middleware=cors)

    def _authorize(self, request):
        """With an API key set (serve.py --api-key), the /v1 and token routes want `Authorization: Bearer <key>`, as
        OpenAI's clients send it; /health and /metrics stay open to probes and scrapers."""
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise BadRequest("missing or wrong API key: send the header `Authorization: Bearer <key>`", status=401,
                             code="invalid_api_key")

    async def _body(self, request) -> dict:
        """The JSON body, read with a size limit and a timeout (never waits on a short body)."""
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise BadRequest(f"request body of {length} bytes is over the limit of {self.max_body_bytes}"
                             if length.isdigit() else f"bad Content-Length {length!r}",
                             status=413 if length.isdigit() else 400)
        chunks, size = [], 0

        async def read():
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise BadRequest(f"request body is over the limit of {self.max_body_bytes} bytes", status=413)
                chunks.append(chunk)
        try:
            await asyncio.wait_for(read(), self.body_timeout)
        except asyncio.TimeoutError:
            raise BadRequest(f"request body not received within {self.body_timeout:g} s ({size} of "
                             f"{length or 'unknown'} bytes); send the whole body") from None
        try:
            return json.loads(b"".join(chunks) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None

    def _admit(self, n: int):
        if n > self.max_waiting:              # never admitted, however empty the queue: not worth a retry
            raise BadRequest(f"this request makes {n} engine requests (n times the prompts), more than the server "
                             f"queues at once (max_waiting {self.max_waiting}, serve.py --max-waiting); lower `n` or "
                             "send fewer prompts per request", param="n")
        if self.engine_error:
            raise BadRequest("the engine failed; restart the server (see its log)", status=503, retry_after=60)
        if self.draining:
            raise BadRequest("the server is shutting down; send the request to another replica or retry later",
                             status=503, retry_after=5)
        if self.inflight >= self.max_concurrent:
            raise BadRequest(f"{self.inflight} requests in flight, the limit is {self.max_concurrent}; retry later",
                             status=429, retry_after=1, code="rate_limit_exceeded")
        waiting = len(self.engine.sched.waiting) + self.engine.inbox.qsize()
        if waiting + n > self.max_waiting:
            raise BadRequest(f"the engine queue is full ({waiting} requests waiting); retry later",
                             status=503, retry_after=1)

    async def _generate(self, request, chat: bool):
        from starlette.responses import JSONResponse, Response, StreamingResponse
        self.loop = asyncio.get_running_loop()
        try:
            self._authorize(request)
            body = await self._body(request)
            plan = api.parse(body, chat, self.tok, self.model_name, self.engine.sched.max_len,
                             self.stop_token_ids, self.max_n, self.tool_format, self.trust_templates,
                             vocab_size=self.engine.md.cfg.vocab_size)
            self._admit(plan.choices)
            call = Call(self, plan) if plan.beam is None else BeamCall(self, plan)
        except BadRequest as e:
            self.counts["rejected"] += e.status in (413, 429, 503)
            return error(e)
        if plan.stream:
            return StreamingResponse(call.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"}, background=_Task(call.close))
        try:
            finished = await call.wait_all(request)
        finally:
            call.close()
        if call.failed:
            return error(BadRequest(ENGINE_FAILED["message"], status=500))
        if not finished:
            return Response(status_code=499)                       # nobody reads it
        with self.host_lock:
            return JSONResponse(call.whole())


def _put_events(events):
    for call, i, done in events:
        call.events.put_nowait((i, done))


class _Task:
    """A Starlette background task that runs a plain function (after the stream ends or breaks)."""

    def __init__(self, fn):
        self.fn = fn

    async def __call__(self):
        self.fn()


def error(e: BadRequest):
    from starlette.responses import JSONResponse
    # OpenAI's types: a client's fault (401 and 404 included) is an invalid_request_error, a rate limit's type
    # is "requests" (code rate_limit_exceeded), the server's fault a server_error
    kind = "requests" if e.status == 429 else "server_error" if e.status >= 500 else "invalid_request_error"
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}}, e.status,
                        headers=headers)
