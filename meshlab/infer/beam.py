"""Beam search through the serving engine (vLLM's `use_beam_search`, width `n`), as vLLM runs it: in
rounds above the engine, not inside it.

Each round sends every live beam as a one-token greedy request asking for its 2 x width most likely
next tokens (logprobs of the raw logits); each candidate extends its beam's summed logprob; a stop
token (the end of sequence unless ignore_eos, and stop_token_ids) finishes the beam it extends, and
the width best of the rest live on. After max_tokens rounds the finished and the live beams are
ranked by summed logprob / length ** length_penalty (the length counts the prompt, as vLLM's does)
and the width best are the choices. The rounds' requests share the prompt's pages through the
prefix cache, so a round feeds each beam only the tokens past its last full page.

What it costs: one engine step per round at least (a decode step's latency per output token, the
beams batched together), and logprobs over 2 x width candidates (so width <= MAX_TOP_LOGPROBS / 2).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

from meshlab.infer.api import MAX_TOP_LOGPROBS, BadRequest, body_field
from meshlab.infer.http_call import Call, _disconnected
from meshlab.infer.sampler import SamplingParams
from meshlab.infer.scheduler import Request, with_special_tokens


# SamplingParams that beam search leaves at their defaults: it ranks beams by the
# raw logits' logprobs alone -> the request fields that set them
_NOT_BEAMED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
               "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
               "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias", "min_tokens": "min_tokens",
               "stop": "stop", "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs / echo's logprobs",
               "grammar": "response_format / structured_outputs / tools"}


def beam_penalty(body, p: SamplingParams, n: int, streamed_or_tools: bool) -> Optional[float]:
    """None without vLLM's use_beam_search; else its length_penalty (1.0 by default), once the request
    asks nothing beam search here does not do (a 400 names it)."""
    if not body_field(body, "use_beam_search", bool, False):
        return None
    penalty = body_field(body, "length_penalty", float, 1.0)
    if n > MAX_TOP_LOGPROBS // 2:
        raise BadRequest(f"`n`={n} is the beam width with use_beam_search, at most {MAX_TOP_LOGPROBS // 2} (each "
                         f"round ranks 2n candidates a beam)", param="n")
    if streamed_or_tools:
        raise BadRequest("`use_beam_search` answers when the search ends: send it without stream, max_tokens 0 or "
                         "tools", param="use_beam_search")
    plain = SamplingParams()
    asked = [name for field, name in _NOT_BEAMED.items() if getattr(p, field) != getattr(plain, field)]
    if asked:
        raise BadRequest(f"`use_beam_search` ranks beams by the model's logprobs alone; leave out {', '.join(asked)}",
                         param="use_beam_search")
    return penalty


@dataclasses.dataclass
class Beam:
    output: list               # the tokens after the prompt
    logprob: float = 0.0       # their summed logprobs
    finish_reason: str | None = None
    kept_stop: bool = False    # output ends with the stop token that finished it (include_stop_str_in_output)

    def score(self, prompt_len: int, length_penalty: float) -> float:
        """vLLM's ranking: summed logprob over the length ** length_penalty, a stop token not counted."""
        return self.logprob / (prompt_len + len(self.output) - self.kept_stop) ** length_penalty


def next_beams(beams: list, candidates: list, width: int, stops, keep_stop: bool) -> tuple[list, list]:
    """One round: (the width best live beams, the beams a stop token finished) from each live beam's
    candidates {token: logprob}, best first by summed logprob (ties: the earlier beam and candidate)."""
    live, done = [], []
    for beam, cand in zip(beams, candidates):
        for t, lp in cand.items():
            if t in stops:
                done.append(Beam(beam.output + [t] if keep_stop else list(beam.output), beam.logprob + lp, "stop",
                                 keep_stop))
            else:
                live.append(Beam(beam.output + [t], beam.logprob + lp))
    live.sort(key=lambda b: -b.logprob)
    return live[:width], done


def best_beams(finished: list, live: list, width: int, prompt_len: int, length_penalty: float) -> list:
    """The width best of the finished and the still-live beams (those end by length)."""
    for b in live:
        b.finish_reason = "length"
    return sorted(finished + live, key=lambda b: -b.score(prompt_len, length_penalty))[:width]


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
            candidates = await self._round(prompt, live, min(2 * width, MAX_TOP_LOGPROBS))
            live, done = next_beams(live, candidates, width, stops, p.include_stop_str_in_output)
            finished += done
            if not live:
                break
        return best_beams(finished, live, width, len(prompt), self.length_penalty)

    async def _search_all(self) -> None:
        """The prompts one after another (a round's beams already fill a step), each beam a choice."""
        p, decode = self.plan.params[0], self.server.engine.detokenize
        for i, prompt in enumerate(self.plan.prompts):
            for j, beam in enumerate(await self._search(prompt)):
                r = Request(prompt, p, output=beam.output, finish_reason=beam.finish_reason)
                r.detokenize = decode if p.skip_special_tokens else with_special_tokens(decode, p)
                self.reqs[i * self.n + j] = r
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
