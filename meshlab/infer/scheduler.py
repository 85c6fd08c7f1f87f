"""Continuous batching over the paged KV cache: requests join at any step and leave when done.

Host bookkeeping only (numpy); the device programs come from `meshlab.infer.programs`.

A request's tokens are prompt + output; the cache holds the first `cached` of them. A step
feeds every decoding row (one uncached token) its token, then prompt chunks of up to `chunk`
tokens to rows still in their prompt, oldest first, within `max_step_tokens` tokens per step
and `max_prefill_rows` chunks (chunked prefill: decodes never wait behind a long prompt, and a
long prompt costs several bounded steps). When a row's fed tokens reach the end of its tokens,
the sampled token is appended. Preemption is `cached = 0` with the pages released: a preempted
request re-feeds prompt + output when readmitted (recompute; its full pages usually come back
from the prefix cache), and draws the same tokens because its random key counts its own
output tokens.

Queues: `waiting` (FIFO) and the running rows. Admission needs a free row and pages for the
whole prompt + 1 token, minus the pages found in the prefix cache (`meshlab.infer.pages`);
a request that could never fit is refused when added; a request whose next prompt page a running
request is computing waits for it, keeping its place. When decode needs a page and none is
free, the most recently admitted request is preempted and goes back to the front of `waiting`.
The page table [max_seqs, max_pages] is kept here and updated only where a row's pages change.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Optional

import numpy as np

from meshlab.infer.pages import ROOT_KEY, PagePool, page_keys
from meshlab.infer.sampler import SamplingParams


class AdmissionError(ValueError):
    """A request that this engine can never serve (too long for the context or the cache)."""


def output_decoder(decode, params) -> Callable:
    """How a request's output reads as text: `decode` itself, or with params.skip_special_tokens False
    (vLLM's) `decode` showing special tokens, where the stop token that ends an output stays out of
    its text, as a stop string does, unless include_stop_str_in_output (the stop tokens cannot come
    earlier: min_tokens holds them back on the device)."""
    if params.skip_special_tokens:
        return decode
    stops, keep = frozenset(params.stop_token_ids), params.include_stop_str_in_output

    def decode_with_specials(ids):
        return decode(ids[:-1] if len(ids) and ids[-1] in stops and not keep else ids, skip_special_tokens=False)
    return decode_with_specials


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list
    params: SamplingParams
    id: int = 0
    output: list = dataclasses.field(default_factory=list)
    cached: int = 0                       # tokens of prompt + output already in the KV cache
    slot: int = -1
    pages: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None   # stop | length | abort
    on_event: Optional[Callable] = None   # on_event(request, new_tokens: list[int], finished: bool)
    detokenize: Optional[Callable] = dataclasses.field(default=None, repr=False)   # the engine's
    text_stop: Optional[str] = None       # the text cut at a stop string that matched (before it, or after it)
    # per output token when params.logprobs is set: (log-softmax of the chosen token, {token: logprob}
    # of the params.logprobs most likely ones), both from the model's raw logits (no temperature)
    logprobs: list = dataclasses.field(default_factory=list)
    # with params.prompt_logprobs: [None, then (logprob, {token: logprob}, rank or None) per prompt token
    # after the first], put together when its first token is emitted (meshlab.infer.scoring)
    prompt_logprobs: Optional[list] = dataclasses.field(default=None, repr=False)
    # until then, the packed steps that scored its positions and the stored pages it was served:
    # (scoring.StepScores or StoredScores, row offset in their outputs, first position, positions)
    score_parts: list = dataclasses.field(default_factory=list, repr=False)
    t_arrival: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    preemptions: int = 0
    # tokens found in the prefix cache at its last admission: positions below it lie in shared pages,
    # never written by this request (a fully cached prompt feeds its last token for the logits only)
    prefix_hit_tokens: int = 0
    keys: list = dataclasses.field(default_factory=list)   # prefix keys of its full pages (pages.page_keys)
    registered: int = 0                   # its pages already offered to the prefix cache (pages[:registered])
    ids: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)   # the prompt as int32 (hashed)
    # its token mask (meshlab.infer.guided.Guide) when params has a grammar, allowed or banned tokens
    guide: Optional[object] = dataclasses.field(default=None, repr=False)
    # tokens sampled by device calls not read back yet (the engine's overlapped packed steps): fed
    # already from the device (their positions counted in `cached`), not yet in `output`
    pending: int = 0

    @property
    def text(self) -> str:
        """The detokenized output, cut before a matched stop string; computed when read (by the
        reader's thread, not the engine's) and kept per output length."""
        if self.text_stop is not None:
            return self.text_stop
        return self.decoded(len(self.output))

    def decoded(self, n: int) -> str:
        """The detokenized output[:n] (the output only grows, so n names it); the last one is kept, as a
        stream reads the same one for its text and for the tokens its logprobs cover."""
        if self.detokenize is None:
            return ""
        last, text = getattr(self, "_text", (-1, ""))
        if last != n:
            text = self.detokenize(self.output[:n])
            self._text = (n, text)
        return text

    @property
    def tokens(self):
        return self.prompt + self.output

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def end(self) -> int:
        """Positions this request ever feeds: its last output token is sampled, never fed."""
        return len(self.prompt) + self.params.max_tokens - 1

    def token_ids(self, upto: int) -> np.ndarray:
        """Its first `upto` tokens as int32, for page keys: the prompt converted once (a 2k-token list
        takes ~70 us to convert, and the prompt + output list ~10 us to build, per key lookup)."""
        if self.ids is None or len(self.ids) != len(self.prompt):
            self.ids = np.asarray(self.prompt, np.int32)
        if upto <= len(self.ids):
            return self.ids[:upto]
        return np.concatenate([self.ids, np.asarray(self.output[:upto - len(self.ids)], np.int32)])

    def append(self, tokens, logprobs=None) -> list:
        """Append sampled tokens until a stop: a stop token, a stop string in the detokenized output (cut
        there in text_stop), or max_tokens; sets finish_reason and returns the tokens taken. logprobs:
        one (logprob, top ids, top logprobs) per token when the step computed them."""
        new, p, out, k = [], self.params, self.output, self.params.logprobs
        for i, t in enumerate(tokens.tolist() if isinstance(tokens, np.ndarray) else map(int, tokens)):
            out.append(t)
            new.append(t)
            if k is not None and logprobs is not None:
                lp, ids, vals = logprobs[i]                 # Python numbers (calls.logprob_rows)
                self.logprobs.append((lp, dict(zip(ids[:k], vals[:k])) if k else {}))
            early = len(out) < p.min_tokens                   # nothing stops it yet (the device holds its stop tokens)
            if t in p.stop_token_ids or (self.guide is not None and self.guide.consume(t)):
                self.finish_reason = None if early else "stop"
            elif self.detokenize and p.stop and not early:
                text = self.detokenize(out)
                hits = [(text.index(s), s) for s in p.stop if s in text]
                if hits:
                    at, s = min(hits, key=lambda hit: hit[0])          # the earliest; ties: the first listed
                    self.text_stop = text[:at + len(s) if p.include_stop_str_in_output else at]
                    self.finish_reason = "stop"
            if not self.finish_reason and len(out) >= p.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return new

    @property
    def scored_to(self) -> int:
        """Prompt positions below this have their logprobs (steps score a prompt in order, after the
        stored pages it was served: those start at position 0)."""
        return max((start + m for _, _, start, m in self.score_parts), default=0)

    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def slice(self, start: int, stop: int) -> list:
        if stop <= len(self.prompt):
            return self.prompt[start:stop]
        return self.tokens[start:stop]

    @property
    def metrics(self) -> dict:
        ttft = self.t_first - self.t_arrival if self.t_first else None
        n = len(self.output)
        tpot = (self.t_done - self.t_first) / (n - 1) if self.t_done and n > 1 else None
        return {"ttft_s": ttft, "tpot_s": tpot, "latency_s": self.t_done - self.t_arrival if self.t_done else None,
                "output_tokens": n, "prompt_tokens": len(self.prompt),
                "preemptions": self.preemptions, "prefix_hit_tokens": self.prefix_hit_tokens}


class Scheduler:
    """Decides each step's rows and tokens; owns slots, pages, the page table and the queues."""

    def __init__(self, max_seqs: int, num_pages: int, page_size: int, max_len: int, chunk: int,
                 max_step_tokens: int | None = None, prefix_cache: bool = True):
        self.max_seqs, self.page_size, self.max_len, self.chunk = max_seqs, page_size, max_len, chunk
        self.max_step_tokens = max_step_tokens or (max_seqs + 4 * chunk)
        if self.max_step_tokens <= max_seqs:
            raise ValueError(f"max_step_tokens={self.max_step_tokens} must exceed max_seqs={max_seqs}, or prompts "
                             "could not progress while every row decodes")
        self.max_prefill_rows = max(1, -(-(self.max_step_tokens - max_seqs) // chunk))
        self.max_pages = -(-max_len // page_size)
        self.pool = PagePool(num_pages, prefix_cache)
        self.table = np.zeros((max_seqs, self.max_pages), np.int32)
        # pages whose last token's hidden state the engine kept (programs.HIDDEN): set by the engine
        # when a packed step computes that token, cleared when the page is handed out again
        self.hidden_ok = np.zeros(num_pages, bool)
        self.scores = None                    # the engine's scoring.ScoreStore: prompt pages' scores by key
        # Prompt pages in flight, by key: being computed by a running request (until it registers them)
        # or scored (until it stores their scores). A waiting request whose next page is one of them
        # waits for it instead of computing it too (SGLang's in-batch prefix sharing): requests that
        # arrive together with a shared prefix (a system prompt, a question's choices) compute it once.
        self.computing: dict = {}
        self.scoring: dict = {}
        self.wait_in_flight = True            # False: never wait (a benchmark's A/B)
        self.counts = {"stored_scores": 0, "prefix_waits": 0}   # for /metrics
        self.rows: list[Optional[Request]] = [None] * max_seqs
        self.waiting: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._admit_order: list[Request] = []

    # -- queues ---------------------------------------------------------------------------
    def add(self, req: Request) -> Request:
        need = req.end                # KV positions it fills: its last output token is sampled, never fed
        if need > self.max_len:
            raise AdmissionError(f"prompt of {len(req.prompt)} tokens + max_tokens={req.params.max_tokens} exceeds "
                                 f"the context of {self.max_len} tokens; shorten the prompt or lower max_tokens")
        if -(-need // self.page_size) > self.pool.total:
            raise AdmissionError(f"request needs {-(-need // self.page_size)} cache pages, the cache has "
                                 f"{self.pool.total}; lower max_tokens or start the engine with more pages")
        req.id, req.t_arrival = next(self._ids), req.t_arrival or time.perf_counter()
        self.waiting.append(req)
        return req

    def running(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.rows)

    def _pages_for(self, req: Request, tokens: int) -> int:
        return max(0, -(-tokens // self.page_size) - len(req.pages))

    def _grow(self, req: Request, n: int) -> None:
        if n <= 0:
            return
        start = len(req.pages)
        req.pages += self.pool.take(n)
        self.table[req.slot, start:len(req.pages)] = req.pages[start:]
        self.hidden_ok[req.pages[start:]] = False

    def _prefix_hit(self, req: Request) -> list:
        """Cached pages for req's prefix, its last full page included: when every token is cached,
        the last one is fed again for its logits and reads its own K/V from the shared page (its
        write is dropped: Request.prefix_hit_tokens). Repetition-penalised requests compute
        everything: their seen-token mask is built by feeding; a request asking for prompt logprobs
        takes only pages whose positions it scored, or whose scores are stored, the last one fed
        again (meshlab.infer.scoring)."""
        if req.params.repetition_penalty != 1.0 or not self.pool.prefix_cache:
            return []
        n = req.n_tokens // self.page_size
        if self._scoring(req):
            n = min(n, max(req.scored_to // self.page_size, self._stored_pages(req) - 1))
            if n <= 0:
                return []
        if req.keys:                          # keys known (a preempted request): no hashing
            return self.pool.lookup(self.prompt_keys(req, n))
        return self.pool.longest(req.token_ids(n * self.page_size), self.page_size, n, req.keys)

    @staticmethod
    def _scoring(req: Request) -> bool:
        return req.params.prompt_logprobs is not None and req.prompt_logprobs is None

    def prompt_keys(self, req: Request, pages: int) -> list:
        """The prefix keys of req's first `pages` full pages of its tokens (computed once, kept in req.keys)."""
        return page_keys(req.token_ids(pages * self.page_size), self.page_size, req.keys, pages)[:pages]

    def _stored_pages(self, req: Request) -> int:
        """How many of req's first full prompt pages have stored scores with the alternatives it asks."""
        if self.scores is None:
            return 0
        return self.scores.leading(self.prompt_keys(req, len(req.prompt) // self.page_size),
                                   req.params.prompt_logprobs, req.params.prompt_ranks)

    def _in_flight(self, req: Request, hit: int) -> bool:
        """Whether the next page req could take (after its `hit` pages, or its stored scores' pages when it
        scores) is in flight: computed, or scored, by a running request."""
        flight = self.scoring if self._scoring(req) else self.computing
        if not flight or not self.wait_in_flight or req.params.repetition_penalty != 1.0:
            return False
        full = len(req.prompt) // self.page_size
        nxt = self._stored_pages(req) if self._scoring(req) else hit
        owner = flight.get(self.prompt_keys(req, nxt + 1)[nxt]) if nxt < full else None
        return owner is not None and bool(owner.pages)     # never on one that let its pages go (preempted, done)

    def _fly(self, req: Request, hit: int) -> None:
        """Mark req's full prompt pages past its hit in flight (computing; and scoring when it scores)."""
        if not self.pool.prefix_cache or req.params.repetition_penalty != 1.0:
            return
        keys = self.prompt_keys(req, len(req.prompt) // self.page_size)
        for key in keys[hit:]:
            self.computing.setdefault(key, req)
        if self._scoring(req) and self.scores is not None:
            for key in keys[self._stored_pages(req):]:
                self.scoring.setdefault(key, req)

    def landed(self, req: Request, flight: dict, keys: list) -> None:
        """Pages of req's no longer in flight in `flight` (computing or scoring)."""
        for key in keys:
            if flight.get(key) is req:
                del flight[key]

    def admit(self) -> list[Request]:
        """Move waiting requests into free rows while pages for their tokens + 1 are free; a request whose
        next page is in flight waits for it (keeping its place)."""
        admitted, later = [], []
        while self.waiting and None in self.rows:
            req = self.waiting[0]
            hit = self._prefix_hit(req)
            if self._in_flight(req, len(hit)):
                later.append(self.waiting.popleft())
                self.counts["prefix_waits"] += 1
                continue
            idx = np.asarray(hit, np.intp)                    # converted once for the three uses below
            need = -(-min(req.n_tokens + 1, req.end) // self.page_size) - len(hit)   # never past its end
            if need + self.pool.unreferenced(idx) > self.pool.available:
                break
            self.waiting.popleft()
            self.pool.acquire(idx)
            req.pages, req.registered = list(hit), len(hit)
            req.prefix_hit_tokens = len(hit) * self.page_size
            scored = req.scored_to
            if hit and self._scoring(req) and self.scores is not None and scored < len(hit) * self.page_size:
                # the stored scores up to the hit's end: its pages', and the next page's first token's
                req.score_parts += self.scores.parts(self.prompt_keys(req, len(hit) + 1))
                self.counts["stored_scores"] += len(hit) * self.page_size - scored
            req.cached = min(req.prefix_hit_tokens, req.n_tokens - 1)      # the last token is fed for its logits
            req.slot = self.rows.index(None)
            self.rows[req.slot] = req
            self.table[req.slot, :len(hit)] = idx
            self._grow(req, need)
            self._admit_order.append(req)
            self._fly(req, len(hit))
            admitted.append(req)
        self.waiting.extendleft(reversed(later))
        return admitted

    def register(self, req: Request) -> None:
        """Offer req's computed full pages to the prefix cache (K/V known for positions < min(cached, tokens)),
        those not offered before only: a page whose key was cached elsewhere when offered stays private."""
        if not self.pool.prefix_cache or req.params.repetition_penalty != 1.0:
            return
        full = min(req.cached, req.n_tokens, len(req.pages) * self.page_size) // self.page_size
        if full <= req.registered:
            return
        keys = self.prompt_keys(req, full)
        self.pool.register(req.pages[req.registered:full], keys[req.registered:full],
                           keys[req.registered - 1] if req.registered else ROOT_KEY)
        if self.computing:
            self.landed(req, self.computing, keys[req.registered:full])
        req.registered = full

    def release(self, req: Request) -> None:
        self.register(req)
        if self.computing or self.scoring:        # what it did not finish is no longer in flight
            keys = req.keys[:len(req.prompt) // self.page_size]
            self.landed(req, self.computing, keys)
            self.landed(req, self.scoring, keys)
        self.pool.give(req.pages)
        req.pages, req.registered = [], 0
        self._vacate(req)

    def _vacate(self, req: Request) -> None:
        """Give up req's row (its slot), not its pages."""
        if req.slot >= 0:
            self.rows[req.slot] = None
        req.slot = -1
        if req in self._admit_order:
            self._admit_order.remove(req)

    def release_finishing(self) -> None:
        """Free the rows of requests whose samples still on the device bring them to max_tokens: they end
        when read back, and a request waiting for a row need not wait for that. The slot is taken again
        at once (the call in flight holds its own copy of the row's pages and settings, and any later
        call runs after it on the device); the pages stay the request's until it is read back and
        released, so its output pages reach the prefix cache with their tokens."""
        for r in [r for r in self._admit_order if r.pending and len(r.output) + r.pending >= r.params.max_tokens]:
            self._vacate(r)

    def remove_waiting(self, req: Request) -> bool:
        try:
            self.waiting.remove(req)
            return True
        except ValueError:
            return False

    def preempt_one(self, keep: Request) -> Optional[Request]:
        """Free the newest running request's pages (not `keep` unless it is the only one); recompute later."""
        victims = [r for r in reversed(self._admit_order) if r is not keep] or [keep]
        victim = victims[0]
        self.release(victim)
        # recomputed from its tokens when readmitted: samples still on the device are dropped
        victim.cached, victim.preemptions, victim.pending = 0, victim.preemptions + 1, 0
        self.waiting.appendleft(victim)
        return victim

    def reserve(self, req: Request, tokens: int) -> bool:
        """Pages for `tokens` cached tokens of req, preempting others when short; False if req itself went."""
        while True:
            need = self._pages_for(req, min(tokens, self.max_len))
            if need == 0:                                  # the common case: the page is already there
                return True
            if need <= self.pool.available:
                self._grow(req, need)
                return True
            if self.preempt_one(keep=req) is req:
                return False

    def reserve_ahead(self, reqs: list, n: int) -> bool:
        """Pages for n more decode steps of every req (none taken unless all fit, no preemption)."""
        need = [self._pages_for(r, min(r.cached + n, r.end)) for r in reqs]
        if sum(need) > self.pool.available:
            return False
        for r, k in zip(reqs, need):
            self._grow(r, k)
        return True

    # -- one step -------------------------------------------------------------------------
    @staticmethod
    def decoding(req: Request) -> bool:
        """Whether req's next token goes through a decode call: one token left to feed, an output
        already begun (a first token never waits behind a call of steps_per_call decode steps: a
        prompt with one token left is planned as a prefill of 1, which the engine feeds in a packed
        row or, when every prompt row of the step has one token left, in one decode step), and a
        position its own (a fully cached prompt's last token lies in a shared page, left unchanged).
        Tokens still on the device (req.pending) count as its own: the last of them is the one to
        feed, unless they bring the output to max_tokens; a request whose mask follows its tokens (a
        grammar, a bad word of several tokens) waits for them (meshlab.infer.guided)."""
        out = len(req.output) + req.pending
        return (req.n_tokens + req.pending - req.cached == 1 and out > 0 and req.cached >= req.prefix_hit_tokens
                and out < req.params.max_tokens and not (req.pending and req.guide is not None and req.guide.per_step))

    def prompts_left(self) -> bool:
        """Whether the next step is likely to feed prompt tokens: a request waits while a row is free,
        or a running row has tokens to feed that are not one decode token."""
        return (bool(self.waiting) and None in self.rows) or any(
            r is not None and r.n_tokens > r.cached and not self.decoding(r) for r in self.rows)

    def plan(self) -> tuple[list, list]:
        """(decoding requests, [(prefilling request, first position, tokens to feed)]) for this step:
        every decode first (one token each), then prompt chunks, oldest request first, within the step
        budget. A request may take several chunk rows, its consecutive chunks in order (a 2k prompt
        alone: four rows of 512 in one step, its GEMMs 2,048 rows tall, instead of four steps)."""
        decodes = [r for r in self._admit_order if self.decoding(r)]
        for req in decodes:
            if req.slot >= 0:
                self.reserve(req, req.cached + 1)
        decodes = [r for r in decodes if r.slot >= 0]
        budget, prefills = self.max_step_tokens - len(decodes), []
        for req in list(self._admit_order):
            if req.slot < 0 or self.decoding(req):
                continue
            fed = 0
            while req.slot >= 0 and req.n_tokens - req.cached - fed > 0:
                n = min(req.n_tokens - req.cached - fed, self.chunk, budget)
                if n <= 0 or len(prefills) == self.max_prefill_rows:
                    break
                if not self.reserve(req, req.cached + fed + n):
                    break                                  # req itself was preempted
                prefills.append((req, req.cached + fed, n))
                budget, fed = budget - n, fed + n
            if budget <= 0 or len(prefills) == self.max_prefill_rows:
                break
        live = {id(r) for r in self._admit_order}
        return [r for r in decodes if id(r) in live], [row for row in prefills if id(row[0]) in live]

    def page_table(self) -> np.ndarray:
        """A copy of the page table holding only what rows own now: each live row's pages, 0 (none)
        elsewhere. The working table keeps the ids a freed row or a shorter successor left behind, which
        no sequence length reaches (the kernels read a row up to its length), so it is never cleared."""
        view = np.zeros_like(self.table)
        for slot, req in enumerate(self.rows):
            if req is not None:
                view[slot, :len(req.pages)] = self.table[slot, :len(req.pages)]
        return view
