"""One HTTP request's engine requests (its n choices) and its answer: the whole JSON body, or its
server-sent events as the choices grow (meshlab/infer/server.py routes requests here; the schemas
are meshlab/infer/api.py's and api_responses.py's). Runs on the server's event loop; the engine thread
hands it events.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from meshlab.infer import api, api_responses as responses
from meshlab.infer.api import BadRequest
from meshlab.infer.scheduler import AdmissionError


# A stream's last event when the engine fails mid-answer: OpenAI's error object, as a 500 body's
ENGINE_FAILED = {"message": "the engine failed while answering; see the server's log", "type": "server_error",
                 "param": None, "code": None}


def _ignore(*_):
    pass


class Call:
    """The engine requests of one HTTP request (n choices) and their events, on the event loop; `server`
    is the meshlab.infer.server.Server that owns the engine and the event loop."""

    def __init__(self, server, plan: api.Plan):
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
        self.lp_end = [None] * n              # completions: the text_offset after them (None: the echo's length)
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
            except ValueError as e:           # a grammar llguidance refuses, or more KV pages than the cache has
                self.close()
                raise BadRequest(str(e), param="max_tokens" if isinstance(e, AdmissionError) else None) from None
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

    observes = True                           # the finished requests' metrics go to the server's histograms

    def _owned(self) -> list:
        """The engine requests this call submitted that may still run."""
        return [r for r in self.reqs if r is not None]

    def close(self):
        """Abort what is still running (the client is gone), once; record the finished ones' metrics."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.server.inflight -= 1
        self.server.calls.discard(self)
        for r in self._owned():
            if r.finish_reason is None:
                self.server.engine.abort(r)
                self.server.counts["aborted"] += 1
            elif self.observes:
                self.server.metrics.observe(r.metrics)
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
        return responses.visible(self.reqs[i], final) if self.reqs and self.plan.generate else ""

    def _logprobs(self, i: int, start: int, end: int, offset: int, before=None):
        if self.plan.logprobs is None:
            return None
        r, text = self.reqs[i], self._token_text()
        toks, entries = (r.output[start:end], r.logprobs[start:end]) if self.plan.generate else ([], [])
        return (responses.chat_logprobs(text, toks, entries) if self.plan.chat
                else responses.completion_logprobs(text, toks, entries, offset, before))

    def _token_text(self):
        text = self.server.special_token_text if self.plan.special_tokens else self.server.token_text
        return responses.token_id_text(text) if self.plan.token_ids else text

    def _echoed(self, i: int) -> str:
        if self.plan.chat:
            return self.plan.reply_prefix
        return self.plan.prompt_texts[i // self.n] if self.plan.echo else ""

    def _prompt_logprobs(self, i: int) -> dict:
        """Choice i's echoed prompt's logprobs: the prompt's first copy's, put together at its first
        token (the other copies are submitted after it: _on_event)."""
        first = self.reqs[i - i % self.n]
        return responses.completion_logprobs(self._token_text(), self.plan.prompts[i // self.n],
                                             first.prompt_logprobs or [], 0)

    def _covered(self, i: int, text: str, final: bool, start: int = 0) -> int:
        if self.plan.logprobs is None or not self.plan.generate:
            return 0
        r = self.reqs[i]
        # every decoding asked for is of a prefix of the output: the request keeps its last one
        return responses.covered_tokens(lambda ids: r.decoded(len(ids)), r.output, text, final, start)

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
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                choice["finish_reason"] = self._finish(i) if p.named_call else "tool_calls"
            elif p.chat:
                choice["message"] = {"role": "assistant", "content": self._echoed(i) + text}
            else:
                choice["text"] = self._echoed(i) + text
            if p.prompt_scores is not None and not p.chat:
                choice["prompt_logprobs"] = self._prompt_scores(i)
            choices.append(choice)
        body = {"id": self.id, "object": "chat.completion" if p.chat else "text_completion", "created": self.created,
                "model": self.server.model_name, "choices": choices, "usage": self._usage()}
        if p.prompt_scores is not None and p.chat:           # vLLM's chat: one list, beside the choices
            body["prompt_logprobs"] = self._prompt_scores(0)
        return body

    def _prompt_scores(self, i: int) -> list:
        """Choice i's prompt in vLLM's prompt_logprobs form, from its prompt's first copy's scores."""
        first = self.reqs[i - i % self.n]
        return responses.prompt_logprobs_list(self._token_text(), self.plan.prompts[i // self.n], first.prompt_logprobs,
                                              self.plan.prompt_scores, self.plan.token_ids)

    def _usage(self) -> dict:
        made = sum(len(r.output) for r in self.reqs if r is not None) if self.plan.generate else 0
        return responses.usage(sum(map(len, self.plan.prompts)), made)

    def _calls(self, i: int, text: str) -> tuple:
        """(content, tool_calls or None) of choice i's whole reply."""
        if self.plan.tool_format is None:
            return text, None
        content, calls = self.plan.tool_format.read(text, self.plan.tool_names)
        return content, calls[:1] if calls and self.plan.one_call else calls

    def _chunk(self, i: int, text: str, finish, logprobs, role: bool = False, calls=None) -> bytes:
        choice = {"index": i, "logprobs": logprobs, "finish_reason": finish}
        if calls:                                  # the tool calls, whole, in the choice's last chunk
            choice["delta"] = {"tool_calls": [dict(index=j, **c) for j, c in enumerate(calls)]}
            choice["finish_reason"] = finish if self.plan.named_call else "tool_calls"
        elif self.plan.chat:
            choice["delta"] = dict({"role": "assistant"} if role else {}, **({"content": text} if text or role
                                                                           else {}))
        else:
            choice["text"] = text
        usage = ""
        if self.plan.continuous_usage:         # this choice's tokens so far (vLLM's continuous_usage_stats)
            usage = f', "usage": {json.dumps(responses.usage(len(self.plan.prompts[i // self.n]), self.counted[i]))}'
        elif self.plan.include_usage:          # OpenAI's: every chunk before the usage chunk has a null usage
            usage = ', "usage": null'
        return f"{self.head}{json.dumps(choice)}]{usage}}}\n\n".encode()

    def _delta(self, i: int, final: bool) -> bytes | None:
        """The chunk for what choice i added since the last one (None: nothing new to show), after the
        echoed prompt with its logprobs at the choice's first event when those were asked for. A tool
        call's reply is sent whole when it ends (its JSON is not the message's content); under
        tool_choice "auto" the text is sent up to where a call may open, and the calls when it ends."""
        if self.plan.tool_call:
            if not final:
                return None
            content, calls = self._calls(i, self._text(i, True))
            return self._chunk(i, "" if calls else content, self._finish(i), None, calls=calls)
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
        # text_offset goes on from the last token streamed, as in the whole answer (a token's offset moves by its own
        # text, U+FFFD for part of a character, which the shown text may still hold back)
        offset = len(self._echoed(i)) if self.lp_end[i] is None else self.lp_end[i]
        lp = self._logprobs(i, k0, k, offset) if k > k0 or final else None
        if lp is not None and not self.plan.chat:
            self.lp_end[i] = offset + sum(len(self._token_text()(t)[0]) for t in self.reqs[i].output[k0:k])
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
                    yield self._chunk(i, self._echoed(i), None, None, role=True)
                elif self.plan.echo and self.plan.prompt_logprobs is None:
                    yield self._chunk(i, self._echoed(i), None, None)
            for i in range(self.plan.choices):
                if not self.reqs:
                    yield self._chunk(i, "", "length", None)
            while not all(self.done):
                ready = await self._ready()
                if self.failed:
                    yield f"data: {json.dumps({'error': ENGINE_FAILED})}\n\n"
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
