"""An OpenAI-compatible HTTP server over the continuous-batching engine (Starlette on uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (with `"stream": true` for server-sent
events), GET /v1/models, /health, /metrics (Prometheus text). The request schemas are in
meshlab/infer/api.py. One engine thread runs `Engine.step` while there is work, so concurrent
requests share decode steps; the HTTP side is one asyncio loop, so a slow client holds no thread.

Limits, each answered at once: a body over `max_body_bytes` is 413; a body not received within
`body_timeout` seconds (shorter than its Content-Length) is 400; more than `max_concurrent` requests
in flight is 429, and more than `max_waiting` engine requests not yet admitted is 503 (both with a
Retry-After). A client that disconnects has its requests aborted (`Engine.abort`: slot and pages
freed at the next step). Every error is JSON {"error": {"message", "type", "param"}}.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import sys
import threading
import time
import traceback
import uuid

from meshlab.infer import api
from meshlab.infer.api import BadRequest
from meshlab.infer.guided import Grammars
from meshlab.infer.tools import tool_calls


class Server:
    """Owns the engine thread and the ASGI server; `start()` returns once it is listening."""

    def __init__(self, engine, tokenizer, model_name: str = "meshlab", host: str = "127.0.0.1", port: int = 8000,
                 stop_token_ids=(), *, max_body_bytes: int = 1 << 20, body_timeout: float = 10.0,
                 max_concurrent: int = 512, max_waiting: int = 1024, max_n: int = 16, tool_format=None,
                 idle_warmup=()):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.tool_format = tool_format        # tool_choice "auto"'s tools.ToolFormat; None: the chat template's
        # warmup.WARMUP_KINDS' flags whose programs the engine thread compiles while it has no work, one
        # program at a time (a request then waits at most for the one being compiled)
        self.idle_warmup = list(idle_warmup)
        self.host, self.port = host, port
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.max_concurrent, self.max_waiting, self.max_n = max_concurrent, max_waiting, max_n
        engine.detokenize = tokenizer.decode
        engine.grammars = Grammars(tokenizer, engine.md.cfg.vocab_size)     # response_format's matchers
        self.token_text = api.TokenText(tokenizer)
        self.wake = threading.Event()
        self.running = True
        self.engine_error: str | None = None
        self.inflight = 0                     # HTTP generation requests being answered (event loop only)
        self.calls: set = set()               # their Call objects (event loop only)
        self.loop = None                      # the event loop, once a request came
        self.counts = {"rejected": 0, "aborted": 0}
        self.finished = collections.deque(maxlen=1000)   # metrics of the last finished requests (ttft, tpot)
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
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                with self.host_lock:
                    self.engine.step()
                    self._deliver_events()
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

    def stop(self):
        self.running = False
        self.uv.should_exit = True
        for t in self.threads:
            t.join(timeout=10)

    # -- the app --------------------------------------------------------------------------
    def _app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.responses import JSONResponse, PlainTextResponse
        from starlette.routing import Route

        async def health(_):
            if self.engine_error:
                return JSONResponse({"status": "engine failed"}, 503)
            return JSONResponse({"status": "ok", "warming": bool(self.idle_warmup)})

        async def metrics(_):
            return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4")

        async def models(_):
            return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                             "owned_by": "meshlab"}]})

        async def completions(request):
            return await self._generate(request, chat=False)

        async def chat(request):
            return await self._generate(request, chat=True)

        async def not_found(request, exc):
            if exc.status_code == 405:
                return error(BadRequest(f"{request.method} {request.url.path} is not allowed", status=405))
            return error(BadRequest(f"no route {request.method} {request.url.path}; try /v1/completions, "
                                    "/v1/chat/completions, /v1/models, /health or /metrics", status=404))
        return Starlette(routes=[Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
                                 Route("/v1/completions", completions, methods=["POST"]),
                                 Route("/v1/chat/completions", chat, methods=["POST"])],
                         exception_handlers={HTTPException: not_found})

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
        if self.engine_error:
            raise BadRequest("the engine failed; restart the server (see its log)", status=503, retry_after=60)
        if self.inflight >= self.max_concurrent:
            raise BadRequest(f"{self.inflight} requests in flight, the limit is {self.max_concurrent}; retry later",
                             status=429, retry_after=1)
        waiting = len(self.engine.sched.waiting) + self.engine.inbox.qsize()
        if waiting + n > self.max_waiting:
            raise BadRequest(f"the engine queue is full ({waiting} requests waiting); retry later",
                             status=503, retry_after=1)

    async def _generate(self, request, chat: bool):
        from starlette.responses import JSONResponse, Response, StreamingResponse
        self.loop = asyncio.get_running_loop()
        try:
            body = await self._body(request)
            plan = api.parse(body, chat, self.tok, self.model_name, self.engine.sched.max_len,
                             self.stop_token_ids, self.max_n, self.tool_format)
            self._admit(plan.choices)
            call = Call(self, plan)
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
            return error(BadRequest("the engine failed while answering; see the server's log", status=500))
        if not finished:
            return Response(status_code=499)                       # nobody reads it
        with self.host_lock:
            return JSONResponse(call.whole())

    def metrics_text(self) -> str:
        s, sched = self.engine.stats, self.engine.sched
        done = list(self.finished)
        ttft = [m["ttft_s"] for m in done if m["ttft_s"] is not None]
        tpot = [m["tpot_s"] for m in done if m["tpot_s"] is not None]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
        rows = [("requests_finished_total", s["requests_finished"]), ("prompt_tokens_total", s["prompt_tokens"]),
                ("generated_tokens_total", s["generated_tokens"]), ("engine_steps_total", s["steps"]),
                ("device_calls_total", s["device_calls"]), ("preemptions_total", s["preemptions"]),
                # calls dispatched before the one before was read back: chained decode calls, overlapped steps
                ("chained_calls_total", s["chained_calls"]), ("overlapped_calls_total", s["overlapped_calls"]),
                ("requests_running", len(sched.running())), ("requests_waiting", len(sched.waiting)),
                ("free_cache_pages", len(sched.pool.free)), ("http_requests_inflight", self.inflight),
                ("http_requests_rejected_total", self.counts["rejected"]),
                ("requests_aborted_total", self.counts["aborted"]), ("ttft_seconds_mean", mean(ttft)),
                ("tpot_seconds_mean", mean(tpot)),
                # prompt positions whose logprobs were computed (echo with logprobs), requests held to a grammar
                ("prompt_tokens_scored_total", s.get("scored_tokens", 0)),
                ("guided_requests_total", s.get("guided_requests", 0)),
                # prompt positions whose scores came from the score store; admissions put off while the
                # next prompt page was in flight (computed or scored by a running request)
                ("prompt_tokens_score_cached_total", sched.counts["stored_scores"]),
                ("prefix_waits_total", sched.counts["prefix_waits"]),
                ("generation_tokens_per_second", s["generated_tokens"] / s["busy_s"] if s["busy_s"] else 0.0)]
        return "".join(f"meshlab_{k} {v}\n" for k, v in rows)


def _ignore(*_):
    pass


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
    kind = {404: "not_found_error", 429: "rate_limit_error", 500: "server_error",
            503: "server_overloaded"}.get(e.status, "invalid_request_error")
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param}}, e.status, headers=headers)


class Call:
    """The engine requests of one HTTP request (n choices) and their events, on the event loop."""

    def __init__(self, server: Server, plan: api.Plan):
        self.server, self.plan = server, plan
        self.id = f"{'chatcmpl' if plan.chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        self.created = int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        self.closed, self.failed, self.lock = False, False, threading.Lock()
        self.loop = asyncio.get_running_loop()
        self.n, n = len(plan.params), plan.choices
        self.reqs = [None] * n if plan.submits else []
        self.done = [not plan.submits] * n
        self.echoed = [False] * n             # the echoed prompt sent (with prompt logprobs: at the choice's first event)
        self.shown = [0] * n                  # characters of each choice's text already streamed
        self.lp_sent = [0] * n                # tokens whose logprobs were streamed
        self.counted = [0] * n                # tokens counted in the last chunk's usage (continuous usage)
        head = {"id": self.id, "object": "chat.completion.chunk" if plan.chat else "text_completion",
                "created": self.created, "model": server.model_name}
        self.head = "data: " + json.dumps(head)[:-1] + ', "choices": ['    # every chunk's start, encoded once
        server.inflight += 1
        server.calls.add(self)
        if plan.submits:
            try:                              # each prompt's first copy (its n - 1 others: _submit_copies)
                for i in range(0, n, self.n):
                    self.reqs[i] = server.engine.add_request(plan.prompts[i // self.n], plan.params[0],
                                                             on_event=self._on_event(i))
            except ValueError as e:           # AdmissionError included
                self.close()
                raise BadRequest(str(e)) from None
        server.wake.set()

    def _on_event(self, i: int):
        """on_event for choice i (engine thread). A prompt's copies 1..n-1 are submitted at copy 0's first
        event: its prompt pages are in the prefix cache by then, so the copies do not prefill them again."""
        def put(_req, _new, done):
            if i % self.n == 0 and self.n > 1 and self.reqs and self.reqs[i + 1] is None:
                self._submit_copies(i)
            self.server.pending.append((self, i, done))     # delivered after the step (_deliver_events)
        return put

    def _submit_copies(self, first: int):
        with self.lock:                       # close() on the event loop sees every request submitted
            if self.closed:
                return
            for j in range(1, self.n):
                self.reqs[first + j] = self.server.engine.add_request(
                    self.plan.prompts[first // self.n], self.plan.params[j], on_event=self._on_event(first + j))
        self.server.wake.set()

    def close(self):
        """Abort what is still running (the client is gone), once; record the finished ones' metrics."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.server.inflight -= 1
        self.server.calls.discard(self)
        for r in self.reqs:
            if r is None:
                continue
            if r.finish_reason is None:
                self.server.engine.abort(r)
                self.server.counts["aborted"] += 1
            else:
                self.server.finished.append(r.metrics)
            # the request's callback held this call, and the call its requests: without the cycle, both
            # (and every token's logprobs) go at once instead of waiting for a full collection
            r.on_event = _ignore
        self.server.wake.set()

    async def _next(self):
        i, done = await self.events.get()
        self.done[i] = self.done[i] or done
        return i, done

    async def _ready(self) -> dict:
        """{choice: finished} for every event queued now (at least one awaited): a stream that fell behind
        the engine answers what piled up in one chunk per choice, not one per engine step."""
        i, done = await self._next()
        got = {i: done}
        while not self.events.empty():
            i, done = self.events.get_nowait()
            self.done[i] = self.done[i] or done
            got[i] = got.get(i, False) or done
        return got

    async def wait_all(self, request) -> bool:
        """Until every choice finished (True); False when the client disconnected first (close() aborts)."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while not all(self.done):
                nxt = asyncio.ensure_future(self._next())
                await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    return False
            return True
        finally:
            gone.cancel()

    # -- output -----------------------------------------------------------------------------
    def _text(self, i: int, final: bool) -> str:
        return api.visible(self.reqs[i], final) if self.reqs and self.plan.generate else ""

    def _logprobs(self, i: int, start: int, end: int, offset: int, before=None):
        if self.plan.logprobs is None:
            return None
        r, text = self.reqs[i], self.server.token_text
        toks, entries = (r.output[start:end], r.logprobs[start:end]) if self.plan.generate else ([], [])
        return (api.chat_logprobs(text, toks, entries) if self.plan.chat
                else api.completion_logprobs(text, toks, entries, offset, before))

    def _echoed(self, i: int) -> str:
        return self.plan.prompt_texts[i // self.n] if self.plan.echo else ""

    def _prompt_logprobs(self, i: int) -> dict:
        """Choice i's echoed prompt's logprobs: the prompt's first copy's, put together at its first
        token (the other copies are submitted after it: _on_event)."""
        first = self.reqs[i - i % self.n]
        return api.completion_logprobs(self.server.token_text, self.plan.prompts[i // self.n],
                                       first.prompt_logprobs or [], 0)

    def _covered(self, i: int, text: str, final: bool, start: int = 0) -> int:
        if self.plan.logprobs is None or not self.plan.generate:
            return 0
        r = self.reqs[i]
        # every decoding asked for is of a prefix of the output: the request keeps its last one
        return api.covered_tokens(lambda ids: r.decoded(len(ids)), r.output, text, final, start)

    def _finish(self, i: int) -> str:
        return self.reqs[i].finish_reason if self.reqs and self.plan.generate else "length"

    def whole(self) -> dict:
        p, choices = self.plan, []
        for i in range(p.choices):
            text = self._text(i, True)
            before = self._prompt_logprobs(i) if p.prompt_logprobs is not None else None
            lp = self._logprobs(i, 0, self._covered(i, text, True), len(self._echoed(i)), before)
            choice = {"index": i, "logprobs": lp, "finish_reason": self._finish(i)}
            content, calls = self._calls(i, text)
            if calls:                              # whole calls (not cut by max_tokens)
                choice.update(message={"role": "assistant", "content": content, "tool_calls": calls},
                              finish_reason="tool_calls")
            elif p.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = self._echoed(i) + text
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if p.chat else "text_completion", "created": self.created,
                "model": self.server.model_name, "choices": choices, "usage": self._usage()}

    def _usage(self) -> dict:
        made = sum(len(r.output) for r in self.reqs if r is not None) if self.plan.generate else 0
        return api.usage(sum(map(len, self.plan.prompts)), made)

    def _calls(self, i: int, text: str) -> tuple:
        """(content, tool_calls or None) of choice i's whole reply."""
        if self.plan.tool_call:
            return None, tool_calls(text)
        if self.plan.tool_format is not None:
            return self.plan.tool_format.read(text, self.plan.tool_names)
        return text, None

    def _chunk(self, i: int, text: str, finish, logprobs, role: bool = False, calls=None) -> bytes:
        choice = {"index": i, "logprobs": logprobs, "finish_reason": finish}
        if calls:                                  # the tool calls, whole, in the choice's last chunk
            choice.update(delta={"tool_calls": [dict(index=j, **c) for j, c in enumerate(calls)]},
                          finish_reason="tool_calls")
        elif self.plan.chat:
            choice["delta"] = dict({"role": "assistant"} if role else {}, **({"content": text} if text or role
                                                                           else {}))
        else:
            choice["text"] = text
        usage = ""
        if self.plan.continuous_usage:         # this choice's tokens so far (vLLM's continuous_usage_stats)
            usage = f', "usage": {json.dumps(api.usage(len(self.plan.prompts[i // self.n]), self.counted[i]))}'
        return f"{self.head}{json.dumps(choice)}]{usage}}}\n\n".encode()

    def _delta(self, i: int, final: bool) -> bytes | None:
        """The chunk for what choice i added since the last one (None: nothing new to show), after the
        echoed prompt with its logprobs at the choice's first event when those were asked for. A tool
        call's reply is sent whole when it ends (its JSON is not the message's content); under
        tool_choice "auto" the text is sent up to where a call may open, and the calls when it ends."""
        if self.plan.tool_call:
            calls = tool_calls(self._text(i, True)) if final else None
            return self._chunk(i, "" if calls else self._text(i, True), self._finish(i), None, calls=calls) \
                if final else None
        if self.plan.tool_format is not None:
            return self._auto_delta(i, final)
        echo = b""
        if self.plan.prompt_logprobs is not None and not self.echoed[i]:
            self.echoed[i] = True
            echo = self._chunk(i, self._echoed(i), None, self._prompt_logprobs(i))
        text = self._text(i, final)
        new, k0 = text[self.shown[i]:], self.lp_sent[i]
        k = self._covered(i, text, final, k0)
        n = len(self.reqs[i].output) if self.reqs else 0
        grew = self.plan.continuous_usage and n > self.counted[i]   # a chunk for every new token then
        if not new and k == k0 and not final and not grew:
            return echo or None
        offset = self.shown[i] + len(self._echoed(i))
        lp = self._logprobs(i, k0, k, offset) if k > k0 or final else None
        self.shown[i], self.lp_sent[i], self.counted[i] = len(text), k, n
        return echo + self._chunk(i, new, self._finish(i) if final else None, lp)

    def _auto_delta(self, i: int, final: bool) -> bytes | None:
        """_delta under tool_choice "auto" (chat, no echo): content while it surely is content; at the
        end the held text, or the content before the calls and then the calls."""
        text = self._text(i, final)
        if final:
            content, calls = self._calls(i, text)
            text = (content or "") if calls else text
        else:
            calls = None
            text = text[:max(self.shown[i], self.plan.tool_format.streamable(text))]
        new, k0 = text[self.shown[i]:], self.lp_sent[i]
        k = self._covered(i, text, final and not calls, k0)
        if not new and k == k0 and not final:
            return None
        lp = self._logprobs(i, k0, k, self.shown[i]) if k > k0 else None
        self.shown[i], self.lp_sent[i], self.counted[i] = len(text), k, len(self.reqs[i].output) if self.reqs else 0
        if not calls:
            return self._chunk(i, new, self._finish(i) if final else None, lp)
        return (self._chunk(i, new, None, lp) if new or lp else b"") + self._chunk(i, "", None, None, calls=calls)

    async def sse(self):
        """Server-sent events: one chunk per choice as its text grows, then [DONE]. Cancelled when the
        client disconnects (Starlette watches for it), and close() then aborts the requests."""
        try:
            for i in range(self.plan.choices):
                if self.plan.chat:
                    yield self._chunk(i, "", None, None, role=True)
                elif self.plan.echo and self.plan.prompt_logprobs is None:
                    yield self._chunk(i, self._echoed(i), None, None)
            for i in range(self.plan.choices):
                if not self.reqs:
                    yield self._chunk(i, "", "length", None)
            while not all(self.done):
                ready = await self._ready()
                if self.failed:
                    yield f"data: {json.dumps({'error': {'message': 'the engine failed', 'type': 'server_error'}})}\n\n"
                    return
                with self.server.host_lock:           # not while the engine thread works on the host
                    chunks = [c for c in (self._delta(i, done) for i, done in sorted(ready.items())) if c]
                if chunks:
                    yield b"".join(chunks)
            if self.plan.include_usage:
                obj = {"id": self.id, "object": "chat.completion.chunk" if self.plan.chat else "text_completion",
                       "created": self.created, "model": self.server.model_name, "choices": [],
                       "usage": self._usage()}
                yield f"data: {json.dumps(obj)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            self.close()


async def _disconnected(request) -> None:
    """Returns when the client has gone (its body already read: the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
