"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and its most
likely alternatives (OpenAI completions' `echo` with `logprobs`: how evaluation harnesses such as
lm-evaluation-harness score a continuation).

The packed steps compute them (programs._prompt_scores), batched with whatever else the step
feeds: a step with a chunk row of a request that asks for them (SamplingParams.prompt_logprobs)
runs the LM head over every chunk-row token too, at the next prompt token (the step's `targets`
input), and its TOP_LOGPROBS best when some row asks for alternatives. Only such steps pay for it
(a program per bucket and score flag, compiled at its first use): [chunk, vocab] fp32 logits per
chunk row, one row at a time, and a top-k over the vocabulary per token (k = 0, 1 or TOP_LOGPROBS:
the most any row of the step asks for, rounded up).

A request computes what it scores: the prefix cache serves it no page it has not scored yet
(Scheduler._prefix_hit), so a prompt met before is fed again, and a preempted request takes back
only pages it scored before it was preempted. Each step's score outputs stay on the device, held
by the rows it scored (Request.score_parts), and are read back once, when the request's first
token is emitted (Engine._emit): no step waits for them.
"""
from __future__ import annotations

import numpy as np

from meshlab.infer.programs import TOP_LOGPROBS
from meshlab.infer.sampler import SamplingParams

SCORE_KEYS = ("prompt_logprob", "prompt_top_logprob", "prompt_top_id")   # a scoring packed step's extra outputs


class StepScores:
    """One packed step's score outputs (SCORE_KEYS) on the device; read back once for all its rows."""
    __slots__ = ("out", "_host")

    def __init__(self, out: dict):
        self.out, self._host = out, None

    def host(self) -> dict:
        if self._host is None:
            self._host = {k: np.asarray(v) for k, v in self.out.items()}
            self.out = None
        return self._host


class Scoring:
    """Engine's prompt logprobs (a mixin, as meshlab.infer.packed's PackedSteps is): which chunk rows
    of a packed step score, their targets, and each request's logprobs put together."""

    def prompt_logprobs(self, prompt, top: int = 0) -> list:
        """Each prompt token's logprob given the ones before it and its `top` best alternatives
        ([None, (logprob, {id: logprob}), ...]; the first token has no context, as OpenAI reports
        it): a one-token request through the engine (generate: call it from the thread that runs
        the engine; other queued requests run too)."""
        return self.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=top))[0].prompt_logprobs

    @staticmethod
    def _scored_rows(prefills) -> list:
        """[(chunk row j, request, first position, positions scored)] of a packed step's prefills that
        score: their request asks for prompt logprobs not yet put together, and the row feeds
        positions below the prompt's last (whose next token is generated, not scored)."""
        return [(j, r, start, min(n, len(r.prompt) - 1 - start)) for j, (r, start, n) in enumerate(prefills)
                if r.params.prompt_logprobs is not None and r.prompt_logprobs is None and start < len(r.prompt) - 1]

    @staticmethod
    def _score_flag(scored):
        """The packed step's static score: None (no row scores), else the alternatives it computes per
        token: 0, 1 (what an evaluation harness asks: whether each token is the greedy one) or
        TOP_LOGPROBS; one top-k pass over the vocabulary per token, cheapest at k = 1."""
        if not scored:
            return None
        most = max(r.params.prompt_logprobs for _, r, _, _ in scored)
        return most if most <= 1 else TOP_LOGPROBS

    @staticmethod
    def _fill_targets(targets: np.ndarray, scored, c: int) -> None:
        """targets [k c] (the step's p.targets): at each scored position, the prompt token after it."""
        for j, r, start, m in scored:
            targets[j * c:j * c + m] = r.token_ids(start + 1 + m)[start + 1:]

    def _keep_scores(self, out: dict, scored, c: int) -> None:
        """Move the step's score outputs from `out` (read back with the step's tokens otherwise) to the
        requests of its scored rows (Request.score_parts)."""
        if not scored:
            return
        step = StepScores({k: out.pop(k) for k in SCORE_KEYS})
        for j, r, start, m in scored:
            r.score_parts.append((step, j * c, start, m))
            self.stats["scored_tokens"] += m

    @staticmethod
    def _put_together(req) -> list:
        """req's prompt logprobs from the steps that scored its positions (read back now: they ran before
        the step that sampled its first token). A position scored again after a preemption takes
        its last scores (the same weights and tokens)."""
        n, top = len(req.prompt) - 1, req.params.prompt_logprobs
        lp, ids, vals = np.zeros(n, np.float32), np.zeros((n, top), np.int32), np.zeros((n, top), np.float32)
        have = np.zeros(n, bool)
        for step, base, start, m in req.score_parts:
            h = step.host()
            lp[start:start + m] = h["prompt_logprob"][base:base + m]
            ids[start:start + m] = h["prompt_top_id"][base:base + m, :top]
            vals[start:start + m] = h["prompt_top_logprob"][base:base + m, :top]
            have[start:start + m] = True
        if not have.all():
            raise RuntimeError(f"prompt positions {np.flatnonzero(~have)[:8].tolist()} were never scored")
        req.score_parts = []
        return [None] + [(x, dict(zip(i, v))) for x, i, v in zip(lp.tolist(), ids.tolist(), vals.tolist())]
