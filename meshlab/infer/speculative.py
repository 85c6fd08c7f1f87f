"""Speculative decoding by prompt lookup: `Speculation`, which `Engine` inherits, and its program.

Each step of a speculative call drafts k tokens per row from the row's own tokens (prompt and
output): the tokens that followed the latest earlier occurrence of the row's longest suffix of
prompt_lookup_min to prompt_lookup_max tokens that occurs before (vLLM's `ngram` method, Saxena's
prompt lookup decoding). The step feeds the row's last token and its k drafts in one forward of
k + 1 tokens and keeps the drafts up to the first one rejected, then the model's own token there
(chosen_tokens): a greedy row keeps a draft that is the argmax, a sampled row keeps it with the
probability the model gives it and otherwise draws without it (speculative sampling), so the tokens
are greedy decoding's (equal in float32; bf16 kernels may round a near-tie another way in a k +
1-token step) or distributed as plain sampling's. A step where no row drafts feeds the rows' tokens
alone. On a GPU the k + 1 tokens attend through the paged prompt kernel (kv_cache.span_attention), so
a step reads the row's pages, not the table's full width. Drafts and their checks stay on the device:
a call's n steps carry each row's tokens, and the call leaves them in the cache (SPEC), so the next
call chains from there as decode calls do (the host uploads a row's tokens only when its rows change)
and the host reads one back while the device runs the next. The rows change only after a call is
read back (no step is planned over it). A step's choice between the two forwards is a lax.cond, whose
predicate XLA:GPU reads back to the host (a sync each step); as a CUDA-graph conditional node
(Engine(compiler_options={"spec": ...}) with CONDITIONAL command buffers) the call ran 3-5% slower on an
H100 (docs/archive/benchmarks-diary.md).

Where it pays: text that repeats its context (code edits, extraction, quoting a document, a chat
that restates the question); elsewhere a step with a draft costs a k + 1-token forward for the one
token it keeps. A row asking for logprobs gets each kept token's from the logits that chose it (those
of the raw model, as every call reports them). Penalties, logit bias and min_tokens change each
position's logits as plain decoding would there (stepwise_penalties: the drafts before it seen and
counted). Rows held to a token mask (a grammar, allowed or banned tokens: the host sets it before each
step) decode as before, and so does a call of more than `speculative_max_batch` rows: a step over
b (k + 1) tokens stops being a weight stream as b grows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.infer import calls, kv_cache
from meshlab.infer.calls import logprob_rows
from meshlab.infer.packed import Flight
from meshlab.infer.programs import BIAS, COUNTS, LAST, SPEC, TOP_LOGPROBS, _bind, _logprobs, _mark, _split_own
from meshlab.infer.sampler import count_sampled, draw_keys, draw_logits, penalties
from models import serving


MAX_PROMPT_LOOKUP = 64   # the longest suffix a draft is looked up by (64: compiled in seconds on a CPU; 256: minutes)


def check_speculation(tokens: int, shortest: int, longest: int, max_batch: int, max_len: int) -> None:
    """ValueError naming Engine's arguments when its speculative settings cannot work."""
    if tokens < 0 or not 1 <= shortest <= longest or max_batch < 1:
        raise ValueError(f"speculative_tokens={tokens} must be >= 0 (0: off), 1 <= prompt_lookup_min={shortest} <= "
                         f"prompt_lookup_max={longest}, speculative_max_batch={max_batch} >= 1")
    if tokens >= max_len:
        raise ValueError(f"speculative_tokens={tokens} must be below max_len={max_len}: a speculative step feeds a row "
                         "its last token and its drafts")
    if tokens and longest > MAX_PROMPT_LOOKUP:
        raise ValueError(f"prompt_lookup_max={longest} must be <= {MAX_PROMPT_LOOKUP}: the lookup's program holds a pass "
                         "per suffix length, so its compile time grows as the square of prompt_lookup_max")


def propose(history, length, k: int, ngram: int, shortest: int = 1):
    """Drafts [b, k] int32 (-1: none) from history [b, L] int32, whose positions below length [b] hold
    each row's tokens: the k tokens after the latest earlier occurrence of the row's longest suffix
    of `shortest` to `ngram` tokens that occurs before its end (none when no such suffix recurs)."""
    b, L = history.shape
    idx = jnp.arange(L)[None]                                                     # [1, L]
    end = jnp.full((b,), -1, jnp.int32)                                           # the match's last position
    for n in range(shortest, ngram + 1):                                          # longer suffixes override
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


