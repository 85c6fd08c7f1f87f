"""`Warmup`, which `Engine` inherits: every bucket's program compiled before the first request.

Each bucket (decode rows, first-token and head calls, packed shapes; see `Engine`) is one program,
compiled at its first call; `warmup` makes that call for each on padding only, so a server's
first requests wait for no compile.
"""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from meshlab.infer import calls
from meshlab.infer.programs import TOP_LOGPROBS, placement
from meshlab.infer.sampler import CUT_MIN_P, CUT_NONE, CUT_TOP_K, CUT_TOP_P
from meshlab.infer.speculative import spec_inputs

# What a server compiles before it listens, or after while idle (scripts/serve.py --warmup-kinds,
# --warmup-idle-kinds): each kind is one set of the programs' static flags (greedy, logprobs,
# prompt-logprob score), every bucket compiled for it.
WARMUP_KINDS = {"greedy": dict(greedy=True),                       # temperature 0, no penalties
                "sampled": dict(greedy=False),                     # temperature, penalties, logit_bias, grammars
                "min_p": dict(greedy=False, cut=CUT_MIN_P),        # the same with min_p (vLLM's)
                "top_p": dict(greedy=False, cut=CUT_TOP_P),        # the same with top_p (OpenAI's)
                "top_k": dict(greedy=False, cut=CUT_TOP_K),        # the same with top_k (and top_p)
                "logprobs": dict(greedy=True, logprobs=TOP_LOGPROBS),
                "scoring": dict(greedy=True, logprobs=TOP_LOGPROBS, score=1)}   # an evaluation harness's


class Warmup:
    """`warmup` for an `Engine`: its buckets' programs called through its own calls (compiles counted)."""

    def warmup(self, greedy: bool = True, logprobs=None, report: Callable | None = None, score=None,
               limit: int | None = None, cut: int = CUT_NONE) -> int:
        """Compile every bucket's program now for these static flags (decode calls of steps_per_call
        steps and of one, which runs when pages for more are short or a request is held to a grammar;
        first-token and head calls; every packed shape) by calling each on padding only: nothing is
        written, no request is touched. A server does this before its first request (WARMUP_KINDS: the
        flags of each kind of request; the speculative calls too, when on, for every kind but scoring). score:
        the packed shapes' prompt-logprob flag (scoring._score_flag). report(key, seconds) after each
        program compiled. limit: compile at most this many (a server's engine thread warms while idle,
        one program at a time). Returns the number of programs compiled (those compiled before are
        skipped). cut: the sampled programs that cut draws to min_p (CUT_MIN_P), top_p (CUT_TOP_P) or
        top_k (CUT_TOP_K; Engine._flags)."""
        s, b_max, before = self.sched, self.sched.max_seqs, self.stats["compiles"]
        cut = CUT_NONE if greedy else cut
        flags = dict(greedy=greedy, logprobs=logprobs, cut=cut)

        def run(key, call, buf, **kw):
            if key not in self._programs and (limit is None or self.stats["compiles"] - before < limit):
                _, t0, t1 = self._call(key, call, buf, **kw, **flags)
                report and report(key, t1 - t0)
        spec_k = self.speculative_tokens if score is None else 0
        spec_rows = next(b for b in self.DECODE if b >= min(self.speculative_max_batch, b_max))
        with placement(self.rules, self.mesh):
            for b in self.DECODE:
                z, pad = np.zeros(b, np.int32), np.full(b, b_max, np.int32)
                buf, layout = calls.decode_inputs(z, z, z, s.table[z], pad, self._row_inputs(z), z, pad)
                for n in sorted({self.steps_per_call, 1}, reverse=True):
                    run(("decode", b, n, greedy, logprobs, cut), self.decode_call, buf, layout=layout, n=n)
                    for chained in (False, True) if spec_k and b <= spec_rows else ():   # padding: limit 0
                        spec_buf, spec_layout = spec_inputs([], b, s.table, s.max_len, self._row_inputs(z), b_max, chained)
                        run(("spec", b, n, spec_k, greedy, logprobs, cut, chained), self.spec_call, spec_buf,
                            layout=spec_layout, n=n, k=spec_k, ngram=self.prompt_lookup, chained=chained)
                if not self.first_token_decode:   # its one-step program is never called: not compiled
                    continue
                slots = self._first_slots(b)
                slots.fill()                                          # padding only: limit 0, nothing fed
                run(("first", b, 1, greedy, logprobs, cut), self.first_call, slots.take(), layout=slots.layout, n=1)
                if self.reuse_hidden:
                    slots = self._head_slots(b)
                    slots.fill()                                      # page 0's row: read, nothing written
                    run(("head", b, greedy, logprobs, cut), self.head_call, slots.take(), layout=slots.layout,
                        weights=self.head_weights)
            shapes = [(nd, k, w) for nd, k, w in itertools.product(self.MIXED_DECODE, self.PREFILL_ROWS, self.WIDTHS)
                      if w == self.chunk or k == 1]
            for nd, k, w in shapes:
                slots = self._packed_slots(nd, k, w, score is not None)
                slots.fill()                                          # padding only
                run(("packed", nd, k, w, greedy, logprobs, score, False, cut), self.packed_call, self._packed_input(slots),
                    layout=slots.layout, score=score, ranks=False)
        return self.stats["compiles"] - before
