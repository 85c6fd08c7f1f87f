"""Speculative decoding by prompt lookup: `Speculation`, which `Engine` inherits, and its program.

Each step of a speculative call drafts k tokens per row from the row's own tokens (prompt and
output): the tokens that followed the latest earlier occurrence of the row's last `ngram` tokens
(the longest suffix of at most prompt_lookup_max tokens that occurs before; vLLM's `ngram` method,
Saxena's prompt lookup decoding). The step feeds the row's last token and its k drafts in one
forward of k + 1 tokens, takes the argmax at each position, and keeps the drafts up to the first
the model disagrees with plus the model's own token there: 1 to k + 1 tokens a step for one weight
stream, and exactly the tokens greedy decoding gives (in float32; bf16 kernels are not
batch-invariant, so a k + 1-token step may round a near-tie another way than a one-token step).
Drafts and their checks stay on the device for the call's n steps (a row's tokens are uploaded
once per call), so the host reads back once a call, as for plain decode calls.

Where it pays: text that repeats its context (code edits, extraction, quoting a document, a chat
that restates the question); elsewhere a draft is rarely kept and a step costs a k + 1-token
forward instead of a one-token one. Only greedy rows without logprobs speculate (a draw would
need rejection sampling), and only while at most `speculative_max_batch` rows decode: a step over
b (k + 1) tokens stops being a weight stream as b grows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.infer import calls, kv_cache
from meshlab.infer.programs import _bind, _split_own
from models import serving


def propose(history, length, k: int, ngram: int):
    """Drafts [b, k] int32 (-1: none) from history [b, L] int32, whose positions below length [b] hold
    each row's tokens: the k tokens after the latest earlier occurrence of the row's longest suffix
    of at most `ngram` tokens that occurs before its end (none when no suffix token recurs)."""
    b, L = history.shape
    idx = jnp.arange(L)[None]                                                     # [1, L]
    end = jnp.full((b,), -1, jnp.int32)                                           # the match's last position
    for n in range(1, ngram + 1):                                                 # longer suffixes override
        suffix = jnp.take_along_axis(history, jnp.clip(length[:, None] - n + jnp.arange(n), 0, L - 1), axis=1)  # [b, n]
        match = (idx >= n - 1) & (idx < length[:, None] - 1)                      # [b, L] an earlier end j
        for t in range(n):                                                        # history[j - (n-1-t)] == suffix[t]
            shift = n - 1 - t
            shifted = jnp.pad(history, ((0, 0), (shift, 0)))[:, :L] if shift else history
            match &= shifted == suffix[:, t:t + 1]
        found = jnp.max(jnp.where(match, idx, -1), axis=1)                        # [b]
        end = jnp.where(found >= 0, found, end)
    at = end[:, None] + 1 + jnp.arange(k)                                         # [b, k]
    known = (end[:, None] >= 0) & (at < length[:, None])
    return jnp.where(known, jnp.take_along_axis(history, jnp.clip(at, 0, L - 1), axis=1), -1)


def kept_tokens(drafts, best, pos, limit):
    """Tokens a step keeps per row [b]: the drafts [b, k] that equal the model's argmax before them
    (best [b, k + 1]: its choice after each fed token), up to the first that does not, plus the
    model's own next one; none past limit (positions pos + i fed while below it)."""
    agree = jnp.cumprod((drafts == best[:, :-1]).astype(jnp.int32), axis=1)       # [b, k] leading agreements
    return jnp.clip(jnp.minimum(jnp.sum(agree, axis=1) + 1, limit - pos), 0, None)


