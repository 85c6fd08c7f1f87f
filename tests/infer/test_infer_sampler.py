"""Device sampler: greedy, temperature, top-k, top-p, repetition penalty, per-request seeds."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlab.infer.sampler import (CUT_DIGITS, CUT_MIN_P, CUT_NONE, CUT_TOP_K, CUT_TOP_P, SamplingParams, filtered, row_arrays, sample,
                                   scaled_logits)

V = 50


def draw(logits, params, counters=None, seen=None):
    b = logits.shape[0]
    rows = {k: jnp.asarray(v) for k, v in row_arrays(params).items()}
    counters = jnp.zeros(b, jnp.int32) if counters is None else jnp.asarray(counters)
    seen = jnp.zeros((b, V), bool) if seen is None else seen
    return np.asarray(jax.jit(sample)(logits, rows, counters, seen))


@pytest.fixture(scope="module")
def logits():
    return jnp.asarray(np.random.default_rng(0).normal(size=(4, V)) * 2, jnp.float32)


def test_greedy_and_degenerate_filters_are_argmax(logits):
    am = np.asarray(logits).argmax(-1)
    assert (draw(logits, [SamplingParams()] * 4) == am).all()
    assert (draw(logits, [SamplingParams(temperature=1.0, top_k=1, seed=s) for s in range(4)]) == am).all()
    assert (draw(logits, [SamplingParams(temperature=1.0, top_p=1e-6, seed=s) for s in range(4)]) == am).all()


def test_seeded_and_row_independent(logits):
    sp = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3, 4)]
    a = draw(logits, sp, counters=[5, 5, 5, 5])
    assert (a == draw(logits, sp, counters=[5, 5, 5, 5])).all()
    mixed = [sp[0], SamplingParams(), sp[2], SamplingParams(temperature=0.5, seed=9)]
    b = draw(logits, mixed, counters=[5, 5, 5, 5])      # a row's draw ignores what the others do
    assert b[0] == a[0] and b[2] == a[2] and b[1] == np.asarray(logits)[1].argmax()


def test_top_k_and_top_p_restrict_support(logits):
    row = jnp.broadcast_to(logits[:1], (4, V))
    top3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    got = set()
    for c in range(40):
        got |= set(draw(row, [SamplingParams(temperature=2.0, top_k=3, seed=s) for s in range(4)], [c] * 4).tolist())
    assert got <= top3 and len(got) > 1
    probs = np.asarray(jax.nn.softmax(logits[0]))
    order = np.argsort(-probs)
    nucleus = set(order[:np.searchsorted(np.cumsum(probs[order]), 0.6) + 1].tolist())
    got = set()
    for c in range(40):
        got |= set(draw(row, [SamplingParams(temperature=1.0, top_p=0.6, seed=s) for s in range(4)], [c] * 4).tolist())
    assert got <= nucleus


def sorted_nucleus(row, temperature, top_k, top_p) -> tuple[set, set]:
    """(kept, unsure) by the definition, through a float64 sort: the top_k best, then the fewest of
    those whose renormalised probability reaches top_p. unsure: tokens fp32 rounding may put either
    side (probability below 1e-9, or their mass before within 1e-5 of top_p), never the best."""
    z = row.astype(np.float64) / max(temperature, 1e-6)
    order = np.argsort(-z, kind="stable")[:top_k or len(row)]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    unsure = (p < 1e-9) | (np.abs(before - top_p) < 1e-5)
    unsure[0] = False                                     # the best is always kept
    return set(order[before < top_p].tolist()), set(order[unsure].tolist())


@pytest.mark.parametrize("scale", [0.1, 2.0, 12.0])
def test_thresholds_keep_exactly_the_sorted_nucleus(scale):
    """The radix-select cuts keep the same tokens as a sort over random rows (no ties; only tokens of
    negligible probability or at the top_p boundary's rounding may differ): every mix of temperature,
    top_k (off, 1, a few, all but one) and top_p (off, tiny, middling, near 1)."""
    rng = np.random.default_rng(int(scale * 10))
    v, cases = 777, [(t, k, p) for t in (0.5, 1.0, 1.7) for k in (0, 1, 9, 776) for p in (1.0, 1e-6, 0.5, 0.97)]
    rows = rng.normal(size=(len(cases), v)).astype(np.float32) * scale
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in cases]
    rows_in = {k: jnp.asarray(x) for k, x in row_arrays(params).items()}
    got = np.isfinite(np.asarray(jax.jit(filtered)(jnp.asarray(rows), rows_in)))
    no_k = np.isfinite(np.asarray(jax.jit(filtered, static_argnames="top_k")(jnp.asarray(rows), rows_in, top_k=False)))
    for i, (t, k, p) in enumerate(cases):
        if k == 0:                                       # top_k's search skipped: the same cut
            np.testing.assert_array_equal(no_k[i], got[i])
        want, unsure = sorted_nucleus(rows[i], t, k, p)
        differ = set(np.flatnonzero(got[i]).tolist()) ^ want
        assert differ <= unsure and len(want - unsure) > 0, (scale, t, k, p, differ - unsure)


def test_thresholds_keep_every_tie_and_masked_tokens_stay_out():
    """Tokens tied at a cut are all kept; -inf (a grammar's or a bias's exclusion) is never kept."""
    row = jnp.asarray([[3.0, 1.0, 1.0, 1.0, -jnp.inf, 0.0]], jnp.float32)
    rows = lambda **kw: {k: jnp.asarray(x) for k, x in row_arrays([SamplingParams(temperature=1.0, **kw)]).items()}  # noqa: E731
    assert np.isfinite(np.asarray(filtered(row, rows(top_k=2)))).tolist() == [[True, True, True, True, False, False]]
    assert np.isfinite(np.asarray(filtered(row, rows()))).tolist() == [[True] * 4 + [False, True]]


def test_draws_follow_the_filtered_probabilities():
    """4,000 draws of one row (counters 0..3999) land on each kept token as often as its renormalised
    probability says (within 3 points), and never outside top_p's nucleus."""
    logits = jnp.log(jnp.asarray([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]], jnp.float32))
    n = 4000
    toks = draw(jnp.broadcast_to(logits, (n, 6)), [SamplingParams(temperature=1.0, top_p=0.85, seed=3)] * n,
                counters=np.arange(n), seen=jnp.zeros((n, V), bool)[:, :6])
    freq = np.bincount(toks, minlength=6) / n
    want = np.array([0.4, 0.25, 0.15, 0.1, 0, 0]) / 0.9
    assert np.abs(freq - want).max() < 0.03, freq


