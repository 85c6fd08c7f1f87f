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
from meshlab.infer.programs import placement


class Warmup:
    """`warmup` for an `Engine`: its buckets' programs called through its own calls (compiles counted)."""

    def warmup(self, greedy: bool = True, logprobs=None, report: Callable | None = None) -> int:
        """Compile every bucket's program now (decode calls of steps_per_call steps, every packed
        shape) by calling each on padding only: nothing is written, no request is touched. A
        server does this before its first request. report(key, seconds) after each program.
        Returns the number of programs compiled."""
        s, b_max, before = self.sched, self.sched.max_seqs, self.stats["compiles"]
        with placement(self.rules, self.mesh):
            for b in self.DECODE:
                z = np.zeros(b, np.int32)
                key = ("decode", b, self.steps_per_call, greedy, logprobs)
                pad = np.full(b, b_max, np.int32)
                buf, layout = calls.decode_inputs(z, z, z, s.table[z], pad, self._row_inputs(z), z, pad)
                _, t0, t1 = self._call(key, self.decode_call, buf, layout=layout, n=self.steps_per_call,
                                       greedy=greedy, logprobs=logprobs)
                report and report(key, t1 - t0)
                if not self.first_token_decode:   # its one-step program is never called: not compiled
                    continue
                key, slots = ("first", b, 1, greedy, logprobs), self._first_slots(b)
                slots.fill()                                          # padding only: limit 0, nothing fed
                _, t0, t1 = self._call(key, self.first_call, slots.take(), layout=slots.layout, n=1,
                                       greedy=greedy, logprobs=logprobs)
                report and report(key, t1 - t0)
                if self.reuse_hidden:
                    key, slots = ("head", b, greedy, logprobs), self._head_slots(b)
                    slots.fill()                                      # page 0's row: read, nothing written
                    _, t0, t1 = self._call(key, self.head_call, slots.take(), layout=slots.layout, greedy=greedy,
                                           logprobs=logprobs, weights=self.head_weights)
                    report and report(key, t1 - t0)
            shapes = [(nd, k, w) for nd, k, w in itertools.product(self.MIXED_DECODE, self.PREFILL_ROWS, self.WIDTHS)
                      if w == self.chunk or k == 1]
            for nd, k, w in shapes:
                key = ("packed", nd, k, w, greedy, logprobs, None)
                slots = self._packed_slots(nd, k, w)
                slots.fill()                                          # padding only
                _, t0, t1 = self._call(key, self.packed_call, self._packed_input(slots), layout=slots.layout, greedy=greedy,
                                       logprobs=logprobs)
                report and report(key, t1 - t0)
        return self.stats["compiles"] - before