def make_spec_loop(md, impl: str = "xla", interpret: bool = False, layers: str = "split"):
    """spec_loop(params, cache, seen, tok, pos, limit, table, history, n, k, ngram) -> (outputs, cache,
    seen): n speculative steps over rows [b] whose last token tok sits at position pos (fed while
    below limit), history [b, L] each row's tokens (positions 0..pos). Outputs "tokens" [n, b, k + 1]
    (the argmax after each fed token; a step's first `count` are kept), "count" [n, b], "drafted"
    [n, b] (drafts fed at a position below limit)."""
    vocab = md.cfg.vocab_size
    unroll, kernels = layers == "unroll", layers == "kernels"

    def spec_loop(params, cache, seen, tok, pos, limit, table, history, n: int, k: int, ngram: int):
        model, per_layer = _bind(md, params, layers)
        cache, own = _split_own(cache)
        b, L = history.shape
        steps = jnp.arange(k + 1)

        def body(carry, _):
            cache, history, tok, pos = carry
            drafts = propose(history, pos + 1, k, ngram)                          # [b, k]
            fed = jnp.concatenate([tok[:, None], jnp.maximum(drafts, 0)], axis=1) # [b, k + 1]
            positions = pos[:, None] + steps                                      # [b, k + 1]
            valid = positions < limit[:, None]
            attend = kv_cache.paged_attend(positions, valid, table, impl, interpret)
            h, cache = serving.forward(model, fed, positions, cache, attend, unroll=unroll, layers=per_layer,
                                       kernels=kernels)                           # [b, k + 1, d]
            best = jnp.argmax(model.logits(h)[..., :vocab], axis=-1).astype(jnp.int32)   # [b, k + 1]
            count = kept_tokens(drafts, best, pos, limit)                         # [b]
            at = jnp.where(steps < count[:, None], positions + 1, L)              # [b, k + 1]; L: dropped
            history = history.at[jnp.arange(b)[:, None], at].set(best, mode="drop")
            last = jnp.take_along_axis(best, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
            drafted = jnp.sum((drafts >= 0) & valid[:, 1:], axis=1).astype(jnp.int32)
            return (cache, history, jnp.where(count > 0, last, tok), pos + count), (best, count, drafted)

        (cache, *_), (best, count, drafted) = jax.lax.scan(body, (cache, history, tok, pos), None, length=n)
        return {"tokens": best, "count": count, "drafted": drafted}, dict(cache, **own), seen
    return spec_loop


def spec_program(spec_loop, treedef, compiler_options: dict | None = None):
    """spec_loop taking (weights, cache, seen, buf, layout) as calls.decode_program's: the buffer holds
    tok, pos, limit, table and history."""
    def call(weights, cache, seen, buf, layout, n, k, ngram):
        params, a = jax.tree.unflatten(treedef, weights), calls.unpack(buf, layout)
        return calls.state_first(spec_loop(params, cache, seen, a["tok"], a["pos"], a["limit"], a["table"],
                                           a["history"], n=n, k=k, ngram=ngram))
    return jax.jit(call, donate_argnums=(1, 2), static_argnames=("layout", "n", "k", "ngram"),
                   compiler_options=compiler_options)


def spec_inputs(reqs, b: int, table: np.ndarray, max_len: int) -> tuple[np.ndarray, tuple]:
    """(buffer, layout) of a speculative call over `reqs` in a bucket of b rows (padding rows: limit 0,
    nothing fed): each row's last token, its position, limit, page table row and tokens."""
    tok, pos, limit = (np.zeros(b, np.int32) for _ in range(3))
    history = np.zeros((b, max_len), np.int32)
    slots = np.zeros(b, np.int32)
    for i, r in enumerate(reqs):
        ids = r.token_ids(r.n_tokens)
        history[i, :len(ids)] = ids
        tok[i], pos[i], limit[i], slots[i] = ids[-1], r.cached, r.end, r.slot
    h = calls.HostInputs()
    for name, a in (("tok", tok), ("pos", pos), ("limit", limit), ("table", table[slots]), ("history", history)):
        h.add(name, a)
    return h.pack()


class Speculation:
    """Speculative decode calls for an `Engine` (its scheduler, programs, flags and stats)."""

    def _speculates(self, decodes) -> bool:
        """Whether a decode call of these rows speculates: on, few enough rows, each greedy (argmax of
        the raw logits) without logprobs."""
        if not self.speculative_tokens or len(decodes) > self.speculative_max_batch:
            return False
        greedy, logprobs, _ = self._flags(np.array([r.slot for r in decodes], np.int32))
        return greedy and logprobs is None

    def _speculate(self, decodes) -> bool:
        """One speculative call of steps_per_call steps over `decodes` (each fed its last token from the
        host: none pending), read back and emitted at once; False (nothing done) when pages for even
        one step's k + 1 tokens are short."""
        s, k, m = self.sched, self.speculative_tokens, len(decodes)
        n = self.steps_per_call
        if not s.reserve_ahead(decodes, n * (k + 1)):
            n = 1
            if not s.reserve_ahead(decodes, k + 1):
                return False
        b = next(x for x in self.DECODE if x >= m)
        buf, layout = spec_inputs(decodes, b, s.table, s.max_len)
        out = self._fetch(self._launch(("spec", b, n, k), self.spec_call, buf, layout=layout, n=n, k=k,
                                       ngram=self.prompt_lookup_max))
        count = out["count"][:, :m]                                                 # [n, m]
        self.stats["steps"] += n
        self.stats["spec_calls"] += 1
        self.stats["spec_drafted"] += int(out["drafted"][:, :m].sum())
        self.stats["spec_accepted"] += int(np.maximum(count - 1, 0).sum())
        for i, r in enumerate(decodes):
            tokens = np.concatenate([out["tokens"][j, i, :count[j, i]] for j in range(n)])
            r.cached += int(count[:, i].sum())
            self._emit(r, tokens)
        return True
