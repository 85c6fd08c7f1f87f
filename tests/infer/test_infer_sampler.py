"""Device sampler: greedy, temperature, top-k, top-p, repetition penalty, per-request seeds."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlab.infer.sampler import SamplingParams, row_arrays, sample

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


def test_repetition_penalty_moves_off_seen_token(logits):
    am = int(np.asarray(logits[0]).argmax())
    seen = jnp.zeros((1, V), bool).at[0, am].set(True)
    out = draw(logits[:1], [SamplingParams(repetition_penalty=100.0)], seen=seen)
    assert out[0] != am
    assert draw(logits[:1], [SamplingParams(repetition_penalty=1.0)], seen=seen)[0] == am


@pytest.mark.parametrize("kw,words", [({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"),
                                      ({"top_p": 1.5}, "top_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                                      ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"),
                                      ({"stop": [""]}, "stop")])
def test_bad_values_are_one_clear_error(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw).validate()
