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

The prefix cache serves a scoring request only pages whose positions have scores: ones it scored
itself (a preempted request takes back those), and full prompt pages whose scores an earlier
request left in the `ScoreStore` (host memory, by page key, with as many alternatives as that
request asked for): an evaluation harness's multiple-choice requests share a context, which is then
computed once, and only each choice's tail is fed. Page q's stored scores are those of the tokens
in it (positions q*page_size - 1 .. q*page_size + page_size - 2: a token's logprob comes from the
position before it), so they depend only on the tokens up to the page's end, which its key names;
the last shared page is fed again, since its last position scores the next page's first token.
Each step's score outputs stay on the device, held by the rows it scored (Request.score_parts),
and are read back once, when the request's first token is emitted (Engine._emit): no step waits
for them.
"""
from __future__ import annotations

import collections

import numpy as np

from meshlab.infer.programs import TOP_LOGPROBS
from meshlab.infer.sampler import SamplingParams

# a scoring packed step's extra outputs ("prompt_rank" only from a step with the ranks flag)
SCORE_KEYS = ("prompt_logprob", "prompt_rank", "prompt_top_logprob", "prompt_top_id")


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


class StoredScores:
    """A stored page's scores as a score part (StepScores' interface): host arrays at hand."""
    __slots__ = ("_host",)

    def __init__(self, lp, ids, vals, rank):
        self._host = {"prompt_logprob": lp, "prompt_top_id": ids, "prompt_top_logprob": vals, "prompt_rank": rank}

    def host(self) -> dict:
        return self._host


class ScoreStore:
    """Prompt scores of full pages by page key (pages.page_keys), least recently used dropped past
    `capacity` pages. An entry: (its token's logprob [page_size], the best alternatives' ids and
    logprobs [page_size, k], its token's rank [page_size] or None) for the page's tokens, k the
    alternatives the scoring request asked for, the ranks if it asked for them."""

    def __init__(self, page_size: int, capacity: int):
        self.page_size, self.capacity = page_size, capacity
        self.pages: collections.OrderedDict = collections.OrderedDict()

    def leading(self, keys: list, top: int, ranks: bool = False) -> int:
        """How many of `keys` (a prompt's full pages, in order) have scores with >= top alternatives
        (and ranks, if asked)."""
        n = 0
        while n < len(keys) and self._covers(self.pages.get(keys[n]), top, ranks):
            n += 1
        return n

    @staticmethod
    def _covers(entry, top: int, ranks: bool) -> bool:
        return entry is not None and entry[1].shape[1] >= top and (entry[3] is not None or not ranks)

    def parts(self, keys: list) -> list:
        """Score parts (Request.score_parts) of the pages `keys`, the first page at position 0."""
        out, ps = [], self.page_size
        for q, key in enumerate(keys):
            self.pages.move_to_end(key)
            base = 1 if q == 0 else 0                    # the first token has no position before it
            out.append((StoredScores(*self.pages[key]), base, q * ps - 1 + base, ps - base))
        return out

    def put(self, keys: list, lp, ids, vals, rank=None) -> None:
        """Store each full page q of keys from a prompt's scores by position (lp, rank [n] or None; ids /
        vals [n, k]); a page stored before stays unless these scores carry more."""
        ps = self.page_size
        for q, key in enumerate(keys):
            lo = q * ps - 1                              # position of the page's first token's score
            page = [None if x is None else np.concatenate([np.zeros_like(x[:1]), x[:ps - 1]]) if q == 0
                    else x[lo:lo + ps].copy() for x in (lp, ids, vals, rank)]
            if self._covers(self.pages.get(key), page[1].shape[1], rank is not None):
                self.pages.move_to_end(key)
                continue
            self.pages[key] = tuple(page)
            self.pages.move_to_end(key)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)


class Scoring:
    """Engine's prompt logprobs (a mixin, as meshlab.infer.packed's PackedSteps is): which chunk rows
    of a packed step score, their targets, and each request's logprobs put together."""

    def prompt_logprobs(self, prompt, top: int = 0, ranks: bool = False) -> list:
        """Each prompt token's logprob given the ones before it and its `top` best alternatives
        ([None, (logprob, {id: logprob}, rank), ...]; the first token has no context, as OpenAI
        reports it; rank: 1 + the tokens more likely, with ranks, else None): a one-token request
        through the engine (generate: call it from the thread that runs the engine; other queued
        requests run too)."""
        return self.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=top,
                                                      prompt_ranks=ranks))[0].prompt_logprobs

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
    def _rank_flag(scored) -> bool:
        """The packed step's static ranks: whether a scored row asks for its tokens' ranks."""
        return any(r.params.prompt_ranks for _, r, _, _ in scored)

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
        step = StepScores({k: out.pop(k) for k in SCORE_KEYS if k in out})
        for j, r, start, m in scored:
            r.score_parts.append((step, j * c, start, m))
            self.stats["scored_tokens"] += m

    def _put_together(self, req) -> list:
        """req's prompt logprobs from the steps that scored its positions (read back now: they ran before
        the step that sampled its first token) and the stored pages it was served; its full pages'
        scores then go to the store. A position scored again (after a preemption, or in a stored
        page fed again) takes its last scores (the same weights and tokens)."""
        n, top = len(req.prompt) - 1, req.params.prompt_logprobs
        lp, ids, vals = np.zeros(n, np.float32), np.zeros((n, top), np.int32), np.zeros((n, top), np.float32)
        rank, have, ranked = np.zeros(n, np.int32), np.zeros(n, bool), np.zeros(n, bool)
        for step, base, start, m in req.score_parts:
            h = step.host()
            lp[start:start + m] = h["prompt_logprob"][base:base + m]
            if h.get("prompt_rank") is not None:
                rank[start:start + m] = h["prompt_rank"][base:base + m]
                ranked[start:start + m] = True
            ids[start:start + m] = h["prompt_top_id"][base:base + m, :top]
            vals[start:start + m] = h["prompt_top_logprob"][base:base + m, :top]
            have[start:start + m] = True
        done = have & ranked if req.params.prompt_ranks else have
        if not done.all():
            raise RuntimeError(f"prompt positions {np.flatnonzero(~done)[:8].tolist()} were never scored")
        ranked = ranked.all()
        req.score_parts = []
        store = self.sched.scores
        if store is not None:
            full = len(req.prompt) // store.page_size
            keys = self.sched.prompt_keys(req, full)
            store.put(keys, lp, ids, vals, rank if ranked else None)
            self.sched.landed(req, self.sched.scoring, keys)
        ranks = rank.tolist() if ranked else [None] * n
        return [None] + [(x, dict(zip(i, v)), r) for x, i, v, r in zip(lp.tolist(), ids.tolist(), vals.tolist(), ranks)]
