"""Sampling on device: greedy, temperature, min-p, top-k, top-p, the repetition, presence and frequency
penalties and a per-token logit bias, seeded per request.

Every row carries its own settings (arrays [b]), so one compiled program serves a batch that mixes
greedy and sampled requests. The random key of a row is fold_in(key(seed), n) where n counts the
tokens that request has generated: a request draws the same tokens alone or batched, and again
after a preemption recomputes it.

What each part costs (one H200, 128 / 64 / 16 rows of a 128,256-token vocabulary, fp32, the whole
`sample`): when no row samples or penalises (all greedy), argmax alone (~0.05 ms): the engines know
that on the host (`all_greedy`) and compile a greedy program; `sample(..., greedy=None)` decides on
device with `lax.cond` instead, whose predicate XLA:GPU reads back to the host every step (a sync).
A sampled row draws by Gumbel max over its logits over the temperature (0.12-0.17 / 0.07-0.10 /
0.05-0.06 ms, no sort). min_p's floor is one more pass over the rows (their maxima; not timed), top_k
and top_p two thresholds found by radix select (`filtered`, both: 1.4 / 0.77 / 0.38 ms; each search is
8 of its 16 passes); programs run them only as their static `cut` says (CUT_MIN_P: some row in the
step sets min_p, none top_p or top_k; CUT_TOP_P: some row sets top_p, none top_k; CUT_TOP_K: some row
sets top_k). The [b, V] key-value sort they replace took 2.0 / 1.7 / 0.56 ms for every sampled step.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


MAX_LOGIT_BIAS = 300       # tokens a request may bias (OpenAI's logit_bias)
MAX_HELD_STOPS = 16        # stop tokens a request with min_tokens may hold back (its bias rows' extra entries)
BIAS_WIDTH = MAX_LOGIT_BIAS + MAX_HELD_STOPS
# A sampling program's static `cut`: what its draw cuts the vocabulary to (`cuts`); each level does what
# the ones below it do. OpenAI's API has no top_k (nor min_p), so its clients' steps skip those.
CUT_NONE, CUT_MIN_P, CUT_TOP_P, CUT_TOP_K = 0, 1, 2, 3     # nothing; min_p's floor; + top_p; + top_k
SEED_RANGE = 2 ** 31       # seeds ride in int32 rows (row_arrays)


class SamplingError(ValueError):
    """A SamplingParams setting out of range; `param` is the field at fault (the API answers 400 naming
    the request's field for it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0            # 0 = greedy
    top_k: int = 0                      # 0 = whole vocabulary
    top_p: float = 1.0
    # vLLM's and llama.cpp's min_p: keep the tokens whose probability (after the temperature) is at
    # least min_p times the best one's; 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0     # > 1 discourages tokens already in prompt or output (CTRL rule)
    # OpenAI's: logits - presence * [token generated before] - frequency * (times generated before),
    # over this request's output tokens only (as OpenAI and vLLM count them), in [-2, 2]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling (at most
    # MAX_LOGIT_BIAS tokens); logprobs still report the raw logits
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    # vLLM's min_tokens: the stop tokens cannot be sampled, and no stop ends the request, before this many
    # tokens (the stop tokens ride in the request's logit-bias rows at -inf while its counter is below it)
    min_tokens: int = 0
    stop: Sequence[str] = ()            # stop strings, checked on the detokenized output
    include_stop_str_in_output: bool = False   # vLLM's: the text ends after the stop string, not before it
    # None: off; k in [0, 20]: each output token's log-softmax (of the raw logits, before temperature
    # and filters, as OpenAI reports it) and its k most likely alternatives (Request.logprobs)
    logprobs: Optional[int] = None
    # None: off; k in [0, 20]: each prompt token's logprob given the tokens before it and its k most
    # likely alternatives (Request.prompt_logprobs; computed by the packed steps: meshlab/infer/scoring.py)
    prompt_logprobs: Optional[int] = None
    prompt_ranks: bool = False          # ... and each prompt token's rank (vLLM's prompt_logprobs reports it)
    # vLLM's: False shows special tokens in the text (a stop token that ends the output still only with
    # include_stop_str_in_output)
    skip_special_tokens: bool = True
    # None: free; else llguidance's grammar text (meshlab.infer.guided.json_grammar): every token is
    # sampled among those the grammar allows next, and a complete grammar ends the request ("stop")
    grammar: Optional[str] = None
    # vLLM's allowed_token_ids: None, or the only ids the output may hold (a fixed mask: no step rule)
    allowed_token_ids: Optional[Sequence[int]] = None
    # vLLM's bad_words as token ids (api tokenizes the words): a one-token word is never sampled; a longer
    # one's last token not after the output's tokens that begin it (meshlab.infer.guided.TokenRules)
    bad_words_ids: Sequence[Sequence[int]] = ()

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """self, checked (its stop strings and bad words made tuples, a top_k past the vocabulary 0: off);
        SamplingError names the field."""
        def bad(param, msg):
            raise SamplingError(msg, param)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"temperature={self.temperature!r} must be a number in [0, 100] (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if self.top_k >= (vocab_size or SEED_RANGE):   # keeps every token: off (the same draws without the top_k
            self.top_k = 0                              # search), and an int32 in the engine's rows
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p={self.top_p!r} must be a number in (0, 1]")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p={self.min_p!r} must be a number in [0, 1] (0 = off)")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"repetition_penalty={self.repetition_penalty!r} must be a number in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                bad(name, f"{name}={v!r} must be a number in [-2, 2] (0 = off)")
        if not isinstance(self.seed, int) or not 0 <= self.seed < SEED_RANGE:
            bad("seed", f"seed={self.seed!r} must be an integer in [0, 2**31) (the engine's int32 seeds; "
                "meshlab.infer.api folds any int64 into it)")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"min_tokens={self.min_tokens!r} must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.min_tokens and len(self.stop_token_ids) > MAX_HELD_STOPS:
            bad("min_tokens", f"min_tokens holds back at most {MAX_HELD_STOPS} stop tokens, not {len(self.stop_token_ids)}")
        if self.min_tokens and self.grammar is not None:
            bad("min_tokens", "min_tokens with a grammar (response_format, structured_outputs, a required tool call): "
                "the grammar decides where the reply ends; send one of them")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"stop_token_ids={list(self.stop_token_ids)} must lie in [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20):
                bad(name, f"{name}={k!r} must be None (off) or an integer in [0, 20]")
        _check_bias(self.logit_bias, vocab_size, bad)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            bad("grammar", "grammar must be None or llguidance's grammar text (meshlab.infer.guided.json_grammar)")
        _check_token_rules(self, vocab_size, bad)
        self.bad_words_ids = tuple(tuple(w) for w in self.bad_words_ids)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", f"stop={list(self.stop)!r} must be a list of non-empty strings")
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output",
                f"include_stop_str_in_output={self.include_stop_str_in_output!r} must be true or false")
        return self