@pytest.mark.parametrize("temperature", [0.4, 1.0, 2.5])
def test_min_p_keeps_the_tokens_within_its_fraction_of_the_best(temperature):
    """min_p keeps exactly the tokens whose probability after the temperature is at least min_p times
    the best's (float64 reference; ties with the floor kept), 0 keeps all, 1 only the best; top_k and
    top_p then cut what min_p kept."""
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(5, 300)).astype(np.float32) * 3
    mins = [0.0, 1e-4, 0.05, 0.5, 1.0]
    params = [SamplingParams(temperature=temperature, min_p=m) for m in mins]
    got = np.isfinite(np.asarray(jax.jit(scaled_logits)(jnp.asarray(rows), _device_rows(params))))
    for i, m in enumerate(mins):
        p = np.exp((rows[i].astype(np.float64) - rows[i].max()) / temperature)     # relative to the best
        want = p >= m * (1 - 1e-6) if m else np.ones_like(p, bool)
        sure = np.abs(p - m) > 1e-5 * max(m, 1e-30)                                 # off fp32's boundary
        np.testing.assert_array_equal(got[i][sure], want[sure])
    assert got[0].all() and got[-1].sum() == 1 and got[-1][rows[-1].argmax()]
    both = [SamplingParams(temperature=temperature, min_p=0.05, top_k=3, top_p=0.9)] * 5
    cut = np.isfinite(np.asarray(jax.jit(filtered)(jnp.asarray(rows), _device_rows(both))))
    by_min_p = np.isfinite(np.asarray(scaled_logits(jnp.asarray(rows), _device_rows(both))))
    assert (cut <= by_min_p).all() and (cut.sum(-1) <= 3).all() and (cut.sum(-1) >= 1).all()


def test_min_p_draws_stay_inside_and_min_p_one_is_greedy(logits):
    row = jnp.broadcast_to(logits[:1], (4, V))
    best = float(jax.nn.softmax(logits[0] / 1.5).max())
    allowed = set(np.flatnonzero(np.asarray(jax.nn.softmax(logits[0] / 1.5)) >= 0.2 * best).tolist())
    got = set()
    for c in range(40):
        got |= set(draw(row, [SamplingParams(temperature=1.5, min_p=0.2, seed=s) for s in range(4)], [c] * 4).tolist())
    assert got <= allowed and len(got) > 1
    am = np.asarray(logits).argmax(-1)
    assert (draw(logits, [SamplingParams(temperature=1.0, min_p=1.0, seed=s) for s in range(4)]) == am).all()
    plain = [SamplingParams(temperature=1.0, seed=s) for s in range(4)]
    zero = [SamplingParams(temperature=1.0, min_p=0.0, seed=s) for s in range(4)]
    assert (draw(logits, plain, [3] * 4) == draw(logits, zero, [3] * 4)).all()


