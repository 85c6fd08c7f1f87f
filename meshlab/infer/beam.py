"""Beam search through the serving engine (vLLM's `use_beam_search`, width `n`), as vLLM runs it: in
rounds above the engine, not inside it.

Each round sends every live beam as a one-token greedy request asking for its 2 x width most likely
next tokens (logprobs of the raw logits); each candidate extends its beam's summed logprob; a stop
token (the end of sequence unless ignore_eos, and stop_token_ids) finishes the beam it extends, and
the width best of the rest live on. After max_tokens rounds the finished and the live beams are
ranked by summed logprob / length ** length_penalty (the length counts the prompt, as vLLM's does)
and the width best are the choices. The rounds' requests share the prompt's pages through the
prefix cache, so a round feeds each beam only the tokens past its last full page. The rounds run
as meshlab.infer.beam_call's BeamCall, on the server's event loop.

What it costs: one engine step per round at least (a decode step's latency per output token, the
beams batched together), and logprobs over 2 x width candidates (so width <= MAX_WIDTH).
"""
from __future__ import annotations

import dataclasses

from meshlab.infer.programs import TOP_LOGPROBS
from meshlab.infer.sampler import SamplingParams

MAX_WIDTH = TOP_LOGPROBS // 2          # a round asks each beam for its 2 x width best next tokens


# SamplingParams that beam search leaves at their defaults: it ranks beams by the
# raw logits' logprobs alone -> the request fields that set them
_NOT_BEAMED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
               "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
               "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias", "min_tokens": "min_tokens",
               "stop": "stop", "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs / echo's logprobs",
               "grammar": "response_format / structured_outputs / tools", "allowed_token_ids": "allowed_token_ids",
               "bad_words_ids": "bad_words"}


class BeamError(ValueError):
    """A beam search request asking for what it does not do; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_beam(p: SamplingParams, n: int, streamed_or_tools: bool) -> None:
    """BeamError unless the request asks nothing beam search here does not do: width n <= MAX_WIDTH,
    no stream, tools or max_tokens 0, the sampling fields at their defaults."""
    if n > MAX_WIDTH:
        raise BeamError(f"`n`={n} is the beam width with use_beam_search, at most {MAX_WIDTH} (each round ranks "
                        f"2n candidates a beam)", param="n")
    if streamed_or_tools:
        raise BeamError("`use_beam_search` answers when the search ends: send it without stream, max_tokens 0 or "
                        "tools", param="use_beam_search")
    plain = SamplingParams()
    asked = [name for field, name in _NOT_BEAMED.items() if getattr(p, field) != getattr(plain, field)]
    if asked:
        raise BeamError(f"`use_beam_search` ranks beams by the model's logprobs alone; leave out {', '.join(asked)}",
                        param="use_beam_search")


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