def _check_bias(bias, vocab_size, bad) -> None:
    if not isinstance(bias, Mapping) or len(bias) > MAX_LOGIT_BIAS:
        bad("logit_bias", f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
    for t, b in bias.items():
        if isinstance(t, bool) or not isinstance(t, int) or (vocab_size is not None and not 0 <= t < vocab_size):
            bad("logit_bias", f"logit_bias: token {t!r} must be an id in [0, {vocab_size})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
            bad("logit_bias", f"logit_bias: the bias {b!r} of token {t} must be a number in [-100, 100]")


def _is_id(t, vocab_size) -> bool:
    return type(t) is int and t >= 0 and (vocab_size is None or t < vocab_size)


def _check_token_rules(p: SamplingParams, vocab_size, bad) -> None:
    allowed = p.allowed_token_ids
    if allowed is not None and (isinstance(allowed, (str, bytes)) or not allowed
                                or not all(_is_id(t, vocab_size) for t in allowed)):
        bad("allowed_token_ids", f"allowed_token_ids must be None or a non-empty list of token ids in [0, {vocab_size})")
    words = p.bad_words_ids
    if isinstance(words, (str, bytes)) or not all(not isinstance(w, (str, bytes)) and len(w) and
                                                  all(_is_id(t, vocab_size) for t in w) for w in words):
        bad("bad_words_ids", f"bad_words_ids must be a list of non-empty lists of token ids in [0, {vocab_size})")
    if allowed is not None and set(allowed) <= {w[0] for w in words if len(w) == 1}:
        bad("bad_words_ids", "bad_words bans every one of allowed_token_ids: nothing could be sampled")


def bias_row(p: SamplingParams, vocab_size: int) -> np.ndarray:
    """A request's logit-bias rows as one [3, BIAS_WIDTH] int32 array (one cache entry: each argument
    buffer costs every call's dispatch): token ids (padded with vocab_size: dropped), the biases' float32
    bits, and the counter each entry holds until. Its logit_bias holds for good; with min_tokens, its
    stop tokens follow at -inf until that many tokens are out (`bias_entries` reads them back)."""
    ids = np.full(BIAS_WIDTH, vocab_size, np.int32)
    vals = np.zeros(BIAS_WIDTH, np.float32)
    until = np.full(BIAS_WIDTH, np.iinfo(np.int32).max, np.int32)
    n = len(p.logit_bias)
    ids[:n], vals[:n] = list(p.logit_bias), list(p.logit_bias.values())
    if p.min_tokens:
        stops = list(dict.fromkeys(p.stop_token_ids))
        ids[n:n + len(stops)], vals[n:n + len(stops)], until[n:n + len(stops)] = stops, -np.inf, p.min_tokens
    return np.stack([ids, vals.view(np.int32), until])


def bias_entries(rows):
    """[..., 3, BIAS_WIDTH] int32 (bias_row's) -> (ids, biases float32, until), each [..., BIAS_WIDTH]."""
    return rows[..., 0, :], jax.lax.bitcast_convert_type(rows[..., 1, :], jnp.float32), rows[..., 2, :]


def row_arrays(params: Sequence[SamplingParams | None]) -> dict:
    """Per-row sampler settings as numpy arrays (rows without a request: greedy, no penalty)."""
    p = [q or SamplingParams() for q in params]
    return {"temperature": np.array([q.temperature for q in p], np.float32),
            "top_k": np.array([q.top_k for q in p], np.int32),
            "top_p": np.array([q.top_p for q in p], np.float32),
            "min_p": np.array([q.min_p for q in p], np.float32),
            "penalty": np.array([q.repetition_penalty for q in p], np.float32),
            "presence": np.array([q.presence_penalty for q in p], np.float32),
            "frequency": np.array([q.frequency_penalty for q in p], np.float32),
            "seed": np.array([q.seed for q in p], np.int32)}


def _penalise(logits, seen, penalty):
    """CTRL/HF repetition penalty: divide positive logits, multiply negative ones, for seen tokens."""
    pen = penalty[:, None]
    hit = jnp.where(logits > 0, logits / pen, logits * pen)
    return jnp.where(seen, hit, logits)


def _order_key(x):
    """float32 [..] -> uint32 [..] in the same order (-inf lowest, +inf highest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


# Bits a radix-select pass decides. The passes are bound by the reduction's work per element, not by
# HBM: the 15-wide pass of 4 digits ran as long on the H100 as on the H200 (1.48 / 1.40-1.46 ms a
# top_k + top_p cut at 128 rows), and on the H100 2 digits (16 passes of 3 sums) took 0.84 / 0.65 / 0.62
# of that time at 128 / 64 / 16 rows, 1 digit (32 passes of 1) 1.37 / 0.91 / 0.95.
CUT_DIGITS = 2


def _threshold(key, weight, target, digits: int = CUT_DIGITS):
    """Per row, the largest c with sum(weight * (key >= c)) >= target: key [b, V] uint32 (_order_key),
    weight [b, V] (None: 1 each), target [b]. A radix select from the top bit, `digits` bits a pass:
    each pass is one variadic reduction that reads the row once and sums the 2**digits - 1 next
    candidates at once (as one reduction of a [b, candidates, V] broadcast, the row was read once per
    candidate: 4.4 ms at b=128 on the H200). Where the row's sum never reaches target, 0 (all kept)."""
    if 32 % digits:
        raise ValueError(f"{digits=} must divide the key's 32 bits")
    t = jnp.zeros(key.shape[:1], jnp.uint32)                                       # [b]
    zero = jnp.zeros((), jnp.int32 if weight is None else weight.dtype)
    n = 2 ** digits - 1
    for shift in range(32 - digits, -1, -digits):
        above = [key >= (t | jnp.uint32(d << shift))[:, None] for d in range(1, n + 1)]   # n x [b, V]
        terms = tuple(a.astype(jnp.int32) if weight is None else jnp.where(a, weight, zero) for a in above)
        reach = jax.lax.reduce(terms, (zero,) * n, lambda xs, ys: tuple(x + y for x, y in zip(xs, ys)), (1,))
        ok = sum((r >= target).astype(jnp.uint32) for r in reach)                 # candidates reached: a prefix
        t = t | (ok << shift)
    return t


def scaled_logits(logits, rows, min_p: bool = True):
    """logits [b, V] over each row's temperature, -inf below its min_p: a token is kept when its
    probability is at least min_p times the best's, i.e. its scaled logit at least the best's +
    log(min_p) (min_p 0: log 0 = -inf keeps all). The floor is one more pass over the rows (their
    maxima); min_p False: a static promise that no row sets min_p, and that pass is skipped."""
    scaled = logits / jnp.maximum(rows["temperature"], 1e-6)[:, None]             # [b, V]
    if not min_p:
        return scaled
    floor = jnp.max(scaled, axis=-1) + jnp.log(rows["min_p"])                       # [b]
    return jnp.where(scaled >= floor[:, None], scaled, -jnp.inf)


def filtered(logits, rows, top_k: bool = True):
    """logits [b, V] fp32 over the temperature, with -inf below each row's min_p (scaled_logits),
    outside its top_k best and outside its top_p nucleus (the fewest best tokens whose probability
    after min_p and top_k reaches top_p; min_p first, as vLLM orders them). Both cuts are
    thresholds found by radix select (`_threshold`: no sort); tokens tied at a cut are all kept,
    where a sort would keep the first in its order. top_k False: a static promise that no row sets
    top_k (its search, half the cost, skipped)."""
    v = logits.shape[-1]
    scaled = scaled_logits(logits, rows)                                            # [b, V]
    kept = jnp.ones(scaled.shape, bool)
    if top_k:
        key = jax.lax.optimization_barrier(_order_key(scaled))                    # made once, read by each pass
        k = jnp.where(rows["top_k"] > 0, jnp.minimum(rows["top_k"], v), v)
        kept = key >= _threshold(key, None, k)[:, None]                            # [b, V] the k best
        scaled = jnp.where(kept, scaled, -jnp.inf)
    probs = jax.lax.optimization_barrier(jax.nn.softmax(scaled, axis=-1))         # [b, V] over the k best
    pkey = _order_key(probs)
    nucleus = pkey >= _threshold(pkey, probs, rows["top_p"])[:, None]             # the top_p nucleus
    kept &= nucleus | (rows["top_p"] >= 1.0)[:, None]      # top_p 1: all (fp32 sums may pass 1 early)
    return jnp.where(kept, scaled, -jnp.inf)


def draw_keys(seeds, counters):
    """The PRNG keys [b] of each row's draw of its output token number counters [b]: fold_in(key(seed),
    counter), so a seeded request draws the same tokens however its steps are batched."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


def draw_logits(logits, rows, cut: int = CUT_TOP_K):
    """logits [b, V] over each row's temperature and cut to its min_p, top_k and top_p (-inf outside), as
    the static `cut` promises (CUT_NONE: no row sets min_p, top_p or top_k; CUT_MIN_P: none top_p or
    top_k; CUT_TOP_P: none top_k): the distribution a row's draw takes."""
    return (filtered(logits, rows, top_k=cut >= CUT_TOP_K) if cut >= CUT_TOP_P else
            scaled_logits(logits, rows, min_p=cut >= CUT_MIN_P))


def _draw(logits, rows, counters, cut: int = CUT_TOP_K):
    """One categorical draw per row (Gumbel max: no sort) from draw_logits, keyed by draw_keys."""
    return jax.vmap(jax.random.categorical)(draw_keys(rows["seed"], counters), draw_logits(logits, rows, cut))   # [b]


def all_greedy(rows: dict) -> bool:
    """True when no row samples or penalises (host arrays from row_arrays): argmax is the whole sampler."""
    return not (np.any(np.asarray(rows["temperature"]) > 0) or np.any(np.asarray(rows["penalty"]) != 1.0)
                or np.any(np.asarray(rows["presence"]) != 0) or np.any(np.asarray(rows["frequency"]) != 0))


def cuts(p: SamplingParams) -> int:
    """What a request's draw is cut to: CUT_NONE, CUT_MIN_P, CUT_TOP_P or CUT_TOP_K (a step's programs
    take the largest of its rows')."""
    if p.temperature <= 0:
        return CUT_NONE
    if p.top_k > 0:
        return CUT_TOP_K
    return CUT_TOP_P if p.top_p < 1.0 else (CUT_MIN_P if p.min_p > 0 else CUT_NONE)


def penalised_row(p: SamplingParams) -> bool:
    """Whether a request's logits are changed before its draw (so argmax over the raw ones is not its
    greedy choice): the repetition, presence or frequency penalty, a logit bias, a grammar, allowed or
    banned tokens, or min_tokens."""
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0 or bool(p.logit_bias)
            or p.grammar is not None or p.allowed_token_ids is not None or bool(p.bad_words_ids) or p.min_tokens > 0)


def allowed_bits(allowed, vocab: int):
    """allowed [b, ceil(vocab / 32)] int32 bitmasks (bit t % 32 of word t // 32) -> [b, vocab] bool."""
    ids = jnp.arange(vocab)
    return ((allowed[:, ids // 32] >> (ids % 32)) & 1).astype(bool)


def penalties(logits, rows: dict, counters, seen, counts=None, bias=None, allowed=None):
    """The logits a row's draw (or argmax) sees, sample's arguments as it takes them: tokens outside its
    mask at -inf, its logit bias while its counter is below an entry's until, the repetition penalty on
    seen tokens, the presence and frequency penalties on its counts."""
    pen = logits
    if allowed is not None:
        pen = jnp.where(allowed_bits(allowed, logits.shape[-1]), pen, -jnp.inf)
    if bias is not None:
        ids, values, until = bias_entries(bias)
        values = jnp.where(counters[:, None] < until, values, 0.0)                      # [b, BIAS_WIDTH]
        pen = pen.at[jnp.arange(pen.shape[0])[:, None], ids].add(values, mode="drop")
    pen = _penalise(pen, seen, rows["penalty"])
    if counts is not None:
        pen = pen - rows["frequency"][:, None] * counts - rows["presence"][:, None] * (counts > 0)
    return pen


def sample(logits, rows: dict, counters, seen, greedy: bool | None = None, counts=None, bias=None, allowed=None,
           cut: int = CUT_TOP_K):
    """logits [b, V] fp32 (real vocabulary only); rows: row_arrays on device; counters [b] int32;
    seen [b, V] bool (prompt and output tokens); counts [b, V] int32 (times each token was generated:
    the presence and frequency penalties), or None (no row has them); bias: [b, 3, BIAS_WIDTH] int32
    (bias_row's: an entry applies while the row's counter is below its until), or None;
    allowed: [b, ceil(V / 32)] int32 bitmasks of the tokens a row may take (a grammar's,
    meshlab.infer.guided; all bits set: free), or None. Returns tokens [b] int32. greedy: a static
    promise that `all_greedy(rows)` (True) or not (False) with no row biased or held to a grammar;
    None decides on device (no bias or grammar then). cut: a static promise of the cuts the rows set
    (`cuts`): the draw skips finding the others."""
    def full(_):
        pen = penalties(logits, rows, counters, seen, counts, bias, allowed)
        return jnp.where(rows["temperature"] > 0, _draw(pen, rows, counters, cut), jnp.argmax(pen, axis=-1))

    argmax = lambda _: jnp.argmax(logits, axis=-1)
    if greedy is not None:
        return (argmax if greedy else full)(None).astype(jnp.int32)
    needs_full = jnp.any(rows["temperature"] > 0) | jnp.any(rows["penalty"] != 1.0)
    if counts is not None:
        needs_full = needs_full | jnp.any(rows["presence"] != 0) | jnp.any(rows["frequency"] != 0)
    return jax.lax.cond(needs_full, full, argmax, None).astype(jnp.int32)


def mark_seen(seen, tokens, active=None):
    """Record tokens [b] as seen (for the repetition penalty); rows not active are left alone."""
    b, v = seen.shape
    cols = tokens if active is None else jnp.where(active, tokens, v)
    return seen.at[jnp.arange(b), cols].set(True, mode="drop")


def count_sampled(counts, slots, tokens, keep):
    """counts [max_seqs, V] with counts[slot, token] += 1 for each kept sample (slots, tokens, keep [n])."""
    return counts.at[jnp.where(keep, slots, counts.shape[0]), tokens].add(1, mode="drop")