def test_min_tokens_holds_the_stop_tokens_until_its_counter():
    """The bias rows' held stop tokens are -inf while a row's counter is below min_tokens, and gone from
    then on; the request's own logit_bias applies throughout."""
    from meshlab.infer.sampler import bias_row
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(1, V)), jnp.float32)
    stop = int(np.asarray(logits).argmax())
    p = SamplingParams(min_tokens=3, stop_token_ids=(stop, stop), logit_bias={7: 50.0})
    bias = jnp.asarray(bias_row(p, V))[None]
    rows = _device_rows([p])
    fn = jax.jit(lambda c: sample(logits, rows, c, jnp.zeros((1, V), bool), greedy=False, bias=bias))
    assert [int(fn(jnp.asarray([c], jnp.int32))[0]) for c in range(5)] == [7, 7, 7, 7, 7]    # the +50 wins
    p = SamplingParams(min_tokens=3, stop_token_ids=(stop,))
    bias = jnp.asarray(bias_row(p, V))[None]
    fn = jax.jit(lambda c: sample(logits, rows, c, jnp.zeros((1, V), bool), greedy=False, bias=bias))
    second = int(np.argsort(-np.asarray(logits[0]))[1])
    assert [int(fn(jnp.asarray([c], jnp.int32))[0]) for c in range(5)] == [second] * 3 + [stop] * 2


def _device_rows(params):
    return {k: jnp.asarray(x) for k, x in row_arrays(params).items()}


def test_repetition_penalty_moves_off_seen_token(logits):
    am = int(np.asarray(logits[0]).argmax())
    seen = jnp.zeros((1, V), bool).at[0, am].set(True)
    out = draw(logits[:1], [SamplingParams(repetition_penalty=100.0)], seen=seen)
    assert out[0] != am
    assert draw(logits[:1], [SamplingParams(repetition_penalty=1.0)], seen=seen)[0] == am


@pytest.mark.parametrize("kw,words", [({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"),
                                      ({"top_p": 1.5}, "top_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                                      ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"),
                                      ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
                                      ({"min_tokens": 20}, "min_tokens"),
                                      ({"min_tokens": 1, "stop_token_ids": tuple(range(17))}, "at most 16"),
                                      ({"stop": [""]}, "stop")])
def test_bad_values_are_one_clear_error(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw).validate()


@pytest.mark.parametrize("cut,cuts", [(CUT_NONE, 0), (CUT_MIN_P, 0), (CUT_TOP_P, 1), (CUT_TOP_K, 2)])
def test_sampled_programs_sort_nothing(logits, cut, cuts):
    """No sampled program sorts the vocabulary (a [b, V] sort cost 2.0 ms a step at 128 rows on the
    H200, the Gumbel draw 0.15 and the radix-select cuts 1.4): the compiled HLO has no sort, the
    cuts' passes (one variadic reduction of 2**CUT_DIGITS - 1 sums each, 32 / CUT_DIGITS a cut) are
    there as `cut` says, and min_p's row maxima only where `cut` asks for its floor."""
    rows = {k: jnp.asarray(x) for k, x in row_arrays([SamplingParams(temperature=1.0, top_p=0.9)] * 4).items()}
    fn = jax.jit(lambda l, r, c, s: sample(l, r, c, s, greedy=False, cut=cut))
    hlo = fn.lower(logits, rows, jnp.zeros(4, jnp.int32), jnp.zeros((4, V), bool)).compile().as_text()
    assert " sort(" not in hlo and " reduce(" in hlo
    widths = [m.count("[") for m in re.findall(r"= \(([^)]*)\) reduce\(", hlo)]         # each tuple reduction's sums
    assert widths.count(2 ** CUT_DIGITS - 1) == cuts * 32 // CUT_DIGITS, widths
    maxima = sum("reduce_max" in line for line in hlo.splitlines() if " reduce(" in line)
    assert (maxima == 0) if cut == CUT_NONE else (maxima >= 1), maxima