def chosen_tokens(logits, drafts, rows, counters, greedy: bool, cut: int):
    """A step's tokens per row from logits [b, t, V] (the model's after each fed token: the row's own,
    then its t - 1 drafts [b, t - 1], -1 for none) -> (tokens [b, t]: the drafts kept, then the model's
    own token, then -1; kept [b]: how many drafts). A greedy row (temperature 0) keeps the drafts that
    are the argmax and ends with the argmax. A sampled row keeps draft d with probability p(d), p its
    distribution there (sampler.draw_logits: temperature and cuts), and ends with a draw from p with the
    rejected draft taken out, or from the last p when every draft is kept: speculative sampling
    (Leviathan et al.) with a draft that is certain, q(d) = 1, so every token is distributed as plain
    sampling's (not the same draws: a kept draft takes none). Position j's draw is keyed as plain
    sampling's would be (sampler.draw_keys at counter + j), its test by that key's fold_in 1. Rows [b]
    of sampler.row_arrays; greedy and cut: the static promises sampler.sample takes."""
    b, t, vocab = logits.shape
    j = jnp.arange(t)
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)                          # [b, t]
    valid = drafts >= 0
    agree, final = drafts == best[:, :-1], best                                   # [b, t - 1], [b, t]
    if not greedy:
        flat = jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), rows)             # [b t] per setting
        scaled = draw_logits(logits.reshape(b * t, vocab), flat, cut).reshape(b, t, vocab)
        keys = draw_keys(flat["seed"], (counters[:, None] + j).reshape(-1))       # [b t]
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys).reshape(b, t)
        at = jnp.maximum(drafts, 0)[..., None]                                    # [b, t - 1, 1]
        p_draft = jnp.take_along_axis(jax.nn.log_softmax(scaled[:, :-1], axis=-1), at, axis=-1)[..., 0]
        rejected = jnp.put_along_axis(scaled[:, :-1], at, -jnp.inf, axis=-1, inplace=False)
        rest = jnp.where(valid[..., None], rejected, scaled[:, :-1])              # the rejected draft out
        pool = jnp.concatenate([rest, scaled[:, -1:]], axis=1).reshape(b * t, vocab)
        draws = jax.vmap(jax.random.categorical)(keys, pool).reshape(b, t).astype(jnp.int32)
        sampled = (rows["temperature"] > 0)[:, None]                              # [b, 1]
        agree = jnp.where(sampled, valid & (jnp.log(u[:, :-1]) < p_draft), agree)
        final = jnp.where(sampled, draws, best)
    kept = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)          # [b] leading kept drafts
    own = jnp.take_along_axis(final, kept[:, None], axis=1)                       # [b, 1]
    padded = jnp.concatenate([drafts, jnp.full((b, 1), -1, jnp.int32)], axis=1)   # [b, t]
    return jnp.where(j < kept[:, None], padded, jnp.where(j == kept[:, None], own, -1)), kept


def stepwise_penalties(logits, fed, valid, rows, counters, seen_rows, count_rows, bias_rows):
    """logits [b, t, V] after each fed token [b, t] (the row's token, then its drafts; valid [b, t]) -> the
    logits each position's draw sees (sampler.penalties) with the row's state as plain decoding would have
    it there: the fed tokens up to the position seen, the drafts up to it generated (counted), the counter
    advanced by the position. seen_rows / count_rows [b, V] and bias_rows (or None) as the step starts."""
    b, t, vocab = logits.shape
    hot = jax.nn.one_hot(jnp.where(valid, fed, vocab), vocab, dtype=jnp.int32)          # [b, t, V]; padding: none
    seen = seen_rows[:, None] | (jnp.cumsum(hot, axis=1) > 0)                             # [b, t, V]
    counts = None if count_rows is None else count_rows[:, None] + jnp.cumsum(hot.at[:, 0].set(0), axis=1)
    flat = lambda a: a.reshape(b * t, *a.shape[2:])                                       # noqa: E731 - [b t, ...]
    each = lambda a: jnp.repeat(a, t, axis=0)                                             # noqa: E731 - a row per position
    pen = penalties(flat(logits), jax.tree.map(each, rows), (counters[:, None] + jnp.arange(t)).reshape(-1), flat(seen),
                    None if counts is None else flat(counts), None if bias_rows is None else each(bias_rows))
    return pen.reshape(b, t, vocab)


