"""`PackedSteps`, which `Engine` inherits: the token-packed steps (some row feeds prompt tokens),
and the rule by which the engine overlaps its steps (`Engine(overlap_steps=True)`, the default).

A packed step feeds every decoding row its token and prompt chunks to the rows still in their
prompt, as one stream (`calls.fill_packed`, `programs.make_engine_programs`). Its device time is
~5-14 ms under the load test's mix on the H200, and the host's work around a step is ~4 ms
(reading it back, emitting tokens, admitting, planning and filling the next step, dispatching
it). A step read back before the next is planned leaves the device idle through that work.

Overlapped, the host dispatches step N + 1 before it reads step N back (`Engine.step`): step N's
samples are not on the host when step N + 1 is planned, so
  - a row that samples in step N counts the tokens it keeps as `Request.pending`; it decodes in
    step N + 1 (Scheduler.decoding), fed from the LAST entry of its slot on the device
    (programs.LAST), which step N wrote (a packed step or a decode call, programs.make_engine_programs);
  - a row whose pending tokens bring it to max_tokens gives up its slot before step N + 1 is
    planned (Scheduler.release_finishing), so a waiting request takes the slot at once; its pages
    stay until it is read back and released (its output pages reach the prefix cache);
  - a row that stops in step N (a stop token or string, found when read back) has fed its stop
    token in step N + 1 too; that step's samples for it are dropped, as a chained decode call's are;
  - a row preempted while its tokens are pending recomputes them when readmitted (the same tokens:
    sampling keys count the row's own output tokens), and those read back are dropped.
A first-token step (prompt rows with one token left, fed from the host) reads step N back first. A
packed step whose only kept samples are prompts' first tokens, with no prompt work after it, is
read back at once: a lone prompt's first token waits for no planning of the step after it.
"""
from __future__ import annotations

import jax
import numpy as np

from meshlab.infer import calls
from meshlab.infer.programs import page_end_rows


class Flight:
    """A device call dispatched and not read back (Engine._land reads it): its outputs, logprobs
    flag, and the rows that keep samples of it, as (request, output column, tokens it keeps, the
    request's preemptions at dispatch, whether its prompt ended here). A packed step's outputs hold
    one token per row ([R]), a decode call's n ([n, b]; `decodes` and `n`: its rows and steps, for
    the call chained after it); a speculative call's (`spec`) up to k + 1 a step, read by
    meshlab.infer.speculative."""
    __slots__ = ("out", "logprobs", "rows", "decodes", "n", "spec")

    def __init__(self, out: dict, logprobs, rows: list, decodes: list | None = None, n: int = 1, spec: bool = False):
        self.out, self.logprobs, self.rows, self.decodes, self.n, self.spec = out, logprobs, rows, decodes, n, spec


class PackedSteps:
    """The packed steps of an `Engine`: they use its scheduler, buckets, slot settings and calls."""

    def _packed_slots(self, nd: int, k: int, c: int, score: bool = False) -> calls.Slots:
        s = self.sched
        return self._slots_for((nd, k, c, score), lambda: calls.packed_slots(
            nd, k, c, s.max_pages, self.slot_rows, s.max_seqs, self.cache["k"].shape[1], score))

    def _packed_input(self, slots: calls.Slots):
        """A packed step's input buffer: numpy (the runtime copies it to the device inside the call), or
        with pinned_inputs put into pinned host memory first (the program copies it in)."""
        return slots.take() if self._pinned is None else jax.device_put(slots.take(), self._pinned[0])

    def _packed(self, decodes, prefills) -> Flight:
        """Dispatch one packed step; its flight, for `Engine._land` (Engine.step decides when)."""
        s, m = self.sched, len(decodes)
        c = next(w for w in self.WIDTHS if w >= prefills[0][2]) if len(prefills) == 1 else self.chunk
        nd = next(x for x in self.MIXED_DECODE if x >= m)
        k = next(x for x in self.PREFILL_ROWS if x >= len(prefills))
        scored = self._scored_rows(prefills)            # chunk rows computing prompt logprobs (scoring.py)
        score, ranks = self._score_flag(scored), self._rank_flag(scored)
        slots = self._packed_slots(nd, k, c, score is not None)
        real = calls.fill_packed(slots.fill(), decodes, prefills, s.table, s.page_size, self.slot_rows)
        if scored:
            self._fill_targets(slots.views["p.targets"], scored, c)
        if self.reuse_hidden:            # the page ends whose hidden states this step keeps
            ends = page_end_rows(slots.views["p.positions"], slots.views["p.write_page"], s.page_size,
                                 len(s.hidden_ok), xp=np)
            s.hidden_ok[ends[ends < len(s.hidden_ok)]] = True
        greedy, logprobs, cut = self._flags(real)
        out = self._launch(("packed", nd, k, c, greedy, logprobs, score, ranks, cut), self.packed_call,
                           self._packed_input(slots), layout=slots.layout, greedy=greedy, logprobs=logprobs, score=score,
                           cut=cut, ranks=ranks)
        self._keep_scores(out, scored, c)
        self.stats["steps"] += 1
        self.stats["packed_calls"] += 1
        self.stats["prefill_tokens"] += sum(r.cached < len(r.prompt) for r in decodes)
        rows = []                         # the rows that sample a token they keep
        for i, r in enumerate(decodes):
            r.cached += 1
            r.pending += 1
            rows.append((r, i, 1, r.preemptions, False))
        for j, (r, start, n) in enumerate(prefills):
            r.cached = start + n
            self.stats["prefill_tokens"] += n
            if r.cached == r.n_tokens:
                r.pending += 1
                rows.append((r, nd + j, 1, r.preemptions, True))
            else:                         # computed pages offered to the prefix cache now (no token to wait for)
                s.register(r)
        if not rows:
            # No row samples a token it keeps: nothing to read back. The host plans and dispatches the
            # next step (the next chunks of a prompt longer than one step's rows) while the device runs
            # this one (a 2k prompt in four one-row steps: 17.1 -> 14.3 ms to its first token, H200).
            self.stats["unread_calls"] += 1
        return Flight(out, logprobs, rows)
