"""Beam search as an HTTP request's answer: BeamCall runs meshlab.infer.beam's rounds on the server's
event loop over the engine, and answers as a Call of sampled choices does."""
from __future__ import annotations

import asyncio
import dataclasses

from meshlab.infer.beam import Beam, best_beams, next_beams
from meshlab.infer.http_call import Call, _disconnected
from meshlab.infer.sampler import SamplingParams
from meshlab.infer.scheduler import Request, output_decoder


class BeamCall(Call):
    """A Call whose choices come from beam search over each prompt (the plan's n is the width): the
    rounds run on the event loop as one task; the choices are put together as finished Requests, so
    whole() answers as for sampled choices. Streaming is refused at parse (the beams are only known
    at the end)."""

    observes = False                          # a round's one-token requests are not the server's requests

    def _owned(self) -> list:
        return self.round                     # close() aborts the round running (the client is gone)

    def __init__(self, server, plan):
        self.length_penalty = plan.beam
        super().__init__(server, dataclasses.replace(plan, generate=False))   # Call submits nothing
        self.plan, self.reqs = plan, [None] * plan.choices
        self.round = []                       # the engine requests of the round running now
        self.search = asyncio.ensure_future(self._search_all())

    def _round_event(self, j: int):
        def put(_req, _new, done):
            self.server.pending.append((self, j, done))      # delivered after the step, as Call's
        return put

    async def _round(self, prompt: list, beams: list, k: int) -> list:
        """Each beam's candidates {token: logprob}: one-token greedy requests, sent together."""
        params = SamplingParams(max_tokens=1, logprobs=k)
        with self.lock:
            if self.closed:
                raise asyncio.CancelledError
            self.round = [self.server.engine.add_request(prompt + b.output, params, on_event=self._round_event(j))
                          for j, b in enumerate(beams)]
        self.done = [False] * len(beams)
        self.server.wake.set()
        while not all(self.done):
            await self._next()
            if self.failed:
                raise RuntimeError("the engine failed")
        return [r.logprobs[0][1] for r in self.round]

    async def _search(self, prompt: list) -> list:
        p = self.plan.params[0]
        width, stops = len(self.plan.params), frozenset(p.stop_token_ids)
        live, finished = [Beam([])], []
        for _ in range(p.max_tokens):
            candidates = await self._round(prompt, live, 2 * width)
            live, done = next_beams(live, candidates, width, stops, p.include_stop_str_in_output)
            finished += done
            if not live:
                break
        return best_beams(finished, live, width, len(prompt), self.length_penalty)

    async def _search_all(self) -> None:
        """The prompts one after another (a round's beams already fill a step), each beam a choice."""
        p = self.plan.params[0]
        decode = output_decoder(self.server.engine.detokenize, p)
        for i, prompt in enumerate(self.plan.prompts):
            for j, beam in enumerate(await self._search(prompt)):
                self.reqs[i * self.n + j] = Request(prompt, p, output=beam.output, finish_reason=beam.finish_reason,
                                                    detokenize=decode)
        self.done = [True] * self.plan.choices

    async def wait_all(self, request) -> bool:
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({self.search, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not self.search.done():
                self.search.cancel()
                return False
            if self.search.cancelled() or self.search.exception() is not None:
                self.failed = True
            return True
        finally:
            gone.cancel()