def kept_tokens(kept, pos, limit):
    """Tokens a step keeps per row [b]: its kept drafts and the model's own token after them; none for a
    row at or past its limit (padding, or a row that reached its end). No draft is fed at the limit or
    past it, so the kept ones never pass it."""
    return jnp.where(pos < limit, kept + 1, 0)


def make_spec_loop(md, impl: str = "xla", interpret: bool = False, layers: str = "split"):
    """spec_loop(params, cache, seen, tok, pos, limit, table, history, slots, rows, counters, n, k, ngram,
    greedy, cut, chained, logprobs) -> (outputs, cache, seen): n speculative steps over rows [b] whose last token
    tok sits at position pos (fed while below limit), history [b, L] each row's tokens (positions
    0..pos), rows and counters as sampler.sample's; ngram (shortest, longest) the suffixes looked up.
    chained: tok, pos, history and counters (None) are instead the state the last call left for each
    slot in the cache's SPEC and LAST entries (slots [b]; padding max_seqs), where every call leaves
    its own. A step where no row drafts runs a one-token forward (the decode kernels where the layers
    have them), so text that never repeats costs about what plain decoding does. Outputs "tokens" [n, b,
    k + 1] (chosen_tokens'; a step's first `count` are kept), "count" [n, b], "drafted" [n, b] (drafts fed);
    with logprobs (None, 0 or TOP_LOGPROBS, as Engine._flags), each token's as programs._head reports
    them: "logprob" [n, b, k + 1], "top_logprob" and "top_id" [n, b, k + 1, top]."""
    vocab = md.cfg.vocab_size
    unroll, kernels = layers == "unroll", layers == "kernels"

    def spec_loop(params, cache, seen, tok, pos, limit, table, history, slots, rows, counters, n: int, k: int,
                  ngram: tuple, greedy: bool, cut: int, chained: bool, logprobs=None):
        model, per_layer = _bind(md, params, layers)
        cache, own = _split_own(cache)
        steps = jnp.arange(k + 1)
        state = own[SPEC]
        if chained:                             # the rows' state where the call before left it
            at = jnp.minimum(slots, state["pos"].shape[0] - 1)
            tok, pos, counters, history = own[LAST][at], state["pos"][at], state["count"][at], state["history"][at]
        b, L = history.shape
        at_slots = jnp.minimum(slots, seen.shape[0] - 1)                          # padding rows read the last slot's

        def forward(cache, fed, positions, valid):
            attend = kv_cache.paged_attend(positions, valid, table, impl, interpret, spans=True)
            h, cache = serving.forward(model, fed, positions, cache, attend, unroll=unroll, layers=per_layer,
                                       kernels=kernels)                           # [b, t, d]
            return model.logits(h)[..., :vocab], cache                            # [b, t, V] fp32

        def choose(logits, drafts, counters, fed, valid, seen_rows, count_rows):
            """(chosen_tokens' tokens [b, t] and kept [b] over the logits each position's draw sees, the
            tokens' logprobs (of the raw logits) padded to k + 1 along t)."""
            pen = logits if greedy else stepwise_penalties(logits, fed, valid, rows, counters, seen_rows, count_rows,
                                                           own[BIAS][at_slots] if BIAS in own else None)
            tokens, kept = chosen_tokens(pen, drafts, rows, counters, greedy, cut)
            if logprobs is None:
                return tokens, kept, {}
            t = logits.shape[1]
            lps = _logprobs(logits.reshape(b * t, vocab), jnp.maximum(tokens, 0).reshape(-1), logprobs and TOP_LOGPROBS)
            pad = lambda a: jnp.pad(a.reshape(b, t, *a.shape[1:]), [(0, 0), (0, k + 1 - t)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
            return tokens, kept, dict(zip(("logprob", "top_logprob", "top_id"), map(pad, lps)))   # [b, k + 1(, top)]

        def body(carry, _):
            cache, seen, counts, history, tok, pos, counters = carry
            positions = pos[:, None] + steps                                      # [b, k + 1]
            valid = positions < limit[:, None]
            drafts = jnp.where(valid[:, 1:], propose(history, pos + 1, k, ngram[1], ngram[0]), -1)   # [b, k]
            fed = jnp.concatenate([tok[:, None], jnp.maximum(drafts, 0)], axis=1)              # [b, k + 1]
            seen_rows = None if greedy else seen[at_slots]                                     # [b, V]
            count_rows = None if counts is None else counts[at_slots]

            def check(cache):                   # each row's token and its drafts
                logits, cache = forward(cache, fed, positions, valid)
                return choose(logits, drafts, counters, fed, valid, seen_rows, count_rows), cache

            def plain(cache):                   # no draft in any row: its token alone
                logits, cache = forward(cache, tok[:, None], pos[:, None], valid[:, :1])       # [b, 1, V]
                tokens, kept, lps = choose(logits, drafts[:, :0], counters, fed[:, :1], valid[:, :1], seen_rows, count_rows)
                return (jnp.pad(tokens, ((0, 0), (0, k)), constant_values=-1), kept, lps), cache
            (tokens, kept, lps), cache = jax.lax.cond(jnp.any(drafts >= 0), check, plain, cache)
            count = kept_tokens(kept, pos, limit)                                 # [b]
            if not greedy:                      # the row's token and its kept drafts are seen, its kept tokens generated
                rows_at = jnp.broadcast_to(slots[:, None], (b, k + 1)).reshape(-1)             # [b (k + 1)]
                fed_seen = (steps == 0) & valid[:, :1] | (steps > 0) & (steps < count[:, None])
                seen = _mark(seen, rows_at, fed.reshape(-1), fed_seen.reshape(-1))
                if counts is not None:
                    counts = count_sampled(counts, rows_at, tokens.reshape(-1), (steps < count[:, None]).reshape(-1))
            at = jnp.where(steps < count[:, None], positions + 1, L)              # [b, k + 1]; L: dropped
            history = history.at[jnp.arange(b)[:, None], at].set(tokens, mode="drop")
            last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
            drafted = jnp.sum(drafts >= 0, axis=1).astype(jnp.int32)
            carry = (cache, seen, counts, history, jnp.where(count > 0, last, tok), pos + count, counters + count)
            return carry, (tokens, count, drafted, lps)

        counts = None if greedy else own.get(COUNTS)
        (cache, seen, counts, history, tok, pos, counters), (tokens, count, drafted, lps) = jax.lax.scan(
            body, (cache, seen, counts, history, tok, pos, counters), None, length=n)
        if counts is not None:
            own[COUNTS] = counts
        own[LAST] = own[LAST].at[slots].set(tok, mode="drop")                     # for a call chained behind
        own[SPEC] = {"history": state["history"].at[slots].set(history, mode="drop"),
                     "pos": state["pos"].at[slots].set(pos, mode="drop"),
                     "count": state["count"].at[slots].set(counters, mode="drop")}
        return {"tokens": tokens, "count": count, "drafted": drafted, **lps}, dict(cache, **own), seen
    return spec_loop


def spec_program(spec_loop, treedef, compiler_options: dict | None = None):
    """spec_loop taking (weights, cache, seen, buf, layout) as calls.decode_program's: the buffer holds
    spec_inputs' arrays (a chained call's only limit, table, slots and rows)."""
    def call(weights, cache, seen, buf, layout, n, k, ngram, greedy, cut, chained, logprobs=None):
        params, a = jax.tree.unflatten(treedef, weights), calls.unpack(buf, layout)
        return calls.state_first(spec_loop(params, cache, seen, a.get("tok"), a.get("pos"), a["limit"], a["table"],
                                           a.get("history"), a["slots"], a["rows"], a.get("counters"), n=n, k=k,
                                           ngram=ngram, greedy=greedy, cut=cut, chained=chained, logprobs=logprobs))
    return jax.jit(call, donate_argnums=(1, 2), compiler_options=compiler_options,
                   static_argnames=("layout", "n", "k", "ngram", "greedy", "cut", "chained", "logprobs"))


def spec_inputs(reqs, b: int, table: np.ndarray, max_len: int, rows: dict, max_seqs: int,
                chained: bool = False) -> tuple[np.ndarray, tuple]:
    """(buffer, layout) of a speculative call over `reqs` in a bucket of b rows (padding rows: limit 0,
    nothing fed, slot max_seqs): each row's limit, page table row, slot and sampler settings (rows:
    Engine._row_inputs of their slots), and, unless chained (the device holds them), its tokens, last
    token, position and output count."""
    limit, slots = np.zeros(b, np.int32), np.full(b, max_seqs, np.int32)
    for i, r in enumerate(reqs):
        slots[i], limit[i] = r.slot, r.end
    h = calls.HostInputs()
    for name, a in (("limit", limit), ("table", table[np.minimum(slots, len(table) - 1)]), ("slots", slots)):
        h.add(name, a)
    h.add_tree("rows", rows)
    if not chained:
        tok, pos, counters = (np.zeros(b, np.int32) for _ in range(3))
        history = np.zeros((b, max_len), np.int32)
        for i, r in enumerate(reqs):
            ids = r.token_ids(r.n_tokens)
            history[i, :len(ids)] = ids
            tok[i], pos[i], counters[i] = ids[-1], r.cached, len(r.output)
        for name, a in (("tok", tok), ("pos", pos), ("history", history), ("counters", counters)):
            h.add(name, a)
    return h.pack()


class Speculation:
    """Speculative decode calls for an `Engine` (its scheduler, programs, flags and stats)."""

    def _speculates(self, decodes) -> bool:
        """Whether a decode call of these rows speculates: on, few enough rows, none held to a token mask
        (a grammar, allowed or banned tokens: the host sets it before each step)."""
        if not self.speculative_tokens or len(decodes) > self.speculative_max_batch:
            return False
        return not any(r in self.masked for r in decodes)

    def _speculate(self, decodes, chained: bool = False):
        """A speculative call of steps_per_call steps over `decodes`, left running (a Flight, read back by
        _land_spec): fed their last tokens from the host (none pending), or, chained, from where the call
        in flight leaves them on the device, with pages for both. None (nothing done) when pages for even
        one step's k + 1 tokens are short (chained: for n steps of both)."""
        s, k, m = self.sched, self.speculative_tokens, len(decodes)
        n = self.steps_per_call
        if not s.reserve_ahead(decodes, (2 if chained else 1) * n * (k + 1)):
            if chained:
                return None
            n = 1
            if not s.reserve_ahead(decodes, k + 1):
                return None
        b = next(x for x in self.DECODE if x >= m)
        slots = np.full(b, s.max_seqs, np.int32)
        slots[:m] = [r.slot for r in decodes]
        greedy, logprobs, cut = self._flags(slots[:m])
        rows = self._row_inputs(np.minimum(slots, s.max_seqs - 1))
        buf, layout = spec_inputs(decodes, b, s.table, s.max_len, rows, s.max_seqs, chained)
        out = self._launch(("spec", b, n, k, greedy, logprobs, cut, chained), self.spec_call, buf, layout=layout, n=n,
                           k=k, ngram=self.prompt_lookup, greedy=greedy, cut=cut, chained=chained, logprobs=logprobs)
        self.stats["steps"] += n
        self.stats["spec_calls"] += 1
        self.stats["chained_calls"] += chained
        return Flight(out, logprobs, [], list(decodes), n, spec=True)

    def _chain_spec(self, f):
        """The speculative call after `f` (in flight), from the rows' state it leaves on the device; None
        when a row may end in f (it reaches its end position, or has stopped) or pages for both are short.
        Engine._chain checks arrivals, aborts and waiting requests first."""
        k = self.speculative_tokens
        if any(r.finish_reason is not None or r.cached + f.n * (k + 1) >= r.end for r in f.decodes):
            return None
        return self._speculate(f.decodes, chained=True)

    def _land_spec(self, f) -> None:
        """Read back a speculative call and emit its rows' tokens (and logprobs): each step's first `count`
        of a row."""
        out = self._fetch(f.out)
        m = len(f.decodes)
        count = out["count"][:, :m]                                                 # [n, m]
        self.stats["spec_drafted"] += int(out["drafted"][:, :m].sum())
        self.stats["spec_accepted"] += int(np.maximum(count - 1, 0).sum())
        kept = np.arange(out["tokens"].shape[2])[None, :, None] < count[:, None, :]  # [n, k + 1, m]
        lps = logprob_rows(out, 1) if f.logprobs is not None else None              # per row, [n (k + 1)] entries
        for i, r in enumerate(f.decodes):
            r.cached += int(count[:, i].sum())
            if r.finish_reason is None:
                mine = kept[:, :, i].reshape(-1)                                    # step-major, as logprob_rows
                self._emit(r, out["tokens"][:, i].reshape(-1)[mine],
                           [e for e, keep in zip(lps[i], mine) if keep] if lps else None)
