"""Continuous batching over the paged KV cache: requests join at any step and leave when done.

Host bookkeeping only (numpy); the device programs come from `meshlab.infer.engine`.

A request's tokens are prompt + output; the cache holds the first `cached` of them. Each step
feeds every running row its next uncached tokens: one token for a decoding row, up to `chunk`
for a row still in its prompt, within a cap of `max_step_tokens` per step (decodes first, so a
long prompt never stalls them; the rest of a prompt waits for the next step). When a row's fed
tokens reach the end of its tokens, the sampled token is appended. Preemption is therefore just
`cached = 0`: a preempted request re-feeds prompt + output when it is readmitted (recompute),
and draws the same tokens because its random key counts its own output tokens.

Queues: `waiting` (not admitted: no slot or not enough free pages; FIFO) and the running rows,
which are in prefill while cached < len(tokens) - 1 and in decode after. Admission needs a free
row and pages for the whole prompt + 1 token; a request that could never fit is refused when
added. When decode needs a page and none is free, the most recently admitted request is
preempted (its pages freed) and goes back to the front of `waiting`.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Optional

import numpy as np

from meshlab.infer.sampler import SamplingParams


class AdmissionError(ValueError):
    """A request that this engine can never serve (too long for the context or the cache)."""


@dataclasses.dataclass
class Request:
    prompt: list
    params: SamplingParams
    id: int = 0
    output: list = dataclasses.field(default_factory=list)
    cached: int = 0                       # tokens of prompt + output already in the KV cache
    slot: int = -1
    pages: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None   # stop | length | abort
    text: str = ""                        # detokenized output (when the engine has a detokenizer)
    on_event: Optional[Callable] = None   # on_event(request, new_tokens: list[int], finished: bool)
    t_arrival: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    preemptions: int = 0

    @property
    def tokens(self):
        return self.prompt + self.output

    @property
    def metrics(self) -> dict:
        ttft = self.t_first - self.t_arrival if self.t_first else None
        n = len(self.output)
        tpot = (self.t_done - self.t_first) / (n - 1) if self.t_done and n > 1 else None
        return {"ttft_s": ttft, "tpot_s": tpot, "output_tokens": n, "prompt_tokens": len(self.prompt),
                "preemptions": self.preemptions}


class PagePool:
    """Free list of cache pages. Page 0 is never handed out: unused page-table entries point at it."""

    def __init__(self, num_pages: int):
        self.free = collections.deque(range(1, num_pages))
        self.total = num_pages - 1

    def take(self, n: int) -> list:
        if n > len(self.free):
            raise MemoryError(f"need {n} pages, {len(self.free)} free")
        return [self.free.popleft() for _ in range(n)]

    def give(self, pages: list) -> None:
        self.free.extend(pages)


class Scheduler:
    """Decides each step's rows and tokens; owns slots, pages and the queues."""

    def __init__(self, max_seqs: int, num_pages: int, page_size: int, max_len: int, chunk: int,
                 max_step_tokens: int | None = None):
        self.max_seqs, self.page_size, self.max_len, self.chunk = max_seqs, page_size, max_len, chunk
        self.max_step_tokens = max_step_tokens or (max_seqs + chunk)
        self.max_pages = -(-max_len // page_size)
        self.pool = PagePool(num_pages)
        self.rows: list[Optional[Request]] = [None] * max_seqs
        self.waiting: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._admit_order: list[Request] = []

    # -- queues ---------------------------------------------------------------------------
    def add(self, req: Request) -> Request:
        need = len(req.prompt) + req.params.max_tokens
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

    def admit(self) -> list[Request]:
        """Move waiting requests into free rows while pages for their prompt + 1 token are free."""
        admitted = []
        while self.waiting and None in self.rows:
            req = self.waiting[0]
            need = self._pages_for(req, len(req.tokens) + 1)
            if need > len(self.pool.free):
                break
            self.waiting.popleft()
            req.pages += self.pool.take(need)
            req.slot = self.rows.index(None)
            self.rows[req.slot] = req
            self._admit_order.append(req)
            admitted.append(req)
        return admitted

    def release(self, req: Request) -> None:
        self.pool.give(req.pages)
        req.pages = []
        if req.slot >= 0:
            self.rows[req.slot] = None
        req.slot = -1
        if req in self._admit_order:
            self._admit_order.remove(req)

    def preempt_one(self, keep: Request) -> Optional[Request]:
        """Free the newest running request's pages (not `keep` unless it is the only one); recompute later."""
        victims = [r for r in reversed(self._admit_order) if r is not keep] or [keep]
        victim = victims[0]
        self.release(victim)
        victim.cached, victim.preemptions = 0, victim.preemptions + 1
        self.waiting.appendleft(victim)
        return victim

    def reserve(self, req: Request, tokens: int) -> bool:
        """Pages for `tokens` cached tokens of req, preempting others when short; False if req itself went."""
        while True:
            need = self._pages_for(req, min(tokens, self.max_len))
            if need <= len(self.pool.free):
                req.pages += self.pool.take(need)
                return True
            if self.preempt_one(keep=req) is req:
                return False

    # -- one step -------------------------------------------------------------------------
    def plan(self) -> dict[int, int]:
        """Tokens to feed per row this step: decodes first (1 each), then prompt chunks within the cap."""
        budget, feed = self.max_step_tokens, {}
        running = sorted(self.running(), key=lambda r: len(r.tokens) - r.cached > 1)   # decodes first
        for req in running:
            n = min(len(req.tokens) - req.cached, self.chunk, budget)
            if n <= 0 or req.slot < 0:
                continue
            if not self.reserve(req, req.cached + n):
                continue                                   # req itself was preempted
            feed[req.slot] = n
            budget -= n
        return {s: n for s, n in feed.items() if self.rows[s] is not None}

    def page_table(self) -> np.ndarray:
        table = np.zeros((self.max_seqs, self.max_pages), np.int32)
        for r in self.running():
            table[r.slot, :len(r.pages)] = r.pages
        return table
