"""`DecodeCalls`, which `Engine` inherits: a decode call of n steps over the rows that only decode
(`_launch_decode`), and the next call chained behind one in flight from its last tokens on the
device (`_chain`, Engine(chain_decode=True)), so the host reads back and emits one call while the
device runs the next. Engine's docstring says when a call chains and when the rows change instead.
"""
from __future__ import annotations

import numpy as np

from meshlab.infer import calls
from meshlab.infer.packed import Flight


class DecodeCalls:
    """Decode calls for an `Engine` (its scheduler, programs, flags and stats)."""

    def _launch_decode(self, decodes, n: int) -> Flight:
        """Dispatch n decode steps of `decodes`; their cache positions advance now, and the tokens each
        row keeps count as pending until read back. Each row is fed its last token from the host, or,
        while that token is still on the device (pending: a chained call's rows), its slot's LAST entry."""
        s, m = self.sched, len(decodes)
        b = next(x for x in self.DECODE if x >= m)
        slots = np.zeros(b, np.int32)
        slots[:m] = [r.slot for r in decodes]
        pos, limit, counters = (np.zeros(b, np.int32) for _ in range(3))
        tok, from_last = np.zeros(b, np.int32), np.full(b, s.max_seqs, np.int32)
        calls.feed_decodes(decodes, tok, from_last)
        pos[:m] = [r.cached for r in decodes]
        steps = [1 if r.guide is not None and r.guide.per_step else n for r in decodes]   # its next mask needs its token
        limit[:m] = [min(r.end, r.cached + k) for r, k in zip(decodes, steps)]
        counters[:m] = [len(r.output) + r.pending for r in decodes]
        greedy, logprobs, cut = self._flags(slots[:m])
        seen_slots = np.where(np.arange(b) < m, slots, s.max_seqs).astype(np.int32)   # padding: no seen row
        buf, layout = calls.decode_inputs(tok, pos, limit, s.table[slots], seen_slots, self._row_inputs(slots),
                                          counters, from_last)
        out = self._launch(("decode", b, n, greedy, logprobs, cut), self.decode_call, buf, layout=layout, n=n,
                           greedy=greedy, logprobs=logprobs, cut=cut)
        self.stats["steps"] += n
        self.stats["decode_calls"] += 1
        self.stats["prefill_tokens"] += sum(r.cached < len(r.prompt) for r in decodes)
        rows = []
        for i, (r, k) in enumerate(zip(decodes, steps)):
            kept = min(k, r.params.max_tokens - len(r.output) - r.pending)   # those before max_tokens
            rows.append((r, i, kept, r.preemptions, False))
            r.cached = min(r.cached + k, r.end)
            r.pending += kept
        return Flight(out, logprobs, rows, list(decodes), n)

    def _chain(self, f: Flight):
        """The decode call after `f` (in flight), launched now from its last tokens on the device (LAST); None
        when the rows may change after f: a request arrived or is being aborted, one waits while a
        row is free, a row reaches max_tokens or has stopped, or pages for n more steps are short."""
        s = self.sched
        if not self.chain_decode or not (self.inbox.empty() and self.aborts.empty()) or (s.waiting and None in s.rows):
            return None
        if f.spec:
            return self._chain_spec(f)
        if any(r.finish_reason is not None or len(r.output) + r.pending >= r.params.max_tokens for r in f.decodes):
            return None
        if self._guides_running():       # a guided row waits for its mask between calls: it joins the next one
            return None
        if not s.reserve_ahead(f.decodes, f.n):
            return None
        self.stats["chained_calls"] += 1
        return self._launch_decode(f.decodes, f.n)
