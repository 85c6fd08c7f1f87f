"""`FirstTokens`, which `Engine` inherits: its one-step paths to the first tokens of prompts.

A step whose prompt rows each have one token left to feed (a prompt met before up to its last
token, read from its shared page and not written; or one uncached token) runs no packed row
(first_token_decode; False: a packed row, the benchmark's A/B):

  `_first_tokens`  one decode step (n = 1) over the rows decoding and those prompt rows, read back
                   at once: the batch-b decode program (`first_call`), whose device time is a decode
                   step's, instead of a 16-wide packed row's (a prompt kernel per layer);
  `_head_tokens`   with no row decoding, when each prompt's last token ends a shared page whose final
                   hidden state a packed step kept (`_hidden_kept`, reuse_hidden): the LM head alone
                   over those states (`head_call`); no layer runs, nothing is written.

Both take their host inputs in one buffer laid out once per decode bucket (`calls.Slots`).
"""
from __future__ import annotations

from meshlab.infer import calls
from meshlab.infer.calls import logprob_rows


class FirstTokens:
    """The first-token steps of an `Engine`: they use its scheduler, buckets, slot settings and calls."""

    def _first_tokens(self, decodes, firsts) -> None:
        """One decode step over the rows decoding and `firsts` (each feeding its one token left), read back
        at once: a prompt met before up to its last token (its slot in a shared page, kept as it was) or
        with one uncached token. The batch-b decode program with n=1, whose device time is a decode
        step's, instead of a 16-wide packed row's (a prompt kernel per layer); host tokens in its one
        input buffer."""
        s, rows = self.sched, decodes + firsts
        b = next(x for x in self.DECODE if x >= len(rows))
        slots = self._first_slots(b)                # the bucket's layout, kept
        real = calls.fill_decode(slots.fill(), rows, s.table, self.slot_rows)
        greedy, logprobs, cut = self._flags(real)
        out, _, _ = self._call(("first", b, 1, greedy, logprobs, cut), self.first_call, slots.take(),
                               layout=slots.layout, n=1, greedy=greedy, logprobs=logprobs, cut=cut)
        self.stats["steps"] += 1
        self.stats["first_token_calls"] += 1
        self.stats["prefill_tokens"] += sum(r.cached < len(r.prompt) for r in rows)
        lps = logprob_rows(out, 1) if logprobs is not None else None
        for i, r in enumerate(rows):
            r.cached += 1
            if self._emit(r, out["tokens"][:, i], lps[i] if lps else None) or i < len(decodes):
                continue
            s.register(r)                 # after its first token, as a packed step's prefill does

    def _hidden_kept(self, reqs) -> bool:
        """reuse_hidden and every req (one token left to feed) feeds a token of a shared page whose
        hidden state is kept: a prompt met before up to its end. The prefix hit covers whole pages of
        the prompt, so a last token inside it ends its page."""
        s = self.sched
        return self.reuse_hidden and all(
            r.cached < r.prefix_hit_tokens and s.hidden_ok[s.table[r.slot, r.cached // s.page_size]] for r in reqs)

    def _head_tokens(self, firsts) -> None:
        """The first tokens of prompts met before (`_hidden_kept`), from the LM head over their pages'
        kept hidden states: no layer runs, nothing is written."""
        s = self.sched
        b = next(x for x in self.DECODE if x >= len(firsts))
        slots = self._head_slots(b)
        real = calls.fill_head(slots.fill(), firsts, s.table, s.page_size, self.slot_rows)
        greedy, logprobs, cut = self._flags(real)
        out, _, _ = self._call(("head", b, greedy, logprobs, cut), self.head_call, slots.take(), layout=slots.layout,
                               greedy=greedy, logprobs=logprobs, cut=cut, weights=self.head_weights)
        self.stats["head_calls"] += 1
        lps = logprob_rows(out, 0) if logprobs is not None else None
        for i, r in enumerate(firsts):
            r.cached += 1
            if not self._emit(r, out["tokens"][i:i + 1], lps[i] if lps else None):
                s.register(r)

    def _head_slots(self, b: int) -> calls.Slots:
        return self._slots_for(("head", b), lambda: calls.head_slots(b, self.slot_rows, self.sched.max_seqs))

    def _first_slots(self, b: int) -> calls.Slots:
        s = self.sched
        return self._slots_for(("first", b), lambda: calls.first_token_slots(b, s.max_pages, self.slot_rows, s.max_seqs))
